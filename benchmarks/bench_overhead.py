"""Adaptive checkpoint frequency under an overhead budget, in a real Lightning job (CPU, 1 device).

What it measures and its targets: ``benchmarks/README.md``, section bench_overhead. The MLP of
``_lightning_job``, one fresh process per fit: no checkpointing, ours at budgets 2 %, 3.5 % and 10 %,
``ModelCheckpoint`` with and without ``AsyncCheckpointIO`` every ``k`` steps (``k``: the mean interval
ours applied at 3.5 % in a first, calibrating fit), then ours at 3.5 % on a disk slowed halfway through so
that a checkpoint's write takes ``--slow-factor`` adaptive intervals. ``--reps`` rounds alternating the
configurations (``_lightning_job.rounds``); medians, and the overheads paired by round (``_fit_figures``).

Usage::

    .venv/bin/python benchmarks/bench_overhead.py            # ~4 min on a quiet machine
    .venv/bin/python benchmarks/bench_overhead.py --quick    # smoke run
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt, parser, pct, table, verdict, write_report  # noqa: E402
from _fit_figures import clean_step, drift_corrected, mean, median, paired_table, run_line, summarize  # noqa: E402
from _lightning_job import FitJob, FitResult, quiet_fit, rounds  # noqa: E402

BUDGETS = (0.02, 0.035, 0.10)
REFERENCE_BUDGET = 0.035
SLACK = 0.01
"""Target: measured overhead ≤ budget + 1 point."""
MORE_CHECKPOINTS = 3.0
"""Target: at the same overhead, at least 3 × the checkpoints of the best peer."""
WINDOW = 12
"""Steps after a checkpoint its local cost is taken over (cut at the next checkpoint)."""


def name_of(b: float) -> str:
    """The configuration's name of ours at budget ``b``."""
    return f"ours_{b * 100:g}%"


def saves(r: FitResult) -> list[int]:
    """The steps checkpointed inside the loop (not ours' save at the end of training; none for none)."""
    return [s for s in r.save_steps if s < len(r.marks)] if r.contender != "none" else []


def intervals(r: FitResult, lo: int = 0, hi: int = 1 << 30) -> list[float]:
    """The distances between the loop's checkpoints that lie within steps ``lo..hi``."""
    return [float(b - a) for a, b in zip(saves(r), saves(r)[1:]) if a >= lo and b <= hi]


def settled_interval(r: FitResult) -> int:
    """The interval the adaptive fit applied, on average: the mean distance between its checkpoints."""
    if len(saves(r)) < 2:
        raise RuntimeError(f"{r.name}: fewer than two checkpoints in the loop; run more --steps")
    return max(1, round((saves(r)[-1] - saves(r)[0]) / (len(saves(r)) - 1)))


def summarize_budgets(job: FitJob, fits: list[FitResult], names: list[str], k: int) -> dict[str, Any]:
    """:func:`_fit_figures.summarize` (local costs over :data:`WINDOW` steps), and per configuration its loop
    time and overhead (median, and drift-corrected), checkpoints, interval, expected lost work, local wall
    cost per checkpoint, stall, training-thread CPU and the policy's own estimate of its overhead."""
    s = summarize(job, fits, names, window=WINDOW)
    base = median([r.loop_s for r in fits if r.name == "none"])
    base_round = {r.rep: r for r in fits if r.name == "none"}
    it = base / len(next(r for r in fits if r.name == "none").marks)
    for n, row in s["rows"].items():
        rs = [r for r in fits if r.name == n]
        ivs = [i for r in rs for i in intervals(r)]
        row.update({
            "loop_s": median([r.loop_s for r in rs]), "overhead": median([r.loop_s for r in rs]) / base - 1,
            "dc_overhead": median([drift_corrected(r, base_round[r.rep], total="loop_s") for r in rs
                                   if r.rep in base_round]),
            "n_ckpt": median([float(len(saves(r))) for r in rs]), "mean_interval": mean(ivs),
            "expected_lost_work_s": mean(ivs) / 2 * it, "policy_overhead": row["measured_overhead"],
            "local_cost_ms": row["local_wall_ms"] if n != "none" else math.nan})
    return {**s, "iteration_ms": it * 1e3, "k": k}


def verdicts(s: dict[str, Any]) -> list[str]:
    """Each budget against its target, and the checkpoints at the same overhead against the best peer's."""
    rows, lines = s["rows"], []
    for b in BUDGETS:
        r = rows[name_of(b)]
        lines.append(f"- budget {b * 100:g} %: measured {pct(r['overhead'])} → {verdict(r['overhead'] <= b + SLACK)}; "
                     f"drift-corrected {pct(r['dc_overhead'])} → {verdict(r['dc_overhead'] <= b + SLACK)} "
                     f"(target ≤ {(b + SLACK) * 100:g} %); "
                     f"the policy's own estimate {r['policy_overhead'] * 100:.1f} %; "
                     f"{r['n_ckpt']:.0f} checkpoints, mean interval {r['mean_interval']:.1f} steps")
    ref = rows[name_of(REFERENCE_BUDGET)]
    best = min(("mc_sync", "mc_async"), key=lambda n: rows[n]["local_cost_ms"])
    ratio = rows[best]["local_cost_ms"] / ref["local_cost_ms"]
    s["more_checkpoints"] = {"peer": best, "ratio": ratio}
    lines.append(f"- checkpoints at the same overhead (the inverse ratio of the local cost per checkpoint): {best} "
                 f"{rows[best]['local_cost_ms']:.0f} ms, ours (3.5 %) {ref['local_cost_ms']:.0f} ms → {ratio:.1f} × → "
                 f"{verdict(ratio >= MORE_CHECKPOINTS)} (target ≥ {MORE_CHECKPOINTS:g} ×)")
    return lines


def slow_summary(r: FitResult, at: int, mb_s: float) -> dict[str, Any]:
    """The slowed fit before and after step ``at``: intervals (applied and the policy's), persist, stall, and
    the overhead against the fit's own clean step."""
    figs = [f for f in r.figures if f.get("kind", "save") == "save"]
    parts = {"before": [f for f in figs if f["step"] < at], "after": [f for f in figs if f["step"] >= at]}
    it, t = clean_step(r), [m[0] for m in r.marks]
    return {"slow_at_step": at, "mb_per_s": mb_s, "interval_before": mean(intervals(r, hi=at)),
            "interval_after": mean(intervals(r, lo=at)),
            "policy_interval_before":
                parts["before"][-1].get("interval_steps", math.nan) if parts["before"] else math.nan,
            "policy_interval_end": figs[-1].get("interval_steps", math.nan) if figs else math.nan,
            **{f"{k}_ms_{p}": mean([f[f"{k}_ms"] for f in fs]) for p, fs in parts.items()
               for k in ("persist", "stall")},
            "overhead_before": (t[at - 1] - t[0]) / ((at - 1) * it) - 1,
            "overhead_after": (t[-1] - t[at - 1]) / ((len(t) - at) * it) - 1}


def markdown(s: dict[str, Any], slow: dict[str, Any] | None, steps: int, reps: int, run: str = "") -> str:
    """The configurations' table, the paired overheads, the verdicts and the slowed fit's before and after."""
    lines = [*([run, ""] if run else []), f"# bench_overhead: MLP + Adam, {steps} steps, iteration ≈ "
             f"{s['iteration_ms']:.0f} ms, {reps} rounds, peers every k = {s['k']} steps", "",
             *table(["configuration", "loop s", "overhead", "drift-corrected", "policy's estimate", "checkpoints",
                     "mean interval", "expected lost work s", "local cost per ckpt ms", "stall ms (ours)",
                     "training-thread CPU per ckpt ms", "clean step ms", "foreign load (max cores)"], [[
                 n, f"{r['loop_s']:.2f}", pct(r["overhead"]), pct(r["dc_overhead"]),
                 fmt(r["policy_overhead"] * 100, "{:.1f} %"), f"{r['n_ckpt']:.0f}", fmt(r["mean_interval"]),
                 fmt(r["expected_lost_work_s"], "{:.2f}"), fmt(r["local_cost_ms"]), fmt(r["stall_ms"]),
                 fmt(r["train_cpu_ms"]), f"{r['clean_step_ms']:.1f}", fmt(r["foreign_cores_max"], "{:.2f}")]
                 for n, r in s["rows"].items()]),
             "", "Overheads paired by round (median / mean ± standard error; `(noise)`: within two standard errors "
             "of zero):", "", *paired_table(s), "", *verdicts(s), ""]
    if slow is not None:
        rows = [[what, fmt(slow[key.format("before")], spec),
                 fmt(slow[key.format("end" if key.startswith("policy") else "after")], spec)]
                for what, key, spec in (("mean interval (steps)", "interval_{}", "{:.1f}"),
                                        ("the policy's interval (last logged)", "policy_interval_{}", "{:.0f}"),
                                        ("persist ms", "persist_ms_{}", "{:.0f}"),
                                        ("stall ms", "stall_ms_{}", "{:.1f}"))]
        rows.append(["overhead against the fit's clean step", pct(slow["overhead_before"]),
                     pct(slow["overhead_after"])])
        lines += [f"Disk slowed to {slow['mb_per_s']:.0f} MB/s at step {slow['slow_at_step']} (adaptive 3.5 %):", "",
                  *table(["", "before", "after"], rows), ""]
    lines += [f"Notes: loop = the first step's end to the last's; local cost = the excess of the {WINDOW} steps after "
              "a checkpoint over the late steps before it; the rest: benchmarks/README.md, section bench_overhead.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, scratch=None, quiet=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--slow-steps", type=int, default=700, help="steps of the slowed fit (slowed from half of them)")
    p.add_argument("--slow-factor", type=float, default=2.0,
                   help="the slow disk writes a checkpoint in this many adaptive intervals (wall time)")
    p.add_argument("--no-slow", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="smoke run: 120 steps, one round, 160 slowed steps")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.reps, a.slow_steps = 120, 1, 160
    job = FitJob(model="mlp", steps=a.steps, threads=a.threads)
    workdir, ref = os.path.join(a.dir or tempfile.mkdtemp(prefix="bench_overhead-"), "run"), name_of(REFERENCE_BUDGET)
    k = settled_interval(quiet_fit(job, "ours", workdir, a.quiet, name=ref, budget=REFERENCE_BUDGET))
    print(f"bench_overhead: adaptive 3.5 % applied a mean interval of k = {k} steps", flush=True)
    names = ["none", *(name_of(b) for b in BUDGETS), "mc_sync", "mc_async"]
    configs = {**{name_of(b): {"contender": "ours", "budget": b} for b in BUDGETS},
               **{n: {"job": FitJob(**{**asdict(job), "every": k})} for n in ("mc_sync", "mc_async")}}
    fits = rounds(job, names, a.reps, workdir, a.quiet, retry=True, configs=configs)
    summary, slow = summarize_budgets(job, fits, names, k), None
    if not a.no_slow:
        at = a.slow_steps // 2
        mb_s = fits[-1].params * 12 / 1e6 / (a.slow_factor * k * summary["iteration_ms"] / 1e3)
        r = quiet_fit(FitJob(**{**asdict(job), "steps": a.slow_steps}), "ours", workdir, a.quiet, True,
                      name="ours_3.5%_slow", budget=REFERENCE_BUDGET, slow_at_step=at, slow_mb_s=mb_s)
        fits.append(r)
        slow = slow_summary(r, at, mb_s)
    run = run_line(f"`bench_overhead.py {' '.join(sys.argv[1:])}`")
    write_report(a.out, "bench_overhead", markdown(summary, slow, a.steps, a.reps, run),
                 {"run": run, "summary": summary, "slowdown": slow, "fits": [r.as_json() for r in fits]})


if __name__ == "__main__":
    main()
