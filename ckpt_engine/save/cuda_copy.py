"""The CUDA half of a snapshot: device-to-host copies on a side stream, ordered by events.

Order of calls for one save (CheckFreq's snapshot, on the GPU)::

    origin = capture(devices)          # training thread, in save(): an event on each device's
                                       # current stream (the caller's training stream)
    copy = queue(buf, direct, gathers, origin)   # any thread (the snapshot thread with defer=True):
                                       # the side stream waits on that event, copies every piece
                                       # into the pinned buffer, records ``copy.done``
    copy.order()                       # training thread: save() at once, or with defer=True
                                       # wait_snapshot() just before the next optimizer step
    copy.synchronize()                 # persist thread: the host waits for ``done`` (that event
                                       # only, never the whole device), then gathers on the host

``order()`` makes the training stream wait on the copy-done event: a stream wait, no host sync.
Every mutation of a CUDA tensor is a kernel or a copy queued on some stream, so kernels queued on
the captured stream (or on streams ordered after it) once ``order()`` returned cannot overtake the
copy; until then, with ``defer=True``, the next forward and backward run beside it.

A non-contiguous tensor is not made contiguous on the device (an allocation per save): the span of
storage its piece touches is copied as one contiguous block into a staging area at the end of the
pinned buffer, and the persist thread gathers the piece's elements from it on the host
(:class:`Gather`). ``copy_`` of a strided CUDA source into pinned memory allocates a device
temporary of the tensor's size (torch 2.11, measured: benchmarks/README.md, bench_gpu section).
The span costs 1 x the bytes over PCIe for a permuted dense tensor (a transpose, channels_last),
its step for a sliced view; the host gather runs off the training path.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from ..sharding.boxes import Box, index_boxes

if TYPE_CHECKING:
    from .buffers import HostBuffer
    from .layout import Span


def storage_span(boxes: Iterable[Box], stride: Sequence[int], offset: int) -> tuple[int, int]:
    """The storage elements ``[lo, hi)`` the boxes of a tensor with ``stride`` and storage
    ``offset`` touch (torch strides are never negative). Pure."""
    lo, hi = None, None
    for box in boxes:
        first = offset + sum(a * s for (a, _), s in zip(box, stride))
        last = offset + sum((b - 1) * s for (_, b), s in zip(box, stride))
        lo = first if lo is None else min(lo, first)
        hi = last + 1 if hi is None else max(hi, last + 1)
    return (lo, hi) if lo is not None and hi is not None else (offset, offset)


@dataclass(frozen=True)
class Gather:
    """A non-contiguous piece: its storage span goes to ``staging`` (one contiguous copy), then
    the host copies each box from there into the piece's place. Metadata only (no tensor kept)."""

    offset: int
    nbytes: int
    """Where the piece goes in the buffer (its place in the data file)."""
    staging: int
    """Byte offset of the staging area in the buffer (after the data file's bytes)."""
    lo: int
    count: int
    """The span: ``count`` storage elements from element ``lo``."""
    base: int
    """The tensor's storage offset minus ``lo``: where its element 0 is in the staging area."""
    stride: tuple[int, ...]
    dtype: torch.dtype
    boxes: tuple[Box, ...]

    @property
    def span_bytes(self) -> int:
        return self.count * self.dtype.itemsize

    @staticmethod
    def plan(offset: int, start: int, stop: int, src: torch.Tensor, staging: int) -> "Gather":
        """Elements ``[start, stop)`` of ``src`` in row-major order, placed at byte ``offset`` of the
        buffer, staged at byte ``staging``. Pure (reads only ``src``'s shape and strides)."""
        boxes = index_boxes(tuple(src.shape), start, stop)
        lo, hi = storage_span(boxes, src.stride(), src.storage_offset())
        return Gather(offset, (stop - start) * src.element_size(), staging, lo, hi - lo, src.storage_offset() - lo,
                      tuple(src.stride()), src.dtype, boxes)

    def stage(self, buf: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the span of ``src`` into the staging area (one contiguous copy: no temporary)."""
        span = src.as_strided((self.count,), (1,), self.lo)
        buf[self.staging:self.staging + self.span_bytes].view(self.dtype).copy_(span, non_blocking=True)

    def finish(self, buf: torch.Tensor) -> None:
        """Host: copy each box from the staging area into the piece's place (no allocation)."""
        staged = buf[self.staging:self.staging + self.span_bytes].view(self.dtype)
        out = buf[self.offset:self.offset + self.nbytes].view(self.dtype)
        at = 0
        for box in self.boxes:
            sizes = tuple(b - a for a, b in box)
            first = self.base + sum(a * s for (a, _), s in zip(box, self.stride))
            n = prod(sizes)
            out[at:at + n].view(sizes).copy_(staged.as_strided(sizes, self.stride, staged.storage_offset() + first))
            at += n


@dataclass(frozen=True)
class Origin:
    """The caller's current stream on each device at ``save()``, and an event recorded there."""

    streams: dict[torch.device, "torch.cuda.Stream"]
    ready: dict[torch.device, "torch.cuda.Event"]


def capture(devices: Sequence[torch.device]) -> Origin | None:
    """Training thread, in ``save()``: record what the copy must come after (``None`` on CPU)."""
    if not devices:
        return None
    streams, ready = {}, {}
    for dev in devices:
        streams[dev] = torch.cuda.current_stream(dev)
        ready[dev] = torch.cuda.Event()
        ready[dev].record(streams[dev])
    return Origin(streams, ready)


class CudaCopy:
    """The queued device-to-host copy of one snapshot (``HostBuffer.event``)."""

    def __init__(self, origin: Origin, done: dict[torch.device, "torch.cuda.Event"], buf: torch.Tensor,
                 gathers: Sequence[Gather]) -> None:
        self.origin, self.done, self._buf, self._gathers = origin, done, buf, tuple(gathers)
        self._finished = False

    def order(self) -> None:
        """Make the captured stream, and the current one if another, wait for the copy (no host sync)."""
        for dev, done in self.done.items():
            stream = self.origin.streams[dev]
            stream.wait_event(done)
            current = torch.cuda.current_stream(dev)
            if current != stream:
                current.wait_event(done)

    def query(self) -> bool:
        """Whether the copy has finished on the device."""
        return all(done.query() for done in self.done.values())

    def synchronize(self) -> None:
        """Host: wait for the copy-done events (never the whole device), then gather (once)."""
        for done in self.done.values():
            done.synchronize()
        if not self._finished:
            for g in self._gathers:
                g.finish(self._buf)
            self._finished = True


def queue(buf: "HostBuffer", direct: Sequence[tuple["Span", torch.Tensor]],
          gathers: Sequence[tuple[Gather, torch.Tensor]], origin: Origin) -> CudaCopy:
    """Queue every CUDA span's copy on its device's side stream, after ``origin``'s event.

    ``record_stream`` (once per tensor) keeps the caching allocator from handing a source's memory
    out again (when the training thread drops the last reference) before the side stream read it.
    """
    done = {}
    one_device = len(origin.ready) == 1
    for dev, ready in origin.ready.items():
        side = _side_stream(dev)
        side.wait_event(ready)
        dsts, srcs, sources = [], [], {}
        for s, src in direct:
            if one_device or src.device == dev:
                dst, part = _pair(buf, s, src)
                dsts.append(dst)
                srcs.append(part)
                sources[id(src)] = src
        with torch.cuda.stream(side):
            _copy_all(dsts, srcs)
            for g, src in gathers:
                if one_device or src.device == dev:
                    g.stage(buf.tensor, src)
                    sources[id(src)] = src
            for src in sources.values():
                src.record_stream(side)
            done[dev] = torch.cuda.Event(blocking=True)  # the persist thread sleeps in synchronize()
            done[dev].record(side)
    return CudaCopy(origin, done, buf.tensor, [g for g, _ in gathers])


def _pair(buf: "HostBuffer", s: "Span", src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The destination in ``buf`` and the source of span ``s`` of the contiguous ``src``: a whole
    tensor is copied as it is, into a view of its shape (kept by ``buf``: made once per layout);
    a slice (a rank's part of a split tensor) as a flat range."""
    if s.start_byte == 0 and s.nbytes == src.numel() * src.element_size():
        return buf.view_of(s.offset, src.dtype, src.shape), src
    start, stop = s.elements(src.element_size())
    return buf.view_of(s.offset, src.dtype, (stop - start,)), src.view(-1)[start:stop]


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def _copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i], non_blocking=True)`` for every ``i``, in one call where this torch
    has ``_foreach_copy_`` (its loop runs in C++), else in a Python loop."""
    if not dsts:
        return
    if _FOREACH_COPY is not None:
        _FOREACH_COPY(dsts, srcs, non_blocking=True)
        return
    for dst, src in zip(dsts, srcs):
        dst.copy_(src, non_blocking=True)


_SIDE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]
