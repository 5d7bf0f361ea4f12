"""``AsyncShardedCheckpoint``: two-phase, rank-sliced checkpoints for a Lightning ``Trainer``.

Every rank takes part (Lightning's ``CheckpointIO`` only runs on rank 0, so the writer lives in
this callback): it finds the state and the step boundaries in the ``Trainer`` and drives the core's
:class:`~ckpt_engine.training.session.TrainingSession`, which decides, identically on every rank,
whether to checkpoint after each real optimizer step; each rank then snapshots its slice of the
replicated state and persists it in the background.

What a checkpoint holds, split the way data parallelism splits it:

* replicated (sliced across ranks): model parameters and optimizer states; under FSDP2, tensor
  parallel or FSDP1, each rank's own chunks of them instead (see ``lightning_ckpt._sharded``);
* per rank (whole): model buffers (BatchNorm statistics differ across DDP ranks after a step),
  the RNG states of Python, NumPy, torch and CUDA, the data position
  (:mod:`ckpt_engine.training.position`), and the rest of Lightning's checkpoint (loops, schedulers,
  callbacks, precision, datamodule, plain hyper-parameters); on restore that rest comes from
  writer rank 0, as in Lightning's own checkpoints.

Resume: exactly one checkpoint is restored (ours with ``resume="auto"`` or ``fit(ckpt_path=<ours>)``,
Lightning's with another ``ckpt_path``; ``"last"`` takes the newer, or ours when Lightning's newer one
cannot resume exactly and ours is at most one interval older: see ``_resume.resume_start``).
From ours Lightning restores the dictionary this callback assembles; the train sampler is wrapped
so that the interrupted epoch continues at the next unseen sample, and the RNG streams are restored
at the step (see ``ckpt_engine.training.resumable``); on another number of devices the rest of the
epoch is re-split among them (see ``lightning_ckpt._data``). Not bitwise: random augmentation inside
DataLoader workers (their seeds derive from a draw at ``iter()`` time) and a restore on a different
world size (the data split changes).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch

from ckpt_engine import CheckpointConfig, CheckpointError, LocalComm, Restored, TorchDistComm
from ckpt_engine.config import DEFAULT_KEEP_LAST
from ckpt_engine.host.collector import pause_collector, resume_collector
from ckpt_engine.interop.lightning import assemble
from ckpt_engine.training.ddp_buckets import DDPBucketOrder
from ckpt_engine.training.parts import Parts
from ckpt_engine.training.resumable import ResumableSampler, set_rng_state
from ckpt_engine.training.session import TrainingSession

from . import _data, _flags, _lightning, _resume, _sharded, _trainer_api
from ._preempt import stop_agreement
from ._resume import CheckpointIOWrapper

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer


class AsyncShardedCheckpoint(*_lightning.bases("callbacks.Callback")):  # type: ignore[misc]
    """Asynchronous, rank-sliced checkpoints to any fsspec path, with exact resume.

    Args:
        dirpath: checkpoint root (local path or fsspec URL; in code also a ``ckpt_engine.storage.Storage``,
            e.g. a ``ckpt_engine.testing`` double).
        every_n_train_steps: checkpoint every N optimizer steps.
        train_time_interval: about every T seconds (a number or a ``timedelta``).
        overhead_budget: adaptive frequency under this fraction of training time (e.g. ``0.035``).
        max_interval: at least every this many seconds, composed with any trigger.
        keep_last: committed checkpoints to keep.
        levels: instead of ``dirpath``, the levels fastest first,
            each a path or a mapping (``{path, storage_options, keep_last}``; the first may be node
            memory, ``{kind: memory, ...}``: ``ckpt_engine.levels.memory``).
        storage_options: fsspec options (leave credentials to fsspec's own configuration).
        resume: ``"auto"`` continues from the newest committed checkpoint under ``dirpath``;
            ``"never"`` starts fresh (``trainer.fit(ckpt_path=...)`` still works).
        save_on_train_end / save_on_exception / save_on_sigterm: final checkpoints (``None``: the
            config's, else on). On SIGTERM under several ranks all ranks agree on the step within two
            steps of the signal, commit there and end with Lightning's ``SIGTERMException`` (see
            ``lightning_ckpt._preempt``).
        pipeline: deferred snapshot (copy during the next forward/backward, waited for just before
            the next optimizer step). Off by default: on CPU the copy competes with training for the
            cores (``benchmarks/bench_lightning.py``). On a GPU turn it on: the device-to-host copy
            then runs beside the forward/backward instead of before it (``benchmarks/bench_gpu.py``).
        restore_route: how a resume on several ranks gets the model's state: ``"auto"`` (measured
            at the resume), ``"read"`` (every rank reads all of it), ``"exchange"`` (each rank
            reads 1/N, the rest comes over the process group); see ``ckpt_engine.load.exchange``.
        max_inflight, commit_timeout: passed to :class:`~ckpt_engine.Checkpointer`.
        config: the same flags as one options object, the one the Horovod hook and
            ``Checkpointer.from_config`` take: a ``ckpt_engine.CheckpointConfig``, a mapping or a YAML
            file; the arguments given here win over it.
        path, every_n_steps, every_seconds: the first release's names of ``dirpath``,
            ``every_n_train_steps`` and ``train_time_interval``; deprecated (a ``DeprecationWarning``).
    """

    def __init__(self, dirpath: Optional[str] = None, *, every_n_train_steps: Optional[int] = None,
                 train_time_interval: Optional[Union[timedelta, float]] = None,
                 overhead_budget: Optional[float] = None, max_interval: Optional[float] = None,
                 keep_last: Optional[int] = DEFAULT_KEEP_LAST,
                 levels: Optional[list[Union[str, dict[str, Any]]]] = None,
                 storage_options: Optional[dict[str, Any]] = None, resume: Literal["auto", "never"] = "auto",
                 save_on_train_end: Optional[bool] = None, save_on_exception: bool = True,
                 save_on_sigterm: Optional[bool] = None, pipeline: bool = False, max_inflight: int = 1,
                 commit_timeout: float = 600.0, restore_route: Optional[Literal["auto", "read", "exchange"]] = None,
                 config: Optional[Union[str, dict[str, Any], CheckpointConfig]] = None,
                 path: Optional[str] = None, every_n_steps: Optional[int] = None,
                 every_seconds: Optional[float] = None) -> None:
        super().__init__()
        self.config = _flags.build_config(
            {"dirpath": dirpath, "every_n_train_steps": every_n_train_steps,
             "train_time_interval": train_time_interval, "overhead_budget": overhead_budget,
             "max_interval": max_interval, "keep_last": keep_last, "levels": levels,
             "storage_options": storage_options, "restore_route": restore_route,
             "save_on_train_end": save_on_train_end, "save_on_sigterm": save_on_sigterm},
            {"path": path, "every_n_steps": every_n_steps, "every_seconds": every_seconds}, config)
        if resume not in ("auto", "never"):
            raise ValueError(f"resume must be 'auto' or 'never', got {resume!r}")
        self.resume, self.pipeline = resume, pipeline
        self.save_on_train_end, self.save_on_exception = self.config.save_on_train_end, save_on_exception
        self.save_on_sigterm = self.config.save_on_sigterm
        self.policy = self.config.policy()  # also rides in Lightning's own checkpoints (state_dict)
        self.session = TrainingSession(self.config, name="AsyncShardedCheckpoint", policy=self.policy,
                                       pipeline=pipeline, max_inflight=max_inflight, commit_timeout=commit_timeout,
                                       on_figures=self._log_figures)
        self.resumed_from: int | None = None
        self.restored: Restored | None = None
        """What the last resume from one of our checkpoints restored (step, level, where each part
        came from: :class:`ckpt_engine.Restored`), on every rank; ``None`` when it restored nothing."""
        self._pending_rng: dict[str, Any] | None = None
        self._pending_data: dict[str, Any] | None = None
        self._samplers: list[ResumableSampler] = []
        self._trainer: Any = None
        self._epoch_end_draws = 0
        self._last_global_step = -1
        self._comm: Any = None
        self._quiet: Any = None  # the filter silencing Lightning's "not resumable" warning while resuming
        self._due = False  # a checkpoint decided at an epoch's last batch, taken after that epoch's end
        self._restarted_epoch = False  # restored from ours; the first epoch's end not reached yet
        self._sharded = False  # the strategy shards the state (see lightning_ckpt._sharded)
        self._buckets: DDPBucketOrder | None = None  # under DDP: its gradient order, replayed after a restore
        self._restored_buckets: dict[str, Any] | None = None  # the order a restored checkpoint recorded

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}[{self.config.location}]"

    @property
    def ck(self) -> Any:
        """The engine's :class:`~ckpt_engine.Checkpointer` during ``fit()`` (records, counters), else ``None``."""
        return self.session.ck

    # ---- set-up and resume ------------------------------------------------------------------
    def setup(self, trainer: "Trainer", pl_module: "LightningModule", stage: str) -> None:
        if stage != "fit" or self.session.active:
            return
        unsupported = _trainer_api.unsupported_strategy(trainer)
        if unsupported:
            raise CheckpointError(f"AsyncShardedCheckpoint does not support {unsupported}")
        self._sharded = _sharded.applies(trainer)
        dist_ready = torch.distributed.is_available() and torch.distributed.is_initialized()
        comm = TorchDistComm() if dist_ready and trainer.world_size > 1 else LocalComm()
        self.session.start(comm, stop=stop_agreement() if self.save_on_sigterm and comm.world_size > 1 else None)
        trainer.strategy.checkpoint_io = CheckpointIOWrapper(trainer.strategy.checkpoint_io, self)
        _trainer_api.wrap_process_dataloader(trainer, self._make_resumable)
        _trainer_api.wrap_resume_start(trainer, lambda path, lightning: _resume.resume_start(self, trainer, path, lightning))
        _trainer_api.guard_fit_loop(trainer, lambda exception: self._after_failure(trainer, exception))
        self._trainer, self._comm = trainer, comm

    def lightning_checkpoint(self, step: int | None) -> dict[str, Any] | None:
        """Load checkpoint ``step`` (the newest that verifies on every rank if ``None``) as the
        dictionary Lightning restores from; remember this rank's data position and RNG for the
        moments they must be applied, and the result in :attr:`restored`. Every rank calls it (a
        collective); ``None`` when nothing is committed. Called by the resume (``_resume.py``)."""
        # per-rank parts: writer 0's for a rank that had no writer; a sharded strategy's weights are loaded here
        resumed = _sharded.restore(self.session, self._trainer, step) if self._sharded else self.session.restore(step)
        if resumed is None:
            return None
        mine = resumed.per_rank
        checkpoint = assemble(resumed.replicated, resumed.first["misc"], None if self._sharded else mine["buffers"])
        self._pending_data = mine["data"]
        self._pending_rng = resumed.rng
        self.resumed_from, self.restored = resumed.step, resumed.restored
        self._restarted_epoch = True
        for sampler in self._samplers:
            self._apply_data_position(sampler)
        if self._trainer is not None:
            if mine["data"].get("epoch") is not None:  # none in a checkpoint imported from a .ckpt
                self._quiet = _lightning.silence_not_resumable()  # this callback resumes the data position
            taken = mine["data"].get("taken_at", resumed.manifest.created_at)  # the snapshot's wall time, not the commit's
            _resume.name_newer_files(self._trainer, resumed.step, taken)
        return checkpoint

    def _make_resumable(self, dataloader: Any) -> Any:
        sampler = _data.make_resumable(dataloader)  # the train loader's (see lightning_ckpt._data)
        if sampler is not None:
            self._samplers, self._loader = [sampler], dataloader
            self._apply_data_position(sampler)
        return dataloader

    def _apply_data_position(self, sampler: ResumableSampler) -> None:
        data, self._pending_data = self._pending_data, None
        if data is not None:  # on_train_start repeats the draws once the RNG is restored
            self._epoch_end_draws = _data.resume(self._trainer, getattr(self, "_loader", None), sampler, data)

    def on_train_start(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        if self._pending_rng is not None:  # after the loader's set-up draws, as they were at save time
            set_rng_state(self._pending_rng)
            self._pending_rng = None
            for _ in range(self._epoch_end_draws):
                torch.empty((), dtype=torch.int64).random_()  # the new epoch's DataLoader seed draw
        self._epoch_end_draws = 0
        self._last_global_step = trainer.global_step
        self._replay_ddp_buckets(trainer)
        if self.session.active:
            self.session.begin()  # after Lightning registered its own signal handlers for the run

    def _replay_ddp_buckets(self, trainer: "Trainer") -> None:
        """Under DDP: record the order its gradients become ready and, after a restore (ours or
        Lightning's checkpoint, which carries this callback's state), replay the recorded one, so the
        resumed run reduces as the uninterrupted one (``ckpt_engine.training.ddp_buckets``)."""
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        self._buckets = DDPBucketOrder(model)
        restored, self._restored_buckets = self._restored_buckets, None
        if trainer.global_step > 0:  # resumed from a checkpoint: every rank, the same step
            self._buckets.load_state_dict(restored)

    # ---- saving -----------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer: "Trainer", pl_module: "LightningModule",
                                 optimizer: Any) -> None:
        self.session.before_update()  # a deferred snapshot must finish before weights change

    def on_train_batch_end(self, trainer: "Trainer", pl_module: "LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        pause_collector()  # a garbage collection that comes due here runs in the loop after it (collector.py)
        try:
            self._after_step(trainer, batch_idx)
        finally:
            resume_collector()

    def _after_step(self, trainer: "Trainer", batch_idx: int) -> None:
        if self._samplers:
            self._samplers[0].note_step()  # one more batch of the epoch consumed
        if trainer.global_step == self._last_global_step:
            return  # gradient accumulation: no optimizer step yet, the state is not consistent
        self._last_global_step = step = trainer.global_step
        now = lambda: self._capture(trainer)  # noqa: E731
        if self.session.due(step, now):
            if batch_idx + 1 >= trainer.num_training_batches:
                # The epoch's end (validation, epoch schedulers, epoch-end hooks) still has to run and a
                # restart from here would skip it: take this checkpoint once it has run.
                self._due = True
            else:
                self._save(trainer)
        self.session.report()
        if self.session.preempted():  # a rank got SIGTERM: all agree here
            self.session.stop(step, now)
            raise _lightning.sigterm_exception(trainer)()  # end the way Lightning ends a run on SIGTERM

    def on_train_epoch_start(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        pause_collector()  # as in on_train_batch_end
        try:
            self._save_due(trainer, pl_module)
        finally:
            resume_collector()

    def on_train_epoch_end(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        if self._restarted_epoch:  # the first epoch after a restore from ours: end it as the uninterrupted run did
            _trainer_api.end_restarted_epoch_normally(trainer)
            self._restarted_epoch = False

    def _save_due(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        """Take the checkpoint decided at the last batch of the previous epoch, now that its end has run."""
        if self._due:
            self._due = False
            self._save(trainer, between_epochs=True)

    def on_train_end(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        if not self.session.active:
            return
        self._save_due(trainer, pl_module)
        between_epochs = self._consumed(trainer) >= trainer.num_training_batches
        self.session.finish(trainer.global_step, final=self.save_on_train_end,  # and waits for the flushes
                            capture=lambda: self._capture(trainer, between_epochs))

    def on_train_batch_start(self, trainer: "Trainer", *args: Any, **kwargs: Any) -> None:
        self._quiet = _lightning.unsilence(self._quiet)

    def on_exception(self, trainer: "Trainer", pl_module: "LightningModule", exception: BaseException) -> None:
        self._after_failure(trainer, exception)

    def _after_failure(self, trainer: "Trainer", exception: BaseException) -> None:
        """Every way out of ``fit()`` by an exception (see ``TrainingSession.abort``): from
        ``on_exception`` and, in ``ddp_spawn`` ranks (where Lightning calls no ``on_exception``),
        from around the fit loop; the second call finds nothing left to do."""
        self._quiet = _lightning.unsilence(self._quiet)
        if isinstance(exception, _lightning.sigterm_exceptions()):  # several ranks: taken where they agreed
            final = self.save_on_sigterm and getattr(self._comm, "world_size", 1) == 1
        else:
            final = self.save_on_exception
        self.session.abort(trainer.global_step, exception, final=final,
                           capture=lambda: self._capture(trainer))

    def teardown(self, trainer: "Trainer", pl_module: "LightningModule", stage: str) -> None:
        self._quiet = _lightning.unsilence(self._quiet)
        if stage == "fit":
            if self._buckets is not None:  # a fit that ended before the order was complete: no hook left behind
                self._buckets.remove()
            self.session.close()

    def _consumed(self, trainer: "Trainer") -> int:
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.completed)

    def _save(self, trainer: "Trainer", between_epochs: bool = False) -> None:
        """A periodic checkpoint of this step (``between_epochs``: of the previous epoch's last batch)."""
        self.session.save(trainer.global_step, lambda: self._capture(trainer, between_epochs), defer=self.pipeline)

    def _capture(self, trainer: "Trainer", between_epochs: bool = False) -> Parts:
        """What a checkpoint now holds (see the module docstring); the data position from the sampler."""
        checkpoint = _trainer_api.dump_checkpoint(trainer, weights=not self._sharded)
        if between_epochs:
            _trainer_api.as_between_epochs(checkpoint)
        parts = (_sharded.split(trainer, checkpoint) if self._sharded
                 else _resume.split(checkpoint, (name for name, _ in trainer.lightning_module.named_buffers())))
        data = _data.position(self._samplers[0] if self._samplers else None, between_epochs)
        return Parts(parts.replicated, {**parts.per_rank, "data": data})

    def _log_figures(self, row: dict[str, Any]) -> None:
        _lightning.log_figures(getattr(self._trainer, "logger", None), row)

    # ---- the callback's own state (rides in Lightning's checkpoint) -----------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"policy": self.policy.state_dict()}
        if self._buckets is not None:
            state["ddp_buckets"] = self._buckets.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.load_state_dict(state_dict.get("policy", {}))
        self._restored_buckets = state_dict.get("ddp_buckets")
