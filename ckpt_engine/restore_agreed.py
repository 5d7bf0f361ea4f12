"""Choosing the checkpoint to restore: the newest whose every part a rank will use verifies.

A rank that resumes training uses three parts of a checkpoint: the replicated state, its own
writer's ``local`` (RNG, data position, per-rank buffers) and writer 0's ``local`` (where the
front ends take per-rank state from when the world size changed, and the plain values every
rank needs). A checkpoint is chosen only when all three verify, so a damaged ``local`` section
moves the fallback on to an older checkpoint instead of failing after the choice.

* :func:`read_for_rank`: the parts one rank uses, read and verified (``Checkpointer.load``).
* :func:`restore`: the collective the front ends call on every rank (a single level; the
  multi-level load is a collective of its own, restore_levels.py). Rank 0 lists the candidates
  once and broadcasts them (or its failure to list); every rank reads its parts of one candidate, then one all-gather of
  verdicts moves all ranks to the next candidate together when any of them failed, so every
  rank resumes from the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .agree import on_rank0
from .format.catalog import manifest_dirs
from .comm import Comm
from .errors import CheckpointError, CorruptionError, NoCheckpointError
from .format.manifest import Manifest
from .restore import Opened, Progress, open_checkpoint, read_local, read_state
from .storage import Storage


@dataclass(frozen=True)
class Restored:
    """What a rank resumes from: one checkpoint, every part of it this rank uses verified."""

    step: int
    dirname: str
    state: Any
    local: Any
    """This rank's writer's ``local``; ``None`` when this rank has no writer (more ranks than writers)."""
    first: Any
    """Writer 0's ``local``: per-rank state for ranks without a writer, and values every rank needs."""
    manifest: Manifest
    level: int = 0
    """The level it was read from (0: the first, fastest)."""


def local_ranks(rank: int, writers: int) -> list[int]:
    """The writers whose ``local`` rank ``rank`` uses: its own (when it had a writer) and writer 0."""
    return sorted({r for r in (0, rank) if r < writers})


def read_for_rank(storage: Storage, ck: Opened, rank: int, threads: int,
                  progress: Progress | None = None) -> tuple[Any, dict[int, Any]]:
    """The replicated state of ``ck`` and the ``local`` of every writer in :func:`local_ranks`,
    each verified; raises :class:`CorruptionError`/:class:`FormatError` naming the file otherwise."""
    state = read_state(storage, ck, threads, progress)
    return state, {r: read_local(storage, ck, r) for r in local_ranks(rank, ck.manifest.world_size)}


def restore(storage: Storage, comm: Comm, step: int | None, fallback: bool, threads: int,
            failures: list[str]) -> tuple[Opened, Any, dict[int, Any]]:
    """Every rank: the newest checkpoint (or the newest attempt of ``step``) whose parts verify on
    every rank, as ``(opened, state, locals)``; see the module docstring.

    Appends what failed to ``failures``. Without ``fallback`` the first failure raises on every
    rank: its own error where it failed, a :class:`CorruptionError` naming the others elsewhere.
    """
    found = on_rank0(comm, lambda: manifest_dirs(storage, step))
    if not found:
        which = "" if step is None else f" of step {step}"
        raise NoCheckpointError(f"no committed checkpoint{which} at {storage.describe('')}")
    for _, dirname in reversed(found):
        own: BaseException | None = None
        try:
            opened = open_checkpoint(storage, dirname)
            state, locals_ = read_for_rank(storage, opened, comm.rank, threads)
            report: dict[str, Any] = {"ok": True}
        except Exception as e:  # noqa: BLE001 - reported to the other ranks first, so that none waits forever
            own, report = e, {"ok": False, "error": f"rank {comm.rank}: {e}",
                              "final": not isinstance(e, CheckpointError) or isinstance(e, NoCheckpointError)}
        reports = comm.all_gather(report) if comm.world_size > 1 else [report]
        bad = [r for r in reports if not r["ok"]]
        if not bad:
            return opened, state, locals_
        failures.extend(f"{dirname}: {r['error']}" for r in bad)
        if not fallback or any(r["final"] for r in bad):
            if own is not None:
                raise own
            raise CorruptionError(f"{storage.describe(dirname)} failed on other ranks: "
                                  + "; ".join(r["error"] for r in bad))
    raise CorruptionError(f"no checkpoint at {storage.describe('')} verifies on every rank: " + "; ".join(failures))
