"""Sharded-state benchmark (FSDP2): ckpt_engine against the memcpy limit and its peers, 2 and 4 ranks.

What it measures, against which limits, peers and targets: ``benchmarks/README.md``, section
bench_sharded. Every rank is a process (gloo on loopback, CPU) holding its FSDP2 shard of the same model
and AdamW state (one step taken); every contender ``fsync``s its data; restores go into the live sharded
state (zeroed first) from files dropped from the page cache, and are checked bit for bit. The save driver
is ``bench_save``'s, on the kind :data:`SHARDED`.

Usage::

    .venv/bin/python benchmarks/bench_sharded.py            # 2 and 4 ranks, ~2 min
    .venv/bin/python benchmarks/bench_sharded.py --size-mib 48 --width 512 --reps 2 --peer-reps 1 --restore-reps 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # noqa: E402
from _common import (CpuLoad, MemProbe, Metrics, MiB, RankCtx, best_rounds, num, numbered,  # noqa: E402
                     set_page_cache, state_bytes, table, tensors_of, timed, verdict, write_report)
from bench_save import (MEM_SLACK_MIB, Kind, driver_parser, figure_cells, rotating, run_rank,  # noqa: E402
                        run_worlds, start_rank)

PEERS = _peers.SHARDED


# ---- the model and its sharded state -----------------------------------------------------------------
class Block(nn.Module):
    """A transformer-sized MLP block: LayerNorm, d -> 4d, GELU, 4d -> d, residual."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build(cfg: argparse.Namespace, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
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


@dataclass
class ShardedCtx(RankCtx):
    """A rank of the sharded state: its model and optimizer (the state is their sharded state dict), a copy
    of its local tensors to check restores against, and the rounds of restores."""

    model: Any = None
    opt: Any = None
    saved: list[torch.Tensor] = field(default_factory=list)
    restore_reps: int = 1

    def matches(self, state: Any) -> bool:
        """Whether the local tensors of ``state`` are those saved, bit for bit."""
        now = tensors_of(state, local=True)
        return len(now) == len(self.saved) and all(torch.equal(a, b) for a, b in zip(now, self.saved))

    def timed_restore(self, root: str, load: Callable[[], Any]) -> Metrics:
        """Drop ``root`` from the page cache, zero the live state, time ``load()`` then ``set_state_dict``."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_page_cache(self, [root], cold=True)
        with torch.no_grad():
            for t in tensors_of(self.state, local=True):
                t.zero_()
        self.before_load()
        probe = MemProbe().start()
        load_s = timed(load)[0]
        set_s = timed(lambda: set_state_dict(self.model, self.opt, model_state_dict=self.state["model"],
                                             optim_state_dict=self.state["optim"]))[0]
        ok = self.matches(self.state) and self.matches(sharded_state(self.model, self.opt))
        return {"load_s": load_s + set_s, "read_s": load_s, "set_state_s": set_s, "load_ok": float(ok),
                "load_mem_extra_bytes": probe.peak_extra()}


def shard_spans(ctx: RankCtx) -> list[tuple[int, int]]:
    """The rank's bytes: every local tensor of its shards, whole."""
    spans = []
    for t in tensors_of(ctx.state, local=True):
        if not t.is_contiguous():
            raise ValueError(f"local tensor of shape {tuple(t.shape)} is not contiguous; the memcpy limit assumes "
                             "FSDP2's contiguous dim-0 shards")
        spans.append((t.data_ptr(), t.numel() * t.element_size()))
    return spans


SHARDED = Kind(shard_spans, PEERS, False, {"raw_write_direct": True}, lambda rec, stall, total: {
    "encode_s": rec.encode_s, "snapshot_s": rec.snapshot_s, "persist_s": rec.persist_s, "commit_s": rec.commit_s})
"""The sharded state: every rank saves its shards; the stall pairs with the memcpy of its round, the raw
write is ``O_DIRECT``; restores are :func:`bench_restore`'s."""


def bench_restore(ctx: ShardedCtx) -> dict[str, Metrics]:
    """One checkpoint of the state by ours and by ``dcp.save``, then ``restore_reps`` rounds restoring
    both into the zeroed live state in alternating order; best round of each."""
    import torch.distributed.checkpoint as dcp
    from ckpt_engine import Checkpointer, TorchDistComm

    root, path = ctx.path("restore-ours"), ctx.path("restore-dcp")
    ck = Checkpointer(root, comm=TorchDistComm(), keep_last=1)
    ck.save(ctx.state, 0)
    ck.wait()
    dcp.save(ctx.state, checkpoint_id=path)
    rounds = rotating({"restore_ours": lambda: ctx.timed_restore(root, lambda: ck.restore(into=ctx.state)),
                       "restore_dcp": lambda: ctx.timed_restore(path, lambda: dcp.load(ctx.state, checkpoint_id=path))},
                      ctx.restore_reps)
    ck.close()
    ctx.remove("restore-")
    return {k: {**best_rounds(r[k] for r in rounds), **numbered([r[k]["load_s"] for r in rounds])} for k in rounds[0]}


def rank_main(rank: int, world: int, cfg: argparse.Namespace, workdir: str, port: int) -> None:
    """One rank: build the FSDP2 model, run ours, the restores and every chosen peer, write ``rank-<r>.json``."""
    start_rank(rank, world, port)
    build_s, (model, opt) = timed(lambda: build(cfg, world))
    state = sharded_state(model, opt)
    tensors = tensors_of(state, local=True)
    ctx = ShardedCtx(rank, world, state, workdir, cfg.reps, cfg.peer_reps, model=model, opt=opt,
                     saved=[t.detach().clone() for t in tensors], restore_reps=cfg.restore_reps)
    run_rank(ctx, SHARDED, [lambda: bench_restore(ctx)], cfg.peers, rank_bytes=state_bytes(tensors),
             tensors=len(tensors), build_s=build_s,
             total_bytes=float(sum(p.numel() * p.element_size() for p in model.parameters()) * 3))


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
                     f"{PEERS[best].label}: {peers[best]['mutable_s'] * 1e3:.1f} ms", "info", None))
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
            if name in res["slowest"]:
                m = {"mutable_s": res["slowest"][name].get("stall_s"), **res["slowest"][name]}
                cells.append([w, PEERS[name].label if name in PEERS else name, *figure_cells(
                    m, {"stall_s": 1e3, "mutable_s": 1e3, "total_s": 1, "mem_extra_bytes": 1 / MiB})])
    lines += [*table(["ranks", "contender", "call ms", "until mutable ms", "to durable s", "extra RSS MiB"], cells), ""]
    restores = []
    for w, res in worlds.items():
        for name, what in (("restore_ours", "ours `restore(into=state)`"), ("restore_dcp", "DCP `load`")):
            m = res["slowest"][name]
            restores.append([w, what, *figure_cells(m, {"load_s": 1, "read_s": 1, "set_state_s": 1,
                                                     "load_mem_extra_bytes": 1 / MiB}),
                             "yes" if m["load_ok"] == 1.0 else "NO"])
    lines += table(["ranks", "restore", "total s", "read s", "set_state_dict s", "extra RSS MiB", "bit-exact"],
                   restores)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = driver_parser(__doc__, (384, "model + AdamW state in MiB, float32"), 9, ("2,4", "each >= 2"))
    p.add_argument("--width", type=int, default=1024, help="model width d (blocks d -> 4d -> d; default 1024)")
    p.add_argument("--restore-reps", type=int, default=3, help="restores of ours and of DCP, alternated (default 3)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"peers to run (default all: {','.join(PEERS)})")
    cfg = p.parse_args(argv)
    cfg.worlds, cfg.peers = tuple(int(w) for w in cfg.worlds.split(",")), tuple(x for x in cfg.peers.split(",") if x)
    if min(cfg.size_mib, cfg.width, cfg.reps, cfg.peer_reps, cfg.restore_reps) < 1 or min(cfg.worlds) < 2:
        p.error("--size-mib, --width, --reps, --peer-reps and --restore-reps must be >= 1, every rank count of "
                "--worlds >= 2 (sharding needs ranks)")
    if set(cfg.peers) - set(PEERS):
        p.error(f"--peers: unknown {sorted(set(cfg.peers) - set(PEERS))}; choose from {','.join(PEERS)}")
    cfg.dir = tempfile.mkdtemp(prefix="bench_sharded-", dir=cfg.dir)
    start, load = time.perf_counter(), CpuLoad()
    results = run_worlds(rank_main, cfg)
    config = {**vars(cfg), "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "wall_s": time.perf_counter() - start, "other_cpu_fraction": load.foreign_cores() / (os.cpu_count() or 1),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = [row for w, res in results.items() for row in headline(w, res["slowest"])]
    write_report(cfg.out, "bench_sharded", markdown(rows, results, config),
                 {"config": config, "rows": rows, "worlds": {str(w): res for w, res in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
