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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import git_commit, parser, pct, spawn_ranks, table, write_report  # noqa: E402
from _fit_figures import NOISE_SE  # noqa: E402
from _plain_job import batches, mlp, paired, rotated, train  # noqa: E402

from ckpt_engine import DDPBucketOrder  # noqa: E402

CONTENDERS = ("defaults", "bucket_order", "find_unused")
RESTARTS = ("new_ddp", "new_ddp_and_replay")
"""A restart: a new DDP until its first step may run, without and with the ``DDPBucketOrder`` replay."""


def width(cfg: Any) -> int:
    """The width of an MLP of about ``cfg.mib`` MiB of float32 parameters in ``cfg.depth`` blocks."""
    return int((cfg.mib * 2**20 / 4 / cfg.depth) ** 0.5)


def make_model(cfg: Any) -> nn.Module:
    """``_plain_job``'s MLP of ``cfg.depth`` blocks (Linear, LayerNorm, GELU: several DDP buckets; the deeper,
    the more autograd nodes ``find_unused_parameters`` walks per step) and a head of one output."""
    return mlp(cfg.depth, width(cfg), nn.GELU, head=1)


def rank_main(rank: int, world: int, cfg: Any, workdir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = batches(rank, 1, (cfg.batch, width(cfg)))
    steps: dict[str, list[list[float]]] = {name: [] for name in CONTENDERS}
    restart: dict[str, list[float]] = {name: [] for name in RESTARTS}
    recorded = None
    for r in range(cfg.rounds):
        for name in rotated(CONTENDERS, r):
            model = make_model(cfg)
            ddp = DDP(model, find_unused_parameters=name == "find_unused")
            order = DDPBucketOrder(ddp) if name == "bucket_order" else None
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            # each step after a barrier, so that every rank starts it together
            steps[name].append(train(lambda b, m=ddp: m(b[0]).square().mean(), opt, data, cfg.steps,
                                     before_step=dist.barrier))
            if order is not None:
                recorded = order.state_dict()
            del ddp, order
        for replay in (False, True) if r % 2 == 0 else (True, False):  # a restart: new DDP, first step due
            model = make_model(cfg)
            dist.barrier()
            start = time.perf_counter()
            ddp = DDP(model)
            if replay:
                DDPBucketOrder(ddp).load_state_dict(recorded)
            dist.barrier()
            restart[RESTARTS[replay]].append(time.perf_counter() - start)
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
    out: dict[str, Any] = {"rounds": rounds, "contenders": {}}
    for name in CONTENDERS:
        p = paired(rounds["defaults"], rounds[name])
        out["contenders"][name] = {"step_s": statistics.median(rounds[name]), "diff_median": p["rel_median"],
                                   "diff_mean": p["rel_mean"], "diff_se": p["rel_se"]}
    restart = {k: statistics.median(max(v) for v in zip(*(r["restart"][k] for r in ranks))) for k in RESTARTS}
    out["restart"] = {**restart, "replay_s": restart["new_ddp_and_replay"] - restart["new_ddp"]}
    return out


def render(doc: dict[str, Any], cfg: Any) -> str:
    """The report: the contenders' steps and their differences from the defaults, then the restart."""
    c, rs = doc["contenders"], doc["restart"]
    step = c["defaults"]["step_s"]
    exact = {"defaults": "no (> 2 ranks)", "bucket_order": "yes", "find_unused": "yes"}
    rows = []
    for name, v in c.items():
        noise = name != "defaults" and abs(v["diff_mean"]) <= NOISE_SE * v["diff_se"]
        within = " (inside the noise: ≤ 2 s.e.)" if noise else ""
        rows.append([name, f"{v['step_s'] * 1e3:.1f} ms", f"{pct(v['diff_median'])}{within}",
                     f"{pct(v['diff_mean'])} ± {v['diff_se'] * 100:.1f} %", exact[name]])
    restarts = [[what, f"{s * 1e3:.1f} ms", f"{s / step:.2f}"] for what, s in [
        ("DDP(model)", rs["new_ddp"]), ("DDP(model) + DDPBucketOrder replay (the warm-up)", rs["new_ddp_and_replay"])]]
    restarts.append(["the replay alone", f"**{rs['replay_s'] * 1e3:.1f} ms**", f"**{rs['replay_s'] / step:.2f}**"])
    return "\n".join([
        f"# bench_exact_ddp: {cfg.world} gloo ranks (CPU), {cfg.mib} MiB MLP of {cfg.depth} blocks, batch {cfg.batch}, "
        f"{cfg.rounds} paired rounds of {cfg.steps} steps", "", doc["run_line"], "",
        *table(["contender", "step (median)", "per-round difference from defaults: median", "mean ± s.e.",
                "exact resume"], rows, "|---|---:|---:|---:|---|"), "",
        *table(["restart (a new DDP until its first step may run)", "time", "in steps"], restarts, "|---|---:|---:|"),
        ""])


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
