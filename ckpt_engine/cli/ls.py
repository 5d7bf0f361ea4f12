"""``ckpt ls``: the committed checkpoints below a root, oldest first, and with ``--all`` every other attempt.

Nothing is read but manifests and listings.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..format import catalog
from ..format.manifest import MANIFEST_NAME
from ..storage import Storage
from .common import OK, Parents, open_storage, print_json
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


def cmd_ls(args: argparse.Namespace) -> int:
    """Print the committed checkpoints (and with ``--all`` every other attempt), oldest first."""
    rows = ls_rows(open_storage(args), args.all)
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
    p.add_argument("--all", action="store_true", help="also list uncommitted, superseded and damaged attempts")
    p.set_defaults(fn=cmd_ls)
