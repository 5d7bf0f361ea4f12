"""The storage contract: what the engine asks of a checkpoint root, and what both implementations share.

:func:`~.open.open_storage` opens a URL with fsspec and returns the implementation for it:
:class:`~.local.LocalStorage` for this machine's files, :class:`~.fsspec_storage.FsspecStorage` for
everything else. :class:`Storage` is an ordinary abstract base: ``isinstance(x, Storage)`` is how a level
given as an object is told from a URL, and a backend of your own subclasses it (and runs
:mod:`ckpt_engine.testing.storage_contract`). What changes how another storage behaves (the doubles of
:mod:`ckpt_engine.testing`, a user's own fault injection) wraps it: :class:`~.wrapper.StorageWrapper`.

``Storage(url, storage_options)``, the way to open a root before ``open_storage``, still works for one
release: it warns (``DeprecationWarning``) and returns ``open_storage(url, storage_options)``.

Guarantees of every implementation:

* ``write_stream``: the bytes are durable when it returns.
* ``write_atomic``: readers see the old content or the new, never a part.
* every existence check and listing is fresh, because the committer polls for files other
  processes write (how often: ``polling``, see :mod:`.poll`).
* every failure is raised as :class:`StorageError` naming the action and the path (:meth:`run`).
"""

from __future__ import annotations

import abc
import posixpath
import uuid
import warnings
from typing import Any, Callable, ClassVar, Iterable, Iterator, Sequence, TypeVar

import fsspec

from ..errors import CheckpointError, StorageError
from . import guard
from .poll import Polling

T = TypeVar("T")

TMP_PREFIX = ".tmp-"
"""Name prefix of the temporary files ``write_atomic`` renames into place."""


def temp_name(rel: str) -> str:
    """A fresh name for the temporary file that ``write_atomic`` of ``rel`` renames into place (beside it)."""
    folder, name = posixpath.split(rel)
    return posixpath.join(folder, f"{TMP_PREFIX}{uuid.uuid4().hex}-{name}")


Chunks = Sequence[memoryview | bytes] | Iterable[memoryview | bytes]

_opener: Callable[..., "Storage"] | None = None
""":func:`~.open.open_storage`, put here by :mod:`.open` (which imports the implementations, which import
this module, so this one cannot import it): what the deprecated ``Storage(url)`` calls."""


class Storage(abc.ABC):
    """A checkpoint root directory (``/dir``, ``file:///dir``, ``memory://x``, ``s3://b/p`` ...).

    ``storage_options``: fsspec options of the URL's filesystem. ``retry_deadline``: seconds to
    keep retrying transient errors on remote filesystems. Paths given to the methods (``rel``)
    are relative to the root, ``/``-separated; ``""`` is the root itself. Methods may be called
    from any thread.
    """

    polling: ClassVar[Polling]
    """How often waits poll this storage (:mod:`.poll`)."""
    can_append: ClassVar[bool] = False
    """Whether :meth:`append` works here (object stores have no append)."""
    in_memory: bool = False
    """The files live in the node's memory (a memory level's tmpfs, set by ``levels/open.py``): a
    reader may map them instead of copying them out (:meth:`Reader.mapped`)."""

    url: str
    """The URL this storage was opened with (a :meth:`child`'s extended by its name)."""
    protocol: str
    """The filesystem's protocol (``file``, ``memory``, ``s3``...)."""
    retry_deadline: float

    def __new__(cls, *args: Any, **kwargs: Any) -> "Storage":
        if cls is Storage:  # the spelling before open_storage: kept one release
            warnings.warn("Storage(url) is deprecated; use ckpt_engine.open_storage(url, storage_options)",
                          DeprecationWarning, stacklevel=2)
            assert _opener is not None, "ckpt_engine.storage.open sets it when the package is imported"
            return _opener(*args, **kwargs)  # Python then runs its __init__ again: opened again, same state
        if cls.__abstractmethods__:
            raise TypeError(f"{cls.__name__} subclasses Storage without implementing "
                            f"{sorted(cls.__abstractmethods__)}: to change how a real storage behaves (a fault "
                            f"injected), subclass ckpt_engine.StorageWrapper and give it the storage "
                            f"({cls.__name__}(open_storage(url))); for a backend of your own, implement those methods")
        return super().__new__(cls)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 retry_deadline: float = 60.0) -> None:
        """Open ``url`` with this implementation (:func:`~.open.open_storage` picks the one for the URL)."""
        self._setup(str(url), *open_url(url, storage_options), retry_deadline)

    def _setup(self, url: str, fs: Any, root: str, retry_deadline: float) -> None:
        """Take the URL and its opened filesystem and root (:func:`~.open.open_storage` opens it once)."""
        self.url = url
        self.protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.retry_deadline = retry_deadline
        self._attach(fs, root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _attach(self, fs: Any, root: str) -> None:
        """Take the opened filesystem and root (in its terms); refuse one this class cannot serve.
        Implementations opened from a URL by :meth:`__init__` define it."""
        raise NotImplementedError(f"{type(self).__name__} opens no URL: override __init__, or define _attach")

    # ---- naming -------------------------------------------------------------------------------
    @abc.abstractmethod
    def path(self, *parts: str) -> str:
        """Absolute path (in the filesystem's terms) of ``parts`` below the root."""

    def describe(self, *parts: str) -> str:
        """A path for messages: URL-like, so users can paste it (never credentials)."""
        return f"{self.protocol}://{self.path(*parts)}"

    def child(self, name: str) -> "Storage":
        """The same storage (same class and settings, same filesystem client) rooted at ``name``
        below this root: a rank's own subtree of a node-local level."""
        sub = object.__new__(type(self))
        sub.__dict__.update(self.__dict__)
        sub._reroot(self.path(name))
        sub.url = f"{self.url.rstrip('/')}/{name}"
        return sub

    def _reroot(self, root: str) -> None:
        """Make ``root`` (a :meth:`path` of the old root) this storage's root; what :meth:`child` needs of
        an implementation (one that cannot be rerooted overrides :meth:`child` instead)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be rerooted: override child, or define _reroot")

    # ---- writing ------------------------------------------------------------------------------
    @abc.abstractmethod
    def makedirs(self, rel: str) -> None:
        """Create directory ``rel`` and its parents (a no-op where there are no directories).

        ``rel=""`` creates the root; a root that exists as something else than a directory is
        a :class:`StorageError` saying so.
        """

    @abc.abstractmethod
    def write_stream(self, rel: str, chunks: Chunks, *, sync_dir: bool = True) -> int:
        """Write ``chunks`` to file ``rel``; durable when this returns. Returns the byte count.

        ``sync_dir=False`` leaves the directory entry to a later ``write_atomic`` in the same
        directory (its directory sync covers both): one fsync fewer per file on local disks.

        ``chunks`` that is neither a sequence nor an iterator (an iterable whose every ``iter()``
        is a fresh pass, such as a copy streamed from another storage) is consumed lazily, one
        chunk in memory at a time where the backend allows, and iterated again on a retry.
        A failed write never leaves a complete-looking file.
        """

    @abc.abstractmethod
    def write_atomic(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        """Replace file ``rel`` with ``data`` so that readers never see a partial file.

        ``durable=False`` (hints such as ``latest``) may skip the syncs, never the atomicity.
        """

    def append(self, rel: str, data: bytes) -> None:
        """Append ``data`` to file ``rel`` (created when missing); only where :attr:`can_append`."""
        raise StorageError(f"cannot append to {self.describe(rel)}: {self.protocol}:// has no append; "
                           "write one file per record there")

    @abc.abstractmethod
    def remove(self, rel: str) -> None:
        """Delete file or directory tree ``rel``; a missing one is not an error."""

    def abort_uploads(self) -> list[str]:
        """Abort unfinished multipart uploads below the root (crashed writers leave them billed
        and invisible). Object stores that have them only; returns the keys aborted."""
        return []

    # ---- reading ------------------------------------------------------------------------------
    @abc.abstractmethod
    def read_bytes(self, rel: str, limit: int = guard.MAX_METADATA_BYTES) -> bytes:
        """Whole content of regular file ``rel``, at most ``limit`` bytes (metadata files only).

        A FIFO, a device, a symbolic link below the root or a larger file is refused with a
        :class:`FormatError` naming it, before anything is read (see :mod:`guard`).
        """

    @abc.abstractmethod
    def regular_size(self, rel: str) -> int | None:
        """Size of regular file ``rel``, ``None`` if missing; :class:`FormatError` for anything a
        reader must not open (a FIFO, a device, a symbolic link below the root, a directory)."""

    @abc.abstractmethod
    def reader(self, rel: str) -> "Reader":
        """An open file for ranged reads into caller-provided memory (close it, or use ``with``)."""

    @abc.abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists now (listing caches bypassed)."""

    @abc.abstractmethod
    def size(self, rel: str) -> int | None:
        """Size of file ``rel`` in bytes, or ``None`` if it does not exist."""

    @abc.abstractmethod
    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly below ``rel``, fresh, sorted; empty when it does not exist."""

    @abc.abstractmethod
    def entries(self, rel: str = "") -> list[tuple[str, str]]:
        """``(name, what it is)`` of each entry directly below ``rel``, fresh, sorted by name.

        What it is, as messages name it: ``"a directory"``, ``"a file"``, and on local storage
        also ``"a symbolic link"``, ``"a FIFO"``... (links not followed). An entry that vanishes
        while it is looked at is left out.
        """

    @abc.abstractmethod
    def usage(self, rel: str) -> tuple[int, float | None]:
        """``(bytes, newest modification time or None)`` of the files below ``rel`` (or of file
        ``rel``), fresh; ``(0, None)`` when it does not exist. An empty local directory counts
        its own time (a save may just have created it)."""

    def free_bytes(self) -> int | None:
        """Bytes this process may still write at the root, ``None`` where that is unknown."""
        return None

    def stale_temp_files(self, rel: str = "") -> Iterator[str]:
        """Temporary files a crashed ``write_atomic`` left in ``rel``."""
        for name in self.listdir(rel):
            if name.startswith(TMP_PREFIX):
                yield posixpath.join(rel, name) if rel else name

    # ---- the hook every operation goes through ------------------------------------------------
    def run(self, action: str, rel: str, fn: Callable[[], T]) -> T:
        """``fn()`` as one storage operation on ``rel``: errors become :class:`StorageError`
        ("could not <action> <path>: ..."); remote implementations retry transient ones.

        Every method above runs its backend calls through this, so an override (a test double
        that injects a fault) fails the way a real backend error would.
        """
        with _StorageErrors(action, self.describe(rel)):
            return fn()


COALESCE_MAX = 16 << 20
"""Largest span a scatter read fetches as one request through a temporary (:meth:`Reader.read_many`)."""


class Reader(abc.ABC):
    """Ranged reads of one file straight into destination memory; from :meth:`Storage.reader`."""

    run_max: int = COALESCE_MAX
    """The most bytes a restore asks of one :meth:`read_many` (neighbouring pieces together)."""

    verify_step: int | None = None
    """The most bytes a restore asks of one request when it verifies while reading: each step's
    checksum is updated right after the step lands, while its bytes are still in the core's cache.
    ``None``: one request per run (where each request costs a round trip, as on object stores)."""

    def __init__(self, storage: Storage, rel: str) -> None:
        self._storage, self._rel = storage, rel

    @abc.abstractmethod
    def _read(self, offset: int, dest: memoryview) -> int:
        """Fill as much of ``dest`` as the file has at ``offset``; the byte count."""

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with the bytes at ``offset``; a short file is an error naming it."""
        self.read_many(offset, [dest])

    def read_many(self, offset: int, dests: Sequence[memoryview]) -> None:
        """Fill ``dests`` with the consecutive bytes from ``offset`` on (a scatter read), in one
        request where the backend allows: a restore reads a piece and its padding, or a run of
        small pieces, together. A short file is an error naming it."""
        self.read_steps(offset, [dests], _nothing)

    def read_steps(self, offset: int, requests: Sequence[Sequence[memoryview]],
                   landed: Callable[[int], None]) -> None:
        """Fill the buffers of ``requests`` with the consecutive bytes from ``offset`` on, one
        request (a :meth:`read_many`) after the other, calling ``landed(i)`` as soon as request
        ``i`` is in: a restore hashes its bytes there, while they are in the core's cache.

        One storage operation for all of them (a request costs a ``preadv`` and no more: the
        per-request error handling of 1,024 requests per GiB cost about as much as hashing them);
        a retried operation resumes at the first request not yet landed, so ``landed`` sees each
        request once. A short file is an error naming it.
        """
        done, at = 0, offset

        def read() -> None:
            nonlocal done, at
            while done < len(requests):
                dests = requests[done]
                want = sum(len(d) for d in dests)
                got = self._read(at, dests[0]) if len(dests) == 1 else self._read_many(at, dests)
                if got != want:
                    raise EOFError(f"file ends after {at + got} bytes, {at + want} expected")
                landed(done)
                done, at = done + 1, at + want

        self._storage.run("read", self._rel, read)

    def _read_many(self, offset: int, dests: Sequence[memoryview]) -> int:
        """Backends without scatter reads: one request for the whole span into a temporary when it
        is at most :data:`COALESCE_MAX` bytes (copied out; on an object store a GET costs more than
        that copy), else each buffer by itself. The byte count."""
        total = sum(len(d) for d in dests)
        if total > COALESCE_MAX:
            got = 0
            for d in dests:
                n = self._read(offset + got, d)
                got += n
                if n < len(d):
                    break
            return got
        return self._read_span(offset, dests)

    def _read_span(self, offset: int, dests: Sequence[memoryview]) -> int:
        """One read of the whole span into a temporary, copied out into ``dests``; the byte count."""
        span = memoryview(bytearray(sum(len(d) for d in dests)))
        got = self._read(offset, span)
        at = 0
        for d in dests:
            d[:] = span[at:at + len(d)]
            at += len(d)
        return got

    def mapped(self) -> memoryview | None:
        """The whole file as read-only memory, valid until :meth:`close`, where the storage keeps
        its files in memory (:attr:`Storage.in_memory`); ``None`` elsewhere (read it instead)."""
        return None

    def close(self) -> None:
        """Release the file (idempotent)."""

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nothing(_: int) -> None:
    pass


class _StorageErrors:
    """Turn backend exceptions into :class:`StorageError` naming the action and path."""

    def __init__(self, action: str, where: str) -> None:
        self.action, self.where = action, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
            return
        if isinstance(exc, FileNotFoundError) and self.action in ("stat", "list"):
            return
        raise StorageError(f"could not {self.action} {self.where}: {type(exc).__name__}: {exc}") from exc


def open_url(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """``(fsspec filesystem, root in its terms)`` of ``url``; a :class:`StorageError` saying what to install."""
    try:
        return fsspec.core.url_to_fs(str(url), **(storage_options or {}))  # type: ignore[no-any-return]
    except ImportError as e:
        raise StorageError(f"cannot open checkpoint path {url!r}: {e}; install the fsspec backend for it "
                           "(for s3://: pip install 'ckpt-suite[s3]')") from e
    except ValueError as e:
        raise StorageError(f"cannot open checkpoint path {url!r}: {e}") from e
