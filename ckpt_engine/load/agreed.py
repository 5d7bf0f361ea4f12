"""Choosing the checkpoint to restore: the newest whose every part a rank will use verifies.

A rank that resumes training uses three parts of a checkpoint: the replicated state, its own
writer's ``local`` (RNG, data position, per-rank buffers) and writer 0's ``local`` (where the
front ends take per-rank state from when the world size changed, and the plain values every
rank needs). A checkpoint is chosen only when all three verify, so a damaged ``local`` section
moves the fallback on to an older checkpoint instead of failing after the choice.

* :func:`read_for_rank`: the parts one rank uses, read and verified.
* :func:`restore`: the choice on one level (several: levels/restore.py), by the one search of
  load/search.py. With the job's communicator it is the collective the front ends call on every
  rank: rank 0 lists the candidates once and broadcasts them (or its failure to list); the search
  moves all ranks from one candidate to the next together, so every rank resumes from the same
  step. With a :class:`LocalComm` it is ``Checkpointer.load()``: the same choice by this process
  alone, no communication.
* :func:`read_whole`: one candidate read as a shared level is read (the whole state, or this
  rank's share of it and the exchange), for the search; levels/restore.py reads shared levels by it.
* :class:`Loaded`: what a load or restore opened, kept for ``load_local()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..agree import on_rank0
from ..comm import Comm
from ..errors import CheckpointError, NoCheckpointError
from ..format.catalog import committed, manifest_dirs
from ..format.manifest import Manifest
from ..progress import Bar, wanted as progress_wanted
from ..storage import Storage
from .exchange import Exchange, Pending, node_name
from .open import Opened, Progress, check_room, open_checkpoint
from .read import read_local, read_state
from .search import search


@dataclass(frozen=True)
class Restored:
    """What a rank resumes from: one checkpoint, every part of it this rank uses verified. The one
    result of every ``restore()``: ``Checkpointer.restore()``, ``HorovodCheckpointer.restore()`` and
    ``AsyncShardedCheckpoint.restored`` (each ``None`` when nothing was restored)."""

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
    where: str = ""
    """The checkpoint's directory, as a URL (no credentials): what to paste into ``ckpt verify``."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where each part came from and how: ``state`` (the replicated state: read from ``where``, or
    its pieces exchanged over the process group), ``local`` and ``first`` (this rank's writer's and
    writer 0's per-rank parts); one line of text each, for logs."""


@dataclass(frozen=True)
class Loaded:
    """What the last load or restore opened: the checkpoint, where, and the ``local`` sections it verified."""

    opened: Opened
    storage: Storage
    level: int = 0
    """The level it was read from (0: the first, fastest)."""
    locals: Mapping[int, Any] = field(default_factory=dict)
    """Writer ``r``'s ``local`` for each ``r`` verified before the choice (this rank's writer, writer 0)."""
    node_local: bool = False
    """Read from this rank's node-local level: only ``locals`` are at hand, no other writer's files."""

    @property
    def manifest(self) -> Manifest:
        return self.opened.manifest

    def local(self, rank: int) -> Any:
        """Writer ``rank``'s ``local`` (``None`` when the checkpoint has no such writer); read
        from storage, verified, when it was not verified at the choice."""
        if rank >= self.manifest.world_size:
            return None
        if rank in self.locals:
            return self.locals[rank]
        if self.node_local:
            raise CheckpointError(f"writer {rank}'s local state of {self.opened.dirname} is on its own node's level "
                                  f"{self.level + 1}; after a restore from there only this rank's and writer 0's are "
                                  "at hand (load that step from a shared level to read any)")
        return read_local(self.storage, self.opened, rank)

    def writer_local(self, rank: object) -> Any:
        """Writer ``rank``'s ``local`` for a caller that names the writer (``load_local(rank=...)``):
        unlike :meth:`local`, which answers ``None`` for a rank beyond the writers (a rank of a
        larger job), a ``rank`` that is not an int in ``0..world_size - 1`` of the checkpoint is a
        :class:`ValueError` naming it, the valid range and the checkpoint."""
        writers = self.manifest.world_size
        if type(rank) is not int or not 0 <= rank < writers:
            raise ValueError(f"rank must be an int in 0..{writers - 1}, the writer ranks of "
                             f"{self.storage.describe(self.opened.dirname)} (saved by {writers} ranks), got {rank!r}")
        return self.local(rank)


def local_ranks(rank: int, writers: int) -> list[int]:
    """The writers whose ``local`` rank ``rank`` uses: its own (when it had a writer) and writer 0."""
    return sorted({r for r in (0, rank) if r < writers})


def read_for_rank(storage: Storage, ck: Opened, rank: int, threads: int,
                  progress: Progress | None = None, into: Any = None) -> tuple[Any, dict[int, Any]]:
    """The replicated state of ``ck`` (or ``into`` filled from it: load/into.py) and the ``local``
    of every writer in :func:`local_ranks`, each verified; raises :class:`CorruptionError` or
    :class:`FormatError` naming the file otherwise, and :class:`InsufficientMemoryError` before
    allocating when the whole tensors it reads (the state unless ``into``, and those locals) add
    up to more than this process can have."""
    check_room(storage, ck, state=into is None, local_ranks=local_ranks(rank, ck.manifest.world_size))
    state = read_state(storage, ck, threads, progress, into)
    return state, read_locals(storage, ck, rank)


def read_locals(storage: Storage, ck: Opened, rank: int) -> dict[int, Any]:
    """The ``local`` of every writer in :func:`local_ranks`, each verified."""
    return {r: read_local(storage, ck, r) for r in local_ranks(rank, ck.manifest.world_size)}


@dataclass(frozen=True)
class Copy:
    """A checkpoint directory to try on the one level."""

    step: int
    dirname: str


def restore(storage: Storage, comm: Comm, step: int | None, fallback: bool, threads: int, failures: list[str], *,
            rank: int | None = None, progress: bool = False, into: Any = None,
            exchange: Exchange | None = None) -> tuple[Any, Loaded]:
    """Every rank of ``comm``: the newest checkpoint (or the newest attempt of ``step``) whose parts
    verify on every rank, as ``(state, loaded)``; see the module docstring.

    ``rank``: whose parts to read (default ``comm.rank``; ``load()`` passes its rank with a
    :class:`LocalComm`). ``into``: a state to fill in place instead of a new one (load/into.py).
    ``exchange``: the route of the replicated state's large pieces (load/exchange.py; its
    communicator is ``comm``). ``progress``: a byte progress bar on stderr (rank 0, when a terminal).
    Appends what failed to ``failures``; which failures fall back and which end the search:
    load/search.py. Raises :class:`NoCheckpointError` when there is none.
    """
    rank = comm.rank if rank is None else rank
    found = on_rank0(comm, lambda: manifest_dirs(storage, step))
    if not found:
        which, steps = ("", "") if step is None else (f" of step {step}", f"; committed steps: {_steps(storage)}")
        raise NoCheckpointError(f"no committed checkpoint{which} at {storage.describe('')}{steps}")
    show = progress and rank == 0 and progress_wanted()
    _, (state, loaded) = search([Copy(int(s), str(d)) for s, d in reversed(found)],
                                lambda c: read_whole(storage, c.dirname, rank, threads, show, into, exchange),
                                comm, rank=rank, fallback=fallback, failures=failures,
                                where=lambda c: storage.describe(c.dirname), scope=f"at {storage.describe('')}")
    return state, loaded


def _steps(storage: Storage) -> list[int]:
    return [e.step for e in committed(storage)]


@dataclass
class WholeRead:
    """A candidate this rank read as a shared level is read: the state (or, with the exchange, this
    rank's share of it: ``pending``) and the ``local`` sections it uses, verified."""

    state: Any
    loaded: Loaded
    pending: Pending | None
    exchange: Exchange | None
    report: dict[str, Any]

    @property
    def collective(self) -> bool:
        """The exchange of the state's pieces runs on every rank together."""
        return self.pending is not None

    def finish(self, reports: Sequence[dict[str, Any]]) -> tuple[Any, Loaded]:
        if self.pending is not None and self.exchange is not None:  # every rank has its share: exchange
            self.state = self.exchange.finish(self.pending, [r["node"] for r in reports])
        return self.state, self.loaded


def read_whole(storage: Storage, dirname: str, rank: int, threads: int, show: bool = False, into: Any = None,
               exchange: Exchange | None = None, level: int = 0) -> WholeRead:
    """Open ``dirname`` and read the parts ``rank`` uses, each verified, by this rank alone; when
    the exchange applies, only this rank's share of the state (the rest comes in ``finish``)."""
    opened = open_checkpoint(storage, dirname)
    total = sum(e.nbytes for idx in opened.indexes for e in idx.entries if not e.local)
    report = {"node": node_name()}
    with Bar(total, f"load step {opened.manifest.step}", show) as bar:
        update = bar.update if show else None
        if exchange is not None and exchange.applies(into):
            check_room(storage, opened, local_ranks=local_ranks(rank, opened.manifest.world_size))
            pending = exchange.start(storage, opened, threads, update)
            return WholeRead(None, Loaded(opened, storage, level, read_locals(storage, opened, rank)), pending,
                             exchange, report)
        state, locals_ = read_for_rank(storage, opened, rank, threads, update, into)
    return WholeRead(state, Loaded(opened, storage, level, locals_), None, None, report)
