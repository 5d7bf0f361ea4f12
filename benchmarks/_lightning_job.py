"""One Lightning fit on CPU under one checkpointing contender, in a fresh process, and its figures.

The one Lightning job of the benchmarks (``bench_lightning`` and ``bench_overhead``). The model is
Lightning's own demo Transformer (``pytorch_lightning.demos.transformer.LightningTransformer``, 14.6 M
parameters, with Adam instead of the demo's SGD: ~176 MB of state) on a synthetic token stream cut
into ``block``-token samples exactly as the demo's ``WikiText2`` cuts its text (no download), or
(``model="mlp"``) an MLP ``512 -> 2048 -> 2048 -> 10`` with Adam (~63 MB) on synthetic classes.

Contenders (:data:`CONTENDERS`): ``none`` (no checkpointing); ``mc_sync`` (``ModelCheckpoint``,
synchronous ``torch.save``, three newest kept as ours keeps three) and ``mc_async`` (the same with
``AsyncCheckpointIO``); ours (``AsyncShardedCheckpoint``, ``pipeline`` off and on; ``budget`` set:
``overhead_budget`` instead of a fixed interval); and the node-memory set (:data:`MEMORY_CONTENDERS`,
a disk paced to ``disk_mb_s`` by ``_slow_storage.SlowStorage``): ``ours_disk50`` on that disk alone,
``ours_mem`` with a node-memory level in ``/dev/shm`` in front of it (every ``every`` steps) and
``ours_mem_every1`` (every step), and ``copy_hash_every1``, the floor of a checkpoint at every step:
the state copied into one preallocated buffer and hashed with xxh3 on the training thread.

Every fit runs in its own process (:func:`run_fit`), so the figures are whole-process ones:
``process_cpu_s`` (``getrusage`` at the end: every thread, imports and start-up included; only ours
imports ``ckpt_engine``); ``fit_cpu_s`` / ``fit_wall_s`` around ``trainer.fit``; the CPU by thread
(the main thread, each Python thread when it ended or at the end, the rest: native threads); per
checkpoint the training thread's CPU (``ModelCheckpoint._save_checkpoint``, ours' ``train_cpu_ms``)
and Lightning's ``torch.save`` calls; at every step's end (the first callback) the wall time, the
main-thread CPU and the process CPU (``marks``), from which :func:`local_costs` and
:func:`drift_corrected` take their figures; when training ends (the first ``on_train_end``, before ours
waits for its last checkpoint) ``end_wall_s`` / ``end_cpu_s``; ours' ``figures.jsonl`` rows and counters.

``python _lightning_job.py --contender ours --out result.json ...`` is one fit (the child).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

VOCAB = 33278
"""The demo's default vocabulary (WikiText-2's)."""
DEFAULT_CONTENDERS = ("none", "mc_sync", "mc_async", "ours", "ours_pipe")
MEMORY_CONTENDERS = ("ours_disk50", "ours_mem", "ours_mem_every1", "copy_hash_every1")
CONTENDERS = DEFAULT_CONTENDERS + MEMORY_CONTENDERS
PEERS = ("mc_sync", "mc_async")
OURS = ("ours", "ours_pipe")
SLOW_DISK = ("ours_disk50", "ours_mem", "ours_mem_every1")
MEMORY_LEVEL = ("ours_mem", "ours_mem_every1")
EVERY_STEP = ("ours_mem_every1", "copy_hash_every1")
"""The contenders that checkpoint (or copy and hash) at every step, whatever ``every`` says."""
SHM_ROOT = "/dev/shm/ckpt-suite-bench"
"""The memory level's root: one directory per fit below it, removed after the fit."""
TARGET_VS_PEER = 1 / 3
"""Target: our overhead at most a third of the best peer's at the same interval."""
LABELS = {"none": "no checkpointing", "mc_sync": "ModelCheckpoint (sync torch.save)",
          "mc_async": "ModelCheckpoint + AsyncCheckpointIO", "ours": "ours, pipeline=False",
          "ours_pipe": "ours, pipeline=True"}


@dataclass(frozen=True)
class FitJob:
    """The fit: ``steps`` optimizer steps of ``model``, a checkpoint every ``every`` steps."""

    model: str = "transformer"
    steps: int = 120
    every: int = 10
    block: int = 35
    """Tokens per sample (the demo's ``WikiText2(block_size=35)``)."""
    threads: int = 0
    """``torch.set_num_threads``; 0 leaves torch's default (all cores)."""
    keep: int = 3
    seed: int = 0
    disk_mb_s: float = 50.0
    """The slow disk's rate (MB/s) of :data:`SLOW_DISK`."""


def every_of(job: FitJob, contender: str) -> int:
    """Steps between checkpoints of ``contender``: 1 for :data:`EVERY_STEP`, else ``job.every``."""
    return 1 if contender in EVERY_STEP else job.every


def label(c: str, job: FitJob) -> str:
    """How the tables name contender ``c``."""
    disk = f"{job.disk_mb_s:g} MB/s disk"
    return LABELS.get(c) or {
        "ours_disk50": f"ours, {disk} only, every {job.every}", "ours_mem": f"ours, memory + {disk}, every {job.every}",
        "ours_mem_every1": f"ours, memory + {disk}, every step",
        "copy_hash_every1": "copy + xxh3 only, every step (floor)"}.get(c) or c


@dataclass
class FitResult:
    """One fit's figures (see the module docstring)."""

    contender: str
    rep: int
    process_cpu_s: float
    process_wall_s: float
    fit_cpu_s: float
    fit_wall_s: float
    main_cpu_s: float
    threads_cpu_s: dict[str, float]
    """CPU seconds by thread name (numbered pool threads folded into their pool's name)."""
    n_ckpt: int
    train_cpu_ms: list[float]
    """Per in-loop checkpoint: CPU the training thread spent on it."""
    torch_save: list[tuple[str, float, float]] = field(default_factory=list)
    """Lightning's ``torch.save`` calls: (thread: "main" | "background", wall s, CPU s)."""
    figures: list[dict[str, Any]] = field(default_factory=list)
    """Ours: the rows of ``figures.jsonl``."""
    params: int = 0
    save_steps: list[int] = field(default_factory=list)
    """The steps checkpointed inside the loop (none: the steps the others checkpoint, as a control)."""
    marks: list[tuple[float, float, float]] = field(default_factory=list)
    """At every step's end: (``perf_counter``, main-thread CPU, process CPU), seconds."""
    import_cpu_ms: float = 0.0
    """CPU of importing ours (``lightning_ckpt``; Lightning's is imported by every contender)."""
    end_wall_s: float = float("nan")
    end_cpu_s: float = float("nan")
    """From the start of ``fit`` to the first ``on_train_end`` hook (before ours' final wait)."""
    counters: dict[str, float] = field(default_factory=dict)
    """Ours: ``Checkpointer.counters`` at the end (saves, committed, skipped, flushed, waited_s...)."""
    slow: dict[str, float] = field(default_factory=dict)
    """The slow disk's counters (``_slow_storage.SLOW``: writes, bytes, slept_s)."""
    shm_left: list[str] = field(default_factory=list)
    """What the fit left below its memory directory after ``fit`` (removed then by the child)."""
    copy_hash: list[tuple[float, float]] = field(default_factory=list)
    """``copy_hash_every1``: per step, (wall s, training-thread CPU s) of the copy and the hash."""
    name: str = ""
    """The benchmark's name of the configuration (``contender`` when empty)."""

    @property
    def loop_s(self) -> float:
        """The training loop's wall time, from the first step's end to the last's (no set-up, no end)."""
        return self.marks[-1][0] - self.marks[0][0] if self.marks else float("nan")

    @property
    def other_cpu_s(self) -> float:
        """Process CPU that is neither the main thread's nor a Python thread's (native threads)."""
        return self.process_cpu_s - self.main_cpu_s - sum(self.threads_cpu_s.values())

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def child_env(pycache: str) -> dict[str, str]:
    """The fits' environment: bytecode cached under ``pycache`` (outside the repository), so that ours
    is not charged for compiling ``ckpt_engine`` in every fit (~0.1 s of CPU)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def warm_up(job: FitJob, workdir: str, pycache: str, memory: bool = False) -> None:
    """Unmeasured short fits that import (and compile into ``pycache``) what the contenders import."""
    short = FitJob(**{**asdict(job), "steps": 2 * job.every})
    for contender in ("mc_async", "ours") + (("ours_mem",) if memory else ()):
        run_fit(short, contender, workdir, pycache=pycache)


def run_fit(job: FitJob, contender: str, workdir: str, rep: int = 0, pycache: Optional[str] = None,
            name: str = "", budget: float = 0.0, slow_at_step: int = 0, slow_mb_s: float = 0.0) -> FitResult:
    """One fit of ``job`` under ``contender`` in a fresh process and a fresh ``workdir`` (removed after).
    ``budget``: ours with ``overhead_budget`` instead of every ``job.every`` steps; ``slow_at_step``:
    ours' disk paced to ``slow_mb_s`` from that step on."""
    if contender not in CONTENDERS:
        raise ValueError(f"contender must be one of {CONTENDERS}, got {contender!r}")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    out = os.path.join(workdir, "result.json")
    mem_job = f"fit-{os.getpid()}-{rep}-{contender}-{uuid.uuid4().hex[:8]}"
    args = [sys.executable, os.path.abspath(__file__), "--contender", contender, "--out", out, "--dir", workdir,
            "--model", job.model, "--steps", str(job.steps), "--every", str(every_of(job, contender)),
            "--block", str(job.block), "--threads", str(job.threads), "--keep", str(job.keep),
            "--seed", str(job.seed), "--disk-mb-s", str(job.disk_mb_s), "--mem-job", mem_job,
            "--budget", str(budget), "--slow-at-step", str(slow_at_step), "--slow-mb-s", str(slow_mb_s)]
    try:
        done = subprocess.run(args, cwd=workdir, capture_output=True, text=True,
                              env=child_env(pycache) if pycache else None)
    finally:  # a fit that died leaves its memory behind: never let it pile up in /dev/shm
        remove_memory(mem_job)
    if done.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"the {contender} fit failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    with open(out) as f:
        res = json.load(f)
    shutil.rmtree(workdir, ignore_errors=True)
    return FitResult(contender=contender, rep=rep, name=name or contender, **res)


def memory_left(mem_job: str) -> list[str]:
    """The files left below the memory directory of ``mem_job`` (``["(empty directories)"]`` if only those)."""
    top = os.path.join(SHM_ROOT, mem_job)
    if not os.path.isdir(top):
        return []
    files = sorted(os.path.relpath(os.path.join(d, f), top) for d, _, names in os.walk(top) for f in names)
    return files or ["(empty directories)"]


def remove_memory(mem_job: str) -> None:
    """Remove the memory directory of ``mem_job`` (and the root, once empty)."""
    shutil.rmtree(os.path.join(SHM_ROOT, mem_job), ignore_errors=True)
    try:
        os.rmdir(SHM_ROOT)
    except OSError:
        pass


# ---- figures of a fit's step marks -------------------------------------------------------------------
def median(values: list[float]) -> float:
    """The median of the values that are not NaN (NaN if none)."""
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else math.nan


def mean(values: list[float]) -> float:
    """The mean of the values that are not NaN (NaN if none)."""
    vals = [v for v in values if v == v]
    return statistics.fmean(vals) if vals else math.nan


MARK = {"wall": 0, "main_cpu": 1, "cpu": 2}
"""The figures of a step mark (``FitResult.marks``)."""


def step_deltas(r: FitResult, i: int = 0) -> dict[int, float]:
    """Per step j ≥ 2, mark ``i`` of step j minus that of step j - 1 (step j holds the checkpoint work
    done at the end of step j - 1)."""
    m = r.marks
    return {j: m[j - 1][i] - m[j - 2][i] for j in range(2, len(m) + 1)}


def clean_step(r: FitResult, i: int = 0, tail: float = 0.7) -> float:
    """The fit's clean step: the median over the steps late in an interval between checkpoints
    (phase > ``tail``, clear of the previous checkpoint's work); every step after the fifth for a fit
    without checkpoints."""
    dx, saves = step_deltas(r, i), sorted(r.save_steps)
    late = []
    for a, b in zip(saves, saves[1:]):
        late += [dx[j] for j in range(a + 1, b + 1) if j in dx and (j - a) / (b - a) > tail]
    return median(late if r.n_ckpt and late else [dx[j] for j in sorted(dx)[4:]])


def drift_corrected(r: FitResult, base: FitResult, i: int = 0, total: str = "end_wall_s") -> float:
    """Overhead with each fit measured in its own clean steps: ``total`` ÷ (steps × clean step), minus
    the same of the no-checkpointing fit of its round. Whole fits run uniformly faster or slower than
    their neighbours here; this figure is not fooled by that, but misses a slowdown lasting whole intervals."""
    def steps(f: FitResult) -> int:  # the loop (``loop_s``) starts at the first step's end
        return len(f.marks) - (total == "loop_s")

    own = getattr(r, total) / (steps(r) * clean_step(r, i))
    return own - getattr(base, total) / (steps(base) * clean_step(base, i))


def local_costs(r: FitResult, window: int, i: int = 0, tail: float = 0.7) -> list[float]:
    """Seconds each in-loop checkpoint cost in mark ``i``: the excess of the ``window`` steps after it
    (cut at the next checkpoint: its stall, then the steps beside its background work) over the median
    of the late steps of the interval before it. Local in time, so the drift between fits is not
    charged to it; a checkpoint without ``window`` steps after it, or without late steps before it, is
    left out. For ``none``: the same windows at the same steps (a control: ~0)."""
    dx, saves, out = step_deltas(r, i), sorted(r.save_steps), []
    for k, s in enumerate(saves):
        prev = saves[k - 1] if k else s - window
        stop = min(s + window, saves[k + 1] if k + 1 < len(saves) else s + window)
        before = [dx[j] for j in range(max(2, prev + 1), s + 1) if j in dx and (j - prev) / (s - prev) > tail]
        if before and stop in dx:
            base = statistics.median(before)
            out.append(sum(dx[j] - base for j in range(s + 1, stop + 1)))
    return out


# ---- the child: one fit ----------------------------------------------------------------------------
_ENDED: dict[str, float] = {}
"""CPU seconds of the Python threads that ended, by name (child process)."""


def _pool_name(name: str) -> str:
    """``ckpt-hash_0`` → ``ckpt-hash``, ``ThreadPoolExecutor-1_0`` → ``ThreadPoolExecutor``."""
    base = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[-1].isdigit() else name
    return base.split("-")[0] if base.startswith("ThreadPoolExecutor-") else base


def _count_thread_cpu() -> None:
    """Wrap ``threading.Thread.run`` so that every Python thread adds its CPU to :data:`_ENDED` as it ends."""
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        try:
            original(self)
        finally:
            name = _pool_name(self.name)
            _ENDED[name] = _ENDED.get(name, 0.0) + time.thread_time()

    threading.Thread.run = run  # type: ignore[method-assign]


def _threads_cpu() -> dict[str, float]:
    """CPU seconds of every Python thread but this one: ended ones, plus the live ones' so far."""
    out = dict(_ENDED)
    tick = os.sysconf("SC_CLK_TCK")
    for t in threading.enumerate():
        if t is threading.current_thread() or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = _pool_name(t.name)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _rusage_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _model(a: argparse.Namespace) -> Any:
    """The fit's LightningModule: the demo Transformer with Adam and synthetic tokens, or the MLP."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.demos.transformer import LightningTransformer
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    class SyntheticTokens(Dataset):
        """A random token stream, cut as the demo's ``WikiText2`` cuts its text."""

        def __init__(self, samples: int, block: int, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.data = torch.randint(0, VOCAB, (samples * block + 1,), generator=g)
            self.block = block

        def __len__(self) -> int:
            return (len(self.data) - 1) // self.block

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            start = index * self.block
            return self.data[start:start + self.block], self.data[start + 1:start + self.block + 1]

    class DemoTransformer(LightningTransformer):
        """The demo model with Adam and synthetic tokens (no download in ``prepare_data``)."""

        def prepare_data(self) -> None:
            pass

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.model.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(SyntheticTokens(a.steps + 1, a.block, a.seed))

    class MLP(pl.LightningModule):
        """``512 -> 2048 -> 2048 -> 10`` with Adam on synthetic classes, 100 batches of 64 per epoch."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                           torch.nn.ReLU(), torch.nn.Linear(2048, 10))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(a.seed)
            x, y = torch.randn(6400, 512, generator=g), torch.randint(0, 10, (6400,), generator=g)
            return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, drop_last=True)

    return DemoTransformer(vocab_size=VOCAB) if a.model == "transformer" else MLP()


def _child(a: argparse.Namespace) -> None:
    start = time.perf_counter()
    _count_thread_cpu()
    import logging
    import warnings

    import pytorch_lightning as pl
    import torch

    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class Marks(pl.Callback):
        """First callback: the time and CPU at every step's end, and when training ends (before the
        other callbacks' ``on_train_end``, so before ours waits for its last checkpoint)."""

        def __init__(self) -> None:
            self.marks: list[tuple[float, float, float]] = []
            self.end = (float("nan"), float("nan"))

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            self.marks.append((time.perf_counter(), time.thread_time(), _rusage_cpu()))

        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            self.end = (time.perf_counter(), _rusage_cpu())

    class CopyHash(pl.Callback):
        """At every step's end: the state's tensors copied into one preallocated byte buffer, then xxh3
        over it, on the training thread (the floor of a checkpoint at every step)."""

        def __init__(self) -> None:
            import xxhash

            self.hash = xxhash.xxh3_64_intdigest
            self.buffer: Optional[torch.Tensor] = None
            self.times: list[tuple[float, float]] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
            wall, cpu = time.perf_counter(), time.thread_time()
            tensors = [t for t in pl_module.state_dict().values() if isinstance(t, torch.Tensor)]
            for opt in trainer.optimizers:
                tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            flat = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
            total = sum(f.numel() for f in flat)
            if self.buffer is None or self.buffer.numel() != total:
                self.buffer = torch.empty(total, dtype=torch.uint8)
            offset = 0
            for f in flat:
                self.buffer[offset:offset + f.numel()].copy_(f)
                offset += f.numel()
            self.hash(self.buffer.numpy())
            self.times.append((time.perf_counter() - wall, time.thread_time() - cpu))

    if a.threads:
        torch.set_num_threads(a.threads)
    ckdir = os.path.join(a.dir, "ckpt")
    marks = Marks()
    callbacks: list[Any] = [marks]
    import_cpu = 0.0
    plugins: list[Any] = []
    ours: Any = None
    copy_hash: Any = None
    slow: dict[str, Any] = {}
    saves: list[float] = []
    save_steps: list[int] = []
    torch_save: list[tuple[str, float, float]] = []
    if a.contender.startswith("mc"):
        from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
        from pytorch_lightning.callbacks import ModelCheckpoint

        original_save = TorchCheckpointIO.save_checkpoint

        def timed_save(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return original_save(*args, **kwargs)
            finally:
                where = "main" if threading.current_thread() is threading.main_thread() else "background"
                torch_save.append((where, time.perf_counter() - wall, time.thread_time() - cpu))

        TorchCheckpointIO.save_checkpoint = timed_save  # type: ignore[method-assign]

        class TimedModelCheckpoint(ModelCheckpoint):
            def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
                save_steps.append(trainer.global_step)
                cpu = time.thread_time()
                super()._save_checkpoint(trainer, filepath)
                saves.append((time.thread_time() - cpu) * 1e3)

        callbacks.append(TimedModelCheckpoint(dirpath=ckdir, every_n_train_steps=a.every, monitor="step",
                                              mode="max", save_top_k=a.keep))
        if a.contender == "mc_async":
            from pytorch_lightning.plugins.io import AsyncCheckpointIO
            plugins.append(AsyncCheckpointIO())
    elif a.contender.startswith("ours"):
        cpu = _rusage_cpu()
        from lightning_ckpt import AsyncShardedCheckpoint
        import_cpu = _rusage_cpu() - cpu

        class Recorded(AsyncShardedCheckpoint):
            """Ours, keeping the figure rows it reports (a memory level's ``figures.jsonl`` goes with its
            directory at close) and its checkpointer (for the counters after the fit)."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.rows: list[dict[str, Any]] = []
                self.opened: Any = None

            def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
                super().setup(trainer, pl_module, stage)
                self.opened = self.session.ck

            def _log_figures(self, row: dict[str, Any]) -> None:
                self.rows.append(dict(row))
                super()._log_figures(row)

        where: dict[str, Any] = {"dirpath": ckdir}
        if a.contender in SLOW_DISK or a.slow_at_step:
            from _slow_storage import SLOW, SlowStorage, throttle

            if a.slow_at_step:  # the disk slows down from that step on
                from pytorch_lightning.callbacks import LambdaCallback

                callbacks.append(LambdaCallback(on_train_batch_end=lambda trainer, *_: None if SLOW["on"] or
                                                trainer.global_step < a.slow_at_step else throttle(a.slow_mb_s)))
            else:
                throttle(a.disk_mb_s)
            slow = SLOW
            disk = SlowStorage(ckdir)
            where = {"dirpath": disk} if a.contender not in MEMORY_LEVEL else \
                {"levels": [{"kind": "memory", "path": SHM_ROOT, "job": a.mem_job}, disk]}
        schedule = {"overhead_budget": a.budget} if a.budget else {"every_n_train_steps": a.every}
        ours = Recorded(**where, **schedule, keep_last=a.keep, pipeline=a.contender == "ours_pipe")
        callbacks.append(ours)
    elif a.contender == "copy_hash_every1":
        copy_hash = CopyHash()
        callbacks.append(copy_hash)
    pl.seed_everything(a.seed, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=a.steps, callbacks=callbacks,
                         plugins=plugins or None, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=a.contender.startswith("mc"),
                         limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=a.dir)
    model = _model(a)
    cpu0, wall0 = _rusage_cpu(), time.perf_counter()
    try:
        trainer.fit(model)
    finally:
        fit_wall, fit_cpu = time.perf_counter() - wall0, _rusage_cpu() - cpu0
        shm_left = memory_left(a.mem_job)
        remove_memory(a.mem_job)
    figures: list[dict[str, Any]] = ours.rows if ours is not None else []
    rows = [r for r in figures if r.get("kind", "save") == "save" and r["step"] <= a.steps]
    train_cpu = saves if a.contender.startswith("mc") else [r.get("train_cpu_ms", float("nan")) for r in rows]
    if a.contender.startswith("ours"):
        save_steps = [r["step"] for r in rows]
    elif a.contender == "none":
        save_steps = list(range(a.every, a.steps + 1, a.every))
    elif copy_hash is not None:
        save_steps = list(range(1, len(copy_hash.times) + 1))
        train_cpu = [cpu * 1e3 for _, cpu in copy_hash.times]
    result = {"process_cpu_s": _rusage_cpu(), "process_wall_s": time.perf_counter() - start,
              "fit_cpu_s": fit_cpu, "fit_wall_s": fit_wall, "main_cpu_s": time.thread_time(),
              "threads_cpu_s": _threads_cpu(), "n_ckpt": len(train_cpu), "train_cpu_ms": train_cpu,
              "torch_save": torch_save, "figures": figures, "params": sum(p.numel() for p in model.parameters()),
              "save_steps": save_steps, "marks": marks.marks, "import_cpu_ms": import_cpu * 1e3,
              "end_wall_s": marks.end[0] - wall0, "end_cpu_s": marks.end[1] - cpu0,
              "counters": dict(ours.opened.counters) if ours is not None and ours.opened is not None else {},
              "slow": {k: v for k, v in slow.items() if k in ("writes", "bytes", "slept_s")},
              "shm_left": shm_left, "copy_hash": copy_hash.times if copy_hash is not None else []}
    with open(a.out, "w") as f:
        json.dump(result, f)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description="One Lightning fit under one contender (a benchmark's child).")
    p.add_argument("--contender", choices=CONTENDERS, required=True)
    p.add_argument("--model", choices=("transformer", "mlp"), default="transformer")
    p.add_argument("--out", required=True)
    p.add_argument("--dir", required=True)
    for name, default in (("steps", 120), ("every", 10), ("block", 35), ("threads", 0), ("keep", 3), ("seed", 0),
                          ("slow-at-step", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("disk-mb-s", 50.0), ("budget", 0.0), ("slow-mb-s", 0.0)):
        p.add_argument(f"--{name}", type=float, default=default)
    p.add_argument("--mem-job", default=f"fit-{os.getpid()}", help="the memory level's job name (below SHM_ROOT)")
    _child(p.parse_args(argv))


if __name__ == "__main__":
    main()
