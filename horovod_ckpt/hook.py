"""``HorovodCheckpointer``: two-phase, rank-sliced checkpoints for an existing Horovod script.

Order of calls, on every rank, from the training thread::

    horovod_ckpt.init(config)     # hvd.init(), with tensor fusion off when the config asks for it
    ... model, optimizer = hvd.DistributedOptimizer(...), sampler, loader ...
    ck = HorovodCheckpointer(dirpath, model=model, optimizer=optimizer, sampler=sampler, every_n_train_steps=50)
    restored = ck.restore()       # None when nothing is committed; else every rank holds the state
    for epoch in ck.epochs(1, epochs + 1):   # the script's numbering; sets the sampler's epoch
        for batch in loader:
            ...; optimizer.step()
            ck.after_step()       # collective-free except once per checkpoint (rank 0 decides)
    ck.close()                    # final checkpoint, then waits for pending persists

The hook finds the state (``_state``: what is replicated, what is per rank) and the step boundary
(``after_step``); the core's :class:`~ckpt_engine.training.session.TrainingSession` decides, saves
(every rank its own slices: no rank-0 bottleneck), restores, and takes the final and preemption
checkpoints. The sampler is made resumable in place
(:func:`ckpt_engine.training.resumable.make_resumable`): the DataLoader keeps using the same object, and
after ``restore()`` its next iteration yields exactly the unseen rest of the interrupted epoch,
re-split across the ranks when their number changed.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from ckpt_engine import CheckpointError, Restored
from ckpt_engine.agree import on_every_rank
from ckpt_engine.comm import Comm
from ckpt_engine.config import RENAMED, UNSET, renamed, resolve_config
from ckpt_engine.errors import ConfigError
from ckpt_engine.training.parts import Parts, Resumed
from ckpt_engine.training.resumable import make_resumable, set_rng_state
from ckpt_engine.training.session import TrainingSession

from . import _hparams, _preempt, reduction
from ._hparams import Hparams, OptimizerHparams
from ._state import Tracked
from ._epochs import EpochLoop
from .comm import HorovodComm


class HorovodCheckpointer:
    """Asynchronous, rank-sliced checkpoints of a Horovod job to any fsspec path, with exact resume.

    Args:
        dirpath: checkpoint root (local path or fsspec URL such as ``s3://bucket/run``).
        model, optimizer, scheduler: what to checkpoint (``hvd.DistributedOptimizer`` included);
            :meth:`register` adds more objects with ``state_dict()``/``load_state_dict()`` (an AMP
            scaler...), replicated or per rank.
        sampler: the train sampler (typically a ``DistributedSampler``); made resumable in place.
        batch_size: per-rank batch size; optional (learned from the DataLoader's pulls otherwise,
            see :meth:`ckpt_engine.ResumableSampler.note_step`).
        config: the flags below as one options object (the one ``AsyncShardedCheckpoint`` and
            ``Checkpointer.from_config`` take): a YAML file, a mapping or a ``CheckpointConfig``;
            keyword flags given here win over it.
        every_n_train_steps, train_time_interval, overhead_budget, max_interval, keep_last, levels, storage_options, save_on_train_end, save_on_sigterm, restore_route, deterministic_reduction:
            the configuration's flags (``ckpt_engine.config``, Lightning's names); ``None`` means
            "not given" (the config's value, or the default). ``keep_last`` defaults to 3 (``None``:
            keep all). ``save_on_train_end``: ``close()`` saves the last step when it is not saved
            yet. ``save_on_sigterm``: on SIGTERM, a final checkpoint at the current step (every rank
            agrees on the step), then the signal is raised again under the previous handler.
            ``restore_route``: how a restore on several ranks gets the replicated state (``"auto"``,
            ``"read"``, ``"exchange"``): see ``ckpt_engine.load.exchange``.
            ``deterministic_reduction``: the gradients must be summed in the same order in every
            run, so that a resume on more than 2 ranks is bit-identical: Horovod's tensor fusion off,
            which :func:`horovod_ckpt.init` applies at ``hvd.init()`` (the hook comes too late to).
            Asked for and not in effect on more than 2 ranks: a ``ConfigError`` on every rank. Not
            asked for and not in effect: :meth:`restore` warns on rank 0 when it resumes more than
            2 ranks. See :mod:`horovod_ckpt.reduction`.
        on_figures: called on rank 0 with each checkpoint's figures (also in ``figures.jsonl``).
        optimizer_hparams: after a restore, the optimizer's hyper-parameters (``lr``, momentum,
            weight decay... every param group key but ``params``) and the scheduler's ``base_lrs``
            are the checkpoint's (``"checkpoint"``: rank 0 warns, naming the values, when the world
            size changed and they differ from the script's, e.g. an ``lr`` scaled by ``hvd.size()``)
            or the script's (``"script"``: the optimizer state such as momentum and ``exp_avg`` and
            the scheduler's position stay restored; a scheduled ``lr`` continues the restored
            schedule on the script's base). See :mod:`horovod_ckpt._hparams`.
        max_inflight, commit_timeout: passed to :class:`~ckpt_engine.Checkpointer`.
        deprecated: the first release's names, for one release with a ``DeprecationWarning``:
            ``path``, ``every_n_steps``, ``every_seconds``, ``final_checkpoint`` (the names above),
            ``extra`` (a mapping of objects: :meth:`register` each), ``comm`` (a communicator for
            tests: ``_comm``).
    """

    def __init__(self, dirpath: Any = None, *, model: Any, optimizer: Any = None, sampler: Any = None,
                 scheduler: Any = None, batch_size: int | None = None, config: Any = None,
                 every_n_train_steps: int | None = None, train_time_interval: Any = None,
                 overhead_budget: float | None = None, max_interval: float | None = None,
                 keep_last: int | None = UNSET, levels: list[Any] | None = None,
                 storage_options: Mapping[str, Any] | None = None, save_on_train_end: bool | None = None,
                 save_on_sigterm: bool | None = None, restore_route: str | None = None,
                 deterministic_reduction: bool | None = None,
                 on_figures: Callable[[dict[str, Any]], None] | None = None,
                 optimizer_hparams: OptimizerHparams = "checkpoint", max_inflight: int = 1,
                 commit_timeout: float = 600.0, _comm: Comm | None = None, **deprecated: Any) -> None:
        self.optimizer_hparams = _hparams.check_choice(optimizer_hparams)
        old = _old_arguments(deprecated)
        flags = renamed({"dirpath": dirpath, "every_n_train_steps": every_n_train_steps,
                 "train_time_interval": train_time_interval, "overhead_budget": overhead_budget,
                 "max_interval": max_interval, "keep_last": keep_last, "levels": levels,
                 "storage_options": storage_options, "restore_route": restore_route,
                 "deterministic_reduction": deterministic_reduction, "save_on_train_end": save_on_train_end,
                 "save_on_sigterm": save_on_sigterm, **old.flags}, "HorovodCheckpointer")
        self.config = resolve_config(config, flags)
        self.policy = self.config.policy()
        self.tracked = Tracked(model, optimizer, scheduler, old.extra)
        self.sampler = make_resumable(sampler, batch_size) if sampler is not None else None
        self.on_figures = on_figures
        comm = _comm if _comm is not None else old.comm
        self.comm: Comm = comm if comm is not None else HorovodComm()
        self._fusion = reduction.settings(self.comm)  # every rank's, so that every rank decides alike
        refused = reduction.refusal(self.config.deterministic_reduction, self._fusion)
        if refused:
            raise ConfigError(refused)
        self.session = TrainingSession(self.config, self._capture, name="HorovodCheckpointer", policy=self.policy,
                                       max_inflight=max_inflight, commit_timeout=commit_timeout,
                                       on_figures=lambda row: self.on_figures(row) if self.on_figures else None)
        stop = _preempt.agreement(self.comm.world_size) if self.config.save_on_sigterm else None
        self.ck = self.session.start(self.comm, stop=stop)
        self.step = 0
        self.resumed_from: int | None = None
        self.restored: Restored | None = None
        """What the last :meth:`restore` restored (``None``: nothing)."""
        self._epochs = EpochLoop(self.sampler, self.comm.world_size)
        self._closed = False
        self.session.begin()  # SIGTERM handler (main thread)

    @property
    def epoch(self) -> int:
        """After :meth:`restore`: the epoch to run next (the interrupted one, or the next when
        the checkpoint ended an epoch), in the numbering of the script that wrote it when that
        script used :meth:`epochs`. Then the running epoch (the sampler's without :meth:`epochs`)."""
        return self._epochs.epoch

    @property
    def samples_in_epoch(self) -> int:
        """After :meth:`restore`: samples of that epoch all ranks together had already consumed."""
        return self._epochs.samples_in_epoch

    @property
    def batch_in_epoch(self) -> int:
        """After :meth:`restore`: batches of that epoch each rank had already consumed (exact on
        the same number of ranks; with another number, the completed batches of the new split)."""
        return self._epochs.batch_in_epoch

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def register(self, name: str, obj: Any, per_rank: bool = False) -> None:
        """Checkpoint ``obj`` too (``state_dict()``/``load_state_dict()``), replicated or per rank."""
        self.tracked.register(name, obj, per_rank)

    # ---- restore ------------------------------------------------------------------------------
    def restore(self, step: int | None = None) -> Restored | None:
        """Load the newest committed checkpoint (or ``step``) into the tracked objects, on every rank.

        Returns what was restored (:class:`ckpt_engine.Restored`: ``step``, ``level``, ``where``,
        ``sources``; also in :attr:`restored`, and the step in :attr:`step`), or ``None`` (changing
        nothing) when nothing is committed; a ``step`` that is not committed raises
        :class:`~ckpt_engine.NoCheckpointError`. Also puts back this rank's RNG states and the
        sampler's position; the optimizer's hyper-parameters follow ``optimizer_hparams``. Call it
        after the initial ``hvd.broadcast_parameters`` / ``broadcast_optimizer_state`` and before the
        loop. A failure on any rank (rank 0 listing the checkpoints, any rank reading or loading them)
        is raised on every rank. Resuming more than 2 ranks with Horovod's tensor fusion on, rank 0
        warns that the run will not end bit-identical, naming ``deterministic_reduction``.
        """
        self._check_open()
        resumed = self.session.restore(step)  # the newest that verifies on every rank, all parts this rank reads
        if resumed is None:
            return None
        warning = on_every_rank(self.comm, lambda: self._apply_restored(resumed))
        if warning:
            warnings.warn(warning, stacklevel=2)
        inexact = reduction.resume_warning(self._fusion) if self.rank == 0 else None
        if inexact:
            warnings.warn(inexact, stacklevel=2)
        self.restored = resumed.restored
        return self.restored

    def restore_dcp(self, src: str, *, trust: bool = False, storage_options: Mapping[str, Any] | None = None) -> int:
        """Start from the DCP checkpoint in directory ``src`` (``dcp.save``, torchtitan, Lightning's sharded
        ``save_checkpoint``; any number of ranks and any mesh wrote it) instead of one of ours, on every rank:
        the model's weights and the optimizer's state as ``horovod_ckpt._dcp`` maps its keys. Call it in place
        of :meth:`restore` (after the initial broadcasts), when this run's own root has no checkpoint yet.

        Returns the checkpoint's own step (``step``/``global_step``, else 0), from which this run's steps and
        checkpoints continue; the data position and RNG states are not in a DCP checkpoint, so the epochs
        start where the script says. Warns on rank 0 with what was restored from where. A failure on any rank
        (a key missing or of another shape, named) is raised on every rank. ``trust``: let the checkpoint's
        pickled values run code (off: ``weights_only``).
        """
        from ._dcp import load_dcp

        self._check_open()
        step, what = on_every_rank(self.comm, lambda: load_dcp(src, self.tracked.model, self.tracked.optimizer,
                                                                trust=trust, options=dict(storage_options or {})))
        self.step = self.resumed_from = step
        if self.rank == 0:
            warnings.warn(f"HorovodCheckpointer: started from the DCP checkpoint {src}: {what}", stacklevel=2)
        return step

    def _apply_restored(self, resumed: Resumed) -> str | None:
        """This rank's part of :meth:`restore`; returns rank 0's hyper-parameter warning, if any."""
        optimizer, scheduler = self.tracked.optimizer, self.tracked.scheduler
        script = Hparams.of(optimizer, scheduler) if optimizer is not None else None
        state, mine = resumed.replicated, resumed.per_rank  # writer 0's per-rank part on a rank that had none
        self.tracked.apply(state["objects"], mine["objects"])
        self.step = self.resumed_from = int(state["step"])
        if resumed.rng is not None:
            set_rng_state(resumed.rng)
        self._epochs.resume(mine.get("data"), resumed.rng, state.get("loop"))
        return _hparams.after_restore(self.optimizer_hparams, optimizer, scheduler, script,
                                      resumed.manifest.world_size, self.world_size, self.rank)


    # ---- the epoch loop -----------------------------------------------------------------------
    def epochs(self, start: int, stop: int) -> Iterator[int]:
        """The epochs still to run, in the script's numbering: ``range(start, stop)`` on a fresh
        start; after :meth:`restore`, from the interrupted epoch (or the next one when the
        checkpoint ended an epoch) to ``stop``.

        Replaces the script's ``range``: ``for epoch in ck.epochs(1, args.epochs + 1)`` where it had
        ``range(1, args.epochs + 1)`` (Horovod's examples count from 1), or ``ck.epochs(0, epochs)``.
        Any ``start`` works, provided the resumed script counts as the one that wrote the
        checkpoint did. Before each epoch the sampler's ``set_epoch(epoch)`` is called with that
        number (a script's own ``set_epoch(epoch)`` is then harmless). Checkpoints record the
        script's epoch and how it maps to the sampler's, so a sampler without ``set_epoch``
        (counting its iterations from 0) resumes in step too. Without a sampler no data position
        is known: the interrupted epoch runs again from its start. Every rank, after :meth:`restore`.
        """
        return self._epochs.epochs(start, stop)

    # ---- saving -------------------------------------------------------------------------------
    def after_step(self) -> bool:
        """Call after every optimizer step, on every rank. Returns whether a checkpoint was taken.

        The policy decides on rank 0 once per checkpoint; the step of the next one is broadcast,
        so all ranks save at the same steps. On an agreed SIGTERM: a final checkpoint, then exit.
        """
        self._check_open()
        self.step += 1
        self._epochs.after_step()
        due = self.session.due(self.step)
        if due:
            self.session.save(self.step)
        self.session.report()
        if self.session.preempted():
            self.session.stop(self.step)  # a final checkpoint here unless taken, committed
            _preempt.end_by_sigterm()
            return True
        return due

    def save(self) -> None:
        """Checkpoint the current step now (every rank, at the same step)."""
        self._check_open()
        if self.session.last_saved != self.step:
            self.session.take(self.step)

    def wait(self) -> None:
        """Block until every pending checkpoint is committed (re-raises a background failure)."""
        self._check_open()
        self.ck.wait()
        self.session.report()

    def _capture(self) -> Parts:
        replicated, per_rank = self.tracked.capture()
        return Parts({"objects": replicated, "step": self.step, "loop": self._epochs.loop},
                     {"objects": per_rank, "data": self._epochs.data_position()})

    @property
    def records(self) -> list[Any]:
        """This rank's figures of recent saves (``SaveRecord``: stall, snapshot, persist...)."""
        return list(self.ck.records)

    # ---- shutdown -----------------------------------------------------------------------------
    def close(self, final: bool | None = None) -> None:
        """Take the final checkpoint (``final``, default ``save_on_train_end``) when the last step
        is not saved yet, wait for every pending persist, and stop. Every rank; idempotent."""
        if self._closed:
            return
        try:
            self.session.finish(self.step, final=self.config.save_on_train_end if final is None else final)
        finally:
            self._closed = True
            self.session.close()

    def __enter__(self) -> "HorovodCheckpointer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, *tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:  # the ranks may not be at the same step: no final checkpoint
            self._closed = True
            self.session.abort(self.step, exc, final=False)  # warns: the exception stays the one raised

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this HorovodCheckpointer is closed")


@dataclass(frozen=True)
class _Old:
    """The first release's arguments a caller still gave (:func:`_old_arguments`)."""

    flags: dict[str, Any]
    extra: dict[str, Any]
    comm: Comm | None


def _old_arguments(given: Mapping[str, Any]) -> _Old:
    """The deprecated keyword arguments of ``HorovodCheckpointer``: the old flag names
    (:data:`~ckpt_engine.config.RENAMED`, for :func:`~ckpt_engine.config.renamed`), ``extra`` and
    ``comm`` (each warning); any other name is a ``TypeError``, as Python's own would be."""
    unknown = sorted(set(given) - set(RENAMED) - {"extra", "comm"})
    if unknown:
        raise TypeError(f"HorovodCheckpointer() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    flags = {k: v for k, v in given.items() if k in RENAMED}
    for name, instead in (("extra", "register(name, obj) for each object"), ("comm", "_comm (tests only)")):
        if name in given:
            warnings.warn(f"HorovodCheckpointer: {name!r} is deprecated and will be removed in the next release; "
                          f"use {instead}", DeprecationWarning, stacklevel=3)
    return _Old(flags, dict(given.get("extra") or {}), given.get("comm"))
