"""Large files on S3: multipart uploads and ranged reads with a bounded number of parts in flight.

One part at a time leaves an object store's bandwidth mostly unused (each request waits a round
trip and the server's per-request pace); S3 serves many requests at once. So a large file goes up
as parts sent concurrently, at most ``in_flight`` of them at a time, and a large read is split
into ranged GETs fetched concurrently into the destination memory. ``in_flight`` is s3fs's own
``max_concurrency`` option (``storage_options={"max_concurrency": N}``, s3fs's default 10), which
s3fs's ``put``/``pipe``/``get``/``cat`` already read with the same meaning.

Everything goes through s3fs's async client (``fs._call_s3``: its session, its retries of
throttling, its error translation) on fsspec's I/O loop; no thread of our own. The caller's thread
produces the parts (a lazily streamed source may block, or itself call into the loop) and waits.

Guarantees (those of :meth:`~.fsspec_storage.FsspecStorage.write_stream`):

* durable when :func:`upload` returns: the upload is completed only after every part succeeded;
* no visible partial object: on any failure, the parts still in flight are let finish (none is
  cut off mid-request), then the upload is aborted, so no part outlives it;
* memory: a stable sequence of chunks (a save's snapshot buffer) is sent as views of the caller's
  memory, copying nothing but a part that straddles two chunks; a lazily streamed source (a flush
  copying from another level) is copied, one part buffer per part in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from typing import Any, AsyncIterator, Iterable, Iterator

import fsspec.asyn

from ..errors import StorageError
from .retry import _answer, _chain

MAX_PARTS = 10_000
"""S3's limit on the parts of one upload: a known-size file gets parts large enough to fit it."""
_SEND_STEP = 1 << 20
"""Bytes handed to the HTTP connection at a time while a part is sent."""


def in_flight(fs: Any, where: str) -> int:
    """Parts of one file in flight on ``fs``: its ``max_concurrency``, checked (``where`` names the store)."""
    n = getattr(fs, "max_concurrency", 1)
    if type(n) is not int or n < 1:
        raise StorageError(f"{where}: storage option max_concurrency={n!r} is invalid: expected a positive "
                           "integer (the parts of one file in flight at once; s3fs's default is 10)")
    return n


# ---- upload ----------------------------------------------------------------------------------------
def upload(fs: Any, path: str, chunks: Iterable[memoryview | bytes], *, part_bytes: int, in_flight: int) -> int:
    """Write ``chunks`` to ``path`` (``bucket/key``) on s3fs filesystem ``fs``; the byte count.

    Up to ``part_bytes`` (or nothing) is one PUT; more goes up as a multipart upload, in parts of
    ``part_bytes`` (larger where a known size would need over :data:`MAX_PARTS`), ``in_flight`` at a
    time. A list or tuple of chunks is sent from its own memory; any other iterable is consumed
    once, each chunk copied before the next is asked for (a streamed copy reuses its buffer), into
    at most ``in_flight`` part buffers at once.
    """
    bucket, key, _ = fs.split_path(path)
    stable = isinstance(chunks, (list, tuple))
    if stable:
        total = sum(len(_bytes(c)) for c in chunks)
        part_bytes = max(part_bytes, -(-total // MAX_PARTS))
    parts = _Parts(chunks, part_bytes, copy=not stable)
    first = parts.take()
    if first is None or not parts.more():
        body = first if first is not None else memoryview(b"")
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=_Body(body))
        fs.invalidate_cache(path)
        return len(body)
    parts.put_back(first)
    del first  # from here on a part's buffer lives only while the part is in flight
    upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    try:
        sent, written = _send_parts(fs, (bucket, key, upload_id), parts, in_flight)
        fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                   MultipartUpload={"Parts": sent})
    except BaseException:
        with contextlib.suppress(Exception):  # the write's own error is the one to report
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        raise
    fs.invalidate_cache(path)
    return written


def _send_parts(fs: Any, target: tuple[str, str, str], parts: "_Parts",
                in_flight: int) -> tuple[list[dict[str, Any]], int]:
    """Send every part, ``in_flight`` at most at once; ``(parts for the completion, bytes)``.
    Returns or raises only once every part request has finished."""
    slots, failed = threading.Semaphore(in_flight), threading.Event()
    futures: list[concurrent.futures.Future[dict[str, Any]]] = []
    written = 0

    def finished(f: concurrent.futures.Future[dict[str, Any]]) -> None:
        if f.exception() is not None:
            failed.set()
        slots.release()

    try:
        while True:
            slots.acquire()  # before the next part is read: at most in_flight part buffers exist
            body = None if failed.is_set() else parts.take()
            if body is None:
                slots.release()
                break
            written += len(body)
            part = asyncio.run_coroutine_threadsafe(_put_part(fs, target, len(futures) + 1, body), fs.loop)
            futures.append(part)
            part.add_done_callback(finished)
            del body  # the part request holds it
    finally:
        concurrent.futures.wait(futures)  # abort (or complete) only once no part request is left
    for f in futures:
        if f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futures], written


async def _put_part(fs: Any, target: tuple[str, str, str], number: int, body: memoryview) -> dict[str, Any]:
    bucket, key, upload_id = target
    out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                            Body=_Body(body))
    return {"PartNumber": number, "ETag": out["ETag"]}


class _Parts:
    """``chunks`` cut into parts of ``size`` bytes (the last one shorter), one :meth:`take` at a time.

    ``copy=False`` (chunks that stay valid, e.g. a list of views of the snapshot buffer): a part
    that lies inside one chunk is a view of it; one that straddles chunks is joined. ``copy=True``
    (a chunk is valid only until the next is asked for): every part is copied into its own buffer.
    """

    def __init__(self, chunks: Iterable[memoryview | bytes], size: int, *, copy: bool) -> None:
        self._chunks: Iterator[memoryview | bytes] = iter(chunks)
        self._size, self._copy = size, copy
        self._rest = memoryview(b"")  # what the current chunk has left
        self._back: memoryview | None = None

    def more(self) -> bool:
        """Whether any bytes are left (reads the next chunk, without consuming it, when needed)."""
        if self._back is not None:
            return True
        while not self._rest:
            chunk = next(self._chunks, None)
            if chunk is None:
                return False
            self._rest = _bytes(chunk)
        return True

    def take(self) -> memoryview | None:
        """The next part, ``None`` at the end."""
        if self._back is not None:
            part, self._back = self._back, None
            return part
        if not self.more():
            return None
        if self._copy:
            return self._join(memoryview(b""))
        if len(self._rest) >= self._size:
            part, self._rest = self._rest[:self._size], self._rest[self._size:]
            return part
        tail, self._rest = self._rest, memoryview(b"")
        return self._join(tail) if self.more() else tail

    def put_back(self, part: memoryview) -> None:
        """Make ``part`` (the last one taken) the next :meth:`take` again."""
        self._back = part

    def _join(self, head: memoryview) -> memoryview:
        """A part copied into a buffer of its own: ``head``, then the chunks' next bytes."""
        buf, n = bytearray(self._size), len(head)
        buf[:n] = head
        while n < self._size and self.more():
            k = min(self._size - n, len(self._rest))
            buf[n:n + k], self._rest = self._rest[:k], self._rest[k:]
            n += k
        return memoryview(buf)[:n]


class _Body:
    """A part sent from its memory, uncopied: file-like for botocore (which reads it for the
    payload hash and checksum, then seeks back; its parameter check refuses a bare memoryview)
    and async-iterable for aiohttp, which sends it in slices of :data:`_SEND_STEP`."""

    def __init__(self, data: memoryview) -> None:
        self._data, self._pos = data, 0

    def __len__(self) -> int:
        return len(self._data)

    def read(self, n: int | None = -1) -> bytes:
        end = len(self._data) if n is None or n < 0 else min(len(self._data), self._pos + n)
        out, self._pos = self._data[self._pos:end].tobytes(), end
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset + (0, self._pos, len(self._data))[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def __aiter__(self) -> AsyncIterator[memoryview]:
        return self._slices()

    async def _slices(self) -> AsyncIterator[memoryview]:
        for i in range(0, len(self._data), _SEND_STEP):  # every send is the whole part (a retry resends it)
            yield self._data[i:i + _SEND_STEP]


def _bytes(chunk: memoryview | bytes) -> memoryview:
    view = memoryview(chunk)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


# ---- ranged reads ----------------------------------------------------------------------------------
def read_into(fs: Any, path: str, offset: int, dest: memoryview, *, part_bytes: int, in_flight: int) -> int:
    """Fill ``dest`` with the bytes of ``path`` from ``offset`` by ranged GETs of ``part_bytes``,
    ``in_flight`` at once; the byte count (less than ``len(dest)`` where the object ends first)."""
    got: int = fsspec.asyn.sync(fs.loop, _read_ranges, fs, path, offset, _bytes(dest), part_bytes, in_flight)
    return got


async def _read_ranges(fs: Any, path: str, offset: int, dest: memoryview, part_bytes: int, in_flight: int) -> int:
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    slots, failed = asyncio.Semaphore(in_flight), asyncio.Event()

    async def fetch(start: int, view: memoryview) -> int:
        async with slots:
            if failed.is_set():
                return 0
            try:
                return await _get_range(fs, bucket, key, offset + start, view, extra)
            except BaseException:
                failed.set()
                raise

    # Every range finishes (or is skipped) before this returns: none writes into dest afterwards.
    got = await asyncio.gather(*(fetch(i, dest[i:i + part_bytes]) for i in range(0, len(dest), part_bytes)),
                               return_exceptions=True)
    for g in got:
        if isinstance(g, BaseException):
            raise g
    n = 0
    for g, i in zip(got, range(0, len(dest), part_bytes)):
        n += g  # type: ignore[operator]
        if g < min(part_bytes, len(dest) - i):  # type: ignore[operator]
            break  # the object ends here
    return n


async def _get_range(fs: Any, bucket: str, key: str, start: int, view: memoryview, extra: dict[str, str]) -> int:
    """Read ``len(view)`` bytes at ``start`` into ``view``; fewer where the object ends (0 past it)."""
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{start + len(view) - 1}",
                                 **extra)
    except OSError as e:
        if _past_the_end(e):
            return 0
        raise
    body, n = resp["Body"], 0
    try:
        while n < len(view) and (k := await body.readinto(view[n:])):
            n += k
    finally:
        body.close()
    return n


def _past_the_end(error: BaseException) -> bool:
    """A ranged GET that starts past the object's end: S3's *416 InvalidRange*."""
    return any(_answer(e)[0] == "InvalidRange" or _answer(e)[1] == 416 for e in _chain(error))
