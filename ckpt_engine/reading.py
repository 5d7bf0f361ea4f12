"""The reading side of a ``Checkpointer`` (checkpointer.py): listing steps, ``load()``, ``load_local()``
and the collective ``restore()``, all through its destination (levels/: one path or several levels).
"""

from __future__ import annotations

from typing import Any

from .comm import Comm
from .errors import NoCheckpointError
from .format.manifest import Manifest
from .levels.destination import Destination
from .levels.restore import open_newest_shared
from .load.agreed import Loaded, Restored
from .load.exchange import Exchange, RestoreFigures


class CheckpointReading:
    """What ``Checkpointer`` offers for reading; set up by ``Checkpointer.__init__``."""

    comm: Comm
    rank: int
    read_threads: int
    load_failures: list[str]
    _dest: Destination
    _exchange: Exchange
    _loaded: Loaded | None

    # ---- loading ------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first (multi-level: on any level)."""
        return self._dest.steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, step: int | None = None, *, into: Any = None, fallback: bool = False,
             progress: bool = False) -> Any:
        """The replicated state of the newest committed checkpoint (or of ``step``), on CPU.

        Sharded tensors (``DTensor``) come back whole, as plain tensors. ``into``: a state to fill
        in place instead (load/into.py), e.g. a sharded model's and optimizer's state dicts
        (FSDP2, HSDP, tensor parallel: any mesh and world size) or a plain one: every tensor in it
        is filled (``copy_``, on its device), each rank reading only the pieces its own chunks
        need; other values are replaced by the checkpoint's, keys the checkpoint lacks are an
        error naming the key. Returns ``into``.

        Every byte read is verified; a mismatch raises :class:`CorruptionError` naming the file
        and tensor. So is the ``local`` of this rank's writer and of writer 0 (what the front ends
        resume per-rank state from), so that ``load_local()`` of either cannot fail afterwards.
        With ``fallback=True`` a checkpoint any of whose parts fails verification is skipped (and
        recorded in ``load_failures``) for the next newest one. Works with any world size,
        including a single process. Raises :class:`NoCheckpointError` when there is nothing.
        Never a collective, whatever the levels: each process reads alone, so ranks may fall back
        differently; :meth:`restore` is the collective that agrees.

        Several levels: every level this process can read alone is considered (the shared ones,
        and a node-local level 1's checkpoints this rank's node holds whole), the newest step first
        and the fastest level first on a tie; a copy that fails verification falls back to the same
        step on the next level (older steps only with ``fallback=True``).

        ``progress=True`` draws a byte progress bar on stderr when it is a terminal (rank 0).
        """
        self.load_failures = []
        state, self._loaded = self._dest.load(step, fallback, self.read_threads, self.load_failures, progress, into)
        return state

    def load_local(self, rank: int | None = None) -> Any:
        """This rank's ``local`` from the checkpoint of the last ``load()`` (or the newest).

        With a different world size, rank ``r`` gets writer ``r``'s local when ``r`` is below
        the writers' world size and ``None`` otherwise; ``rank=`` reads any writer's (``0..world_size - 1``
        of the checkpoint, else a ``ValueError``).
        """
        if self._loaded is None:  # before any load(): the newest this process sees, no communication
            self._loaded = open_newest_shared(self._dest.levels, self.comm.world_size)
        return self._loaded.local(self.rank) if rank is None else self._loaded.writer_local(rank)

    def restore(self, step: int | None = None, *, into: Any = None, fallback: bool = True) -> Restored | None:
        """Every rank, together (a collective): the checkpoint to resume from, and this rank's parts.

        The newest checkpoint (or the newest attempt of ``step``) whose replicated state, this
        rank's writer's ``local`` and writer 0's ``local`` verify on every rank; with
        ``fallback=True`` (the default) one that fails on any rank is skipped by all ranks alike
        (recorded in ``load_failures``), so every rank resumes from the same step. Returns a
        :class:`Restored`: ``state``, ``local`` (``None`` when this rank had no writer), ``first``
        (writer 0's), ``step``, ``level``, ``manifest``, ``where`` and ``sources`` (where each part
        came from); ``load_local()`` then returns the same values. Returns ``None`` when nothing is
        committed (start fresh); a ``step`` that is not committed raises :class:`NoCheckpointError`
        naming the committed ones (an explicit choice that cannot be honoured is an error).
        ``into``: fill that state in place (see :meth:`load`); ``state`` is then ``into``.
        """
        self.load_failures = []
        self._exchange.figures = None
        try:
            state, loaded = self._dest.restore(step, fallback, self.read_threads, self.load_failures, into,
                                               self._exchange)
        except NoCheckpointError:
            if step is not None:
                raise
            return None
        self._loaded = loaded
        m = loaded.manifest
        where = loaded.storage.describe(loaded.opened.dirname)
        return Restored(m.step, loaded.opened.dirname, state, loaded.local(self.rank), loaded.local(0), m,
                        loaded.level, where, self._sources(loaded, where))

    def _sources(self, loaded: Loaded, where: str) -> dict[str, str]:
        """Where each part of the last restore came from (:attr:`Restored.sources`)."""
        at = f"level {loaded.level} ({where})"
        figures = self._exchange.figures
        state = f"read from {at}" if figures is None else \
            f"{figures.route}: {figures.read_bytes} bytes read from {at}, {figures.received_bytes} received " \
            "over the process group"
        own = f"this node's copy on {at}" if loaded.node_local else f"read from {at}"
        return {"state": state, "local": own if loaded.manifest.world_size > self.rank else "none: no writer of this rank",
                "first": own}

    @property
    def restore_figures(self) -> RestoreFigures | None:
        """What this rank's last ``restore()`` did when it went through the exchange: the route
        taken, bytes read and received, seconds, and ``auto``'s measurement (``None`` when it read
        directly: one rank, ``into=``, route ``read``, or ``auto`` having chosen to read)."""
        return self._exchange.figures

    @property
    def loaded_manifest(self) -> Manifest | None:
        """The manifest of the checkpoint the last ``load()`` read."""
        return self._loaded.manifest if self._loaded else None

    @property
    def loaded_level(self) -> int | None:
        """Which level (0: the first, fastest) the last ``load()`` read from."""
        return self._loaded.level if self._loaded else None
