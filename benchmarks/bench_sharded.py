"""Sharded-state benchmark (FSDP2): ckpt_engine against the memcpy limit and its peers, 2 and 4 ranks.

What it measures, against which limits, peers and targets: ``benchmarks/README.md``, section
bench_sharded. Every rank is a process (gloo on loopback, CPU) holding its FSDP2 shard of the same model
and AdamW state (one step taken); every contender ``fsync``s its data; restores go into the live sharded
state (zeroed first) from files dropped from the page cache, and are checked bit for bit.

Usage::

    .venv/bin/python benchmarks/bench_sharded.py            # 2 and 4 ranks, ~2 min
    .venv/bin/python benchmarks/bench_sharded.py --size-mib 48 --width 512 --reps 2 --peer-reps 1 --restore-reps 1
"""

from __future__ import annotations

import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # noqa: E402
from _common import (CpuLoad, MemProbe, Metrics, MiB, RankCtx, RawWriter, best_rounds, byte_view, num,  # noqa: E402
                     numbered, parser, peer_rounds, run_stages, set_page_cache, slowest, spawn_ranks, steady_figures,
                     synchronous, table, tensors_of, timed, timed_save, verdict, write_report)

PEERS = {"lightning": "Lightning ModelParallelStrategy save (its calls)", "dcp_save": "DCP save",
         "dcp_async": "DCP async_save", "dcp_async_stager": "DCP async_save, reused DefaultStager",
         "dcp_async_process": "DCP async_save, PROCESS"}
MEM_SLACK_MIB = 4
"""Allowance over the rank's share for interpreter and metadata noise (as in bench_save)."""


@dataclass(frozen=True)
class Config:
    """Command-line settings, passed to every rank process."""

    size_mib: int
    width: int
    out: str
    dir: str
    reps: int
    peer_reps: int
    restore_reps: int
    worlds: tuple[int, ...]
    peers: tuple[str, ...]
    keep: bool


# ---- the model and its sharded state -----------------------------------------------------------------
class Block(nn.Module):
    """A transformer-sized MLP block: LayerNorm, d -> 4d, GELU, 4d -> d, residual."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build(cfg: Config, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The FSDP2 model (every block and the root ``fully_shard``-ed), blocks so that parameters and AdamW's
    two moments come to about ``size_mib`` MiB, and its AdamW after one training step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    d = cfg.width
    blocks = max(1, round((cfg.size_mib * MiB - 12 * (d * d + 3 * d)) / (12 * (8 * d * d + 7 * d))))
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(d) for _ in range(blocks)], nn.LayerNorm(d), nn.Linear(d, d))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for layer in model:
        if isinstance(layer, Block):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, d, generator=torch.Generator().manual_seed(dist.get_rank()))).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def sharded_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a user checkpoints: model and optimizer state as they are sharded (DTensors, no gather)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=False, cpu_offload=False))
    return {"model": msd, "optim": osd}


def nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Rank:
    """One rank's model, optimizer, the sharded state dict every contender saves, and a copy of its local
    tensors to check restores against."""

    ctx: RankCtx
    model: nn.Module
    opt: torch.optim.Optimizer
    saved: list[torch.Tensor]
    restore_reps: int

    def matches(self, state: Any) -> bool:
        """Whether the local tensors of ``state`` are those saved, bit for bit."""
        now = tensors_of(state, local=True)
        return len(now) == len(self.saved) and all(torch.equal(a, b) for a, b in zip(now, self.saved))

    def timed_restore(self, root: str, load: Callable[[], Any]) -> Metrics:
        """Drop ``root`` from the page cache, zero the live state, time ``load()`` then ``set_state_dict``."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_page_cache(self.ctx, [root], cold=True)
        with torch.no_grad():
            for t in tensors_of(self.ctx.state, local=True):
                t.zero_()
        self.ctx.before_load()
        probe = MemProbe().start()
        load_s = timed(load)[0]
        state = self.ctx.state
        set_s = timed(lambda: set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                                             optim_state_dict=state["optim"]))[0]
        ok = self.matches(state) and self.matches(sharded_state(self.model, self.opt))
        return {"load_s": load_s + set_s, "read_s": load_s, "set_state_s": set_s, "load_ok": float(ok),
                "load_mem_extra_bytes": probe.peak_extra()}


# ---- ours and its limits, the restores ---------------------------------------------------------------
def bench_ours(r: Rank) -> dict[str, Metrics]:
    """``reps`` rounds: the memcpy limit of the rank's local tensors, then a raw ``O_DIRECT`` write + fsync
    of those bytes and our save, in alternating order. The stall target pairs each save with the memcpy
    timed just before it (the memcpy alone varies 2-3x between rounds here)."""
    from ckpt_engine import Checkpointer, TorchDistComm

    ctx, tensors = r.ctx, tensors_of(r.ctx.state, local=True)
    buf = torch.zeros(nbytes(tensors), dtype=torch.uint8)
    spans, off = [], 0
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"local tensor of shape {tuple(t.shape)} is not contiguous; the memcpy limit assumes "
                             "FSDP2's contiguous dim-0 shards")
        spans.append((buf.data_ptr() + off, t.data_ptr(), t.numel() * t.element_size()))
        off += spans[-1][2]

    def copy() -> None:
        for dst, src, n in spans:
            ctypes.memmove(dst, src, n)

    copy()
    raw = RawWriter(ctx, byte_view(buf), direct=True)
    ck = Checkpointer(ctx.path("ours"), comm=TorchDistComm(), keep_last=1)
    probe, memcpy, writes, saves = MemProbe(), [], [], []

    def save() -> None:
        ctx.barrier()
        probe.start(keep_baseline=bool(saves), trim=not saves)
        stall, total, _ = timed_save(ck, ctx.state, len(saves))  # then waits for the retention
        rec = ck.records[-1]
        saves.append({"stall_s": stall, "total_s": total, "mem_extra_bytes": probe.peak_extra(),
                      "encode_s": rec.encode_s, "snapshot_s": rec.snapshot_s, "persist_s": rec.persist_s,
                      "commit_s": rec.commit_s, "memcpy_s": memcpy[-1], "share_bytes": rec.bytes})

    def write() -> None:
        ctx.barrier()
        writes.append(raw.write())

    for step in range(ctx.reps):
        ctx.barrier()
        memcpy.append(timed(copy)[0])
        for fn in ((write, save) if step % 2 == 0 else (save, write)):
            fn()
    raw.finish()
    ck.close()
    ctx.remove("ours")
    paired = [s["stall_s"] / s["memcpy_s"] for s in saves[1:] or saves]  # each save ÷ the memcpy just before it
    ours = {"stall_first_s": saves[0]["stall_s"], "total_first_s": saves[0]["total_s"],
            "share_bytes": saves[0]["share_bytes"],
            "tensors": float(len(tensors)), "mem_extra_bytes": max(s["mem_extra_bytes"] for s in saves),
            "stall_paired_median": statistics.median(paired), "stall_paired_min": min(paired),
            **steady_figures(saves, ("stall_s", "total_s", "encode_s", "snapshot_s", "persist_s", "commit_s"))}
    for i, s in enumerate(saves, 1):
        ours.update({f"rep{i}_{k}": v for k, v in s.items() if k not in ("memcpy_s", "share_bytes")})
    return {"ours": ours, "memcpy": {"stall_s": min(memcpy), "share_bytes": buf.numel(), **numbered(memcpy)},
            "raw_write_direct": {"total_s": min(writes[1:] or writes), "total_first_s": writes[0],
                                 "bytes": buf.numel(), **numbered(writes)}}


def bench_restore(r: Rank) -> dict[str, Metrics]:
    """One checkpoint of the state by ours and by ``dcp.save``, then ``restore_reps`` rounds restoring
    both into the zeroed live state in alternating order; best round of each."""
    import torch.distributed.checkpoint as dcp
    from ckpt_engine import Checkpointer, TorchDistComm

    ctx = r.ctx
    root, path = ctx.path("restore-ours"), ctx.path("restore-dcp")
    ck = Checkpointer(root, comm=TorchDistComm(), keep_last=1)
    ck.save(ctx.state, 0)
    ck.wait()
    dcp.save(ctx.state, checkpoint_id=path)
    runs: dict[str, list[Metrics]] = {"restore_ours": [], "restore_dcp": []}
    restores = {"restore_ours": lambda: r.timed_restore(root, lambda: ck.restore(into=ctx.state)),
                "restore_dcp": lambda: r.timed_restore(path, lambda: dcp.load(ctx.state, checkpoint_id=path))}
    for i in range(r.restore_reps):
        for name in (list(restores) if i % 2 == 0 else list(restores)[::-1]):
            runs[name].append(restores[name]())
    ck.close()
    ctx.remove("restore-")
    return {k: {**best_rounds(v), **numbered([m["load_s"] for m in v])} for k, v in runs.items()}


# ---- the peers ---------------------------------------------------------------------------------------
def _async_round(r: Rank, path: str, **kwargs: Any) -> Metrics:
    """One ``async_save``: the call (stall), until the state may change (staging done), until durable."""
    stall, (staged, durable) = timed(lambda: _peers.dcp_async(r.ctx.state, path, **kwargs))
    mutable = stall + (timed(staged)[0] if staged is not None else 0.0)
    return {"stall_s": stall, "mutable_s": mutable, "total_s": mutable + timed(durable)[0]}


def bench_lightning(r: Rank) -> Metrics:
    """What ``ModelParallelStrategy(save_distributed_checkpoint=True).save_checkpoint`` does after the
    state's collection: ``get_*_state_dict`` with ``cpu_offload=True``, ``dcp.save({"state_dict",
    "optimizer_0"})``, ``torch.save`` of the rest on rank 0; no ``Trainer`` built."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=False, cpu_offload=True)

    def save(path: str) -> None:
        msd, osd = get_model_state_dict(r.model, options=options), get_optimizer_state_dict(r.model, r.opt,
                                                                                              options=options)
        os.makedirs(path, exist_ok=True)
        dcp.save({"state_dict": msd, "optimizer_0": osd}, checkpoint_id=path)
        if r.ctx.rank == 0:
            torch.save({"epoch": 0, "global_step": 1, "loops": {}, "callbacks": {}}, os.path.join(path, "meta.pt"))

    return peer_rounds(r.ctx, "lightning", lambda path: synchronous(lambda: save(path)))


def bench_dcp_save(r: Rank) -> Metrics:
    """``dcp.save``: synchronous, every file ``fsync``ed (``FileSystemWriter(sync_files=True)``)."""
    return peer_rounds(r.ctx, "dcp-sync", lambda path: synchronous(lambda: _peers.dcp_save(r.ctx.state, path)))


def bench_dcp_async(r: Rank) -> Metrics:
    """``async_save`` as shipped: its default stager copies the state on the caller's thread."""
    return peer_rounds(r.ctx, "dcp-async", lambda path: _async_round(r, path))


def bench_dcp_async_stager(r: Rank) -> Metrics:
    """``async_save`` with one ``DefaultStager`` kept across saves, staging on a background thread (pinned
    memory and non-blocking copies only where CUDA exists)."""
    stager = _peers.dcp_stager(pinned=torch.cuda.is_available())
    try:
        return peer_rounds(r.ctx, "dcp-stager", lambda path: _async_round(r, path, async_stager=stager))
    finally:
        _peers.close_stager(stager)


def bench_dcp_async_process(r: Rank) -> Metrics:
    """``async_save(async_checkpointer_type=PROCESS)``: a checkpoint daemon process per rank writes."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return peer_rounds(r.ctx, "dcp-process",
                   lambda path: _async_round(r, path, async_checkpointer_type=AsyncCheckpointerType.PROCESS))


PEER_FNS: dict[str, Callable[[Rank], Metrics]] = {
    "lightning": bench_lightning, "dcp_save": bench_dcp_save, "dcp_async": bench_dcp_async,
    "dcp_async_stager": bench_dcp_async_stager, "dcp_async_process": bench_dcp_async_process}


def rank_main(rank: int, world: int, cfg: Config, workdir: str, port: int) -> None:
    """One rank: build the FSDP2 model, run ours, the restores and every chosen peer, write ``rank-<r>.json``."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    build_s, (model, opt) = timed(lambda: build(cfg, world))
    state = sharded_state(model, opt)
    tensors = tensors_of(state, local=True)
    r = Rank(RankCtx(rank, world, state, workdir, cfg.reps, cfg.peer_reps), model, opt,
             [t.detach().clone() for t in tensors], cfg.restore_reps)
    run_stages(r.ctx, [lambda: bench_ours(r), lambda: bench_restore(r),
                       *((lambda p=p: {p: PEER_FNS[p](r)}) for p in cfg.peers)],
               os.path.join(workdir, f"rank-{rank}.json"),
               state={"rank_bytes": nbytes(tensors), "tensors": len(tensors), "build_s": build_s,
                      "threads": torch.get_num_threads(),
                      "total_bytes": float(sum(p.numel() * p.element_size() for p in model.parameters()) * 3)})


# ---- report ------------------------------------------------------------------------------------------
def headline(world: int, agg: dict[str, Metrics]) -> list[dict[str, Any]]:
    """The targets as ratios of the slowest rank's figures, then informative ones."""
    ours, share, memcpy = agg["ours"], agg["ours"]["share_bytes"], agg["memcpy"]["stall_s"]
    peers = {p: agg[p] for p in PEERS if p in agg}
    mine, theirs, extra, raw = agg["restore_ours"], agg["restore_dcp"], ours["mem_extra_bytes"], \
        agg["raw_write_direct"]["total_s"]
    rows = [("stall ÷ memcpy of the rank's shard (median over saves 2..N of each save ÷ the memcpy timed just before "
             "it)", ours["stall_paired_median"], f"best-of ratio {ours['stall_s'] / memcpy:.2f}: ours "
             f"{ours['stall_s'] * 1e3:.1f} ms, memcpy {memcpy * 1e3:.1f} ms", "≤ 1.10",
             ours["stall_paired_median"] <= 1.10)]
    if "dcp_save" in peers:
        durable = ours["total_s"] / peers["dcp_save"]["total_s"]
        rows.append(("time to durable ÷ synchronous DCP save", durable,
                     f"ours {ours['total_s']:.3f} s, DCP {peers['dcp_save']['total_s']:.3f} s", "≤ 0.50",
                     durable <= 0.5))
    rows += [("restore + set_state_dict ÷ DCP load + set_state_dict (time)", mine["load_s"] / theirs["load_s"],
              f"ours {mine['load_s']:.3f} s, DCP {theirs['load_s']:.3f} s", "≤ 1.00",
              mine["load_s"] <= theirs["load_s"]),
             ("peak extra RSS of saving ÷ rank's share", extra / share,
              f"extra {extra / MiB:.1f} MiB, share {share / MiB:.1f} MiB", f"≤ 1.00 (+{MEM_SLACK_MIB} MiB)",
              extra <= share + MEM_SLACK_MIB * MiB),
             ("time to durable ÷ raw O_DIRECT write+fsync of the shard", ours["total_s"] / raw, f"raw {raw:.3f} s",
              "info", None)]
    if peers:
        best = min(peers, key=lambda p: peers[p]["mutable_s"])
        rows.append(("stall ÷ best peer's time until the state may change", ours["stall_s"] / peers[best]["mutable_s"],
                     f"{PEERS[best]}: {peers[best]['mutable_s'] * 1e3:.1f} ms", "info", None))
    return [dict(zip(("metric", "ratio", "figures", "target", "passed"), row), ranks=world) for row in rows]


def markdown(rows: list[dict[str, Any]], worlds: dict[int, dict[str, Any]], config: dict[str, Any]) -> str:
    """Headline ratios, then every contender's figures and the restores (slowest rank)."""
    state = next(iter(worlds.values()))["slowest"]["state"]
    lines = [f"# bench_sharded: FSDP2 model + AdamW, {state['total_bytes'] / MiB:.0f} MiB in all, "
             f"{config['cpu_count']} cores, torch {config['torch']}", "",
             f"Slowest rank of each world size. CPU taken by other work during the run: "
             f"{config['other_cpu_fraction'] * 100:.0f} % of the machine.", "",
             *table(["ranks", "ratio", "value", "figures", "target", "result"],
                    [[r["ranks"], r["metric"], num(r["ratio"]), r["figures"], r["target"], verdict(r["passed"])]
                     for r in rows]), ""]
    cells = []
    for w, res in worlds.items():
        for name in ("memcpy", "raw_write_direct", "ours", *PEERS):
            m = res["slowest"].get(name)
            if m is not None:
                call, mem = m.get("stall_s"), m.get("mem_extra_bytes")
                mutable = m.get("mutable_s", call)
                cells.append([w, PEERS.get(name, name), num(call * 1e3 if call is not None else None),
                              num(mutable * 1e3 if mutable is not None else None), num(m.get("total_s")),
                              num(mem / MiB if mem is not None else None)])
    lines += [*table(["ranks", "contender", "call ms", "until mutable ms", "to durable s", "extra RSS MiB"], cells), ""]
    restores = []
    for w, res in worlds.items():
        for name, what in (("restore_ours", "ours `restore(into=state)`"), ("restore_dcp", "DCP `load`")):
            m = res["slowest"][name]
            restores.append([w, what, num(m["load_s"]), num(m["read_s"]), num(m["set_state_s"]),
                             num(m["load_mem_extra_bytes"] / MiB), "yes" if m["load_ok"] == 1.0 else "NO"])
    lines += table(["ranks", "restore", "total s", "read s", "set_state_dict s", "extra RSS MiB", "bit-exact"],
                   restores)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, scratch="/tmp")
    p.add_argument("--size-mib", type=int, default=384, help="model + AdamW state in MiB, float32 (default 384)")
    p.add_argument("--width", type=int, default=1024, help="model width d (blocks d -> 4d -> d; default 1024)")
    p.add_argument("--reps", type=int, default=9, help="saves of ours per world size (default 9)")
    p.add_argument("--peer-reps", type=int, default=2, help="rounds of each peer, best kept (default 2)")
    p.add_argument("--restore-reps", type=int, default=3, help="restores of ours and of DCP, alternated (default 3)")
    p.add_argument("--worlds", default="2,4", help="rank counts to run, each >= 2 (default 2,4)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"peers to run (default all: {','.join(PEERS)})")
    p.add_argument("--keep", action="store_true", help="keep the working directory (each rank's raw JSON)")
    a = p.parse_args(argv)
    worlds, peers = tuple(int(w) for w in a.worlds.split(",")), tuple(x for x in a.peers.split(",") if x)
    if min(a.size_mib, a.width, a.reps, a.peer_reps, a.restore_reps) < 1 or min(worlds) < 2:
        p.error("--size-mib, --width, --reps, --peer-reps and --restore-reps must be >= 1, every rank count of "
                "--worlds >= 2 (sharding needs ranks)")
    if set(peers) - set(PEERS):
        p.error(f"--peers: unknown {sorted(set(peers) - set(PEERS))}; choose from {','.join(PEERS)}")
    cfg = Config(a.size_mib, a.width, a.out, tempfile.mkdtemp(prefix="bench_sharded-", dir=a.dir), a.reps,
                 a.peer_reps, a.restore_reps, worlds, peers, a.keep)
    start, load = time.perf_counter(), CpuLoad()
    try:
        results = {}
        for w in cfg.worlds:
            ranks = spawn_ranks(rank_main, w, cfg)
            results[w] = {"ranks": ranks, "slowest": slowest(ranks)}
    finally:
        if not cfg.keep:
            shutil.rmtree(cfg.dir, ignore_errors=True)
    config = {**asdict(cfg), "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "wall_s": time.perf_counter() - start, "other_cpu_fraction": load.foreign_cores() / (os.cpu_count() or 1),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = [row for w, res in results.items() for row in headline(w, res["slowest"])]
    write_report(cfg.out, "bench_sharded", markdown(rows, results, config),
                 {"config": config, "rows": rows, "worlds": {str(w): res for w, res in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
