"""Boxes: the geometry of chunks of a tensor. Pure functions of shapes and ranges, no tensors.

A box is a tuple of half-open index ranges, one per dimension: ``((0, 2), (0, 5))`` is rows 0-1
of a ``[3, 5]`` tensor. A 0-d tensor has the empty box ``()`` (one element). Every stored piece of
a tensor is a range of elements ``[start, stop)`` of the row-major order of a box (the whole
tensor, or the chunk a rank held): :func:`index_boxes` turns such a range into at most
``2 * ndim - 1`` boxes, so any stored piece can be placed into any other chunk by intersecting
boxes (:func:`intersect`).
"""

from __future__ import annotations

from math import prod
from typing import Iterable, Sequence

Box = tuple[tuple[int, int], ...]
"""Half-open index ranges, one per dimension."""

MAX_GRID_CELLS = 1 << 22
"""Most cells :func:`tiling_error` checks (the product over dimensions of the distinct cuts): the
chunks of real meshes make a few thousand; a hostile index cannot make a reader spin."""


def full_box(shape: Sequence[int]) -> Box:
    """The box of a whole tensor of ``shape``."""
    return tuple((0, n) for n in shape)


def box_of(offsets: Sequence[int], lengths: Sequence[int]) -> Box:
    """The box at ``offsets`` of size ``lengths`` (what ``DTensor`` chunk metadata gives)."""
    return tuple((o, o + n) for o, n in zip(offsets, lengths))


def sizes(box: Box) -> tuple[int, ...]:
    """The box's length in each dimension (the shape of the chunk)."""
    return tuple(b - a for a, b in box)


def numel(box: Box) -> int:
    """Elements in the box (1 for the 0-d box ``()``)."""
    return prod(b - a for a, b in box)


def within(box: Box, shape: Sequence[int]) -> bool:
    """Whether ``box`` has ``len(shape)`` dimensions and lies inside a tensor of ``shape``."""
    return len(box) == len(shape) and all(0 <= a <= b <= n for (a, b), n in zip(box, shape))


def shift(box: Box, origin: Box) -> Box:
    """``box`` (relative to the chunk ``origin``) in the coordinates of the whole tensor."""
    return tuple((a + o, b + o) for (a, b), (o, _) in zip(box, origin))


def relative(box: Box, origin: Box) -> tuple[slice, ...]:
    """Index of ``box`` (whole-tensor coordinates) into the chunk at ``origin``: ``chunk[relative(...)]``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of one tensor, or ``None`` when it has no element."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def index_boxes(shape: Sequence[int], start: int, stop: int) -> tuple[Box, ...]:
    """Elements ``start:stop`` of a row-major flattening of ``shape`` as at most ``2 * ndim - 1``
    boxes, in order (their row-major flattenings, concatenated, are the range)."""
    if start >= stop:
        return ()
    if not shape:
        return ((),)
    inner = prod(shape[1:])
    a, ra = divmod(start, inner)
    b, rb = divmod(stop, inner)
    if a == b:
        return tuple(((a, a + 1),) + box for box in index_boxes(shape[1:], ra, rb))
    out: list[Box] = []
    if ra:
        out += [((a, a + 1),) + box for box in index_boxes(shape[1:], ra, inner)]
        a += 1
    if b > a:
        out.append(((a, b),) + tuple((0, n) for n in shape[1:]))
    if rb:
        out += [((b, b + 1),) + box for box in index_boxes(shape[1:], 0, rb)]
    return tuple(out)


def range_boxes(chunk: Box, start: int, stop: int) -> tuple[tuple[int, Box], ...]:
    """Elements ``start:stop`` of the row-major order of ``chunk`` as boxes of the whole tensor,
    each with the position of its first element within the range."""
    out, at = [], 0
    for box in index_boxes(sizes(chunk), start, stop):
        out.append((at, shift(box, chunk)))
        at += numel(box)
    return tuple(out)


def contiguous_start(inner: Box, outer: Box) -> int | None:
    """Where ``inner`` starts in the row-major order of ``outer`` when its elements are one run
    there (so a piece of ``inner`` can be read straight into ``outer``'s memory), else ``None``.

    One run: before the last dimension where ``inner`` is shorter than ``outer``, every dimension
    has length 1 (after it, every dimension is whole by definition).
    """
    if len(inner) != len(outer) or any(not (o0 <= i0 <= i1 <= o1) for (i0, i1), (o0, o1) in zip(inner, outer)):
        return None
    short = [d for d, ((i0, i1), (o0, o1)) in enumerate(zip(inner, outer)) if (i0, i1) != (o0, o1)]
    if short and any(inner[d][1] - inner[d][0] != 1 for d in range(short[-1])):
        return None
    start, stride = 0, 1
    for (i0, _), (o0, o1) in zip(reversed(inner), reversed(outer)):
        start += (i0 - o0) * stride
        stride *= o1 - o0
    return start


def tiling_error(boxes: Iterable[Box], shape: Sequence[int]) -> str | None:
    """Why ``boxes`` do not cover a tensor of ``shape`` exactly once, or ``None`` when they do.

    Empty boxes are ignored. Each box is mapped onto the grid of every cut any box makes, and
    every grid cell must be covered by exactly one box (cost: the cells, at most
    :data:`MAX_GRID_CELLS`).
    """
    boxes = [b for b in boxes if numel(b) > 0]
    for b in boxes:
        if not within(b, shape):
            return f"chunk {list(b)} lies outside the tensor's shape {list(shape)}"
    if prod(shape) == 0:
        return None if not boxes else f"chunks of an empty tensor of shape {list(shape)}"
    cuts = [sorted({0, n} | {x for b in boxes for x in b[d]}) for d, n in enumerate(shape)]
    cells = prod(len(c) - 1 for c in cuts)
    if cells > MAX_GRID_CELLS:
        return f"{len(boxes)} chunks cut the tensor into {cells} cells, more than the {MAX_GRID_CELLS} a reader checks"
    where = [{x: i for i, x in enumerate(c)} for c in cuts]
    strides = [prod(len(c) - 1 for c in cuts[d + 1:]) for d in range(len(cuts))]
    seen = bytearray(cells)
    for b in boxes:
        ranges = [range(where[d][lo], where[d][hi]) for d, (lo, hi) in enumerate(b)]
        for cell in _cells(ranges, strides):
            if seen[cell]:
                return f"chunk {list(b)} overlaps another chunk"
            seen[cell] = 1
    if not all(seen):
        return f"the chunks leave part of the tensor of shape {list(shape)} uncovered"
    return None


def _cells(ranges: Sequence[range], strides: Sequence[int]) -> Iterable[int]:
    if not ranges:
        yield 0
        return
    for i in ranges[0]:
        for rest in _cells(ranges[1:], strides[1:]):
            yield i * strides[0] + rest
