"""Command line ``ckpt`` (same as ``python -m ckpt_engine``): ls, verify, inspect, diff, export, gc.

Every command takes a checkpoint root (a local path or an fsspec URL such as ``s3://bucket/run``)
and ``--storage-option key=value``. Exit codes: 0 success, 1 a verification failure or (``diff``)
a difference, 2 a usage, storage or I/O error. Results go to stdout (``--json``: one JSON
document), errors and progress bars to stderr; bars only on a terminal, never with ``--json`` or
``--quiet``. The commands themselves live in small modules (describe, compare, export, cleanup);
this one parses arguments and prints. See docs/CLI.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any, Sequence

from .. import __version__, progress
from ..format import catalog
from . import diff as compare
from . import gc as cleanup
from . import inspect as describe
from ..errors import CheckpointError, CorruptionError, FormatError, NoCheckpointError, StorageError
from .export import FORMATS, export
from ..format.manifest import MANIFEST_NAME
from ..restore import Opened, open_checkpoint, verify
from ..storage import Storage
from .table import duration, human, iso, render

OK, DIFFERENT, ERROR = 0, 1, 2


class UsageError(Exception):
    """A bad argument value (exit code 2)."""


def _storage_options(pairs: Sequence[str], flag: str = "--storage-option") -> dict[str, object]:
    """``["key=value", ...]`` → options; values that parse as JSON are used parsed (numbers, booleans, objects)."""
    opts: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} expects key=value, got {pair!r}")
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return opts


def _storage(args: argparse.Namespace, path: str | None = None) -> Storage:
    return Storage(path or args.path, _storage_options(args.storage_option))


def _open(storage: Storage, step: int | None) -> Opened:
    """The newest committed checkpoint at ``storage`` (or of ``step``), manifest and indexes checked."""
    found = catalog.manifest_dirs(storage, step)
    if not found:
        which = "" if step is None else f" of step {step}"
        steps = [e.step for e in catalog.committed(storage)]
        raise NoCheckpointError(f"no committed checkpoint{which} at {_root(storage)} "
                                f"(committed steps: {steps or 'none'}); see `ckpt ls {_root(storage)}`")
    return open_checkpoint(storage, found[-1][1])


def _root(storage: Storage) -> str:
    return storage.describe("").rstrip("/") or "/"


def _bar(args: argparse.Namespace) -> bool:
    return progress.wanted(args.quiet, getattr(args, "json", False))


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, allow_nan=False))


# ---- ls ---------------------------------------------------------------------------------------
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
    size, mtime = cleanup.usage(storage, name)
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
    rows = ls_rows(_storage(args), args.all)
    if args.json:
        _print_json(rows)
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


# ---- verify -----------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    """Read every byte of one checkpoint (the newest, ``--step N``, or ``--all``) and check every checksum."""
    storage = _storage(args)
    if args.all:  # every committed checkpoint, and damaged manifests of steps with no readable one
        entries = catalog.committed(storage)
        steps = {e.step for e in entries}
        found = sorted([(e.step, e.dirname) for e in entries]
                       + [(st, d) for st, d in catalog.manifest_dirs(storage) if st not in steps])
        if not found:
            raise NoCheckpointError(f"no committed checkpoint at {_root(storage)}")
    else:
        found = catalog.manifest_dirs(storage, args.step)[-1:]
        if not found:
            _open(storage, args.step)  # raises the "no checkpoint" error
    results = [_verify_one(storage, dirname, _bar(args)) for _, dirname in found]
    failed = [r for r in results if not r["ok"]]
    if args.json:
        _print_json({"ok": not failed, "checkpoints": results})
    else:
        for r in results:
            if r["ok"] and not args.quiet:
                print(f"OK step {r['step']}: {r['tensors']} tensors, {human(r['bytes'])} in "
                      f"{r['world_size']} rank files verified ({r['dir']})")
            elif not r["ok"]:
                print(f"FAILED {storage.describe(r['dir'])}: {r['error']}", file=sys.stderr)
    return DIFFERENT if failed else OK


def _verify_one(storage: Storage, dirname: str, bar: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"dir": dirname, "step": catalog.parse_dir(dirname)[0],  # type: ignore[index]
                           "world_size": None, "tensors": None, "bytes": None}
    try:
        opened = open_checkpoint(storage, dirname)
        m = opened.manifest
        row.update(step=m.step, world_size=m.world_size, tensors=len(m.tensors), bytes=m.total_bytes)
        total = sum(e.nbytes for idx in opened.indexes for e in idx.entries)
        with progress.Bar(total, f"verify step {m.step}", bar) as b:
            verify(storage, opened, progress=b.update)
    except (CorruptionError, FormatError) as e:
        return {**row, "ok": False, "error": str(e)}
    return {**row, "ok": True, "error": None}


# ---- inspect ----------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    """Describe one checkpoint: replicated tensors and values, and every rank's local values."""
    if args.width < 10:
        raise UsageError(f"--width must be at least 10, got {args.width}")
    opened = _open(_storage(args), args.step)
    bad = [r for r in args.rank if not 0 <= r < opened.manifest.world_size]
    if bad:
        raise UsageError(f"--rank {bad[0]}: the checkpoint of step {opened.manifest.step} has ranks "
                         f"0..{opened.manifest.world_size - 1}")
    contents = describe.describe(opened, args.width)
    if args.json:
        _print_json(describe.to_json(contents))
        return OK
    ranks = args.rank if args.rank else ([r.rank for r in contents.ranks] if contents.world_size <= 8 else [0])
    print(describe.render_text(contents, ranks))
    return OK


# ---- diff -------------------------------------------------------------------------------------
def _diff_refs(refs: Sequence[str]) -> list[tuple[str, int | None]]:
    """``PATH A B`` or ``PATH_A[@STEP] PATH_B[@STEP]`` → two (path, step) pairs."""
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
    for path, step in _diff_refs(args.refs):
        storage = _storage(args, path)
        sides.append(compare.Side(storage, _open(storage, step)))
    result = compare.diff(sides[0], sides[1], progress=_bar(args))
    if args.json:
        _print_json(compare.to_json(result))
    elif not args.quiet:
        print(compare.render_text(result, args.all))
    return OK if result.identical else DIFFERENT


# ---- export -----------------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace) -> int:
    """Write one checkpoint as a plain ``torch.save`` or safetensors file."""
    fmt = args.format or ("safetensors" if args.out.endswith(".safetensors") else "torch")
    storage = _storage(args)
    opened = _open(storage, args.step)
    local_rank = args.local_rank if args.local_rank is not None else (0 if args.include_local else None)
    result = export(storage, opened, args.out, fmt=fmt, flat=args.flat, local_rank=local_rank,
                    out_options=_storage_options(args.out_option, "--out-option"), progress=_bar(args))
    if args.json:
        _print_json(asdict(result))
    elif not args.quiet:
        size = "" if result.file_bytes is None else f", {human(result.file_bytes)}"
        print(f"exported step {result.step} to {result.out} ({result.format}{size}): {result.tensors} tensors "
              f"({human(result.tensor_bytes)}), {result.values} other values")
    return OK


# ---- gc ---------------------------------------------------------------------------------------
def cmd_gc(args: argparse.Namespace) -> int:
    """List (default) or delete (``--yes``) old checkpoints and dead leftovers."""
    storage = _storage(args)
    try:
        grace = cleanup.parse_duration(args.grace)
    except ValueError as e:
        raise UsageError(f"--grace: {e}") from None
    plan = cleanup.plan(storage, args.keep_last, grace)
    if args.yes:
        cleanup.apply(storage, plan)
    if args.json:
        _print_json(cleanup.to_json(plan, args.yes))
        return OK
    if args.quiet:
        return OK
    verb = "removed" if args.yes else "would remove"
    rows = [(i.name, "-" if i.step is None else i.step, human(i.bytes),
             "-" if i.age_s is None else duration(i.age_s), i.reason) for i in plan.remove]
    if rows:
        print(f"{verb} {len(rows)} item(s), {human(plan.bytes)} at {_root(storage)}:")
        print("\n".join(render(("name", "step", "size", "age", "reason"), rows, right=(1, 2, 3), indent="  ")))
    else:
        print(f"nothing to remove at {_root(storage)}")
    if plan.keep:
        print("kept:")
        kept = [(i.name, "-" if i.age_s is None else duration(i.age_s), i.reason) for i in plan.keep]
        print("\n".join(render(("name", "age", "reason"), kept, right=(1,), indent="  ")))
    if rows and not args.yes:
        print("dry run: nothing was deleted; run again with --yes to delete")
    return OK


# ---- parser -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ckpt`` / ``python -m ckpt_engine``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option for the checkpoint root (repeatable; JSON values are parsed)")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars, no summary lines")
    js = argparse.ArgumentParser(add_help=False)
    js.add_argument("--json", action="store_true", help="one machine-readable JSON document on stdout")
    path = argparse.ArgumentParser(add_help=False)
    path.add_argument("path", help="checkpoint root (local path or fsspec URL such as s3://bucket/run)")
    step = argparse.ArgumentParser(add_help=False)
    step.add_argument("--step", type=int, help="step (default: the newest committed checkpoint)")

    parser = argparse.ArgumentParser(
        prog="ckpt", description="List, check, inspect, compare, export and clean up ckpt-suite checkpoints.",
        epilog="Exit codes: 0 success, 1 verification failure or difference, 2 usage or I/O error.")
    parser.add_argument("--version", action="version", version=f"ckpt-suite {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", parents=[path, common, js], help="list committed checkpoints")
    p.add_argument("--all", action="store_true", help="also list uncommitted, superseded and damaged attempts")
    p.set_defaults(fn=cmd_ls)

    p = sub.add_parser("verify", parents=[path, step, common, js], help="read every byte and check every checksum")
    p.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser("inspect", parents=[path, step, common, js],
                       help="tensors (dtype, shape, bytes, placement) and plain values of a checkpoint")
    p.add_argument("--rank", type=int, action="append", default=[],
                   help="list this writer rank's local values in full (repeatable; default: all up to 8 ranks)")
    p.add_argument("--width", type=int, default=80, help="cut value texts to about this many characters")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("diff", parents=[common, js], help="compare two checkpoints (exit 1 when they differ)")
    p.add_argument("refs", nargs="+", metavar="REF",
                   help="PATH A B (two steps of one root) or PATH_A[@STEP] PATH_B[@STEP]")
    p.add_argument("--all", action="store_true", help="also list unchanged keys")
    p.set_defaults(fn=cmd_diff)

    p = sub.add_parser("export", parents=[path, step, common, js],
                       help="write a plain torch.save or safetensors file (loads without ckpt-suite)")
    p.add_argument("out", help="output file (local path or fsspec URL)")
    p.add_argument("--format", choices=FORMATS, help="default: safetensors if OUT ends in .safetensors, else torch")
    p.add_argument("--flat", action="store_true",
                   help="torch format: a flat {'a.b.c': value} dict instead of the nested state")
    p.add_argument("--include-local", action="store_true", help="add rank 0's local values (see --local-rank)")
    p.add_argument("--local-rank", type=int, help="add this writer rank's local values")
    p.add_argument("--out-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option for OUT (repeatable)")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("gc", parents=[path, common, js],
                       help="delete old checkpoints and dead leftovers (dry run unless --yes)")
    p.add_argument("--keep-last", type=int, metavar="K", help="keep the K newest committed checkpoints (default: all)")
    p.add_argument("--grace", default="1h",
                   help="delete uncommitted attempts only when older than this (default 1h; e.g. 90s, 30m, 2d)")
    p.add_argument("--yes", "--force", dest="yes", action="store_true", help="really delete")
    p.set_defaults(fn=cmd_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (errors are printed to stderr)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except UsageError as e:
        print(f"ckpt {args.command}: error: {e}", file=sys.stderr)
        return ERROR
    except (CorruptionError, FormatError) as e:
        print(f"ckpt {args.command}: verification failed: {e}", file=sys.stderr)
        return DIFFERENT
    except (NoCheckpointError, StorageError, CheckpointError) as e:
        print(f"ckpt {args.command}: error: {e}", file=sys.stderr)
        return ERROR
    except KeyboardInterrupt:
        print(f"ckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ckpt ls | head`: the reader left; no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
