"""Where the bytes read go: :class:`Target` regions of the table's tensors, and :class:`Places`,
which maps each stored piece onto the targets it meets (read in place where its elements are one run
of one contiguous CPU target, else through a temporary scattered box by box). New tensors are
allocated for what the manifest claims, so their bytes are checked against this process's memory
first (headroom.py: :func:`whole_targets`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from ..format.entries import IndexEntry, TensorEntry
from ..host import headroom, hugepages
from ..sharding.boxes import Box, contiguous_start, full_box, intersect, numel, range_boxes, relative
from ..state.values import parse_dtype
from .open import tensor_name

@dataclass(frozen=True)
class Target:
    """Region ``box`` of table tensor ``tensor``, to be filled into ``out`` (shaped as the box; on
    any device)."""

    tensor: int
    box: Box
    out: torch.Tensor


class Places:
    """Where each stored piece goes: the targets it meets, and whether it can be read in place.

    Thread-safe after construction (reader threads only read it; targets are disjoint per tensor
    or receive identical bytes).
    """

    def __init__(self, table: Sequence[TensorEntry], targets: Sequence[Target]) -> None:
        self.table = table
        self.targets: dict[int, list[Target]] = {}
        for t in targets:
            self.targets.setdefault(t.tensor, []).append(t)
        # Tensors a target covers whole (every piece of them is needed), and the bytes of each
        # tensor's target where pieces can be read in place (one contiguous CPU target) with its
        # element size: decided once per target, not once per piece. This and ``needed`` run on
        # the calling thread before the reader threads start, so they add to the restore's wall
        # time: for the benchmark's 364 tensors and 556 pieces 1.42 + 0.52 ms with a NumPy view
        # of each target and the boxes compared per piece, 0.87 + 0.07 ms now (medians of 50).
        self._whole = {i for i, ts in self.targets.items() if any(t.box == full_box(table[i].shape) for t in ts)}
        self._flat: dict[int, tuple[memoryview, int]] = {
            i: (bytes_of(ts[0].out), ts[0].out.element_size())
            for i, ts in self.targets.items()
            if len(ts) == 1 and ts[0].out.is_cpu and ts[0].out.is_contiguous()}

    def chunk(self, e: IndexEntry) -> Box:
        """The box ``e``'s element range is of: its chunk, or the whole tensor."""
        return e.box if e.box is not None else full_box(self.table[e.tensor].shape)

    def needed(self, e: IndexEntry) -> bool:
        """Whether any target meets the piece ``e``."""
        if e.tensor in self._whole:
            return True  # a whole tensor needs every piece
        return any(intersect(b, t.box) is not None for _, b in range_boxes(self.chunk(e), e.start, e.stop)
                   for t in self.targets.get(e.tensor, ()))

    def in_place(self, e: IndexEntry) -> memoryview | None:
        """The bytes of the one target where ``e``'s elements are one run, or ``None`` (use a temporary)."""
        flat = self._flat.get(e.tensor)
        if flat is None:
            return None
        (t,), chunk = self.targets[e.tensor], self.chunk(e)
        at = e.start if chunk == t.box else None
        if at is None:
            whole = full_box(self.table[e.tensor].shape)
            c0, t0 = contiguous_start(chunk, whole), contiguous_start(t.box, whole)
            if c0 is None or t0 is None or not t0 <= c0 + e.start <= c0 + e.stop <= t0 + numel(t.box):
                return None
            at = c0 + e.start - t0
        data, item = flat
        return data[at * item:(at + e.stop - e.start) * item]

    def destination(self, e: IndexEntry) -> tuple[memoryview, torch.Tensor | None]:
        """Where to read ``e``'s bytes: the target's own memory (``temp`` ``None``), or a new
        temporary of the piece's size, to :meth:`scatter` from once verified."""
        view = self.in_place(e)
        if view is not None:
            return view, None
        temp = torch.empty(e.stop - e.start, dtype=parse_dtype(self.table[e.tensor].dtype))
        return bytes_of(temp), temp

    def scatter(self, e: IndexEntry, piece: torch.Tensor) -> None:
        """Copy the verified elements of ``e`` (``piece``, flat) into every target they meet."""
        for at, b in range_boxes(self.chunk(e), e.start, e.stop):
            src = piece[at:at + numel(b)].view(tuple(hi - lo for lo, hi in b))
            for t in self.targets.get(e.tensor, ()):
                common = intersect(b, t.box)
                if common is not None:
                    t.out[relative(common, t.box)].copy_(src[relative(common, b)])


def whole_targets(table: Sequence[TensorEntry], which: Sequence[int] | None = None, *,
                  where: str = "the checkpoint", what: str = "reading it", prefix: str = "") -> list[Target]:
    """A new CPU tensor for every tensor of ``table`` (or those ``which`` names), whole.

    Refused before any is allocated, as :class:`InsufficientMemoryError` naming ``where`` (the file
    that claims them), the largest tensor (``prefix`` before its name), the bytes needed and the
    bytes available, when together they are more than this process can have (headroom.py): a
    table is what the manifest claims, not what the data file holds. An allocation the allocator
    refuses anyway is the same error.
    """
    chosen = range(len(table)) if which is None else which
    claims = [(f"{prefix}{tensor_name(table[i], i)}", table[i].nbytes) for i in chosen]
    headroom.refuse_beyond(claims, where, what)
    try:
        return [Target(i, full_box(table[i].shape), _empty(table[i])) for i in chosen]
    except (RuntimeError, MemoryError) as e:  # torch's allocation failure is a RuntimeError
        raise headroom.too_large(claims, where, what, None) from e


def _empty(t: TensorEntry) -> torch.Tensor:
    # Huge pages where large: a page fault per 2 MiB, not per 4 KiB (figures in hugepages.py).
    return hugepages.empty(t.shape, parse_dtype(t.dtype))


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t``, writable, as one flat memoryview that keeps
    ``t`` alive. Through ctypes: 0.7 us a tensor against 2.8 us for ``t.view(torch.uint8).numpy()``
    (the restore makes one per target before its reader threads start)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    area = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    area.tensor = t  # type: ignore[attr-defined]  # the view must not outlive the memory
    return memoryview(area).cast("B")
