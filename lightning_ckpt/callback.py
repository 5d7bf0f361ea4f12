"""``AsyncShardedCheckpoint``: two-phase, rank-sliced checkpoints for a Lightning ``Trainer``.

Every rank takes part (Lightning's ``CheckpointIO`` only runs on rank 0, so the writer lives in
this callback): after each real optimizer step the shared :class:`~ckpt_engine.training.schedule.Schedule`
decides, identically on every rank, whether to checkpoint; each rank then snapshots its slice of
the replicated state and persists it in the background.

What a checkpoint holds, split the way data parallelism splits it:

* replicated (sliced across ranks): model parameters and optimizer states;
* per rank (whole): model buffers (BatchNorm statistics differ across DDP ranks after a step),
  the RNG states of Python, NumPy, torch and CUDA, the data position (epoch, batches consumed,
  the epoch-start RNG of the sampler), and the rest of Lightning's checkpoint (loops, schedulers,
  callbacks, precision, datamodule, plain hyper-parameters); on restore that rest comes from
  writer rank 0, as in Lightning's own checkpoints.

Resume: exactly one checkpoint is restored (ours with ``resume="auto"`` or ``fit(ckpt_path=<ours>)``,
Lightning's with another ``ckpt_path``; ``"last"`` takes the newer: see :meth:`_resume_start`).
From ours Lightning restores the dictionary this callback assembles; the train sampler is wrapped
so that the interrupted epoch continues at the next unseen sample, and the RNG streams are restored
at the step (see ``ckpt_engine.training.resumable``). Not bitwise: random augmentation inside DataLoader
workers (their seeds derive from a draw at ``iter()`` time) and a restore on a different world size
(the data split changes).
"""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

import torch

from ckpt_engine import Checkpointer, CheckpointError, LocalComm, TorchDistComm
from ckpt_engine.agree import on_rank0
from ckpt_engine.training.figures import FigureReporter
from ckpt_engine.training.preempt import SignalAgreement
from ckpt_engine.training.resumable import rng_state, set_rng_state
from ckpt_engine.training.schedule import Schedule

from . import _flags, _lightning, _trainer_api
from ._preempt import stop_agreement
from . import _resume
from ._resume import CheckpointIOWrapper, assemble, is_our_checkpoint, plain_misc
from ._stateful import LoaderSampler, is_stateful_loader

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

_REPLICATED = ("state_dict", "optimizer_states")


class AsyncShardedCheckpoint(*_lightning.bases("callbacks.Callback")):  # type: ignore[misc]
    """Asynchronous, rank-sliced checkpoints to any fsspec path, with exact resume.

    Args:
        path / dirpath: checkpoint root (local path or fsspec URL); ``dirpath`` is Lightning's name.
        every_n_steps / every_n_train_steps: checkpoint every N optimizer steps.
        every_seconds / train_time_interval: about every T seconds (a number or a ``timedelta``).
        overhead_budget: adaptive frequency under this fraction of training time (e.g. ``0.035``).
        max_interval: at least every this many seconds, composed with any trigger.
        keep_last: committed checkpoints to keep. levels: one level, or use ``path``.
        storage_options: fsspec options (leave credentials to fsspec's own configuration).
        resume: ``"auto"`` continues from the newest committed checkpoint under ``path``;
            ``"never"`` starts fresh (``trainer.fit(ckpt_path=...)`` still works).
        save_on_train_end / save_on_exception / save_on_sigterm: final checkpoints. On SIGTERM
            under several ranks all ranks agree on the step within two steps of the signal, commit
            there and end with Lightning's ``SIGTERMException`` (see ``lightning_ckpt._preempt``).
        pipeline: deferred snapshot (copy during the next forward/backward, waited for just before
            the next optimizer step). Off by default: measured in ``benchmarks/bench_lightning.py``.
        max_inflight, commit_timeout: passed to :class:`~ckpt_engine.Checkpointer`.
    """

    def __init__(self, path: Optional[str] = None, *, dirpath: Optional[str] = None,
                 every_n_steps: Optional[int] = None, every_n_train_steps: Optional[int] = None,
                 every_seconds: Optional[float] = None, train_time_interval: Optional[timedelta] = None,
                 overhead_budget: Optional[float] = None, max_interval: Optional[float] = None,
                 keep_last: Optional[int] = 3, levels: Optional[list[str]] = None,
                 storage_options: Optional[dict[str, Any]] = None, resume: Literal["auto", "never"] = "auto",
                 save_on_train_end: bool = True, save_on_exception: bool = True, save_on_sigterm: bool = True,
                 pipeline: bool = False, max_inflight: int = 1, commit_timeout: float = 600.0) -> None:
        super().__init__()
        self.config = _flags.build_config(path=path, dirpath=dirpath, every_n_steps=every_n_steps,
                                          every_n_train_steps=every_n_train_steps, every_seconds=every_seconds,
                                          train_time_interval=train_time_interval, overhead_budget=overhead_budget,
                                          max_interval=max_interval, keep_last=keep_last, levels=levels,
                                          storage_options=storage_options)
        if resume not in ("auto", "never"):
            raise ValueError(f"resume must be 'auto' or 'never', got {resume!r}")
        if type(max_inflight) is not int or max_inflight < 1:
            raise ValueError(f"max_inflight must be a positive integer, got {max_inflight!r}")
        self.resume, self.pipeline, self.max_inflight = resume, pipeline, max_inflight
        self.save_on_train_end, self.save_on_exception = save_on_train_end, save_on_exception
        self.save_on_sigterm, self.commit_timeout = save_on_sigterm, commit_timeout
        self.policy = self.config.policy()
        self.ck: Checkpointer | None = None
        self.schedule: Schedule | None = None
        self.resumed_from: int | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._pending_data: dict[str, Any] | None = None
        self._samplers: list[LoaderSampler] = []
        self._trainer: Any = None
        self._epoch_end_draws = 0
        self._handle: Any = None
        self._last_global_step = -1
        self._last_saved_step: int | None = None
        self._figures: FigureReporter | None = None  # rank 0's unreported saves and flushes
        self._stop: SignalAgreement | None = None  # SIGTERM under several ranks (see _preempt)
        self._comm: Any = None
        self._quiet: Any = None  # the filter silencing Lightning's "not resumable" warning while resuming
        self._due: tuple[int, int] | None = None  # (epoch, batches): a checkpoint decided at an epoch's last batch
        self._restarted_epoch = False  # resumed mid-epoch from ours, that epoch's end not reached yet

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}[{self.config.location}]"

    # ---- set-up and resume ------------------------------------------------------------------
    def setup(self, trainer: "Trainer", pl_module: "LightningModule", stage: str) -> None:
        if stage != "fit" or self.ck is not None:
            return
        unsupported = _trainer_api.unsupported_strategy(trainer)
        if unsupported:
            raise CheckpointError(f"AsyncShardedCheckpoint does not support {unsupported} yet: it slices "
                                  "replicated (data-parallel) state; use DDP, ddp_spawn or a single device")
        dist_ready = torch.distributed.is_available() and torch.distributed.is_initialized()
        comm = TorchDistComm() if dist_ready and trainer.world_size > 1 else LocalComm()
        self.ck = Checkpointer.from_config(self.config, comm=comm, max_inflight=self.max_inflight,
                                           commit_timeout=self.commit_timeout)
        self.schedule = Schedule(self.policy, self.ck)
        self._figures = FigureReporter(self.ck, self.policy)
        if self.save_on_sigterm and comm.world_size > 1:
            self._stop = stop_agreement()
        trainer.strategy.checkpoint_io = CheckpointIOWrapper(trainer.strategy.checkpoint_io, self)
        _trainer_api.wrap_process_dataloader(trainer, self._make_resumable)
        _trainer_api.wrap_resume_start(trainer, self._resume_start)
        _trainer_api.guard_fit_loop(trainer, lambda exception: self._after_failure(trainer, exception))
        self._trainer, self._comm = trainer, comm

    def _resume_start(self, path: Any, lightning: Callable[[Any], None]) -> None:
        """Restore exactly one checkpoint (README, "Which checkpoint a resume restores"):

        * ``ckpt_path`` is one of ours: that one (read once, through :class:`CheckpointIOWrapper`);
        * ``ckpt_path`` is Lightning's ``last`` checkpoint (``"last"``): the newer of it and our
          newest, ours on a tie (it also restores the data position and RNG exactly);
        * any other ``ckpt_path``: that one (an explicit choice wins);
        * none: our newest with ``resume="auto"``, else nothing.

        The candidate not used is named in a log line (a warning when it is the newer one).
        """
        assert self.ck is not None and self._trainer is not None
        trainer, root = self._trainer, self.config.location
        ours = on_rank0(self._comm, self.ck.latest_step)  # a failure listing is raised on every rank
        lightning(path)
        if path is not None:
            if is_our_checkpoint(path, root) is not None or ours is None:
                return
            theirs = int(_trainer_api.loaded_checkpoint(trainer).get("global_step", -1))
            last = os.path.abspath(str(path)) in _trainer_api.last_checkpoint_files(trainer)
            if not (last and self.resume == "auto" and ours >= theirs):
                _lightning.notice(trainer, f"AsyncShardedCheckpoint: restoring ckpt_path={str(path)!r} (step {theirs}); "
                                  f"not restoring this callback's newest checkpoint (step {ours} under {root}). To "
                                  f"resume from it, call fit() without ckpt_path or with ckpt_path={root!r}.",
                                  warn=ours > theirs)
                return
            _lightning.notice(trainer, f"AsyncShardedCheckpoint: ckpt_path={str(path)!r} is Lightning's last checkpoint "
                              f"(step {theirs}); this callback's checkpoint at step {ours} is as new or newer and "
                              f"is restored instead (it also restores the data position and RNG); {path} is not used.")
        elif self.resume != "auto" or ours is None:
            return
        checkpoint = self.restore(None)  # the newest that verifies everywhere (a damaged one is skipped)
        _trainer_api.inject_loaded_checkpoint(trainer, checkpoint, root)

    def restore(self, step: int | None) -> dict[str, Any]:
        """Load checkpoint ``step`` (the newest that verifies on every rank if ``None``) as the
        dictionary Lightning restores from; remember this rank's data position and RNG for the
        moments they must be applied. Every rank calls it (a collective)."""
        assert self.ck is not None
        restored = self.ck.restore(step)  # a collective: verified on every rank, damaged ones skipped
        own, first = restored.local, restored.first
        mine = own if own is not None else first
        checkpoint = assemble(restored.state, first["misc"], mine["buffers"])
        self._pending_data = mine["data"]
        self._pending_rng = own["rng"] if own is not None else None
        manifest = restored.manifest
        self.resumed_from = restored.step
        self._restarted_epoch = True
        for sampler in self._samplers:
            self._apply_data_position(sampler)
        if self._trainer is not None:
            self._quiet = _lightning.silence_not_resumable()  # this callback resumes the data position
            taken = mine["data"].get("taken_at", manifest.created_at)  # wall time of the snapshot, not of the commit
            newer = _resume.newer_files(_trainer_api.lightning_checkpoint_dirs(self._trainer), taken)
            if newer:
                _lightning.notice(self._trainer, f"AsyncShardedCheckpoint: resumed from step {self.resumed_from}; "
                                  f"Lightning checkpoints written after it by the interrupted run stay in place: "
                                  f"{', '.join(newer)}")
        return checkpoint

    def _make_resumable(self, dataloader: Any) -> Any:
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        if batch_sampler is None or not hasattr(batch_sampler, "sampler"):
            warnings.warn("AsyncShardedCheckpoint: the train DataLoader has no batch sampler; a mid-epoch "
                          "resume restarts that epoch's data", stacklevel=2)
            return dataloader
        if not isinstance(batch_sampler.sampler, LoaderSampler):
            batch_sampler.sampler = LoaderSampler(batch_sampler.sampler)
        sampler = batch_sampler.sampler
        self._samplers = [sampler]
        self._batch_size = int(getattr(batch_sampler, "batch_size", 1) or 1)
        self._loader = dataloader
        self._apply_data_position(sampler)
        return dataloader

    def _apply_data_position(self, sampler: LoaderSampler) -> None:
        data = self._pending_data
        if data is None:
            return
        self._pending_data = None
        loader = getattr(self, "_loader", None)
        if loader is not None and data["consumed_batches"] >= len(loader):
            # Saved at the last batch of an epoch: Lightning resumes with the next epoch, whose
            # iterator it creates (one draw from the global RNG when the loader has no generator)
            # before training starts; in the uninterrupted run that draw came after the saved RNG
            # state, so it is repeated right after restoring it (see on_train_start).
            sampler.resume(data["epoch"] + 1, 0, None)
            self._epoch_end_draws = 1 if getattr(loader, "generator", None) is None else 0
            return
        if self._trainer is not None and is_stateful_loader(loader) and _trainer_api.restores_loader_states(self._trainer):
            return  # Lightning restores the loader's own state next, which resumes the sampler (see _stateful)
        sampler.resume(data["epoch"], data["consumed_batches"] * data["batch_size"], data["epoch_rng"],
                       data.get("epoch_generators"))

    def on_train_start(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        if self._pending_rng is not None:  # after the loader's set-up draws, as they were at save time
            set_rng_state(self._pending_rng)
            self._pending_rng = None
            for _ in range(self._epoch_end_draws):
                torch.empty((), dtype=torch.int64).random_()  # the new epoch's DataLoader seed draw
        self._epoch_end_draws = 0
        self._last_global_step = trainer.global_step
        if self.schedule is not None:
            self.schedule.restart_clock()
        if self._stop is not None:
            self._stop.install()  # after Lightning registered its own handlers for the run

    # ---- saving -----------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer: "Trainer", pl_module: "LightningModule",
                                 optimizer: Any) -> None:
        if self._handle is not None:  # a deferred snapshot must finish before weights change
            self._handle.wait_snapshot()
            self._handle = None

    def on_train_batch_end(self, trainer: "Trainer", pl_module: "LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_global_step:
            return  # gradient accumulation: no optimizer step yet, the state is not consistent
        self._last_global_step = trainer.global_step
        assert self.schedule is not None
        if self.schedule.should_save(trainer.global_step):
            if batch_idx + 1 >= trainer.num_training_batches:
                # The epoch's end (validation, epoch schedulers, epoch-end hooks) still has to run and a
                # restart from here would skip it: take this checkpoint once it has run.
                self._due = (trainer.current_epoch, batch_idx + 1)
            else:
                self._save(trainer, pl_module, batch_idx + 1, defer=self.pipeline)
                self.schedule.saved(trainer.global_step)
        self._report(trainer)
        if self._stop is not None and self._stop.poll():  # a rank got SIGTERM: all agree here
            self._stop.uninstall()
            if self._last_saved_step != trainer.global_step:
                self._save(trainer, pl_module, batch_idx + 1, defer=False)
            self.ck.wait()
            self._report(trainer)
            raise _lightning.sigterm_exception(trainer)()  # end the way Lightning ends a run on SIGTERM

    def on_train_epoch_start(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        self._save_due(trainer, pl_module)

    def on_train_epoch_end(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        if self._restarted_epoch:  # resumed mid-epoch from ours: end this epoch as the uninterrupted run did
            _trainer_api.end_restarted_epoch_normally(trainer)
            self._restarted_epoch = False

    def _save_due(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        """Take the checkpoint decided at the last batch of the previous epoch, now that its end has run."""
        if self._due is None:
            return
        epoch, consumed = self._due
        self._due = None
        self._save(trainer, pl_module, consumed, defer=self.pipeline, epoch=epoch, between_epochs=True)
        assert self.schedule is not None
        self.schedule.saved(trainer.global_step)

    def on_train_end(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        if self.ck is None:
            return
        self._save_due(trainer, pl_module)
        if self._stop is not None:
            self._stop.finish()
            self._stop.uninstall()
        if self.save_on_train_end and self._last_saved_step != trainer.global_step:
            consumed = self._consumed(trainer)
            self._save(trainer, pl_module, consumed, defer=False,
                       between_epochs=consumed >= trainer.num_training_batches)
        self.ck.wait(flush=True)  # multi-level: the flushes too (teardown's close() would wait anyway)
        self._report(trainer)

    def on_train_batch_start(self, trainer: "Trainer", *args: Any, **kwargs: Any) -> None:
        self._quiet = _lightning.unsilence(self._quiet)

    def on_exception(self, trainer: "Trainer", pl_module: "LightningModule", exception: BaseException) -> None:
        self._after_failure(trainer, exception)

    def _after_failure(self, trainer: "Trainer", exception: BaseException) -> None:
        """Every way out of ``fit()`` by an exception (``KeyboardInterrupt`` and ``SIGTERMException``
        included) waits, bounded by ``commit_timeout``, for the checkpoints already taken to commit,
        then closes. One rank also takes a final checkpoint first (``save_on_exception`` /
        ``save_on_sigterm``); under several ranks the others may never reach it, so it could not commit.

        Called from ``on_exception`` and, in ``ddp_spawn`` ranks (where Lightning calls no
        ``on_exception``), from around the fit loop; the second call finds nothing left to do.
        """
        self._quiet = _lightning.unsilence(self._quiet)
        if self._stop is not None:
            self._stop.uninstall()
        if self.ck is None:
            return
        try:
            sigterm = isinstance(exception, _lightning.sigterm_exceptions())
            final = self.save_on_sigterm if sigterm else self.save_on_exception
            if final and self._last_saved_step != trainer.global_step:
                if self.ck.world_size == 1:
                    self._save(trainer, trainer.lightning_module, self._consumed(trainer), defer=False)
                elif not sigterm:
                    warnings.warn("AsyncShardedCheckpoint: no final checkpoint on an exception under several ranks "
                                  "(the other ranks may not reach it, so it could never commit); waiting for the "
                                  "checkpoints already taken", stacklevel=2)
            self.ck.wait()
            self._report(trainer)
        except Exception as error:  # never hide the exception that ended training
            warnings.warn(f"AsyncShardedCheckpoint: after {type(exception).__name__}, the checkpoints in flight "
                          f"could not be committed: {error}", stacklevel=2)
        finally:
            try:
                self._close()
            except Exception as error:
                warnings.warn(f"AsyncShardedCheckpoint: closing after {type(exception).__name__}: {error}", stacklevel=2)

    def teardown(self, trainer: "Trainer", pl_module: "LightningModule", stage: str) -> None:
        self._quiet = _lightning.unsilence(self._quiet)
        if stage == "fit":
            self._close()

    def _close(self) -> None:
        if self._stop is not None:
            self._stop.uninstall()
            self._stop = None
        if self.ck is not None:
            try:
                self.ck.close()
            finally:
                self.ck = None

    def _consumed(self, trainer: "Trainer") -> int:
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.completed)

    def _save(self, trainer: "Trainer", pl_module: "LightningModule", consumed: int, defer: bool,
              epoch: int | None = None, between_epochs: bool = False) -> None:
        assert self.ck is not None
        checkpoint = _trainer_api.dump_checkpoint(trainer)
        if between_epochs:
            _trainer_api.as_between_epochs(checkpoint)
        buffers = {name for name, _ in pl_module.named_buffers()}
        weights = checkpoint.pop("state_dict")
        state = {"state_dict": {k: v for k, v in weights.items() if k not in buffers},
                 "optimizer_states": checkpoint.pop("optimizer_states", [])}
        sampler = self._samplers[0] if self._samplers else None
        local = {"misc": plain_misc(checkpoint),
                 "buffers": {k: v.detach().clone() for k, v in weights.items() if k in buffers},
                 "rng": rng_state(),
                 "data": {"epoch": trainer.current_epoch if epoch is None else epoch, "consumed_batches": consumed,
                          "taken_at": time.time(),
                          "batch_size": getattr(self, "_batch_size", 1),
                          "epoch_rng": sampler.epoch_rng if sampler is not None else None,
                          "epoch_generators": sampler.epoch_generators if sampler is not None else []}}
        self._handle = self.ck.save(state, trainer.global_step, local, defer=defer)
        self._last_saved_step = trainer.global_step
        if self.ck.rank == 0 and self.ck.records and self._figures is not None:
            self._figures.track(self.ck.records[-1])

    # ---- figures -------------------------------------------------------------------------------
    def _report(self, trainer: "Trainer") -> None:
        """Log the figures of every save and flush that finished since the last report (rank 0)."""
        if self.ck is None or self.ck.rank != 0 or self._figures is None:
            return
        for row in self._figures.collect():
            if trainer.logger is not None:
                prefix = "ckpt/" if row["kind"] == "save" else f"ckpt/level{row['level']}_"
                trainer.logger.log_metrics({f"{prefix}{k}": float(v) for k, v in row.items()
                                            if isinstance(v, (int, float)) and k not in ("step", "time", "level")},
                                           step=row["step"])

    # ---- the callback's own state (rides in Lightning's checkpoint) -----------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.load_state_dict(state_dict.get("policy", {}))
