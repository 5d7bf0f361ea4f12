"""Adaptive checkpoint frequency under an overhead budget, in a real Lightning job (CPU, 1 device).

The MLP of ``_lightning_job`` (~63 MB of state with Adam), ``--steps`` steps per fit, one fresh
process per fit, under:

* ``none``: no checkpointing (the reference);
* ours, adaptive: ``AsyncShardedCheckpoint(overhead_budget=b)`` for b = 2 %, 3.5 %, 10 %;
* ``ModelCheckpoint`` (synchronous ``torch.save``) and the same with ``AsyncCheckpointIO``, every
  ``k`` steps, ``k`` being the mean interval the adaptive 3.5 % fit applied (measured first);

then once more adaptive 3.5 % on a disk that slows down halfway through (``_slow_storage``, paced so
that a checkpoint's write takes ``--slow-factor`` × the adaptive interval's wall time).

Per configuration (median over ``--reps`` rounds, the order alternating): overhead of the training
loop (the first step's end to the last's) over no checkpointing, drift-corrected (each fit in its
own clean steps), checkpoints, mean interval, expected lost work, local cost per checkpoint (the
excess of the steps after it over the clean steps before it). Targets: overhead ≤ budget + 1 point;
at the same overhead ≥ 3 × the checkpoints of the best peer (the inverse ratio of the local costs);
on the slow disk the interval grows.

Usage::

    .venv/bin/python benchmarks/bench_overhead.py            # ~4 min on a quiet machine
    .venv/bin/python benchmarks/bench_overhead.py --quick    # smoke run

Outputs: ``benchmarks/out/bench_overhead.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import CpuLoad, wait_quiet  # noqa: E402
from _lightning_job import (FitJob, FitResult, clean_step, drift_corrected, local_costs, mean, median,  # noqa: E402
                            run_fit, warm_up)

BUDGETS = (0.02, 0.035, 0.10)
REFERENCE_BUDGET = 0.035
SLACK = 0.01
"""Target: measured overhead ≤ budget + 1 point."""
MORE_CHECKPOINTS = 3.0
"""Target: at the same overhead, at least 3 × the checkpoints of the best peer."""
WINDOW = 12
"""Steps after a checkpoint its local cost is taken over (cut at the next checkpoint)."""


def name_of(b: float) -> str:
    return f"ours_{b * 100:g}%"


def saves(r: FitResult) -> list[int]:
    """The steps checkpointed inside the loop (ours' save at the last step is the end of training's;
    no checkpointing lists the steps the others checkpoint, for its control windows)."""
    return [s for s in r.save_steps if s < len(r.marks)] if r.contender != "none" else []


def intervals(r: FitResult) -> list[int]:
    return [b - a for a, b in zip(saves(r), saves(r)[1:])]


def settled_interval(r: FitResult) -> int:
    """The interval the adaptive fit applied, on average: the mean distance between its checkpoints."""
    if len(saves(r)) < 2:
        raise RuntimeError(f"{r.name}: fewer than two checkpoints in the loop; run more --steps")
    return max(1, round((saves(r)[-1] - saves(r)[0]) / (len(saves(r)) - 1)))


class Runner:
    """Fits one after another, each after waiting (a little) for the other processes to quieten; a fit
    during which they used more than ``quiet`` cores is run once more, the less disturbed one kept."""

    def __init__(self, job: FitJob, workdir: str, quiet: float) -> None:
        self.job, self.workdir, self.quiet, self.fits = job, workdir, quiet, []
        self.pycache = os.path.join(tempfile.gettempdir(), "ckpt-suite-bench-pycache")
        warm_up(job, workdir, self.pycache)

    def __call__(self, name: str, contender: str, rep: int, job: FitJob | None = None, **kw: Any) -> FitResult:
        best: FitResult | None = None
        for attempt in range(2):
            wait_quiet(self.quiet, max_wait=10.0)
            load = CpuLoad()
            r = run_fit(job or self.job, contender, self.workdir, rep=rep, pycache=self.pycache, name=name, **kw)
            r.counters["foreign_cores"] = load.foreign_cores()
            print(f"  round {rep} {name:12s} loop {r.loop_s:6.2f} s  ckpts {len(saves(r)):3d}  foreign load "
                  f"{r.counters['foreign_cores']:.2f} cores{'  (run again)' if attempt else ''}", flush=True)
            if best is None or r.counters["foreign_cores"] < best.counters["foreign_cores"]:
                best = r
            if r.counters["foreign_cores"] <= self.quiet:
                break
        assert best is not None
        self.fits.append(best)
        return best


def summarize(fits: list[FitResult], names: list[str], k: int) -> dict[str, Any]:
    by = {n: [r for r in fits if r.name == n] for n in names}
    base = median([r.loop_s for r in by["none"]])
    base_round = {r.rep: r for r in by["none"]}
    it = base / len(by["none"][0].marks)
    rows: dict[str, Any] = {}
    for n in names:
        rs = by[n]
        ckpts = median([float(len(saves(r))) for r in rs])
        ivs = [float(i) for r in rs for i in intervals(r)]
        figs = [f for r in rs for f in r.figures if f.get("kind", "save") == "save"]
        local = [c * 1e3 for r in rs for c in local_costs(r, WINDOW)] if n != "none" else []
        rows[n] = {
            "loop_s": median([r.loop_s for r in rs]), "overhead": median([r.loop_s for r in rs]) / base - 1,
            "dc_overhead": median([drift_corrected(r, base_round[r.rep], total="loop_s") for r in rs
                                   if r.rep in base_round]),
            "n_ckpt": ckpts, "mean_interval": mean(ivs), "expected_lost_work_s": mean(ivs) / 2 * it,
            "local_cost_ms": mean(local), "stall_ms": mean([f["stall_ms"] for f in figs]),
            "train_cpu_ms": mean([x for r in rs for x in r.train_cpu_ms]),
            "policy_overhead": mean([f["measured_overhead"] for f in figs if "measured_overhead" in f]),
            "clean_step_ms": median([clean_step(r) * 1e3 for r in rs]),
            "foreign_cores_max": max(r.counters.get("foreign_cores", math.nan) for r in rs),
        }
    return {"rows": rows, "iteration_ms": it * 1e3, "k": k}


def verdicts(s: dict[str, Any]) -> list[str]:
    rows, lines = s["rows"], []
    for b in BUDGETS:
        r = rows[name_of(b)]
        ok, ok_dc = r["overhead"] <= b + SLACK, r["dc_overhead"] <= b + SLACK
        lines.append(f"- budget {b * 100:g} %: measured {r['overhead'] * 100:+.1f} % → {'PASS' if ok else 'FAIL'}; "
                     f"drift-corrected {r['dc_overhead'] * 100:+.1f} % → {'PASS' if ok_dc else 'FAIL'} "
                     f"(target ≤ {(b + SLACK) * 100:g} %); "
                     f"the policy's own estimate {r['policy_overhead'] * 100:.1f} %; {r['n_ckpt']:.0f} checkpoints, "
                     f"mean interval {r['mean_interval']:.1f} steps")
    ref = rows[name_of(REFERENCE_BUDGET)]
    best = min(("mc_sync", "mc_async"), key=lambda n: rows[n]["local_cost_ms"])
    ratio = rows[best]["local_cost_ms"] / ref["local_cost_ms"]
    s["more_checkpoints"] = {"peer": best, "ratio": ratio}
    lines.append(f"- checkpoints at the same overhead (the inverse ratio of the local cost per checkpoint): {best} "
                 f"{rows[best]['local_cost_ms']:.0f} ms, ours (3.5 %) {ref['local_cost_ms']:.0f} ms → {ratio:.1f} × "
                 f"→ "
                 f"{'PASS' if ratio >= MORE_CHECKPOINTS else 'FAIL'} (target ≥ {MORE_CHECKPOINTS:g} ×)")
    return lines


def slow_summary(r: FitResult, at: int, mb_s: float) -> dict[str, Any]:
    """The slowed fit before and after step ``at``: intervals, the policy's interval, persist and stall,
    and the overhead against the fit's own clean step."""
    figs = [f for f in r.figures if f.get("kind", "save") == "save"]
    before, after = [f for f in figs if f["step"] < at], [f for f in figs if f["step"] >= at]
    it, t = clean_step(r), [m[0] for m in r.marks]
    return {"slow_at_step": at, "mb_per_s": mb_s,
            "interval_before": mean([float(b - a) for a, b in zip(saves(r), saves(r)[1:]) if b <= at]),
            "interval_after": mean([float(b - a) for a, b in zip(saves(r), saves(r)[1:]) if a >= at]),
            "policy_interval_before": before[-1].get("interval_steps", math.nan) if before else math.nan,
            "policy_interval_end": figs[-1].get("interval_steps", math.nan) if figs else math.nan,
            "persist_ms_before": mean([f["persist_ms"] for f in before]),
            "persist_ms_after": mean([f["persist_ms"] for f in after]),
            "stall_ms_before": mean([f["stall_ms"] for f in before]),
            "stall_ms_after": mean([f["stall_ms"] for f in after]),
            "overhead_before": (t[at - 1] - t[0]) / ((at - 1) * it) - 1,
            "overhead_after": (t[-1] - t[at - 1]) / ((len(t) - at) * it) - 1}


def _f(x: float, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or x != x else fmt.format(x)


def markdown(s: dict[str, Any], slow: dict[str, Any] | None, steps: int, reps: int) -> str:
    lines = [f"# bench_overhead: MLP + Adam, {steps} steps, iteration ≈ {s['iteration_ms']:.0f} ms, {reps} rounds, "
             f"peers every k = {s['k']} steps", "",
             "| configuration | loop s | overhead | drift-corrected | policy's estimate | checkpoints "
             "| mean interval | expected lost work s | local cost per ckpt ms | stall ms (ours) "
             "| training-thread CPU per ckpt ms | clean step ms | foreign load (max cores) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in s["rows"].items():
        lines.append(f"| {n} | {r['loop_s']:.2f} | {r['overhead'] * 100:+.1f} % | {r['dc_overhead'] * 100:+.1f} % "
                     f"| {_f(r['policy_overhead'] * 100, '{:.1f} %')} | {r['n_ckpt']:.0f} | {_f(r['mean_interval'])} "
                     f"| {_f(r['expected_lost_work_s'], '{:.2f}')} | {_f(r['local_cost_ms'])} | {_f(r['stall_ms'])} "
                     f"| {_f(r['train_cpu_ms'])} "
                     f"| {r['clean_step_ms']:.1f} | {_f(r['foreign_cores_max'], '{:.2f}')} |")
    lines += ["", *verdicts(s), ""]
    if slow is not None:
        lines += [f"Disk slowed to {slow['mb_per_s']:.0f} MB/s at step {slow['slow_at_step']} (adaptive 3.5 %):", "",
                  "| | before | after |", "|---|---|---|",
                  f"| mean interval (steps) | {_f(slow['interval_before'])} | {_f(slow['interval_after'])} |",
                  f"| the policy's interval (last logged) | {_f(slow['policy_interval_before'], '{:.0f}')} "
                  f"| {_f(slow['policy_interval_end'], '{:.0f}')} |",
                  f"| persist ms | {_f(slow['persist_ms_before'], '{:.0f}')} "
                  f"| {_f(slow['persist_ms_after'], '{:.0f}')} |",
                  f"| stall ms | {_f(slow['stall_ms_before'])} | {_f(slow['stall_ms_after'])} |",
                  f"| overhead against the fit's clean step | {slow['overhead_before'] * 100:+.1f} % "
                  f"| {slow['overhead_after'] * 100:+.1f} % |", ""]
    lines += ["Notes: loop = the first step's end to the last's (no set-up, not ours' final wait); overhead = median "
              "÷ that of no checkpointing − 1; drift-corrected = each fit in its own clean step (the median of the "
              "late steps of its intervals) against its round's no-checkpointing fit; local cost = the excess of the "
              f"{WINDOW} steps after a checkpoint over the late steps before it; expected lost work = mean interval "
              "÷ 2 × iteration. Peers keep 3 checkpoints, as ours; `torch.save` does not fsync, ours does.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--slow-steps", type=int, default=700, help="steps of the slowed fit (slowed from half of them)")
    p.add_argument("--slow-factor", type=float, default=2.0,
                   help="the slow disk writes a checkpoint in this many adaptive intervals (wall time)")
    p.add_argument("--no-slow", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="smoke run: 120 steps, one round, 160 slowed steps")
    p.add_argument("--quiet", type=float, default=0.3, help="wait (a little) for other processes to use fewer cores")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.reps, a.slow_steps = 120, 1, 160
    job = FitJob(model="mlp", steps=a.steps, threads=a.threads)
    run = Runner(job, os.path.join(a.dir or tempfile.mkdtemp(prefix="bench_overhead-"), "run"), a.quiet)
    ref = name_of(REFERENCE_BUDGET)
    k = settled_interval(run(ref, "ours", 0, budget=REFERENCE_BUDGET))  # first: the peers' k comes from it
    print(f"bench_overhead: adaptive 3.5 % applied a mean interval of k = {k} steps", flush=True)
    peer_job = FitJob(**{**job.__dict__, "every": k})
    order = [*(name_of(b) for b in BUDGETS if b != REFERENCE_BUDGET), "none", "mc_sync", "mc_async"]
    for rep in range(a.reps):
        for n in (order if rep % 2 == 0 else [ref, *order[::-1]]):
            budget = float(n[5:-1]) / 100 if n.startswith("ours_") else 0.0
            run(n, "ours" if budget else n, rep, job=peer_job if n.startswith("mc") else job, budget=budget)
    names = ["none", *(name_of(b) for b in BUDGETS), "mc_sync", "mc_async"]
    summary = summarize(run.fits, names, k)
    slow = None
    if not a.no_slow:
        at = a.slow_steps // 2
        mb_s = run.fits[-1].params * 12 / 1e6 / (a.slow_factor * k * summary["iteration_ms"] / 1e3)
        r = run("ours_3.5%_slow", "ours", 0, job=FitJob(**{**job.__dict__, "steps": a.slow_steps}),
                budget=REFERENCE_BUDGET, slow_at_step=at, slow_mb_s=mb_s)
        slow = slow_summary(r, at, mb_s)
    text = markdown(summary, slow, a.steps, a.reps)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_overhead.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "bench_overhead.json"), "w") as f:
        json.dump({"summary": summary, "slowdown": slow, "fits": [r.as_json() for r in run.fits]}, f, indent=1)
    print(text)
    print(f"wrote {a.out}/bench_overhead.{{md,json}}")


if __name__ == "__main__":
    main()
