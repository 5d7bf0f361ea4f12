"""Planner wall time: ``make_plan`` plus one rank's ``slices_for``, for 1k..100k tensors on 8..4096 ranks.

The planner runs inside the stall of the first save and whenever the state's layout changes (target:
10k tensors on 1024 ranks well under 1 s; median of ``--reps``).

Usage::

    .venv/bin/python benchmarks/bench_plan.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckpt_engine.state.plan import TensorMeta, make_plan  # noqa: E402


def time_plan(n: int, world: int, reps: int) -> float:
    """Median seconds of ``make_plan`` + ``slices_for(world // 2)`` over ``reps`` runs, for ``n`` tensors:
    every tenth a 1 MiB matrix, the rest biases and 16 KiB blocks (fp32)."""
    ms = [TensorMeta("float32", (1024, 256) if i % 10 == 0 else (256,) if i % 2 else (64, 64), 4) for i in range(n)]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        make_plan(ms, world).slices_for(world // 2, ms)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print("| tensors | ranks | plan + one rank's slices |\n|---:|---:|---:|")
    for n in (1_000, 10_000, 100_000):
        for world in (8, 1024, 4096):
            print(f"| {n} | {world} | {time_plan(n, world, args.reps) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
