"""``ckpt diff``: which values of two checkpoints' replicated states differ, and by how much.

Keys are matched by their flat key (:mod:`ckpt_engine.state.tree`). Tensors are read one at a time
(:func:`restore.tensor_reader`: verified, memory bounded by the largest tensor) and compared in
chunks; a tensor whose slices carry the same ranges and checksums in both checkpoints is
reported unchanged without reading it (same xxh3-64 over the same bytes). Plain values are
compared through their typed JSON, so ``1`` and ``True`` or ``1`` and ``1.0`` differ and NaN
equals NaN.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..load.open import Opened, open_newest
from ..load.read import tensor_reader
from ..progress import Bar
from ..state.tree import TensorRef, flatten, is_tensor, refs_tree, short_repr
from ..state.values import encode
from ..storage import Storage
from .common import DIFFERENT, OK, Parents, UsageError, open_root, print_json, wants_bar
from .table import render

CHUNK = 1 << 22
"""Elements compared at a time: bounds the temporary float64 copies to a few tens of MiB."""


@dataclass(frozen=True)
class Side:
    """One checkpoint to compare: where it is, and its opened (verified) metadata."""

    storage: Storage
    opened: Opened

    @property
    def label(self) -> str:
        return f"{self.storage.describe(self.opened.dirname)} (step {self.opened.manifest.step})"


@dataclass(frozen=True)
class Change:
    """The comparison of one key: ``status`` is changed, unchanged, added or removed.

    ``differing``: elements that differ bit for bit (tensors); ``max_abs_diff``: the largest
    ``|a - b|`` over them, computed in float64 (complex: modulus of the difference; ``None`` for
    bool, for dtype or shape changes, and when only NaNs differ).
    """

    key: str
    status: str
    a: str | None
    b: str | None
    numel: int | None = None
    differing: int | None = None
    max_abs_diff: float | None = None
    note: str = ""


@dataclass(frozen=True)
class Diff:
    """Every key of either side, A's order first, then keys only B has."""

    a: Side
    b: Side
    changes: tuple[Change, ...]

    @property
    def identical(self) -> bool:
        return all(c.status == "unchanged" for c in self.changes)

    def counts(self) -> dict[str, int]:
        out = {"changed": 0, "unchanged": 0, "added": 0, "removed": 0}
        for c in self.changes:
            out[c.status] += 1
        return out


def tensor_difference(a: torch.Tensor, b: torch.Tensor, chunk: int = CHUNK) -> tuple[int, float | None]:
    """``(elements differing bit for bit, max |a - b| in float64)`` of two same-dtype, same-shape tensors."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    item = a.element_size()
    differing, worst = 0, None
    for start in range(0, fa.numel(), chunk):
        x, y = fa[start:start + chunk], fb[start:start + chunk]
        ne = (x.view(torch.uint8).reshape(-1, item) != y.view(torch.uint8).reshape(-1, item)).any(dim=1)
        n = int(ne.sum())
        differing += n
        if n == 0 or a.dtype == torch.bool:
            continue
        wide = torch.complex128 if a.is_complex() else torch.float64
        d = (x[ne].to(wide) - y[ne].to(wide)).abs()
        d = d[~torch.isnan(d)]
        if d.numel():
            m = float(d.max())
            worst = m if worst is None else max(worst, m)
    if differing == 0 and a.dtype != torch.bool:
        worst = 0.0
    return differing, worst


def _signatures(ck: Opened) -> list[tuple]:
    """Per replicated tensor: its slices' (start, stop, checksum), sorted (equal → same bytes)."""
    sig: list[list[tuple[int, int, str]]] = [[] for _ in ck.manifest.tensors]
    for idx in ck.indexes:
        for e in idx.entries:
            if not e.local:
                sig[e.tensor].append((e.start, e.stop, e.xxh3))
    return [tuple(sorted(s)) for s in sig]


class _Side:
    """One side during a diff: flat leaves, tensor table, checksums and a streaming reader."""

    def __init__(self, side: Side) -> None:
        self.flat = flatten(refs_tree(side.opened.manifest.state))
        self.meta = side.opened.manifest.tensors
        self.sig = _signatures(side.opened)
        self.side = side
        self.read: Callable[[int], torch.Tensor] = lambda i: torch.empty(0)

    def describe(self, leaf: object) -> str:
        if isinstance(leaf, TensorRef):
            t = self.meta[leaf.index]
            return f"{t.dtype}{list(t.shape)}"
        if isinstance(leaf, np.ndarray):
            return f"{leaf.dtype.name}{list(leaf.shape)}"
        return short_repr(leaf, 32)

    def tensor(self, leaf: object) -> torch.Tensor:
        if isinstance(leaf, TensorRef):
            return self.read(leaf.index)
        return torch.from_numpy(np.ascontiguousarray(leaf))  # type: ignore[call-overload]


def _same_layout(a: _Side, x: object, b: _Side, y: object) -> bool:
    if isinstance(x, TensorRef) and isinstance(y, TensorRef):
        ta, tb = a.meta[x.index], b.meta[y.index]
        return (ta.dtype, ta.shape) == (tb.dtype, tb.shape)
    return False


def _same_checksums(a: _Side, x: TensorRef, b: _Side, y: TensorRef) -> bool:
    return a.sig[x.index] == b.sig[y.index]


def diff(a: Side, b: Side, *, progress: bool = False, threads: int = 4, chunk: int = CHUNK) -> Diff:
    """Compare the replicated states of ``a`` and ``b`` key by key (see the module docstring)."""
    sa, sb = _Side(a), _Side(b)
    pairs = {(x.index, y.index) for k, x in sa.flat.items() if k in sb.flat for y in (sb.flat[k],)
             if _same_layout(sa, x, sb, y) and not _same_checksums(sa, x, sb, y)}  # type: ignore[arg-type]
    total = sum(sa.meta[i].nbytes + sb.meta[j].nbytes for i, j in pairs)
    memo: dict[tuple[int, int], tuple[int, float | None]] = {}
    changes = []
    with Bar(total, "diff", progress) as bar:
        sa.read = tensor_reader(a.storage, a.opened, threads, bar.update)
        sb.read = tensor_reader(b.storage, b.opened, threads, bar.update)
        for key, x in sa.flat.items():
            if key in sb.flat:
                changes.append(_compare(key, sa, x, sb, sb.flat[key], memo, chunk))
            else:
                changes.append(Change(key, "removed", sa.describe(x), None))
        changes += [Change(key, "added", None, sb.describe(y)) for key, y in sb.flat.items() if key not in sa.flat]
    return Diff(a, b, tuple(changes))


def _compare(key: str, a: _Side, x: object, b: _Side, y: object,
             memo: dict[tuple[int, int], tuple[int, float | None]], chunk: int) -> Change:
    da, db = a.describe(x), b.describe(y)
    if is_tensor(x) != is_tensor(y):
        return Change(key, "changed", da, db, note="tensor on one side, plain value on the other")
    if not is_tensor(x):
        same = json.dumps(encode(x, key).tree) == json.dumps(encode(y, key).tree)
        return Change(key, "unchanged" if same else "changed", da, db)
    if isinstance(x, TensorRef) and isinstance(y, TensorRef):
        if not _same_layout(a, x, b, y):
            return Change(key, "changed", da, db, note="dtype or shape changed")
        numel = math.prod(a.meta[x.index].shape)
        if _same_checksums(a, x, b, y):
            return Change(key, "unchanged", da, db, numel, 0, 0.0, note="same checksums")
        pair = (x.index, y.index)
        if pair not in memo:  # tied tensors are compared once
            memo[pair] = tensor_difference(a.read(x.index), b.read(y.index), chunk)
        differing, worst = memo[pair]
        return Change(key, "changed" if differing else "unchanged", da, db, numel, differing, worst)
    ta, tb = a.tensor(x), b.tensor(y)  # an inline NumPy array on either side: small, compared in memory
    if (ta.dtype, ta.shape) != (tb.dtype, tb.shape):
        return Change(key, "changed", da, db, note="dtype or shape changed")
    differing, worst = tensor_difference(ta, tb, chunk)
    return Change(key, "changed" if differing else "unchanged", da, db, ta.numel(), differing, worst)


def _json_float(x: float | None) -> float | str | None:
    return x if x is None or math.isfinite(x) else str(x)


def _side_json(s: Side) -> dict:
    return {"root": s.storage.describe("").rstrip("/"), "dir": s.opened.dirname, "step": s.opened.manifest.step}


def to_json(d: Diff) -> dict:
    """The ``--json`` document of ``ckpt diff`` (see docs/CLI.md)."""
    return {"a": _side_json(d.a), "b": _side_json(d.b), "identical": d.identical, "counts": d.counts(),
            "changes": [{"key": c.key, "status": c.status, "a": c.a, "b": c.b, "numel": c.numel,
                         "differing": c.differing, "max_abs_diff": _json_float(c.max_abs_diff), "note": c.note}
                        for c in d.changes]}


def _values(c: Change) -> str:
    if c.a is None:
        return f"+ {c.b}"
    if c.b is None:
        return f"- {c.a}"
    return c.a if c.a == c.b else f"{c.a} → {c.b}"


def render_text(d: Diff, show_all: bool = False) -> str:
    """One row per key that differs (every key with ``show_all``), then the counts."""
    rows = []
    for c in d.changes:
        if c.status == "unchanged" and not show_all:
            continue
        detail = ""
        if c.differing is not None:
            detail = f"{c.differing}/{c.numel} elements differ"
            if c.max_abs_diff is not None and c.differing:
                detail += f", max |A-B| {c.max_abs_diff:.6g}"
        rows.append((c.key, c.status, _values(c), "; ".join(x for x in (detail, c.note) if x)))
    lines = [f"A: {d.a.label}", f"B: {d.b.label}"]
    if rows:
        lines += ["", *render(("key", "status", "A → B", "difference"), rows, indent="  ")]
    lines += ["", "identical" if d.identical else ", ".join(f"{n} {s}" for s, n in d.counts().items())]
    return "\n".join(lines)


def parse_refs(refs: Sequence[str]) -> list[tuple[str, int | None]]:
    """``PATH A B`` or ``PATH_A[@STEP] PATH_B[@STEP]`` → two (path, step) pairs; :class:`UsageError` otherwise."""
    if len(refs) == 3:
        path, a, b = refs
        try:
            return [(path, int(a)), (path, int(b))]
        except ValueError:
            raise UsageError(f"diff PATH A B: A and B must be steps (integers), got {a!r} and {b!r}") from None
    if len(refs) == 2:
        out = []
        for ref in refs:
            path, at, step = ref.rpartition("@")
            out.append((path, int(step)) if at and step.isdigit() else (ref, None))
        return out
    raise UsageError("diff takes PATH A B (two steps of one root) or PATH_A[@STEP] PATH_B[@STEP]")


def cmd_diff(args: argparse.Namespace) -> int:
    """Compare two checkpoints' replicated states; exit 0 when identical, 1 when they differ."""
    sides = []
    for path, step in parse_refs(args.refs):
        storage = open_root(args, path)
        sides.append(Side(storage, open_newest(storage, step)))
    result = diff(sides[0], sides[1], progress=wants_bar(args))
    if args.json:
        print_json(to_json(result))
    elif not args.quiet:
        print(render_text(result, args.all))
    return OK if result.identical else DIFFERENT


def add_parser(sub: Any, parents: Parents) -> None:
    """Register ``ckpt diff`` on the sub-parsers ``sub``."""
    p = sub.add_parser("diff", parents=[parents.common, parents.json],
                       help="compare two checkpoints (exit 1 when they differ)")
    p.add_argument("refs", nargs="+", metavar="REF",
                   help="PATH A B (two steps of one root) or PATH_A[@STEP] PATH_B[@STEP]")
    p.add_argument("--all", action="store_true", help="also list unchanged keys")
    p.set_defaults(fn=cmd_diff)
