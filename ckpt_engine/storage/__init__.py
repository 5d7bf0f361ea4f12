"""Where checkpoint bytes go: one contract (:class:`Storage`), two implementations, one factory.

* :mod:`.base` — the contract the engine uses (write, read, list, remove, the error and retry
  hook) and what both implementations share.
* :mod:`.open` — :func:`open_storage`: the implementation for a URL.
* :mod:`.local` — :class:`LocalStorage`, this machine's files through ``os``: ``O_DIRECT``
  writes, fsync of files and directories, regular-file checks before reading.
* :mod:`.fsspec_storage` — :class:`FsspecStorage`, every other fsspec URL (object stores,
  ``memory://``): multipart uploads abandoned on failure, retries, listing caches bypassed.
* :mod:`.wrapper` — :class:`StorageWrapper`, a storage that passes every operation to another: the
  base of the test doubles (:mod:`ckpt_engine.testing`) and of a user's own fault injection.
* :mod:`.poll` — how often waits poll each kind of storage; :mod:`.retry` — which errors are
  transient and the backoff between retries.
"""

from .base import Reader, Storage
from .fsspec_storage import FsspecStorage
from .local import LocalStorage
from .open import open_storage
from .wrapper import StorageWrapper

__all__ = ["FsspecStorage", "LocalStorage", "Reader", "Storage", "StorageWrapper", "open_storage"]
