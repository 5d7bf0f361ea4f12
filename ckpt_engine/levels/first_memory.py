"""A node-memory level 1 (levels/memory.py): the :class:`~ckpt_engine.levels.first.FirstLevel` that
commits each rank's part in its node's memory as a node-local level does, and replicates it to
peers on other nodes (levels/replicate.py), so that a checkpoint counts as taken only once it
survives this node. Its snapshot buffers are files of it (save/filebuffers.py: a commit links
them), and its room is checked before the first save (:meth:`MemoryFirst.admit`).
"""

from __future__ import annotations

from typing import Protocol

from ..config import LevelSpec
from ..errors import CheckpointError, CommitTimeoutError
from ..format.catalog import split_dir
from ..save.commit import CommitInputs
from ..save.filebuffers import BUFFERS, FileBuffers
from ..save.persist import PersistJob
from ..storage import Storage, open_storage
from .first import ManifestOf, NodeLocalFirst
from .memory import NodeParts, NodeTable, check_room, remove_node_dir
from .open import Level, NodeMemory, assemblable, held_catalog, rank_dir


class Replicas(Protocol):
    """What the memory level asks of its replication (:class:`~ckpt_engine.levels.replicate.Replicator`,
    or :class:`Unreplicated` with no peer on another node); the order of calls is the Replicator's."""

    peers: list[int]

    def expect(self, dirname: str) -> None: ...

    def settle(self, dirname: str, ok: bool) -> None: ...

    def drain(self, timeout: float) -> bool: ...

    def take_warning(self) -> Warning | None: ...

    def stop(self) -> None: ...


class Unreplicated:
    """:class:`Replicas` of a memory level with ``replicas: 0`` or on one node: nothing to send."""

    peers: list[int] = []

    def expect(self, dirname: str) -> None:
        """No round to wait for."""

    def settle(self, dirname: str, ok: bool) -> None:
        """No round to start."""

    def drain(self, timeout: float) -> bool:
        return True

    def take_warning(self) -> Warning | None:
        return None

    def stop(self) -> None:
        """No thread."""


class MemoryFirst:
    """Level 1 in the node's memory: this rank's own part committed by ``own`` (as on any node-local
    level), copies sent to and received from peers by ``replicas``, snapshot buffers made by
    ``buffers``, and as many checkpoints kept as the node's room holds."""

    full_is_warning = True
    """A full memory level is a warning: the job goes on, the slower levels keep what they have."""

    def __init__(self, own: NodeLocalFirst, spec: LevelSpec, memory: NodeMemory, replicas: Replicas, *,
                 generation: str, flushed: bool) -> None:
        """``memory``: this node's directory (every rank's part it holds, below ``rank-NNNNN/``) and
        which node each rank is on; ``flushed``: whether slower levels copy its checkpoints (two more
        buffers kept, see :meth:`admit`)."""
        self.own, self.spec, self.replicas = own, spec, replicas
        self.node: Storage = memory.node
        self.nodes: NodeTable = memory.nodes
        self.level: Level = own.level
        self.rank, self.generation, self.flushed = own.rank, generation, flushed
        self.buffers = FileBuffers(self.level.storage.path(BUFFERS))
        self._keep = self.level.keep_last
        self._room: int | None = None
        """How many checkpoints the node's room holds, once :meth:`admit` checked it."""

    @property
    def keep_last(self) -> int | None:
        """The level's ``keep_last``, lowered by :meth:`admit` to what its room (``budget``) holds."""
        return self._keep

    def admit(self, nbytes: int) -> int:
        """Before the first save (or at ``reserve()``), with this rank's part size: a memory level
        that cannot hold one checkpoint plus the one being written is refused with the numbers; a
        ``budget`` lowers ``keep_last`` to what it holds (levels/memory.py).

        Returns the snapshot buffers kept: a memory level's are its checkpoints, ``keep_last`` of
        them, and, with slower levels, the two that the flushers may keep beyond them for a while
        (the one being copied and, on the other ranks, the one rank 0 chose next: levels/flush.py,
        ``protected``; the newest not yet copied is among the newest ``keep_last`` already). Made on
        demand, those landed on a save whenever a flush lagged: a 1.5 GB page-locked buffer held a
        GPT-2's training step for 0.84 s on an H200 (2026-11-28). Reserved in the background like the
        others, they cost that once, off the training thread (and ~0.14 s of CPU per 176 MiB on the
        CPU VM). Only as far as the level's room goes beyond the ``keep_last`` + 1 it was admitted with.
        """
        if self._room is None:
            fits = check_room(self.node.path(""), nbytes, self.nodes.local_world(self.rank),
                              len(self.nodes.peers(self.rank, self.spec.replicas)), self.spec.budget)
            self._keep = fits if self._keep is None else min(self._keep, fits)
            self._room = fits + 1
        keep = self._keep or 1
        spare = 2 if self.flushed else 0
        return keep + max(0, min(spare, self._room - keep - 1))

    def saving(self, dirname: str, inputs: CommitInputs) -> CommitInputs | None:
        """Its replication round comes in save order; this rank commits its own part (:meth:`commit`)."""
        self.replicas.expect(dirname)
        return self.own.saving(dirname, inputs)

    def skipped(self, dirname: str) -> None:
        self.own.skipped(dirname)
        self.replicas.expect(dirname)
        self.replicas.settle(dirname, False)

    def commit(self, job: PersistJob) -> bool:
        """This rank's own commit; then its part goes to the peers (or their round goes on without it)."""
        ok = False
        try:
            ok = self.own.commit(job)
        finally:
            self.replicas.settle(job.dirname, ok)
        return ok

    def await_commit(self, dirname: str, timeout: float) -> None:
        """Until this rank's part is also on its peers (the checkpoint is *taken*: it survives this
        node); a peer that died is not waited for (replication stopped, warned once)."""
        if not self.replicas.drain(timeout):
            raise CommitTimeoutError(f"{self.level.name}: {dirname} not replicated to ranks {self.replicas.peers} "
                                     f"on other nodes within {timeout:g} s; is every rank saving the same steps?")

    def drain(self, timeout: float) -> None:
        if not self.replicas.drain(timeout):
            raise CheckpointError(f"{self.level.name}: replication to other nodes not finished within {timeout:g} s; "
                                  "pass close(timeout=...) to wait longer")

    def take_warning(self) -> Warning | None:
        """Replication that stopped (a peer died), once: the other levels go on."""
        return self.replicas.take_warning()

    def close(self, release: bool) -> None:
        """Stop replicating; the buffers' names go (the checkpoints kept keep their bytes through
        their own links); ``release``: this node's memory too."""
        self.replicas.stop()
        self.buffers.remove()
        if release:
            remove_node_dir(self.node.path(""))

    def manifest_of(self, dirname: str) -> ManifestOf:
        return self.own.manifest_of(dirname)

    def steps(self) -> set[int]:
        """What every rank could assemble at start, and the steps saved since whose every part this node holds now."""
        now = {step for step, d, _ in assemblable([self.held()]) if split_dir(d)[1].startswith(self.generation)}
        return self.own.steps() | now

    def held(self) -> dict[str, list[tuple[int, str, int]]]:
        """Every part in this node's memory: its ranks' own and the replicas it received."""
        return held_catalog(self.node, self.rank, True)

    def part_storage(self, writer: int) -> Storage:
        """Where ``writer``'s part lives in this node's memory."""
        return self.level.storage if writer == self.rank else self.node.child(rank_dir(writer))

    def node_parts(self) -> Storage:
        """This node's memory as one checkpoint root (levels/memory.py :class:`NodeParts`)."""
        return NodeParts(open_storage(self.node.path("")))

