"""Level 1's commit: one committer per kind of first level, behind the small :class:`FirstLevel`.

A save counts as committed as soon as level 1 has it; what that takes depends on the kind, chosen
once when the levels are opened (:func:`~ckpt_engine.levels.multilevel.first_level`):

* :class:`SharedFirst`: every rank sees the whole level; rank 0's persist worker writes the
  manifest (save/commit.py) and the other ranks wait for it;
* :class:`NodeLocalFirst`: each rank sees its own subtree (``rank-NNNNN/``) and commits its own
  files there with its ``rank-commit.json`` (levels/open.py), on its persist thread;
* :class:`~ckpt_engine.levels.first_memory.MemoryFirst`: the node's memory, committed as a
  node-local level is, each rank's part also replicated to peers on other nodes.

The slower levels' flushers (flush.py) and level-1 retention are the composer's
(:class:`~ckpt_engine.levels.multilevel.MultiLevel`), the same for every kind.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Protocol

from ..comm import Comm
from ..format.catalog import committed
from ..format.entries import MANIFEST_NAME, RankRecord
from ..format.manifest import Manifest
from ..save.commit import CommitInputs, wait_for_commit, write_abort
from ..save.persist import PersistJob
from ..storage import Storage
from .open import RANK_COMMIT, Level, RankCommit, local_catalog, write_rank_commit

ManifestOf = Callable[[tuple[RankRecord, ...]], Manifest]
"""Rank 0's flusher: builds a checkpoint's manifest on a lower level from that level's rank records."""


class FirstLevel(Protocol):
    """How level 1 commits a save, and what of it this rank can read.

    Order of calls (the composer's, on the threads of destination.py's order): :meth:`admit` then
    :meth:`saving` (or :meth:`skipped`) per ``save()`` on the training thread; :meth:`commit` after
    every persist job, on the persist thread; :meth:`await_commit`, :meth:`drain`,
    :meth:`take_warning` on the training thread; :meth:`close` once, last. :meth:`manifest_of` from
    rank 0's flushers; the reading members (:meth:`steps`, :meth:`held`, :meth:`part_storage`,
    :meth:`node_parts`) from the training thread at any time.
    """

    @property
    def level(self) -> Level:
        """Level 1 as this rank reads and writes it (node-local: its own subtree)."""

    @property
    def full_is_warning(self) -> bool:
        """Whether a save that found level 1 full is a warning whatever ``on_error`` (a memory level)."""

    @property
    def buffers(self) -> Callable[[int, bool], Any] | None:
        """What makes the snapshot buffers, when not ordinary host memory (a memory level: files of it)."""

    @property
    def keep_last(self) -> int | None:
        """How many checkpoints level-1 retention keeps (a memory level: as many as its room holds)."""

    def admit(self, nbytes: int) -> int:
        """Raise :class:`CheckpointError` when level 1 cannot hold a checkpoint of this rank's
        ``nbytes``; how many snapshot buffers its committed checkpoints hold in steady state."""

    def saving(self, dirname: str, inputs: CommitInputs) -> CommitInputs | None:
        """``save()`` of attempt ``dirname``: the commit inputs for this rank's persist worker, if it commits."""

    def skipped(self, dirname: str) -> None:
        """``save()`` dropped ``dirname``: tell whoever waits for this rank's part of it."""

    def commit(self, job: PersistJob) -> bool:
        """After ``job`` (failed ones too): commit this rank's part where the kind wants it;
        whether this rank's part is on level 1 (what the flushers are told)."""

    def await_commit(self, dirname: str, timeout: float) -> None:
        """Until ``dirname`` counts as taken on level 1 (:class:`CommitTimeoutError` after ``timeout``)."""

    def drain(self, timeout: float) -> None:
        """Until level 1 is done with everything handed to it (:class:`CheckpointError` after ``timeout``)."""

    def take_warning(self) -> Warning | None:
        """A background problem of level 1 the job goes on with, once."""

    def close(self, release: bool) -> None:
        """Stop what level 1 runs; ``release``: the slower levels hold its newest, its memory may go."""

    def manifest_of(self, dirname: str) -> ManifestOf:
        """Rank 0's flushers: ``dirname``'s manifest as committed here, to commit the same below."""

    def steps(self) -> set[int]:
        """The committed steps this rank can read from level 1 (no communication)."""

    def held(self) -> dict[str, list[tuple[int, str, int]]]:
        """The committed node-local parts this rank can read now, by writer (a shared level: none)."""

    def part_storage(self, writer: int) -> Storage:
        """Where this rank reads ``writer``'s part of a checkpoint on level 1."""

    def node_parts(self) -> Storage:
        """Level 1 as one checkpoint root, holding every part this rank can read (levels/restore.py)."""


class _OnPaths:
    """What the two kinds of level 1 on paths (disk, object store) share: no budget (a full storage
    is handled at the write, failure.py), ordinary host buffers that outlive no persist, no thread."""

    level: Level
    full_is_warning = False
    buffers = None

    @property
    def keep_last(self) -> int | None:
        return self.level.keep_last

    def admit(self, nbytes: int) -> int:
        """Nothing to check; no snapshot buffer outlives its persist."""
        return 0

    def drain(self, timeout: float) -> None:
        """Nothing runs here."""

    def take_warning(self) -> Warning | None:
        return None

    def close(self, release: bool) -> None:
        """Nothing to stop."""


class SharedFirst(_OnPaths):
    """A level 1 every rank sees whole: committed as a single path is (rank 0 writes the manifest)."""

    def __init__(self, level: Level, comm: Comm) -> None:
        self.level, self.rank, self.world_size = level, comm.rank, comm.world_size

    def saving(self, dirname: str, inputs: CommitInputs) -> CommitInputs | None:
        """Rank 0's persist worker commits every attempt."""
        return inputs if self.rank == 0 else None

    def skipped(self, dirname: str) -> None:
        """An abort marker, so that rank 0's commit stops waiting for this rank."""
        if self.world_size > 1:
            write_abort(self.level.storage, dirname, self.rank, "skipped")

    def commit(self, job: PersistJob) -> bool:
        """Nothing more to write (rank 0's persist worker wrote the manifest): this rank's files are durable."""
        return job.durable

    def await_commit(self, dirname: str, timeout: float) -> None:
        """The other ranks: until rank 0 committed ``dirname``."""
        if self.rank != 0:
            wait_for_commit(self.level.storage, dirname, self.world_size, timeout)

    def manifest_of(self, dirname: str) -> ManifestOf:
        storage = self.level.storage
        where = storage.describe(f"{dirname}/{MANIFEST_NAME}")
        manifest = Manifest.from_json(storage.read_bytes(f"{dirname}/{MANIFEST_NAME}"), where)
        return lambda records: replace(manifest, ranks=tuple(records))

    def steps(self) -> set[int]:
        return {e.step for e in committed(self.level.storage)}

    def held(self) -> dict[str, list[tuple[int, str, int]]]:
        """No part is node-local: restore lists this level's manifests instead."""
        return {}

    def part_storage(self, writer: int) -> Storage:
        """Every writer's files are in the one root."""
        return self.level.storage

    def node_parts(self) -> Storage:
        return self.level.storage


class NodeLocalFirst(_OnPaths):
    """A level 1 no rank sees whole (a node's own disk): each rank commits its own files there.

    The job-wide commit that counts for a restart on other nodes is the one on the shared lower
    level; a restore uses level 1 when the ranks hold every writer's part between them.
    """

    def __init__(self, level: Level, comm: Comm, complete: tuple[tuple[int, str], ...]) -> None:
        """``complete``: what every rank could assemble from level 1 at open (levels/open.py)."""
        self.level, self.rank, self.world_size = level, comm.rank, comm.world_size
        self.complete = complete
        self._templates: dict[str, CommitInputs] = {}

    def saving(self, dirname: str, inputs: CommitInputs) -> CommitInputs | None:
        """Kept for :meth:`commit`: each rank commits its own files, no persist worker commits the job."""
        self._templates[dirname] = inputs
        return None

    def skipped(self, dirname: str) -> None:
        """An abort marker, as on a shared level (no rank waits for one here)."""
        if self.world_size > 1:
            write_abort(self.level.storage, dirname, self.rank, "skipped")
        self._templates.pop(dirname, None)

    def commit(self, job: PersistJob) -> bool:
        """This rank's ``rank-commit.json``, once its files are durable."""
        if not job.durable:
            self._templates.pop(job.dirname, None)
            return False
        inputs = self._templates.pop(job.dirname)  # kept by saving()
        write_rank_commit(self.level.storage, job.dirname, self.rank, inputs.manifest_body((), time.time()),
                          (job.index, job.nbytes) if job.index is not None else None)
        job.record.committed = True
        return True

    def await_commit(self, dirname: str, timeout: float) -> None:
        """Nothing to wait for: this rank committed its own part on its persist thread."""

    def manifest_of(self, dirname: str) -> ManifestOf:
        """From rank 0's own commit: the manifest body every rank wrote, with the lower level's rank table."""
        storage = self.level.storage
        where = storage.describe(f"{dirname}/{RANK_COMMIT}")
        rc = RankCommit.from_json(storage.read_bytes(f"{dirname}/{RANK_COMMIT}"), where)
        return lambda records: rc.manifest(records, where)

    def steps(self) -> set[int]:
        """The steps every rank could assemble from level 1 at open (the same on every rank)."""
        return {step for step, _ in self.complete}

    def held(self) -> dict[str, list[tuple[int, str, int]]]:
        """This rank's own committed parts."""
        return {str(self.rank): local_catalog(self.level.storage)}

    def part_storage(self, writer: int) -> Storage:
        """This rank's subtree: the only part it holds (other writers' are read by their ranks)."""
        return self.level.storage

    def node_parts(self) -> Storage:
        """This rank's subtree: a checkpoint is whole here only when this rank wrote all of it."""
        return self.level.storage
