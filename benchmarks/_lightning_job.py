"""The one Lightning job: a fit under one checkpointing contender, and its figures.

Used by ``bench_lightning`` and ``bench_overhead`` (CPU, each fit a fresh process: :func:`run_fit`) and
by ``bench_gpu_lightning`` (one GPU, the fits in its own process: :func:`fit`). Models: Lightning's demo
Transformer (``LightningTransformer``, 14.6 M parameters, with Adam: ~176 MB of state) on synthetic tokens
cut as the demo's ``WikiText2`` cuts its text; an MLP ``512 -> 2048 -> 2048 -> 10`` with Adam (~63 MB);
``transformers``' GPT-2 (``GPT2LMHeadModel(GPT2Config())``, 124 M parameters, AdamW) on random tokens,
or a 2-layer one (``gpt2-tiny``). Contenders: :data:`CONTENDERS` (the memory ones on a disk paced by
``_slow_storage``) and :data:`GPU_CONTENDERS`.

A fit's figures: CPU by ``getrusage`` (imports included), ``fit`` CPU and wall, CPU by thread, per
checkpoint the training thread's CPU, at every step's end the wall time, main-thread and process CPU
(``marks``, from which :func:`local_costs` and :func:`drift_corrected` take their figures), and the
device-synchronized start of step :data:`FIRST_TIMED` and end of training.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

VOCAB = 33278
"""The demo's default vocabulary (WikiText-2's)."""
DEFAULT_CONTENDERS = ("none", "mc_sync", "mc_async", "ours", "ours_pipe")
MEMORY_CONTENDERS = ("ours_disk50", "ours_mem", "ours_mem_every1", "copy_hash_every1")
CONTENDERS = DEFAULT_CONTENDERS + MEMORY_CONTENDERS
GPU_CONTENDERS = ("none", "disk", "memory", "memory_pipeline")
"""``bench_gpu_lightning``'s: ours on the local disk, or through the memory level in front of it."""
PEERS = ("mc_sync", "mc_async")
OURS = ("ours", "ours_pipe")
SLOW_DISK = ("ours_disk50", "ours_mem", "ours_mem_every1")
MEMORY_LEVEL = ("ours_mem", "ours_mem_every1", "memory", "memory_pipeline")
PIPELINE = ("ours_pipe", "memory_pipeline")
EVERY_STEP = ("ours_mem_every1", "copy_hash_every1")
"""The contenders that checkpoint (or copy and hash) at every step, whatever ``every`` says."""
SHM_ROOT = "/dev/shm/ckpt-suite-bench"
"""The memory level's default root: one directory per fit below it, removed after the fit."""
FIRST_TIMED = 5
"""The device-synchronized timing (``timed_start_s``) starts at this step: CUDA and the allocator warm."""
TARGET_VS_PEER = 1 / 3
"""Target: our overhead at most a third of the best peer's at the same interval."""
LABELS = {"none": "no checkpointing", "mc_sync": "ModelCheckpoint (sync torch.save)",
          "mc_async": "ModelCheckpoint + AsyncCheckpointIO", "ours": "ours, pipeline=False",
          "ours_pipe": "ours, pipeline=True"}
PYCACHE = os.path.join(tempfile.gettempdir(), "ckpt-suite-bench-pycache")
"""The fits' bytecode cache, outside the repository: ours is not charged for compiling ``ckpt_engine``."""
PL = "pytorch_lightning" if importlib.util.find_spec("pytorch_lightning") else "lightning.pytorch"
"""The trainer package the fits use: the standalone distribution where installed, else the unified one."""


@dataclass(frozen=True)
class FitJob:
    """The fit: ``steps`` optimizer steps of ``model``, a checkpoint every ``every`` steps; ``block`` tokens
    per sample; ``threads``: ``torch.set_num_threads`` (0: torch's default); ``disk_mb_s``: the slow disk;
    ``device``, ``precision``: the ``Trainer``'s; ``shm``: the memory level's root."""

    model: str = "transformer"
    steps: int = 120
    every: int = 10
    block: int = 35
    threads: int = 0
    keep: int = 3
    seed: int = 0
    disk_mb_s: float = 50.0
    device: str = "cpu"
    precision: str = "32-true"
    shm: str = SHM_ROOT


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
    """One fit's figures: CPU and wall of the process and of ``fit``; CPU by thread name (pool threads
    folded into their pool's name); per in-loop checkpoint the training thread's CPU (``train_cpu_ms``)
    at ``save_steps`` (for none: the steps the others checkpoint, a control); ours' ``figures.jsonl`` rows
    and counters; ``marks``: at every step's end (``perf_counter``, main-thread CPU, process CPU);
    ``end_*``: from the start of ``fit`` to the first ``on_train_end`` (before ours' final wait);
    ``shm_left``: what the fit left in its memory directory; ``copy_hash``: the floor's (wall, CPU);
    ``timed_start_s``: the start of step :data:`FIRST_TIMED`, ``drain_s``: ours' ``on_train_end``;
    ``records``: ours' (step, stall ms, bytes) per save; ``buffers``: its snapshot buffers' kinds."""

    contender: str
    rep: int
    process_cpu_s: float
    process_wall_s: float
    fit_cpu_s: float
    fit_wall_s: float
    main_cpu_s: float
    threads_cpu_s: dict[str, float]
    n_ckpt: int
    train_cpu_ms: list[float]
    figures: list[dict[str, Any]] = field(default_factory=list)
    params: int = 0
    save_steps: list[int] = field(default_factory=list)
    marks: list[tuple[float, float, float]] = field(default_factory=list)
    import_cpu_ms: float = 0.0
    end_wall_s: float = float("nan")
    end_cpu_s: float = float("nan")
    counters: dict[str, float] = field(default_factory=dict)
    shm_left: list[str] = field(default_factory=list)
    copy_hash: list[tuple[float, float]] = field(default_factory=list)
    timed_start_s: float = float("nan")
    drain_s: float = 0.0
    records: list[tuple[int, float, int]] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    allocations: int = 0
    name: str = ""
    """The benchmark's name of the configuration (``contender`` when empty)."""

    @classmethod
    def of(cls, saved: dict[str, Any]) -> "FitResult":
        """A fit from its JSON (keys this class does not know, from older runs, left out)."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})

    @property
    def loop_s(self) -> float:
        """The training loop's wall time, from the first step's end to the last's."""
        return self.marks[-1][0] - self.marks[0][0] if self.marks else float("nan")

    @property
    def other_cpu_s(self) -> float:
        """Process CPU that is neither the main thread's nor a Python thread's (native threads)."""
        return self.process_cpu_s - self.main_cpu_s - sum(self.threads_cpu_s.values())

    def as_json(self) -> dict[str, Any]:
        """The fit as a JSON object."""
        return asdict(self)


def _job_args(job: FitJob, contender: str, workdir: str, **kw: Any) -> dict[str, Any]:
    """The child's arguments of one fit (``kw``: ``budget``, ``slow_at_step``, ``slow_mb_s``, ``mem_job``)."""
    if contender not in CONTENDERS + GPU_CONTENDERS:
        raise ValueError(f"contender must be one of {CONTENDERS + GPU_CONTENDERS}, got {contender!r}")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    return {**asdict(job), "every": every_of(job, contender), "budget": 0.0, "slow_at_step": 0, "slow_mb_s": 0.0,
            "mem_job": f"fit-{os.getpid()}-{contender}-{uuid.uuid4().hex[:8]}", **kw, "contender": contender,
            "dir": workdir, "out": os.path.join(workdir, "result.json")}


def run_fit(job: FitJob, contender: str, workdir: str, rep: int = 0, name: str = "", **kw: Any) -> FitResult:
    """One fit of ``job`` under ``contender`` in a fresh process and ``workdir`` (removed after). ``budget``:
    ours with ``overhead_budget``; ``slow_at_step``: ours' disk paced to ``slow_mb_s`` from that step on."""
    a = _job_args(job, contender, workdir, **kw)
    args = [sys.executable, os.path.abspath(__file__), *(x for k, v in a.items() for x in (f"--{k.replace('_', '-')}",
                                                                                            str(v)))]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPYCACHEPREFIX": PYCACHE}
    try:
        done = subprocess.run(args, cwd=workdir, capture_output=True, text=True, env=env)
    finally:  # a fit that died leaves its memory behind: never let it pile up in /dev/shm
        remove_memory(job.shm, a["mem_job"])
    if done.returncode != 0 or not os.path.exists(a["out"]):
        raise RuntimeError(f"the {contender} fit failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    with open(a["out"]) as f:
        res = json.load(f)
    shutil.rmtree(workdir, ignore_errors=True)
    return FitResult(contender=contender, rep=rep, name=name or contender, **res)


def fit(job: FitJob, contender: str, workdir: str, rep: int = 0, **kw: Any) -> FitResult:
    """:func:`run_fit` in this process (a GPU bench's: its fits share one CUDA context)."""
    a = argparse.Namespace(**_job_args(job, contender, workdir, **kw))
    try:
        res = _fit(a)
    finally:
        remove_memory(job.shm, a.mem_job)
        shutil.rmtree(workdir, ignore_errors=True)
    return FitResult(contender=contender, rep=rep, name=contender, **res)


def quiet_fit(job: FitJob, contender: str, workdir: str, quiet: float, retry: bool = False,
              **kw: Any) -> tuple[FitResult, float]:
    """:func:`run_fit` after waiting (a little) for other processes to use at most ``quiet`` cores; with
    the cores they used during the fit. ``retry``: a disturbed fit runs once more, the quieter one kept."""
    from _common import CpuLoad, wait_quiet

    best: tuple[FitResult, float] | None = None
    for _ in range(2 if retry else 1):
        wait_quiet(quiet, max_wait=10.0)
        load = CpuLoad()
        r = run_fit(job, contender, workdir, **kw)
        foreign = load.foreign_cores()
        print(f"  {kw.get('name') or contender:14s} round {kw.get('rep', 0)}: process CPU {r.process_cpu_s:6.2f} s, "
              f"fit wall {r.fit_wall_s:6.2f} s, loop {r.loop_s:6.2f} s, {r.n_ckpt} checkpoints, foreign load "
              f"{foreign:.2f} cores" + (f", LEFT IN /dev/shm: {len(r.shm_left)}" if r.shm_left else ""), flush=True)
        if best is None or foreign < best[1]:
            best = (r, foreign)
        if best[1] <= quiet:
            break
    assert best is not None
    return best


def warm_up(job: FitJob, workdir: str, memory: bool = False) -> None:
    """Unmeasured short fits that import (and compile into :data:`PYCACHE`) what the contenders import."""
    for contender in ("mc_async", "ours") + (("ours_mem",) if memory else ()):
        run_fit(FitJob(**{**asdict(job), "steps": 2 * job.every}), contender, workdir)


def remove_memory(root: str, mem_job: str) -> list[str]:
    """Remove the memory directory of ``mem_job`` below ``root`` (and ``root``, once empty); return the files
    it held (``["(empty directories)"]`` if only those)."""
    top = os.path.join(root, mem_job)
    left = sorted(os.path.relpath(os.path.join(d, f), top) for d, _, names in os.walk(top) for f in names)
    left = left or (["(empty directories)"] if os.path.isdir(top) else [])
    shutil.rmtree(top, ignore_errors=True)
    try:
        os.rmdir(root)
    except OSError:
        pass
    return left


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
    """The fit's clean step: the median over the steps late in an interval between checkpoints (phase >
    ``tail``); every step after the fifth for a fit without checkpoints."""
    dx, saves, late = step_deltas(r, i), sorted(r.save_steps), []
    for a, b in zip(saves, saves[1:]):
        late += [dx[j] for j in range(a + 1, b + 1) if j in dx and (j - a) / (b - a) > tail]
    return median(late if r.n_ckpt and late else [dx[j] for j in sorted(dx)[4:]])


def drift_corrected(r: FitResult, base: FitResult, i: int = 0, total: str = "end_wall_s") -> float:
    """Overhead with each fit in its own clean steps: ``total`` ÷ (steps × clean step), minus the same of
    the no-checkpointing fit of its round (not fooled by whole fits running faster or slower)."""
    def steps(f: FitResult) -> int:  # the loop (``loop_s``) starts at the first step's end
        return len(f.marks) - (total == "loop_s")

    own = getattr(r, total) / (steps(r) * clean_step(r, i))
    return own - getattr(base, total) / (steps(base) * clean_step(base, i))


def local_costs(r: FitResult, window: int, i: int = 0, tail: float = 0.7) -> list[float]:
    """Seconds each in-loop checkpoint cost in mark ``i``: the excess of the ``window`` steps after it (cut
    at the next checkpoint) over the median of the late steps of the interval before it; a checkpoint
    without either is left out. For ``none``: the same windows at the same steps (a control: ~0)."""
    dx, saves, out = step_deltas(r, i), sorted(r.save_steps), []
    for k, s in enumerate(saves):
        prev = saves[k - 1] if k else s - window
        stop = min(s + window, saves[k + 1] if k + 1 < len(saves) else s + window)
        before = [dx[j] for j in range(max(2, prev + 1), s + 1) if j in dx and (j - prev) / (s - prev) > tail]
        if before and stop in dx:
            base = statistics.median(before)
            out.append(sum(dx[j] - base for j in range(s + 1, stop + 1)))
    return out


# ---- the fit ------------------------------------------------------------------------------------------
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
    out, tick = dict(_ENDED), os.sysconf("SC_CLK_TCK")
    for t in threading.enumerate():
        if t is threading.current_thread() or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[_pool_name(t.name)] = out.get(_pool_name(t.name), 0.0) + (int(stat[11]) + int(stat[12])) / tick
    return out


def _rusage_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _sync() -> None:
    """Wait for the device (nothing without CUDA)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _model(a: argparse.Namespace) -> Any:
    """The fit's LightningModule: the demo Transformer with Adam and synthetic tokens, the MLP, or GPT-2."""
    import torch
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    pl = importlib.import_module(PL)

    class SyntheticTokens(Dataset):
        def __init__(self, samples: int, block: int, seed: int) -> None:
            self.data = torch.randint(0, VOCAB, (samples * block + 1,), generator=torch.Generator().manual_seed(seed))
            self.block = block

        def __len__(self) -> int:
            return (len(self.data) - 1) // self.block

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            start = index * self.block
            return self.data[start:start + self.block], self.data[start + 1:start + self.block + 1]

    class DemoTransformer(importlib.import_module(f"{PL}.demos.transformer").LightningTransformer):
        def prepare_data(self) -> None:  # no download
            pass

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.model.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(SyntheticTokens(a.steps + 1, a.block, a.seed))

    class MLP(pl.LightningModule):
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

    class GPT2(pl.LightningModule):
        def __init__(self) -> None:
            from transformers import GPT2Config, GPT2LMHeadModel

            super().__init__()
            tiny = a.model == "gpt2-tiny"
            self.config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64) if tiny \
                else GPT2Config()
            self.batch, self.seq = (4, 64) if tiny else (16, 1024)
            self.model = GPT2LMHeadModel(self.config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            return self.model(input_ids=tokens, labels=tokens).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, self.config.vocab_size, (a.steps * self.batch, self.seq), generator=g)
            return DataLoader(TensorDataset(tokens), batch_size=self.batch, shuffle=True)

    return {"transformer": lambda: DemoTransformer(vocab_size=VOCAB), "mlp": MLP}.get(a.model, GPT2)()


def _fit(a: argparse.Namespace) -> dict[str, Any]:
    """One fit under ``a.contender``; its figures (the fields of :class:`FitResult` but the first two)."""
    start = time.perf_counter()
    import logging
    import warnings

    import torch

    pl = importlib.import_module(PL)
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class Marks(pl.Callback):
        """First callback: the time and CPU at every step's end, the synchronized start of step
        :data:`FIRST_TIMED`, and when training ends (before the other callbacks' ``on_train_end``, so
        before ours waits for its last checkpoint)."""

        def __init__(self) -> None:
            self.marks: list[tuple[float, float, float]] = []
            self.end, self.start = (float("nan"), float("nan")), float("nan")

        def on_train_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            if trainer.global_step == FIRST_TIMED:
                _sync()
                self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            self.marks.append((time.perf_counter(), time.thread_time(), _rusage_cpu()))

        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            _sync()
            self.end = (time.perf_counter(), _rusage_cpu())

    class CopyHash(pl.Callback):
        """At every step's end: the state's tensors copied into one preallocated byte buffer, then xxh3
        over it, on the training thread (the floor of a checkpoint at every step)."""

        def __init__(self) -> None:
            import xxhash

            self.hash, self.buffer, self.times = xxhash.xxh3_64_intdigest, None, []

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
    ckdir, marks = os.path.join(a.dir, "ckpt"), Marks()
    callbacks: list[Any] = [marks]
    plugins: list[Any] = []
    ours: Any = None
    copy_hash: Any = None
    import_cpu, saves, save_steps = 0.0, [], []
    if a.contender.startswith("mc"):
        class TimedModelCheckpoint(pl.callbacks.ModelCheckpoint):
            def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
                save_steps.append(trainer.global_step)
                cpu = time.thread_time()
                super()._save_checkpoint(trainer, filepath)
                saves.append((time.thread_time() - cpu) * 1e3)

        callbacks.append(TimedModelCheckpoint(dirpath=ckdir, every_n_train_steps=a.every, monitor="step",
                                              mode="max", save_top_k=a.keep))
        if a.contender == "mc_async":
            plugins.append(importlib.import_module(f"{PL}.plugins.io").AsyncCheckpointIO())
    elif a.contender not in ("none", "copy_hash_every1"):
        import_cpu, ours = _ours(a, ckdir, callbacks)
    elif a.contender == "copy_hash_every1":
        copy_hash = CopyHash()
        callbacks.append(copy_hash)
    pl.seed_everything(a.seed, verbose=False)
    trainer = pl.Trainer(accelerator=a.device, devices=1, precision=a.precision, max_steps=a.steps,
                         callbacks=callbacks, plugins=plugins or None, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=a.contender.startswith("mc"),
                         limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=a.dir)
    model = _model(a)
    cpu0, wall0 = _rusage_cpu(), time.perf_counter()
    try:
        trainer.fit(model)
    finally:
        _sync()
        fit_wall, fit_cpu = time.perf_counter() - wall0, _rusage_cpu() - cpu0
        shm_left = remove_memory(a.shm, a.mem_job)
    figures: list[dict[str, Any]] = ours.rows if ours is not None else []
    rows = [r for r in figures if r.get("kind", "save") == "save" and r["step"] <= a.steps]
    train_cpu = saves if a.contender.startswith("mc") else [r.get("train_cpu_ms", float("nan")) for r in rows]
    if ours is not None:
        save_steps = [r["step"] for r in rows]
    elif a.contender == "none":
        save_steps = list(range(a.every, a.steps + 1, a.every))
    elif copy_hash is not None:
        save_steps = list(range(1, len(copy_hash.times) + 1))
        train_cpu = [cpu * 1e3 for _, cpu in copy_hash.times]
    ck = ours.opened if ours is not None else None
    return {"process_cpu_s": _rusage_cpu(), "process_wall_s": time.perf_counter() - start,
            "fit_cpu_s": fit_cpu, "fit_wall_s": fit_wall, "main_cpu_s": time.thread_time(),
            "threads_cpu_s": _threads_cpu(), "n_ckpt": len(train_cpu), "train_cpu_ms": train_cpu,
            "figures": figures, "params": sum(p.numel() for p in model.parameters()),
            "save_steps": save_steps, "marks": marks.marks, "import_cpu_ms": import_cpu * 1e3,
            "end_wall_s": marks.end[0] - wall0, "end_cpu_s": marks.end[1] - cpu0,
            "counters": dict(ck.counters) if ck is not None else {}, "shm_left": shm_left,
            "copy_hash": copy_hash.times if copy_hash is not None else [], "timed_start_s": marks.start - wall0,
            "drain_s": ours.ended - marks.end[0] if ours is not None else 0.0,
            "records": [(r.step, r.stall_s * 1e3, r.bytes) for r in ck.records] if ck is not None else [],
            "buffers": ours.buffers if ours is not None else [],
            "allocations": ck._pool.allocations if ck is not None else 0}


def _ours(a: argparse.Namespace, ckdir: str, callbacks: list[Any]) -> tuple[float, Any]:
    """The CPU seconds of importing ours, and our callback as ``a.contender`` configures it, appended to
    ``callbacks`` (a pacer before it)."""
    cpu = _rusage_cpu()
    from lightning_ckpt import AsyncShardedCheckpoint
    import_cpu = _rusage_cpu() - cpu

    class Recorded(AsyncShardedCheckpoint):
        """Ours, keeping the figure rows it reports (a memory level's ``figures.jsonl`` goes with its
        directory at close), its checkpointer (for the counters after the fit), the kinds of its snapshot
        buffers at the last step but one, and when its ``on_train_end`` (the drain) ended."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rows: list[dict[str, Any]] = []
            self.opened: Any = None
            self.buffers: list[str] = []
            self.ended = float("nan")

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            super().setup(trainer, pl_module, stage)
            self.opened = self.session.ck

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            super().on_train_batch_end(trainer, *args, **kwargs)
            if trainer.global_step == trainer.max_steps - 1:
                self.buffers = sorted({f"{type(b).__name__}{' pinned' if b.pinned else ''}"
                                       for b in self.opened._pool._free})

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            super().on_train_end(trainer, pl_module)
            self.ended = time.perf_counter()

        def _log_figures(self, row: dict[str, Any]) -> None:
            self.rows.append(dict(row))
            super()._log_figures(row)

    disk: Any = ckdir
    if a.contender in SLOW_DISK or a.slow_at_step:
        from _slow_storage import SLOW, SlowStorage, throttle

        if a.slow_at_step:  # the disk slows down from that step on
            callbacks.append(importlib.import_module(PL).callbacks.LambdaCallback(
                on_train_batch_end=lambda trainer, *_: None if SLOW["on"] or trainer.global_step < a.slow_at_step
                else throttle(a.slow_mb_s)))
        else:
            throttle(a.disk_mb_s)
        disk = SlowStorage(ckdir)
    where = {"levels": [{"kind": "memory", "path": a.shm, "job": a.mem_job}, disk]} if a.contender in MEMORY_LEVEL \
        else {"dirpath": disk}
    schedule = {"overhead_budget": a.budget} if a.budget else {"every_n_train_steps": a.every}
    ours = Recorded(**where, **schedule, keep_last=a.keep, pipeline=a.contender in PIPELINE)
    callbacks.append(ours)
    return import_cpu, ours


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description="One Lightning fit under one contender (a benchmark's child).")
    p.add_argument("--contender", choices=CONTENDERS + GPU_CONTENDERS, required=True)
    for name, kind in (("out", str), ("dir", str), ("mem-job", str), ("model", str), ("device", str),
                       ("precision", str), ("shm", str), ("steps", int), ("every", int), ("block", int),
                       ("threads", int), ("keep", int), ("seed", int), ("slow-at-step", int), ("disk-mb-s", float),
                       ("budget", float), ("slow-mb-s", float)):
        p.add_argument(f"--{name}", type=kind, required=True)
    a = p.parse_args(argv)
    _count_thread_cpu()
    result = _fit(a)
    with open(a.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
