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

import os
import posixpath
import uuid
from typing import Any, Iterable, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import StorageError

_TMP_PREFIX = ".tmp-"
_OBJECT_BLOCK = 64 << 20


class Storage:
    """A checkpoint root directory (``/dir``, ``file:///dir``, ``memory://x``, ``s3://b/p`` ...)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        try:
            self.fs, root = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise StorageError(f"cannot open checkpoint path {url!r}: {e}") from e
        self.url = str(url)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")
        protocol = self.fs.protocol
        self.protocol = protocol if isinstance(protocol, str) else protocol[0]

    # ---- naming -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """Absolute path (in the filesystem's terms) of ``parts`` below the root."""
        return posixpath.join(self.root, *parts) if not self.local else os.path.join(self.root, *parts)

    def describe(self, *parts: str) -> str:
        """A path for messages: URL-like, so users can paste it."""
        return self.path(*parts) if self.local else f"{self.protocol}://{self.path(*parts)}"

    # ---- writing ------------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        """Create directory ``rel`` (a no-op on object stores, which have no directories)."""
        with self._errors("create directory", rel):
            if self.local:
                os.makedirs(self.path(rel), exist_ok=True)
            else:
                self.fs.makedirs(self.path(rel), exist_ok=True)

    def write_stream(self, rel: str, chunks: Iterable[memoryview | bytes]) -> int:
        """Write ``chunks`` to file ``rel``; durable when this returns. Returns the byte count."""
        written = 0
        with self._errors("write", rel):
            if self.local:
                fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    for chunk in chunks:
                        written += _write_all(fd, chunk)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                _fsync_dir(os.path.dirname(self.path(rel)))
                return written
            with self.fs.open(self.path(rel), "wb", block_size=_OBJECT_BLOCK) as f:
                for chunk in chunks:
                    f.write(chunk)
                    written += len(chunk)
        return written

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Replace file ``rel`` with ``data`` so that readers never see a partial file."""
        with self._errors("write", rel):
            if not self.local:
                self.fs.pipe_file(self.path(rel), data)
                return
            final = self.path(rel)
            tmp = os.path.join(os.path.dirname(final), f"{_TMP_PREFIX}{uuid.uuid4().hex}-{os.path.basename(final)}")
            try:
                self.write_stream(os.path.relpath(tmp, self.root), [data])
                os.replace(tmp, final)
            except BaseException:
                _unlink_quiet(tmp)
                raise
            _fsync_dir(os.path.dirname(final))

    def remove(self, rel: str) -> None:
        """Delete file or directory tree ``rel``; a missing one is not an error."""
        with self._errors("remove", rel):
            try:
                self.fs.rm(self.path(rel), recursive=True)
            except FileNotFoundError:
                pass

    # ---- reading ------------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        """Whole content of file ``rel``."""
        with self._errors("read", rel):
            if self.local:
                with open(self.path(rel), "rb") as f:
                    return f.read()
            return self.fs.cat_file(self.path(rel))

    def reader(self, rel: str) -> "Reader":
        """An open file for ranged reads into caller-provided memory (close it, or use ``with``)."""
        return Reader(self, rel)

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists now (listing caches bypassed)."""
        with self._errors("check", rel):
            if self.local:
                return os.path.exists(self.path(rel))
            self.fs.invalidate_cache(posixpath.dirname(self.path(rel)))
            return self.fs.exists(self.path(rel))

    def size(self, rel: str) -> int | None:
        """Size of file ``rel`` in bytes, or ``None`` if it does not exist."""
        with self._errors("stat", rel):
            try:
                if self.local:
                    return os.stat(self.path(rel)).st_size
                self.fs.invalidate_cache(posixpath.dirname(self.path(rel)))
                return int(self.fs.size(self.path(rel)))
            except FileNotFoundError:
                return None

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly below ``rel``, fresh; empty when it does not exist."""
        with self._errors("list", rel):
            full = self.path(rel) if rel else self.root
            if self.local:
                try:
                    return sorted(os.listdir(full))
                except FileNotFoundError:
                    return []
            self.fs.invalidate_cache(full)
            try:
                return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(full, detail=False))
            except FileNotFoundError:
                return []

    def stale_temp_files(self, rel: str = "") -> Iterator[str]:
        """Temporary files a crashed ``write_atomic`` left in ``rel``."""
        for name in self.listdir(rel):
            if name.startswith(_TMP_PREFIX):
                yield posixpath.join(rel, name) if rel else name

    def _errors(self, action: str, rel: str) -> "_StorageErrors":
        return _StorageErrors(action, self.describe(rel))


class Reader:
    """Ranged reads of one file straight into destination memory.

    Local files: one descriptor, ``preadv`` into the destination (no intermediate copy, GIL
    released). Other filesystems: one ranged request per read.
    """

    def __init__(self, storage: Storage, rel: str) -> None:
        self._storage, self._rel = storage, rel
        self._fd: int | None = None
        if storage.local:
            with storage._errors("open", rel):
                self._fd = os.open(storage.path(rel), os.O_RDONLY)

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with the bytes at ``offset``; a short file is an error naming it."""
        with self._storage._errors("read", self._rel):
            got = 0
            if self._fd is not None:
                while got < len(dest):
                    n = os.preadv(self._fd, [dest[got:]], offset + got)
                    if n == 0:
                        break
                    got += n
            else:
                fs, path = self._storage.fs, self._storage.path(self._rel)
                data = fs.cat_file(path, start=offset, end=offset + len(dest))
                got = len(data)
                dest[:got] = data
            if got != len(dest):
                raise EOFError(f"file ends after {offset + got} bytes, {offset + len(dest)} expected")

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
        if exc is None or isinstance(exc, StorageError) or not isinstance(exc, Exception):
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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
