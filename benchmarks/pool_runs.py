"""Pool the paired figures of several ``bench_save`` runs: one median per target, with its interval.

Per world size and target, every pair of every run (``bench_save.json`` of each): the pooled median, a
95 % bootstrap interval of it (4000 resamples, a fixed seed) and each run's own median. The pairs:
``benchmarks/README.md``, section bench_save.

Usage::

    .venv/bin/python benchmarks/pool_runs.py RUN_A/bench_save.json RUN_B/bench_save.json ... [--names A,B] [--out F.md]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from _common import Metrics, slowest, table
from bench_save import counted, persist_ratios, stall_pairs
TARGETS: dict[str, tuple[str, str, Callable[[float], bool] | None]] = {
    "stall": ("stall ÷ the copy on the rank's cores on both sides of it", "≤ 1.10", lambda x: x <= 1.10),
    "snapshot": ("of which the copy inside `save()` alone ÷ the same copies", "-", None),
    "persist": ("persist ÷ raw write + fsync of the same round", "≥ 0.90", lambda x: x >= 0.90),
    **{f"restore_{c}{suffix}": (label.format(c), *test) for c in ("cold", "warm") for suffix, label, test in (
        ("", "restore ÷ raw read into fresh memory, {}", ("≥ 0.90", lambda x: x >= 0.90)),
        ("_cap", "raw read + xxh3 of every MiB ÷ raw read, {}: the most a verified restore reaches", ("-", None)),
        ("_verified", "restore ÷ raw read + xxh3 of every MiB, {}", ("-", None)))},
}
"""Each figure's label, target and test; ``None``: informative (what bounds or explains a target)."""
RESTORE_PAIRS = {"": ("raw", "ours"), "_cap": ("raw", "verified"), "_verified": ("verified", "ours")}
"""The restore figures' pairs of times, by the suffix of the figure: (numerator, denominator)."""


@dataclass(frozen=True)
class Pooled:
    """One target of one world size, pooled over runs; ``runs``: each run's own median, in order."""

    world: str
    target: str
    median: float
    low: float
    high: float
    pairs: int
    runs: tuple[float, ...]

    @property
    def met(self) -> bool | None:
        """Whether the pooled median meets the target; ``None`` for an informative figure."""
        test = TARGETS[self.target][2]
        return None if test is None else test(self.median)


def rank_pairs(rank: dict[str, Metrics]) -> dict[str, list[float]]:
    """The per-pair ratios of each target of one rank's times (or of the slowest rank's). Pure."""
    ours, paired, out = rank["ours"], rank["paired"], {}
    saves = [{k: ours[f"rep{i}_{k}"] for k in ("stall_s", "snapshot_s", "copy_before_s", "copy_after_s")}
             for i in counted(ours, "rep{}_stall_s", 1)]
    if len(saves) > 1:
        out.update({k: v for k, v in stall_pairs(saves).items() if k in ("stall", "snapshot")})
    if persist_ratios(rank):
        out["persist"] = persist_ratios(rank)
    for cache in ("cold", "warm"):
        rounds = counted(paired, f"restore_{cache}_{{}}_ours_s", 1)
        times = {n: [paired[f"restore_{cache}_{i}_{n}_s"] for i in rounds] for n in ("raw", "ours", "verified")}
        if rounds:
            out.update({f"restore_{cache}{suffix}": [x / y for x, y in zip(times[a], times[b])]
                        for suffix, (a, b) in RESTORE_PAIRS.items()})
    return out


def world_pairs(ranks: Sequence[dict[str, Metrics]]) -> dict[str, list[float]]:
    """Per target, each pair's ratio of the slowest rank's times. Pure."""
    return rank_pairs(slowest(list(ranks)))


def bootstrap_median(values: Sequence[float], rounds: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of the median of ``values`` (deterministic). Pure."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def pool(runs: Sequence[dict[str, Any]]) -> list[Pooled]:
    """Every target of every world size the runs share, pooled. Pure."""
    out: list[Pooled] = []
    for world in sorted(set.intersection(*(set(r["worlds"]) for r in runs)), key=int):
        per_run = [world_pairs(r["worlds"][world]["ranks"]) for r in runs]
        for target in TARGETS:
            if all(target in p for p in per_run):
                values = [x for p in per_run for x in p[target]]
                out.append(Pooled(world, target, statistics.median(values), *bootstrap_median(values), len(values),
                                  tuple(statistics.median(p[target]) for p in per_run)))
    return out


def markdown(pooled: Sequence[Pooled], names: Sequence[str]) -> str:
    """The pooled table: one row per world size and target."""
    cells = [[p.world, TARGETS[p.target][0], f"{p.median:.3f}", f"{p.low:.3f}-{p.high:.3f}", p.pairs,
              *(f"{m:.3f}" for m in p.runs), TARGETS[p.target][1],
              "-" if p.met is None else "yes" if p.met else "**no**"] for p in pooled]
    return "\n".join(table(["ranks", "figure", "pooled median", "95 % interval", "pairs", *names, "target", "met"],
                           cells)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="bench_save.json files of the runs to pool")
    p.add_argument("--names", default=None, help="comma-separated column names of the runs (default: run 1, 2, ...)")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    runs = [json.loads(pathlib.Path(path).read_text()) for path in args.runs]
    names = args.names.split(",") if args.names else [f"run {i}" for i in range(1, len(runs) + 1)]
    if len(names) != len(runs):
        p.error(f"--names gives {len(names)} names for {len(runs)} runs")
    table = markdown(pool(runs), names)
    sys.stdout.write(table)
    if args.out:
        pathlib.Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
