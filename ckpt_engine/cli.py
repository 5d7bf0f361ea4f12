"""Command line: list and verify the checkpoints below a path.

``ls PATH [--json]`` prints one row per committed checkpoint; ``verify PATH [--step N]`` reads
every byte and exits 0 when every checksum matches, 1 naming the file and tensor otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from typing import Sequence

from . import catalog
from .errors import CheckpointError
from .restore import open_checkpoint, verify
from .storage import Storage


def _storage_options(pairs: Sequence[str]) -> dict[str, object]:
    opts: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--storage-option expects key=value, got {pair!r}")
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return opts


def _rows(storage: Storage) -> list[dict]:
    rows = []
    for e in catalog.committed(storage):
        m = e.manifest
        rows.append({
            "step": m.step, "world_size": m.world_size, "total_bytes": m.total_bytes,
            "rank_bytes": [r.data_bytes for r in m.ranks], "tensors": len(m.tensors),
            "time": datetime.fromtimestamp(m.created_at, timezone.utc).isoformat(timespec="seconds"),
            "dir": e.dirname,
        })
    return rows


def cmd_ls(args: argparse.Namespace) -> int:
    """Print the committed checkpoints, oldest first."""
    rows = _rows(Storage(args.path, _storage_options(args.storage_option)))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no committed checkpoint at {args.path}")
        return 0
    print(f"{'step':>10}  {'ranks':>5}  {'total':>10}  {'per rank':<24}  time")
    for r in rows:
        per_rank = ",".join(_human(b) for b in r["rank_bytes"])
        per_rank = per_rank if len(per_rank) <= 24 else per_rank[:21] + "..."
        print(f"{r['step']:>10}  {r['world_size']:>5}  {_human(r['total_bytes']):>10}  {per_rank:<24}  {r['time']}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify every checksum of one checkpoint (the newest, or ``--step``)."""
    storage = Storage(args.path, _storage_options(args.storage_option))
    candidates = catalog.manifest_dirs(storage, args.step)
    if not candidates:
        print(f"error: no committed checkpoint{'' if args.step is None else f' of step {args.step}'} at {args.path}",
              file=sys.stderr)
        return 2
    dirname = candidates[-1][1]
    try:
        opened = open_checkpoint(storage, dirname)
        verify(storage, opened)
    except CheckpointError as e:
        print(f"FAILED {storage.describe(dirname)}: {e}", file=sys.stderr)
        return 1
    print(f"OK step {opened.manifest.step}: {len(opened.manifest.tensors)} tensors, "
          f"{_human(opened.manifest.total_bytes)} in {opened.manifest.world_size} rank files verified")
    return 0


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ckpt`` / ``python -m ckpt_engine``."""
    parser = argparse.ArgumentParser(prog="ckpt", description="Inspect ckpt-suite checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (("ls", cmd_ls, "list committed checkpoints"),
                            ("verify", cmd_verify, "check every checksum of a checkpoint")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("path", help="checkpoint root (local path or fsspec URL)")
        p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                       help="fsspec storage option (repeatable; JSON values are parsed)")
        p.set_defaults(fn=fn)
    sub.choices["ls"].add_argument("--json", action="store_true", help="machine-readable output")
    sub.choices["verify"].add_argument("--step", type=int, help="step to verify (default: newest)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
