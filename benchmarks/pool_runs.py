"""Pool the paired figures of several ``bench_save`` runs: one median per target, with its interval.

Each of ``bench_save``'s paired targets is a median over 5-9 pairs of one run, and single pairs on
this VM range 0.7-1.6 (the same 1 GiB copy took 96-161 ms within one run, a cold read 0.5-3.4 s per
GiB), so a run's median lands on either side of a target by luck, a different target each run. This
script takes the runs' raw JSON (``bench_save.py --out DIR`` writes ``DIR/bench_save.json``) and, per
world size and target, pools every pair of every run: the pooled median, a 95 % bootstrap interval
of it (pairs resampled with replacement, 4000 times, a fixed seed: the same input gives the same
table), and each run's own median beside it, so that a difference between runs stays visible.

A pair's figure is the job's: every time in it is the slowest rank's (the training waits for the
slowest rank's stall, a commit for every rank's files), as in the run's own persist and restore rows;
the run's stall row takes the slowest rank's median of its own ratios instead, so its figure can
differ from the per-run median here by a few hundredths. The pairs:

* stall: each save 2..N ÷ the mean of the threaded copies timed right before and right after it
  (runs before 38ba48b, 2026-11-26, which timed one side only, pair with that side);
* persist: the faster raw write + fsync of the round ÷ our time after the stall, saves 2..N;
* restore, cold and warm: the raw read into fresh memory of the round ÷ our ``load()``; from
  2026-11-27 (c22a51e) on, also the same raw read hashed as ``load()`` verifies (xxh3 of every MiB): raw ÷
  verified (the cap: the most a restore that checks every byte reaches) and verified ÷ ours.

Informative figures (no target) sit beside the targets they bound or explain: the copy inside
``save()`` alone against the same copies (the stall without encoding, planning and hand-over).

Usage::

    .venv/bin/python benchmarks/pool_runs.py RUN_A/bench_save.json RUN_B/bench_save.json ... [--out F.md]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from _report import persist_ratios
from bench_save import _slowest

Metrics = dict[str, float]
TARGETS: dict[str, tuple[str, Callable[[float], bool] | None]] = {
    "stall": ("≤ 1.10", lambda x: x <= 1.10),
    "snapshot": ("-", None),
    "persist": ("≥ 0.90", lambda x: x >= 0.90),
    "restore_cold": ("≥ 0.90", lambda x: x >= 0.90),
    "restore_cold_cap": ("-", None),
    "restore_cold_verified": ("-", None),
    "restore_warm": ("≥ 0.90", lambda x: x >= 0.90),
    "restore_warm_cap": ("-", None),
    "restore_warm_verified": ("-", None),
}
"""Each figure's target and its test; ``None``: informative (what bounds or explains a target)."""
LABELS = {
    "stall": "stall ÷ the copy on the rank's cores on both sides of it",
    "snapshot": "of which the copy inside `save()` alone ÷ the same copies",
    "persist": "persist ÷ raw write + fsync of the same round",
    "restore_cold": "restore ÷ raw read into fresh memory, cold",
    "restore_cold_cap": "raw read + xxh3 of every MiB ÷ raw read, cold: the most a verified restore reaches",
    "restore_cold_verified": "restore ÷ raw read + xxh3 of every MiB, cold",
    "restore_warm": "restore ÷ raw read into fresh memory, warm",
    "restore_warm_cap": "raw read + xxh3 of every MiB ÷ raw read, warm: the most a verified restore reaches",
    "restore_warm_verified": "restore ÷ raw read + xxh3 of every MiB, warm",
}
@dataclass(frozen=True)
class Pooled:
    """One target of one world size, pooled over runs."""

    world: str
    target: str
    median: float
    low: float
    high: float
    pairs: int
    runs: tuple[float, ...]
    """Each run's own median of the same pairs (in the order the runs were given)."""

    @property
    def met(self) -> bool | None:
        """Whether the pooled median meets the target; ``None`` for an informative figure."""
        test = TARGETS[self.target][1]
        return None if test is None else test(self.median)


def _numbered(m: Metrics, key: Callable[[int], str], start: int) -> list[int]:
    return list(itertools.takewhile(lambda i: key(i) in m, itertools.count(start)))


def rank_pairs(rank: dict[str, Metrics]) -> dict[str, list[float]]:
    """The per-pair ratios of each target of one rank's times (or of the slowest rank's). Pure."""
    ours, copies = rank["ours"], rank.get("memcpy_threads", {})
    out: dict[str, list[float]] = {}
    steady = _numbered(ours, lambda i: f"rep{i}_stall_s", 2)
    if all(f"rep{i}_copy_before_s" in ours for i in steady):
        mean = [(ours[f"rep{i}_copy_before_s"] + ours[f"rep{i}_copy_after_s"]) / 2 for i in steady]
        out["stall"] = [ours[f"rep{i}_stall_s"] / m for i, m in zip(steady, mean)]
        if all(f"rep{i}_snapshot_s" in ours for i in steady):
            out["snapshot"] = [ours[f"rep{i}_snapshot_s"] / m for i, m in zip(steady, mean)]
    elif all(f"rep{i}_s" in copies for i in steady):  # one copy per save, on one side of it
        out["stall"] = [ours[f"rep{i}_stall_s"] / copies[f"rep{i}_s"] for i in steady]
    persist = persist_ratios(rank)
    if persist:
        out["persist"] = persist
    paired = rank.get("paired", {})
    for cache in ("cold", "warm"):
        found = _numbered(paired, lambda i: f"restore_{cache}_{i}_ours_s", 1)
        times = {name: [paired.get(f"restore_{cache}_{i}_{name}_s") for i in found]
                 for name in ("raw", "ours", "verified")}
        pairs = {"": ("raw", "ours"), "_cap": ("raw", "verified"), "_verified": ("verified", "ours")}
        for suffix, (num, den) in pairs.items():  # the verified read: from c22a51e on
            if found and None not in times[num] + times[den]:
                out[f"restore_{cache}{suffix}"] = [a / b for a, b in zip(times[num], times[den])]
    return out


def world_pairs(ranks: Sequence[dict[str, Metrics]]) -> dict[str, list[float]]:
    """Per target, each pair's ratio of the slowest rank's times (every figure used here is a time,
    which ``_slowest`` merges by the largest). Pure."""
    return rank_pairs(_slowest(list(ranks)))


def bootstrap_median(values: Sequence[float], rounds: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of the median of ``values`` (deterministic). Pure."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def pool(runs: Sequence[dict[str, Any]]) -> list[Pooled]:
    """Every target of every world size the runs share, pooled (see the module docstring). Pure."""
    out: list[Pooled] = []
    worlds = sorted(set.intersection(*(set(r["worlds"]) for r in runs)), key=int)
    for world in worlds:
        per_run = [world_pairs(r["worlds"][world]["ranks"]) for r in runs]
        for target in TARGETS:
            if not all(target in p for p in per_run):
                continue
            values = [x for p in per_run for x in p[target]]
            low, high = bootstrap_median(values)
            out.append(Pooled(world, target, statistics.median(values), low, high, len(values),
                              tuple(statistics.median(p[target]) for p in per_run)))
    return out


def markdown(pooled: Sequence[Pooled], names: Sequence[str]) -> str:
    """The pooled table: one row per world size and target."""
    lines = ["| ranks | figure | pooled median | 95 % interval | pairs | " + " | ".join(names) + " | target | met |",
             "|---|---|---|---|---|" + "---|" * len(names) + "---|---|"]
    for p in pooled:
        runs = " | ".join(f"{m:.3f}" for m in p.runs)
        lines.append(f"| {p.world} | {LABELS[p.target]} | {p.median:.3f} | {p.low:.3f}-{p.high:.3f} | {p.pairs} | "
                     f"{runs} | {TARGETS[p.target][0]} | {'-' if p.met is None else 'yes' if p.met else '**no**'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="bench_save.json files of the runs to pool")
    p.add_argument("--names", default=None, help="comma-separated column names of the runs (default: run 1, 2, ...)")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    names = args.names.split(",") if args.names else [f"run {i}" for i in range(1, len(runs) + 1)]
    if len(names) != len(runs):
        p.error(f"--names gives {len(names)} names for {len(runs)} runs")
    table = markdown(pool(runs), names)
    sys.stdout.write(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
