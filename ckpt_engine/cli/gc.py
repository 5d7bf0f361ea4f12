"""``ckpt gc``: what may be deleted below a checkpoint root, and deleting it the commit's way.

Planned, not done, by default (the command line's dry run). Candidates:

* committed checkpoints beyond the ``keep_last`` highest steps (the newest is always kept);
* superseded attempts: a committed directory of a step that has a newer committed attempt;
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

import os
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

from ..format import catalog
from ..commit import remove_checkpoint
from ..errors import CheckpointError, StorageError
from ..format.manifest import MANIFEST_NAME
from ..storage.retry import retrying
from ..storage import Storage

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


def _mtime(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(key)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return None


def usage(storage: Storage, rel: str) -> tuple[int, float | None]:
    """``(bytes, newest modification time or None)`` of the files below ``rel`` (fresh listing)."""
    full = storage.path(rel)

    def find() -> dict[str, dict[str, Any]]:
        storage.fs.invalidate_cache(full)
        try:
            if storage.fs.isfile(full):
                return {full: storage.fs.info(full)}
            return storage.fs.find(full, detail=True, withdirs=False)  # type: ignore[no-any-return]
        except FileNotFoundError:
            return {}

    try:
        infos = find() if storage.local else retrying(find, storage.retry_deadline)
    except Exception as e:  # noqa: BLE001  (any backend error, named with the path)
        raise StorageError(f"could not list {storage.describe(rel)}: {type(e).__name__}: {e}") from e
    times = [t for t in (_mtime(i) for i in infos.values()) if t is not None]
    if not times and storage.local and os.path.isdir(full):  # an empty directory: a save may just have begun
        times = [os.path.getmtime(full)]
    return sum(int(i.get("size") or 0) for i in infos.values()), (max(times) if times else None)


def plan(storage: Storage, keep_last: int | None, grace_s: float, now: float | None = None) -> Plan:
    """What ``gc`` would delete at ``storage`` now (nothing is changed)."""
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"--keep-last must be at least 1 (the newest checkpoint is always kept), got {keep_last}")
    now = time.time() if now is None else now
    chosen = {e.dirname: e for e in catalog.committed(storage)}
    by_step = sorted(chosen.values(), key=lambda e: e.step, reverse=True)
    beyond = {e.dirname for e in by_step[keep_last:]} if keep_last is not None else set()
    remove, keep = [], []

    def item(name: str, reason: str, step: int | None) -> Item:
        size, mtime = usage(storage, name)
        return Item(name, reason, step, size, None if mtime is None else max(0.0, now - mtime))

    for name in catalog.attempt_dirs(storage):
        step = catalog.parse_dir(name)[0]  # type: ignore[index]
        if name in chosen:
            if name in beyond:
                remove.append(item(name, f"beyond --keep-last {keep_last}", step))
        elif storage.exists(f"{name}/{MANIFEST_NAME}"):
            newer = [e for e in chosen.values() if e.step == step]
            if newer:
                remove.append(item(name, f"superseded by {newer[0].dirname}", step))
            else:
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
