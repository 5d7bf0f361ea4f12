"""Planner wall time: ``make_plan`` plus one rank's ``slices_for``, for 1k..100k tensors on 8..4096 ranks.

The planner runs inside the stall of the first save and whenever the state's layout changes (target:
10k tensors on 1024 ranks well under 1 s; median of ``--reps``).

Usage::

    .venv/bin/python benchmarks/bench_plan.py [--reps 5]
"""

from __future__ import annotations

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import parser, table, timed, write_report  # noqa: E402

from ckpt_engine.state.plan import TensorMeta, make_plan  # noqa: E402


def time_plan(n: int, world: int, reps: int) -> float:
    """Median seconds of ``make_plan`` + ``slices_for(world // 2)`` over ``reps`` runs, for ``n`` tensors:
    every tenth a 1 MiB matrix, the rest biases and 16 KiB blocks (fp32)."""
    ms = [TensorMeta("float32", (1024, 256) if i % 10 == 0 else (256,) if i % 2 else (64, 64), 4) for i in range(n)]
    return statistics.median(timed(lambda: make_plan(ms, world).slices_for(world // 2, ms))[0] for _ in range(reps))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    runs = [{"tensors": n, "ranks": world, "seconds": time_plan(n, world, args.reps)}
            for n in (1_000, 10_000, 100_000) for world in (8, 1024, 4096)]
    rows = [[r["tensors"], r["ranks"], f"{r['seconds'] * 1e3:.1f} ms"] for r in runs]
    text = "\n".join([f"# bench_plan: make_plan + one rank's slices_for, median of {args.reps}", "",
                      *table(["tensors", "ranks", "plan + one rank's slices"], rows, rule="|---:" * 3 + "|")])
    write_report(args.out, "bench_plan", text + "\n", {"reps": args.reps, "runs": runs})


if __name__ == "__main__":
    main()
