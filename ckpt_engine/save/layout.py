"""Where this rank's share of a state goes in its data file: the save plan's slices cut into
pieces of at most :data:`PIECE_BYTES`, placed at aligned offsets, and merged into the spans a copy
moves at once. Pure functions of the state's dtypes and shapes, cached by signature by
``Snapshots``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..format.entries import ALIGN, Piece, TensorEntry
from ..state.plan import Plan, Slice, TensorMeta, chunk_slice, make_plan
from ..state.values import Encoded, dtype_name

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
            offset += align_up(nbytes)
    for i, t in enumerate(local_tensors):
        pieces.append(Piece(True, i, 0, t.numel(), offset, t.numel() * t.element_size()))
        offset += align_up(t.numel() * t.element_size())
    return tuple(pieces), offset


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of the format's :data:`ALIGN`."""
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
