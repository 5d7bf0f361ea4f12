"""Measurement primitives shared by the benchmarks: timing, host memory, the synthetic state, raw I/O.

Nothing here imports ``ckpt_engine``: the physical limits must not depend on the code they judge.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch
import torch.distributed as dist
import xxhash

T = TypeVar("T")
Metrics = dict[str, float]
MiB = 1 << 20
GB = 1e9


# ---- one rank's view -----------------------------------------------------------------------------
@dataclass
class RankCtx:
    """What a contender needs to know about its rank."""

    rank: int
    world: int
    state: dict[str, Any]
    workdir: str
    reps: int
    peer_reps: int
    cold: bool = True
    """Whether this round starts with the allocator's free memory handed back (exact RSS
    figures, first-touch page faults paid) or with a warm heap (steady-state timings)."""

    def barrier(self) -> None:
        """Line all ranks up so that they start a measurement together."""
        if self.world > 1:
            dist.barrier()

    def before_load(self) -> None:
        """Give free heap back first, so no restore reuses memory an earlier one left behind; then
        touch and free the restore's bytes (:func:`prime_free_memory`), so that every contender's
        fresh pages come the same way."""
        trim_heap()
        prime_free_memory(state_bytes(self.state))
        self.barrier()

    def path(self, name: str) -> str:
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


# ---- timing ---------------------------------------------------------------------------------------
def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` once; return (seconds on the monotonic high-resolution clock, its result)."""
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def timed_save(ck: Any, state: Any, step: int, **kwargs: Any) -> tuple[float, float, Any]:
    """One save of ours as every benchmark times it: (stall, seconds until committed with the stall,
    what ``save()`` returned). Then, untimed, it waits for the deletion of older checkpoints
    (``keep_last``): that runs on its own thread after the commit, and left running it would slow
    whatever is timed next (a physical limit, a peer, the next save) and flatter ours beside it."""
    start = time.perf_counter()
    handle = ck.save(state, step, **kwargs)
    stall = time.perf_counter() - start
    ck.wait()
    total = time.perf_counter() - start
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


def summary(values: Sequence[float]) -> dict[str, float]:
    """min / median / max of a non-empty sequence."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def numbered(values: Sequence[float]) -> Metrics:
    """``{"rep1_s": values[0], ...}``: each repetition's seconds under its own key."""
    return {f"rep{i}_s": v for i, v in enumerate(values, 1)}


def num(x: Any) -> str:
    """A figure for a table: 3 significant digits, whole numbers from 1000 on; ``-`` for none or NaN."""
    if not isinstance(x, (int, float)) or x != x:
        return "-"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def free_port() -> int:
    """A free TCP port on the loopback interface (for a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second); 0 for a zero time."""
    return nbytes / seconds / GB if seconds > 0 else 0.0


# ---- host memory ----------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_kib("VmRSS") * 1024


class MemProbe:
    """Peak RSS growth of this process (all threads) over a stretch of code.

    ``start()`` hands the allocator's free memory back to the kernel (glibc ``malloc_trim``:
    otherwise memory freed by an earlier contender is reused without growing RSS and hides
    the allocation), resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``,
    Linux >= 4.0) and notes the RSS; ``peak_extra()`` is ``VmHWM - that RSS``. Where the reset
    is not permitted the old high-water mark may hide the peak; ``exact`` says which case holds.
    Page cache is not RSS, so written or read files do not count.
    """

    def __init__(self) -> None:
        self.baseline = 0
        self.exact = True

    def start(self, keep_baseline: bool = False, trim: bool = True) -> "MemProbe":
        """Reset the peak; measure growth from the RSS now (or, with ``keep_baseline``, from the
        previous ``start()``'s, so that memory kept across calls still counts). ``trim=False``
        leaves the allocator's free memory in place: a steady-state timing, an RSS figure that
        may miss reused memory."""
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
        return max(0, _status_kib("VmHWM") * 1024 - self.baseline)


def trim_heap() -> None:
    """Return free heap memory to the kernel (glibc only; a no-op elsewhere)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


_LIBC = ctypes.CDLL(None)


def prime_free_memory(nbytes: int) -> None:
    """Touch ``nbytes`` (and 64 MiB more) of fresh memory and free it, so that the allocations
    right after get pages the kernel has just freed.

    Why: this project's VMs (Firecracker) report free memory to their host (virtio-balloon free page
    reporting, ``/sys/module/page_reporting``), which takes it back, and the next first touch of such a
    page faults on the host as well. 1 GiB of fresh huge pages took 0.9-1.6 s to fill after 5 s idle,
    0.16-0.20 s right after this priming, and 0.18 s right after another 1 GiB was freed (4 KiB pages:
    0.66-0.85 s primed, up to 1.29 s not). Which restore of a pair found which kind of page decided the
    paired restore figures of the runs of 2026-11-26 (both sides bimodal). Primed before each restore, every
    contender finds recycled pages, as on a machine whose free memory is simply free. Huge pages where
    the kernel gives them (they split for 4 KiB allocations); the fill is timed by nobody.
    """
    from ckpt_engine.host import hugepages

    block = hugepages.empty((nbytes + 64 * MiB,), torch.uint8)
    block.fill_(0)
    del block


# ---- the synthetic training state -----------------------------------------------------------------
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
        rest = self.size_mib * MiB - 4 * sum(self.small_numels())
        return max(1024, rest // (4 * self.large))


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


def tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor of a nested dict/list state, in a stable order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_of(v)]
    return []


def state_bytes(state: Any) -> int:
    """Tensor bytes of a nested state."""
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def saved_bytes(state: Any) -> int:
    """Tensor bytes a checkpoint of ``state`` stores: the tensors of the engine's own ``encode()``,
    which stores tensors sharing data once (a tied embedding once)."""
    from ckpt_engine.state.values import encode

    return sum(t.numel() * t.element_size() for t in encode(state).tensors)


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


# ---- a rank's share and raw I/O -------------------------------------------------------------------
def share_slices(state: Any, rank: int, world: int) -> list[tuple[int, int]]:
    """(address, nbytes) of this rank's contiguous 1/world of every tensor (DeepFreeze-style)."""
    out = []
    for t in tensors_of(state):
        item, n = t.element_size(), t.numel()
        start, stop = n * rank // world, n * (rank + 1) // world
        if stop > start:
            out.append((t.data_ptr() + start * item, (stop - start) * item))
    return out


def write_fsync(path: str, views: Iterable[memoryview], direct: bool = False) -> int:
    """Write ``views`` to a new file with ``os.write`` and ``fsync`` it; returns the bytes written.

    ``direct``: the page cache bypassed (``O_DIRECT``) for the 4 KiB-aligned head of each view,
    which must start page-aligned (see :func:`aligned_copy`); the tail goes through the cache.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    done = 0
    try:
        for view in views:
            view = view.cast("B")
            head = len(view) - len(view) % 4096 if direct else 0
            pos = 0
            while pos < head:
                pos += os.write(fd, view[pos:min(head, pos + (64 << 20))])
            if direct and pos < len(view):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            while pos < len(view):
                pos += os.write(fd, view[pos:])
            done += pos
        os.fsync(fd)
    finally:
        os.close(fd)
    return done


def aligned_copy(data: memoryview) -> memoryview:
    """A page-aligned (``mmap``) copy of ``data``, as direct I/O needs."""
    import mmap

    buf = mmap.mmap(-1, max(1, len(data)))
    view = memoryview(buf)[:len(data)]
    view[:] = data.cast("B")
    return view


def read_into(paths: Sequence[str], dest: memoryview, threads: int = 1, verify_step: int | None = None) -> int:
    """Read ``paths`` back to back into ``dest`` with ``preadv``; returns the bytes read. With
    ``threads`` > 1 the concatenated bytes are split at equal shares, each thread reading its own
    ranges into its own pages of ``dest``: the fastest plain read this machine does, page faults
    spread over the cores as a threaded restore spreads them.

    ``verify_step``: read in requests of that many bytes and hash each with xxh3 right after it
    lands (one digest per thread and file), as ``load()`` verifies while reading
    (``LocalReader.verify_step``): the floor of a verified read, with no planning, no per-tensor
    allocation and no Python beyond the loop."""
    sizes = [os.path.getsize(p) for p in paths]
    total = sum(sizes)
    if threads <= 1:
        return _read_range(paths, sizes, dest, 0, total, verify_step)
    bounds = [total * i // threads for i in range(threads + 1)]
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda i: _read_range(paths, sizes, dest, bounds[i], bounds[i + 1], verify_step),
                            range(threads)))


def _read_range(paths: Sequence[str], sizes: Sequence[int], dest: memoryview, lo: int, hi: int,
                verify_step: int | None = None) -> int:
    """Bytes ``lo:hi`` of the concatenated ``paths`` into the same bytes of ``dest`` (each request
    of at most ``verify_step`` bytes hashed after it lands, when given)."""
    got, start = 0, 0
    for path, size in zip(paths, sizes):
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            fd = os.open(path, os.O_RDONLY)
            digest = xxhash.xxh3_64() if verify_step else None
            try:
                while a < b:
                    stop = b if digest is None else min(b, a + verify_step)
                    n = os.preadv(fd, [dest[a:stop]], a - start)
                    if n == 0:
                        raise OSError(f"{path}: ended at byte {a - start} of {size}")
                    if digest is not None:
                        digest.update(dest[a:a + n])
                    a, got = a + n, got + n
            finally:
                os.close(fd)
            if digest is not None:
                digest.hexdigest()  # as a reader compares it (the comparison itself costs nothing)
        start += size
    return got


def set_page_cache(ctx: "RankCtx", paths: Sequence[str], cold: bool) -> None:
    """Every file under ``paths`` out of the page cache (``cold``: ``fsync``, then
    ``posix_fadvise(DONTNEED)``, which drops clean pages without root, unlike ``drop_caches``) or
    in it (read through once); done by rank 0 for the node, then a barrier."""
    ctx.barrier()
    if ctx.rank == 0 and cold:
        drop_page_cache(paths)
    elif ctx.rank == 0:
        chunk = memoryview(bytearray(16 << 20))
        for path in _files(paths):
            fd = os.open(path, os.O_RDONLY)
            try:
                while os.readv(fd, [chunk]):
                    pass
            finally:
                os.close(fd)
    ctx.barrier()


def drop_page_cache(paths: Sequence[str]) -> None:
    """Every file under ``paths`` out of the page cache: ``fsync``, then ``posix_fadvise(DONTNEED)``
    (drops clean pages without root, unlike ``drop_caches``)."""
    for path in _files(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files(paths: Sequence[str]) -> list[str]:
    out = []
    for path in paths:
        if os.path.isdir(path):
            out += [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
        elif os.path.exists(path):
            out.append(path)
    return out


def fsync_path(path: str) -> None:
    """``fsync`` an existing file (or directory) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview of a contiguous CPU tensor's memory."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ---- a quiet machine --------------------------------------------------------------------------------
class CpuLoad:
    """Busy CPU time of the whole machine (``/proc/stat``) minus this process's and its reaped
    children's, over a stretch of wall time: how many cores other processes used meanwhile."""

    def __init__(self) -> None:
        self.wall, self.busy, self.own = time.perf_counter(), _busy_s(), _own_cpu_s()

    def foreign_cores(self) -> float:
        """Cores other processes kept busy, on average, since this object was made."""
        wall = time.perf_counter() - self.wall
        if wall <= 0:
            return float("nan")
        return max(0.0, (_busy_s() - self.busy) - (_own_cpu_s() - self.own)) / wall


def _busy_s() -> float:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
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
