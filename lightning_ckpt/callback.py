"""``AsyncShardedCheckpoint``: two-phase, rank-sliced checkpoints for a Lightning ``Trainer``.

Every rank takes part (Lightning's ``CheckpointIO`` only runs on rank 0, so the writer lives in
this callback): after each real optimizer step the shared :class:`~ckpt_engine.schedule.Schedule`
decides, identically on every rank, whether to checkpoint; each rank then snapshots its slice of
the replicated state and persists it in the background.

What a checkpoint holds, split the way data parallelism splits it:

* replicated (sliced across ranks): model parameters and optimizer states;
* per rank (whole): model buffers (BatchNorm statistics differ across DDP ranks after a step),
  the RNG states of Python, NumPy, torch and CUDA, the data position (epoch, batches consumed,
  the epoch-start RNG of the sampler), and the rest of Lightning's checkpoint (loops, schedulers,
  callbacks, precision, datamodule, plain hyper-parameters); on restore that rest comes from
  writer rank 0, as in Lightning's own checkpoints.

Resume: with ``resume="auto"`` (or ``trainer.fit(ckpt_path=<one of our checkpoints>)``) Lightning
restores from the dictionary this callback assembles; the train sampler is wrapped so that the
interrupted epoch continues at the next unseen sample, and the RNG streams are restored at the
step (see ``ckpt_engine.resumable``). Not bitwise: random augmentation inside DataLoader workers
(their seeds derive from a draw at ``iter()`` time) and a restore on a different world size (the
data split changes).
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import Any, Literal, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities.exceptions import SIGTERMException

from ckpt_engine import Checkpointer, CheckpointError, LocalComm, TorchDistComm
from ckpt_engine.config import CheckpointConfig
from ckpt_engine.errors import UnsupportedValueError
from ckpt_engine.figures import FigureReporter
from ckpt_engine.preempt import SignalAgreement
from ckpt_engine.resumable import rng_state, set_rng_state
from ckpt_engine.schedule import Schedule
from ckpt_engine.values import encode

from . import _trainer_api
from ._preempt import stop_agreement
from ._resume import CheckpointIOWrapper, assemble, is_our_checkpoint
from ._stateful import LoaderSampler, is_stateful_loader

_REPLICATED = ("state_dict", "optimizer_states")


class AsyncShardedCheckpoint(Callback):
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
        self.config = CheckpointConfig(
            path=_one_of("path", path, "dirpath", dirpath),
            every_n_steps=_one_of("every_n_steps", every_n_steps, "every_n_train_steps", every_n_train_steps),
            every_seconds=_one_of("every_seconds", every_seconds, "train_time_interval",
                                  train_time_interval.total_seconds() if isinstance(train_time_interval, timedelta)
                                  else train_time_interval),
            overhead_budget=overhead_budget, max_interval=max_interval, keep_last=keep_last,
            levels=tuple(levels) if levels is not None else None, storage_options=dict(storage_options or {}))
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
        self._interval_start = time.perf_counter()
        self._stop: SignalAgreement | None = None  # SIGTERM under several ranks (see _preempt)

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}[{self.config.location}]"

    # ---- set-up and resume ------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
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
        self._trainer = trainer
        if self.resume == "auto":
            step = comm.broadcast(self.ck.latest_step() if comm.rank == 0 else None)
            if step is not None:
                _trainer_api.inject_loaded_checkpoint(trainer, self.restore(step))

    def restore(self, step: int | None) -> dict[str, Any]:
        """Load checkpoint ``step`` (newest if ``None``) as the dictionary Lightning restores from;
        remember this rank's data position and RNG for the moments they must be applied."""
        assert self.ck is not None
        state = self.ck.load(step)
        own = self.ck.load_local()
        first = own if self.ck.rank == 0 and own is not None else self.ck.load_local(rank=0)
        mine = own if own is not None else first
        checkpoint = assemble(state, first["misc"], mine["buffers"])
        self._pending_data = mine["data"]
        self._pending_rng = own["rng"] if own is not None else None
        self.resumed_from = self.ck.loaded_manifest.step if self.ck.loaded_manifest else step
        for sampler in self._samplers:
            self._apply_data_position(sampler)
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

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
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
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: Any) -> None:
        if self._handle is not None:  # a deferred snapshot must finish before weights change
            self._handle.wait_snapshot()
            self._handle = None

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_global_step:
            return  # gradient accumulation: no optimizer step yet, the state is not consistent
        self._last_global_step = trainer.global_step
        assert self.schedule is not None
        if self.schedule.should_save(trainer.global_step):
            self._save(trainer, pl_module, batch_idx + 1, defer=self.pipeline)
            self.schedule.saved(trainer.global_step)
        self._report(trainer)
        if self._stop is not None and self._stop.poll():  # a rank got SIGTERM: all agree here
            self._stop.uninstall()
            if self._last_saved_step != trainer.global_step:
                self._save(trainer, pl_module, batch_idx + 1, defer=False)
            self.ck.wait()
            self._report(trainer)
            raise SIGTERMException()  # end the way Lightning ends a run on SIGTERM

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.ck is None:
            return
        if self._stop is not None:
            self._stop.finish()
            self._stop.uninstall()
        if self.save_on_train_end and self._last_saved_step != trainer.global_step:
            self._save(trainer, pl_module, self._consumed(trainer), defer=False)
        self.ck.wait(flush=True)  # multi-level: the flushes too (teardown's close() would wait anyway)
        self._report(trainer)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self._stop is not None:
            self._stop.uninstall()
        if self.ck is None or self._last_saved_step == trainer.global_step:
            return
        sigterm = isinstance(exception, SIGTERMException)
        if (sigterm and self.save_on_sigterm) or (not sigterm and self.save_on_exception):
            if not sigterm and self.ck.world_size > 1:
                warnings.warn("AsyncShardedCheckpoint: no final checkpoint on an exception under several ranks "
                              "(the other ranks may not reach it, so it could never commit)", stacklevel=2)
                return
            # One rank: Lightning raised SIGTERMException (several ranks: see on_train_batch_end).
            self._save(trainer, pl_module, self._consumed(trainer), defer=False)
            self.ck.wait()
            self._report(trainer)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and self._stop is not None:
            self._stop.uninstall()
            self._stop = None
        if stage == "fit" and self.ck is not None:
            try:
                self.ck.close()
            finally:
                self.ck = None

    def _consumed(self, trainer: "pl.Trainer") -> int:
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.completed)

    def _save(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", consumed: int, defer: bool) -> None:
        assert self.ck is not None
        checkpoint = _trainer_api.dump_checkpoint(trainer)
        buffers = {name for name, _ in pl_module.named_buffers()}
        weights = checkpoint.pop("state_dict")
        state = {"state_dict": {k: v for k, v in weights.items() if k not in buffers},
                 "optimizer_states": checkpoint.pop("optimizer_states", [])}
        sampler = self._samplers[0] if self._samplers else None
        local = {"misc": _plain_misc(checkpoint),
                 "buffers": {k: v.detach().clone() for k, v in weights.items() if k in buffers},
                 "rng": rng_state(),
                 "data": {"epoch": trainer.current_epoch, "consumed_batches": consumed,
                          "batch_size": getattr(self, "_batch_size", 1),
                          "epoch_rng": sampler.epoch_rng if sampler is not None else None,
                          "epoch_generators": sampler.epoch_generators if sampler is not None else []}}
        self._handle = self.ck.save(state, trainer.global_step, local, defer=defer)
        self._last_saved_step = trainer.global_step
        if self.ck.rank == 0 and self.ck.records and self._figures is not None:
            self._figures.track(self.ck.records[-1])

    # ---- figures -------------------------------------------------------------------------------
    def _report(self, trainer: "pl.Trainer") -> None:
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


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None:
        raise ValueError(f"give {name!r} or Lightning's {alias!r}, not both ({value!r} and {alias_value!r})")
    return value if value is not None else alias_value


def _plain_misc(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint minus weights, with the hyper-parameters that are not plain values
    dropped with a warning (resume does not need them). Anything else unstorable fails in
    ``Checkpointer.save`` naming its key, so only the hyper-parameters are checked here."""
    out = {}
    for key, value in checkpoint.items():
        if "hyper_parameters" in key or "hparams" in key:
            try:
                encode(value, key)
            except UnsupportedValueError as e:
                if not isinstance(value, dict):
                    warnings.warn(f"AsyncShardedCheckpoint: {key} not stored: {e}", stacklevel=3)
                    continue
                value = {k: v for k, v in value.items() if _plain(k, v)}
        out[key] = value
    return out


def _plain(key: str, value: Any) -> bool:
    try:
        encode(value, key)
        return True
    except UnsupportedValueError:
        warnings.warn(f"AsyncShardedCheckpoint: hyper-parameter {key!r} is not a plain value and is not stored "
                      "(resume does not need it)", stacklevel=4)
        return False
