"""Where checkpoint bytes go: one contract (:class:`Storage`), two implementations.

* :mod:`.base` — the contract the engine uses (write, read, list, remove, the error and retry
  hook) and what both implementations share; ``Storage(url)`` returns the implementation for
  the URL (why ``__new__`` and not a factory: see there).
* :mod:`.local` — :class:`LocalStorage`, this machine's files through ``os``: ``O_DIRECT``
  writes, fsync of files and directories, regular-file checks before reading.
* :mod:`.fsspec_storage` — :class:`FsspecStorage`, every other fsspec URL (object stores,
  ``memory://``): multipart uploads abandoned on failure, retries, listing caches bypassed.
* :mod:`.poll` — how often waits poll each kind of storage; :mod:`.retry` — which errors are
  transient and the backoff between retries.
"""

from .base import Reader, Storage
from .fsspec_storage import FsspecStorage
from .local import LocalStorage

__all__ = ["FsspecStorage", "LocalStorage", "Reader", "Storage"]
