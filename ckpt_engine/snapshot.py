"""Snapshot (phase 1): copy this rank's slices into a reused host buffer.

This is the only part training waits for, so it does as little as possible: on CPU one ``memmove``
per run of adjacent pieces (a slice's pieces are adjacent in the buffer and in the tensor), outside
the GIL, or an asynchronous copy into pinned memory on a side CUDA stream,
ordered by events (cuda_copy.py). The buffer's first bytes are the rank's data file layout, so
persist writes them unchanged.

While training waits for a CPU copy, the copy may use the cores the rank has: ``copy_threads``
threads (the checkpointer's default: this machine's cores divided among the ranks sharing it, as
for reads), taking 4 MiB chunks of the bytes in turn (a call crossing a chunk's end is cut). One thread copies at
most about 20 GB/s on a server core and about 6 here, so a second one pays off on any copy of more
than a few MiB. Never more threads than that: ranks sharing the cores would fight over them, and
the library never touches ``torch.set_num_threads``. A deferred copy (``save(defer=True)``) runs
beside training, so it stays on one thread.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from . import hugepages
from .cuda_copy import CudaCopy, Gather, Origin, capture, queue
from .format.manifest import ALIGN, Piece, TensorEntry
from .plan import Plan, Slice, TensorMeta, chunk_slice, make_plan
from .values import Encoded, dtype_name

if TYPE_CHECKING:
    from .persist import SaveRecord

PAGE = 4096
"""Host buffers start at a multiple of this (the block alignment direct I/O needs)."""
VIEWS_KEPT = 1 << 16
"""At most this many destination views per buffer (:meth:`HostBuffer.view_of`): a few MiB."""
PIECE_BYTES = 4 << 20
"""A slice longer than this is stored as several pieces, each under its own checksum, so that a
reader needing part of it (another world size, another sharding) reads and verifies about what it
needs instead of the whole slice. 4 MiB: a piece costs a copy call, an index row of ~100 bytes
and a read call, nothing next to copying 4 MiB."""


@dataclass(frozen=True)
class SaveLayout:
    """What one state signature (dtypes and shapes) gives on this rank: the plan, the tensor tables
    of the manifest and index file, and where each piece goes in the buffer."""

    plan: Plan
    tensors: tuple[TensorEntry, ...]
    local_tensors: tuple[TensorEntry, ...]
    pieces: tuple[Piece, ...]
    nbytes: int
    spans: tuple["Span", ...] = ()
    """The pieces merged where adjacent (see :func:`spans`): what a CPU copy calls ``memmove`` for."""


def save_layout(enc: Encoded, lenc: Encoded, rank: int, world_size: int) -> SaveLayout:
    """Pure: the layout of ``enc`` (replicated, sliced; sharded, this rank's share of its chunks)
    and ``lenc`` (``local``, whole) on ``rank`` (the same plan on every rank, no communication);
    callers cache it by signature."""
    metas = [TensorMeta(dtype_name(t.dtype), c.shape if c else tuple(t.shape), t.element_size())
             for t, c in zip(enc.tensors, enc.shards)]
    plan = make_plan(metas, world_size, sharded=[c is not None for c in enc.shards])
    mine = [s for i, c in enumerate(enc.shards) if c is not None
            for s in [chunk_slice(i, c.box, c.replica, c.replicas)] if s is not None]
    slices = sorted(plan.slices_for(rank, metas) + mine, key=lambda s: s.tensor)
    pieces, nbytes = layout(slices, [m.itemsize for m in metas], lenc.tensors)
    tensors = tuple(TensorEntry(m.dtype, m.shape, o, n, c.sharding if c else None)
                    for m, o, n, c in zip(metas, plan.owner, enc.names, enc.shards))
    local = tuple(TensorEntry(dtype_name(t.dtype), tuple(t.shape), rank, n) for t, n in zip(lenc.tensors, lenc.names))
    merged = spans(pieces, [m.itemsize for m in metas], [t.element_size() for t in lenc.tensors])
    return SaveLayout(plan, tensors, local, pieces, nbytes, merged)


def layout(state_slices: Sequence[Slice], state_itemsize: Sequence[int],
           local_tensors: Sequence[torch.Tensor]) -> tuple[tuple[Piece, ...], int]:
    """Place the rank's state slices (each in pieces of at most :data:`PIECE_BYTES`), then its
    local tensors whole, at aligned offsets.

    Pure: returns the pieces and the buffer size they need.
    """
    pieces: list[Piece] = []
    offset = 0
    for s in state_slices:
        item = state_itemsize[s.tensor]
        step = max(1, PIECE_BYTES // item)
        for start in range(s.start, s.stop, step):
            stop = min(s.stop, start + step)
            nbytes = (stop - start) * item
            pieces.append(Piece(False, s.tensor, start, stop, offset, nbytes, box=s.box))
            offset += _align(nbytes)
    for i, t in enumerate(local_tensors):
        pieces.append(Piece(True, i, 0, t.numel(), offset, t.numel() * t.element_size()))
        offset += _align(t.numel() * t.element_size())
    return tuple(pieces), offset


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Span:
    """Consecutive pieces of one tensor that follow each other in the buffer too (the pieces of one
    slice): bytes ``[start_byte, start_byte + nbytes)`` of the tensor's row-major data (of its
    chunk's, when sharded) at ``offset`` in the buffer. A CPU copy is one ``memmove`` per span."""

    local: bool
    tensor: int
    start_byte: int
    offset: int
    nbytes: int

    def elements(self, itemsize: int) -> tuple[int, int]:
        """The span as elements ``[start, stop)`` of the tensor's row-major data."""
        return self.start_byte // itemsize, (self.start_byte + self.nbytes) // itemsize


def spans(pieces: Sequence[Piece], itemsize: Sequence[int], local_itemsize: Sequence[int]) -> tuple[Span, ...]:
    """Pure: ``pieces`` (in buffer order) with each run of adjacent pieces of one tensor merged."""
    out: list[Span] = []
    for p in pieces:
        start = p.start * (local_itemsize if p.local else itemsize)[p.tensor]
        last = out[-1] if out else None
        if (last is not None and (last.local, last.tensor) == (p.local, p.tensor)
                and last.start_byte + last.nbytes == start and last.offset + last.nbytes == p.offset):
            out[-1] = Span(p.local, p.tensor, last.start_byte, last.offset, last.nbytes + p.nbytes)
        else:
            out.append(Span(p.local, p.tensor, start, p.offset, p.nbytes))
    return tuple(out)


class HostBuffer:
    """A reusable host byte buffer (pinned when the state lives on a GPU), zero-filled once."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        # zeros: the padding between pieces is written and checksummed, and must not leak old memory.
        # Page-aligned start, so persist can write it with O_DIRECT (see storage.write_stream).
        if pinned:
            raw = torch.zeros(max(nbytes, 1) + PAGE, dtype=torch.uint8, pin_memory=True)
        else:  # zero-filled through huge pages where the kernel has them (hugepages.py)
            raw = hugepages.empty((max(nbytes, 1) + PAGE,), torch.uint8).zero_()
        skip = -raw.data_ptr() % PAGE
        self.tensor = raw[skip:skip + max(nbytes, 1)]
        self.pinned = pinned
        self.address = self.tensor.data_ptr()
        self.event: CudaCopy | None = None
        """The CUDA copy into this buffer of the snapshot in it (persist calls ``synchronize()``)."""
        self._views: dict[tuple, torch.Tensor] = {}

    def view_of(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes at ``offset`` as a tensor of ``dtype`` and ``shape``, made once and kept (the
        destination of a CUDA copy: the same each save of a layout, and making it costs as much as
        queuing the copy). Forgets all when it holds too many (layouts that keep changing)."""
        key = (offset, dtype, shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            n = prod(shape) * dtype.itemsize
            view = self._views[key] = self.tensor[offset:offset + n].view(dtype).view(shape)
        return view

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    def view(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` as a memoryview (what persist writes and hashes)."""
        return memoryview(self.tensor.numpy()[:nbytes])

    def reusable(self, nbytes: int) -> bool:
        """Whether a snapshot of ``nbytes`` may be copied into it now (given back, large enough)."""
        return True

    def kept(self) -> bool:
        """Whether something else still holds it (a committed memory checkpoint), so the pool keeps it."""
        return False

    def drop(self) -> None:
        """Let it go (the pool replaces it): nothing to do for host memory."""


class BufferPool:
    """At most ``max_inflight`` buffers taken at once; a snapshot takes one, persist gives it back.

    Buffers are allocated on first use and reused while they are large enough, so steady-state
    checkpointing allocates nothing. ``make(nbytes, pinned)`` allocates one (default
    :class:`HostBuffer`; a memory level makes buffers that are files in its tmpfs, levels/buffers.py,
    which a committed checkpoint keeps until retention removes it: such a buffer given back is
    reused only once :meth:`HostBuffer.reusable` says so). ``allocations`` counts the allocations
    made, ``waiting`` the callers blocked in :meth:`acquire`.
    """

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self.make: Callable[[int, bool], HostBuffer] = HostBuffer
        self._free: list[HostBuffer] = []
        self._taken = 0
        self._cond = threading.Condition()
        self.allocations = 0
        self.waiting = 0

    def acquire(self, nbytes: int, pinned: bool, block: bool) -> HostBuffer | None:
        """A buffer of at least ``nbytes``; waits for one (``block``) or returns ``None``."""
        with self._cond:
            while self._taken >= self.max_inflight:
                if not block:
                    return None
                self.waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self.waiting -= 1
            self._taken += 1
            for buf in self._free:
                if buf.capacity >= nbytes and buf.pinned == pinned and buf.reusable(nbytes):
                    self._free.remove(buf)
                    return buf
            for buf in [b for b in self._free if not b.kept()]:  # too small: replaced below
                self._free.remove(buf)
                buf.drop()
        self.allocations += 1
        return self.make(nbytes, pinned)

    def reserve(self, nbytes: int, pinned: bool, kept: int = 0) -> None:
        """Allocate every slot now (at set-up), so the first snapshots do not pay for it; ``kept``
        more for buffers that committed checkpoints hold (a memory level's)."""
        with self._cond:
            usable = [b for b in self._free if b.capacity >= nbytes and b.pinned == pinned and b.reusable(nbytes)]
            for _ in range(self.max_inflight + kept - self._taken - len(usable)):
                self._free.append(self.make(nbytes, pinned))
                self.allocations += 1

    def release(self, buf: HostBuffer) -> None:
        """Give ``buf`` back for reuse."""
        with self._cond:
            self._taken -= 1
            self._free.append(buf)
            self._cond.notify()

    def idle(self) -> bool:
        """Whether no buffer is taken (nothing in flight)."""
        with self._cond:
            return self._taken == 0


@dataclass(frozen=True)
class CopyPlan:
    """What one snapshot copies, and how: made in ``save()`` (and ``reserve()``) from the tensors."""

    host: tuple[tuple[Span, torch.Tensor], ...]
    """CPU spans: one ``memmove`` each."""
    direct: tuple[tuple[Span, torch.Tensor], ...]
    """Contiguous CUDA spans: one asynchronous copy each (not one per 4 MiB piece)."""
    gathers: tuple[tuple[Gather, torch.Tensor], ...]
    """Non-contiguous CUDA spans: the storage they touch to a staging area, gathered on the host."""
    nbytes: int
    """Host buffer bytes: the data file's, then the staging areas."""
    devices: tuple[torch.device, ...]
    """The CUDA devices of the pieces (empty: all on CPU, no pinned memory)."""
    layout: object = None
    """The layout the spans come from (``Snapshots`` passes its cached ``SaveLayout``): the same
    object for the same spans, which lets :class:`CopyCalls` reuse the last copy's calls."""

    @property
    def host_bytes(self) -> int:
        """Bytes of the CPU pieces."""
        return sum(p.nbytes for p, _ in self.host)


def plan_copy(pieces: Sequence[Piece], nbytes: int, state: Sequence[torch.Tensor],
              local: Sequence[torch.Tensor], merged: Sequence[Span] | None = None, layout: object = None) -> CopyPlan:
    """Sort the pieces by how they are copied, a span (``merged``: the pieces merged where adjacent,
    made here when not given) at a time; staging areas go after the ``nbytes`` of the file.
    ``layout``: what ``merged`` comes from (:attr:`CopyPlan.layout`).

    By spans on the device too: a piece of a transposed tensor touches nearly all of its storage,
    so staging per piece would copy the storage once per 4 MiB piece (a 256 MiB transpose: 64 x).
    Empty spans copy nothing but still name their device (the copy is ordered after it all the same).
    """
    if merged is None:
        merged = spans(pieces, [t.element_size() for t in state], [t.element_size() for t in local])
    on_cuda = [[t.is_cuda for t in state], [t.is_cuda for t in local]]
    host = tuple((s, (local if s.local else state)[s.tensor]) for s in merged if not on_cuda[s.local][s.tensor])
    if not any(on_cuda[0]) and not any(on_cuda[1]):  # the common case: no piece to look at
        return CopyPlan(host, (), (), nbytes, (), layout)
    direct, gathers, devices = [], [], {}
    end = _align(nbytes)
    for s in merged:
        if not on_cuda[s.local][s.tensor]:
            continue
        src = (local if s.local else state)[s.tensor]
        devices[src.device] = None
        if s.nbytes == 0:
            continue
        if src.is_contiguous():
            direct.append((s, src))
        else:
            g = Gather.plan(s.offset, *s.elements(src.element_size()), src, end)
            gathers.append((g, src))
            end += _align(g.span_bytes)
    return CopyPlan(host, tuple(direct), tuple(gathers), end if gathers else nbytes, tuple(devices), layout)


SPLIT_MIN = 8 << 20
"""A CPU copy smaller than this stays on the calling thread (handing runs to other threads costs
tens of microseconds)."""

Move = tuple[int, int, int]
"""One ``memmove``: destination address, source address, bytes."""


def moves(buf: HostBuffer, host: Sequence[tuple[Span, torch.Tensor]]) -> tuple[list[Move], list[torch.Tensor]]:
    """The ``memmove`` calls that copy ``host`` into ``buf``, one per span, and the tensors they
    read from, which the caller holds until the calls are done (a non-contiguous tensor's
    contiguous copy exists only there). A tensor's address is resolved once per copy (a
    non-contiguous one made contiguous once, not once per piece)."""
    out: list[Move] = []
    bases: dict[int, tuple[torch.Tensor, int]] = {}
    for s, src in host:
        base = bases.get(id(src))
        if base is None:  # (a view's data_ptr() is of its first element: no reshape needed)
            flat = src if src.is_contiguous() else src.contiguous()
            base = bases[id(src)] = (flat, flat.data_ptr())
        if s.nbytes:
            out.append((buf.address + s.offset, base[1] + s.start_byte, s.nbytes))
    return out, [flat for flat, _ in bases.values()]


def split(calls: Sequence[Move], parts: int) -> list[list[Move]]:
    """Cut ``calls`` into ``parts`` lists of consecutive bytes, each within one byte of an equal
    share (a call crossing a boundary is cut in two), every byte in exactly one list, in order;
    fewer lists when there are fewer bytes than ``parts``."""
    total = sum(n for _, _, n in calls)
    parts = max(1, min(parts, total))
    out: list[list[Move]] = [[] for _ in range(parts)]
    k, done = 0, 0
    for dst, src, n in calls:
        while n:
            goal = total * (k + 1) // parts  # this list ends at byte ``goal``
            take = min(n, goal - done)
            if take:
                out[k].append((dst, src, take))
            dst, src, n, done = dst + take, src + take, n - take, done + take
            if done == goal and k < parts - 1:
                k += 1
    return out


def _copy_run(calls: Sequence[Move]) -> None:
    """Each ``memmove`` of ``calls`` (ctypes releases the GIL)."""
    memmove = ctypes.memmove
    for dst, src, n in calls:
        memmove(dst, src, n)


COPY_CHUNK = 4 << 20
"""Bytes a thread of a shared copy takes at a time (:class:`_Chunks`): about 0.3 ms of copying here,
the most by which one thread can finish after another."""


class _Chunks:
    """A copy cut into chunks of consecutive bytes that any number of threads take one at a time.

    Why not a fixed share per thread: a thread that starts late or runs on a core the host
    slows down held the whole copy up (the caller waited 0.1-8 ms for its helper's half, 1.5 ms
    on average of 12 saves of 1 GiB). Here the others take its chunks, and the caller waits only for
    the chunks already taken: a helper still queued finds none left and touches nothing.
    """

    def __init__(self, runs: Sequence[Sequence[Move]]) -> None:
        self.runs = runs
        self._next = itertools.count()  # its __next__ is atomic under the GIL
        self._left = len(self.runs)
        self._done = threading.Condition()
        self.helper_cpu = 0.0
        self.error: BaseException | None = None
        """What stopped a helper (re-raised by the caller: a chunk it took is not in the buffer)."""

    def take(self, helper: bool = True) -> None:
        """Copy chunks until none is left (on any thread); a helper's CPU seconds add to :attr:`helper_cpu`."""
        cpu, settled = time.thread_time(), 0
        try:
            while (k := next(self._next)) < len(self.runs):
                settled += 1  # settled once taken: copied, or given up by an exception
                _copy_run(self.runs[k])
        except BaseException as e:
            if helper:  # the caller learns of it after wait(); its own exception it raises itself
                self.error = e
                self.abandon()
            raise
        finally:
            with self._done:
                self._left -= settled
                if helper:
                    self.helper_cpu += time.thread_time() - cpu
                if self._left == 0:
                    self._done.notify_all()

    def abandon(self) -> None:
        """Take every chunk nobody has taken yet, uncopied, so that no thread starts another."""
        untaken = 0
        while next(self._next) < len(self.runs):
            untaken += 1
        with self._done:
            self._left -= untaken
            if self._left == 0:
                self._done.notify_all()

    def wait(self) -> None:
        """Until every chunk is settled (after :meth:`take` on this thread: copied)."""
        with self._done:
            while self._left:
                self._done.wait()


class CopyCalls:
    """The ``memmove`` calls of the last CPU copy and their chunks, reused while nothing they
    depend on changed: the layout (:attr:`CopyPlan.layout`, the same object), the buffer, the
    chunking, and the address of every source tensor, each contiguous (a non-contiguous one is
    copied to a contiguous temporary per save, at a new address each time: nothing is reused).

    Why: a training loop saves the same parameters and optimizer state, updated in place, every
    time, and making the calls (``moves``, ``split``) took ~0.6 ms of the stall per save of the
    benchmark's 364 tensors; checking the addresses takes ~0.06 ms. Used by one copy at a time
    (a ``Snapshots``' saves never overlap).
    """

    def __init__(self) -> None:
        self._layout: object = None
        self._key: tuple | None = None
        self._calls: list[Move] = []
        self._runs: list[list[Move]] = []

    def of(self, buf: HostBuffer, plan: CopyPlan,
           chunks: int) -> tuple[list[Move], list[list[Move]], list[torch.Tensor]]:
        """The calls that copy ``plan``'s CPU spans into ``buf``, those calls cut into ``chunks``
        runs of consecutive bytes (:func:`split`; none when ``chunks`` is 0), and the tensors they
        read from (held by the caller until the calls are done)."""
        sources = [t for _, t in plan.host]
        key = None
        if plan.layout is not None and all(t.is_contiguous() for t in sources):
            key = (buf.address, chunks, tuple(t.data_ptr() for t in sources))
            if plan.layout is self._layout and key == self._key:
                return self._calls, self._runs, sources
        calls, held = moves(buf, plan.host)
        runs = split(calls, chunks) if chunks else []
        kept = (plan.layout, key, calls, runs) if key else (None, None, [], [])
        self._layout, self._key, self._calls, self._runs = kept
        return calls, runs, held


def copy_into(buf: HostBuffer, plan: CopyPlan, origin: Origin | None,
              helpers: ThreadPoolExecutor | None = None, threads: int = 1,
              reuse: CopyCalls | None = None) -> tuple[CudaCopy | None, float]:
    """Copy every piece of ``plan`` into ``buf``; with ``helpers`` and ``threads`` > 1 the CPU
    bytes in chunks that this thread and ``threads - 1`` helpers take in turn (:class:`_Chunks`).
    ``reuse``: the calls of the previous copy, where they still hold (:class:`CopyCalls`).
    Returns the CUDA copy (or ``None``) and the CPU seconds of the helper threads.

    On return the CPU pieces are in the buffer; CUDA pieces are queued on a side stream after
    ``origin`` (the caller's stream at ``save()``): ``buf.event`` (also returned) orders the
    training stream after them (``order()``) and lets persist wait for them (``synchronize()``).
    """
    host_bytes, helper_cpu = plan.host_bytes, 0.0
    shared = helpers is not None and threads > 1 and host_bytes >= SPLIT_MIN
    parts = -(-host_bytes // COPY_CHUNK) if shared else 0
    calls, runs, sources = (reuse or CopyCalls()).of(buf, plan, parts)  # ``sources`` outlive the calls
    if shared:
        assert helpers is not None
        chunks = _Chunks(runs)
        for _ in range(threads - 1):
            helpers.submit(chunks.take)
        try:
            chunks.take(helper=False)
        except BaseException:
            chunks.abandon()  # no helper may write into the buffer once this save has failed
            raise
        finally:
            chunks.wait()  # every chunk taken is copied before the buffer is used
        if chunks.error is not None:
            raise chunks.error
        helper_cpu = chunks.helper_cpu
    else:
        _copy_run(calls)
    del sources  # every call is done: the contiguous copies may go
    buf.event = queue(buf, plan.direct, plan.gathers, origin) if origin is not None else None
    return buf.event, helper_cpu


class Snapshots:
    """The snapshot phase of one ``Checkpointer``, called from its training thread: the layout of
    each state signature (cached), at most ``max_inflight`` host buffers (:attr:`pool`), and the
    copies into them: on the calling thread, or deferred to one background thread."""

    def __init__(self, rank: int, world_size: int, max_inflight: int, copy_threads: int = 1) -> None:
        self.rank, self.world_size = rank, world_size
        self.copy_threads = copy_threads
        self.pool = BufferPool(max_inflight)
        self._layouts: dict[tuple, SaveLayout] = {}
        self._thread: ThreadPoolExecutor | None = None
        self._helpers: ThreadPoolExecutor | None = None
        self._calls = CopyCalls()  # one copy at a time: a save waits for the deferred copy before it

    def plan(self, enc: Encoded, lenc: Encoded) -> tuple[SaveLayout, CopyPlan]:
        """The layout of this state signature and how this state's pieces are copied."""
        key = (tuple((t.dtype, t.shape, c and (c.shape, c.box, c.replica, c.replicas, c.sharding))
                     for t, c in zip(enc.tensors, enc.shards)),
               tuple((t.dtype, t.shape) for t in lenc.tensors),
               tuple(enc.names), tuple(lenc.names))  # the manifest's tensor table names the keys
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = save_layout(enc, lenc, self.rank, self.world_size)
        return lay, plan_copy(lay.pieces, lay.nbytes, enc.tensors, lenc.tensors, lay.spans, lay)

    def take(self, buf: HostBuffer, plan: CopyPlan, record: SaveRecord,
             defer: bool) -> "Future[CudaCopy | None] | None":
        """Copy into ``buf`` now (CUDA: the caller's streams ordered after the copy), or, with
        ``defer``, on the background thread: its future is returned (see :class:`SaveHandle`)."""
        origin = capture(plan.devices)  # here, on the caller's thread: its current streams
        if defer:  # beside training: one thread
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-snapshot")
            return self._thread.submit(_timed_copy, buf, plan, origin, record, reuse=self._calls)
        if self.copy_threads > 1 and self._helpers is None:
            self._helpers = ThreadPoolExecutor(self.copy_threads - 1, thread_name_prefix="ckpt-copy")
        copy = _timed_copy(buf, plan, origin, record, self._helpers, self.copy_threads, self._calls)
        if copy is not None:
            copy.order()
        return None

    def close(self) -> None:
        """After the last ``take``: end the background threads."""
        for pool in (self._thread, self._helpers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._thread = self._helpers = None


def _timed_copy(buf: HostBuffer, plan: CopyPlan, origin: Origin | None, record: SaveRecord,
                helpers: ThreadPoolExecutor | None = None, threads: int = 1,
                reuse: CopyCalls | None = None) -> CudaCopy | None:
    start, cpu = time.perf_counter(), time.thread_time()
    copy, helper_cpu = copy_into(buf, plan, origin, helpers, threads, reuse)
    record.snapshot_s = time.perf_counter() - start
    record.snapshot_cpu_s = time.thread_time() - cpu + helper_cpu
    return copy


class SaveHandle:
    """Returned by :meth:`Checkpointer.save`; ``wait_snapshot()`` before mutating the state."""

    def __init__(self, record: SaveRecord, snapshot: "Future[CudaCopy | None] | None") -> None:
        self.record = record
        self._snapshot = snapshot

    @property
    def step(self) -> int:
        return self.record.step

    def snapshot_done(self) -> bool:
        """Whether ``wait_snapshot()`` would not block (always true for a non-deferred save): the
        CPU copies are done and the CUDA copies queued (they may still run on the device)."""
        return self._snapshot is None or self._snapshot.done()

    def wait_snapshot(self) -> None:
        """Return when the state may be mutated again (re-raises a failed copy).

        CPU tensors: their copy is done. CUDA tensors: a CUDA tensor is only ever mutated by work
        queued on a stream, so no host sync is needed: the caller's stream of the ``save()`` call
        (and the current stream, if another) is made to wait on the copy-done event, and work
        queued on it afterwards (the optimizer step) cannot overtake the copy. Work on any other
        stream must be ordered after that one (``wait_stream``) before it writes the state.
        """
        if self._snapshot is not None:
            copy = self._snapshot.result()
            if copy is not None:
                copy.order()
