"""``ckpt gc``: what may be deleted below a checkpoint root, and deleting it the commit's way.

Planned, not done, by default (the command line's dry run). Candidates:

* what the retention rule of a running job drops (save/retention.py, the same rule, so ``gc`` and
  the job agree): superseded attempts (a committed directory of a step that has a newer committed
  attempt), and committed checkpoints beyond ``keep_last`` (the newest commit, whatever its step,
  and the highest steps of the others, ``keep_last`` in all);
* uncommitted attempt directories (no manifest: crashed, failed or skipped saves) whose newest
  file is older than ``grace`` seconds, and stale temporary files of interrupted atomic writes.

The grace period is what keeps a running job safe: its checkpoint in progress is an uncommitted
directory too, indistinguishable on storage from a dead one except by age (an empty local
directory counts from its own time; anything whose age cannot be told is kept). A directory whose
manifest exists but cannot be read is never deleted (``ckpt verify`` reports it). Unfinished
multipart uploads are left to the start-up sweep of :class:`Checkpointer` (``commit.sweep``),
which runs when no save can be in progress. Deletion uses :func:`commit.remove_checkpoint`
(manifest first, so a checkpoint stops existing before its files go).
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CheckpointError
from ..format import catalog
from ..format.entries import MANIFEST_NAME
from ..levels.memory import dead_node_dirs, sweep_dead_jobs
from ..save.commit import remove_checkpoint
from ..save.retention import retention
from ..storage import Storage, open_storage
from .common import OK, Parents, UsageError, open_root, print_json, root
from .table import duration, human, render

_DURATION = re.compile(r"(\d+(?:\.\d*)?)\s*(s|m|min|h|d)?")
_UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True)
class Item:
    """One thing below the root: a directory (``step`` set) or a stray temporary file."""

    name: str
    reason: str
    step: int | None
    bytes: int
    age_s: float | None


@dataclass(frozen=True)
class Plan:
    """``remove``: what ``gc`` deletes; ``keep``: uncommitted or damaged items left alone, and why."""

    remove: tuple[Item, ...]
    keep: tuple[Item, ...]

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.remove)


def parse_duration(text: str) -> float:
    """``"3600"``, ``"90s"``, ``"30m"``, ``"1h"``, ``"2d"`` → seconds; ``ValueError`` naming the text otherwise."""
    m = _DURATION.fullmatch(text.strip())
    if not m:
        raise ValueError(f"cannot read {text!r} as a duration; write e.g. 3600, 90s, 30m, 1h or 2d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def usage(storage: Storage, rel: str) -> tuple[int, float | None]:
    """``(bytes, newest modification time or None)`` of the files below ``rel`` (fresh listing)."""
    return storage.usage(rel)


def plan(storage: Storage, keep_last: int | None, grace_s: float, now: float | None = None) -> Plan:
    """What ``gc`` would delete at ``storage`` now (nothing is changed)."""
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"--keep-last must be at least 1 (the newest checkpoint is always kept), got {keep_last}")
    now = time.time() if now is None else now
    readable = {e.dirname for e in catalog.readable(storage)}
    rule = retention(readable, keep_last)
    remove, keep = [], []

    def item(name: str, reason: str, step: int | None) -> Item:
        size, mtime = usage(storage, name)
        return Item(name, reason, step, size, None if mtime is None else max(0.0, now - mtime))

    for name in catalog.attempt_dirs(storage):
        step = catalog.parse_dir(name)[0]  # type: ignore[index]
        if name in rule.superseded:
            remove.append(item(name, f"superseded by {rule.superseded[name]}", step))
        elif name in rule.beyond:
            remove.append(item(name, f"beyond --keep-last {keep_last}", step))
        elif name in readable:
            continue
        elif storage.exists(f"{name}/{MANIFEST_NAME}"):
            keep.append(item(name, "manifest unreadable: kept, run `ckpt verify`", step))
        else:
            it = item(name, "uncommitted", step)
            old = it.age_s is not None and it.age_s >= grace_s  # unknown age: keep, it may be in progress
            (remove if old else keep).append(it if old else Item(
                it.name, "uncommitted, younger than --grace (a save may be in progress)", step, it.bytes, it.age_s))
    for tmp in storage.stale_temp_files():
        it = item(tmp, "stale temporary file", None)
        if it.age_s is not None and it.age_s >= grace_s:
            remove.append(it)
    return Plan(tuple(remove), tuple(keep))


def apply(storage: Storage, p: Plan, on_removed: Callable[[Item], None] | None = None) -> list[str]:
    """Delete what ``p`` lists (checkpoints manifest first); returns the names removed."""
    done = []
    for it in p.remove:
        if it.step is not None:
            remove_checkpoint(storage, it.name)
        else:
            storage.remove(it.name)
        done.append(it.name)
        if on_removed is not None:
            on_removed(it)
    return done


def to_json(p: Plan, applied: bool) -> dict:
    """The ``--json`` document of ``ckpt gc`` (see docs/CLI.md)."""
    def row(i: Item) -> dict:
        return {"name": i.name, "reason": i.reason, "step": i.step, "bytes": i.bytes, "age_s": i.age_s}

    return {"dry_run": not applied, "remove": [row(i) for i in p.remove], "keep": [row(i) for i in p.keep],
            "bytes": p.bytes}


def cmd_gc(args: argparse.Namespace) -> int:
    """List (default) or delete (``--yes``) old checkpoints and dead leftovers."""
    if args.memory:
        return _gc_memory(args)
    storage = open_root(args)
    try:
        grace = parse_duration(args.grace)
    except ValueError as e:
        raise UsageError(f"--grace: {e}") from None
    todo = plan(storage, args.keep_last, grace)
    if args.yes:
        apply(storage, todo)
    if args.json:
        print_json(to_json(todo, args.yes))
        return OK
    if args.quiet:
        return OK
    verb = "removed" if args.yes else "would remove"
    rows = [(i.name, "-" if i.step is None else i.step, human(i.bytes),
             "-" if i.age_s is None else duration(i.age_s), i.reason) for i in todo.remove]
    if rows:
        print(f"{verb} {len(rows)} item(s), {human(todo.bytes)} at {root(storage)}:")
        print("\n".join(render(("name", "step", "size", "age", "reason"), rows, right=(1, 2, 3), indent="  ")))
    else:
        print(f"nothing to remove at {root(storage)}")
    if todo.keep:
        print("kept:")
        kept = [(i.name, "-" if i.age_s is None else duration(i.age_s), i.reason) for i in todo.keep]
        print("\n".join(render(("name", "age", "reason"), kept, right=(1,), indent="  ")))
    if rows and not args.yes:
        print("dry run: nothing was deleted; run again with --yes to delete")
    return OK


def _gc_memory(args: argparse.Namespace) -> int:
    """``ckpt gc --memory ROOT``: the memory-level directories on this machine of jobs none of whose
    processes is alive (levels/memory.py); removed with ``--yes``."""
    if "://" in args.path.removeprefix("file://"):
        raise UsageError(f"--memory takes the memory level's local directory (e.g. /dev/shm/ckpt-suite), "
                         f"got {args.path!r}")
    root_dir = args.path.removeprefix("file://")
    dead = dead_node_dirs(root_dir)
    sizes = {d: open_storage(d).usage("")[0] for d in dead}
    if args.yes:
        sweep_dead_jobs(root_dir, None)
    if args.json:
        print_json({"dry_run": not args.yes, "remove": [{"name": d, "bytes": sizes[d], "reason": "no live process"}
                                                         for d in dead], "bytes": sum(sizes.values())})
        return OK
    if args.quiet:
        return OK
    if not dead:
        print(f"nothing to remove at {root_dir}: every job's memory there has a live process")
        return OK
    print(f"{'removed' if args.yes else 'would remove'} {len(dead)} node memory "
          f"{'directory' if len(dead) == 1 else 'directories'}, "
          f"{human(sum(sizes.values()))} at {root_dir} (no process of their job is alive):")
    print("\n".join(render(("directory", "size"), [(d, human(sizes[d])) for d in dead], right=(1,), indent="  ")))
    if not args.yes:
        print("dry run: nothing was deleted; run again with --yes to delete")
    return OK


def add_parser(sub: Any, parents: Parents) -> None:
    """Register ``ckpt gc`` on the sub-parsers ``sub``."""
    p = sub.add_parser("gc", parents=[parents.path, parents.common, parents.json],
                       help="delete old checkpoints and dead leftovers (dry run unless --yes)")
    p.add_argument("--keep-last", type=int, metavar="K", help="keep the K newest committed checkpoints (default: all)")
    p.add_argument("--grace", default="1h",
                   help="delete uncommitted attempts only when older than this (default 1h; e.g. 90s, 30m, 2d)")
    p.add_argument("--yes", "--force", dest="yes", action="store_true", help="really delete")
    p.add_argument("--memory", action="store_true",
                   help="PATH is a memory level's directory (e.g. /dev/shm/ckpt-suite): remove the memory of jobs "
                        "none of whose processes is alive on this machine")
    p.set_defaults(fn=cmd_gc)
