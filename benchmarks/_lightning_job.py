"""A real Lightning training job on CPU, run under one checkpointing configuration, and timed.

Shared by ``bench_lightning.py`` and ``bench_overhead.py``. One call of :func:`run` is one
``trainer.fit`` of the same MLP (Adam, synthetic classification data) under one contender:

* ``none``: no checkpointing (``enable_checkpointing=False``);
* ``mc_sync``: Lightning ``ModelCheckpoint(every_n_train_steps=k, monitor="step", mode="max",
  save_top_k=3)``: synchronous ``torch.save`` on rank 0, the three newest kept (as ours keeps 3);
* ``mc_async``: the same ``ModelCheckpoint`` with ``Trainer(plugins=[AsyncCheckpointIO()])``;
* ``ours``: ``AsyncShardedCheckpoint(every_n_train_steps=k | overhead_budget=b, keep_last=3,
  pipeline=...)``.

What is timed (rank 0, ``time.perf_counter``, comparable across processes on Linux):

* ``loop_s``: ``on_train_start`` to ``on_train_end`` of a timing callback placed first in the
  callback list, so it includes every step and every checkpoint taken inside the loop, and not
  start-up, nor ours' final drain in its own ``on_train_end`` (placed after the timer);
* ``durable_s``: ``on_train_start`` to the timer's ``teardown``, which Lightning calls after
  ``strategy.teardown()`` (AsyncCheckpointIO's drain) and after ours' ``on_train_end``
  (final save, wait until committed): the time until every checkpoint is written;
* ``marks``: the time of every step's ``on_train_batch_end`` (timer, before the checkpoint
  callbacks of that step), for over-time plots;
* the time spent inside the checkpoint callback's hooks, by subclassing it: per checkpoint at
  step ``s``, ``on_train_batch_end`` at ``s`` plus (ours, pipeline) ``on_before_optimizer_step``
  of the next step, where the deferred copy is waited for.

Under ``ddp_spawn`` the fit runs in child processes; rank 0 writes its figures to a JSON file that
:func:`run` reads back, which is also how the single-device run reports (one code path).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import math
import os
import shutil
import statistics
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import AsyncShardedCheckpoint

from _slow_storage import SLOW, SlowStorage  # bench_overhead's slow runs (run(slow_at_step=...))

TARGET_VS_PEER = 1 / 3
"""Issue target: our overhead at most a third of the best peer's at the same interval."""
LABELS = {"none": "no checkpointing", "mc_sync": "ModelCheckpoint (sync torch.save)",
          "mc_async": "ModelCheckpoint + AsyncCheckpointIO", "ours": "ours, pipeline=False",
          "ours_pipe": "ours, pipeline=True"}
"""The contenders of bench_lightning (MLP and Transformer sections alike), as the tables name them."""
PEERS = ("mc_sync", "mc_async")
OURS = ("ours", "ours_pipe")

for _name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
    logging.getLogger(_name).setLevel(logging.ERROR)
warnings.filterwarnings("ignore", module="pytorch_lightning")
warnings.filterwarnings("ignore", module="lightning_fabric")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*AsyncCheckpointIO.*")


# ---- where the checkpoint work runs ------------------------------------------------------------------
WORK: list[tuple[str, str, float, float]] = []
"""(what, thread: "main" | "background", wall s, CPU s of that thread) of every checkpoint work item
since the timer's ``on_train_start``: ``torch.save`` of Lightning's ``TorchCheckpointIO`` (on the
training thread, or in AsyncCheckpointIO's), timed by wrapping it in this process. Ours' items come
from the engine's own per-save figures instead (:func:`our_work`)."""


def _record(what: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            where = "main" if threading.current_thread() is threading.main_thread() else "background"
            WORK.append((what, where, time.perf_counter() - wall, time.thread_time() - cpu))

    timed._bench_recorded = True  # type: ignore[attr-defined]
    return timed


def _instrument() -> None:
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

    if getattr(TorchCheckpointIO.save_checkpoint, "_bench_recorded", False):
        return
    TorchCheckpointIO.save_checkpoint = _record("torch.save", TorchCheckpointIO.save_checkpoint)


_instrument()


def our_work(figures: list[dict[str, Any]]) -> list[tuple[str, str, float, float]]:
    """Ours' checkpoint work in :data:`WORK`'s form, from the rows of ``figures.jsonl`` (each save's
    ``SaveRecord``: wall and thread CPU ms of encode + layout, snapshot copy, persist, commit)."""
    out: list[tuple[str, str, float, float]] = []
    for f in figures:
        if f.get("kind", "save") != "save":
            continue
        out.append(("ours encode+layout", "main", f["encode_ms"] / 1e3, f["encode_cpu_ms"] / 1e3))
        if f["skipped"]:
            continue
        out.append(("ours snapshot copy", "background" if f["deferred"] else "main", f["snapshot_ms"] / 1e3,
                    f["snapshot_cpu_ms"] / 1e3))
        out.append(("ours persist", "background", f["persist_ms"] / 1e3, f["persist_cpu_ms"] / 1e3))
        if f["commit_ms"] > 0:
            out.append(("ours commit", "background", f["commit_ms"] / 1e3, f["commit_cpu_ms"] / 1e3))
    return out


# ---- the job --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """The training job: an MLP ``dim_in -> hidden x depth -> 10`` with Adam, ``steps`` steps."""

    steps: int = 150
    batch: int = 64
    dim_in: int = 512
    hidden: int = 2048
    depth: int = 2
    devices: int = 1
    threads: int = 0
    """torch threads per rank; 0: cores // devices."""
    batches_per_epoch: int = 50
    seed: int = 0

    def params(self) -> int:
        h, d = self.hidden, self.depth
        return self.dim_in * h + h + (d - 1) * (h * h + h) + h * 10 + 10

    def state_mib(self) -> float:
        """Parameters + Adam's two moments, float32."""
        return self.params() * 12 / (1 << 20)


class MLP(pl.LightningModule):
    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job
        layers: list[torch.nn.Module] = [torch.nn.Linear(job.dim_in, job.hidden), torch.nn.ReLU()]
        for _ in range(job.depth - 1):
            layers += [torch.nn.Linear(job.hidden, job.hidden), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(job.hidden, 10))
        self.net = torch.nn.Sequential(*layers)

    def setup(self, stage: str) -> None:
        cores = os.cpu_count() or 1
        torch.set_num_threads(self.job.threads or max(1, cores // self.job.devices))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.job.seed)
        n = self.job.batch * self.job.batches_per_epoch
        x = torch.randn(n, self.job.dim_in, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.job.batch, shuffle=True, drop_last=True)


# ---- contenders ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Contender:
    """One checkpointing configuration."""

    name: str
    kind: str  # "none" | "mc_sync" | "mc_async" | "ours"
    every: Optional[int] = None
    budget: Optional[float] = None
    pipeline: bool = False
    keep: int = 3


class TimedModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that times its hooks (the save happens inside ``on_train_batch_end``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook_s: dict[str, dict[int, float]] = {"batch_end": defaultdict(float), "before_opt": defaultdict(float),
                                                    "epoch_end": defaultdict(float)}
        self.save_steps: list[int] = []
        self.cpu_ms: list[float] = []
        """Training-thread CPU per checkpoint (``time.thread_time`` around ``_save_checkpoint``)."""

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        super().on_train_batch_end(trainer, *args, **kwargs)
        self.hook_s["batch_end"][trainer.global_step] += time.perf_counter() - t

    def on_train_epoch_end(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        super().on_train_epoch_end(trainer, *args, **kwargs)
        self.hook_s["epoch_end"][trainer.global_step] += time.perf_counter() - t

    def _save_checkpoint(self, trainer: "pl.Trainer", filepath: str) -> None:
        self.save_steps.append(trainer.global_step)
        cpu = time.thread_time()
        super()._save_checkpoint(trainer, filepath)
        self.cpu_ms.append((time.thread_time() - cpu) * 1e3)  # Lightning's dictionary + torch.save (or the clone)


class TimedAsyncSharded(AsyncShardedCheckpoint):
    """Ours, timing the hooks the training thread waits in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook_s: dict[str, dict[int, float]] = {"batch_end": defaultdict(float), "before_opt": defaultdict(float),
                                                    "train_end": defaultdict(float)}
        self.save_steps: list[int] = []
        self._in_loop = True

    def on_before_optimizer_step(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        super().on_before_optimizer_step(trainer, *args, **kwargs)
        # global_step is not incremented yet: this wait belongs to the checkpoint of that step
        self.hook_s["before_opt"][trainer.global_step] += time.perf_counter() - t

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        super().on_train_batch_end(trainer, *args, **kwargs)
        self.hook_s["batch_end"][trainer.global_step] += time.perf_counter() - t

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._in_loop = False
        t = time.perf_counter()
        super().on_train_end(trainer, pl_module)
        self.hook_s["train_end"][trainer.global_step] += time.perf_counter() - t

    def _save(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        if self._in_loop:
            self.save_steps.append(trainer.global_step)
        super()._save(trainer, *args, **kwargs)


class Timer(Callback):
    """First callback of the list: loop and to-durable times, per-step marks, and (at teardown)
    the hook times of the checkpoint callback; rank 0 writes them to ``out``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.t0 = 0.0
        self.marks: list[float] = []
        self.loop_s = math.nan

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.marks = []
        WORK.clear()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any) -> None:
        self.marks.append(time.perf_counter() - self.t0)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.loop_s = time.perf_counter() - self.t0

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit" or trainer.global_rank != 0:
            return
        durable_s = time.perf_counter() - self.t0
        result: dict[str, Any] = {"loop_s": self.loop_s, "durable_s": durable_s, "t0": self.t0,
                                  "marks": self.marks, "global_step": trainer.global_step,
                                  "save_steps": [], "hook_s": {}, "work": list(WORK)}
        for cb in trainer.callbacks:
            if isinstance(cb, (TimedModelCheckpoint, TimedAsyncSharded)):
                result["save_steps"] = list(cb.save_steps)
                result["train_cpu_ms"] = list(getattr(cb, "cpu_ms", []))
                result["hook_s"] = {h: {str(k): v for k, v in d.items()} for h, d in cb.hook_s.items()}
        with open(self.out, "w") as f:
            json.dump(result, f)


# ---- slow storage (bench_overhead) ------------------------------------------------------------------
# SLOW and SlowStorage live in _slow_storage (it imports no Lightning: the Transformer fits use it too).


class SlowSwitch(Callback):
    """Turns :data:`SLOW` on from step ``at_step`` (and off at set-up)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        SLOW["on"], SLOW["writes"] = False, 0

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any) -> None:
        if trainer.global_step >= self.at_step:
            SLOW["on"] = True

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        SLOW["on"] = False


# ---- one run -----------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """Figures of one fit (rank 0)."""

    contender: str
    kind: str
    devices: int
    steps: int
    rep: int
    loop_s: float
    durable_s: float
    marks: list[float]
    save_steps: list[int]
    stalls_ms: list[float]
    """Time the training thread spent in the checkpoint callback per in-loop checkpoint."""
    figures: list[dict[str, Any]] = field(default_factory=list)
    """Ours: the rows of ``figures.jsonl`` (every checkpoint, the final one included)."""
    final_save_ms: float = 0.0
    """Ours: ``on_train_end`` (final save if any, then wait until committed)."""
    slow_writes: int = 0
    work: list = field(default_factory=list)
    """:data:`WORK` of rank 0 during the fit, then ours' items (:func:`our_work`)."""
    foreign_cores: float = 0.0
    """CPU cores other processes kept busy during the fit, on average (noise indicator)."""
    train_cpu_ms: list = field(default_factory=list)
    """Per in-loop checkpoint: CPU the training thread spent on it (``time.thread_time``): ours'
    ``train_cpu_ms`` from ``figures.jsonl``; ``ModelCheckpoint._save_checkpoint`` for Lightning's."""

    @property
    def n_ckpt(self) -> int:
        return len(self.save_steps)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _stalls(result: dict[str, Any]) -> list[float]:
    """Per in-loop checkpoint at step s: batch_end(s) + before_opt(s) (the next step's wait), minus
    the median of the same hooks at steps without a checkpoint (their bookkeeping)."""
    hooks = result["hook_s"]
    if not hooks:
        return []
    be = {int(k): v for k, v in hooks.get("batch_end", {}).items()}
    bo = {int(k): v for k, v in hooks.get("before_opt", {}).items()}
    saves = set(result["save_steps"])
    plain = [be.get(s, 0.0) + bo.get(s, 0.0) for s in be if s not in saves]
    base = statistics.median(plain) if plain else 0.0
    return [(be.get(s, 0.0) + bo.get(s, 0.0) - base) * 1e3 for s in result["save_steps"]]


def run(job: Job, c: Contender, workdir: str, rep: int = 0, slow_at_step: Optional[int] = None,
        slow_sleep_s: float = 0.0, slow_seconds_per_byte: float = 0.0) -> RunResult:
    """One ``trainer.fit`` of ``job`` under ``c`` in a fresh ``workdir`` (deleted afterwards)."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    out = os.path.join(workdir, "timer.json")
    ckdir = os.path.join(workdir, "ckpt")
    callbacks: list[Callback] = [Timer(out)]
    plugins: list[Any] = []
    cb: Any = None
    if c.kind in ("mc_sync", "mc_async"):
        cb = TimedModelCheckpoint(dirpath=ckdir, every_n_train_steps=c.every, monitor="step", mode="max",
                                  save_top_k=c.keep)
        if c.kind == "mc_async":
            from pytorch_lightning.plugins.io import AsyncCheckpointIO
            plugins.append(AsyncCheckpointIO())
    elif c.kind == "ours":
        where = SlowStorage(ckdir) if slow_at_step is not None else ckdir  # slow runs: one device
        cb = TimedAsyncSharded(dirpath=where, every_n_train_steps=c.every, overhead_budget=c.budget,
                               keep_last=c.keep, pipeline=c.pipeline, resume="never")
    elif c.kind != "none":
        raise ValueError(c.kind)
    if cb is not None:
        callbacks.append(cb)
    if slow_at_step is not None:
        callbacks.append(SlowSwitch(slow_at_step))
        SLOW.update(sleep_s=slow_sleep_s, seconds_per_byte=slow_seconds_per_byte)
    pl.seed_everything(job.seed, verbose=False)
    load = CpuLoad()
    trainer = pl.Trainer(accelerator="cpu", devices=job.devices,
                         strategy="ddp_spawn" if job.devices > 1 else "auto", max_steps=job.steps,
                         callbacks=callbacks, plugins=plugins or None, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=c.kind.startswith("mc"),
                         limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=workdir)
    trainer.fit(MLP(job))
    foreign = load.foreign_cores()
    with open(out) as f:
        res = json.load(f)
    figures: list[dict[str, Any]] = []
    fig_path = os.path.join(ckdir, "figures.jsonl")
    if os.path.exists(fig_path):
        with open(fig_path) as f:
            figures = [json.loads(line) for line in f if line.strip()]
    final_ms = sum(res["hook_s"].get("train_end", {}).values()) * 1e3 if res["hook_s"] else 0.0
    result = RunResult(c.name, c.kind, job.devices, job.steps, rep, res["loop_s"], res["durable_s"], res["marks"],
                       res["save_steps"], _stalls(res), figures, final_ms, SLOW["writes"] if slow_at_step else 0,
                       res.get("work", []) + our_work(figures), foreign)
    if c.kind == "ours":
        steps = set(res["save_steps"])
        result.train_cpu_ms = [f["train_cpu_ms"] for f in figures
                               if f.get("kind", "save") == "save" and f["step"] in steps and "train_cpu_ms" in f]
    else:
        result.train_cpu_ms = res.get("train_cpu_ms", [])
    shutil.rmtree(workdir, ignore_errors=True)
    return result


class CpuLoad:
    """Busy CPU time of the whole machine (``/proc/stat``) minus this process's and its reaped
    children's, over a stretch of wall time: how many cores other processes used meanwhile."""

    def __init__(self) -> None:
        self.wall, self.busy, self.own = time.perf_counter(), _busy_s(), _own_cpu_s()

    def foreign_cores(self) -> float:
        wall = time.perf_counter() - self.wall
        if wall <= 0:
            return math.nan
        return max(0.0, (_busy_s() - self.busy) - (_own_cpu_s() - self.own)) / wall


def _busy_s() -> float:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return math.nan
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user / nice
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def wait_quiet(threshold: float, window: float = 1.0, max_wait: float = 30.0) -> tuple[float, float]:
    """Wait until other processes use at most ``threshold`` cores over ``window`` seconds, or
    ``max_wait`` passed. Returns (seconds waited, the last foreign load seen)."""
    start = time.perf_counter()
    while True:
        probe = CpuLoad()
        time.sleep(window)
        load = probe.foreign_cores()
        waited = time.perf_counter() - start
        if load <= threshold or waited >= max_wait:
            return waited, load


def warm_up(job: Job, workdir: str, steps: int = 100) -> None:
    """Unmeasured fits first (kernels, allocator, imports, page cache of the libraries): in every
    early run here the first measured fit after a 20-step warm-up came out 15-50 % slower."""
    run(Job(**{**asdict(job), "steps": steps}), Contender("warm-up", "none"), workdir)
    run(Job(**{**asdict(job), "steps": 30}), Contender("warm-up", "ours", every=10), workdir)


def median(values: list[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else math.nan


def mean(values: list[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.fmean(vals) if vals else math.nan


class Runner:
    """Runs fits one after another on a shared machine: before each, waits (a little) for the
    other processes to quieten; re-runs a fit that others disturbed (more than ``quiet`` cores on
    average), keeping the least disturbed attempt, while ``budget_s`` of wall time lasts."""

    def __init__(self, workdir: str, budget_s: float, quiet: float = 0.3, retries: int = 1,
                 max_wait: float = 15.0) -> None:
        self.workdir, self.budget_s, self.quiet = workdir, budget_s, quiet
        self.retries, self.max_wait = retries, max_wait
        self.start = time.perf_counter()
        self.waited_s = 0.0
        self.reruns = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def __call__(self, job: Job, c: Contender, rep: int = 0, note: str = "", **kwargs: Any) -> RunResult:
        best: Optional[RunResult] = None
        for attempt in range(1 + self.retries):
            if self.left() > 0:
                waited, _ = wait_quiet(self.quiet, max_wait=min(self.max_wait, max(0.0, self.left())))
                self.waited_s += waited
            r = run(job, c, self.workdir, rep=rep, **kwargs)
            if best is None or r.foreign_cores < best.foreign_cores:
                best = r
            print(f"  [{self.elapsed():6.1f}s] devices={job.devices} rep={rep} {c.name:12s}{note} "
                  f"loop {r.loop_s:6.2f}s durable {r.durable_s:6.2f}s ckpts {r.n_ckpt:3d} "
                  f"stall/ckpt {mean(r.stalls_ms):7.1f} ms  foreign load {r.foreign_cores:.2f} cores"
                  f"{'  (re-run)' if attempt else ''}", flush=True)
            if r.foreign_cores <= self.quiet or self.left() <= 0:
                break
            self.reruns += 1
        assert best is not None
        return best


# ---- within-run figures (immune to the run-to-run drift of this machine) --------------------------
def step_times(r: RunResult) -> list[float]:
    """Wall time of steps 2..N (step j: from the timer's mark of step j-1 to its mark of step j, so
    it holds the checkpoint work done at the end of step j-1)."""
    return [b - a for a, b in zip(r.marks, r.marks[1:])]


def phases(r: RunResult) -> list[tuple[int, float, float]]:
    """(step, dt, phase) for steps after the first checkpoint: phase = position in its interval,
    in (0, 1]; 1/k for the step right after a checkpoint, 1 for the step before the next one."""
    saves = sorted(r.save_steps)
    dts = step_times(r)
    out = []
    for j in range(2, len(r.marks) + 1):  # step j, dt index j-2
        prev = max((s for s in saves if s < j), default=None)
        nxt = min((s for s in saves if s >= j), default=None)
        if prev is None or nxt is None:
            continue
        out.append((j, dts[j - 2], (j - prev) / (nxt - prev)))
    return out


def base_step_s(r: RunResult, tail: float = 0.7) -> float:
    """This run's clean iteration time: the median step time over the last 30 % of each interval
    between checkpoints (furthest from the previous checkpoint's stall and background write);
    every step but the first few for a run without checkpoints."""
    if not r.save_steps:
        return median(step_times(r)[5:])
    late = [dt for _, dt, ph in phases(r) if ph > tail]
    return median(late) if late else median(step_times(r)[5:])


def drift_corrected(r: RunResult, base: RunResult) -> float:
    """Overhead with each run measured in its own clean iterations: loop ÷ (steps × clean
    iteration), minus the same figure of the no-checkpoint run (its jitter and start). Not fooled
    by one run being uniformly faster than another; misses a slowdown that lasts whole intervals."""
    own = r.loop_s / (r.steps * base_step_s(r))
    ref = base.loop_s / (base.steps * base_step_s(base))
    return own - ref


def local_costs(r: RunResult, window: int = 12, before: int = 10) -> list[float]:
    """Seconds each in-loop checkpoint cost the training: the excess of the ``window`` steps that
    follow it (its stall, then the steps that ran beside its background write; cut at the next
    checkpoint) over the clean step time just before it (median of the late-interval steps, phase
    > 0.7, among the ``before`` steps that precede it; the run's clean step if fewer than 3). Local
    in time, so neither the run-to-run nor the slower within-run drift of this machine's speed is
    charged to the checkpoint, and jitter far from any checkpoint is not either."""
    dts = step_times(r)
    clean_run = base_step_s(r)
    saves = sorted(r.save_steps)
    phase = {j: ph for j, _, ph in phases(r)}
    out = []
    for i, s in enumerate(saves):
        ref = [dts[j - 2] for j in range(max(6, s - before + 1), s + 1)
               if 0 <= j - 2 < len(dts) and phase.get(j, 1.0 if i == 0 else 0.0) > 0.7]
        base = median(ref) if len(ref) >= 3 else clean_run
        stop = min(s + window, saves[i + 1] if i + 1 < len(saves) else s + window, len(r.marks))
        seg = [dts[j - 2] for j in range(s + 1, stop + 1) if 0 <= j - 2 < len(dts)]
        if seg:
            out.append(sum(seg) - len(seg) * base)
    return out
