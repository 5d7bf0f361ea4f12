"""``ckpt ls``: the committed checkpoints below a root, oldest first, and with ``--all`` every other attempt.

With several roots (the levels of one job, fastest first: ``ckpt ls /dev/shm/ckpt-suite/JOB /ckpt/run
s3://bucket/run``), one row per step and one column per level says which level holds which step.
A memory level's directory (levels/memory.py: ``node-*/rank-*/`` below it, or one level up) is
listed from its nodes' parts: a step is whole there when the nodes on this machine hold every
writer's part. Nothing is read but manifests, rank commits and listings.
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Any

from ..format import catalog
from ..format.entries import MANIFEST_NAME
from ..levels.open import assemblable, held_catalog
from ..storage import Storage, open_storage
from .common import OK, Parents, open_root, print_json
from .gc import usage
from .table import human, iso, render


def ls_rows(storage: Storage, include_all: bool = False) -> list[dict[str, Any]]:
    """One row per committed checkpoint, oldest first; ``include_all`` adds every other attempt directory."""
    entries = catalog.committed(storage)
    rows = [{"step": e.step, "world_size": e.manifest.world_size, "total_bytes": e.manifest.total_bytes,
             "rank_bytes": [r.data_bytes for r in e.manifest.ranks], "tensors": len(e.manifest.tensors),
             "time": iso(e.manifest.created_at), "dir": e.dirname,
             "status": "committed, latest" if i == len(entries) - 1 else "committed"}
            for i, e in enumerate(entries)]
    if include_all:
        chosen = {e.dirname for e in entries}
        for name in catalog.attempt_dirs(storage):
            if name not in chosen:
                rows.append(_other_row(storage, name, {e.step for e in entries}))
        rows += [_stray_row(name, kind) for name, kind in catalog.stray_entries(storage)]
        rows.sort(key=lambda r: (r["step"], r["dir"]))
    return rows


def _stray_row(name: str, kind: str) -> dict[str, Any]:
    """A file, link or special file named like a checkpoint directory: shown, never read."""
    return {"step": catalog.parse_dir(name)[0], "world_size": None, "total_bytes": 0,  # type: ignore[index]
            "rank_bytes": [], "tensors": None, "time": None, "dir": name, "status": f"not a checkpoint ({kind})"}


def _other_row(storage: Storage, name: str, committed_steps: set[int]) -> dict[str, Any]:
    step = catalog.parse_dir(name)[0]  # type: ignore[index]
    size, mtime = usage(storage, name)
    names = storage.listdir(name)
    if MANIFEST_NAME in names:
        status = "superseded" if step in committed_steps else "damaged manifest (ckpt verify)"
    else:
        indexes = sum(n.endswith(".index.json") for n in names)
        aborts = sum(n.endswith(".abort.json") for n in names)
        status = f"uncommitted ({indexes} index files" + (f", {aborts} aborted)" if aborts else ")")
    return {"step": step, "world_size": None, "total_bytes": size, "rank_bytes": [], "tensors": None,
            "time": iso(mtime) if mtime is not None else None, "dir": name, "status": status}


def node_dirs(root: str) -> list[str]:
    """The memory-level node directories at ``root`` (a node's, a job's or the memory root), sorted."""
    for depth in range(3):
        found = sorted(glob.glob(os.path.join(glob.escape(root), *["*"] * depth, "node-*")))
        found = [d for d in found if os.path.isdir(d) and not os.path.islink(d)]
        if found or os.path.basename(root.rstrip("/")).startswith("node-"):
            return found or [root]
    return []


def memory_steps(root: str) -> dict[int, str]:
    """What a memory level at ``root`` holds, by step: ``whole (node-0: 4/4 parts, ...)`` when the
    nodes here hold every writer's part of the newest attempt, else ``partial (...)``. Whole is what
    a restore on these nodes could assemble (levels/open.py's :func:`assemblable`, the restore's rule)."""
    nodes = node_dirs(root)
    held = [held_catalog(open_storage(node), 0, memory=True) for node in nodes]
    whole = {(step, dirname) for step, dirname, _ in assemblable(held)}
    parts: dict[tuple[int, str], dict[str, set[int]]] = {}
    writers: dict[tuple[int, str], int] = {}
    for node, view in zip(nodes, held):
        for writer, catalog_ in view.items():
            for step, dirname, world in catalog_:
                parts.setdefault((step, dirname), {}).setdefault(os.path.basename(node), set()).add(int(writer))
                writers[(step, dirname)] = world
    out: dict[int, str] = {}
    for key, by_node in sorted(parts.items()):  # a step's newest attempt last: it is the one listed
        where = ", ".join(f"{n}: {len(w)}/{writers[key]} parts" for n, w in sorted(by_node.items()))
        out[key[0]] = f"{'whole' if key in whole else 'partial'} ({where})"
    return out


def level_rows(args: argparse.Namespace, roots: list[str]) -> list[dict[str, Any]]:
    """One row per step any level holds: what each level (``roots``, fastest first) has of it."""
    columns: list[dict[int, str]] = []
    for path in roots:
        if "://" not in path.removeprefix("file://") and node_dirs(path.removeprefix("file://")):
            columns.append(memory_steps(path.removeprefix("file://")))
        else:
            columns.append({r["step"]: r["status"] for r in ls_rows(open_root(args, path))})
    steps = sorted(set().union(*columns))
    return [{"step": step, "levels": [{"level": i + 1, "root": root, "status": col.get(step)}
                                      for i, (root, col) in enumerate(zip(roots, columns))]} for step in steps]


def cmd_ls(args: argparse.Namespace) -> int:
    """Print the committed checkpoints (and with ``--all`` every other attempt), oldest first."""
    roots = [args.path, *args.more]
    if len(roots) > 1 or node_dirs(args.path.removeprefix("file://")):
        rows = level_rows(args, roots)
        if args.json:
            print_json(rows)
        elif not rows:
            print(f"no checkpoint on any of {', '.join(roots)}")
        else:
            heads = ("step", *(f"level {i + 1}: {root}" for i, root in enumerate(roots)))
            print("\n".join(render(heads, [(r["step"], *(lv["status"] or "-" for lv in r["levels"])) for r in rows],
                                   right=(0,))))
        return OK
    rows = ls_rows(open_root(args), args.all)
    if args.json:
        print_json(rows)
        return OK
    if not rows:
        print(f"no committed checkpoint at {args.path}")
        return OK
    table = []
    for r in rows:
        per_rank = ",".join(human(b) for b in r["rank_bytes"]) or "-"
        per_rank = per_rank if len(per_rank) <= 32 else per_rank[:29] + "..."
        table.append((r["step"], r["world_size"] or "-", human(r["total_bytes"]), per_rank, r["time"] or "-",
                      r["status"]))
    print("\n".join(render(("step", "ranks", "total", "per rank", "time", "status"), table, right=(0, 1, 2))))
    return OK


def add_parser(sub: Any, parents: Parents) -> None:
    """Register ``ckpt ls`` on the sub-parsers ``sub``."""
    p = sub.add_parser("ls", parents=[parents.path, parents.common, parents.json], help="list committed checkpoints")
    p.add_argument("more", nargs="*", metavar="ROOT",
                   help="the job's other levels, slower ones after: one column per level (a memory level's "
                        "directory is listed from its nodes' parts)")
    p.add_argument("--all", action="store_true", help="also list uncommitted, superseded and damaged attempts")
    p.set_defaults(fn=cmd_ls)
