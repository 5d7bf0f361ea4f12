"""Planner: which elements of which tensor each rank snapshots and writes.

A pure, deterministic function of (tensor metadata, world size): every rank computes the same
plan alone, with no communication, and the manifest records the rule rather than a list of
slices, so its size does not grow with the world size.

The rule (DeepFreeze: every rank writes part of every layer):

* a tensor of at least ``split_threshold`` bytes is *split*: rank ``r`` of ``N`` owns elements
  ``[numel*r//N, numel*(r+1)//N)``;
* a smaller tensor is *whole* on one rank, packed largest-first onto the least-loaded rank;
* a *sharded* tensor (``DTensor``) is not placed here: each rank writes its own chunk, split in
  element ranges among the ranks that hold the same chunk (:func:`chunk_slice`).

``split_threshold = max(min_split_bytes, balance * total_bytes / N)``. Largest-first packing
overshoots the mean by at most the largest whole item, so tying the threshold to the per-rank
mean is what keeps every rank within ``balance`` of ``total/N`` (plus one element per split
tensor); the floor keeps tiny tensors whole (a 256-byte bias is not worth N slices, checksums
and index rows).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..sharding.boxes import Box, numel

SPLIT = -1
"""Owner value of a tensor that is split across all ranks."""
SHARDED = -2
"""Owner value of a sharded tensor (a ``DTensor``): every rank writes part of its own chunk."""

DEFAULT_BALANCE = 0.01
DEFAULT_MIN_SPLIT_BYTES = 1024


@dataclass(frozen=True)
class TensorMeta:
    """What the planner knows of a tensor: its element size and count (not its values)."""

    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Slice:
    """Elements ``[start, stop)`` of the flattened tensor ``tensor`` (an index into the table); of
    the chunk ``box`` of it when the tensor is sharded."""

    tensor: int
    start: int
    stop: int
    box: Box | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class Plan:
    """The placement of every tensor for one world size. ``owner[i]`` is a rank or :data:`SPLIT`."""

    world_size: int
    split_threshold: int
    owner: tuple[int, ...]

    def slices_for(self, rank: int, metas: Sequence[TensorMeta]) -> list[Slice]:
        """The non-empty slices ``rank`` writes, in tensor order (each rank calls it for itself)."""
        out = []
        for i, (meta, owner) in enumerate(zip(metas, self.owner)):
            if owner == SHARDED:
                continue
            if owner == SPLIT:
                start, stop = split_range(meta.numel, rank, self.world_size)
                if stop > start:
                    out.append(Slice(i, start, stop))
            elif owner == rank and meta.numel > 0:
                out.append(Slice(i, 0, meta.numel))
        return out

    def rank_bytes(self, metas: Sequence[TensorMeta]) -> list[int]:
        """Bytes each rank writes of the replicated tensors, for all ranks at once (O(tensors × ranks)
        in numpy)."""
        n = self.world_size
        loads = np.zeros(n, dtype=np.int64)
        bounds = np.arange(n + 1, dtype=np.int64)
        for meta, owner in zip(metas, self.owner):
            if owner == SPLIT:
                loads += np.diff(meta.numel * bounds // n) * meta.itemsize
            elif owner != SHARDED:
                loads[owner] += meta.nbytes
        return [int(x) for x in loads]


def split_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Element range ``[start, stop)`` of a split tensor that ``rank`` owns."""
    return numel * rank // world_size, numel * (rank + 1) // world_size


def chunk_slice(tensor: int, chunk: Box, replica: int, replicas: int) -> Slice | None:
    """What the ``replica``-th of the ``replicas`` ranks holding ``chunk`` of sharded tensor
    ``tensor`` writes: its share of the chunk's elements (``None``: nothing); the ranks holding the
    same chunk (replicated along a mesh dimension) write it once between them."""
    start, stop = split_range(numel(chunk), replica, replicas)
    return Slice(tensor, start, stop, box=chunk) if stop > start else None


def make_plan(
    metas: Sequence[TensorMeta],
    world_size: int,
    *,
    balance: float = DEFAULT_BALANCE,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
    sharded: Sequence[bool] = (),
) -> Plan:
    """Place every tensor for ``world_size`` ranks (see the module docstring for the rule);
    ``sharded[i]`` marks tensor ``i`` as sharded (left to its holders)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    is_sharded = [i < len(sharded) and bool(sharded[i]) for i in range(len(metas))]
    total = sum(m.nbytes for m, s in zip(metas, is_sharded) if not s)
    threshold = max(min_split_bytes, int(balance * total / world_size))
    owner = [SHARDED if s else SPLIT if (world_size > 1 and m.nbytes >= threshold) else 0
             for m, s in zip(metas, is_sharded)]
    if world_size > 1:
        small = sorted((i for i, o in enumerate(owner) if o >= 0), key=lambda i: (-metas[i].nbytes, i))
        heap = [(0, r) for r in range(world_size)]
        for i in small:
            load, rank = heapq.heappop(heap)
            owner[i] = rank
            heapq.heappush(heap, (load + metas[i].nbytes, rank))
    return Plan(world_size, threshold, tuple(owner))

