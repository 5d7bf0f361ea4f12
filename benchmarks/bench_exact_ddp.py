"""What exact resume under DDP costs: ``DDPBucketOrder`` against DDP's defaults and against
``find_unused_parameters=True``, on 4 gloo ranks (CPU), in paired alternating rounds.

The contenders and the figures (the per-step time, its per-round difference from the defaults, the
restart): ``benchmarks/README.md``, section bench_exact.

Usage::

    .venv/bin/python benchmarks/bench_exact_ddp.py                 # 4 ranks, 16 MiB MLP of 8 blocks, 8 rounds
    .venv/bin/python benchmarks/bench_exact_ddp.py --depth 64 --mib 4   # many small layers: a larger graph
    .venv/bin/python benchmarks/bench_exact_ddp.py --rounds 2 --steps 6 --mib 4   # quick
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import git_commit, parser, pct, spawn_ranks, write_report  # noqa: E402
from _plain_job import mlp, train  # noqa: E402

from ckpt_engine import DDPBucketOrder  # noqa: E402

CONTENDERS = ("defaults", "bucket_order", "find_unused")


def make_model(mib: int, depth: int) -> nn.Module:
    """``_plain_job``'s MLP of about ``mib`` MiB of float32 parameters in ``depth`` blocks (Linear, LayerNorm,
    GELU: several DDP buckets; the deeper, the more autograd nodes ``find_unused_parameters`` walks per
    step), seed 0."""
    torch.manual_seed(0)
    return mlp(depth, int((mib * 2**20 / 4 / depth) ** 0.5), nn.GELU, head=1)


def build(name: str, cfg: Any) -> tuple[nn.Module, DDP, DDPBucketOrder | None]:
    model = make_model(cfg.mib, cfg.depth)
    ddp = DDP(model, find_unused_parameters=name == "find_unused")
    return model, ddp, DDPBucketOrder(ddp) if name == "bucket_order" else None


def rank_main(rank: int, world: int, cfg: Any, workdir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.randn(cfg.batch, make_model(cfg.mib, cfg.depth)[0].in_features, generator=torch.Generator().manual_seed(rank))
    steps: dict[str, list[list[float]]] = {name: [] for name in CONTENDERS}
    restart: dict[str, list[float]] = {"new_ddp": [], "new_ddp_and_replay": []}
    recorded = None
    for r in range(cfg.rounds):
        for name in CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]:
            model, ddp, order = build(name, cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            # each step after a barrier, so that every rank starts it together
            steps[name].append(train(lambda b, m=ddp: m(b).square().mean(), opt, [x], cfg.steps,
                                     before_step=dist.barrier))
            if order is not None:
                recorded = order.state_dict()
            del ddp, order
        for replay in (False, True) if r % 2 == 0 else (True, False):  # a restart: new DDP, first step due
            model = make_model(cfg.mib, cfg.depth)
            dist.barrier()
            start = time.perf_counter()
            ddp = DDP(model)
            if replay:
                DDPBucketOrder(ddp).load_state_dict(recorded)
            dist.barrier()
            restart["new_ddp_and_replay" if replay else "new_ddp"].append(time.perf_counter() - start)
            del ddp
    with open(os.path.join(workdir, f"rank-{rank}.json"), "w") as f:
        json.dump({"steps": steps, "restart": restart}, f)
    dist.barrier()
    dist.destroy_process_group()


def summarize(ranks: list[dict], warm: int) -> dict[str, Any]:
    """Per contender and round, the median over steps ``warm``.. of the slowest rank's step; the paired
    differences from ``defaults``; the restart figures (slowest rank, median over rounds)."""
    rounds: dict[str, list[float]] = {}
    for name in CONTENDERS:
        per_round = zip(*(r["steps"][name] for r in ranks))
        rounds[name] = [statistics.median(max(s) for s in list(zip(*steps))[warm:]) for steps in per_round]
    base = rounds["defaults"]
    out: dict[str, Any] = {"rounds": rounds, "contenders": {}}
    for name in CONTENDERS:
        diffs = [a / b - 1 for a, b in zip(rounds[name], base)]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        out["contenders"][name] = {"step_s": statistics.median(rounds[name]), "diff_median": statistics.median(diffs),
                                   "diff_mean": statistics.mean(diffs), "diff_se": se}
    restart = {k: statistics.median(max(v) for v in zip(*(r["restart"][k] for r in ranks)))
               for k in ("new_ddp", "new_ddp_and_replay")}
    out["restart"] = {**restart, "replay_s": restart["new_ddp_and_replay"] - restart["new_ddp"]}
    return out


def render(doc: dict[str, Any], cfg: Any) -> str:
    c, rs = doc["contenders"], doc["restart"]
    step = c["defaults"]["step_s"]
    lines = [f"# bench_exact_ddp: {cfg.world} gloo ranks (CPU), {cfg.mib} MiB MLP of {cfg.depth} blocks, batch {cfg.batch}, "
             f"{cfg.rounds} paired rounds of {cfg.steps} steps", "", doc["run_line"], "",
             "| contender | step (median) | per-round difference from defaults: median | mean ± s.e. | exact resume |",
             "|---|---:|---:|---:|---|"]
    exact = {"defaults": "no (> 2 ranks)", "bucket_order": "yes", "find_unused": "yes"}
    for name in CONTENDERS:
        v = c[name]
        within = " (inside the noise: ≤ 2 s.e.)" if name != "defaults" and abs(v["diff_mean"]) <= 2 * v["diff_se"] else ""
        lines.append(f"| {name} | {v['step_s'] * 1e3:.1f} ms | {pct(v['diff_median'])}{within} | "
                     f"{pct(v['diff_mean'])} ± {v['diff_se'] * 100:.1f} % | {exact[name]} |")
    lines += ["", "| restart (a new DDP until its first step may run) | time | in steps |", "|---|---:|---:|",
              f"| DDP(model) | {rs['new_ddp'] * 1e3:.1f} ms | {rs['new_ddp'] / step:.2f} |",
              f"| DDP(model) + DDPBucketOrder replay (the warm-up) | {rs['new_ddp_and_replay'] * 1e3:.1f} ms | "
              f"{rs['new_ddp_and_replay'] / step:.2f} |",
              f"| the replay alone | **{rs['replay_s'] * 1e3:.1f} ms** | **{rs['replay_s'] / step:.2f}** |", ""]
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--depth", type=int, default=8, help="Linear + LayerNorm + GELU blocks")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--name", default="bench_exact_ddp", help="the report's name in --out")
    cfg = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-exact-ddp-") as cfg.dir:
        ranks = spawn_ranks(rank_main, cfg.world, cfg)
    doc = summarize(ranks, warm=2)
    commit = git_commit()
    doc["run"] = {"date": time.strftime("%Y-%m-%d"), "device": f"CPU, {os.cpu_count()} cores", "commit": commit}
    doc["run_line"] = f"Run {doc['run']['date']}, {doc['run']['device']}, {commit}"
    write_report(cfg.out, cfg.name, render(doc, cfg), {**doc, "config": {k: v for k, v in vars(cfg).items()
                                                                                   if k != "dir"}})


if __name__ == "__main__":
    main()
