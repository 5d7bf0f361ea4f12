"""Save / restore benchmark: ckpt_engine against the physical limits and its peers, 1 and 2 ranks.

One run measures, on the same replicated state and within the same processes:

* physical limits: ``memmove`` of the rank's share into a warm preallocated buffer (one thread),
  ``os.write`` + ``fsync`` of those bytes (one file per rank), ``preadv`` of the whole state back
  into a warm buffer (from the page cache: nothing is dropped);
* peers: ``torch.save`` (+ ``fsync``) / ``torch.load`` on rank 0, Lightning's ``AsyncCheckpointIO``
  on rank 0, ``torch.distributed.checkpoint`` ``save`` / ``async_save`` / ``load`` on every rank;
* ours: ``Checkpointer.save`` (stall), until ``wait()`` (committed), ``load()``, peak extra RSS.

Every rank is one process holding the full state (``torch.multiprocessing.spawn``, gloo on
localhost for 2 ranks, no process group at all for 1). The harness sets ``torch.set_num_threads``
to cores / ranks in each rank process; the library itself never changes it.

Usage::

    .venv/bin/python benchmarks/bench_save.py                  # 1 GiB, a few minutes
    .venv/bin/python benchmarks/bench_save.py --size-mib 64    # smoke test, seconds
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (MemProbe, StateSpec, best_of, byte_view, empty_like_state, fsync_path,  # noqa: E402
                     make_state, read_into, rss_bytes, share_slices, state_bytes, states_equal, summary,
                     timed, write_fsync)
from _report import write_report  # noqa: E402

Metrics = dict[str, float]
KEEP_LAST = 2
"""Checkpoints ours keeps (``keep_last``); the raw write keeps as many files."""


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


@dataclass
class RankCtx:
    """What a contender needs to know about its rank."""

    rank: int
    world: int
    state: dict[str, Any]
    workdir: str
    reps: int
    peer_reps: int

    def barrier(self) -> None:
        """Line all ranks up so that they start a measurement together."""
        if self.world > 1:
            dist.barrier()

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def remove(self, name: str) -> None:
        """After every rank is done with it, rank 0 deletes ``name`` (file or tree)."""
        self.barrier()
        if self.rank == 0:
            target = self.path(name)
            shutil.rmtree(target) if os.path.isdir(target) else os.unlink(target)
        self.barrier()


# ---- physical limits ------------------------------------------------------------------------------
def gather_share(ctx: RankCtx) -> tuple[torch.Tensor, Callable[[], None]]:
    """A warm buffer of the rank's share of the state and the single-threaded copy that fills it."""
    import ctypes

    slices = share_slices(ctx.state, ctx.rank, ctx.world)
    buf = torch.zeros(sum(n for _, n in slices), dtype=torch.uint8)
    base = buf.data_ptr()

    def copy() -> None:
        offset = 0
        for src, n in slices:
            ctypes.memmove(base + offset, src, n)
            offset += n

    copy()
    return buf, copy


def bench_memcpy(ctx: RankCtx) -> Metrics:
    """The floor of a snapshot: copy the rank's share into a preallocated, warm buffer."""
    buf, copy = gather_share(ctx)
    return {"stall_s": best_of(3, copy, ctx.barrier), "share_bytes": buf.numel()}


def bench_raw_write(ctx: RankCtx) -> Metrics:
    """The floor of persist: ``os.write`` + ``fsync`` of the share, one new file per rank per save.

    Same schedule, retention and statistic as ours (``reps`` saves back to back, the last two
    kept, best of saves 2..N): this virtual disk's speed depends on what was written recently.
    """
    buf, _ = gather_share(ctx)
    view, times = byte_view(buf), []
    names = [ctx.path(f"raw-{ctx.rank}-{i}.bin") for i in range(ctx.reps)]
    for i, path in enumerate(names):
        ctx.barrier()
        times.append(timed(lambda: write_fsync(path, [view]))[0])
        if i >= KEEP_LAST:
            os.unlink(names[i - KEEP_LAST])
    for path in names[max(0, ctx.reps - KEEP_LAST):-1]:
        os.unlink(path)
    os.replace(names[-1], ctx.path(f"raw-{ctx.rank}.bin"))
    return {"total_first_s": times[0], "total_s": min(times[1:] or times), "bytes": buf.numel()}


def bench_raw_read(ctx: RankCtx) -> Metrics:
    """The floor of restore: ``preadv`` every rank's raw file (the whole state) into a warm buffer.

    Also into a freshly allocated buffer (``load_fresh_s``): restoring returns new tensors, whose
    first-touch page faults a warm buffer does not pay.
    """
    paths = [ctx.path(f"raw-{r}.bin") for r in range(ctx.world)]
    dest = torch.zeros(sum(os.path.getsize(p) for p in paths), dtype=torch.uint8)
    view = byte_view(dest)
    warm = best_of(3, lambda: read_into(paths, view), ctx.barrier)
    fresh = best_of(3, lambda: read_into(paths, byte_view(torch.empty(dest.numel(), dtype=torch.uint8))),
                    ctx.barrier)
    for r in range(ctx.world):
        ctx.remove(f"raw-{r}.bin")
    return {"load_s": warm, "load_fresh_s": fresh, "bytes": dest.numel()}


# ---- ours -----------------------------------------------------------------------------------------
def bench_ours(ctx: RankCtx) -> Metrics:
    """``Checkpointer``: ``reps`` saves (stall, until committed, peak RSS growth), then ``load()``."""
    from ckpt_engine import Checkpointer, LocalComm, TorchDistComm

    ck = Checkpointer(ctx.path("ours"), comm=TorchDistComm() if ctx.world > 1 else LocalComm(), keep_last=KEEP_LAST)
    baseline, probe, reps = rss_bytes(), MemProbe(), []
    for step in range(ctx.reps):
        ctx.barrier()
        probe.start(baseline)
        stall, handle = timed(lambda: ck.save(ctx.state, step))
        total = stall + timed(ck.wait)[0]
        rec = handle.record
        reps.append({"stall_s": stall, "total_s": total, "mem_extra_bytes": probe.peak_extra(),
                     "snapshot_s": rec.snapshot_s, "persist_s": rec.persist_s, "commit_s": rec.commit_s,
                     "share_bytes": rec.bytes})
    ctx.barrier()
    load_s, loaded = timed(ck.load)
    ok = states_equal(loaded, ctx.state)
    del loaded
    ck.close()
    ctx.remove("ours")
    return _ours_metrics(reps, load_s, ok)


def _ours_metrics(reps: list[Metrics], load_s: float, ok: bool) -> Metrics:
    """First save, steady state (best of reps 2..N), medians, and each repetition's figures."""
    steady = reps[1:] or reps
    out: Metrics = {"stall_first_s": reps[0]["stall_s"], "total_first_s": reps[0]["total_s"],
                    "share_bytes": reps[0]["share_bytes"], "load_s": load_s, "load_ok": float(ok),
                    "mem_extra_bytes": max(r["mem_extra_bytes"] for r in reps)}
    for key in ("stall_s", "total_s", "snapshot_s", "persist_s", "commit_s"):
        stats = summary([r[key] for r in steady])
        out[key], out[key.replace("_s", "_median_s")] = stats["min"], stats["median"]
    for i, rep in enumerate(reps, 1):
        out.update({f"rep{i}_{k}": v for k, v in rep.items() if k != "share_bytes"})
    return out


# ---- peers ----------------------------------------------------------------------------------------
def repeated(one_round: Callable[[RankCtx], Metrics]) -> Callable[[RankCtx], Metrics]:
    """Run a peer ``ctx.peer_reps`` times and keep each figure's best (the first round pays warm-up)."""

    @functools.wraps(one_round)
    def run(ctx: RankCtx) -> Metrics:
        best: Metrics = {}
        for _ in range(ctx.peer_reps):
            for key, value in one_round(ctx).items():
                best[key] = min(best.get(key, value), value)
            gc.collect()
        return best

    return run


@repeated
def bench_torch_save(ctx: RankCtx) -> Metrics:
    """``torch.save`` + ``fsync`` on rank 0 (it writes everything); ``torch.load`` on every rank."""
    path, out = ctx.path("torch.pt"), {}
    ctx.barrier()
    if ctx.rank == 0:
        probe = MemProbe().start()
        out["stall_s"] = out["total_s"] = timed(lambda: _torch_save_fsync(ctx.state, path))[0]
        out["mem_extra_bytes"] = probe.peak_extra()
    ctx.barrier()
    out["load_s"], loaded = timed(lambda: torch.load(path, weights_only=True))
    out["load_ok"] = float(states_equal(loaded, ctx.state))
    del loaded
    ctx.remove("torch.pt")
    return out


def _torch_save_fsync(state: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


@repeated
def bench_lightning(ctx: RankCtx) -> Metrics:
    """``AsyncCheckpointIO(TorchCheckpointIO())`` on rank 0, as Lightning saves under DDP.

    Stall: the ``save_checkpoint`` call (it clones every tensor on the caller's thread). Total:
    until ``teardown()`` returned, plus an ``fsync`` of the file (Lightning does not sync; the
    ``fsync`` time is reported apart as ``fsync_s``).
    """
    from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    path, out = ctx.path("lightning.ckpt"), {}
    ctx.barrier()
    if ctx.rank == 0:
        io, probe = AsyncCheckpointIO(TorchCheckpointIO()), MemProbe().start()
        out["stall_s"] = timed(lambda: io.save_checkpoint(ctx.state, path))[0]
        teardown_s = timed(io.teardown)[0]
        out["fsync_s"] = timed(lambda: fsync_path(path))[0]
        out["total_s"] = out["stall_s"] + teardown_s + out["fsync_s"]
        out["mem_extra_bytes"] = probe.peak_extra()
    ctx.remove("lightning.ckpt")
    return out


@repeated
def bench_dcp_save(ctx: RankCtx) -> Metrics:
    """``torch.distributed.checkpoint.save`` (synchronous, every rank) and ``load`` into fresh tensors."""
    import torch.distributed.checkpoint as dcp

    path = ctx.path("dcp")
    ctx.barrier()
    probe = MemProbe().start()
    out = {"total_s": timed(lambda: dcp.save(ctx.state, checkpoint_id=path))[0]}
    out["stall_s"], out["mem_extra_bytes"] = out["total_s"], probe.peak_extra()
    ctx.barrier()

    def load() -> Any:
        target = empty_like_state(ctx.state)
        dcp.load(target, checkpoint_id=path)
        return target

    out["load_s"], loaded = timed(load)
    out["load_ok"] = float(states_equal(loaded, ctx.state))
    del loaded
    ctx.remove("dcp")
    return out


@repeated
def bench_dcp_async(ctx: RankCtx) -> Metrics:
    """``torch.distributed.checkpoint.async_save``: stall until the future is returned, total until it resolves."""
    import torch.distributed.checkpoint as dcp

    path = ctx.path("dcp-async")
    ctx.barrier()
    probe = MemProbe().start()
    stall, future = timed(lambda: dcp.async_save(ctx.state, checkpoint_id=path))
    total = stall + timed(future.result)[0]
    out = {"stall_s": stall, "total_s": total, "mem_extra_bytes": probe.peak_extra()}
    ctx.remove("dcp-async")
    return out


CONTENDERS: dict[str, Callable[[RankCtx], Metrics]] = {
    "memcpy": bench_memcpy, "raw_write": bench_raw_write, "raw_read": bench_raw_read,
    "ours": bench_ours,
    "torch_save": bench_torch_save, "lightning": bench_lightning,
    "dcp_save": bench_dcp_save, "dcp_async": bench_dcp_async,
}


# ---- processes ------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, cfg: Config, workdir: str, port: int) -> None:
    """One rank: build the state, run every contender in turn, write ``rank-<r>.json``."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = RankCtx(rank, world, make_state(StateSpec(cfg.size_mib)), workdir, cfg.reps, cfg.peer_reps)
    results: dict[str, Metrics] = {}
    for name, fn in CONTENDERS.items():
        elapsed, results[name] = timed(lambda: fn(ctx))
        results[name]["elapsed_s"] = elapsed
        gc.collect()
    results["state"] = {"bytes": state_bytes(ctx.state), "threads": torch.get_num_threads()}
    with open(os.path.join(workdir, f"rank-{rank}.json"), "w") as f:
        json.dump(results, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_world(world: int, cfg: Config) -> dict[str, Any]:
    """Spawn ``world`` rank processes; return every rank's figures and their slowest-rank merge."""
    workdir = os.path.join(cfg.dir, f"world{world}")
    os.makedirs(workdir, exist_ok=True)
    mp.spawn(rank_main, args=(world, cfg, workdir, _free_port()), nprocs=world, join=True)
    ranks = []
    for r in range(world):
        with open(os.path.join(workdir, f"rank-{r}.json")) as f:
            ranks.append(json.load(f))
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> Config:
    """Command line → :class:`Config` (the working directory is created here when not given)."""
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--out", default=os.path.join(here, "out"), help="report directory (default benchmarks/out)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir in /tmp)")
    p.add_argument("--reps", type=int, default=3, help="saves of ours per world size (default 3)")
    p.add_argument("--peer-reps", type=int, default=2, help="rounds of each peer, best kept (default 2)")
    p.add_argument("--worlds", default="1,2", help="rank counts to run (default 1,2)")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    a = p.parse_args(argv)
    if min(a.size_mib, a.reps, a.peer_reps) < 1:
        p.error(f"--size-mib, --reps and --peer-reps must be >= 1, got {a.size_mib}, {a.reps}, {a.peer_reps}")
    workdir = tempfile.mkdtemp(prefix="bench_save-", dir=a.dir)
    return Config(a.size_mib, a.out, workdir, a.reps, a.peer_reps, tuple(int(w) for w in a.worlds.split(",")), a.keep)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        worlds = {w: run_world(w, cfg) for w in cfg.worlds}
    finally:
        if not cfg.keep:
            shutil.rmtree(cfg.dir, ignore_errors=True)
    config = {**asdict(cfg), "cpu_count": os.cpu_count(), "torch": torch.__version__}
    print(write_report(worlds, config, cfg.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
