"""Snapshot (phase 1): copy this rank's slices into a reused host buffer.

This is the only part training waits for, so it does as little as possible: one ``memmove`` per
slice on CPU (single-threaded and outside the GIL: ranks sharing a machine's cores do not fight
over torch's intra-op thread pool, and the library never touches ``torch.set_num_threads``), or
an asynchronous copy into pinned memory on a side CUDA stream, ordered by events (cuda_copy.py).
The buffer's first bytes are the rank's data file layout, so persist writes them unchanged.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from .cuda_copy import CudaCopy, Gather, Origin, queue
from .format.manifest import ALIGN
from .plan import Slice

PAGE = 4096
"""Host buffers start at a multiple of this (the block alignment direct I/O needs)."""


@dataclass(frozen=True)
class Piece:
    """Where one slice lives in the rank's buffer and data file."""

    local: bool
    tensor: int
    start: int
    stop: int
    offset: int
    nbytes: int


def layout(state_slices: Sequence[Slice], state_itemsize: Sequence[int],
           local_tensors: Sequence[torch.Tensor]) -> tuple[tuple[Piece, ...], int]:
    """Place the rank's state slices, then its local tensors whole, at aligned offsets.

    Pure: returns the pieces and the buffer size they need.
    """
    pieces: list[Piece] = []
    offset = 0
    for s in state_slices:
        nbytes = (s.stop - s.start) * state_itemsize[s.tensor]
        pieces.append(Piece(False, s.tensor, s.start, s.stop, offset, nbytes))
        offset += _align(nbytes)
    for i, t in enumerate(local_tensors):
        pieces.append(Piece(True, i, 0, t.numel(), offset, t.numel() * t.element_size()))
        offset += _align(t.numel() * t.element_size())
    return tuple(pieces), offset


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HostBuffer:
    """A reusable host byte buffer (pinned when the state lives on a GPU), zero-filled once."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        # zeros: the padding between pieces is written and checksummed, and must not leak old memory.
        # Page-aligned start, so persist can write it with O_DIRECT (see storage.write_stream).
        raw = torch.zeros(max(nbytes, 1) + PAGE, dtype=torch.uint8, pin_memory=pinned)
        skip = -raw.data_ptr() % PAGE
        self.tensor = raw[skip:skip + max(nbytes, 1)]
        self.pinned = pinned
        self.address = self.tensor.data_ptr()
        self.event: CudaCopy | None = None
        """The CUDA copy into this buffer of the snapshot in it (persist calls ``synchronize()``)."""

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    def view(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` as a memoryview (what persist writes and hashes)."""
        return memoryview(self.tensor.numpy()[:nbytes])


class BufferPool:
    """At most ``max_inflight`` buffers; a snapshot takes one, persist gives it back.

    Buffers are allocated on first use and reused while they are large enough, so steady-state
    checkpointing allocates nothing. ``allocations`` counts the allocations made.
    """

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self._free: list[HostBuffer] = []
        self._count = 0
        self._cond = threading.Condition()
        self.allocations = 0

    def acquire(self, nbytes: int, pinned: bool, block: bool) -> HostBuffer | None:
        """A buffer of at least ``nbytes``; waits for one (``block``) or returns ``None``."""
        with self._cond:
            while not self._free and self._count >= self.max_inflight:
                if not block:
                    return None
                self._cond.wait()
            if self._free:
                fits = [b for b in self._free if b.capacity >= nbytes and b.pinned == pinned]
                buf = fits[0] if fits else self._free[0]
                self._free.remove(buf)
                if fits:
                    return buf
                self._count -= 1  # too small: dropped, replaced below
            self._count += 1
        self.allocations += 1
        return HostBuffer(nbytes, pinned)

    def reserve(self, nbytes: int, pinned: bool) -> None:
        """Allocate every slot now (at set-up), so the first snapshots do not pay for it."""
        with self._cond:
            while self._count < self.max_inflight:
                self._free.append(HostBuffer(nbytes, pinned))
                self._count += 1
                self.allocations += 1
            for i, buf in enumerate(self._free):
                if buf.capacity < nbytes or buf.pinned != pinned:
                    self._free[i] = HostBuffer(nbytes, pinned)
                    self.allocations += 1

    def release(self, buf: HostBuffer) -> None:
        """Give ``buf`` back for reuse."""
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def idle(self) -> bool:
        """Whether no buffer is taken (nothing in flight)."""
        with self._cond:
            return len(self._free) == self._count


@dataclass(frozen=True)
class CopyPlan:
    """What one snapshot copies, and how: made in ``save()`` (and ``reserve()``) from the tensors."""

    host: tuple[tuple[Piece, torch.Tensor], ...]
    """CPU pieces: one ``memmove`` each."""
    direct: tuple[tuple[Piece, torch.Tensor], ...]
    """Contiguous CUDA pieces: one asynchronous copy each."""
    gathers: tuple[tuple[Gather, torch.Tensor], ...]
    """Non-contiguous CUDA pieces: their storage span to a staging area, gathered on the host."""
    nbytes: int
    """Host buffer bytes: the data file's, then the staging areas."""
    devices: tuple[torch.device, ...]
    """The CUDA devices of the pieces (empty: all on CPU, no pinned memory)."""


def plan_copy(pieces: Sequence[Piece], nbytes: int, state: Sequence[torch.Tensor],
              local: Sequence[torch.Tensor]) -> CopyPlan:
    """Sort the pieces by how they are copied; staging areas go after the ``nbytes`` of the file."""
    host, direct, gathers, devices = [], [], [], {}
    end = _align(nbytes)
    for p in pieces:
        src = (local if p.local else state)[p.tensor]
        if not src.is_cuda:
            host.append((p, src))
            continue
        devices[src.device] = None
        if src.is_contiguous() or p.nbytes == 0:
            direct.append((p, src))
        else:
            g = Gather.plan(p, src, end)
            gathers.append((g, src))
            end += _align(g.span_bytes)
    return CopyPlan(tuple(host), tuple(direct), tuple(gathers), end if gathers else nbytes, tuple(devices))


def copy_into(buf: HostBuffer, plan: CopyPlan, origin: Origin | None) -> CudaCopy | None:
    """Copy every piece of ``plan`` into ``buf``.

    On return the CPU pieces are in the buffer; CUDA pieces are queued on a side stream after
    ``origin`` (the caller's stream at ``save()``): ``buf.event`` (also returned) orders the
    training stream after them (``order()``) and lets persist wait for them (``synchronize()``).
    """
    for p, src in plan.host:
        flat = _flat(src)
        ctypes.memmove(buf.address + p.offset, flat.data_ptr() + p.start * flat.element_size(), p.nbytes)
    buf.event = queue(buf, plan.direct, plan.gathers, origin) if origin is not None else None
    return buf.event


def _flat(t: torch.Tensor) -> torch.Tensor:
    return (t if t.is_contiguous() else t.contiguous()).reshape(-1)
