"""Sharded state (``DTensor``: FSDP2, HSDP, tensor parallel), the engine's third kind of state.

* :mod:`.boxes`: pure geometry of chunks (half-open index ranges per dimension);
* :mod:`.dtensors`: what a ``DTensor`` is on this rank (its chunk, its replicas), for saving and
  for loading into one;
* ``load(into=...)`` of a ``DTensor`` (which stored pieces its region needs, copied in) is the load
  path's: load/into.py.
"""
