"""The storage contract: a handful of operations on a checkpoint root, over fsspec.

Why a wrapper and not fsspec directly: the commit protocol needs a few guarantees that differ per
backend and are worth stating once.

* ``write_stream``: the bytes are durable when it returns (local: ``fsync`` of file and
  directory; object stores: the upload completed).
* ``write_atomic``: readers see the old content or the new, never a part (local: temp file,
  fsync, ``rename``, fsync of the directory; object stores: one PUT, atomic by the protocol).
* every existence check and listing is fresh (fsspec's listing caches are invalidated first),
  because the committer polls for files other processes write.

Local paths take a direct ``os`` path (one ``write`` per buffer, ``preadv`` into the destination)
since that is where the physical limits are reached; everything else goes through fsspec.
Every failure is raised as :class:`StorageError` naming the path.
"""

from __future__ import annotations

import errno
import fcntl
import collections.abc
import contextlib
import os
import posixpath
import uuid
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ..format import guard
from ..errors import CheckpointError, CheckpointWarning, StorageError
from .retry import is_not_implemented, retrying

T = TypeVar("T")

_TMP_PREFIX = ".tmp-"
_OBJECT_BLOCK = 64 << 20
_NO_DIRECTORIES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "adl"}
_NO_UPLOAD_LISTING: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Filesystems (equal when URL options are) whose server answered 501 to ListMultipartUploads."""


class Storage:
    """A checkpoint root directory (``/dir``, ``file:///dir``, ``memory://x``, ``s3://b/p`` ...).

    ``retry_deadline``: seconds to keep retrying transient errors on remote filesystems.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 retry_deadline: float = 60.0) -> None:
        try:
            self.fs, root = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
        except ImportError as e:
            raise StorageError(f"cannot open checkpoint path {url!r}: {e}; install the fsspec backend for it "
                               "(for s3://: pip install 'ckpt-suite[s3]')") from e
        except ValueError as e:
            raise StorageError(f"cannot open checkpoint path {url!r}: {e}") from e
        self.url = str(url)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")
        protocol = self.fs.protocol
        self.protocol = protocol if isinstance(protocol, str) else protocol[0]
        self.retry_deadline = retry_deadline
        self.direct_io = self.local and _DIRECT_FLAG != 0 and os.environ.get("CKPT_DIRECT_IO", "1") != "0"
        """Large page-aligned local writes bypass the page cache (``O_DIRECT``): see :func:`_write_direct`."""

    # ---- naming -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """Absolute path (in the filesystem's terms) of ``parts`` below the root."""
        return os.path.join(self.root, *parts) if self.local else posixpath.join(self.root, *parts).rstrip("/")

    def describe(self, *parts: str) -> str:
        """A path for messages: URL-like, so users can paste it (never credentials)."""
        return self.path(*parts) if self.local else f"{self.protocol}://{self.path(*parts)}"

    # ---- writing ------------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        """Create directory ``rel`` (a no-op on object stores, which have no directories)."""
        if self.local:
            self._run("create directory", rel, lambda: os.makedirs(self.path(rel), exist_ok=True))
        elif self.protocol not in _NO_DIRECTORIES:
            self._run("create directory", rel, lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def write_stream(self, rel: str, chunks: Sequence[memoryview | bytes] | Iterable[memoryview | bytes],
                     *, sync_dir: bool = True) -> int:
        """Write ``chunks`` to file ``rel``; durable when this returns. Returns the byte count.

        ``sync_dir=False`` leaves the directory entry to a later ``write_atomic`` in the same
        directory (its directory fsync covers both): one fsync fewer per file on local disks.

        ``chunks`` that is neither a sequence nor an iterator (an iterable whose every ``iter()``
        is a fresh pass, such as a copy streamed from another storage) is consumed lazily, one
        chunk in memory at a time, and iterated again on a retry.

        On object stores a large file goes up as a multipart upload (S3) or staged blocks (Azure),
        in parts of ``_OBJECT_BLOCK``, completed only at the end, so neither a crash nor a failed
        write leaves a visible partial object.
        """
        if self.local:
            return self._run("write", rel, lambda: self._write_local(rel, chunks, sync_dir))
        if isinstance(chunks, collections.abc.Iterator):
            chunks = list(chunks)  # a retry writes them again

        def write() -> int:
            written = 0
            f = self.fs.open(self.path(rel), "wb", block_size=_OBJECT_BLOCK)
            try:
                for chunk in chunks:
                    f.write(chunk)
                    written += len(chunk)
            except BaseException:
                _abandon(f)
                raise
            f.close()
            return written

        return self._run("write", rel, write)

    def _write_local(self, rel: str, chunks: Iterable[memoryview | bytes], sync_dir: bool) -> int:
        streamed = not isinstance(chunks, collections.abc.Sequence)  # a stream stays lazy: one chunk in memory
        chunks = chunks if streamed else list(chunks)
        written = None
        single = not streamed and len(chunks) == 1  # type: ignore[arg-type]
        if single and self.direct_io and _direct_eligible(chunks[0]):  # type: ignore[index]
            written = _write_direct(self.path(rel), memoryview(chunks[0]).cast("B"))
            if written is None:  # this filesystem refuses O_DIRECT (tmpfs, some FUSE): stop trying
                self.direct_io = False
        if written is None:
            written = 0
            fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for chunk in chunks:
                    written += _write_all(fd, chunk)
                os.fsync(fd)
            finally:
                os.close(fd)
        if sync_dir:
            _fsync_dir(os.path.dirname(self.path(rel)))
        return written

    def write_atomic(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        """Replace file ``rel`` with ``data`` so that readers never see a partial file.

        ``durable=False`` (hints such as ``latest``) keeps the atomic rename but skips the fsyncs.
        """
        if not self.local:
            self._run("write", rel, lambda: self.fs.pipe_file(self.path(rel), data))
            return
        final = self.path(rel)
        tmp = os.path.join(os.path.dirname(final), f"{_TMP_PREFIX}{uuid.uuid4().hex}-{os.path.basename(final)}")
        try:
            self._run("write", rel, lambda: _write_file(tmp, data, durable))
            self._run("rename", rel, lambda: os.replace(tmp, final))
        except BaseException:
            _unlink_quiet(tmp)
            raise
        if durable:
            self._run("sync directory of", rel, lambda: _fsync_dir(os.path.dirname(final)))

    def remove(self, rel: str) -> None:
        """Delete file or directory tree ``rel``; a missing one is not an error."""
        def rm() -> None:
            try:
                self.fs.rm(self.path(rel), recursive=True)
            except FileNotFoundError:
                pass

        self._run("remove", rel, rm)

    def abort_uploads(self) -> list[str]:
        """Abort unfinished multipart uploads below the root (crashed writers leave them billed
        and invisible). Object stores that have them only; returns the keys aborted."""
        if self.protocol not in ("s3", "s3a") or self.fs in _NO_UPLOAD_LISTING:
            return []
        bucket, _, prefix = self.root.partition("/")
        try:
            uploads = self._run("list uploads of", "", lambda: self.fs.list_multipart_uploads(bucket))
        except StorageError as e:
            if not is_not_implemented(e):
                raise
            self._skip_upload_cleanup(bucket)
            return []
        aborted = []
        for up in uploads:
            key = up.get("Key", "")
            if key.startswith(prefix.rstrip("/") + "/" if prefix else ""):
                self._run("abort upload of", key, lambda up=up: self.fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"]))
                aborted.append(key)
        return aborted

    def _skip_upload_cleanup(self, bucket: str) -> None:
        """The server lacks ListMultipartUploads (s3rver says 501): an optional cleanup, so skip it.

        Remembered per filesystem object, so the same store is neither asked nor warned about
        again in this process: retrying would only delay every writable start.
        """
        _NO_UPLOAD_LISTING.add(self.fs)
        warnings.warn(f"{self.protocol}://{bucket}: the server does not implement ListMultipartUploads (HTTP 501 "
                      "NotImplemented), so unfinished multipart uploads of crashed runs are not aborted at start; "
                      "they stay invisible but may use space: remove them with the store's own tools or a "
                      "lifecycle rule", CheckpointWarning, stacklevel=4)

    # ---- reading ------------------------------------------------------------------------------
    def read_bytes(self, rel: str, limit: int = guard.MAX_METADATA_BYTES) -> bytes:
        """Whole content of regular file ``rel``, at most ``limit`` bytes (metadata files only).

        A FIFO, a device, a symbolic link below the root or a larger file is refused with a
        :class:`FormatError` naming it, before anything is read (see :mod:`guard`).
        """
        where = self.describe(rel)
        if self.local:
            return self._run("read", rel, lambda: guard.read_regular(self.root, rel, limit, where))
        return self._run("read", rel,
                         lambda: self._fresh(rel) or guard.read_object(self.fs, self.path(rel), limit, where))

    def regular_size(self, rel: str) -> int | None:
        """Size of regular file ``rel``, ``None`` if missing; :class:`FormatError` for anything a
        reader must not open (a FIFO, a device, a symbolic link below the root, a directory)."""
        where = self.describe(rel)
        if self.local:
            return self._run("stat", rel, lambda: guard.regular_size(self.root, rel, where))
        return self._run("stat", rel, lambda: self._fresh(rel) or guard.object_size(self.fs, self.path(rel), where))

    def reader(self, rel: str) -> "Reader":
        """An open file for ranged reads into caller-provided memory (close it, or use ``with``)."""
        return Reader(self, rel)

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists now (listing caches bypassed)."""
        if self.local:
            return os.path.exists(self.path(rel))
        return self._run("check", rel, lambda: self._fresh(rel) or self.fs.exists(self.path(rel)))

    def size(self, rel: str) -> int | None:
        """Size of file ``rel`` in bytes, or ``None`` if it does not exist."""
        def stat() -> int | None:
            try:
                if self.local:
                    return os.stat(self.path(rel)).st_size
                self._fresh(rel)
                return int(self.fs.size(self.path(rel)))
            except FileNotFoundError:
                return None

        return self._run("stat", rel, stat)

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly below ``rel``, fresh; empty when it does not exist."""
        full = self.path(rel) if rel else self.root

        def ls() -> list[str]:
            try:
                if self.local:
                    return sorted(os.listdir(full))
                self.fs.invalidate_cache(full)
                return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(full, detail=False))
            except FileNotFoundError:
                return []

        return self._run("list", rel, ls)

    def stale_temp_files(self, rel: str = "") -> Iterator[str]:
        """Temporary files a crashed ``write_atomic`` left in ``rel``."""
        for name in self.listdir(rel):
            if name.startswith(_TMP_PREFIX):
                yield posixpath.join(rel, name) if rel else name

    def _fresh(self, rel: str) -> bool:
        """Drop fsspec's cached listing of ``rel``'s directory (s3fs caches listings)."""
        self.fs.invalidate_cache(posixpath.dirname(self.path(rel)))
        return False

    def _run(self, action: str, rel: str, fn: Callable[[], T]) -> T:
        """``fn()``; retried while transient on remote filesystems; errors become StorageError."""
        with _StorageErrors(action, self.describe(rel)):
            return fn() if self.local else retrying(fn, self.retry_deadline)


class Reader:
    """Ranged reads of one file straight into destination memory.

    Local files: one descriptor, ``preadv`` into the destination (no intermediate copy, GIL
    released). Other filesystems: one ranged request per read.
    """

    def __init__(self, storage: Storage, rel: str) -> None:
        self._storage, self._rel = storage, rel
        self._fd: int | None = None
        if storage.local:
            where = storage.describe(rel)  # regular files only, no link below the root (see guard)
            self._fd = storage._run("open", rel, lambda: guard.open_regular(storage.root, rel, where))

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with the bytes at ``offset``; a short file is an error naming it."""
        def read() -> None:
            got = 0
            if self._fd is not None:
                while got < len(dest):
                    n = os.preadv(self._fd, [dest[got:]], offset + got)
                    if n == 0:
                        break
                    got += n
            else:
                data = self._storage.fs.cat_file(self._storage.path(self._rel), start=offset, end=offset + len(dest))
                got = len(data)
                dest[:got] = data
            if got != len(dest):
                raise EOFError(f"file ends after {offset + got} bytes, {offset + len(dest)} expected")

        self._storage._run("read", self._rel, read)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _write_all(fd: int, chunk: memoryview | bytes) -> int:
    view = memoryview(chunk).cast("B")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return done


_DIRECT_FLAG = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGN = 4096    # covers 512-byte and 4 KiB logical blocks
_DIRECT_MIN = 1 << 20   # below this the page cache costs little and direct I/O gains nothing
_DIRECT_CHUNK = 64 << 20


def _direct_eligible(chunk: memoryview | bytes) -> bool:
    view = memoryview(chunk)
    if view.nbytes < _DIRECT_MIN or not view.c_contiguous:
        return False
    return np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data % _DIRECT_ALIGN == 0


def _write_direct(path: str, view: memoryview) -> int | None:
    """Write ``view`` (page-aligned) to ``path`` with ``O_DIRECT``, fsync; ``None`` if refused.

    Why: a buffered write of a large checkpoint copies every byte into the page cache, and on a
    machine whose cores train, that copy (about 2.5 ms of CPU per MB on this project's CI VMs, 50x
    the direct write's cost) is what slows training beside a background persist. The block-aligned
    head goes out directly from the snapshot buffer; the unaligned tail (under 4 KiB) through the
    page cache on the same descriptor once ``O_DIRECT`` is cleared. Returns ``None`` only when the
    filesystem refuses direct I/O before anything was written, so the caller can write normally.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _DIRECT_FLAG, 0o644)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    try:
        n = view.nbytes
        head = n - n % _DIRECT_ALIGN
        done = 0
        while done < head and done % _DIRECT_ALIGN == 0:
            try:
                done += os.write(fd, view[done:min(head, done + _DIRECT_CHUNK)])
            except OSError as e:
                if e.errno == errno.EINVAL and done == 0:
                    return None
                raise
        if done < n:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_DIRECT_FLAG)
            done += _write_all(fd, view[done:])
        os.fsync(fd)
        return done
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes, durable: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _abandon(f: Any) -> None:
    """Close an object-store file whose writing failed, without completing the upload.

    fsspec's ``close()`` (which ``with`` calls, error or not) completes a write, so a failure
    mid-file would make the bytes written so far visible as the whole object. ``discard()`` aborts
    what the backend started (s3fs: the multipart upload; blocks adlfs staged are never committed
    and Azure drops them); ``forced`` tells ``close()`` that the final flush is done.
    """
    with contextlib.suppress(Exception):  # the write's own error is the one to report
        f.discard()
    f.forced = True
    with contextlib.suppress(Exception):
        f.close()


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
