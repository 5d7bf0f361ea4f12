"""Several levels: the destination of a ``Checkpointer`` with a fast first level and slower ones.

Implements :class:`~ckpt_engine.levels.destination.Destination` (the order of calls is there). Opening
is a collective (:func:`levels.open.open_levels`). A save counts as committed on level 1 as soon
as that level has it (the manifest on a shared level 1, written by rank 0's persist worker; on a
node-local one, this rank's ``rank-commit.json``, written by :meth:`MultiLevel.persisted`):
``wait()`` and the policy see exactly that. Then every lower level's flusher gets it (flush.py),
and level-1 retention keeps what a flusher still needs. Reading: levels/restore.py.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence

from ..comm import Comm
from ..config import LevelSpec
from ..errors import CheckpointError, CommitTimeoutError
from ..format.catalog import committed, parse_dir
from ..format.entries import MANIFEST_NAME, RankRecord
from ..format.manifest import Manifest
from ..load.agreed import Loaded
from ..load.exchange import Exchange
from ..save.commit import CommitInputs, retain, wait_for_commit, write_abort
from ..save.filebuffers import BUFFERS, FileBuffers
from ..save.persist import PersistJob
from ..save.tally import Tally
from ..storage import Storage
from .assemble import Assembly
from .destination import Retention, new_generation
from .flush import Flusher, FlushItem
from .memory import NodeParts, check_room, remove_node_dir
from .open import (RANK_COMMIT, Level, RankCommit, assemblable, held_catalog, local_catalog, open_levels, rank_dir,
                   write_rank_commit)
from .replicate import Replicator, open_group
from .restore import load_levels


class MultiLevel:
    """Levels (fastest first) and one background flusher per lower level, for one ``Checkpointer``.

    The flushers report to ``tally`` (counters ``flushed``, ``flush_skipped``, ``flush_failed``,
    ``flush_bytes``; one :class:`~ckpt_engine.levels.flush.FlushRecord` per checkpoint and lower level).
    """

    make_room = False

    def __init__(self, specs: Sequence[LevelSpec], comm: Comm, *, commit_timeout: float, retries: int,
                 tally: Tally) -> None:
        """Open every level (a collective, see :func:`~ckpt_engine.levels.open.open_levels`) and start
        the flushers; a flush a crash cut short is started over."""
        opening = open_levels(specs, comm, new_generation)
        self.levels: tuple[Level, ...] = opening.levels
        self.fast = self.levels[0]
        self.node_local = self.fast.node_local
        self.generation = opening.generation
        self.complete = opening.complete
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.memory, self.node, self.nodes = specs[0], opening.node, opening.nodes
        self._keep_fast = self.fast.keep_last
        self._admitted = False
        self._room: int | None = None  # a memory level: how many checkpoints its room holds (admit)
        self._drained = False
        self.full_is_warning = self.nodes is not None
        """A full memory level is a warning: the job goes on, the slower levels keep what they have."""
        self.buffers: FileBuffers | None = None
        """A memory level: the rank's snapshot buffers are files of it (save/filebuffers.py)."""
        if self.node is not None and self.fast.storage.protocol == "file":
            self.buffers = FileBuffers(self.fast.storage.path(BUFFERS))
        self.replicator: Replicator | None = None
        if self.nodes is not None and self.memory.replicas > 0 and self.nodes.count > 1:
            group = open_group(comm, self.generation, min(commit_timeout, 120.0))
            self.replicator = Replicator(group, self.node, self.nodes, self.rank,  # type: ignore[arg-type]
                                         self.memory.replicas, keep_last=self.fast.keep_last,
                                         generation=self.generation, tally=tally)
        self.assembly: Assembly | None = None
        """What this rank moved in its last restore from the node-local level 1 (levels/assemble.py)."""
        self._templates: dict[str, CommitInputs] = {}
        self._last_committed: str | None = None
        self._retention = Retention()
        self.flushers = tuple(
            Flusher(self.fast.storage, level.storage, level=level.index, rank=self.rank, world_size=self.world_size,
                    generation=self.generation, keep_last=level.keep_last, commit_timeout=commit_timeout,
                    retries=retries, manifest_of=self._manifest_of if self.rank == 0 else None, tally=tally)
            for level in self.levels[1:])
        start = time.perf_counter()
        for flusher, dirname in zip(self.flushers, opening.recover):
            if dirname is not None:  # a crash cut its flush short: start it over
                flusher.offer(FlushItem(dirname, parse_dir(dirname)[0], True, "", start, start))  # type: ignore[index]

    # ---- saving -----------------------------------------------------------------------------------
    def _kept_buffers(self) -> int:
        """A memory level's snapshot buffers are its checkpoints: ``keep_last`` of them reserved,
        and, with slower levels, the two that the flushers may keep beyond them for a while (the one
        being copied and, on the other ranks, the one rank 0 chose next: levels/flush.py, ``protected``;
        the newest not yet copied is among the newest ``keep_last`` already). Made on demand, those landed on a save whenever a
        flush lagged: a 1.5 GB page-locked buffer held a GPT-2's training step for 0.84 s on an H200
        (2026-11-28). Reserved in the background like the others, they cost that once, off the
        training thread (and ~0.14 s of CPU per 176 MiB on the CPU VM). Only as far as the level's
        room (its ``budget``) goes beyond the ``keep_last`` + 1 it was admitted with."""
        if self.buffers is None:
            return 0
        keep = self._keep_fast or 1
        spare = 2 if self.flushers else 0
        return keep + (spare if self._room is None else max(0, min(spare, self._room - keep - 1)))

    def admit(self, nbytes: int) -> int:
        """Before the first save (or at ``reserve()``), with this rank's part size: a memory level
        that cannot hold one checkpoint plus the one being written is refused with the numbers; a
        ``budget`` lowers level 1's ``keep_last`` to what it holds (levels/memory.py). The snapshot
        buffers its committed checkpoints keep (:meth:`_kept_buffers`)."""
        if self._admitted or self.nodes is None:
            return self._kept_buffers()
        fits = check_room(self.node.path(""), nbytes, self.nodes.local_world(self.rank),  # type: ignore[union-attr]
                          len(self.nodes.peers(self.rank, self.memory.replicas)), self.memory.budget)
        self._keep_fast = fits if self._keep_fast is None else min(self._keep_fast, fits)
        self._room = fits + 1
        self._admitted = True
        return self._kept_buffers()

    def saving(self, dirname: str, inputs: CommitInputs) -> CommitInputs | None:
        """A shared level 1 is committed by rank 0's persist worker; on a node-local one each rank
        commits its own files (:meth:`persisted`), with these inputs."""
        if self.replicator is not None:
            self.replicator.expect(dirname)
        if self.node_local:
            self._templates[dirname] = inputs
            return None
        return inputs if self.rank == 0 else None

    def skipped(self, dirname: str, step: int, saved_at: float) -> None:
        """This rank skipped the attempt (back-pressure): an abort marker for rank 0's commit, and the
        flushers learn it (rank 0 may still pick it)."""
        if self.world_size > 1:
            write_abort(self.fast.storage, dirname, self.rank, "skipped")
        if self.replicator is not None:
            self.replicator.expect(dirname)
            self.replicator.settle(dirname, False)
        self._templates.pop(dirname, None)
        self._offer(FlushItem(dirname, step, False, "skipped", saved_at, time.perf_counter()))

    def persisted(self, job: PersistJob) -> bool:
        """Persist thread, after every job: commit this rank's files on a node-local level 1, hand
        the attempt (done or not) to the flushers, then level-1 retention when this rank committed
        it (after the hand-over, so that it sees what the flushers need)."""
        inputs = self._templates.pop(job.dirname, None)
        ok = job.durable
        try:
            if ok and self.node_local:
                ok = False
                write_rank_commit(self.fast.storage, job.dirname, self.rank,
                                  inputs.manifest_body((), time.time()),  # type: ignore[union-attr]
                                  (job.index, job.nbytes) if job.index is not None else None)
                job.record.committed = ok = True
        finally:
            if self.replicator is not None:
                self.replicator.settle(job.dirname, ok)
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
        removed = retain(self.fast.storage, dirname, self._keep_fast, self.generation, marker=self.fast.marker,
                         protect=protect)
        for flusher in self.flushers:
            flusher.forget(removed)
        return removed

    # ---- waiting ----------------------------------------------------------------------------------
    def await_commit(self, dirname: str, timeout: float) -> None:
        """Other ranks of a shared level 1: until rank 0 committed ``dirname`` there. A memory level:
        until this rank's part is also on its peers (the checkpoint is *taken*: it survives this
        node); a peer that died is not waited for (replication stopped, warned once)."""
        if not self.node_local and self.rank != 0:
            wait_for_commit(self.fast.storage, dirname, self.world_size, timeout)
        if self.replicator is not None and not self.replicator.drain(timeout):
            raise CommitTimeoutError(f"{self.fast.name}: {dirname} not replicated to ranks {self.replicator.peers} "
                                     f"on other nodes within {timeout:g} s; is every rank saving the same steps?")

    def drain(self, timeout: float) -> None:
        """Wait until every lower level has the newest checkpoint (older pending ones are skipped).

        Raises :class:`CheckpointError` naming the level and steps after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        if self.replicator is not None and not self.replicator.drain(timeout):
            raise CheckpointError(f"{self.fast.name}: replication to other nodes not finished within {timeout:g} s; "
                                  "pass close(timeout=...) to wait longer")
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
        """A flush that failed for good (after its retries), once; named by its level. Replication
        that stopped (a peer died) is warned about, once: the other levels go on."""
        warning = self.replicator.take_warning() if self.replicator is not None else None
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
        flushers (a copy in progress goes on in its daemon thread)."""
        if self._last_committed is not None:
            self._retention.submit(self.retain_fast, self._last_committed)
        failures = self._retention.shutdown()
        for flusher in self.flushers:
            flusher.stop(0.0)
        if self.replicator is not None:
            self.replicator.stop()
        if self.buffers is not None:  # the checkpoints kept keep their bytes through their own links
            self.buffers.remove()
        if self.node is not None and release_memory and self._drained and len(self.levels) > 1:
            remove_node_dir(self.node.path(""))  # the slower levels hold its newest checkpoint
        return failures

    # ---- catalog ----------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps this process can see on any level, oldest first (no communication).

        A node-local level 1 contributes the steps every rank could assemble there at start (the
        same on every rank), and on a memory level the steps saved since whose every part this
        node holds now; shared levels are listed now.
        """
        found: set[int] = set()
        for level in self.levels:
            if level.node_local:
                found |= {step for step, _ in self.complete}
                if self.node is not None:
                    found |= {step for step, d, _ in assemblable([self.held()])
                              if parse_dir(d)[1].startswith(self.generation)}  # type: ignore[index]
            else:
                found |= {e.step for e in committed(level.storage)}
        return sorted(found)

    def load(self, step: int | None, fallback: bool, threads: int, failures: list[str],
             progress: bool, into: Any = None) -> tuple[Any, Loaded]:
        """A collective with several ranks (levels/restore.py); ``progress`` is not drawn here."""
        return load_levels(self, self.comm, step, fallback, threads, failures, into)

    def restore(self, step: int | None, fallback: bool, threads: int, failures: list[str],
                into: Any = None, exchange: Exchange | None = None) -> tuple[Any, Loaded]:
        """:meth:`load`, with ``exchange``: the route of a shared level's large pieces, as on one level
        (a node-local level 1 exchanges its parts its own way: levels/assemble.py)."""
        return load_levels(self, self.comm, step, fallback, threads, failures, into, exchange)

    def held(self) -> dict[str, list[tuple[int, str, int]]]:
        """The committed node-local level-1 parts this rank can read now, by writer (levels/open.py)."""
        if self.node is not None:
            return held_catalog(self.node, self.rank, True)
        return {str(self.rank): local_catalog(self.fast.storage)}

    def node_parts(self) -> Storage:
        """This node's memory as one checkpoint root (levels/memory.py :class:`NodeParts`)."""
        return NodeParts(self.node.path(""))  # type: ignore[union-attr]

    def part_storage(self, writer: int) -> Storage:
        """Where this rank reads ``writer``'s part on the node-local level 1."""
        return self.fast.storage if writer == self.rank or self.node is None else self.node.child(rank_dir(writer))

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
