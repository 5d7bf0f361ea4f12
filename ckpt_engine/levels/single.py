"""One path: the destination of a ``Checkpointer`` with a single level (see destination.py).

Rank 0 creates and sweeps the root at open; the path is committed as a shared level 1 is
(levels/first.py :class:`~ckpt_engine.levels.first.SharedFirst`: rank 0's persist thread writes
the manifest, commit.py; the other ranks wait for it in ``wait()``). Retention runs on rank 0
after each commit; under a full storage, persist may make room (``failure.py``). Reading is
:func:`ckpt_engine.load.agreed.restore`: with the job's communicator for ``restore()``, alone for ``load()``.

Not a :class:`~ckpt_engine.levels.multilevel.MultiLevel` without flushers: its open (no probe,
``readonly``) and its ``load()`` (no communication, a progress bar) are those of a plain path.
"""

from __future__ import annotations

from typing import Any, Callable

from ..agree import on_rank0
from ..comm import Comm, LocalComm
from ..config import LevelSpec
from ..errors import CheckpointError
from ..format.catalog import committed
from ..load.agreed import Loaded, restore
from ..load.exchange import Exchange
from ..save.commit import CommitInputs, retain, sweep
from ..save.persist import PersistJob
from ..storage import Storage
from .destination import Retention, new_generation
from .first import SharedFirst
from .open import Level, level_storage


class SingleLevel:
    """A :class:`~ckpt_engine.levels.destination.Destination` of one path (one level)."""

    make_room = True
    full_is_warning = False
    buffers: Callable[[int, bool], Any] | None = None
    """Snapshot buffers are ordinary host memory (a memory level makes them files: save/filebuffers.py)."""

    def __init__(self, spec: LevelSpec, comm: Comm, *, readonly: bool = False) -> None:
        """Open the root (a collective: rank 0 creates and sweeps it unless ``readonly``; its failure
        is raised on every rank) and agree on this incarnation's tag."""
        storage = level_storage(spec)
        if storage.protocol == "memory" and comm.world_size > 1:
            raise CheckpointError(f"{spec.path!r}: memory:// lives in one process and cannot hold a checkpoint of "
                                  f"{comm.world_size} ranks; use a shared filesystem or object store")
        self.storage, self.keep_last, self.comm = storage, spec.keep_last, comm
        self.levels: tuple[Level, ...] = (Level(0, storage, spec.keep_last),)
        self.first = SharedFirst(self.levels[0], comm)
        self.generation: str = on_rank0(comm, lambda: _open_root(storage, readonly))
        self._retention = Retention()

    # ---- saving ---------------------------------------------------------------------------------
    def admit(self, nbytes: int) -> int:
        """Nothing to check, no snapshot buffer outlives its persist (levels/first.py)."""
        return self.first.admit(nbytes)

    def saving(self, dirname: str, inputs: CommitInputs) -> CommitInputs | None:
        """Rank 0's persist worker commits every attempt."""
        return self.first.saving(dirname, inputs)

    def skipped(self, dirname: str, step: int, saved_at: float) -> None:
        """An abort marker, so that rank 0's commit stops waiting for this rank."""
        self.first.skipped(dirname)

    def persisted(self, job: PersistJob) -> bool:
        """Rank 0, after a commit: retention (older attempts, ``keep_last``) on the retention thread."""
        if not (job.durable and job.record.committed):
            return False
        self._retention.submit(retain, self.storage, job.dirname, self.keep_last, self.generation)
        return True

    def await_commit(self, dirname: str, timeout: float) -> None:
        self.first.await_commit(dirname, timeout)

    def drain(self, timeout: float) -> None:
        """Nothing below this level."""

    def take_error(self) -> CheckpointError | None:
        return None

    def retention_failures(self, wait: bool) -> list[BaseException]:
        return self._retention.failures(wait)

    def close(self, release_memory: bool = True) -> list[BaseException]:
        return self._retention.shutdown()

    # ---- reading --------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        return [e.step for e in committed(self.storage)]

    def load(self, step: int | None, fallback: bool, threads: int, failures: list[str],
             progress: bool, into: Any = None) -> tuple[Any, Loaded]:
        """The choice of :meth:`restore`, made by this process alone (no communication)."""
        return restore(self.storage, LocalComm(), step, fallback, threads, failures, rank=self.comm.rank,
                       progress=progress, into=into)

    def restore(self, step: int | None, fallback: bool, threads: int, failures: list[str],
                into: Any = None, exchange: Exchange | None = None) -> tuple[Any, Loaded]:
        return restore(self.storage, self.comm, step, fallback, threads, failures, into=into, exchange=exchange)


def _open_root(storage: Storage, readonly: bool) -> str:
    """Rank 0 at start: create and sweep the root (unless read-only); the new incarnation's name."""
    if not readonly:
        storage.makedirs("")  # a root that exists as a file is a StorageError saying so
        sweep(storage)
    return new_generation()
