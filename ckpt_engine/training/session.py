"""One training job's checkpoints, as every front end drives them.

A front end finds the state and the step boundary in its framework; the session does the rest:
the :class:`~ckpt_engine.Checkpointer` from the configuration, snapshot buffers reserved before
the first checkpoint, the decision agreed on every rank (:class:`~.schedule.Schedule`), the save
(replicated and per-rank parts, a deferred copy), restore with the rule for ranks that had no
writer, final checkpoints (end of training, an exception, an agreed preemption) and rank 0's
figures.

Order of calls, on every rank, from the training thread::

    session = TrainingSession(config, capture, name="MyFrontEnd")  # no collective yet
    session.start(comm, stop=agreement)     # collective: opens the checkpointer
    resumed = session.restore()             # collective; None: nothing committed, start fresh
    session.begin()                         # the loop starts: iteration clock, signal handlers
    # after every real optimizer step (before_update() before the next one):
        if session.due(step): session.save(step)
        session.report()
        if session.preempted(): session.stop(step); <end the run the framework's way>
    session.finish(step, final=True)        # or abort(step, error, final=...) on an exception
    session.close()

``capture`` is a callable returning :class:`~.parts.Parts` (what a checkpoint taken now holds);
each saving method takes one for this moment, or uses the one given at construction. To what the
front end captures the session adds the policy's state (replicated) and this rank's RNG states
(per rank).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Mapping

from ..checkpointer import Checkpointer, SaveHandle
from ..comm import Comm
from ..config import CheckpointConfig
from ..errors import CheckpointError
from ..host.collector import pause_collector, resume_collector
from .figures import FigureReporter
from .parts import Parts, Resumed
from .policy import Policy
from .preempt import SignalAgreement
from .resumable import rng_state
from .schedule import Schedule

Capture = Callable[[], Parts]
"""What a checkpoint taken now holds (called on the training thread, every rank)."""


class TrainingSession:
    """The checkpoints of one training job (see the module docstring for the order of calls).

    Args:
        config: the validated configuration (:func:`ckpt_engine.config.resolve_config`).
        capture: the default :data:`Capture` (saving methods may pass their own).
        name: the front end's name, for messages.
        policy: when to checkpoint; default ``config.policy()`` (a front end that stores the
            policy's state elsewhere too passes its own).
        pipeline: periodic saves defer their copy to overlap the next forward/backward.
        max_inflight, commit_timeout: passed to the :class:`Checkpointer`.
        on_figures: called on rank 0 with each finished save's and flush's figures.
    """

    def __init__(self, config: CheckpointConfig, capture: Capture | None = None, *, name: str,
                 policy: Policy | None = None, pipeline: bool = False, max_inflight: int = 1,
                 commit_timeout: float = 600.0, on_figures: Callable[[dict[str, Any]], None] | None = None) -> None:
        if type(max_inflight) is not int or max_inflight < 1:
            raise ValueError(f"max_inflight must be a positive integer, got {max_inflight!r}")
        self.config, self.capture, self.name = config, capture, name
        self.policy = policy if policy is not None else config.policy()
        self.pipeline, self.on_figures = pipeline, on_figures
        self.max_inflight, self.commit_timeout = max_inflight, commit_timeout
        self.ck: Checkpointer | None = None
        self.resumed_from: int | None = None
        """The step the last :meth:`restore` resumed from."""
        self.last_saved: int | None = None
        """The step of the last checkpoint taken (or restored): no final checkpoint repeats it."""
        self._schedule: Schedule | None = None
        self._figures: FigureReporter | None = None
        self._stop: SignalAgreement | None = None
        self._handle: SaveHandle | None = None
        self._reserved = False

    @property
    def active(self) -> bool:
        """Between :meth:`start` and :meth:`close`."""
        return self.ck is not None

    # ---- set-up and restore -------------------------------------------------------------------
    def start(self, comm: Comm, stop: SignalAgreement | None = None) -> Checkpointer:
        """Open the checkpointer for ``comm``'s ranks (every rank, a collective). ``stop``: the
        preemption agreement over the front end's collective (installed by :meth:`begin`)."""
        if self.ck is not None:
            raise CheckpointError(f"{self.name}: this training session is already started")
        self.ck = Checkpointer.from_config(self.config, comm=comm, max_inflight=self.max_inflight,
                                           commit_timeout=self.commit_timeout)
        self._schedule, self._figures = Schedule(self.policy, self.ck), FigureReporter(self.ck, self.policy)
        self._stop, self._handle, self._reserved, self.last_saved = stop, None, False, None
        return self.ck

    def restore(self, step: int | None = None, into: Mapping[str, Any] | None = None) -> Resumed | None:
        """Every rank together: the newest checkpoint (or the newest attempt of ``step``) whose
        every part this rank uses verifies on every rank (a damaged one is skipped by all).

        Loads the policy's state and restarts the iteration clock; returns this rank's parts
        (:class:`Resumed`: writer 0's per-rank part for a rank that had no writer), or ``None`` when
        nothing is committed (start fresh; a ``step`` not committed raises
        :class:`~ckpt_engine.NoCheckpointError`). ``into``: the replicated part to fill in place
        (``Checkpointer.restore(into=...)``: a sharded model's and optimizers' state, each rank
        reading its chunks); ``replicated`` is then a new mapping of its entries (the same objects,
        filled) and the policy's.
        """
        restored = self._open().restore(step, into=None if into is None else {**into, "policy": None})
        if restored is None:
            return None
        own = restored.local
        if "policy" in restored.state:
            self.policy.load_state_dict(restored.state["policy"] or {})
        self.resumed_from = self.last_saved = restored.step
        self._agreement().restart_clock()
        return Resumed(restored.step, restored.state, own if own is not None else restored.first,
                       own.get("rng") if own is not None else None, restored.first, restored.manifest, restored)

    def begin(self) -> None:
        """The training loop starts (after the framework installed its own signal handlers):
        restart the iteration clock; take the preemption signals over."""
        self._agreement().restart_clock()
        if self._stop is not None:
            self._stop.install()

    # ---- every step ---------------------------------------------------------------------------
    def due(self, step: int, capture: Capture | None = None) -> bool:
        """After every real optimizer step, every rank: whether a checkpoint is due at ``step``
        (rank 0's policy decides once per checkpoint; the same answer on every rank).

        The first call reserves the snapshot buffers with ``capture()`` when nothing is due yet:
        only after the first step is the state complete (an optimizer creates its state then), and
        the first checkpoint then does not pay for the allocation.
        """
        schedule = self._agreement()
        due = schedule.should_save(step)
        if not self._reserved:
            self._reserved = True
            if not due:
                self._open().reserve(*self._envelope(capture), background=True)
                schedule.restart_clock()  # the reservation is no training iteration
        return due

    def save(self, step: int, capture: Capture | None = None, *, defer: bool | None = None) -> None:
        """Take the checkpoint :meth:`due` asked for (every rank, the same step), then agree on
        the next due step. ``defer`` (default ``pipeline``): the copy overlaps the next
        forward/backward; :meth:`before_update` waits for it."""
        self.take(step, capture, defer=self.pipeline if defer is None else defer)
        self._agreement().saved(step)

    def take(self, step: int, capture: Capture | None = None, *, defer: bool = False) -> None:
        """Checkpoint ``step`` now, outside the schedule (a script's own save, a final one): this
        rank's share of the replicated part and its per-rank part are copied, then persisted in
        the background. Every rank that takes part in the checkpoint, at the same step.

        The training thread's CPU time for it (capture, encoding, its part of the copy) is the
        figure row's ``train_cpu_ms``; no automatic garbage collection starts during it."""
        ck = self._open()
        cpu = time.thread_time()
        pause_collector()  # a collection due now runs after the checkpoint (ckpt_engine/host/collector.py)
        try:
            state, local = self._envelope(capture)
            handle = ck.save(state, step, local, defer=defer)
        finally:
            resume_collector()
        train_cpu = time.thread_time() - cpu
        self._handle = handle if defer else None
        self.last_saved = step
        if ck.rank == 0 and ck.records and self._figures is not None:
            self._figures.track(ck.records[-1], train_cpu)

    def before_update(self) -> None:
        """Before the weights change (the next optimizer step): the deferred copy, if any, ends."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.wait_snapshot()

    def report(self) -> None:
        """Rank 0: pass the figures of every save and flush that finished since the last call to
        ``on_figures`` (each row is also written beside the checkpoints). Elsewhere: nothing."""
        if self.ck is None or self.ck.rank != 0 or self._figures is None:
            return
        for row in self._figures.collect():
            if self.on_figures is not None:
                self.on_figures(row)

    def preempted(self) -> bool:
        """After every step, every rank: whether the ranks agreed on a preemption notice (the same
        answer on every rank at the same step; see :mod:`.preempt`)."""
        return self._stop is not None and self._stop.poll()

    # ---- the ways out -------------------------------------------------------------------------
    def stop(self, step: int, capture: Capture | None = None) -> None:
        """After :meth:`preempted`, every rank: checkpoint ``step`` unless it is saved, wait until
        it is committed, then give the signals back. The front end then ends the run its way.

        The handlers stay the session's until the commit: a further notice (a scheduler's second
        SIGTERM; under ``ddp_spawn`` the launcher's death arriving as SIGINT, seconds later on a
        loaded machine) would otherwise reach the framework's handler and interrupt the final
        checkpoint."""
        try:
            if self.last_saved != step:
                self.take(step, capture)
            self._open().wait()
            self.report()
        finally:
            if self._stop is not None:
                self._stop.uninstall()

    def finish(self, step: int, *, final: bool, capture: Capture | None = None) -> None:
        """Training ended normally, every rank: with ``final``, checkpoint ``step`` unless it is
        saved (or no step was taken); wait until everything is committed on every level."""
        if self._stop is not None:
            self._stop.finish()
            self._stop.uninstall()
        if final and step > 0 and step != self.last_saved:
            self.take(step, capture)
        self._open().wait(flush=True)
        self.report()

    def abort(self, step: int, error: BaseException, *, final: bool, capture: Capture | None = None) -> None:
        """Training ended on this rank by ``error``: wait (bounded by ``commit_timeout``) for the
        checkpoints already taken to commit, then close. With ``final`` a single process first
        checkpoints ``step``; under several ranks the others may never reach it, so it could never
        commit (a warning says so). Never raises: what fails here is a warning, so that ``error``
        stays the exception that ends training. Idempotent (nothing to do once closed)."""
        if self._stop is not None:
            self._stop.uninstall()
        if self.ck is None:
            return
        try:
            if final and step > 0 and step != self.last_saved:
                if self.ck.world_size == 1:
                    self.take(step, capture)
                else:
                    warnings.warn(f"{self.name}: no final checkpoint on an exception under several ranks (the "
                                  "other ranks may not reach it, so it could never commit); waiting for the "
                                  "checkpoints already taken", stacklevel=3)
            self.ck.wait()
            self.report()
        except Exception as e:  # never hide the exception that ended training
            warnings.warn(f"{self.name}: after {type(error).__name__}, the checkpoints in flight could not be "
                          f"committed: {e}", stacklevel=3)
        finally:
            try:
                self.close(release_memory=False)  # a restart resumes from this node's memory
            except Exception as e:
                warnings.warn(f"{self.name}: closing after {type(error).__name__}: {e}", stacklevel=3)

    def close(self, *, release_memory: bool = True) -> None:
        """Give the signals back, wait for pending saves (and flushes), stop the background
        threads (``release_memory``: see ``Checkpointer.close``). Idempotent; :meth:`start` may
        open the session again."""
        if self._stop is not None:
            self._stop.uninstall()
            self._stop = None
        ck, self.ck, self._handle = self.ck, None, None
        if ck is not None:
            ck.close(release_memory=release_memory)

    # ---- helpers ------------------------------------------------------------------------------
    def _envelope(self, capture: Capture | None) -> tuple[dict[str, Any], dict[str, Any]]:
        fn = capture if capture is not None else self.capture
        if fn is None:
            raise CheckpointError(f"{self.name}: no capture given to the training session")
        parts = fn()
        return {**parts.replicated, "policy": self.policy.state_dict()}, {**parts.per_rank, "rng": rng_state()}

    def _open(self) -> Checkpointer:
        if self.ck is None:
            raise CheckpointError(f"{self.name}: the training session is not started (or already closed)")
        return self.ck

    def _agreement(self) -> Schedule:
        self._open()
        assert self._schedule is not None
        return self._schedule
