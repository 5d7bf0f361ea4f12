"""The benchmarks' harness: timing, host memory, the synthetic state, raw I/O, ranks in processes, the
peers' rounds, the quiet-machine checks and the writing of a report (``out/<name>.{md,json}``).

The physical limits here do not depend on the code they judge (``ckpt_engine`` is imported only for
its huge-page allocator and its encoder).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import gc
import json
import mmap
import os
import pathlib
import random
import resource
import shutil
import socket
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash

T = TypeVar("T")
Metrics = dict[str, float]
MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
_LIBC = ctypes.CDLL(None)


@dataclass
class RankCtx:
    """What a contender needs to know about its rank. ``cold``: this round starts with the allocator's free
    memory handed back (exact RSS figures, first-touch faults paid) rather than with a warm heap;
    ``copy_threads``: ours' ``Checkpointer(copy_threads=)`` (0: its default, a thread per core of the rank)."""

    rank: int
    world: int
    state: dict[str, Any]
    workdir: str
    reps: int
    peer_reps: int
    cold: bool = True
    copy_threads: int = 0

    def barrier(self) -> None:
        """Line all ranks up so that they start a measurement together."""
        if self.world > 1:
            dist.barrier()

    def before_load(self) -> None:
        """Give free heap back, then touch and free the restore's bytes (:func:`prime_free_memory`), so
        that every contender's fresh pages come the same way."""
        trim_heap()
        prime_free_memory(state_bytes(self.state))
        self.barrier()

    def path(self, name: str) -> str:
        """``name`` in this rank's working directory."""
        return os.path.join(self.workdir, name)

    def remove(self, prefix: str) -> None:
        """After every rank is done with them, rank 0 deletes the entries named ``prefix*``."""
        self.barrier()
        if self.rank == 0:
            for name in os.listdir(self.workdir):
                if name.startswith(prefix):
                    target = self.path(name)
                    shutil.rmtree(target) if os.path.isdir(target) else os.unlink(target)
        self.barrier()


# ---- timing and figures ------------------------------------------------------------------------------
def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` once; return (seconds on the monotonic high-resolution clock, its result)."""
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def timed_save(ck: Any, state: Any, step: int, **kwargs: Any) -> tuple[float, float, Any]:
    """One save of ours as every benchmark times it: (stall, seconds until committed, what ``save()``
    returned); then, untimed, the wait for the deletion of older checkpoints (``keep_last``), which left
    running would slow whatever is timed next and flatter ours beside it."""
    stall, handle = timed(lambda: ck.save(state, step, **kwargs))
    total = stall + timed(ck.wait)[0]
    ck.wait(retention=True)
    return stall, total, handle


def best_of(reps: int, fn: Callable[[], Any], before: Callable[[], None] | None = None) -> float:
    """Fastest of ``reps`` runs of ``fn`` in seconds (``before`` runs untimed ahead of each)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        times.append(timed(fn)[0])
    return min(times)


def steady_figures(saves: list[Metrics], keys: Iterable[str]) -> Metrics:
    """Per key, the best (``<key>``) and the median (``<key>`` with ``_median_s``) over saves 2..N."""
    steady, out = saves[1:] or saves, {}
    for key in keys:
        values = [s[key] for s in steady]
        out[key], out[key.replace("_s", "_median_s")] = min(values), statistics.median(values)
    return out


def numbered(values: Sequence[float]) -> Metrics:
    """``{"rep1_s": values[0], ...}``: each repetition's seconds under its own key."""
    return {f"rep{i}_s": v for i, v in enumerate(values, 1)}


def num(x: Any) -> str:
    """A figure for a table: 3 significant digits, whole numbers from 1000 on; ``-`` for none or NaN."""
    return fmt(x, "{:.0f}" if abs(x) >= 1000 else "{:.3g}") if isinstance(x, (int, float)) else "-"


def fmt(x: Any, spec: str = "{:.1f}") -> str:
    """``x`` formatted by ``spec``; ``-`` for none or NaN."""
    return "-" if x is None or x != x else spec.format(x)


def pct(x: float) -> str:
    """A fraction as a signed percentage (``+3.5 %``); ``-`` for NaN."""
    return fmt(x * 100, "{:+.1f} %")


def verdict(ok: bool | None) -> str:
    """PASS, FAIL, or info for a figure without a target."""
    return "info" if ok is None else "PASS" if ok else "FAIL"


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second); 0 for a zero time."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def table(header: Sequence[str], rows: Iterable[Iterable[Any]], rule: str | None = None) -> list[str]:
    """A Markdown table's lines: ``header``, its rule (``rule``, else ``|---|`` per column), one per row;
    each cell through ``str``, an empty one as ``| |``."""
    head, *body = ["|" + "".join(f" {c} |" if str(c) else " |" for c in cells) for cells in [header, *rows]]
    return [head, rule or "|---" * len(header) + "|", *body]


def parser(doc: str | None, scratch: str | None = "", quiet: bool = False) -> argparse.ArgumentParser:
    """A benchmark's command line with the usual flags: the first paragraph of ``doc`` as description,
    ``--out`` (the report's directory, default ``benchmarks/out``), ``--dir`` unless ``scratch`` is ``""``
    (the scratch directory; ``None``: a temporary one, else a fresh one is made inside it), and ``--quiet``
    (wait a little for other processes to use fewer cores)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="report directory (default benchmarks/out)")
    if scratch is None:
        p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    elif scratch:
        p.add_argument("--dir", default=scratch, help=f"a fresh scratch directory is made in it (default {scratch})")
    if quiet:
        p.add_argument("--quiet", type=float, default=0.3, help="wait a little for other processes to use fewer cores")
    return p


def write_report(out: str, name: str, text: str, doc: dict[str, Any]) -> str:
    """Write ``out/<name>.md`` (``text``) and ``out/<name>.json`` (``doc``); print and return ``text``."""
    os.makedirs(out, exist_ok=True)
    for ext, body in (("md", text), ("json", json.dumps(doc, indent=1, default=str))):
        pathlib.Path(out, f"{name}.{ext}").write_text(body)
    print(text)
    return text


def git_commit() -> str:
    """The short hash of this checkout's ``HEAD`` (empty outside a git checkout)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                          text=True).stdout.strip()


# ---- host memory -------------------------------------------------------------------------------------
def rss_bytes(field: str = "VmRSS") -> int:
    """Resident set size of this process now (``field``: another size of ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class MemProbe:
    """Peak RSS growth of this process over a stretch of code: ``start()`` hands free heap back
    (``malloc_trim``, else reused memory hides the allocation), resets the kernel's high-water mark
    (``/proc/self/clear_refs``; ``exact`` is False where that is refused) and notes the RSS;
    ``peak_extra()`` is ``VmHWM`` minus that. Page cache is not RSS."""

    def __init__(self) -> None:
        self.baseline, self.exact = 0, True

    def start(self, keep_baseline: bool = False, trim: bool = True) -> "MemProbe":
        """Reset the peak; measure from the RSS now (``keep_baseline``: from the previous start's)."""
        if trim:
            trim_heap()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.exact = False
        if not keep_baseline:
            self.baseline = rss_bytes()
        return self

    def peak_extra(self) -> int:
        """Bytes by which the peak RSS since ``start()`` exceeded the baseline."""
        return max(0, rss_bytes("VmHWM") - self.baseline)


def trim_heap() -> None:
    """Return free heap memory to the kernel (glibc only; a no-op elsewhere)."""
    getattr(_LIBC, "malloc_trim", lambda _: 0)(0)


def prime_free_memory(nbytes: int) -> None:
    """Touch ``nbytes`` (and 64 MiB more) of fresh memory and free it, so that the allocations right
    after get pages the kernel has just freed. This VM reports free memory to its host (virtio-balloon
    free page reporting), and a first touch of such a page faults on the host too: 1 GiB of fresh huge
    pages took 0.9-1.6 s to fill after 5 s idle, 0.16-0.20 s right after this priming."""
    from ckpt_engine.host import hugepages

    hugepages.empty((nbytes + 64 * MiB,), torch.uint8).fill_(0)  # freed as soon as filled


# ---- the synthetic training state --------------------------------------------------------------------
@dataclass(frozen=True)
class StateSpec:
    """Shape of the benchmark state: ``large`` big float32 tensors plus ``small`` 1-64 KiB ones."""

    size_mib: int
    large: int = 64
    small: int = 300
    seed: int = 0

    def small_numels(self) -> list[int]:
        """Element counts of the small tensors (biases, norms): 1-64 KiB of float32 each."""
        rng = random.Random(self.seed)
        return [rng.randint(256, 16384) for _ in range(self.small)]

    def large_numel(self) -> int:
        """Elements of each large tensor, so that the whole state is ``size_mib`` MiB."""
        return max(1024, (self.size_mib * MiB - 4 * sum(self.small_numels())) // (4 * self.large))


def make_state(spec: StateSpec) -> dict[str, Any]:
    """A nested, replicated training state: identical on every rank (same seed)."""
    gen = torch.Generator().manual_seed(spec.seed)
    side = spec.large_numel()
    model: dict[str, torch.Tensor] = {}
    for i in range(spec.large):
        weight = torch.rand(side, generator=gen)
        model[f"block{i}.weight"] = weight.reshape(-1, 256) if side % 256 == 0 else weight
    for i, n in enumerate(spec.small_numels()):
        model[f"block{i % spec.large}.norm{i // spec.large}.weight"] = torch.rand(n, generator=gen)
    return {"model": model, "meta": {"epoch": 3, "global_step": 12345, "lr": 1e-3}}


def tensors_of(state: Any, local: bool = False) -> list[torch.Tensor]:
    """Every tensor of a nested dict/list state, in a stable order (``local``: a DTensor's local chunk)."""
    if local and type(state).__name__ == "DTensor":
        return [state.to_local()]
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, (dict, list, tuple)):
        state = state.values() if isinstance(state, dict) else state
        return [t for v in state for t in tensors_of(v, local)]
    return []


def state_bytes(state: Any) -> int:
    """Tensor bytes of a nested state."""
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def saved_bytes(state: Any) -> int:
    """Tensor bytes a checkpoint of ``state`` stores (the engine's ``encode()`` stores shared data once)."""
    from ckpt_engine.state.values import encode

    return state_bytes(encode(state).tensors)


def empty_like_state(state: Any) -> Any:
    """Same structure with freshly allocated (untouched) tensors: a restore target."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    return state


def states_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of two nested states' tensors (and of the structure)."""
    ta, tb = tensors_of(a), tensors_of(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


# ---- a rank's share and raw I/O ----------------------------------------------------------------------
def share_slices(state: Any, rank: int, world: int) -> list[tuple[int, int]]:
    """(address, nbytes) of this rank's contiguous 1/world of every tensor (DeepFreeze-style)."""
    out = []
    for t in tensors_of(state):
        item, n = t.element_size(), t.numel()
        start, stop = n * rank // world, n * (rank + 1) // world
        if stop > start:
            out.append((t.data_ptr() + start * item, (stop - start) * item))
    return out


@contextlib.contextmanager
def _fd(path: str, flags: int = os.O_RDONLY) -> Iterator[int]:
    fd = os.open(path, flags, 0o644)
    try:
        yield fd
    finally:
        os.close(fd)


def write_fsync(path: str, views: Iterable[memoryview], direct: bool = False) -> int:
    """Write ``views`` to a new file and ``fsync`` it; returns the bytes written. ``direct``: ``O_DIRECT``
    for the 4 KiB-aligned head of each view (which must start page-aligned), the tail through the cache."""
    done = 0
    with _fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)) as fd:
        for view in views:
            view = view.cast("B")
            head, pos = (len(view) - len(view) % 4096 if direct else 0), 0
            while pos < head:
                pos += os.write(fd, view[pos:min(head, pos + (64 << 20))])
            if direct and pos < len(view):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            while pos < len(view):
                pos += os.write(fd, view[pos:])
            done += pos
        os.fsync(fd)
    return done


class RawWriter:
    """``write`` + ``fsync`` of ``data`` to a new file per call, the oldest beyond ``keep`` deleted after
    the write as ours deletes after its commit: on this VM a write that follows the deletion of a file of
    its size runs ~5x faster than one needing fresh pages, so both keep the same number of files.
    ``direct``: ``O_DIRECT`` from a page-aligned (``mmap``) copy of ``data``."""

    def __init__(self, ctx: RankCtx, data: memoryview, direct: bool = False, keep: int = 1) -> None:
        self.ctx, self.files, self.direct, self.keep = ctx, [], direct, keep
        self.data, self.tag = data, "rawd" if direct else "raw"
        if direct:
            self.data = memoryview(mmap.mmap(-1, max(1, len(data))))[:len(data)]
            self.data[:] = data.cast("B")

    def write(self) -> float:
        """Seconds to write and ``fsync`` one file."""
        path = self.ctx.path(f"{self.tag}-{self.ctx.rank}-{len(self.files)}.bin")
        seconds = timed(lambda: write_fsync(path, [self.data], self.direct))[0]
        self.files.append(path)
        if len(self.files) > self.keep:
            os.unlink(self.files[-self.keep - 1])
        return seconds

    def finish(self) -> None:
        """Leave only the newest buffered file, as ``raw-<rank>.bin`` for the raw read."""
        for path in self.files[-self.keep:-1]:
            os.unlink(path)
        if self.direct:
            os.unlink(self.files[-1])
        else:
            os.replace(self.files[-1], self.ctx.path(f"raw-{self.ctx.rank}.bin"))


def read_into(paths: Sequence[str], dest: memoryview, threads: int = 1, verify_step: int | None = None) -> int:
    """Read ``paths`` back to back into ``dest`` with ``preadv``, split at equal shares over ``threads``;
    returns the bytes read. ``verify_step``: requests of that many bytes, each hashed with xxh3 as it lands,
    as ``load()`` verifies (the floor of a verified read)."""
    sizes = [os.path.getsize(p) for p in paths]
    bounds = [sum(sizes) * i // max(1, threads) for i in range(max(1, threads) + 1)]

    def read_range(i: int) -> int:
        lo, hi, got, start = bounds[i], bounds[i + 1], 0, 0
        for path, size in zip(paths, sizes):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                digest = xxhash.xxh3_64() if verify_step else None
                with _fd(path) as fd:
                    while a < b:
                        n = os.preadv(fd, [dest[a:b if digest is None else min(b, a + verify_step)]], a - start)
                        if n == 0:
                            raise OSError(f"{path}: ended at byte {a - start} of {size}")
                        if digest is not None:
                            digest.update(dest[a:a + n])
                        a, got = a + n, got + n
                if digest is not None:
                    digest.hexdigest()  # as a reader compares it
            start += size
        return got

    if threads <= 1:
        return read_range(0)
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read_range, range(threads)))


def _files(paths: Sequence[str]) -> list[str]:
    out = []
    for path in paths:
        if os.path.isdir(path):
            out += [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
        elif os.path.exists(path):
            out.append(path)
    return out


def drop_page_cache(paths: Sequence[str], cold: bool = True) -> None:
    """Every file under ``paths`` out of the page cache: ``fsync``, then ``posix_fadvise(DONTNEED)``
    (drops clean pages without root, unlike ``drop_caches``); ``cold`` False: into it (read through once)."""
    chunk = None if cold else memoryview(bytearray(16 << 20))
    for path in _files(paths):
        with _fd(path) as fd:
            if chunk is None:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.readv(fd, [chunk]):
                    pass


def set_page_cache(ctx: RankCtx, paths: Sequence[str], cold: bool) -> None:
    """Every file under ``paths`` out of the page cache (``cold``) or in it (:func:`drop_page_cache`); done by
    rank 0 for the node, between barriers."""
    ctx.barrier()
    if ctx.rank == 0:
        drop_page_cache(paths, cold)
    ctx.barrier()


def fsync_path(path: str) -> None:
    """``fsync`` an existing file (or directory) by path."""
    with _fd(path) as fd:
        os.fsync(fd)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview of a contiguous CPU tensor's memory."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ---- ranks in processes, the peers' rounds -----------------------------------------------------------
def free_port() -> int:
    """A free TCP port on the loopback interface (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(main: Any, world: int, cfg: Any) -> list[dict]:
    """Run ``main(rank, world, cfg, workdir, port)`` in ``world`` processes; each rank's ``rank-N.json``."""
    workdir = os.path.join(cfg.dir, f"world{world}")
    os.makedirs(workdir, exist_ok=True)
    mp.spawn(main, args=(world, cfg, workdir, free_port()), nprocs=world, join=True)
    return [json.loads(pathlib.Path(workdir, f"rank-{r}.json").read_text()) for r in range(world)]


def run_stages(ctx: RankCtx, stages: Iterable[Callable[[], dict[str, Metrics]]], path: str, **extra: Any) -> None:
    """Run each stage in turn (each figure with its stage's ``stage_s``) and write them to ``path``."""
    results: dict[str, Any] = {}
    for stage in stages:
        elapsed, produced = timed(stage)
        results.update({name: {**metrics, "stage_s": elapsed} for name, metrics in produced.items()})
        gc.collect()
    pathlib.Path(path).write_text(json.dumps({**results, **extra}))
    if ctx.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _merge(figures: Iterable[Metrics], largest: Callable[[str], bool]) -> Metrics:
    """Per figure over ``figures``: the largest value where ``largest(key)``, else the smallest."""
    out: Metrics = {}
    for m in figures:
        for key, value in m.items():
            out[key] = (max if largest(key) else min)(out.get(key, value), value)
    return out


def slowest(ranks: list[dict[str, Metrics]]) -> dict[str, Metrics]:
    """Per contender and figure, the largest value any rank reported, the smallest for ``load_ok``."""
    return {name: _merge((r.get(name, {}) for r in ranks), lambda key: key != "load_ok") for name in ranks[0]}


def best_rounds(rounds: Iterable[Metrics]) -> Metrics:
    """Per figure over rounds: the fastest time, the largest memory (``mem_``), the worst bit-exactness."""
    return _merge(rounds, lambda key: "mem_" in key)


def peer_rounds(ctx: RankCtx, stem: str, save: Callable[[str], Metrics],
                load: Callable[[str], Metrics] | None = None, rank0: bool = False) -> Metrics:
    """``ctx.peer_reps`` rounds of a peer, each to its own path ``stem-<round>``, deleted after the last
    round: between barriers, ``save(path)`` with its peak RSS (``rank0``: rank 0 saves, the others wait),
    then ``load(path)`` on every rank. The first round is cold (``ctx.cold``), later ones find a warm
    heap. The best of each figure."""
    rounds = []
    for i in range(ctx.peer_reps):
        ctx.cold, path = i == 0, ctx.path(f"{stem}-{i}")
        ctx.barrier()
        m: Metrics = {}
        if not (rank0 and ctx.rank):
            probe = MemProbe().start(trim=ctx.cold)
            m = {**save(path), "mem_extra_bytes": probe.peak_extra()}
        rounds.append({**m, **(load(path) if load is not None else {})})
        gc.collect()
    ctx.cold = True
    ctx.remove(stem)
    return best_rounds(rounds)


def synchronous(save: Callable[[], Any]) -> Metrics:
    """The figures of a save that is durable when it returns: its seconds are its stall and its total."""
    seconds = timed(save)[0]
    return {"stall_s": seconds, "mutable_s": seconds, "total_s": seconds}


# ---- a quiet machine ---------------------------------------------------------------------------------
def _foreign_cpu_s() -> float:
    """Busy CPU seconds of the machine (``/proc/stat``) minus this process's and its reaped children's."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user / nice
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    own = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK") - own


class CpuLoad:
    """Busy CPU time of the whole machine (``/proc/stat``) minus this process's and its reaped children's,
    over a stretch of wall time: how many cores other processes used meanwhile."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), _foreign_cpu_s()

    def foreign_cores(self) -> float:
        """Cores other processes kept busy, on average, since this object was made."""
        wall = time.perf_counter() - self.wall
        return max(0.0, _foreign_cpu_s() - self.cpu) / wall if wall > 0 else float("nan")


def wait_quiet(threshold: float, window: float = 1.0, max_wait: float = 30.0) -> tuple[float, float]:
    """Wait until other processes use at most ``threshold`` cores over ``window`` seconds, or ``max_wait``
    passed. Returns (seconds waited, the last foreign load seen)."""
    start = time.perf_counter()
    while True:
        probe = CpuLoad()
        time.sleep(window)
        load, waited = probe.foreign_cores(), time.perf_counter() - start
        if load <= threshold or waited >= max_wait:
            return waited, load
