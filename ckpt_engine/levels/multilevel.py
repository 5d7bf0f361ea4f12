"""Several levels: the destination of a ``Checkpointer`` with a fast first level and slower ones.

Implements :class:`~ckpt_engine.levels.destination.Destination` (the order of calls is there) as a
composition: level 1's committer, one per kind (levels/first.py: shared, node-local, node memory
with replicas; chosen once, by :func:`first_level`), and one background flusher per lower level
(flush.py). Opening is a collective (:func:`levels.open.open_levels`). A save counts as committed
on level 1 as soon as that level has it: ``wait()`` and the policy see exactly that. Then every
lower level's flusher gets it, and level-1 retention keeps what a flusher still needs. Reading:
levels/restore.py.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Sequence

from ..comm import Comm, LocalComm
from ..config import LevelSpec
from ..errors import CheckpointError, CommitTimeoutError
from ..format.catalog import committed
from ..load.agreed import Loaded
from ..load.exchange import Exchange
from ..save.commit import CommitInputs, retain, wait_for_commit
from ..save.persist import PersistJob
from ..save.tally import Tally
from .assemble import Assembly
from .destination import Retention, new_generation
from .first import FirstLevel, NodeLocalFirst, SharedFirst
from .first_memory import MemoryFirst, Replicas, Unreplicated
from .flush import Flusher, FlushItem
from .open import Level, Opening, open_levels
from .replicate import Replicator, open_group
from .restore import load_levels


def first_level(opening: Opening, spec: LevelSpec, comm: Comm, *, commit_timeout: float,
                tally: Tally) -> FirstLevel:
    """Level 1's committer, of the kind :func:`~ckpt_engine.levels.open.open_levels` found (every
    rank; a collective with a memory level replicated across nodes: its peer group is opened)."""
    fast = opening.levels[0]
    if opening.memory is None:
        return NodeLocalFirst(fast, comm, opening.complete) if fast.node_local else SharedFirst(fast, comm)
    memory = opening.memory
    replicas: Replicas = Unreplicated()
    if spec.replicas > 0 and memory.nodes.count > 1:
        group = open_group(comm, opening.generation, min(commit_timeout, 120.0))
        replicas = Replicator(group, memory.node, memory.nodes, comm.rank, spec.replicas, keep_last=fast.keep_last,
                              generation=opening.generation, tally=tally)
    return MemoryFirst(NodeLocalFirst(fast, comm, opening.complete), spec, memory, replicas,
                       generation=opening.generation, flushed=len(opening.levels) > 1)


class MultiLevel:
    """Level 1's committer (``first``) composed with one background flusher per lower level
    (``flushers``), for one ``Checkpointer``; the levels fastest first.

    The flushers report to ``tally`` (counters ``flushed``, ``flush_skipped``, ``flush_failed``,
    ``flush_bytes``; one :class:`~ckpt_engine.levels.flush.FlushRecord` per checkpoint and lower level).
    """

    make_room = False

    def __init__(self, specs: Sequence[LevelSpec], comm: Comm, *, commit_timeout: float, retries: int,
                 tally: Tally) -> None:
        """Open every level (a collective, see :func:`~ckpt_engine.levels.open.open_levels`), choose
        level 1's committer and start the flushers; a flush a crash cut short is started over."""
        opening = open_levels(specs, comm, new_generation)
        self.levels: tuple[Level, ...] = opening.levels
        self.generation = opening.generation
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.first = first_level(opening, specs[0], comm, commit_timeout=commit_timeout, tally=tally)
        self.full_is_warning = self.first.full_is_warning
        self.buffers = self.first.buffers
        self.assembly: Assembly | None = None
        """What this rank moved in its last restore from the node-local level 1 (levels/assemble.py)."""
        self._last_committed: str | None = None
        self._drained = False
        self._retention = Retention()
        fast = self.levels[0]
        self.flushers = tuple(
            Flusher(fast.storage, level.storage, level=level.index, rank=self.rank, world_size=self.world_size,
                    generation=self.generation, keep_last=level.keep_last, commit_timeout=commit_timeout,
                    retries=retries, manifest_of=self.first.manifest_of, tally=tally)
            for level in self.levels[1:])
        start = time.perf_counter()
        for flusher, again in zip(self.flushers, opening.recover):
            if again is not None:  # a crash cut its flush short: start it over
                step, dirname = again
                flusher.offer(FlushItem(dirname, step, True, "", start, start))

    # ---- saving -----------------------------------------------------------------------------------
    def admit(self, nbytes: int) -> int:
        """Level 1's check of this rank's part size (a memory level's room); the snapshot buffers its
        committed checkpoints keep (levels/first.py)."""
        return self.first.admit(nbytes)

    def saving(self, dirname: str, inputs: CommitInputs) -> CommitInputs | None:
        """A shared level 1 is committed by rank 0's persist worker; on a node-local one each rank
        commits its own files (:meth:`persisted`), with these inputs."""
        return self.first.saving(dirname, inputs)

    def skipped(self, dirname: str, step: int, saved_at: float) -> None:
        """This rank skipped the attempt (back-pressure): level 1 learns it (an abort marker for rank 0's
        commit), and so do the flushers (rank 0 may still pick it)."""
        self.first.skipped(dirname)
        self._offer(FlushItem(dirname, step, False, "skipped", saved_at, time.perf_counter()))

    def persisted(self, job: PersistJob) -> bool:
        """Persist thread, after every job: level 1 commits this rank's part as its kind does, the
        attempt (done or not) goes to the flushers, then level-1 retention when this rank committed
        it (after the hand-over, so that it sees what the flushers need)."""
        ok = False
        try:
            ok = self.first.commit(job)
        finally:
            reason = "skipped" if job.record.skipped else "failed"
            self._offer(FlushItem(job.dirname, job.step, ok, "" if ok else reason, job.record.started_at,
                                  time.perf_counter()))
        if not (job.durable and job.record.committed):
            return False
        self._last_committed = job.dirname
        self._retention.submit(self.retain_fast, job.dirname)
        return True

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
        fast = self.first.level
        removed = retain(fast.storage, dirname, self.first.keep_last, self.generation, marker=fast.marker,
                         protect=protect)
        for flusher in self.flushers:
            flusher.forget(removed)
        return removed

    # ---- waiting ----------------------------------------------------------------------------------
    def await_commit(self, dirname: str, timeout: float) -> None:
        """Until ``dirname`` counts as taken on level 1 (levels/first.py: the manifest rank 0 writes on
        a shared level 1; on a memory level, this rank's part also on its peers)."""
        self.first.await_commit(dirname, timeout)

    def drain(self, timeout: float) -> None:
        """Wait until every lower level has the newest checkpoint (older pending ones are skipped).

        Raises :class:`CheckpointError` naming the level and steps after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        self.first.drain(timeout)
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
        self._drained = True

    def take_error(self) -> CheckpointError | None:
        """A flush that failed for good (after its retries), once; named by its level. A problem of
        level 1 the job goes on with (replication stopped: a peer died) is warned about, once."""
        warning = self.first.take_warning()
        if warning is not None:
            warnings.warn(warning, stacklevel=4)
        for level, flusher in zip(self.levels[1:], self.flushers):
            error = flusher.take_error()
            if error is not None:
                wrapped = CheckpointError(f"flush to {level.name} failed: {type(error).__name__}: {error}")
                wrapped.__cause__ = error
                return wrapped
        return None

    def retention_failures(self, wait: bool) -> list[BaseException]:
        return self._retention.failures(wait)

    def close(self, release_memory: bool = True) -> list[BaseException]:
        """Level-1 retention once more (what the drained flushes no longer protect), then stop the
        flushers (a copy in progress goes on in its daemon thread) and level 1's own threads (a memory
        level is released when ``release_memory`` and the slower levels hold its newest)."""
        if self._last_committed is not None:
            self._retention.submit(self.retain_fast, self._last_committed)
        failures = self._retention.shutdown()
        for flusher in self.flushers:
            flusher.stop(0.0)
        self.first.close(release=release_memory and self._drained and bool(self.flushers))
        return failures

    # ---- reading ----------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps this process can see on any level, oldest first (no communication): level 1's
        as its kind counts them (levels/first.py), the lower levels' listed now."""
        found = self.first.steps()
        for level in self.levels[1:]:
            found |= {e.step for e in committed(level.storage)}
        return sorted(found)

    def load(self, step: int | None, fallback: bool, threads: int, failures: list[str],
             progress: bool, into: Any = None) -> tuple[Any, Loaded]:
        """This process alone, as :meth:`restore` would choose with one rank (levels/restore.py): the
        shared levels and the node-local checkpoints this rank holds whole; ``progress`` is not drawn."""
        return load_levels(self, LocalComm(), step, fallback, threads, failures, into, rank=self.rank)

    def restore(self, step: int | None, fallback: bool, threads: int, failures: list[str],
                into: Any = None, exchange: Exchange | None = None) -> tuple[Any, Loaded]:
        """:meth:`load`, with ``exchange``: the route of a shared level's large pieces, as on one level
        (a node-local level 1 exchanges its parts its own way: levels/assemble.py)."""
        return load_levels(self, self.comm, step, fallback, threads, failures, into, exchange)
