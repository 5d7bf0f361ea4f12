"""What a checkpoint is on storage (docs/FORMAT.md): the manifest and rank indexes
(:mod:`.manifest`), directory names and listings (:mod:`.catalog`), and the guards every reader
applies to metadata it did not write (:mod:`.strict_json`, :mod:`.validate`; the limits on what a
storage reads: storage/guard.py)."""
