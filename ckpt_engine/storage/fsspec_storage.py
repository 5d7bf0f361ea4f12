"""Every other fsspec filesystem: object stores (S3, Azure, GCS), ``memory://``, HDFS, SFTP...

What the contract needs beyond plain fsspec calls:

* durability: ``write_stream`` returns once the upload completed. A large file goes up as a
  multipart upload (S3) or staged blocks (Azure) in parts of ``_OBJECT_BLOCK``, completed only at
  the end; a failed write is abandoned (S3: aborted, :mod:`.s3_parts`; others: :func:`_abandon`),
  so neither a crash nor an error leaves a visible partial object. Parts of crashed writers are
  aborted at start (:meth:`abort_uploads`).
* concurrency (S3): the parts of a file go up, and a large read comes back as ranged GETs of
  ``_READ_BLOCK``, ``max_concurrency`` at a time per write or read (s3fs's storage option,
  default 10; see :mod:`.s3_parts`); botocore's connection pool (``max_pool_connections``, default
  10) caps all of a client's requests together. Other backends write through an fsspec file, one
  block at a time.
* atomicity: ``write_atomic`` is one PUT, atomic by the protocol (there is no rename).
* freshness: fsspec's listing caches (s3fs caches listings) are invalidated before every check.
* transient errors (5xx, throttling, dropped connections) are retried for ``retry_deadline``
  seconds (:mod:`.retry`).
"""

from __future__ import annotations

import collections.abc
import contextlib
import posixpath
import warnings
import weakref
from datetime import datetime
from typing import Any, Callable, Sequence, TypeVar

from ..errors import CheckpointWarning, StorageError
from . import guard, poll, s3_parts
from .base import Chunks, Reader, Storage, _StorageErrors
from .retry import is_not_implemented, retrying

T = TypeVar("T")

_OBJECT_BLOCK = 64 << 20
"""Part (S3) or block (Azure) size of large uploads: S3 takes at most 10,000 parts of 5 MiB to 5 GiB."""
_READ_BLOCK = 16 << 20
"""Range of one GET when a large S3 read is split (a GET has no minimum; 8-16 MiB is AWS's advice)."""
_S3 = {"s3", "s3a"}
_S3_RUN = 64 << 20
"""Largest span of neighbouring pieces a restore reads from S3 in one scatter read."""
_NO_DIRECTORIES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "adl"}
_NO_UPLOAD_LISTING: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Filesystems (equal when URL options are) whose server answered 501 to ListMultipartUploads."""


class FsspecStorage(Storage):
    """A checkpoint root on any fsspec filesystem (see the module docstring)."""

    polling = poll.OBJECT_STORE

    fs: Any
    """The fsspec filesystem (shared by every storage of equal URL options: fsspec caches them)."""
    root: str
    """The root in the filesystem's terms (``bucket/prefix`` on object stores)."""

    def _attach(self, fs: Any, root: str) -> None:
        self.fs, self.root = fs, root.rstrip("/")
        if self.protocol in _S3:
            s3_parts.in_flight(fs, self.describe(""))  # a bad max_concurrency fails here, not at a save

    @property
    def parts_in_flight(self) -> int:
        """S3: parts of one file sent, or ranges read, at once (the ``max_concurrency`` storage option)."""
        return s3_parts.in_flight(self.fs, self.describe(""))

    def _reroot(self, root: str) -> None:
        self.root = root

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts).rstrip("/")

    def run(self, action: str, rel: str, fn: Callable[[], T]) -> T:
        with _StorageErrors(action, self.describe(rel)):
            return retrying(fn, self.retry_deadline)

    # ---- writing ------------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        if self.protocol not in _NO_DIRECTORIES:
            self.run("create directory", rel, lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def write_stream(self, rel: str, chunks: Chunks, *, sync_dir: bool = True) -> int:
        if isinstance(chunks, collections.abc.Iterator):  # a retry writes them again; a failure is the write's
            chunks = self.run("write", rel, lambda: list(chunks))  # type: ignore[arg-type]
        if self.protocol in _S3:
            return self.run("write", rel, lambda: s3_parts.upload(
                self.fs, self.path(rel), chunks, part_bytes=_OBJECT_BLOCK, in_flight=self.parts_in_flight))

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

        return self.run("write", rel, write)

    def write_atomic(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        self.run("write", rel, lambda: self.fs.pipe_file(self.path(rel), data))

    def remove(self, rel: str) -> None:
        def rm() -> None:
            try:
                self.fs.rm(self.path(rel), recursive=True)
            except FileNotFoundError:
                pass

        self.run("remove", rel, rm)

    def abort_uploads(self) -> list[str]:
        if self.protocol not in _S3 or self.fs in _NO_UPLOAD_LISTING:
            return []
        bucket, _, prefix = self.root.partition("/")
        try:
            uploads = self.run("list uploads of", "", lambda: self.fs.list_multipart_uploads(bucket))
        except StorageError as e:
            if not is_not_implemented(e):
                raise
            self._skip_upload_cleanup(bucket)
            return []
        aborted = []
        for up in uploads:
            key = up.get("Key", "")
            if key.startswith(prefix.rstrip("/") + "/" if prefix else ""):
                self.run("abort upload of", key, lambda up=up: self.fs.call_s3(
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
        where = self.describe(rel)
        return self.run("read", rel, lambda: self._fresh(rel) or guard.read_object(self.fs, self.path(rel), limit, where))

    def regular_size(self, rel: str) -> int | None:
        where = self.describe(rel)
        return self.run("stat", rel, lambda: self._fresh(rel) or guard.object_size(self.fs, self.path(rel), where))

    def reader(self, rel: str) -> "FsspecReader":
        return FsspecReader(self, rel)

    def exists(self, rel: str) -> bool:
        return self.run("check", rel, lambda: self._fresh(rel) or self.fs.exists(self.path(rel)))

    def size(self, rel: str) -> int | None:
        def stat() -> int | None:
            self._fresh(rel)
            try:
                return int(self.fs.size(self.path(rel)))
            except FileNotFoundError:
                return None

        return self.run("stat", rel, stat)

    def listdir(self, rel: str = "") -> list[str]:
        return [name for name, _ in self._list(rel, "list")]

    def entries(self, rel: str = "") -> list[tuple[str, str]]:
        return [(name, "a directory" if info.get("type") == "directory" else "a file")
                for name, info in self._list(rel, "list")]

    def _list(self, rel: str, action: str) -> list[tuple[str, dict[str, Any]]]:
        """``(name, fsspec info)`` directly below ``rel``, fresh, sorted by name; empty when missing."""
        full = self.path(rel)

        def ls() -> list[tuple[str, dict[str, Any]]]:
            self.fs.invalidate_cache(full)
            try:
                infos = self.fs.ls(full, detail=True)
            except FileNotFoundError:
                return []
            return sorted(((posixpath.basename(i["name"].rstrip("/")), i) for i in infos), key=lambda e: e[0])

        return self.run(action, rel, ls)

    def usage(self, rel: str) -> tuple[int, float | None]:
        full = self.path(rel)

        def find() -> dict[str, dict[str, Any]]:
            self.fs.invalidate_cache(full)
            try:
                if self.fs.isfile(full):
                    return {full: self.fs.info(full)}
                return self.fs.find(full, detail=True, withdirs=False)  # type: ignore[no-any-return]
            except FileNotFoundError:
                return {}

        infos = self.run("list", rel, find)
        times = [t for t in (_mtime(i) for i in infos.values()) if t is not None]
        return sum(int(i.get("size") or 0) for i in infos.values()), (max(times) if times else None)

    def _fresh(self, rel: str) -> bool:
        """Drop fsspec's cached listing of ``rel``'s directory (s3fs caches listings)."""
        self.fs.invalidate_cache(posixpath.dirname(self.path(rel)))
        return False


class FsspecReader(Reader):
    """One ranged request per read (``cat_file``); on S3, a read over ``_READ_BLOCK`` is split
    into ranges fetched concurrently (:func:`.s3_parts.read_into`), and a scatter read of
    neighbouring pieces spans up to :data:`_S3_RUN` bytes: fetched that way into one temporary,
    then copied out (a copy costs far less than the GETs it saves)."""

    @property
    def run_max(self) -> int:  # type: ignore[override]
        return _S3_RUN if self._storage.protocol in _S3 else super().run_max  # type: ignore[attr-defined]

    def _read_many(self, offset: int, dests: Sequence[memoryview]) -> int:
        if self._storage.protocol in _S3 and sum(len(d) for d in dests) <= _S3_RUN:  # type: ignore[attr-defined]
            return self._read_span(offset, dests)
        return super()._read_many(offset, dests)

    def _read(self, offset: int, dest: memoryview) -> int:
        st: FsspecStorage = self._storage  # type: ignore[assignment]
        if st.protocol in _S3 and len(dest) > _READ_BLOCK:
            return s3_parts.read_into(st.fs, st.path(self._rel), offset, dest, part_bytes=_READ_BLOCK,
                                      in_flight=st.parts_in_flight)
        data = st.fs.cat_file(st.path(self._rel), start=offset, end=offset + len(dest))
        dest[:len(data)] = data
        return len(data)


def _mtime(info: dict[str, Any]) -> float | None:
    """Modification time of an fsspec info dict, whichever key the backend uses."""
    for key in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(key)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return None


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
