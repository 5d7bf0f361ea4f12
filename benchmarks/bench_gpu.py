"""The CUDA path on one GPU: snapshot stall, GPU-side delay, persist, and training overhead.

Per state size on the GPU, each contender's ``stall``, ``mutable``, ``gpu_delay`` (less a ``control``
without a save in the same repetition) and ``durable``, against a device-to-host ``copy_`` into pinned
memory and a raw write of it; then a GPT-2-small-sized model (``_plain_job``) trained with ours and DCP
``async_save``. The method, peers and targets: ``benchmarks/README.md``, section bench_gpu. ``--tiny``:
a few MiB and a 2-layer model, on CPU without CUDA (tests/test_gpu.py).

    PYTHONPATH=. python3 benchmarks/bench_gpu.py --sizes-gib 1 4 16 --out benchmarks/out
    PYTHONPATH=. python3 benchmarks/bench_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import _peers  # noqa: E402
from _peers import Staged  # noqa: E402
from _common import best_of, gbps, parser, saved_bytes, state_bytes, table, timed, write_fsync  # noqa: E402
from _plain_job import GPT, train  # noqa: E402

from ckpt_engine import Checkpointer  # noqa: E402
from ckpt_engine.config import CheckpointConfig  # noqa: E402
from ckpt_engine.state.values import encode  # noqa: E402
from ckpt_engine.training.policy import EveryNSteps, Policy  # noqa: E402
from ckpt_engine.training.schedule import Schedule  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
warnings.filterwarnings("ignore")
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def free_memory() -> None:
    """Collect garbage and hand the device's and the pinned host cache back."""
    gc.collect()
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None) or getattr(torch.cuda.memory, "empty_host_cache", None)
        if empty_host is not None:
            empty_host()


# ---- the state and the GPU probe ---------------------------------------------------------------------
def make_state(nbytes: int) -> dict[str, Any]:
    """~``nbytes`` on DEV: 85 % float32 matrices, 10 % bf16, 2 % one transposed tensor, 200 small ones."""
    g = torch.Generator(device=DEV).manual_seed(0)
    cols = 4096 if nbytes >= 256 * MiB else 256
    model: dict[str, Any] = {}
    big = int(nbytes * 0.85) // (4 * cols * 48)
    for i in range(48):
        model[f"layer{i}.weight"] = torch.rand(big, cols, generator=g, device=DEV)
    half = int(nbytes * 0.10) // (2 * cols * 8)
    for i in range(8):
        model[f"emb{i}.weight"] = torch.rand(half, cols, generator=g, device=DEV).bfloat16()
    model["proj.weight_t"] = torch.rand(int(nbytes * 0.02) // (4 * cols), cols, generator=g, device=DEV).t()
    for i in range(200):
        model[f"layer{i % 48}.norm{i // 48}"] = torch.rand(256 + 64 * i, generator=g, device=DEV)
    return {"model": model, "optimizer": {"step": 1234, "lr": 3e-4}, "empty": torch.empty(0, device=DEV)}


class Timeline:
    """CUDA events on the training stream (none without CUDA), the first recorded when made: a probe run's
    start, the end of its workload, and the mark recorded once the host was told the state may be mutated
    (when the next optimizer step could run on the GPU)."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.mark()

    def mark(self) -> None:
        """Record the next event."""
        if CUDA:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()

    def since(self, i: int) -> float:
        """Seconds from the first event to event ``i``; NaN where there is none."""
        if len(self.events) <= i:
            return float("nan")
        self.events[i].synchronize()
        return self.events[0].elapsed_time(self.events[i]) / 1e3


def device_s(fn: Callable[[], Any]) -> float:
    """Seconds the kernels ``fn`` queues take on the device, from an idle one (CUDA events)."""
    sync()
    tl = Timeline()
    fn()
    tl.mark()
    return tl.since(1)


class GpuProbe:
    """Times a fixed workload queued behind a spin kernel, with or without a save in between."""

    def __init__(self, tiny: bool) -> None:
        n = 256 if tiny or not CUDA else 8192
        self.a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
        self.reps = 4 if tiny or not CUDA else 36
        self.cycles = 0
        if CUDA:
            torch.cuda._sleep(1000)
            spin_ms = 1e3 * device_s(lambda: torch.cuda._sleep(10_000_000))
            self.cycles = int(10_000_000 * 10.0 / max(spin_ms, 1e-3))  # a 10 ms spin
        self.workload_s = device_s(self.workload) if CUDA else float("nan")
        self.base_s = statistics.median(self.base()[0] for _ in range(3)) if CUDA else float("nan")

    def workload(self) -> None:
        for _ in range(self.reps):
            self.a @ self.a

    @contextlib.contextmanager
    def run(self) -> Iterator[Timeline]:
        """Spin, the body of the ``with``, workload: their timeline."""
        if not CUDA:  # no device to overlap with: the workload would only add host time
            yield Timeline()
            return
        sync()
        tl = Timeline()
        torch.cuda._sleep(self.cycles)
        yield tl
        self.workload()
        tl.mark()

    def base(self) -> tuple[float, float]:
        """(spin + workload, the same with a mark after it), no save: the reference of this repetition."""
        with self.run() as tl:
            pass
        tl.mark()
        return tl.since(1), tl.since(2)

    def control(self) -> float:
        """The sequence with no save in it: its "delay" is the figure's own bias in this repetition (the
        reference is a separate spin + workload run just before, and the GPU's clocks move: ±3-5 ms per
        pair and a few ms of bias that changes between runs on an H200)."""
        base_fwd, _ = self.base()
        with self.run() as tl:
            pass
        return tl.since(1) - base_fwd


# ---- physical limits ----------------------------------------------------------------------------------
def limits(nbytes: int, workdir: str, reps: int, buffered: bool) -> dict[str, float]:
    """The fastest device-to-host ``copy_`` of ``nbytes`` into pinned memory, and :func:`raw_write` of it."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    src.random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=CUDA)
    dst.fill_(0)  # first touch outside the timing
    d2h = best_of(reps, lambda: (dst.copy_(src, non_blocking=True), sync()), before=sync)
    out = {"d2h_s": d2h, "d2h_gbps": gbps(nbytes, d2h), **raw_write(dst, workdir, reps, buffered)}
    src = dst = None  # drop the references before free_memory() (not del: the lambda above reads them)
    free_memory()
    return out


def raw_write(host: torch.Tensor, workdir: str, reps: int, buffered: bool) -> dict[str, float]:
    """The fastest of ``reps - 1`` raw writes + ``fsync`` of the bytes of ``host`` (a flat uint8 tensor)
    into ``workdir``: ``O_DIRECT`` when ``host`` is page-aligned, also through the page cache with
    ``buffered`` (``raw_direct_s``, ``raw_buffered_s``); ``raw_write_s`` and ``raw_write_gbps`` the best."""
    out: dict[str, float] = {}
    view, path = memoryview(host.numpy()), os.path.join(workdir, "raw.bin")
    kinds = [("direct", True)] if host.data_ptr() % 4096 == 0 and hasattr(os, "O_DIRECT") else []
    for kind, direct in kinds + ([("buffered", False)] if buffered or not kinds else []):
        try:
            out[f"raw_{kind}_s"] = best_of(max(1, reps - 1), lambda: write_fsync(path, [view], direct=direct),
                                           before=lambda: os.path.exists(path) and os.unlink(path))
        except OSError as e:  # a filesystem that refuses O_DIRECT
            out[f"raw_{kind}_error"] = str(e)
    if os.path.exists(path):
        os.unlink(path)
    raw = min(v for k, v in out.items() if k.startswith("raw_") and k.endswith("_s"))
    out["raw_write_s"], out["raw_write_gbps"] = raw, gbps(host.numel(), raw)
    return out


# ---- contenders: one interface for the saves per size and the training runs --------------------------
class Contender:
    """A checkpointer under test, made by ``Contender(state, root)``: :meth:`save` starts a save and returns
    what waits until the state may change; :meth:`durable` waits until the last save is durable (``pending``)
    and returns its own figures; :meth:`after`, untimed, waits for what it left running that is no part of a
    save; :meth:`close` drains and releases it. In a training run it saves when :meth:`schedule` says (a peer:
    every ``policy.n`` steps) and adds :meth:`run_figures` once closed."""

    pending: Staged = None

    def save(self, state: Any, step: int) -> Staged:
        raise NotImplementedError

    def durable(self) -> dict[str, Any]:
        done, self.pending = self.pending, None
        if done is not None:
            done()
        return {}

    def after(self) -> None:
        pass

    def close(self) -> None:
        self.durable()

    def schedule(self, policy: Policy) -> tuple[Callable[[int], bool], Callable[[int], None]]:
        return (lambda step: step % policy.n == 0), (lambda step: None)

    def run_figures(self) -> dict[str, Any]:
        return {}


class Ours(Contender):
    """Ours, ``keep_last=1``, its buffers reserved first (``setup_s``); ``defer``: the copy beside the next
    forward/backward, waited for before the optimizer step (as the front ends' ``pipeline=True``)."""

    def __init__(self, state: Any, root: str, defer: bool = False) -> None:
        self.ck, self.defer = Checkpointer(root, keep_last=1), defer
        self.setup_s = timed(lambda: self.ck.reserve(state))[0]

    def save(self, state: Any, step: int) -> Staged:
        handle = self.ck.save(state, step, defer=self.defer)
        return handle.wait_snapshot if self.defer else None

    def durable(self) -> dict[str, Any]:
        self.ck.wait()
        r = self.ck.records[-1]
        return {"write_s": r.persist_s, "commit_s": r.commit_s, "queue_s": r.snapshot_s,
                "allocations": self.ck._pool.allocations, "setup_s": self.setup_s}

    def after(self) -> None:  # the deletion of the older checkpoint (keep_last=1) is not part of the save
        self.ck.wait(retention=True)

    def close(self) -> None:
        self.ck.close()

    def schedule(self, policy: Policy) -> tuple[Callable[[int], bool], Callable[[int], None]]:  # as the front ends
        self.policy, sched = policy, Schedule(policy, self.ck)
        return sched.should_save, sched.saved

    def run_figures(self) -> dict[str, Any]:  # the median stall as the checkpointer timed it
        stalls = [r.stall_s for r in self.ck.records]
        return {"stall_ms_median": 1e3 * statistics.median(stalls) if stalls else 0.0,
                "waited_s": self.ck.counters["waited_s"], "skipped": self.ck.counters["skipped"],
                "figures": self.policy.figures()}


class Dcp(Contender):
    """DCP ``async_save``, one checkpoint in flight: ``pinned=None`` its default stager (a synchronous copy
    into pageable memory); ``"fresh"`` a new pinned ``DefaultStager`` per save; ``"cached"`` one pinned
    stager whose copies are reused across saves (:func:`_peers.dcp_stager`)."""

    def __init__(self, state: Any, root: str, pinned: str | None) -> None:
        self.root, self.pinned, self.stager = root, pinned, None
        if pinned == "cached":
            self.stager = _peers.dcp_stager(pinned=True, keep_copies=True)
            staged = self.stager.stage(state)  # pin and fill its copies now, as ours' reserve() does
            staged.result() if hasattr(staged, "result") else None

    def save(self, state: Any, step: int) -> Staged:
        self.durable()  # the previous checkpoint first
        stager = _peers.dcp_stager(pinned=True) if self.pinned == "fresh" else self.stager
        staged, upload = _peers.dcp_async(state, os.path.join(self.root, f"dcp-{step}"),
                                          **({"async_stager": stager} if stager is not None else {}))
        self.pending = lambda: (upload(), stager.close() if self.pinned == "fresh" else None)
        return staged

    def close(self) -> None:
        self.durable()
        if self.stager is not None:
            _peers.close_stager(self.stager)


class LightningAsync(Contender):
    """``AsyncCheckpointIO``, a new one per save (``_peers.LightningAsync``)."""

    def __init__(self, state: Any, root: str) -> None:
        self.root = root

    def save(self, state: Any, step: int) -> Staged:
        io = _peers.LightningAsync(os.path.join(self.root, f"lightning-{step}.ckpt"))
        io.save(state)
        self.pending = io.durable
        return None


MAKERS: dict[str, Callable[[Any, str], Contender]] = {
    "ours": Ours, "ours_defer": lambda s, r: Ours(s, r, defer=True), "dcp_async": lambda s, r: Dcp(s, r, None),
    "dcp_async_pinned": lambda s, r: Dcp(s, r, "fresh"), "dcp_async_pinned_cached": lambda s, r: Dcp(s, r, "cached"),
    "lightning_async": LightningAsync}


def contenders(nbytes: int) -> list[str]:
    """The contenders of a size, in order (DCP's pinned stagers with CUDA only); above 8 GiB (a 16 GiB write
    costs ~10 s) one variant of ours, the slowest peer last."""
    names = (["ours", "dcp_async_pinned_cached", "dcp_async_pinned", "dcp_async"] if nbytes > 8 * GiB
             else ["ours", "ours_defer", "dcp_async", "dcp_async_pinned", "dcp_async_pinned_cached"])
    return [n for n in names if CUDA or "pinned" not in n] + ["lightning_async"]


def measure(make: Callable[[Any, str], Contender], state: Any, nbytes: int, workdir: str, probe: GpuProbe,
            reps: int) -> dict[str, Any]:
    """``reps`` saves; each beside a control (:meth:`GpuProbe.control`), before it in odd repetitions and
    after it in even ones, so that drift and order cancel in ``gpu_delay_net_s`` (delay − control
    of the same repetition). The first save is reported apart, the median of the others in the table."""
    root = os.path.join(workdir, "ckpt")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    c = make(state, root)
    rows = []
    try:
        for i in range(reps):
            ctrl = probe.control() if i % 2 else None
            base_fwd, base_mut = probe.base()  # same clocks and heap as the save right after it
            with probe.run() as tl:
                t = time.perf_counter()
                ready = c.save(state, i)
                stall = time.perf_counter() - t
            if ready is not None:
                ready()
            mutable = time.perf_counter() - t if ready is not None else stall
            tl.mark()
            extra = c.durable()
            done = time.perf_counter() - t
            row = {"stall_s": stall, "mutable_s": mutable, "durable_s": done,
                   "gpu_delay_s": tl.since(1) - base_fwd,
                   "gpu_delay_to_mutable_s": tl.since(2) - base_mut,
                   "persist_gbps": gbps(nbytes, done - mutable), **extra}
            c.after()
            row["gpu_delay_control_s"] = probe.control() if ctrl is None else ctrl
            row["gpu_delay_net_s"] = row["gpu_delay_s"] - row["gpu_delay_control_s"]
            rows.append(row)
            for name in os.listdir(root):  # keep at most the last checkpoint on disk (ours: keep_last=1)
                if name.startswith(("dcp-", "lightning-")):
                    p = os.path.join(root, name)
                    shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
    finally:
        c.close()
        c = None  # drop the reference before free_memory()
        shutil.rmtree(root, ignore_errors=True)
        free_memory()
    steady = rows[1:] if len(rows) > 1 else rows
    out: dict[str, Any] = {k: statistics.median(r[k] for r in steady) for k in steady[0]}
    out["reps"], out["first"] = len(rows), rows[0]
    return out


def bench_size(size: float, args: argparse.Namespace, probe: GpuProbe, out: dict[str, Any],
               dump: Callable[[], None]) -> None:
    """Fills ``out`` (already in the results) as it goes; ``dump()`` after each contender."""
    nbytes = int(size * GiB)
    need = 2.2 * nbytes + GiB
    free = shutil.disk_usage(args.workdir).free
    if free < need:
        out["skipped"] = f"{free / GiB:.1f} GiB free on {args.workdir}, {need / GiB:.1f} needed"
        return
    reps = args.reps or (3 if nbytes <= GiB else 2 if nbytes <= 4 * GiB else 1)
    state = make_state(nbytes)
    nbytes = state_bytes(state)
    out.update(bytes=nbytes, tensors=len(encode(state).tensors), reps=reps)
    out["encode_s"] = best_of(3, lambda: encode(state, "state"))
    out["contenders"] = {}
    log(f"{label(size)}: limits")
    out["limits"] = limits(nbytes, args.workdir, max(2, min(reps, 3)), buffered=nbytes <= 4 * GiB)
    log(f"  d2h {out['limits']['d2h_gbps']:.1f} GB/s, raw write {out['limits']['raw_write_gbps']:.2f} GB/s")
    for name in contenders(nbytes):
        attempt(args, name, lambda: measure(MAKERS[name], state, nbytes, args.workdir, probe, reps), out["contenders"])
        dump()
    state = None  # drop the reference before free_memory() (not del: closures above read it)
    free_memory()


def attempt(args: argparse.Namespace, name: str, run: Callable[[], dict[str, Any]], results: dict[str, Any],
            always: bool = False) -> None:
    """``results[name] = run()``; ``{"skipped": "time budget"}`` once ``--budget-s`` is spent (unless ``always``),
    the error if it raised (one peer's failure, API drift, must not lose the rest); memory freed after."""
    if time.perf_counter() - T0 > args.budget_s and not always:
        results[name] = {"skipped": "time budget"}
        return
    try:
        results[name] = run()
    except Exception as e:  # noqa: BLE001
        results[name] = {"error": f"{type(e).__name__}: {e}", "where": traceback.format_exc(limit=-4)}
    free_memory()
    r = results[name]
    log(f"  {name}: " + (r["error"] if "error" in r else
                         ", ".join(f"{k}={v:.4g}" for k, v in r.items() if isinstance(v, (int, float)))))


def label(size_gib: float) -> str:
    return f"{size_gib:g} GiB" if size_gib >= 1 else f"{size_gib * 1024:g} MiB"


# ---- GPT-2 small training overhead ----------------------------------------------------------------------
class Trainer:
    """``_plain_job``'s GPT-2-small-sized model (2 layers with ``tiny``), fused AdamW, 8 batches on DEV."""

    def __init__(self, tiny: bool) -> None:
        vocab, seq, d, layers, heads, batch = (512, 64, 64, 2, 4, 4) if tiny else (50257, 1024, 768, 12, 12, 16)
        torch.manual_seed(0)
        self.model = GPT(vocab, seq, d, layers, heads).to(DEV)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, **({"fused": True} if CUDA else {}))
        tokens = [torch.randint(0, vocab, (batch, seq + 1), device=DEV) for _ in range(8)]
        self.data = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
        self.step = 0

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step}

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=CUDA):  # CPU bf16 is slow
            return self.model(*batch)

    def loop(self, steps: int, before_opt: Callable[[], None] | None = None,
             after: Callable[[int], None] | None = None) -> float:
        """Seconds per step over ``steps`` steps of :func:`_plain_job.train`, the device synchronized."""
        sync()
        t = time.perf_counter()
        train(self.loss, self.opt, self.data, steps, self.step, before_opt=before_opt, after=after)
        self.step += steps
        sync()
        return (time.perf_counter() - t) / steps


def train_with(tr: Trainer, make: Callable[[Any, str], Contender], root: str, steps: int,
               policy: Policy) -> dict[str, Any]:
    """``steps`` steps of ``tr`` with a contender saving when its :meth:`Contender.schedule` says; a save's
    pending copy is waited for just before the optimizer step (the first write to the weights), the
    drain at the end (the last checkpoint durable) is timed apart."""
    c = make(tr.state(), root)
    due, saved = c.schedule(policy)
    pending: list[Callable[[], Any]] = []
    stalls: list[float] = []

    def before_opt() -> None:
        while pending:
            pending.pop()()

    def after(step: int) -> None:
        if due(step):
            t = time.perf_counter()
            ready = c.save(tr.state(), step)
            stalls.append(time.perf_counter() - t)
            pending.extend([ready] if ready is not None else [])
            saved(step)

    per_step = tr.loop(steps, before_opt=before_opt, after=after)
    t = time.perf_counter()
    before_opt()
    c.close()
    return {"step_s": per_step, "checkpoints": len(stalls), "drain_s": time.perf_counter() - t,
            "stall_ms_median": 1e3 * statistics.median(stalls) if stalls else 0.0, **c.run_figures()}


def bench_train(args: argparse.Namespace) -> dict[str, Any]:
    tr = Trainer(args.tiny)
    n = 12 if args.tiny else 60
    root = os.path.join(args.workdir, "train")
    tr.loop(3 if args.tiny else 10)  # warm-up: kernels, allocator, AdamW state
    # Measured after the warm-up: AdamW's moments exist only from the first step on (2/3 of what is saved).
    state_b = saved_bytes(tr.state())
    # The disk's own limit, now: an interval shorter than one raw write of the state makes any
    # checkpointer wait for the previous one (the figures of such runs are the disk's, not the copy's).
    host = torch.empty(state_b, dtype=torch.uint8, pin_memory=CUDA)  # aligned as the limits' buffer is
    host.fill_(7)  # first touch outside the timing
    raw = raw_write(host, args.workdir, reps=2, buffered=False)
    del host
    out: dict[str, Any] = {"params": tr.params, "state_bytes": state_b, "raw_write_s": raw["raw_write_s"],
                           "runs": {}}
    log(f"train: {tr.params / 1e6:.1f}M params, {state_b / GiB:.2f} GiB of state, raw write "
        f"{raw['raw_write_s']:.2f} s ({raw['raw_write_gbps']:.2f} GB/s)")
    # Most telling first: a run that would start after the time budget is skipped (the end baseline never).
    # Each run: (name, contender, steps, policy); no contender: the baseline.
    every = EveryNSteps(2 if args.tiny else 10)
    peers = ["ours", "ours_defer", "dcp_async"] + (["dcp_async_pinned_cached", "dcp_async_pinned"] if CUDA else [])
    runs: list[tuple[str, Any, int, Any]] = [
        ("baseline", None, n, None), *((f"{name}_every_10", MAKERS[name], n, every) for name in peers),
        ("ours_budget_3.5%", Ours, 2 * n if args.tiny else 120,
         CheckpointConfig(dirpath=root, overhead_budget=0.035).policy()),
        ("ours_every_1", Ours, max(4, n // 3), EveryNSteps(1)), ("baseline_end", None, n, None)]
    for name, make, steps, policy in runs:
        shutil.rmtree(root, ignore_errors=True)
        attempt(args, name, lambda: {"step_s": tr.loop(steps), "checkpoints": 0} if make is None
                else train_with(tr, make, root, steps, policy), out["runs"], always=name == "baseline_end")
        shutil.rmtree(root, ignore_errors=True)
    base = [out["runs"][k]["step_s"] for k in ("baseline", "baseline_end") if "step_s" in out["runs"][k]]
    out["baseline_step_s"] = statistics.fmean(base)
    out["disk_interval_steps"] = max(1, math.ceil(out["raw_write_s"] / out["baseline_step_s"]))
    for r in out["runs"].values():
        if "step_s" in r:
            r["overhead"] = r["step_s"] / out["baseline_step_s"] - 1
    tr = None  # drop the reference before free_memory()
    free_memory()
    return out


# ---- report -------------------------------------------------------------------------------------------
def _f(v: Any, scale: float = 1.0, fmt: str = ".3g") -> str:
    return "-" if not isinstance(v, (int, float)) or v != v else format(v * scale, fmt)


SIZE_COLUMNS = ["size", "contender", "stall ms", "stall − encode ms", "mutable ms", "GPU delay, next fwd/bwd ms",
                "control (no save) ms", "(delay − control) ÷ D2H", "GPU delay, next optimizer step ms", "durable s",
                "persist GB/s", "persist ÷ raw"]
TRAIN_COLUMNS = ["run", "checkpoints", "ms/step", "overhead", "median stall ms", "notes"]


def markdown(res: dict[str, Any]) -> str:
    """The report of a run's results (also of older runs': ``report.py`` renders them)."""
    m, rows = res["meta"], []
    for key, s in res["sizes"].items():
        size, lim = label(float(key)), s.get("limits")
        if "skipped" in s or lim is None:
            rows.append([size, f"skipped: {s.get('skipped', 'unfinished')}"] + [""] * 10)
            continue
        rows.append([size, f"limit: D2H `copy_` into pinned {_f(lim['d2h_s'], 1e3)} ms ({_f(lim['d2h_gbps'])} GB/s);"
                     " raw write of it", *[""] * 7, _f(lim["raw_write_s"]), _f(lim["raw_write_gbps"]), 1])
        for name, r in s["contenders"].items():
            if "stall_s" not in r:
                rows.append([size, f"{name}: {r.get('error') or r.get('skipped')}"] + [""] * 10)
                continue
            ms = [_f(v, 1e3) for v in (r["stall_s"], r["stall_s"] - s["encode_s"], r["mutable_s"], r["gpu_delay_s"],
                                       r.get("gpu_delay_control_s"))]
            rows.append([size, name, *ms, _net(r, lim["d2h_s"]), _f(r["gpu_delay_to_mutable_s"], 1e3),
                         _f(r["durable_s"]), _f(r["persist_gbps"]), _f(r["persist_gbps"] / lim["raw_write_gbps"])])
    lines = [f"Device: {m['device']}; torch {m['torch']}; {m['date']}; workdir {m['workdir']} ({m['fstype']})", "",
             *table(SIZE_COLUMNS, rows)]
    t = res.get("train")
    if t:
        lines += ["", f"Training: GPT-2-small-sized model, {t['params'] / 1e6:.1f}M parameters, "
                  f"{t['state_bytes'] / GiB:.2f} GiB checkpointed per save; baseline {_f(t['baseline_step_s'], 1e3)} "
                  f"ms/step; a raw write+fsync of the state takes {_f(t['raw_write_s'])} s, so the disk allows a "
                  f"checkpoint every {t['disk_interval_steps']} steps at least (shorter intervals wait for it)",
                  "", *table(TRAIN_COLUMNS, [])]
        for name, r in t["runs"].items():
            if "step_s" not in r:
                cells, notes = [name, r.get("error") or r.get("skipped"), "", "", ""], ""
            else:
                cells = [name, r["checkpoints"], _f(r["step_s"], 1e3), f"{_f(r['overhead'], 100, '.1f')} %",
                         _f(r.get("stall_ms_median"))]
                notes = ", ".join([*(f"{k}={_f(v)}" for k, v in r.items() if k in ("waited_s", "skipped", "drain_s")),
                                   *(f"{k}={_f(v)}" for k, v in (r.get("figures") or {}).items()
                                     if k in ("interval_steps", "measured_overhead"))])
            lines.append(f"{table(cells, [])[0]} {notes} |")  # an empty note as "|  |", as published runs show it
    return "\n".join(lines) + "\n"


def _net(r: dict[str, Any], d2h_s: float) -> str:
    """(delay − control) ÷ D2H; runs before the control was timed (2026-11-26) show the delay ÷ D2H."""
    net = r.get("gpu_delay_net_s")
    return _f(net / d2h_s) if net is not None else f"{_f(r['gpu_delay_s'] / d2h_s)} (no control)"


def fstype(path: str) -> str:
    """The filesystem type of the mount ``path`` lies on (``/proc/mounts``)."""
    with open("/proc/mounts") as f:
        mounts = [line.split()[1:3] for line in f]
    path = os.path.realpath(path)
    return max((m for m in mounts if path == m[0] or path.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=("/", "?"))[1]


def pick_workdir(explicit: str | None) -> str:
    """``explicit``, else ``bench_gpu_work`` in the directory with the most free space on a real disk (not
    tmpfs: its writes would be memcpy)."""
    if not explicit:
        cands = [d for d in ("/var/tmp", "/tmp", os.getcwd()) if os.path.isdir(d)]
        disk = [d for d in cands if fstype(d) not in ("tmpfs", "ramfs", "overlay")] or cands
        explicit = os.path.join(max(disk, key=lambda d: shutil.disk_usage(d).free), "bench_gpu_work")
    os.makedirs(explicit, exist_ok=True)
    return explicit


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, scratch="")
    p.add_argument("--sizes-gib", type=float, nargs="+", default=[1, 4, 16])
    p.add_argument("--tiny", action="store_true", help="a few MiB and a 2-layer model (CPU without CUDA)")
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--workdir", help="checkpoint directory on a local disk (default: picked, not tmpfs)")
    p.add_argument("--budget-s", type=float, default=480, help="skip remaining contenders after this")
    p.add_argument("--reps", type=int, default=0,
                   help="saves per contender and size (default: 3 up to 1 GiB, 2 up to 4 GiB, else 1); the "
                        "first is reported apart, the median of the others in the table")
    args = p.parse_args(argv)
    if args.tiny:
        args.sizes_gib = [4 / 1024]
    args.workdir = pick_workdir(args.workdir)
    os.makedirs(args.out, exist_ok=True)
    res: dict[str, Any] = {"meta": {
        "device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__,
        "cuda": torch.version.cuda, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "workdir": args.workdir, "fstype": fstype(args.workdir),
        "disk_free_gib": shutil.disk_usage(args.workdir).free / GiB, "cpus": os.cpu_count(), "tiny": args.tiny,
        "argv": sys.argv[1:]}, "sizes": {}}
    log(f"{res['meta']}")
    probe = GpuProbe(args.tiny)
    res["meta"].update(workload_s=probe.workload_s, spin_plus_workload_s=probe.base_s)

    def dump() -> None:
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
            f.write(markdown(res))

    # The largest sizes last: if the time budget runs out, they are what is lost.
    for size in [s for s in args.sizes_gib if s <= 4]:
        bench_size(size, args, probe, res["sizes"].setdefault(f"{size:g}", {}), dump)
    if not args.no_train:
        res["train"] = bench_train(args)
        dump()
    for size in [s for s in args.sizes_gib if s > 4]:
        bench_size(size, args, probe, res["sizes"].setdefault(f"{size:g}", {}), dump)
    res["meta"]["total_s"] = time.perf_counter() - T0
    dump()
    shutil.rmtree(args.workdir, ignore_errors=True) if args.workdir.endswith("bench_gpu_work") else None
    print(markdown(res), flush=True)
    return res


if __name__ == "__main__":
    main()
