"""How a snapshot is copied: the CPU spans as ``memmove`` calls outside the GIL (split among the
rank's copy threads in 4 MiB chunks taken in turn), the CUDA ones queued on a side stream
(cuda_copy.py). Pure planning (:func:`plan_copy`, :func:`moves`, :func:`split`) beside the copy.

When every piece is on the CPU, each piece is checksummed right after it is copied, by the thread
that copied it, while its bytes are still in that core's cache (:func:`piece_moves`): persist then
has no pass of its own over the buffer. Why: copy then hash of a 176 MiB state took 25.2 ms of CPU
here, copy and hash a piece at a time 20.0 ms; beside training, persist's separate pass cost 12.8 ms
(bench_lightning, 2026-11-28).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import xxhash

from ..format.entries import Piece
from .buffers import HostBuffer
from .cuda_copy import CudaCopy, Gather, Origin, queue
from .layout import Span, align_up, spans

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
    pieces: tuple[tuple[Piece, torch.Tensor], ...] = ()
    """When every piece is on the CPU: each piece (in buffer order) and its tensor, copied and
    checksummed one at a time (:func:`piece_moves`); empty otherwise (persist checksums)."""

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
        hashed = tuple((p, (local if p.local else state)[p.tensor]) for p in pieces)
        return CopyPlan(host, (), (), nbytes, (), layout, hashed)
    direct, gathers, devices = [], [], {}
    end = align_up(nbytes)
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
            end += align_up(g.span_bytes)
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


HashedMove = tuple[int, int, int, int, int, int]
"""One piece: destination address, source address, bytes; then the piece's index and the bytes of
the buffer its checksum covers, ``[start, end)`` (the piece and its padding up to the next one)."""


def piece_moves(buf: HostBuffer, pieces: Sequence[tuple[Piece, torch.Tensor]],
                nbytes: int) -> tuple[list[HashedMove], list[torch.Tensor]]:
    """One ``memmove`` per piece of ``pieces`` (all of the data file's, in buffer order), with the
    extent persist would checksum for it, and the tensors they read from (held by the caller, as
    for :func:`moves`)."""
    out: list[HashedMove] = []
    bases: dict[int, tuple[torch.Tensor, int]] = {}
    ends = [p.offset for p, _ in pieces[1:]] + [nbytes]
    for k, ((p, src), end) in enumerate(zip(pieces, ends)):
        base = bases.get(id(src))
        if base is None:
            flat = src if src.is_contiguous() else src.contiguous()
            base = bases[id(src)] = (flat, flat.data_ptr())
        out.append((buf.address + p.offset, base[1] + p.start * src.element_size(), p.nbytes, k, p.offset, end))
    return out, [flat for flat, _ in bases.values()]


def group(calls: Sequence[HashedMove], size: int) -> list[list[HashedMove]]:
    """Consecutive pieces gathered into runs of at least ``size`` bytes (the last may be less); a
    piece is never cut, since its checksum is of the whole of it."""
    runs: list[list[HashedMove]] = [[]]
    filled = 0
    for call in calls:
        if filled >= size:
            runs.append([])
            filled = 0
        runs[-1].append(call)
        filled += call[2]
    return [r for r in runs if r]


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


class _HashedRun:
    """Copies pieces and checksums each right after its copy, into ``digests`` by piece index."""

    def __init__(self, view: memoryview, count: int) -> None:
        self.view = view
        self.digests: list[str | None] = [None] * count

    def __call__(self, calls: Sequence[HashedMove]) -> None:
        memmove, digest, view, out = ctypes.memmove, xxhash.xxh3_64_hexdigest, self.view, self.digests
        for dst, src, n, k, start, end in calls:
            if n:
                memmove(dst, src, n)
            out[k] = digest(view[start:end])


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

    def __init__(self, runs: Sequence[Sequence[Any]], run: Callable[[Sequence[Any]], None] = _copy_run) -> None:
        self.runs, self._run = runs, run
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
                self._run(self.runs[k])
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
        self._calls: list[Any] = []
        self._runs: list[list[Any]] = []

    def of(self, buf: HostBuffer, plan: CopyPlan,
           chunks: int) -> tuple[list[Any], list[list[Any]], list[torch.Tensor]]:
        """The calls that copy ``plan``'s CPU spans into ``buf``, those calls cut into ``chunks``
        runs of consecutive bytes (:func:`split`; none when ``chunks`` is 0), and the tensors they
        read from (held by the caller until the calls are done). A plan with :attr:`CopyPlan.pieces`
        gets one call per piece (:func:`piece_moves`), gathered into runs of about
        :data:`COPY_CHUNK` bytes (:func:`group`) when ``chunks`` is not 0."""
        sources = [t for _, t in plan.host]
        key = None
        if plan.layout is not None and all(t.is_contiguous() for t in sources):
            key = (buf.address, chunks, tuple(t.data_ptr() for t in sources))
            if plan.layout is self._layout and key == self._key:
                return self._calls, self._runs, sources
        if plan.pieces:  # a piece at a time, each checksummed after its copy
            calls, held = piece_moves(buf, plan.pieces, plan.nbytes)  # type: ignore[assignment]
            runs = group(calls, COPY_CHUNK) if chunks else []  # type: ignore[arg-type]
        else:
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
    Returns the CUDA copy (or ``None``) and the CPU seconds of the helper threads. With
    :attr:`CopyPlan.pieces`, ``buf.checksums`` holds each piece's checksum on return (else ``None``).

    On return the CPU pieces are in the buffer; CUDA pieces are queued on a side stream after
    ``origin`` (the caller's stream at ``save()``): ``buf.event`` (also returned) orders the
    training stream after them (``order()``) and lets persist wait for them (``synchronize()``).
    """
    host_bytes, helper_cpu = plan.host_bytes, 0.0
    buf.checksums = None
    shared = helpers is not None and threads > 1 and host_bytes >= SPLIT_MIN
    parts = -(-host_bytes // COPY_CHUNK) if shared else 0
    calls, runs, sources = (reuse or CopyCalls()).of(buf, plan, parts)  # ``sources`` outlive the calls
    hashed = _HashedRun(buf.view(plan.nbytes), len(plan.pieces)) if plan.pieces else None
    run: Callable[[Sequence[Any]], None] = hashed if hashed is not None else _copy_run
    if shared:
        assert helpers is not None
        chunks = _Chunks(runs, run)
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
        run(calls)
    del sources  # every call is done: the contiguous copies may go
    if hashed is not None:
        buf.checksums = tuple(hashed.digests)  # type: ignore[arg-type]
    buf.event = queue(buf, plan.direct, plan.gathers, origin) if origin is not None else None
    return buf.event, helper_cpu
