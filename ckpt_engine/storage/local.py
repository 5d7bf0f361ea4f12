"""This machine's files (local disks, NFS and other POSIX mounts), straight through ``os``.

Here the physical limits are reached, so no layer sits between the engine and the system
calls: one ``write`` per buffer (``O_DIRECT`` for large page-aligned ones), ``preadv`` into the
destination on restore. Durability and atomicity are POSIX's: ``write_stream`` fsyncs the file
and its directory; ``write_atomic`` writes a temporary file, fsyncs it, ``rename``\\ s it into
place and fsyncs the directory. Readers open regular files only, never a symbolic link below the
root (see :mod:`.guard`).
"""

from __future__ import annotations

import collections.abc
import errno
import fcntl
import mmap
import os
import shutil
import weakref
from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ..errors import StorageError
from ..host.hugepages import map_file
from . import guard, poll
from .base import Chunks, Reader, Storage, temp_name

T = TypeVar("T")
_SHARED: "weakref.WeakValueDictionary[tuple[int, int], mmap.mmap]" = weakref.WeakValueDictionary()


def share_mapping(fd: int, mapping: mmap.mmap) -> None:
    """``mapping`` maps the whole file ``fd`` of a memory level and lives on in this process (a
    snapshot buffer: save/filebuffers.py): :meth:`LocalReader.mapped` of that file (any of its hard
    links) returns it instead of mapping the file again, whose page tables cost 12 ms of CPU per
    176 MiB (2026-11-28). Forgotten when ``mapping`` is garbage."""
    st = os.fstat(fd)
    _SHARED[(st.st_dev, st.st_ino)] = mapping


class LocalStorage(Storage):
    """A checkpoint root on this machine's filesystem (see the module docstring)."""

    polling = poll.LOCAL
    can_append = True

    root: str
    """Absolute path of the root."""
    direct_io: bool
    """Large page-aligned writes bypass the page cache (``O_DIRECT``): see :func:`_write_direct`.
    Turned off for good when the filesystem refuses it (tmpfs, some FUSE), or by ``CKPT_DIRECT_IO=0``."""

    def _attach(self, fs: Any, root: str) -> None:
        if not isinstance(fs, LocalFileSystem):
            raise StorageError(f"{self.url} is not a local path ({type(fs).__name__}): open it with open_storage(url)")
        self.root = os.path.abspath(root)
        self.direct_io = _DIRECT_FLAG != 0 and os.environ.get("CKPT_DIRECT_IO", "1") != "0"

    def _reroot(self, root: str) -> None:
        self.root = root

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def describe(self, *parts: str) -> str:
        return self.path(*parts)

    # ---- writing ------------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        path = self.path(rel) if rel else self.root
        if not rel and os.path.exists(path) and not os.path.isdir(path):
            raise StorageError(f"the checkpoint root {path} exists and is not a directory: give the path of a "
                               "directory (it is created when missing), or move that file away")
        self.run("create directory", rel, lambda: os.makedirs(path, exist_ok=True))

    def write_stream(self, rel: str, chunks: Chunks, *, sync_dir: bool = True) -> int:
        return self.run("write", rel, lambda: self._write(rel, chunks, sync_dir))

    def _write(self, rel: str, chunks: Iterable[memoryview | bytes], sync_dir: bool) -> int:
        streamed = not isinstance(chunks, collections.abc.Sequence)  # a stream stays lazy: one chunk in memory
        chunks = chunks if streamed else list(chunks)
        written = None
        single = not streamed and len(chunks) == 1  # type: ignore[arg-type]
        if single and self.direct_io and _direct_eligible(chunks[0]):  # type: ignore[index]
            written = _write_direct(self.path(rel), memoryview(chunks[0]).cast("B"))  # type: ignore[index]
            if written is None:  # this filesystem refuses O_DIRECT (tmpfs, some FUSE): stop trying
                self.direct_io = False
        if written is None and streamed and self.direct_io:
            written = _write_direct_stream(self.path(rel), chunks)
            if written is None:
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
        final = self.path(rel)
        tmp = self.path(temp_name(rel))
        try:
            self.run("write", rel, lambda: _write_file(tmp, data, durable))
            self.run("rename", rel, lambda: os.replace(tmp, final))
        except BaseException:
            _unlink_quiet(tmp)
            raise
        if durable:
            self.run("sync directory of", rel, lambda: _fsync_dir(os.path.dirname(final)))

    def append(self, rel: str, data: bytes) -> None:
        def append() -> None:
            with open(self.path(rel), "ab") as f:
                f.write(data)

        self.run("append to", rel, append)

    def remove(self, rel: str) -> None:
        def rm() -> None:
            path = self.path(rel)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                pass

        self.run("remove", rel, rm)

    # ---- reading ------------------------------------------------------------------------------
    def read_bytes(self, rel: str, limit: int = guard.MAX_METADATA_BYTES) -> bytes:
        where = self.describe(rel)
        return self.run("read", rel, lambda: guard.read_regular(self.root, rel, limit, where))

    def regular_size(self, rel: str) -> int | None:
        where = self.describe(rel)
        return self.run("stat", rel, lambda: guard.regular_size(self.root, rel, where))

    def reader(self, rel: str) -> "LocalReader":
        return LocalReader(self, rel)

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def size(self, rel: str) -> int | None:
        return self.run("stat", rel, lambda: _missing_is_none(lambda: os.stat(self.path(rel)).st_size))

    def listdir(self, rel: str = "") -> list[str]:
        return self.run("list", rel, lambda: _missing_is_none(lambda: sorted(os.listdir(self.path(rel)))) or [])

    def entries(self, rel: str = "") -> list[tuple[str, str]]:
        kinds = [(n, guard.local_kind(self.root, os.path.join(rel, n))) for n in self.listdir(rel)]
        return [(n, kind) for n, kind in kinds if kind is not None]

    def usage(self, rel: str) -> tuple[int, float | None]:
        def walk() -> tuple[int, float | None]:
            path = self.path(rel)
            if not os.path.isdir(path):
                st = _missing_is_none(lambda: os.lstat(path))
                return (st.st_size, st.st_mtime) if st is not None else (0, None)
            total, times = 0, []
            for folder, _, files in os.walk(path):
                for name in files:
                    st = _missing_is_none(lambda: os.lstat(os.path.join(folder, name)))
                    if st is not None:
                        total += st.st_size
                        times.append(st.st_mtime)
            if not times:  # an empty directory: a save may just have begun
                return total, _missing_is_none(lambda: os.path.getmtime(path))
            return total, max(times)

        return self.run("list", rel, walk)

    def free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize


class LocalReader(Reader):
    """One descriptor, ``preadv`` into the destination (no intermediate copy, GIL released)."""

    run_max = 8 << 20
    """A scatter read needs no temporary here, so a run's size only sets how finely the restore's
    threads share the work at the end (load/shares.py: a thread done with its share takes the
    others' runs from their back). 30 alternated warm loads of 1 GiB on 2 threads: median 160.0 ms
    with 8 MiB runs, 160.6 with 16 MiB, 166.6 with fixed shares in 64 MiB runs (first quartiles
    147.1 / 151.3 / 153.5 ms); requests stay :attr:`verify_step` long whatever the run."""
    verify_step = 1 << 20
    """Hashing each MiB right after its ``preadv`` (from the core's cache) instead of a 64 MiB run
    after reading it (from memory): a warm 1 GiB read plus its checksums on 2 threads took 1.11-1.19
    x the read alone instead of 1.50 x (256 KiB to 4 MiB steps: 1.10-1.31 x, 1 MiB best or within
    noise of it; bench_save, 2026-11-26, f436282)."""

    def __init__(self, storage: LocalStorage, rel: str) -> None:
        super().__init__(storage, rel)
        where = storage.describe(rel)  # regular files only, no link below the root (see guard)
        self._fd: int | None = storage.run("open", rel, lambda: guard.open_regular(storage.root, rel, where))
        self._map: mmap.mmap | None = None

    def mapped(self) -> memoryview | None:
        """The file mapped read-only, on a memory level only: there a read cannot fail with an I/O
        error (which a mapping would turn into SIGBUS), and the engine never shortens a file it
        committed. Why: ``preadv`` from tmpfs copies 4 KiB pages one at a time in the kernel, 41 ms of
        CPU for a 176 MiB flush against ~8 ms to checksum the mapped pages (2026-11-28)."""
        if not self._storage.in_memory or self._fd is None:
            return None
        if self._map is None:
            st = os.fstat(self._fd)
            size = st.st_size
            if size == 0:
                return None
            shared = _SHARED.get((st.st_dev, st.st_ino))
            if shared is not None and not shared.closed and len(shared) >= size:
                return memoryview(shared)[:size].toreadonly()
            fd = self._fd  # every page mapped at once, off the GIL (a flush runs beside training)
            self._map = self._storage.run("map", self._rel, lambda: map_file(fd, size, writable=False))
        return memoryview(self._map)

    def _read(self, offset: int, dest: memoryview) -> int:
        if self._fd is None:
            raise ValueError("read from a closed reader")
        got = 0
        while got < len(dest):
            n = os.preadv(self._fd, [dest[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got

    def _read_many(self, offset: int, dests: Sequence[memoryview]) -> int:
        if self._fd is None:
            raise ValueError("read from a closed reader")
        todo, got = [memoryview(d).cast("B") for d in dests], 0
        while todo:  # one preadv per call, straight into every buffer; resumed after a short read
            n = os.preadv(self._fd, todo[:_IOV_MAX], offset + got)
            if n == 0:
                break
            got += n
            while todo and n >= len(todo[0]):
                n -= len(todo[0])
                todo.pop(0)
            if todo and n:
                todo[0] = todo[0][n:]
        return got

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view of it is still held somewhere: it closes when that goes
                pass
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _missing_is_none(fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except FileNotFoundError:
        return None


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


def _open_direct(path: str) -> int | None:
    """``path`` opened for writing with ``O_DIRECT`` (truncated); ``None`` where the filesystem refuses it."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _DIRECT_FLAG, 0o644)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def _write_direct_stream(path: str, chunks: Iterable[memoryview | bytes]) -> int | None:
    """Write a stream (a flush's copy) with ``O_DIRECT`` while its chunks are page-aligned (a
    reused aligned buffer: levels/transfer.py), the rest through the page cache on the same
    descriptor; fsync. ``None``, before any chunk is taken, when the filesystem refuses ``O_DIRECT``.
    Why: as :func:`_write_direct`; a buffered flush of a 176 MB state cost ~300 ms of CPU here."""
    fd = _open_direct(path)
    if fd is None:
        return None
    direct, written = True, 0
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if direct and not (view.nbytes % _DIRECT_ALIGN == 0 and _direct_eligible(view)):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_DIRECT_FLAG)
                direct = False
            done = 0
            while done < view.nbytes:
                try:
                    done += os.write(fd, view[done:])
                except OSError as e:  # refused (or a short write left an unaligned offset): buffered from here
                    if not (direct and e.errno == errno.EINVAL):
                        raise
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_DIRECT_FLAG)
                    direct = False
            written += done
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def _write_direct(path: str, view: memoryview) -> int | None:
    """Write ``view`` (page-aligned) to ``path`` with ``O_DIRECT``, fsync; ``None`` if refused.

    Why: a buffered write of a large checkpoint copies every byte into the page cache, and on a
    machine whose cores train, that copy (about 2.5 ms of CPU per MB on this project's CI VMs, 50x
    the direct write's cost) is what slows training beside a background persist. The block-aligned
    head goes out directly from the snapshot buffer; the unaligned tail (under 4 KiB) through the
    page cache on the same descriptor once ``O_DIRECT`` is cleared. Returns ``None`` only when the
    filesystem refuses direct I/O before anything was written, so the caller can write normally.
    """
    fd = _open_direct(path)
    if fd is None:
        return None
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


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
