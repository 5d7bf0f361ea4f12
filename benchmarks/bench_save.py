"""Save / restore benchmark: ckpt_engine against the physical limits and its peers, 1 and 2 ranks.

One run measures, on the same replicated state and within the same processes:

* physical limits: ``memmove`` of the rank's share into a warm preallocated buffer (one thread),
  ``os.write`` + ``fsync`` of those bytes (one new file per rank per save), ``preadv`` of the
  whole state back into a warm buffer (from the page cache: nothing is dropped);
* ours: ``Checkpointer.save`` (the stall), until ``wait()`` returns (committed), ``load()``,
  peak extra RSS. Each repetition times memcpy, raw write and our save back to back (the raw
  write and our save in alternating order), so that limit and engine see the same machine; the
  threaded copy limit is timed on both sides of every save, right before it and right after it;
* peers: ``torch.save`` (+ ``fsync``) / ``torch.load`` on rank 0, Lightning's ``AsyncCheckpointIO``
  on rank 0, ``torch.distributed.checkpoint`` ``save`` / ``async_save`` / ``load`` on every rank.

Every rank is one process holding the full state (``torch.multiprocessing.spawn``, gloo on
localhost for 2 ranks, no process group at all for 1). The harness sets ``torch.set_num_threads``
to cores / ranks in each rank process; the library itself never changes it.

Multi-level section (``_levels.py``): for the same state, time to durable on a local level 1 against
writing straight to S3 (moto), and the training-side stall with one level and with two.

Usage::

    .venv/bin/python benchmarks/bench_save.py                  # 1 GiB, a few minutes
    .venv/bin/python benchmarks/bench_save.py --size-mib 64    # smoke test, well under a minute
    .venv/bin/python benchmarks/bench_save.py --worlds none --levels-mib 64   # the multi-level section only
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _levels import bench_levels  # noqa: E402
from ckpt_engine.host import hugepages  # noqa: E402
from _common import (MemProbe, Metrics, RankCtx, StateSpec, aligned_copy, best_of, byte_view,  # noqa: E402
                     free_port, make_state, numbered, read_into, set_page_cache, share_slices, state_bytes,
                     states_equal, summary, timed, timed_save, write_fsync)
from _peers import bench_dcp_async, bench_dcp_save, bench_lightning, bench_torch_save, cold_and_warm_loads  # noqa: E402
from _report import write_report  # noqa: E402

KEEP_LAST = 1
"""Checkpoints ours keeps (``keep_last``), and raw files the raw write keeps.

On the VM this was written on (virtio-balloon with free page reporting), memory the guest has
freed goes back to the host and costs a host fault per page when touched again, page cache
included: a write that directly follows the deletion of a file of its size runs about 5x faster
than one that needs fresh pages (0.6 s against 3 s per GiB, measured), and first touches of new
buffers vary as much. With one file kept by both, and the raw write and our save alternating,
each write from the third on follows the other's deletion. Peers write one new file per round
and delete after their last round, so their first round follows the previous contender's cleanup.
"""


@dataclass(frozen=True)
class Config:
    """Command-line settings, passed to every rank process."""

    size_mib: int
    out: str
    dir: str
    reps: int
    peer_reps: int
    worlds: tuple[int, ...]
    keep: bool
    levels_mib: int = 64
    levels_reps: int = 6


# ---- physical limits ------------------------------------------------------------------------------
def gather_share(ctx: RankCtx) -> tuple[torch.Tensor, Callable[[], None], Callable[[], None]]:
    """A warm buffer of the rank's share of the state, the single-threaded copy that fills it, and
    the same copy split over this rank's cores (``torch.get_num_threads()``: cores ÷ ranks), each
    thread one run of about equal bytes (``ctypes.memmove`` releases the GIL)."""
    slices = share_slices(ctx.state, ctx.rank, ctx.world)
    buf = torch.zeros(sum(n for _, n in slices), dtype=torch.uint8)
    base = buf.data_ptr()
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(max(1, torch.get_num_threads()))]
    offset, per = 0, -(-buf.numel() // len(runs))
    for src, n in slices:  # cut at run boundaries so that every thread copies ``per`` bytes
        while n:
            take = min(n, per - offset % per)
            runs[offset // per].append((base + offset, src, take))
            offset, src, n = offset + take, src + take, n - take
    pool = ThreadPoolExecutor(len(runs))

    def copy() -> None:
        offset = 0
        for src, n in slices:
            ctypes.memmove(base + offset, src, n)
            offset += n

    def copy_run(run: list[tuple[int, int, int]]) -> None:
        for dst, src, n in run:
            ctypes.memmove(dst, src, n)

    def copy_threads() -> None:
        list(pool.map(copy_run, runs))

    copy()
    return buf, copy, copy_threads


class RawWriter:
    """``os.write`` + ``fsync`` of the share to a new file per call; the oldest beyond ``KEEP_LAST``
    is deleted after the write, as ours deletes after its commit (see ``KEEP_LAST`` for why)."""

    def __init__(self, ctx: RankCtx, data: memoryview, direct: bool = False) -> None:
        self.ctx, self.files, self.direct = ctx, [], direct
        self.data = aligned_copy(data) if direct else data
        self.tag = "rawd" if direct else "raw"

    def write(self) -> float:
        """Seconds to write and ``fsync`` one file."""
        path = self.ctx.path(f"{self.tag}-{self.ctx.rank}-{len(self.files)}.bin")
        seconds = timed(lambda: write_fsync(path, [self.data], self.direct))[0]
        self.files.append(path)
        if len(self.files) > KEEP_LAST:
            os.unlink(self.files[-KEEP_LAST - 1])
        return seconds

    def finish(self) -> None:
        """Leave only the newest file, as ``raw-<rank>.bin`` for the raw read."""
        for path in self.files[-KEEP_LAST:-1]:
            os.unlink(path)
        if self.direct:
            os.unlink(self.files[-1])
        else:
            os.replace(self.files[-1], self.ctx.path(f"raw-{self.ctx.rank}.bin"))


def _plain_pages(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def _huge_pages(n: int) -> torch.Tensor:
    return hugepages.empty((n,), torch.uint8)


FRESH_MEMORY = (_plain_pages, _huge_pages)
"""Fresh memory with 4 KiB pages and with huge pages: a restore's limit is the faster of the two."""


def read_fresh(ctx: RankCtx, paths: list[str], nbytes: int, cold: bool,
               allocate: Callable[[int], torch.Tensor], verify_step: int | None = None) -> float:
    """Seconds of one raw read of ``paths`` on the rank's cores (``torch.get_num_threads()`` threads)
    into ``allocate(nbytes)``, fresh memory (its allocation timed, as a restore's own is), the files
    first out of the page cache (``cold``) or in it; with ``verify_step``, each request of that many
    bytes hashed after it lands (``read_into``: the floor of a verified read)."""
    ctx.before_load()
    set_page_cache(ctx, paths, cold)
    return timed(lambda: read_into(paths, byte_view(allocate(nbytes)), torch.get_num_threads(), verify_step))[0]


def bench_raw_read(ctx: RankCtx) -> Metrics:
    """The floor of restore: ``preadv`` every rank's raw file (the whole state) into a warm buffer
    from the page cache (``load_s``), and into a freshly allocated buffer (restoring returns new
    tensors, whose first-touch page faults a warm buffer does not pay) on the rank's cores, with the
    files out of the page cache (``load_fresh_s``) and in it (``load_fresh_warm_s``).
    """
    paths = [ctx.path(f"raw-{r}.bin") for r in range(ctx.world)]
    dest = torch.zeros(sum(os.path.getsize(p) for p in paths), dtype=torch.uint8)
    view = byte_view(dest)
    warm = best_of(3, lambda: read_into(paths, view), lambda: set_page_cache(ctx, paths, cold=False))

    def fresh(cold: bool) -> float:
        return min(read_fresh(ctx, paths, dest.numel(), cold, allocate) for allocate in FRESH_MEMORY for _ in range(3))

    out = {"load_s": warm, "load_fresh_s": fresh(True), "load_fresh_warm_s": fresh(False), "bytes": dest.numel()}
    ctx.remove("raw-")
    return out


# ---- ours, side by side with memcpy and raw write -------------------------------------------------
def bench_ours(ctx: RankCtx) -> dict[str, Metrics]:
    """``reps`` saves of ``Checkpointer`` (stall, until committed, peak RSS growth), then ``load()``.

    Each repetition first times the memcpy limit, then the raw writes and our save (bracketed by
    the threaded copy limit), in rotating order: the disk of this machine changes speed by several times
    with what was written and deleted just before (see ``KEEP_LAST``), so limits taken minutes
    apart would not bound anything.
    """
    from ckpt_engine import Checkpointer, LocalComm, TorchDistComm

    buf, copy, copy_threads = gather_share(ctx)
    raw = RawWriter(ctx, byte_view(buf))
    rawd = RawWriter(ctx, byte_view(buf), direct=True)  # the page cache bypassed, as ours writes
    ck = Checkpointer(ctx.path("ours"), comm=TorchDistComm() if ctx.world > 1 else LocalComm(), keep_last=KEEP_LAST)
    probe, memcpy, memcpy_t, writes, dwrites, saves = MemProbe(), [], [], [], [], []

    def limit() -> float:
        ctx.barrier()
        memcpy_t.append(timed(copy_threads)[0])
        return memcpy_t[-1]

    def save() -> None:
        # The copy limit of the same bytes is timed on both sides of every save: right before it and
        # right after it (once committed and the retention done), and the save is judged against their
        # mean. Which of the two runs first after a 1 GiB write moves their ratio here by up to 0.1
        # (a probe of 2026-11-26), and the machine drifts between saves (the same copy took 96-161 ms within
        # one run): the mean of both sides cancels a drift that is linear over the save.
        before = limit()
        ctx.barrier()
        probe.start(keep_baseline=bool(saves), trim=not saves)
        stall, total, handle = timed_save(ck, ctx.state, len(saves))  # then waits for the retention
        rec = handle.record
        saves.append({"stall_s": stall, "total_s": total, "mem_extra_bytes": probe.peak_extra(),
                      "snapshot_s": rec.snapshot_s, "persist_s": rec.persist_s, "commit_s": rec.commit_s,
                      "other_s": total - stall - rec.persist_s - rec.commit_s, "share_bytes": rec.bytes,
                      "copy_before_s": before})
        saves[-1]["copy_after_s"] = limit()

    def write() -> None:
        ctx.barrier()
        writes.append(raw.write())

    def dwrite() -> None:
        ctx.barrier()
        dwrites.append(rawd.write())

    order = (write, dwrite, save)
    for step in range(ctx.reps):
        ctx.barrier()
        memcpy.append(timed(copy)[0])
        for fn in order[step % 3:] + order[:step % 3]:
            fn()
    raw.finish()
    rawd.finish()
    loads = best_loads(ctx, [ctx.path("ours")], ck.load)
    paired = paired_restores(ctx, ck.load)
    if ctx.world > 1:
        loads.update(bench_routes(ctx))
    ck.close()
    ctx.remove("ours")
    ours = _ours_metrics(saves, loads)
    return {"memcpy": {"stall_s": min(memcpy), "share_bytes": buf.numel(), **numbered(memcpy)},
            "memcpy_threads": {"stall_s": min(memcpy_t), "threads": torch.get_num_threads(), **numbered(memcpy_t)},
            "paired": {**paired_stalls(saves), **paired},
            "raw_write": {"total_first_s": writes[0], "total_s": min(writes[1:] or writes), "bytes": buf.numel(),
                          **numbered(writes)},
            "raw_write_direct": {"total_first_s": dwrites[0], "total_s": min(dwrites[1:] or dwrites),
                                 "bytes": buf.numel(), **numbered(dwrites)},
            "ours": ours}


def paired_stalls(saves: list[Metrics]) -> Metrics:
    """Each save's stall ÷ the mean of the copy limits timed right before and right after it, over
    saves 2..N (all of them when there is one): the median (the target), and, informative, the
    medians against the copy before and the copy after alone, and of the copy inside the save
    alone (``snapshot_s``, without encoding, planning and hand-over) against the mean. Pure."""
    steady = saves[1:] or saves

    def median_vs(limit: Callable[[Metrics], float], key: str = "stall_s") -> float:
        return statistics.median(s[key] / limit(s) for s in steady)

    def mean(s: Metrics) -> float:
        return (s["copy_before_s"] + s["copy_after_s"]) / 2

    return {"stall_vs_copy_median": median_vs(mean),
            "snapshot_vs_copy_median": median_vs(mean, "snapshot_s"),
            "stall_vs_copy_median_before": median_vs(lambda s: s["copy_before_s"]),
            "stall_vs_copy_median_after": median_vs(lambda s: s["copy_after_s"]),
            "pairs": float(len(steady))}


def best_loads(ctx: RankCtx, paths: list[str], load: Callable[[], Any]) -> Metrics:
    """Fastest of ``ctx.peer_reps`` cold and warm restores each (as many as each peer gets), and
    whether all were bit-exact (``load_ok``)."""
    best: Metrics = {}
    for _ in range(ctx.peer_reps):
        for key, value in cold_and_warm_loads(ctx, paths, load).items():
            best[key] = min(best.get(key, value), value)
    return best


def faster_memory(ctx: RankCtx, paths: list[str], nbytes: int, reads: int = 5) -> Callable[[int], torch.Tensor]:
    """The kind of fresh memory (``FRESH_MEMORY``) a warm raw read of ``paths`` fills faster: the lower
    median of ``reads`` reads of each, alternated, summed over the ranks so that all of them read
    into the same kind (with 3 reads each and no agreement, one rank of a run picked 4 KiB pages,
    3-5 x slower here, and its restore target read 2.6 x)."""
    times: dict[Callable[[int], torch.Tensor], list[float]] = {a: [] for a in FRESH_MEMORY}
    for _ in range(reads):
        for allocate in FRESH_MEMORY:
            times[allocate].append(read_fresh(ctx, paths, nbytes, False, allocate))
    medians = torch.tensor([statistics.median(times[a]) for a in FRESH_MEMORY], dtype=torch.float64)
    if ctx.world > 1:
        dist.all_reduce(medians)
    return FRESH_MEMORY[int(medians.argmin())]


def paired_restores(ctx: RankCtx, load: Callable[[], Any]) -> Metrics:
    """The restore target, robust to this machine's drift: ``ctx.reps`` rounds, each timing our
    ``load()``, a raw read of every rank's raw file (the same bytes) on the rank's cores
    (``read_fresh``) and the same read verified as ``load()`` verifies (each 1 MiB request hashed
    with xxh3 after it lands: ``LocalReader.verify_step``), into freshly allocated memory of the
    kind (``FRESH_MEMORY``: 4 KiB or huge pages) that read faster before the rounds
    (``restore_raw_huge_pages``: 1 for huge pages), right after each other in an order that
    rotates from round to round, cold and warm. Per cache: the median of the rounds' time ratios
    ours ÷ raw (``restore_vs_raw_<cache>_median``, the target), ours ÷ verified raw
    (``..._vs_verified_...``) and verified ÷ raw (``verified_vs_raw_<cache>_median``: the most a
    read that checks every byte gets of the raw read here, the cap of the target); each round's
    times (``restore_<cache>_<round>_{ours,raw,verified}_s``) and the median of our load's minor
    page faults (``restore_<cache>_minor_faults_median``; 262144 would be 1 GiB of fresh 4 KiB
    pages: fewer means the allocator handed back memory it had kept).

    A cold read on this VM takes 0.5 to 3.4 s/GiB from one moment to the next, so two best-of
    figures taken minutes apart (``load_s`` against ``raw_read.load_fresh_s``) say more about
    which of them was lucky than about the engine.
    """
    from ckpt_engine.storage.local import LocalReader

    raw = [ctx.path(f"raw-{r}.bin") for r in range(ctx.world)]
    nbytes = sum(os.path.getsize(p) for p in raw)
    minflt: dict[bool, list[int]] = {True: [], False: []}  # our load's minor page faults, by ``cold``

    def ours(cold: bool) -> float:
        ctx.before_load()
        set_page_cache(ctx, [ctx.path("ours")], cold)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds, loaded = timed(load)
        minflt[cold].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        del loaded
        return seconds

    # Every round times one raw read against one load, into the kind of fresh memory chosen once,
    # here. Runs up to 2026-11-26 took the faster of a 4 KiB and a huge-page read in every round, a best of two
    # against a single load: a stall of the raw read counted only where it hit both of its reads (even
    # so, warm raw reads 2-5 times slower than usual in 2 of 10 rounds per run; ours in 2-6 of 10).
    kind = faster_memory(ctx, raw, nbytes)
    contenders: dict[str, Callable[[bool], float]] = {
        "raw": lambda cold: read_fresh(ctx, raw, nbytes, cold, kind),
        "ours": ours,
        "verified": lambda cold: read_fresh(ctx, raw, nbytes, cold, kind, LocalReader.verify_step),
    }
    names = list(contenders)
    out: Metrics = {"restore_raw_huge_pages": float(kind is _huge_pages)}
    for cache, cold in (("cold", True), ("warm", False)):
        rounds: list[dict[str, float]] = []
        for i in range(ctx.reps):
            turn = names[i % 3:] + names[:i % 3]  # each contender first, second and third in turn
            rounds.append({name: contenders[name](cold) for name in turn})
            out.update({f"restore_{cache}_{i + 1}_{name}_s": t for name, t in rounds[-1].items()})
        for key, (num, den) in {f"restore_vs_raw_{cache}_median": ("ours", "raw"),
                                f"restore_vs_verified_{cache}_median": ("ours", "verified"),
                                f"verified_vs_raw_{cache}_median": ("verified", "raw")}.items():
            out[key] = statistics.median(r[num] / r[den] for r in rounds)
        out[f"restore_{cache}_minor_faults_median"] = statistics.median(minflt[cold])
    return out


def bench_routes(ctx: RankCtx) -> Metrics:
    """The collective ``restore()`` from a cold page cache by each route (restore_exchange.py):
    ``restore_<route>_s`` (best of ``peer_reps``, a new ``Checkpointer`` each, so ``auto``
    measures every time) and what ``auto`` chose (``auto_exchanged``: 1 when it exchanged)."""
    from ckpt_engine import Checkpointer, TorchDistComm

    out: Metrics = {}
    for route in ("read", "exchange", "auto"):
        for _ in range(ctx.peer_reps):
            ck = Checkpointer(ctx.path("ours"), comm=TorchDistComm(), readonly=True, restore_route=route)
            ctx.before_load()
            set_page_cache(ctx, [ctx.path("ours")], cold=True)
            seconds, restored = timed(ck.restore)
            ok = states_equal(restored.state, ctx.state)
            key = f"restore_{route}_s"
            out[key] = min(out.get(key, seconds), seconds)
            out["load_ok"] = min(out.get("load_ok", 1.0), float(ok))
            if route == "auto" and ck.restore_figures is not None:
                out["auto_exchanged"] = float(ck.restore_figures.route.endswith("exchange"))
                out.update({f"auto_{k}": v for k, v in ck.restore_figures.measured.items()})
            del restored
            ck.close()
    return out


def _ours_metrics(reps: list[Metrics], loads: Metrics) -> Metrics:
    """First save, steady state (best of reps 2..N), medians, and each repetition's figures.

    ``other_s`` is the part of the time to ``wait()`` outside snapshot, data write and commit:
    the index file, retention of older checkpoints (rank 0) and waiting for the commit (others).
    ``after_stall_s``: from the end of ``save()`` until committed, the background phase the raw
    write is compared with (the stall is compared with memcpy).
    """
    steady = reps[1:] or reps
    for r in reps:
        r["after_stall_s"] = r["total_s"] - r["stall_s"]
    out: Metrics = {"stall_first_s": reps[0]["stall_s"], "total_first_s": reps[0]["total_s"],
                    "share_bytes": reps[0]["share_bytes"], **loads,
                    "mem_extra_bytes": max(r["mem_extra_bytes"] for r in reps)}
    for key in ("stall_s", "total_s", "after_stall_s", "snapshot_s", "persist_s", "commit_s", "other_s"):
        stats = summary([r[key] for r in steady])
        out[key], out[key.replace("_s", "_median_s")] = stats["min"], stats["median"]
    for i, rep in enumerate(reps, 1):
        out.update({f"rep{i}_{k}": v for k, v in rep.items() if k != "share_bytes"})
    return out


def _alone(name: str, fn: Callable[[RankCtx], Metrics]) -> Callable[[RankCtx], dict[str, Metrics]]:
    return lambda ctx: {name: fn(ctx)}


STAGES: tuple[Callable[[RankCtx], dict[str, Metrics]], ...] = (
    bench_ours,  # also yields "memcpy" and "raw_write", and leaves the raw files for the raw read
    _alone("raw_read", bench_raw_read),
    _alone("torch_save", bench_torch_save),
    _alone("lightning", bench_lightning),
    _alone("dcp_save", bench_dcp_save),
    _alone("dcp_async", bench_dcp_async),
)


# ---- processes ------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, cfg: Config, workdir: str, port: int) -> None:
    """One rank: build the state, run every stage in turn, write ``rank-<r>.json``."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = RankCtx(rank, world, make_state(StateSpec(cfg.size_mib)), workdir, cfg.reps, cfg.peer_reps)
    results: dict[str, Metrics] = {}
    for stage in STAGES:
        elapsed, produced = timed(lambda: stage(ctx))
        for name, metrics in produced.items():
            results[name] = {**metrics, "stage_s": elapsed}
        gc.collect()
    results["state"] = {"bytes": state_bytes(ctx.state), "threads": torch.get_num_threads()}
    with open(os.path.join(workdir, f"rank-{rank}.json"), "w") as f:
        json.dump(results, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def spawn_ranks(main: Any, world: int, cfg: Any) -> list[dict]:
    """Run ``main(rank, world, cfg, workdir, port)`` in ``world`` processes; each rank's ``rank-N.json``."""
    workdir = os.path.join(cfg.dir, f"world{world}")
    os.makedirs(workdir, exist_ok=True)
    mp.spawn(main, args=(world, cfg, workdir, free_port()), nprocs=world, join=True)
    ranks = []
    for r in range(world):
        with open(os.path.join(workdir, f"rank-{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def run_world(world: int, cfg: Config) -> dict[str, Any]:
    """Spawn ``world`` rank processes; return every rank's figures and their slowest-rank merge."""
    ranks = spawn_ranks(rank_main, world, cfg)
    return {"ranks": ranks, "slowest": _slowest(ranks)}


def _slowest(ranks: list[dict[str, Metrics]]) -> dict[str, Metrics]:
    """Per contender and figure, the largest value any rank reported (times, bytes, memory), and
    the smallest for ``load_ok`` (a single rank's bad load fails the check)."""
    merged: dict[str, Metrics] = {}
    for name in ranks[0]:
        merged[name] = {}
        for r in ranks:
            for key, value in r.get(name, {}).items():
                pick = min if key == "load_ok" else max
                merged[name][key] = pick(merged[name].get(key, value), value)
    return merged


def parse_args(argv: list[str] | None = None) -> Config:
    """Command line → :class:`Config` (the working directory is created here)."""
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--out", default=os.path.join(here, "out"), help="report directory (default benchmarks/out)")
    p.add_argument("--dir", default=None,
                   help="where checkpoints are written: a fresh temp dir is made inside it (default /tmp)")
    p.add_argument("--reps", type=int, default=3, help="saves of ours per world size (default 3)")
    p.add_argument("--peer-reps", type=int, default=2, help="rounds of each peer, best kept (default 2)")
    p.add_argument("--worlds", default="1,2", help="rank counts to run (default 1,2)")
    p.add_argument("--keep", action="store_true", help="keep the working directory (each rank's raw JSON)")
    p.add_argument("--levels-mib", type=int, default=64,
                   help="state size of the multi-level section (local level + S3 on moto); 0 skips it (default 64)")
    p.add_argument("--levels-reps", type=int, default=6, help="saves per set-up in the multi-level section (default 6)")
    a = p.parse_args(argv)
    if min(a.size_mib, a.reps, a.peer_reps) < 1:
        p.error(f"--size-mib, --reps and --peer-reps must be >= 1, got {a.size_mib}, {a.reps}, {a.peer_reps}")
    worlds = () if a.worlds == "none" else tuple(int(w) for w in a.worlds.split(","))
    if any(w < 1 for w in worlds):
        p.error(f"--worlds must list positive rank counts, got {a.worlds!r}")
    workdir = tempfile.mkdtemp(prefix="bench_save-", dir=a.dir or "/tmp")
    return Config(a.size_mib, a.out, workdir, a.reps, a.peer_reps, worlds, a.keep, a.levels_mib, a.levels_reps)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    levels: dict[str, Any] = {}
    levels_md = ""
    try:
        worlds = {w: run_world(w, cfg) for w in cfg.worlds}
        if cfg.levels_mib > 0:
            levels, levels_md = bench_levels(cfg.levels_mib, cfg.levels_reps, cfg.dir)
    finally:
        if not cfg.keep:
            shutil.rmtree(cfg.dir, ignore_errors=True)
    config = {**asdict(cfg), "cpu_count": os.cpu_count(), "torch": torch.__version__}
    if worlds:
        print(write_report(worlds, config, cfg.out))
    if cfg.levels_mib > 0:
        print(levels_md)
    if levels:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "bench_levels.md"), "w") as f:
            f.write(levels_md + "\n")
        with open(os.path.join(cfg.out, "bench_levels.json"), "w") as f:
            json.dump({"config": config, "levels": levels}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
