"""Save / restore benchmark: ckpt_engine against the physical limits and its peers, 1 and 2 ranks.

What it measures, against which limits, peers and targets: ``benchmarks/README.md``, section bench_save.
Every rank is one process holding the full state (gloo on loopback for 2 ranks), with
``torch.set_num_threads(cores ÷ ranks)``; the slowest rank's figures are the job's. The save driver here
(:func:`bench_ours`, :func:`bench_peer`, :func:`run_rank`, :func:`run_worlds`) also measures
``bench_sharded``'s state: a :class:`Kind` says which.

Usage::

    .venv/bin/python benchmarks/bench_save.py --levels-mib 0 --reps 10   # 1 GiB, 1 and 2 ranks
    .venv/bin/python benchmarks/bench_save.py --size-mib 64 --reps 2 --peer-reps 1 --levels-mib 0   # quick
    .venv/bin/python benchmarks/bench_save.py --worlds none --levels-mib 64   # the multi-level section only
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import itertools
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable, Iterable, TypeVar
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # noqa: E402
from _common import (HERE, MemProbe, Metrics, MiB, RankCtx, RawWriter, StateSpec, best_of, best_rounds,  # noqa: E402
                     byte_view, gbps, make_state, num, numbered, parser, peer_rounds, read_into, run_stages,
                     set_page_cache, share_slices, slowest, spawn_ranks, state_bytes, states_equal, steady_figures,
                     table, timed, timed_save, verdict, write_report)
from ckpt_engine.host import hugepages  # noqa: E402

T = TypeVar("T")
KEEP_LAST = 1
"""Checkpoints ours keeps, and raw files the raw writes keep (see ``RawWriter``)."""
PEERS = _peers.REPLICATED
ORDER = ("memcpy", "memcpy_threads", "raw_write", "raw_write_direct", "raw_read", "ours", *PEERS)
LOAD_PEERS = {"torch_save": "torch.load", "dcp_save": "DCP load"}
MEM_SLACK_MIB = 4
"""Allowance over the snapshot buffer for interpreter and metadata noise (manifest JSON, records)."""
Agg = dict[str, dict[str, float]]


# ---- the save driver: ours beside its limits, then the peers, on a replicated or a sharded state ------
@dataclass(frozen=True)
class Kind:
    """A state the save driver measures. ``spans(ctx)``: the rank's bytes, (address, bytes) each;
    ``bracket``: the copy limit on the rank's cores is timed right before and right after each save (else
    a save pairs with the one-thread memcpy of its round); ``writers``: the raw writes + fsync of the
    rank's bytes, name → ``O_DIRECT``; ``figures(record, stall, total)``: a save's figures beside its stall
    and total; ``restores(ctx, ck)``: restores from ours after the rounds, figures per contender."""

    spans: Callable[[RankCtx], list[tuple[int, int]]]
    peers: dict[str, _peers.Peer]
    bracket: bool
    writers: dict[str, bool]
    figures: Callable[[Any, float, float], Metrics]
    restores: Callable[[RankCtx, Any], dict[str, Metrics]] | None = None


def gather_share(spans: list[tuple[int, int]]) -> tuple[torch.Tensor, Callable[[], None], Callable[[], None]]:
    """A warm buffer of the rank's bytes ``spans``, the single-threaded copy that fills it, and the same copy
    split over this rank's cores (``ctypes.memmove`` releases the GIL), each thread about equal bytes."""
    buf = torch.zeros(sum(n for _, n in spans), dtype=torch.uint8)
    base = buf.data_ptr()
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(max(1, torch.get_num_threads()))]
    offset, per = 0, -(-buf.numel() // len(runs))
    for src, n in spans:  # cut at run boundaries so that every thread copies ``per`` bytes
        while n:
            take = min(n, per - offset % per)
            runs[offset // per].append((base + offset, src, take))
            offset, src, n = offset + take, src + take, n - take
    pool = ThreadPoolExecutor(len(runs))

    def copy_run(run: list[tuple[int, int, int]]) -> None:
        for dst, src, n in run:
            ctypes.memmove(dst, src, n)

    def copy() -> None:
        copy_run([run for r in runs for run in r])

    def copy_threads() -> None:
        list(pool.map(copy_run, runs))

    copy()
    return buf, copy, copy_threads


def rotating(contenders: dict[str, Callable[[], T]], rounds: int, before: Callable[[], Any] | None = None
             ) -> list[dict[str, T]]:
    """``rounds`` rounds of every contender (``before`` ahead of each), in an order rotating by round (the
    machine drifts: none always runs first); each round's results by name, in the order they ran."""
    names, out = list(contenders), []
    for i in range(rounds):
        if before is not None:
            before()
        out.append({name: contenders[name]() for name in names[i % len(names):] + names[:i % len(names)]})
    return out


def bench_ours(ctx: RankCtx, kind: Kind | None = None) -> dict[str, Metrics]:
    """``reps`` rounds, each: the memcpy limit of the rank's bytes, then the raw writes and our save in
    rotating order (this disk changes speed with what was written just before), with ``kind.bracket`` the
    threaded copy limit timed right before and right after each save (the machine drifts between saves);
    then ``kind.restores``. The limits' figures too; the buffered raw file is left for the raw read."""
    from ckpt_engine import Checkpointer, LocalComm, TorchDistComm

    kind = kind or REPLICATED
    spans = kind.spans(ctx)
    buf, copy, copy_threads = gather_share(spans)
    writers = {k: RawWriter(ctx, byte_view(buf), direct, KEEP_LAST) for k, direct in kind.writers.items()}
    ck = Checkpointer(ctx.path("ours"), comm=TorchDistComm() if ctx.world > 1 else LocalComm(), keep_last=KEEP_LAST,
                      copy_threads=ctx.copy_threads or None)
    probe, memcpy, memcpy_t, saves, writes = MemProbe(), [], [], [], {k: [] for k in writers}

    def limit() -> float:
        ctx.barrier()
        memcpy_t.append(timed(copy_threads)[0])
        return memcpy_t[-1]

    def save() -> None:
        pair = {"copy_before_s": limit()} if kind.bracket else {"memcpy_s": memcpy[-1]}
        ctx.barrier()
        probe.start(keep_baseline=bool(saves), trim=not saves)
        stall, total, handle = timed_save(ck, ctx.state, len(saves))  # then waits for the retention
        rec = handle.record  # the CPU of every thread that worked on it: encoding, copy, persist, commit
        cpu = rec.encode_cpu_s + rec.snapshot_cpu_s + rec.persist_cpu_s + rec.commit_cpu_s
        saves.append({"stall_s": stall, "total_s": total, "cpu_s": cpu, **kind.figures(rec, stall, total),
                      "mem_extra_bytes": probe.peak_extra(), "share_bytes": handle.record.bytes, **pair})
        if kind.bracket:
            saves[-1]["copy_after_s"] = limit()

    def write(k: str) -> Callable[[], None]:
        return lambda: (ctx.barrier(), writes[k].append(writers[k].write()))

    rotating({**{k: write(k) for k in writers}, "ours": save}, ctx.reps,
             lambda: (ctx.barrier(), memcpy.append(timed(copy)[0])))
    for writer in writers.values():
        writer.finish()
    restores = kind.restores(ctx, ck) if kind.restores is not None else {}
    ck.close()
    ctx.remove("ours")
    limits = ("share_bytes", "mem_extra_bytes", "memcpy_s", "copy_before_s", "copy_after_s")
    ours = {"stall_first_s": saves[0]["stall_s"], "total_first_s": saves[0]["total_s"],
            "share_bytes": saves[0]["share_bytes"], "mem_extra_bytes": max(s["mem_extra_bytes"] for s in saves),
            **steady_figures(saves, [k for k in saves[0] if k not in limits]), **restores.pop("ours", {})}
    for i, rep in enumerate(saves, 1):
        ours.update({f"rep{i}_{k}": v for k, v in rep.items() if k not in ("memcpy_s", "share_bytes")})
    out = {"memcpy": {"stall_s": min(memcpy), "share_bytes": buf.numel(), **numbered(memcpy)},
           **{k: {"total_first_s": w[0], "total_s": min(w[1:] or w), "bytes": buf.numel(), **numbered(w)}
              for k, w in writes.items()}, "ours": ours}
    if kind.bracket:
        out["memcpy_threads"] = {"stall_s": min(memcpy_t), "threads": torch.get_num_threads(), **numbered(memcpy_t)}
        out["paired"] = {**paired_stalls(saves), **restores.pop("paired", {})}
    else:
        paired = [s["stall_s"] / s["memcpy_s"] for s in saves[1:] or saves]  # each save ÷ the memcpy before it
        ours.update(tensors=float(len(spans)), stall_paired_median=statistics.median(paired),
                    stall_paired_min=min(paired))
    return {**out, **restores}


def bench_peer(ctx: RankCtx, name: str, peer: _peers.Peer) -> Metrics:
    """``ctx.peer_reps`` rounds of ``peer`` (:func:`peer_rounds`), its load, if any, timed cold and warm."""
    load = None if peer.load is None else (
        lambda path: cold_and_warm_loads(ctx, [path], lambda: peer.load(ctx.state, path)))
    with peer.using() as kwargs:
        return peer_rounds(ctx, name, lambda path: peer.save(ctx, path, **kwargs), load, peer.rank0)


def start_rank(rank: int, world: int, port: int) -> None:
    """A rank's process: warnings off, its share of the cores, a gloo process group on loopback with others."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world)


def run_rank(ctx: RankCtx, kind: Kind, stages: list[Callable[[], dict[str, Metrics]]], peers: Iterable[str],
             **state: Any) -> None:
    """Ours, then ``stages``, then each of ``peers`` in turn; every figure to ``rank-<r>.json`` with the
    ``state``'s figures."""
    run_stages(ctx, [lambda: bench_ours(ctx, kind), *stages,
                     *((lambda p=p: {p: bench_peer(ctx, p, kind.peers[p])}) for p in peers)],
               ctx.path(f"rank-{ctx.rank}.json"), state={**state, "threads": torch.get_num_threads()})


def run_worlds(rank_main: Callable[..., None], cfg: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Each world size of ``cfg.worlds`` in turn, a process per rank: every rank's figures and the slowest
    rank's; the scratch directory ``cfg.dir`` removed afterwards unless ``cfg.keep``."""
    results = {}
    try:
        for w in cfg.worlds:
            ranks = spawn_ranks(rank_main, w, cfg)
            results[w] = {"ranks": ranks, "slowest": slowest(ranks)}
    finally:
        if not cfg.keep:
            shutil.rmtree(cfg.dir, ignore_errors=True)
    return results


def driver_parser(doc: str | None, size: tuple[int, str], reps: int,
                  worlds: tuple[str, str]) -> argparse.ArgumentParser:
    """The command line both states share: ``size`` and ``worlds`` are (default, what it is)."""
    p = parser(doc, scratch="/tmp")
    p.add_argument("--size-mib", type=int, default=size[0], help=f"{size[1]} (default {size[0]})")
    p.add_argument("--reps", type=int, default=reps, help=f"saves of ours per world size (default {reps})")
    p.add_argument("--peer-reps", type=int, default=2, help="rounds of each peer, best kept (default 2)")
    p.add_argument("--worlds", default=worlds[0], help=f"rank counts to run, {worlds[1]} (default {worlds[0]})")
    p.add_argument("--keep", action="store_true", help="keep the working directory (each rank's raw JSON)")
    p.add_argument("--copy-threads", type=int, default=0, help="ours' copy_threads (default 0: a thread per core "
                   "of the rank, the Checkpointer's default)")
    return p


# ---- the replicated state: its limits and restores ----------------------------------------------------
def _plain_pages(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def _huge_pages(n: int) -> torch.Tensor:
    return hugepages.empty((n,), torch.uint8)


FRESH_MEMORY = (_plain_pages, _huge_pages)
"""Fresh memory with 4 KiB pages and with huge pages: a restore's limit reads into the faster."""


def read_fresh(ctx: RankCtx, paths: list[str], nbytes: int, cold: bool,
               allocate: Callable[[int], torch.Tensor], verify_step: int | None = None) -> float:
    """Seconds of one raw read of ``paths`` on the rank's cores into ``allocate(nbytes)`` (allocation
    timed, as a restore's own is), files out of the page cache (``cold``) or in it; ``verify_step``: each
    request hashed as ``load()`` verifies."""
    ctx.before_load()
    set_page_cache(ctx, paths, cold)
    return timed(lambda: read_into(paths, byte_view(allocate(nbytes)), torch.get_num_threads(), verify_step))[0]


def bench_raw_read(ctx: RankCtx) -> dict[str, Metrics]:
    """``preadv`` of every rank's raw file into a warm buffer from the page cache (``load_s``), and into
    fresh memory cold (``load_fresh_s``) and warm (``load_fresh_warm_s``); best of 3 of each kind."""
    paths = [ctx.path(f"raw-{r}.bin") for r in range(ctx.world)]
    dest = torch.zeros(sum(os.path.getsize(p) for p in paths), dtype=torch.uint8)
    view = byte_view(dest)
    warm = best_of(3, lambda: read_into(paths, view), lambda: set_page_cache(ctx, paths, cold=False))

    def fresh(cold: bool) -> float:
        return min(read_fresh(ctx, paths, dest.numel(), cold, allocate) for allocate in FRESH_MEMORY for _ in range(3))

    out = {"load_s": warm, "load_fresh_s": fresh(True), "load_fresh_warm_s": fresh(False), "bytes": dest.numel()}
    ctx.remove("raw-")
    return {"raw_read": out}


def replicated_figures(rec: Any, stall: float, total: float) -> Metrics:
    """A save's copy, persist and commit; the rest of its time after the stall, and that time."""
    return {"snapshot_s": rec.snapshot_s, "persist_s": rec.persist_s, "commit_s": rec.commit_s,
            "other_s": total - stall - rec.persist_s - rec.commit_s, "after_stall_s": total - stall}


def replicated_restores(ctx: RankCtx, ck: Any) -> dict[str, Metrics]:
    """``load()`` cold and warm, the fastest of ``ctx.peer_reps`` of each (as many as each peer gets); the
    paired rounds (:func:`paired_restores`); with several ranks, the collective ``restore()`` by route."""
    ours = best_rounds([cold_and_warm_loads(ctx, [ctx.path("ours")], ck.load) for _ in range(ctx.peer_reps)])
    paired = paired_restores(ctx, ck.load)
    return {"ours": {**ours, **(bench_routes(ctx) if ctx.world > 1 else {})}, "paired": paired}


def stall_pairs(saves: list[Metrics]) -> dict[str, list[float]]:
    """Per save 2..N, its stall ÷ the mean of the copies timed right before and right after it (``stall``)
    and ÷ each alone (``before``, ``after``); the copy inside the save alone ÷ that mean (``snapshot``). Pure."""
    steady = saves[1:] or saves
    means = [(s["copy_before_s"] + s["copy_after_s"]) / 2 for s in steady]
    return {"stall": [s["stall_s"] / m for s, m in zip(steady, means)],
            "snapshot": [s["snapshot_s"] / m for s, m in zip(steady, means)],
            "before": [s["stall_s"] / s["copy_before_s"] for s in steady],
            "after": [s["stall_s"] / s["copy_after_s"] for s in steady]}


def paired_stalls(saves: list[Metrics]) -> Metrics:
    """The medians of :func:`stall_pairs`: ``stall`` is the target, the others informative. Pure."""
    median = {k: statistics.median(v) for k, v in stall_pairs(saves).items()}
    return {"stall_vs_copy_median": median["stall"], "snapshot_vs_copy_median": median["snapshot"],
            "stall_vs_copy_median_before": median["before"], "stall_vs_copy_median_after": median["after"],
            "pairs": float(len(saves[1:] or saves))}


def cold_and_warm_loads(ctx: RankCtx, paths: list[str], load: Callable[[], Any]) -> Metrics:
    """``load()`` timed with ``paths`` out of the page cache (``load_s``), then in it (``load_warm_s``),
    each from freshly freed memory; ``load_ok``: both bit-exact."""
    out: Metrics = {"load_ok": 1.0}
    for key, cold in (("load_s", True), ("load_warm_s", False)):
        ctx.before_load()
        set_page_cache(ctx, paths, cold)
        out[key], loaded = timed(load)
        out["load_ok"] = min(out["load_ok"], float(states_equal(loaded, ctx.state)))
        del loaded
    return out


def faster_memory(ctx: RankCtx, paths: list[str], nbytes: int, reads: int = 5) -> Callable[[int], torch.Tensor]:
    """The kind of fresh memory a warm raw read of ``paths`` fills faster: the lower median of ``reads``
    reads of each, alternated, summed over the ranks so that all of them read into the same kind."""
    times: dict[Callable[[int], torch.Tensor], list[float]] = {a: [] for a in FRESH_MEMORY}
    for _ in range(reads):
        for allocate in FRESH_MEMORY:
            times[allocate].append(read_fresh(ctx, paths, nbytes, False, allocate))
    medians = torch.tensor([statistics.median(times[a]) for a in FRESH_MEMORY], dtype=torch.float64)
    if ctx.world > 1:
        dist.all_reduce(medians)
    return FRESH_MEMORY[int(medians.argmin())]


def paired_restores(ctx: RankCtx, load: Callable[[], Any]) -> Metrics:
    """The restore target, robust to this machine's drift (a cold read takes 0.5-3.4 s/GiB from one moment
    to the next): ``ctx.reps`` rounds, cold then warm, each timing our ``load()``, a raw read of the same
    bytes (``read_fresh``) and that read verified as ``load()`` verifies, into the kind of fresh memory
    that read faster before the rounds, in an order rotating by round. Per cache the medians of the
    rounds' ratios ours ÷ raw (the target), ours ÷ verified and verified ÷ raw (the cap), each round's
    times and the median of our load's minor page faults."""
    from ckpt_engine.storage.local import LocalReader

    raw = [ctx.path(f"raw-{r}.bin") for r in range(ctx.world)]
    nbytes = sum(os.path.getsize(p) for p in raw)
    minflt: dict[bool, list[int]] = {True: [], False: []}

    def ours(cold: bool) -> float:
        ctx.before_load()
        set_page_cache(ctx, [ctx.path("ours")], cold)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds, loaded = timed(load)
        minflt[cold].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        del loaded
        return seconds

    kind = faster_memory(ctx, raw, nbytes)
    contenders: dict[str, Callable[[bool], float]] = {
        "raw": lambda cold: read_fresh(ctx, raw, nbytes, cold, kind), "ours": ours,
        "verified": lambda cold: read_fresh(ctx, raw, nbytes, cold, kind, LocalReader.verify_step)}
    out: Metrics = {"restore_raw_huge_pages": float(kind is _huge_pages)}
    for cache, cold in (("cold", True), ("warm", False)):
        rounds = rotating({name: partial(f, cold) for name, f in contenders.items()}, ctx.reps)
        for i, times in enumerate(rounds, 1):
            out.update({f"restore_{cache}_{i}_{name}_s": t for name, t in times.items()})
        for key, (a, b) in {f"restore_vs_raw_{cache}_median": ("ours", "raw"),
                            f"restore_vs_verified_{cache}_median": ("ours", "verified"),
                            f"verified_vs_raw_{cache}_median": ("verified", "raw")}.items():
            out[key] = statistics.median(r[a] / r[b] for r in rounds)
        out[f"restore_{cache}_minor_faults_median"] = statistics.median(minflt[cold])
    return out


def bench_routes(ctx: RankCtx) -> Metrics:
    """The collective ``restore()`` from a cold page cache by each route (best of ``peer_reps``, a new
    ``Checkpointer`` each) and what ``auto`` chose (``auto_exchanged``: 1 when it exchanged)."""
    from ckpt_engine import Checkpointer, TorchDistComm

    out: Metrics = {}
    for route in ("read", "exchange", "auto"):
        for _ in range(ctx.peer_reps):
            ck = Checkpointer(ctx.path("ours"), comm=TorchDistComm(), readonly=True, restore_route=route)
            ctx.before_load()
            set_page_cache(ctx, [ctx.path("ours")], cold=True)
            seconds, restored = timed(ck.restore)
            out[f"restore_{route}_s"] = min(out.get(f"restore_{route}_s", seconds), seconds)
            out["load_ok"] = min(out.get("load_ok", 1.0), float(states_equal(restored.state, ctx.state)))
            if route == "auto" and ck.restore_figures is not None:
                out["auto_exchanged"] = float(ck.restore_figures.route.endswith("exchange"))
                out.update({f"auto_{k}": v for k, v in ck.restore_figures.measured.items()})
            del restored
            ck.close()
    return out


REPLICATED = Kind(lambda ctx: share_slices(ctx.state, ctx.rank, ctx.world), PEERS, True,
                  {"raw_write": False, "raw_write_direct": True}, replicated_figures, replicated_restores)
"""The replicated state: every rank saves its 1/N of every tensor (DeepFreeze-style), ``LocalComm`` alone."""


# ---- rows and targets --------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the table: a figure of ours next to its physical limit and its best peer."""

    world: str
    metric: str
    unit: str
    ours: float
    limit: float
    limit_name: str
    peer: float | None
    peer_name: str
    target: str
    passed: bool | None

    @property
    def vs_limit(self) -> float:
        """Ours ÷ the limit."""
        return self.ours / self.limit if self.limit else float("nan")

    @property
    def vs_peer(self) -> float:
        """Ours ÷ the best peer."""
        return self.ours / self.peer if self.peer else float("nan")


Check = tuple[str, Callable[[float, float], bool] | None]
INFO: Check = ("info", None)
AT_MOST_110: Check = ("≤ 1.10 × limit", lambda o, lim: o <= 1.10 * lim)
AT_LEAST_090: Check = ("≥ 0.90 × limit", lambda o, lim: o >= 0.90 * lim)
SAME = ("same bytes, same moment", 1.0)


def _row(w: str, metric: str, unit: str, ours: float, limit: tuple[str, float], peers: dict[str, float] | None = None,
         lower_is_better: bool = True, check: Check = INFO) -> Row:
    """A row whose check's test ``(ours, limit)`` decides PASS/FAIL (``None``: informative only)."""
    peers = peers or {}
    best = (min if lower_is_better else max)(peers, key=peers.__getitem__) if peers else "-"
    return Row(w, metric, unit, ours, limit[1], limit[0], peers.get(best), best, check[0],
               None if check[1] is None else check[1](ours, limit[1]))


def world_rows(world: int, agg: Agg) -> list[Row]:
    """Stall, time to committed, persist, restore and memory rows of one world size."""
    w, ours, total, share = str(world), agg["ours"], agg["state"]["bytes"], agg["ours"]["share_bytes"]
    persist_ratio = paired_persist(agg)
    peers = {k: {PEERS[p].label: f(agg[p]) for p in PEERS if key in agg[p]} for k, key, f in (
        ("stall", "stall_s", lambda m: m["stall_s"] * 1e3), ("total", "total_s", lambda m: m["total_s"]),
        ("gbps", "total_s", lambda m: gbps(total // world, m["total_s"])),
        ("mem", "mem_extra_bytes", lambda m: m["mem_extra_bytes"] / MiB))}
    n = int(agg["memcpy_threads"]["threads"])  # the same bytes split over the rank's cores
    memcpy = min([("memcpy of share, 1 thread", agg["memcpy"]["stall_s"] * 1e3), (
        f"memcpy of share, {n} thread{'s' if n > 1 else ''}", agg["memcpy_threads"]["stall_s"] * 1e3)],
                 key=lambda c: c[1])
    kinds = [("raw write+fsync", agg["raw_write"]), ("raw O_DIRECT write+fsync", agg["raw_write_direct"])]
    raw_name, raw_w = min(kinds, key=lambda k: k[1]["total_s"])
    first_name, raw_first = min(kinds, key=lambda k: k[1]["total_first_s"])
    return [
        _row(w, "stall, steady state (best of saves 2..N)", "ms", ours["stall_s"] * 1e3, memcpy, peers["stall"]),
        *paired_stall(w, agg),
        _row(w, "stall, first save", "ms", ours["stall_first_s"] * 1e3, memcpy, peers["stall"]),
        _row(w, "CPU per checkpoint, every thread: encode, copy, persist (hash + write), commit (median of saves "
                "2..N)", "ms", ours["cpu_median_s"] * 1e3,
             ("memcpy of share, 1 thread", agg["memcpy"]["stall_s"] * 1e3)),
        _row(w, "time to committed (steady)", "s", ours["total_s"], (raw_name, raw_w["total_s"]), peers["total"]),
        _row(w, "time to committed, first save", "s", ours["total_first_s"],
             (f"{first_name}, first", raw_first["total_first_s"])),
        _row(w, "persist throughput of rank share (after the stall)", "GB/s",
             gbps(share, ours["after_stall_s"]),
             (raw_name, gbps(raw_w["bytes"], raw_w["total_s"])),
             peers["gbps"], False, INFO if persist_ratio is not None else AT_LEAST_090),
        *paired_persist_rows(w, persist_ratio),
        *restore_rows(w, agg, total),
        _row(w, "peak extra host memory (1 in-flight snapshot)", "MiB", ours["mem_extra_bytes"] / MiB,
             ("rank share", share / MiB), peers["mem"], True,
             (f"≤ 1.00 × limit + {MEM_SLACK_MIB} MiB", lambda o, lim: o <= lim + MEM_SLACK_MIB)),
    ]


def paired_stall(w: str, agg: Agg) -> list[Row]:
    """The stall target: the median over saves 2..N of each stall ÷ the mean of the threaded copies timed
    right before and right after it (slowest rank), with each side's median and the copy alone beside it."""
    paired = agg["paired"]
    n = int(paired["pairs"])
    alone = f"alone ({n} save{'s' if n != 1 else ''})"
    return [_row(w, "stall ÷ copy on the rank's cores on both sides of it (their mean, median of saves 2..N)", "×",
                 paired["stall_vs_copy_median"], SAME, check=AT_MOST_110),
            _row(w, f"of which against the copy right before the save {alone}", "×",
                 paired["stall_vs_copy_median_before"], SAME),
            _row(w, f"of which against the copy right after it {alone}", "×",
                 paired["stall_vs_copy_median_after"], SAME),
            _row(w, "of which the copy alone (the snapshot inside `save()`: no encoding, planning or hand-over) ÷ the "
                    "same mean", "×", paired["snapshot_vs_copy_median"], SAME)]


def persist_ratios(agg: Agg) -> list[float]:
    """The persist target's pairs: per round 2..N, the faster raw write + fsync of the round (buffered or
    ``O_DIRECT``) ÷ our time after the stall in that round; empty without per-round figures. Pure."""
    ours, buffered, direct = agg["ours"], agg.get("raw_write", {}), agg.get("raw_write_direct", {})
    return [min(buffered[f"rep{i}_s"], direct[f"rep{i}_s"]) / ours[f"rep{i}_after_stall_s"]
            for i in counted(ours, "rep{}_after_stall_s", 2) if f"rep{i}_s" in buffered and f"rep{i}_s" in direct]


def counted(m: Metrics, key: str, start: int) -> list[int]:
    """The numbers ``i`` from ``start`` on for which ``key.format(i)`` is in ``m``, up to the first missing."""
    return list(itertools.takewhile(lambda i: key.format(i) in m, itertools.count(start)))


def paired_persist(agg: Agg) -> float | None:
    """The persist target: the median of :func:`persist_ratios` (``None`` without per-round figures)."""
    ratios = persist_ratios(agg)
    return statistics.median(ratios) if ratios else None


def paired_persist_rows(w: str, ratio: float | None) -> list[Row]:
    """The row of :func:`paired_persist`'s ``ratio``, when the run has its figures."""
    return [] if ratio is None else [_row(w, "persist ÷ raw write + fsync of the same round (median of saves 2..N)",
                                          "×", ratio, ("same bytes, same round", 1.0), None, False, AT_LEAST_090)]


def restore_rows(w: str, agg: Agg, total: int) -> list[Row]:
    """``load()`` cold and warm: against the raw read into fresh memory (paired by round: the target;
    best of rounds: informative), the verified raw read and ``torch.load``; with several ranks, the
    collective ``restore()`` by each route."""
    ours, raw_r, paired, rows = agg["ours"], agg["raw_read"], agg["paired"], []
    for cache, key, raw_key in (("cold", "load_s", "load_fresh_s"), ("warm", "load_warm_s", "load_fresh_warm_s")):
        peers = {f"{LOAD_PEERS[p]} ({cache})": gbps(total, agg[p][key]) for p in LOAD_PEERS if key in agg[p]}
        rows += [_row(w, f"restore throughput, {cache} page cache (best of rounds)", "GB/s", gbps(total, ours[key]),
                      (f"raw read into fresh buffer ({cache})", gbps(raw_r["bytes"], raw_r[raw_key])), peers, False),
                 _row(w, f"restore ÷ raw read into fresh memory just before or after it, {cache} (median of rounds)",
                      "×", 1 / paired[f"restore_vs_raw_{cache}_median"], SAME, None, False, AT_LEAST_090),
                 _row(w, f"raw read + xxh3 of every MiB ÷ raw read, {cache}: the most a verified restore reaches "
                         "(median of rounds)", "×", 1 / paired[f"verified_vs_raw_{cache}_median"], SAME, None, False),
                 _row(w, f"restore ÷ raw read + xxh3 of every MiB, {cache} (median of rounds)", "×",
                      1 / paired[f"restore_vs_verified_{cache}_median"], SAME, None, False),
                 _row(w, f"restore throughput ÷ torch.load, {cache}", "GB/s", gbps(total, ours[key]),
                      (f"torch.load ({cache})", gbps(total, agg["torch_save"][key])), peers, False,
                      ("≥ 1.00 × torch.load", lambda o, lim: o >= lim))]
    rows.append(_row(w, "restore throughput vs raw read into a warm buffer", "GB/s", gbps(total, ours["load_warm_s"]),
                     ("raw read (page cache, warm buffer)", gbps(raw_r["bytes"], raw_r["load_s"])), None, False))
    if "restore_exchange_s" in ours:
        chose = "exchange" if ours.get("auto_exchanged") else "read"
        rows.append(_row(w, "collective restore, cold: each rank reads 1/N + exchange", "GB/s",
                         gbps(total, ours["restore_exchange_s"]),
                         ("every rank reads everything", gbps(total, ours["restore_read_s"])),
                         {f"auto (chose {chose})": gbps(total, ours["restore_auto_s"])}, False))
    return rows


def fastest_copy(agg: Agg) -> float:
    """Seconds of the rank's fastest copy of its share: one ``memmove``, or split over its cores."""
    return min(agg["memcpy"]["stall_s"], agg["memcpy_threads"]["stall_s"])


def scaling_row(one: Agg, two: Agg) -> Row:
    """2-rank slowest-rank stall ÷ 1-rank stall, against the same scaling of the machine's fastest copy
    of each rank's share (a single rank already copies on every core, so a stall scales as that copy)."""
    peers = {PEERS[p].label: two[p]["stall_s"] / one[p]["stall_s"] for p in PEERS if "stall_s" in one[p]}
    return _row("2 vs 1", "stall scaling (2-rank slowest ÷ 1-rank)", "×",
                two["ours"]["stall_s"] / one["ours"]["stall_s"],
                ("fastest copy's scaling", fastest_copy(two) / fastest_copy(one)), peers, True, AT_MOST_110)


def markdown(rows: list[Row], worlds: dict[int, dict[str, Any]], config: dict[str, Any]) -> str:
    """The headline table, then every contender's raw figures per world size."""
    lines = [f"# bench_save: {config['size_mib']} MiB state, {config['cpu_count']} cores, torch {config['torch']}",
             "", "Slowest rank of each world size; the method, limits and targets: benchmarks/README.md.", "",
             *table(["ranks", "metric", "unit", "ours", "physical limit", "ours ÷ limit", "best peer",
                     "ours ÷ best peer", "target", "result"],
                    [[r.world, r.metric, r.unit, num(r.ours), f"{r.limit_name}: {num(r.limit)}", num(r.vs_limit),
                      f"{r.peer_name}: {num(r.peer)}", num(r.vs_peer), r.target, verdict(r.passed)] for r in rows]),
             ""]
    cells = []
    for w, res in worlds.items():
        for name in ORDER:
            m = res["slowest"].get(name, {})
            cells.append([w, name, *figure_cells(m, {"stall_s": 1e3, "total_s": 1, "load_s": 1, "load_warm_s": 1,
                                                 "mem_extra_bytes": 1 / MiB}),
                          {1.0: "yes", 0.0: "NO"}.get(m.get("load_ok", -1), "-")])
            if "load_fresh_s" in m:
                cells.append([w, f"{name} (into fresh buffer)", "-", "-", num(m["load_fresh_s"]),
                              num(m.get("load_fresh_warm_s")), "-", "-"])
            cells += [[w, f"{name} restore(), route {route}", "-", "-", num(m[f"restore_{route}_s"]), "-", "-", "-"]
                      for route in ("read", "exchange", "auto") if f"restore_{route}_s" in m]
    lines += table(["ranks", "contender", "stall ms", "to durable s", "restore s (cold)", "restore s (warm)",
                    "extra RSS MiB", "restore bit-exact"], cells)
    return "\n".join(lines) + "\n"


def figure_cells(m: Metrics, columns: dict[str, float]) -> list[str]:
    """The cells of ``m``'s figures ``columns`` (key → the factor of its unit); ``-`` for one it lacks."""
    return [num(None if m.get(k) is None else m[k] * f) for k, f in columns.items()]


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


# ---- the multi-level section (S3 = moto) ---------------------------------------------------------
def _level_saves(ck: Any, state: dict, reps: int, beside: Any = None) -> dict[str, Any]:
    """``reps`` saves after a first one (which allocates the buffer, left out); ``beside``: run in a thread
    started just before each save and joined after it."""
    stalls, durable = [], []
    for step in range(reps + 1):
        thread = threading.Thread(target=beside) if beside is not None and step else None
        if thread is not None:
            thread.start()
            time.sleep(0.05)
        start = time.perf_counter()
        ck.save(state, step)
        stall = time.perf_counter() - start
        ck.wait()
        if thread is not None:
            thread.join()
        if step:
            stalls.append(stall)
            durable.append(time.perf_counter() - start)
        ck.wait(retention=True)  # untimed: the next save does not run beside this one's retention
    out: dict[str, Any] = {"stall_s": statistics.median(stalls), "durable_s": statistics.median(durable),
                           "stalls": stalls, "durables": durable}
    if ck.levels[1:]:
        ck.wait(flush=True)
        flushed = [r for r in ck.flush_records if r.committed and r.step > 0]
        out.update(l2_durable_s=statistics.median(r.durable_s for r in flushed) if flushed else float("nan"),
                   l2_lag_s=statistics.median(r.lag_s for r in flushed) if flushed else float("nan"),
                   **{k: ck.counters[k] for k in ("flushed", "flush_skipped", "flush_bytes")})
    ck.close()
    return out


def bench_levels(size_mib: int, reps: int, workdir: str) -> tuple[dict[str, Any], str]:
    """The multi-level section, one process: ``s3 direct``, ``local only``, ``local only + raw upload`` (an
    s3fs upload of the same bytes beside each save) and ``local + s3`` (two levels), back to back. Figures
    and a Markdown report; none and a note when moto is not installed."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    try:
        importlib.import_module("moto.server")
        import s3server
    except ImportError as e:
        return {}, f"multi-level section skipped: {e} (install the test extra: pip install 'ckpt-suite[test]')"
    from ckpt_engine import Checkpointer
    from ckpt_engine.storage import open_storage

    state, server, run = make_state(StateSpec(size_mib)), s3server.start(), uuid.uuid4().hex[:8]
    try:
        with mock.patch.dict(os.environ, server.env), tempfile.TemporaryDirectory(dir=workdir) as local:
            s3server.make_bucket(server, "bench")
            raw, data = open_storage(f"s3://bench/raw-{run}"), bytes(state_bytes(state))
            setups = {"s3 direct": ([f"s3://bench/direct-{run}"], None),
                      "local only": ([os.path.join(local, "one")], None),
                      "local only + raw upload": ([os.path.join(local, "ref")],
                                                  lambda: raw.write_stream("raw.bin", [data])),
                      "local + s3": ([os.path.join(local, "l1"), f"s3://bench/l2-{run}"], None)}
            rows = {name: _level_saves(Checkpointer(levels=levels, keep_last=1), state, reps, beside)
                    for name, (levels, beside) in setups.items()}
    finally:
        server.stop()
    direct, one, two, ref = rows["s3 direct"], rows["local only"], rows["local + s3"], rows["local only + raw upload"]
    lines = [f"## Multi-level: {size_mib} MiB, 1 process, median of {reps} saves (S3 = moto on loopback)", "",
             *table(["set-up", "stall ms", "durable on level 1 s", "durable on S3 s"], [
                 ["s3 direct", f"{direct['stall_s'] * 1e3:.1f}", "", f"{direct['durable_s']:.3f}"],
                 ["local only", f"{one['stall_s'] * 1e3:.1f}", f"{one['durable_s']:.3f}", ""],
                 ["local only + raw upload beside", f"{ref['stall_s'] * 1e3:.1f}", f"{ref['durable_s']:.3f}", ""],
                 ["local + s3", f"{two['stall_s'] * 1e3:.1f}", f"{two['durable_s']:.3f}", f"{two['l2_durable_s']:.3f} "
                  f"(flushed {two['flushed']}, skipped {two['flush_skipped']})"]]), "",
             f"- time to durable, level 1 ÷ straight to S3: **{two['durable_s'] / direct['durable_s']:.3f}**",
             f"- training-side stall, two levels ÷ one level: **{two['stall_s'] / one['stall_s']:.2f}**; "
             f"÷ one level with a raw upload beside (the same contention, without our code): "
             f"**{two['stall_s'] / ref['stall_s']:.2f}**",
             f"- time to durable on S3 through level 1 ÷ straight: {two['l2_durable_s'] / direct['durable_s']:.2f} "
             "(includes waiting behind the previous flush)"]
    return rows, "\n".join(lines)


# ---- processes ---------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, cfg: argparse.Namespace, workdir: str, port: int) -> None:
    """One rank: build the state, run ours, the raw read and every peer in turn, write ``rank-<r>.json``."""
    start_rank(rank, world, port)
    ctx = RankCtx(rank, world, make_state(StateSpec(cfg.size_mib)), workdir, cfg.reps, cfg.peer_reps,
                  copy_threads=cfg.copy_threads)
    run_rank(ctx, REPLICATED, [lambda: bench_raw_read(ctx)], PEERS, bytes=state_bytes(ctx.state))


def main(argv: list[str] | None = None) -> int:
    p = driver_parser(__doc__, (1024, "state size in MiB"), 3, ("1,2", "or none"))
    p.add_argument("--levels-mib", type=int, default=64, help="state of the multi-level section; 0 skips it")
    p.add_argument("--levels-reps", type=int, default=6, help="saves per set-up in the multi-level section")
    cfg = p.parse_args(argv)
    cfg.worlds = () if cfg.worlds == "none" else tuple(int(w) for w in cfg.worlds.split(","))
    if min(cfg.size_mib, cfg.reps, cfg.peer_reps, *cfg.worlds) < 1:
        p.error("--size-mib, --reps, --peer-reps and every rank count of --worlds must be >= 1")
    scratch, cfg.dir = cfg.dir, tempfile.mkdtemp(prefix="bench_save-", dir=cfg.dir)
    results = run_worlds(rank_main, cfg)
    levels, levels_md = bench_levels(cfg.levels_mib, cfg.levels_reps, scratch) if cfg.levels_mib > 0 else ({}, "")
    config = {**vars(cfg), "cpu_count": os.cpu_count(), "torch": torch.__version__}
    if results:
        rows = [row for w, res in results.items() for row in world_rows(w, res["slowest"])]
        if 1 in results and 2 in results:
            rows.append(scaling_row(results[1]["slowest"], results[2]["slowest"]))
        write_report(cfg.out, "bench_save", markdown(rows, results, config), {
            "config": config, "worlds": {str(w): res for w, res in results.items()},
            "rows": [{**asdict(r), "ours_vs_limit": _finite(r.vs_limit), "ours_vs_peer": _finite(r.vs_peer)}
                     for r in rows]})
    if levels:
        write_report(cfg.out, "bench_levels", levels_md + "\n", {"config": config, "levels": levels})
    elif levels_md:
        print(levels_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
