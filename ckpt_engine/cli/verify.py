"""``ckpt verify``: read every byte of one checkpoint (the newest, ``--step N``, or ``--all``) and check every checksum.

Exit 1 when any checkpoint fails (a checksum mismatch, a missing or truncated file, a malformed
manifest, tensors claimed larger than this process's memory: refused before allocating, so it is
not verified), each failure on stderr naming the file.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .. import progress
from ..errors import CorruptionError, FormatError, InsufficientMemoryError, NoCheckpointError
from ..format import catalog
from ..load.open import open_checkpoint, open_newest
from ..load.read import verify
from ..storage import Storage
from .common import DIFFERENT, OK, Parents, open_root, print_json, root, wants_bar
from .table import human


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify the chosen checkpoints; print one line (or one JSON document) and return 0, or 1 on a failure."""
    store = open_root(args)
    if args.all:  # every committed checkpoint, and damaged manifests of steps with no readable one
        entries = catalog.committed(store)
        steps = {e.step for e in entries}
        found = sorted([(e.step, e.dirname) for e in entries]
                       + [(st, d) for st, d in catalog.manifest_dirs(store) if st not in steps])
        if not found:
            raise NoCheckpointError(f"no committed checkpoint at {root(store)}")
    else:
        found = catalog.manifest_dirs(store, args.step)[-1:]
        if not found:
            open_newest(store, args.step)  # raises the "no checkpoint" error
    results = [verify_one(store, dirname, wants_bar(args)) for _, dirname in found]
    failed = [r for r in results if not r["ok"]]
    if args.json:
        print_json({"ok": not failed, "checkpoints": results})
    else:
        for r in results:
            if r["ok"] and not args.quiet:
                print(f"OK step {r['step']}: {r['tensors']} tensors, {human(r['bytes'])} in "
                      f"{r['world_size']} rank files verified ({r['dir']})")
            elif not r["ok"]:
                print(f"FAILED {store.describe(r['dir'])}: {r['error']}", file=sys.stderr)
    return DIFFERENT if failed else OK


def verify_one(storage: Storage, dirname: str, bar: bool) -> dict[str, Any]:
    """Verify the checkpoint directory ``dirname``: its row (``ok``, ``error`` and what the manifest says).

    A corrupt or malformed checkpoint, or one whose tensors would not fit in memory (not verified:
    refused before allocating), is a row with ``ok`` false; storage errors propagate.
    """
    row: dict[str, Any] = {"dir": dirname, "step": catalog.parse_dir(dirname)[0],  # type: ignore[index]
                           "world_size": None, "tensors": None, "bytes": None}
    try:
        opened = open_checkpoint(storage, dirname)
        m = opened.manifest
        row.update(step=m.step, world_size=m.world_size, tensors=len(m.tensors), bytes=m.total_bytes)
        total = sum(e.nbytes for idx in opened.indexes for e in idx.entries)
        with progress.Bar(total, f"verify step {m.step}", bar) as b:
            verify(storage, opened, progress=b.update)
    except (CorruptionError, FormatError, InsufficientMemoryError) as e:
        return {**row, "ok": False, "error": str(e)}
    return {**row, "ok": True, "error": None}


def add_parser(sub: Any, parents: Parents) -> None:
    """Register ``ckpt verify`` on the sub-parsers ``sub``."""
    p = sub.add_parser("verify", parents=[parents.path, parents.step, parents.common, parents.json],
                       help="read every byte and check every checksum")
    p.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    p.set_defaults(fn=cmd_verify)
