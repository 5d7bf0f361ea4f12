"""The one Lightning job: a fit under one checkpointing contender, and its figures; the rounds of fits.

Used by ``bench_lightning`` and ``bench_overhead`` (CPU, each fit a fresh process) and by
``bench_gpu_lightning`` (one GPU, the fits in its own process), through :func:`run_fit` and :func:`rounds`;
``_fit_figures`` reads the fits. Models: Lightning's demo
Transformer (``LightningTransformer``, 14.6 M parameters, with Adam: ~176 MB of state) on synthetic tokens
cut as the demo's ``WikiText2`` cuts its text; an MLP ``512 -> 2048 -> 2048 -> 10`` with Adam (~63 MB);
``transformers``' GPT-2 (``GPT2LMHeadModel(GPT2Config())``, 124 M parameters, AdamW) on random tokens,
or a 2-layer one (``gpt2-tiny``). Contenders: :data:`CONTENDER` (a slow disk is paced by ``_slow_storage``).

A fit's figures: CPU by ``getrusage`` (imports included), ``fit`` CPU and wall, CPU by thread, per
checkpoint the training thread's CPU, at every step's end the wall time, main-thread and process CPU
(``marks``), and the
device-synchronized start of step :data:`FIRST_TIMED` and end of training.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import resource
import shutil
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
SHM_ROOT = "/dev/shm/ckpt-suite-bench"
"""The memory level's default root: one directory per fit below it, removed after the fit."""
FIRST_TIMED = 5
"""The device-synchronized timing (``timed_start_s``) starts at this step: CUDA and the allocator warm."""
PYCACHE = os.path.join(tempfile.gettempdir(), "ckpt-suite-bench-pycache")
"""The fits' bytecode cache, outside the repository: ours is not charged for compiling ``ckpt_engine``."""
PL = "pytorch_lightning" if importlib.util.find_spec("pytorch_lightning") else "lightning.pytorch"
"""The trainer package the fits use: the standalone distribution where installed, else the unified one."""


@dataclass(frozen=True)
class Contender:
    """How a fit checkpoints: ``label`` (``{disk}`` and ``{every}`` filled from the job), ours or not, with the
    node-memory level in front of the disk, the disk paced to ``FitJob.disk_mb_s``, ``pipeline=True``, or at
    every step whatever ``FitJob.every`` says."""

    label: str
    ours: bool = False
    memory: bool = False
    slow: bool = False
    pipeline: bool = False
    every_step: bool = False


CONTENDER = {
    "none": Contender("no checkpointing"), "mc_sync": Contender("ModelCheckpoint (sync torch.save)"),
    "mc_async": Contender("ModelCheckpoint + AsyncCheckpointIO"), "ours": Contender("ours, pipeline=False", True),
    "ours_pipe": Contender("ours, pipeline=True", True, pipeline=True),
    "ours_memory": Contender("ours, memory + disk, every {every}", True, memory=True),
    "ours_disk50": Contender("ours, {disk} only, every {every}", True, slow=True),
    "ours_mem": Contender("ours, memory + {disk}, every {every}", True, memory=True, slow=True),
    "ours_mem_every1": Contender("ours, memory + {disk}, every step", True, memory=True, slow=True, every_step=True),
    "copy_hash_every1": Contender("copy + xxh3 only, every step (floor)", every_step=True),
    "disk": Contender("disk", True), "memory": Contender("memory", True, memory=True),
    "memory_pipeline": Contender("memory_pipeline", True, memory=True, pipeline=True)}
"""Every contender by name: ``bench_lightning``'s, ``bench_overhead``'s (``ours`` with a budget) and
:data:`GPU_CONTENDERS`."""
DEFAULT_CONTENDERS = ("none", "mc_sync", "mc_async", "ours", "ours_pipe", "ours_memory")
MEMORY_CONTENDERS = ("ours_disk50", "ours_mem", "ours_mem_every1", "copy_hash_every1")
CONTENDERS = DEFAULT_CONTENDERS + MEMORY_CONTENDERS
GPU_CONTENDERS = ("none", "disk", "memory", "memory_pipeline")
"""``bench_gpu_lightning``'s: ours on the local disk, or through the memory level in front of it."""
PEERS = ("mc_sync", "mc_async")
OURS = ("ours", "ours_pipe", "ours_memory")


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
    """Steps between checkpoints of ``contender``: 1 for those at every step, else ``job.every``."""
    return 1 if CONTENDER[contender].every_step else job.every


def label(c: str, job: FitJob) -> str:
    """How the tables name contender ``c``."""
    return CONTENDER[c].label.format(disk=f"{job.disk_mb_s:g} MB/s disk", every=job.every) if c in CONTENDER else c


@dataclass
class FitResult:
    """One fit's figures: CPU and wall of the process and of ``fit``; CPU by thread name (pool threads
    folded into their pool's name); per in-loop checkpoint the training thread's CPU (``train_cpu_ms``)
    at ``save_steps`` (for none: the steps the others checkpoint, a control); ours' ``figures.jsonl`` rows
    and counters; ``marks``: at every step's end (``perf_counter``, main-thread CPU, process CPU);
    ``end_*``: from the start of ``fit`` to the first ``on_train_end`` (before ours' final wait);
    ``shm_left``: what the fit left in its memory directory; ``copy_hash``: the floor's (wall, CPU);
    ``timed_start_s``: the start of step :data:`FIRST_TIMED`, ``drain_s``: ours' ``on_train_end``;
    ``records``: ours' (step, stall ms, bytes) per save; ``buffers``: its snapshot buffers' kinds;
    ``name``: the benchmark's name of the configuration (``contender`` when empty); ``foreign_cores``:
    what other processes used meanwhile."""

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
    foreign_cores: float = float("nan")

    def __post_init__(self) -> None:
        self.name = self.name or self.contender

    @classmethod
    def of(cls, saved: dict[str, Any]) -> "FitResult":
        """A fit from its JSON (keys this class does not know, from older runs, left out)."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})

    @property
    def loop_s(self) -> float:
        """The training loop's wall time, from the first step's end to the last's."""
        return self.marks[-1][0] - self.marks[0][0] if self.marks else float("nan")

    @property
    def background_cpu_s(self) -> float:
        """CPU seconds of the Python threads other than the main one (the checkpoint writers)."""
        return sum(self.threads_cpu_s.values())

    @property
    def own_cpu_s(self) -> float:
        """CPU seconds of the checkpoint work on the threads that ran it, within the fit: the training thread's
        part of each checkpoint and every Python thread but the main one (blind to indirect costs)."""
        return sum(x for x in self.train_cpu_ms if x == x) / 1e3 + self.background_cpu_s

    @property
    def other_cpu_s(self) -> float:
        """Process CPU that is neither the main thread's nor a Python thread's (native threads)."""
        return self.process_cpu_s - self.main_cpu_s - self.background_cpu_s

    def as_json(self) -> dict[str, Any]:
        """The fit as a JSON object."""
        return asdict(self)


def run_fit(job: FitJob, contender: str, workdir: str, rep: int = 0, name: str = "", here: bool = False,
            **kw: Any) -> FitResult:
    """One fit of ``job`` under ``contender`` in ``workdir`` (removed after), in a fresh process or, ``here``,
    in this one (a GPU bench's fits share one CUDA context). ``kw``: ``budget`` (ours with
    ``overhead_budget``), ``slow_at_step`` (ours' disk paced to ``slow_mb_s`` from that step on), ``mem_job``."""
    if contender not in CONTENDER:
        raise ValueError(f"contender must be one of {list(CONTENDER)}, got {contender!r}")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    a = {**asdict(job), "every": every_of(job, contender), "budget": 0.0, "slow_at_step": 0, "slow_mb_s": 0.0,
         "mem_job": f"fit-{os.getpid()}-{contender}-{uuid.uuid4().hex[:8]}", **kw, "contender": contender,
         "dir": workdir, "out": os.path.join(workdir, "result.json")}
    try:
        if here:
            res = _fit(argparse.Namespace(**a))
        else:
            args = [sys.executable, os.path.abspath(__file__), json.dumps(a)]
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            env["PYTHONPYCACHEPREFIX"] = PYCACHE
            done = subprocess.run(args, cwd=workdir, capture_output=True, text=True, env=env)
            if done.returncode != 0 or not os.path.exists(a["out"]):
                raise RuntimeError(f"the {contender} fit failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            with open(a["out"]) as f:
                res = json.load(f)
    finally:  # a fit that died leaves its memory behind: never let it pile up in /dev/shm
        remove_memory(job.shm, a["mem_job"])
        shutil.rmtree(workdir, ignore_errors=True)
    return FitResult(contender=contender, rep=rep, name=name, **res)


def quiet_fit(job: FitJob, contender: str, workdir: str, quiet: float, retry: bool = False, **kw: Any) -> FitResult:
    """:func:`run_fit` after waiting (a little) for other processes to use at most ``quiet`` cores; with
    the cores they used during the fit. ``retry``: a disturbed fit runs once more, the quieter one kept."""
    from _common import CpuLoad, wait_quiet

    best: FitResult | None = None
    for _ in range(2 if retry else 1):
        wait_quiet(quiet, max_wait=10.0)
        load = CpuLoad()
        r = run_fit(job, contender, workdir, **kw)
        r.foreign_cores = load.foreign_cores()
        print(f"  {r.name:14s} round {r.rep}: process CPU {r.process_cpu_s:6.2f} s, fit wall {r.fit_wall_s:6.2f} s, "
              f"loop {r.loop_s:6.2f} s, {r.n_ckpt} checkpoints, foreign load {r.foreign_cores:.2f} cores"
              + (f", LEFT IN /dev/shm: {len(r.shm_left)}" if r.shm_left else ""), flush=True)
        best = r if best is None or r.foreign_cores < best.foreign_cores else best
        if best.foreign_cores <= quiet:
            break
    assert best is not None
    return best


def rounds(job: FitJob, names: list[str], n: int, workdir: str, quiet: float = 0.3, retry: bool = False,
           configs: dict[str, dict[str, Any]] | None = None) -> list[FitResult]:
    """``n`` rounds of one fit per configuration in ``names``, the order rotating by round so that no
    configuration always runs first or after the same one, after unmeasured warm-up fits; ``configs``: per name,
    the contender and the arguments of :func:`run_fit` (default: the name is the contender)."""
    from _plain_job import rotated

    configs = configs or {}
    memory = any(CONTENDER[configs.get(c, {}).get("contender", c)].memory for c in names)
    for contender in ("mc_async", "ours") + (("ours_mem",) if memory else ()):  # imports, compiled into PYCACHE
        run_fit(FitJob(**{**asdict(job), "steps": 2 * job.every}), contender, workdir)
    fits = []
    for rnd in range(n):
        for c in rotated(names, rnd + 1):
            kw = {"contender": c, **configs.get(c, {})}
            fits.append(quiet_fit(kw.pop("job", job), kw.pop("contender"), workdir, quiet, retry, rep=rnd, name=c,
                                  **kw))
    return fits


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

    class Module(pl.LightningModule):
        """A model, the loss of a batch, AdamW or Adam (lr 1e-4), and its data shuffled into batches."""

        def __init__(self, net: Any, loss: Any, data: Any, batch: int, adamw: bool = False) -> None:
            super().__init__()
            self.net, self.loss, self.data, self.batch, self.adamw = net, loss, data, batch, adamw

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.loss(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return (torch.optim.AdamW if self.adamw else torch.optim.Adam)(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=self.batch, shuffle=True, drop_last=True)

    if a.model == "transformer":
        return DemoTransformer(vocab_size=VOCAB)
    g = torch.Generator().manual_seed(a.seed if a.model == "mlp" else 1)
    if a.model == "mlp":  # 512 -> 2048 -> 2048 -> 10 with Adam, 6400 samples in batches of 64
        net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                  torch.nn.ReLU(), torch.nn.Linear(2048, 10))
        data = TensorDataset(torch.randn(6400, 512, generator=g), torch.randint(0, 10, (6400,), generator=g))
        return Module(net, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), data, 64)
    from transformers import GPT2Config, GPT2LMHeadModel

    tiny = a.model == "gpt2-tiny"
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64) if tiny else GPT2Config()
    batch, seq = (4, 64) if tiny else (16, 1024)
    data = TensorDataset(torch.randint(0, config.vocab_size, (a.steps * batch, seq), generator=g))
    return Module(GPT2LMHeadModel(config), lambda m, b: m(input_ids=b[0], labels=b[0]).loss, data, batch, True)


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
    c = CONTENDER[a.contender]
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
    elif c.ours:
        import_cpu, ours = _ours(a, c, ckdir, callbacks)
    elif c.every_step:
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


def _ours(a: argparse.Namespace, c: Contender, ckdir: str, callbacks: list[Any]) -> tuple[float, Any]:
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
    if c.slow or a.slow_at_step:
        from _slow_storage import SLOW, SlowStorage, throttle

        if a.slow_at_step:  # the disk slows down from that step on
            callbacks.append(importlib.import_module(PL).callbacks.LambdaCallback(
                on_train_batch_end=lambda trainer, *_: None if SLOW["on"] or trainer.global_step < a.slow_at_step
                else throttle(a.slow_mb_s)))
        else:
            throttle(a.disk_mb_s)
        disk = SlowStorage(ckdir)
    where = {"levels": [{"kind": "memory", "path": a.shm, "job": a.mem_job}, disk]} if c.memory \
        else {"dirpath": disk}
    schedule = {"overhead_budget": a.budget} if a.budget else {"every_n_train_steps": a.every}
    ours = Recorded(**where, **schedule, keep_last=a.keep, pipeline=c.pipeline)
    callbacks.append(ours)
    return import_cpu, ours


def main(argv: Optional[list[str]] = None) -> None:
    """A benchmark's child: one fit, its arguments (those of :func:`run_fit`) one JSON object in ``argv``."""
    a = argparse.Namespace(**json.loads((argv or sys.argv[1:])[0]))
    _count_thread_cpu()
    result = _fit(a)
    with open(a.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
