"""Retention: which committed checkpoints a root keeps. One pure rule, used by the commit
(:func:`~ckpt_engine.save.commit.retain`, on every level), by a full disk making room for the save
being written (:func:`~ckpt_engine.save.failure.make_room`) and by ``ckpt gc`` (cli/gc.py), so that
the three never disagree on what ``keep_last`` keeps.

Given the committed directories of a root, by name (``step-<step>-<attempt>``; the attempt tags of
a later incarnation and of a later save sort after earlier ones: catalog.py, destination.py):

1. **one per step**: the newest attempt of a step supersedes its older attempts;
2. **the newest commit**, whatever its step, is always kept: after a restart from an older
   checkpoint, or a job started afresh in the same root, the running job's newest checkpoint has a
   step below the earlier run's, and counting it by its step would delete it;
3. **with** ``keep_last``: besides the newest commit, the highest steps of the others, ``keep_last``
   in all; while a save is being written (``writing``: a full disk makes room for it, and it will
   count as one) one fewer, never fewer than the newest commit. Without ``keep_last`` every step's
   newest attempt stays: the user asked to keep all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..format.catalog import parse_dir


@dataclass(frozen=True)
class Retention:
    """What the rule keeps of a root's committed checkpoints, and why the others go."""

    keep: frozenset[str]
    superseded: dict[str, str]
    """An older attempt of a step -> the newest attempt of that step, which replaces it."""
    beyond: frozenset[str]
    """The newest attempts of steps past ``keep_last``."""
    newest: str | None
    """The newest commit (kept whatever its step); ``None`` when nothing is committed."""

    @property
    def remove(self) -> frozenset[str]:
        return frozenset(self.superseded) | self.beyond


def retention(committed: Iterable[str], keep_last: int | None, *, newest: str | None = None,
              writing: bool = False) -> Retention:
    """Pure: what the rule of the module docstring keeps of ``committed`` (directory names, each with
    its commit marker). ``newest``: the newest commit when the caller knows it (the commit it just
    made; it must be in ``committed``), else the highest attempt tag. Raises ``ValueError`` for a
    name that is not a checkpoint directory, a ``newest`` not in ``committed`` or ``keep_last < 1``."""
    parsed: dict[str, tuple[int, str]] = {}
    for name in set(committed):
        found = parse_dir(name)
        if found is None:
            raise ValueError(f"{name!r} is not a checkpoint directory name (step-<step>-<attempt>)")
        parsed[name] = found
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (the newest checkpoint is always kept), got {keep_last}")
    if newest is not None and newest not in parsed:
        raise ValueError(f"the newest commit {newest!r} is not among the committed checkpoints given")
    if not parsed:
        return Retention(frozenset(), {}, frozenset(), None)
    ordered = sorted(parsed, key=lambda n: (parsed[n][1], parsed[n][0]))  # by attempt tag, then step
    newest = ordered[-1] if newest is None else newest
    latest: dict[int, str] = {}  # step -> its newest attempt (ascending attempt order: the last one wins)
    for name in ordered:
        latest[parsed[name][0]] = name
    latest[parsed[newest][0]] = newest
    superseded = {name: latest[parsed[name][0]] for name in ordered if latest[parsed[name][0]] != name}
    others = sorted((s for s, name in latest.items() if name != newest), reverse=True)
    budget = len(others) if keep_last is None else max(0, keep_last - 1 - (1 if writing else 0))
    kept_steps = others[:budget]
    beyond = frozenset(latest[s] for s in others[budget:])
    return Retention(frozenset([newest, *(latest[s] for s in kept_steps)]), superseded, beyond, newest)
