"""The multi-level side of a ``Checkpointer``: level-1 commits, flushers, retention guards, figures.

Order of calls (the ``Checkpointer`` makes them): construction on every rank (a collective, see
:func:`levels.open_levels`); per save, :meth:`MultiLevel.expect` (training thread), then
:meth:`MultiLevel.persisted` (persist thread) or :meth:`MultiLevel.skipped` (training thread);
:meth:`MultiLevel.retain_fast` from the retention thread; :meth:`MultiLevel.drain`,
:meth:`MultiLevel.take_error` and :meth:`MultiLevel.stop` from the training thread.

A save counts as committed on level 1 as soon as that level has it (the manifest on a shared
level 1; on a node-local one, this rank's ``rank-commit.json``): ``wait()`` and the policy see
exactly that. Then every lower level's flusher gets it (flush.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable, Sequence

from ..format.catalog import committed, parse_dir
from ..comm import Comm
from ..commit import CommitInputs, retain, wait_for_commit
from ..config import LevelSpec
from ..errors import CheckpointError, CommitTimeoutError
from .flush import Flusher, FlushItem, FlushRecord
from .open import RANK_COMMIT, Level, RankCommit, open_levels, write_rank_commit
from ..format.manifest import MANIFEST_NAME, Manifest, RankRecord
from ..persist import PersistJob


class MultiLevel:
    """Levels (fastest first) and one background flusher per lower level, for one ``Checkpointer``.

    ``counters`` and ``records``: the checkpointer's figures, which the flushers extend
    (``flushed``, ``flush_skipped``, ``flush_failed``, ``flush_bytes``; one
    :class:`~ckpt_engine.levels.flush.FlushRecord` per checkpoint and lower level).
    """

    def __init__(self, specs: Sequence[LevelSpec], comm: Comm, *, commit_timeout: float, retries: int,
                 new_generation: Callable[[], str], counters: dict, records: "deque[FlushRecord]") -> None:
        opening = open_levels(specs, comm, new_generation)
        self.levels: tuple[Level, ...] = opening.levels
        self.fast = self.levels[0]
        self.node_local = self.fast.node_local
        self.generation = opening.generation
        self.complete = opening.complete
        self.rank, self.world_size = comm.rank, comm.world_size
        self._templates: dict[str, CommitInputs] = {}
        lock = threading.Lock()
        self.flushers = tuple(
            Flusher(self.fast.storage, level.storage, level=level.index, rank=self.rank, world_size=self.world_size,
                    generation=self.generation, keep_last=level.keep_last, commit_timeout=commit_timeout,
                    retries=retries, manifest_of=self._manifest_of if self.rank == 0 else None,
                    counters=counters, records=records, lock=lock)
            for level in self.levels[1:])
        start = time.perf_counter()
        for flusher, dirname in zip(self.flushers, opening.recover):
            if dirname is not None:  # a crash cut its flush short: start it over
                flusher.offer(FlushItem(dirname, parse_dir(dirname)[0], True, "", start, start))  # type: ignore[index]

    # ---- saving -----------------------------------------------------------------------------------
    def expect(self, dirname: str, inputs: CommitInputs | None) -> None:
        """At ``save()``: on a node-local level 1, keep what this rank's own commit will need."""
        if self.node_local and inputs is not None:
            self._templates[dirname] = inputs

    def persisted(self, job: PersistJob) -> None:
        """Persist thread, after every job: commit this rank's files on a node-local level 1, then
        hand the attempt (done or not) to the flushers."""
        inputs = self._templates.pop(job.dirname, None)
        ok = job.durable
        try:
            if ok and self.node_local:
                ok = False
                write_rank_commit(self.fast.storage, job.dirname, self.rank,
                                  inputs.manifest_body((), time.time()))  # type: ignore[union-attr]
                job.record.committed = ok = True
        finally:
            reason = "skipped" if job.record.skipped else "failed"
            self._offer(FlushItem(job.dirname, job.step, ok, "" if ok else reason, job.record.started_at,
                                  time.perf_counter()))

    def skipped(self, dirname: str, step: int, saved_at: float) -> None:
        """At ``save()``: this rank skipped the attempt (back-pressure); rank 0 may still pick it."""
        self._templates.pop(dirname, None)
        self._offer(FlushItem(dirname, step, False, "skipped", saved_at, time.perf_counter()))

    def _offer(self, item: FlushItem) -> None:
        for flusher in self.flushers:
            flusher.offer(item)

    def retain_fast(self, dirname: str) -> list[str]:
        """Level-1 retention after ``dirname`` committed there (rank 0; every rank when node-local).

        Keeps ``keep_last`` of level 1, and whatever a flusher still needs: the checkpoint being
        copied and the newest one not yet copied.
        """
        protect: set[str] = set()
        for flusher in self.flushers:
            protect |= flusher.protected()
        removed = retain(self.fast.storage, dirname, self.fast.keep_last, self.generation, marker=self.fast.marker,
                         protect=protect)
        for flusher in self.flushers:
            flusher.forget(removed)
        return removed

    # ---- waiting ----------------------------------------------------------------------------------
    def drain(self, timeout: float) -> None:
        """Wait until every lower level has the newest checkpoint (older pending ones are skipped).

        Raises :class:`CheckpointError` naming the level and steps after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        for level, flusher in zip(self.levels[1:], self.flushers):
            done = flusher.drain(max(0.0, deadline - time.monotonic()))
            if done and self.rank != 0 and flusher.last_copied is not None:  # and rank 0 committed it there
                try:
                    wait_for_commit(level.storage, flusher.last_copied, self.world_size,
                                    max(0.001, deadline - time.monotonic()))
                except CommitTimeoutError:
                    done = False
                except CheckpointError:
                    pass  # another rank failed it: rank 0 reports that
            if not done:
                raise CheckpointError(f"{level.name}: flush of steps {flusher.waiting_for()} not finished within "
                                      f"{timeout:g} s; pass close(timeout=...) to wait longer (after a restart the "
                                      "newest level-1 checkpoint is flushed again)")

    def take_error(self) -> CheckpointError | None:
        """A flush that failed for good (after its retries), once; named by its level."""
        for level, flusher in zip(self.levels[1:], self.flushers):
            error = flusher.take_error()
            if error is not None:
                wrapped = CheckpointError(f"flush to {level.name} failed: {type(error).__name__}: {error}")
                wrapped.__cause__ = error
                return wrapped
        return None

    def stop(self, timeout: float = 0.0) -> None:
        """Stop the flushers (a copy in progress may go on, in a daemon thread, up to ``timeout``)."""
        for flusher in self.flushers:
            flusher.stop(timeout)

    # ---- catalog ----------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps this process can see on any level, oldest first (no communication).

        A node-local level 1 contributes the steps every rank had there at start (a restore from it
        needs every rank); shared levels are listed now.
        """
        found: set[int] = set()
        for level in self.levels:
            if level.node_local:
                found |= {step for step, _ in self.complete}
            else:
                found |= {e.step for e in committed(level.storage)}
        return sorted(found)

    def _manifest_of(self, dirname: str) -> Callable[[tuple[RankRecord, ...]], Manifest]:
        """Rank 0's flusher: the level-1 manifest of ``dirname``, to commit the same on a lower level."""
        storage = self.fast.storage
        if self.node_local:
            where = storage.describe(f"{dirname}/{RANK_COMMIT}")
            rc = RankCommit.from_json(storage.read_bytes(f"{dirname}/{RANK_COMMIT}"), where)
            return lambda records: rc.manifest(records, where)
        where = storage.describe(f"{dirname}/{MANIFEST_NAME}")
        manifest = Manifest.from_json(storage.read_bytes(f"{dirname}/{MANIFEST_NAME}"), where)
        return lambda records: replace(manifest, ranks=tuple(records))
