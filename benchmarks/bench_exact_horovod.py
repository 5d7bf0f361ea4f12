"""The cost of Horovod's deterministic reduction (``deterministic_reduction``: tensor fusion off), 4 ranks.

One ``horovodrun -np 4 --gloo`` job of this file (``--job``) per contender (``fused``: Horovod's defaults;
``exact``: ``horovod_ckpt.init(deterministic_reduction=True)``) and round, alternating, on MLPs of about
the same bytes in 64 tensors and in 16 (``--shapes``). The method and the figures: ``benchmarks/README.md``,
section bench_exact.

Usage::

    .venv/bin/python benchmarks/bench_exact_horovod.py              # 2 models x 5 rounds, ~15 min on 2 cores
    .venv/bin/python benchmarks/bench_exact_horovod.py --ranks 2 --rounds 3 --shapes 16x512   # a core per rank
    .venv/bin/python benchmarks/bench_exact_horovod.py --rounds 1 --steps 10 --shapes 4x256   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import CpuLoad, fmt, git_commit, parser, pct, table, timed, write_report  # noqa: E402
from _plain_job import batches, mlp, paired, rotated, train  # noqa: E402

CONTENDERS = ("fused", "exact")


# ---- one rank of a job -------------------------------------------------------------------------------
def rank_job(a: argparse.Namespace) -> None:
    """One rank: start Horovod as the contender does, restore, train; rank 0 prints its figures as JSON."""
    import torch

    torch.set_num_threads(1)
    import horovod.torch as hvd

    import horovod_ckpt

    init_s, _ = timed(lambda: horovod_ckpt.init(deterministic_reduction=True) if a.contender == "exact"
                       else hvd.init())
    model = mlp(a.layers, a.width, torch.nn.ReLU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    ck = horovod_ckpt.HorovodCheckpointer(a.ckpt_dir, model=model, optimizer=optimizer, keep_last=None,
                                          save_on_train_end=a.prepare, save_on_sigterm=False)
    restore_s, _ = timed(ck.restore)
    data = batches(hvd.rank(), 4, (a.batch, a.width), (a.batch, a.width))

    def steps(n: int, first: int = 0) -> list[float]:
        return train(lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]), optimizer, data, n, first)

    first_step_s = steps(1)[0]
    steps(a.warmup, first=1)
    times = steps(a.steps)
    if a.prepare:
        ck.after_step()
    ck.close()
    if hvd.rank() == 0:
        print("FIGURES " + json.dumps({"init_s": init_s, "restore_s": restore_s, "first_step_s": first_step_s,
                                       "restart_s": init_s + restore_s + first_step_s,
                                       "step_ms": statistics.median(times) * 1e3,
                                       "tensors": len(list(model.parameters())),
                                       "mb": sum(p.numel() for p in model.parameters()) * 4 / 1e6}), flush=True)


# ---- the driver ----------------------------------------------------------------------------------------
Shape = tuple[int, int]
"""(blocks, width) of the MLP."""
FIGURES = ("step_ms", "restart_s", "init_s", "restore_s", "first_step_s")


def launch(a: argparse.Namespace, shape: Shape, contender: str, ckpt_dir: str,
           prepare: bool = False) -> dict[str, float]:
    """One ``horovodrun -np <ranks> --gloo`` job of ``contender``; rank 0's figures and the foreign load."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(a.ranks), "-H",
           f"localhost:{a.ranks}", "--gloo", sys.executable, os.path.abspath(__file__), "--job", "--contender",
           contender, "--ckpt-dir", ckpt_dir, "--layers", str(shape[0]), "--width", str(shape[1]),
           "--batch", str(a.batch), "--warmup", str(a.warmup), "--steps", str(a.steps),
           *(["--prepare"] if prepare else [])]
    env = {k: v for k, v in os.environ.items() if k != "HOROVOD_FUSION_THRESHOLD"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    load = CpuLoad()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    foreign = load.foreign_cores()
    lines = [x for x in done.stdout.splitlines() if "FIGURES " in x]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{contender} job failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return {**json.loads(lines[0].split("FIGURES ", 1)[1]), "foreign_cores": foreign}


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per figure: each contender's median over rounds, the median per-round difference and ratio."""
    out: dict[str, Any] = {}
    for key in FIGURES:
        fused, exact = ([r[c][key] for r in rounds] for c in CONTENDERS)
        p = paired(fused, exact)
        out[key] = {"fused": statistics.median(fused), "exact": statistics.median(exact), "diff": p["diff"],
                    "ratio": p["ratio"]}
    return out


def label(shape: Shape, rounds: list[dict[str, dict[str, float]]]) -> str:
    """The model of a shape, as the table names it."""
    first = rounds[0]["fused"]
    return f"{shape[0]} × {shape[1]}: {first['tensors']:.0f} tensors, {first['mb']:.1f} MB"


def markdown(by_shape: dict[Shape, dict[str, Any]], a: argparse.Namespace, run: str) -> str:
    """The report: one paired table over the shapes, the headline lines, the per-round step ratios."""
    price = (f"the price of bit-identical resume on {a.ranks} ranks" if a.ranks > 2 else
             f"what fusion off costs with a core per rank (on {a.ranks} ranks the reduction is exact either way)")
    rows, heads, notes = [], [], []
    for shape, done in by_shape.items():
        name, s, rounds = label(shape, done["rounds"]), done["summary"], done["rounds"]
        for key in FIGURES:
            unit = "ms" if key.endswith("_ms") else "s"
            spec = "{:.1f}" if unit == "ms" else "{:.3f}"
            r = s[key]
            rows.append([name, f"{key.rsplit('_', 1)[0].replace('_', ' ')} {unit}", fmt(r["fused"], spec),
                         fmt(r["exact"], spec), fmt(r["diff"], "{:+" + spec[2:]), fmt(r["ratio"], "{:.2f}")])
        step, restart = s["step_ms"], s["restart_s"]
        heads.append(f"- {name}: per step exact / fused {step['ratio']:.2f} × ({pct(step['ratio'] - 1)}, "
                     f"{step['diff']:+.1f} ms); restart (start Horovod + restore + first step) "
                     f"{restart['diff']:+.3f} s ({restart['ratio']:.2f} ×) → {price}")
        ratios = ", ".join(f"{r['exact']['step_ms'] / r['fused']['step_ms']:.2f}" for r in rounds)
        loads = ", ".join(f"{max(r[c]['foreign_cores'] for c in CONTENDERS):.1f}" for r in rounds)
        notes.append(f"{name}: per-round step ratios {ratios}; other processes' load per round (cores, the more "
                     f"loaded job of the pair) {loads}.")
    return "\n".join([
        "# bench_exact_horovod: tensor fusion off (deterministic_reduction) against Horovod's default, "
        f"{a.ranks} ranks",
        "", run, "", f"MLPs of blocks × width (Linear(width, width) + LayerNorm per block), SGD with momentum, "
        f"{a.batch} samples per rank and step; median of {a.steps} timed steps after {a.warmup}; {a.rounds} rounds "
        "per model, the contenders' order alternating; one horovodrun job per contender and round:", "",
        *table(["model", "figure (rank 0)", "fused (median)", "exact (median)", "exact - fused (median of rounds)",
                "exact / fused (median of rounds)"], rows, "|---|---|---:|---:|---:|---:|"),
        "", *heads, "", *notes, "", "Notes: rank 0's figures; a step ends in the reduction, so it waits for the "
        "slowest rank. benchmarks/README.md, section bench_exact_horovod.", ""])


def run_line() -> str:
    """``Run <date>, <machine>, commit <hash>`` for the report."""
    import horovod
    import torch

    commit = git_commit()
    return (f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()}-core {platform.machine()} "
            f"VM shared with other work (torch {torch.__version__}, Horovod {horovod.__version__}, Gloo), "
            f"commit {commit or '?'}.")


def parse_shapes(text: str) -> list[Shape]:
    """``"16x512,4x1024"`` -> ``[(16, 512), (4, 1024)]``."""
    try:
        return [(int(b), int(w)) for b, w in (part.split("x") for part in text.split(","))]
    except ValueError as e:
        raise SystemExit(f"--shapes {text!r}: expected blocks x width, comma-separated, e.g. 16x512,4x1024 ({e})")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, scratch=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, default=4, help="2: the cost with a core per rank on a 2-core machine "
                   "(where the reduction is exact either way)")
    p.add_argument("--shapes", default="16x512,4x1024",
                   help="MLPs as blocks x width: about the same bytes in 4 times more tensors, then fewer")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", choices=CONTENDERS, default="fused", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=512, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.job:
        rank_job(a)
        return
    workdir = a.dir or tempfile.mkdtemp(prefix="bench_exact_horovod-")
    by_shape: dict[Shape, dict[str, Any]] = {}
    try:
        for shape in parse_shapes(a.shapes):
            ckpt_dir = os.path.join(workdir, f"ck-{shape[0]}x{shape[1]}")
            launch(a, shape, "fused", ckpt_dir, prepare=True)  # the checkpoint this shape's jobs restore
            rounds = []
            for i in range(a.rounds):
                order = rotated(CONTENDERS, i)
                rounds.append({c: launch(a, shape, c, ckpt_dir) for c in order})
                print(f"{shape[0]}x{shape[1]} round {i + 1}: " + ", ".join(
                    f"{c} step {rounds[-1][c]['step_ms']:.1f} ms, restart {rounds[-1][c]['restart_s']:.2f} s"
                    for c in order), flush=True)
            by_shape[shape] = {"summary": summarize(rounds), "rounds": rounds}
    finally:
        if a.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    write_report(a.out, "bench_exact_horovod", markdown(by_shape, a, run_line()),
                 {"shapes": {f"{b}x{w}": v for (b, w), v in by_shape.items()}, "args": vars(a)})


if __name__ == "__main__":
    main()
