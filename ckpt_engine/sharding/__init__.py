"""Sharded state (``DTensor``: FSDP2, HSDP, tensor parallel), the engine's third kind of state.

* :mod:`.boxes`: pure geometry of chunks (half-open index ranges per dimension);
* :mod:`.dtensors`: what a ``DTensor`` is on this rank (its chunk, its replicas), for saving and
  for loading into one;
* :mod:`.fill`: ``load(into=...)``: which stored pieces each target needs, and copying them in.
"""
