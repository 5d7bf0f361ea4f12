"""The peers ckpt_engine is compared with, one function each, every one run ``peer_reps`` rounds.

Each round writes a new file or directory; all are deleted after the last round, as ours keeps
its last checkpoint. Rank-0-only peers (``torch.save``, Lightning) leave the other ranks waiting
at the barrier, as in a DDP job.
"""

from __future__ import annotations

import functools
import gc
import os
from typing import Any, Callable

import torch

from _common import (MemProbe, Metrics, RankCtx, empty_like_state, fsync_path, set_page_cache, states_equal,
                     timed)


def cold_and_warm_loads(ctx: RankCtx, paths: list[str], load: Callable[[], Any], prefix: str = "load") -> Metrics:
    """``load()`` timed with ``paths`` out of the page cache (``<prefix>_s``), then in it
    (``<prefix>_warm_s``), each after the free heap is given back; ``<prefix>_ok``: both bit-exact."""
    out: Metrics = {}
    ok = True
    for key, cold in ((f"{prefix}_s", True), (f"{prefix}_warm_s", False)):
        ctx.before_load()
        set_page_cache(ctx, paths, cold)
        out[key], loaded = timed(load)
        ok = ok and states_equal(loaded, ctx.state)
        del loaded
    out[f"{prefix}_ok"] = float(ok)
    return out


def repeated(stem: str) -> Callable[[Callable[[RankCtx, str], Metrics]], Callable[[RankCtx], Metrics]]:
    """Run a peer's round ``ctx.peer_reps`` times, each to its own path ``stem-<round>``, and
    delete the files only after the last round (ours keeps its last checkpoints too).

    The first round is cold (``ctx.cold``: exact RSS growth); later ones find a warm heap, as a
    training loop saving again would. Kept: each time's best, each memory figure's largest.
    """

    def wrap(one_round: Callable[[RankCtx, str], Metrics]) -> Callable[[RankCtx], Metrics]:
        @functools.wraps(one_round)
        def run(ctx: RankCtx) -> Metrics:
            best: Metrics = {}
            for i in range(ctx.peer_reps):
                ctx.cold = i == 0
                for key, value in one_round(ctx, ctx.path(f"{stem}-{i}")).items():
                    pick = max if key.startswith("mem_") else min
                    best[key] = pick(best.get(key, value), value)
                gc.collect()
            ctx.cold = True
            ctx.remove(stem)
            return best

        return run

    return wrap


@repeated("torch.pt")
def bench_torch_save(ctx: RankCtx, path: str) -> Metrics:
    """``torch.save`` + ``fsync`` on rank 0 (it writes everything); ``torch.load`` on every rank."""
    out: Metrics = {}
    ctx.barrier()
    if ctx.rank == 0:
        probe = MemProbe().start(trim=ctx.cold)
        out["stall_s"] = out["total_s"] = timed(lambda: _torch_save_fsync(ctx.state, path))[0]
        out["mem_extra_bytes"] = probe.peak_extra()
    out.update(cold_and_warm_loads(ctx, [path], lambda: torch.load(path, weights_only=True)))
    return out


def _torch_save_fsync(state: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


@repeated("lightning.ckpt")
def bench_lightning(ctx: RankCtx, path: str) -> Metrics:
    """``AsyncCheckpointIO(TorchCheckpointIO())`` on rank 0, as Lightning saves under DDP.

    Stall: the ``save_checkpoint`` call (it clones every tensor on the caller's thread). Total:
    until ``teardown()`` returned, plus an ``fsync`` of the file (Lightning does not sync; the
    ``fsync`` time is reported apart as ``fsync_s``).
    """
    out: Metrics = {}
    ctx.barrier()
    if ctx.rank == 0:
        from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        io, probe = AsyncCheckpointIO(TorchCheckpointIO()), MemProbe().start(trim=ctx.cold)
        out["stall_s"] = timed(lambda: io.save_checkpoint(ctx.state, path))[0]
        teardown_s = timed(io.teardown)[0]
        out["fsync_s"] = timed(lambda: fsync_path(path))[0]
        out["total_s"] = out["stall_s"] + teardown_s + out["fsync_s"]
        out["mem_extra_bytes"] = probe.peak_extra()
    return out


@repeated("dcp-sync")
def bench_dcp_save(ctx: RankCtx, path: str) -> Metrics:
    """``torch.distributed.checkpoint.save`` (synchronous, every rank) and ``load`` into fresh tensors."""
    import torch.distributed.checkpoint as dcp

    ctx.barrier()
    probe = MemProbe().start(trim=ctx.cold)
    out = {"total_s": timed(lambda: dcp.save(ctx.state, checkpoint_id=path))[0]}
    out["stall_s"], out["mem_extra_bytes"] = out["total_s"], probe.peak_extra()

    def load() -> Any:
        target = empty_like_state(ctx.state)
        dcp.load(target, checkpoint_id=path)
        return target

    out.update(cold_and_warm_loads(ctx, [path], load))
    return out


@repeated("dcp-async")
def bench_dcp_async(ctx: RankCtx, path: str) -> Metrics:
    """``torch.distributed.checkpoint.async_save``: stall until the future is returned, total until it resolves."""
    import torch.distributed.checkpoint as dcp

    ctx.barrier()
    probe = MemProbe().start(trim=ctx.cold)
    stall, future = timed(lambda: dcp.async_save(ctx.state, checkpoint_id=path))
    total = stall + timed(future.result)[0]
    return {"stall_s": stall, "total_s": total, "mem_extra_bytes": probe.peak_extra()}
