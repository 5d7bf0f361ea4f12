"""``ckpt inspect``: what one checkpoint holds, from its manifest and index files alone.

No data file is read: tensor dtypes, shapes and placement come from the tensor tables (a sharded
tensor's mesh and placements from the manifest, its chunks and the ranks that wrote each from the
index files), plain values from the typed-JSON trees (all verified by :func:`restore.open_checkpoint`).
Keys are the flat keys of :mod:`ckpt_engine.state.tree`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..format.entries import TensorEntry
from ..load.open import Opened, open_newest
from ..state.tree import TensorRef, flatten, is_tensor, refs_tree, short_repr, type_name
from ..state.values import encode
from .common import OK, Parents, UsageError, open_root, print_json
from .table import human, iso, render


@dataclass(frozen=True)
class TensorRow:
    """One tensor of a tree: ``index`` into its table (-1: a small NumPy array stored inline)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    placement: str
    index: int
    tied_to: str | None = None
    numpy: bool = False
    chunks: tuple[Chunk, ...] = ()
    """A sharded tensor's chunks, as stored."""


@dataclass(frozen=True)
class Chunk:
    """One chunk of a sharded tensor: its box (``[start, stop)`` per dimension) and who wrote it."""

    box: tuple[tuple[int, int], ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ValueRow:
    """One plain (non-tensor) value: its type, a shortened ``repr`` and its exact typed JSON."""

    key: str
    type: str
    text: str
    value: Any


@dataclass(frozen=True)
class RankRow:
    """What one writer rank holds: its file's bytes and its own ``local`` tree."""

    rank: int
    data_bytes: int
    state_bytes: int
    local_bytes: int
    tensors: tuple[TensorRow, ...]
    values: tuple[ValueRow, ...]
    stats: dict


@dataclass(frozen=True)
class Contents:
    """A checkpoint's replicated tree and every rank's local tree, described."""

    dirname: str
    step: int
    world_size: int
    created_at: float
    total_bytes: int
    tensors: tuple[TensorRow, ...]
    values: tuple[ValueRow, ...]
    ranks: tuple[RankRow, ...]


def _placement(t: TensorEntry, world: int, chunks: int = 0) -> str:
    if t.sharding is not None:
        names = f" ({', '.join(t.sharding.mesh_dims)})" if t.sharding.mesh_dims else ""
        return (f"sharded {', '.join(t.sharding.placements)} on mesh {list(t.sharding.mesh)}{names}: "
                f"{chunks} chunk{'s' if chunks != 1 else ''}")
    return f"split over {world} ranks" if t.owner == -1 else f"rank {t.owner}"


def _chunks(ck: Opened) -> dict[int, tuple[Chunk, ...]]:
    """Each sharded tensor's chunks (ordered by box) with the ranks that wrote part of each."""
    found: dict[int, dict[tuple, set[int]]] = {}
    for idx in ck.indexes:
        for e in idx.entries:
            if e.box is not None:
                found.setdefault(e.tensor, {}).setdefault(e.box, set()).add(idx.rank)
    return {i: tuple(Chunk(box, tuple(sorted(ranks))) for box, ranks in sorted(boxes.items()))
            for i, boxes in found.items()}


def _rows(tree: Any, table: Sequence[TensorEntry], placement: Any, width: int,
          chunks: dict[int, tuple[Chunk, ...]] | None = None) -> tuple[tuple[TensorRow, ...], tuple[ValueRow, ...]]:
    """Tensor and value rows of a typed-JSON tree whose tensors index ``table``."""
    tensors: list[TensorRow] = []
    values: list[ValueRow] = []
    first: dict[int, str] = {}
    for key, leaf in flatten(refs_tree(tree)).items():
        if isinstance(leaf, TensorRef):
            t = table[leaf.index]
            mine = (chunks or {}).get(leaf.index, ())
            tensors.append(TensorRow(key, t.dtype, t.shape, t.nbytes, placement(t, len(mine)), leaf.index,
                                     first.get(leaf.index), leaf.as_numpy, mine))
            first.setdefault(leaf.index, key)
        elif is_tensor(leaf):  # an inline NumPy array ($ndarray), stored in the JSON itself
            a: np.ndarray = leaf  # type: ignore[assignment]
            tensors.append(TensorRow(key, a.dtype.name, tuple(a.shape), a.nbytes, "inline", -1, None, True))
        else:
            values.append(ValueRow(key, type_name(leaf), short_repr(leaf, width), encode(leaf, key).tree))
    return tuple(tensors), tuple(values)


def describe(ck: Opened, width: int = 80) -> Contents:
    """Describe ``ck``; ``width`` bounds the shortened value texts."""
    m = ck.manifest
    tensors, values = _rows(m.state, m.tensors, lambda t, n: _placement(t, m.world_size, n), width, _chunks(ck))
    ranks = []
    for idx in ck.indexes:
        lt, lv = _rows(idx.local, idx.local_tensors, lambda t, n: "local", width)
        state_bytes = sum(e.nbytes for e in idx.entries if not e.local)
        local_bytes = sum(e.nbytes for e in idx.entries if e.local)
        ranks.append(RankRow(idx.rank, idx.data_bytes, state_bytes, local_bytes, lt, lv, dict(idx.stats)))
    return Contents(ck.dirname, m.step, m.world_size, m.created_at, m.total_bytes, tensors, values, tuple(ranks))


def _tensor_json(t: TensorRow) -> dict:
    out = {"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "placement": t.placement,
           "index": t.index, "tied_to": t.tied_to, "numpy": t.numpy}
    if t.chunks:
        out["chunks"] = [{"box": [list(r) for r in c.box], "ranks": list(c.ranks)} for c in t.chunks]
    return out


def _value_json(v: ValueRow) -> dict:
    return {"key": v.key, "type": v.type, "repr": v.text, "value": v.value}


def to_json(c: Contents) -> dict:
    """The ``--json`` document of ``ckpt inspect`` (see docs/CLI.md)."""
    return {
        "dir": c.dirname, "step": c.step, "world_size": c.world_size, "time": iso(c.created_at),
        "created_at": c.created_at, "total_bytes": c.total_bytes,
        "state": {"tensors": [_tensor_json(t) for t in c.tensors], "values": [_value_json(v) for v in c.values],
                  "bytes": sum(t.nbytes for t in c.tensors if t.tied_to is None)},
        "ranks": [{"rank": r.rank, "data_bytes": r.data_bytes, "state_bytes": r.state_bytes,
                   "local_bytes": r.local_bytes, "stats": r.stats,
                   "local": {"tensors": [_tensor_json(t) for t in r.tensors],
                             "values": [_value_json(v) for v in r.values]}} for r in c.ranks],
    }


def _tensor_lines(tensors: Sequence[TensorRow], indent: str) -> list[str]:
    rows = [(t.key, t.dtype + (" (numpy)" if t.numpy else ""), list(t.shape),
             "-" if t.tied_to else human(t.nbytes), f"tied to {t.tied_to}" if t.tied_to else t.placement)
            for t in tensors]
    return render(("key", "dtype", "shape", "bytes", "placement"), rows, right=(3,), indent=indent)


def _value_lines(values: Sequence[ValueRow], indent: str) -> list[str]:
    return render(("key", "type", "value"), [(v.key, v.type, v.text) for v in values], indent=indent)


def _chunk_lines(tensors: Sequence[TensorRow], indent: str) -> list[str]:
    rows = [(t.key if i == 0 else "", ", ".join(f"{a}:{b}" for a, b in c.box) or "(scalar)",
             ",".join(map(str, c.ranks))) for t in tensors if t.tied_to is None for i, c in enumerate(t.chunks)]
    return render(("sharded tensor", "chunk", "written by ranks"), rows, indent=indent) if rows else []


def render_text(c: Contents, detail_ranks: Sequence[int], chunks: bool = False) -> str:
    """The human-readable report; ranks in ``detail_ranks`` get their local tensors and values
    listed; ``chunks``: every chunk of every sharded tensor, with the ranks that wrote it."""
    unique = sum(t.nbytes for t in c.tensors if t.tied_to is None)
    lines = [f"step {c.step}  {c.dirname}  {c.world_size} rank(s)  {human(c.total_bytes)} on storage  "
             f"committed {iso(c.created_at)}", "",
             f"{'sharded and ' if any(t.chunks for t in c.tensors) else ''}replicated state: {len(c.tensors)} tensors "
             f"({human(unique)}), {len(c.values)} other values"]
    if c.tensors:
        lines += _tensor_lines(c.tensors, "  ")
    if chunks:
        lines += ["", *_chunk_lines(c.tensors, "  ")]
    if c.values:
        lines += ["", *_value_lines(c.values, "  ")]
    for r in c.ranks:
        lines += ["", f"rank {r.rank}: {human(r.data_bytes)} file (state slices {human(r.state_bytes)}, "
                      f"local {human(r.local_bytes)}); local: {len(r.tensors)} tensors, {len(r.values)} values"]
        if r.rank in detail_ranks:
            if r.tensors:
                lines += _tensor_lines(r.tensors, "  ")
            if r.values:
                lines += _value_lines(r.values, "  ")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Describe one checkpoint: replicated tensors and values, and every rank's local values (or ``--rank``'s)."""
    if args.width < 10:
        raise UsageError(f"--width must be at least 10, got {args.width}")
    opened = open_newest(open_root(args), args.step)
    bad = [r for r in args.rank if not 0 <= r < opened.manifest.world_size]
    if bad:
        raise UsageError(f"--rank {bad[0]}: the checkpoint of step {opened.manifest.step} has ranks "
                         f"0..{opened.manifest.world_size - 1}")
    contents = describe(opened, args.width)
    if args.json:
        print_json(to_json(contents))
        return OK
    ranks = args.rank if args.rank else ([r.rank for r in contents.ranks] if contents.world_size <= 8 else [0])
    print(render_text(contents, ranks, args.chunks))
    return OK


def add_parser(sub: Any, parents: Parents) -> None:
    """Register ``ckpt inspect`` on the sub-parsers ``sub``."""
    p = sub.add_parser("inspect", parents=[parents.path, parents.step, parents.common, parents.json],
                       help="tensors (dtype, shape, bytes, placement) and plain values of a checkpoint")
    p.add_argument("--rank", type=int, action="append", default=[],
                   help="list this writer rank's local values in full (repeatable; default: all up to 8 ranks)")
    p.add_argument("--width", type=int, default=80, help="cut value texts to about this many characters")
    p.add_argument("--chunks", action="store_true",
                   help="list every chunk of every sharded tensor and the ranks that wrote it")
    p.set_defaults(fn=cmd_inspect)
