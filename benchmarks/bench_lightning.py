"""Training-time overhead of checkpointing in a real Lightning job: ours against Lightning's own.

One run trains the same MLP (~21 MB of float32 parameters, ~63 MB with Adam's moments; CPU) for
the same number of steps under each configuration, with a checkpoint every ``k`` steps:

* ``none``: no checkpointing (the reference);
* ``ModelCheckpoint`` (sync): ``ModelCheckpoint(every_n_train_steps=k, monitor="step",
  mode="max", save_top_k=3)``: ``torch.save`` on the training thread, three newest kept;
* ``ModelCheckpoint + AsyncCheckpointIO``: the same, ``Trainer(plugins=[AsyncCheckpointIO()])``
  (clones every tensor on the training thread, ``torch.save`` in a thread);
* ours: ``AsyncShardedCheckpoint(every_n_train_steps=k, keep_last=3)`` with ``pipeline=False``
  (the snapshot copy on the training thread) and ``pipeline=True`` (the copy overlaps the next
  forward/backward and is waited for before the next optimizer step).

First on one device, then (unless ``--no-ddp``) on two ranks with ``ddp_spawn`` (one torch thread
each). Configurations are interleaved within each repetition (the order rotates), every figure is
the median over the repetitions, and every ratio is taken within this run.

Figures (rank 0): loop time = ``on_train_start`` .. ``on_train_end`` (start-up excluded; the
checkpoints taken inside the loop included; the last one's background write is not), to-durable =
until every checkpoint is written (AsyncCheckpointIO's drain, ours' wait in ``on_train_end``);
stall per checkpoint = time the training thread spent in the checkpoint callback for it (hooks
timed by subclassing: ``on_train_batch_end`` of the step, plus, for ours, the wait in the next
step's ``on_before_optimizer_step``), next to ours' own ``stall_ms`` from ``figures.jsonl``.

Then (unless ``--model mlp``) a model nobody here wrote: Lightning's demo Transformer
(``LightningTransformer``, 14.6 M parameters, with Adam: ~176 MB of state; synthetic tokens; one CPU
device; 120 steps, a checkpoint every 10), one fresh process per fit, contenders alternated over 3
rounds, each figure the minimum over the rounds: whole-process CPU time (``getrusage``, every
thread, imports included) and fit wall time, with where the CPU went per checkpoint and per
thread (``_transformer_job.py``, ``_transformer_bench.py``).

The Transformer section can also measure ours' node-memory level against a slow disk (not in the
default list; ``--tf-contenders none,ours_disk50,ours_mem,ours_mem_every1,copy_hash_every1``):
the disk paced to ``--tf-disk-mb-s`` (50 MB/s) as the only level (``ours_disk50``), a memory level
in ``/dev/shm`` in front of it every ``--tf-every`` steps (``ours_mem``) and at every step
(``ours_mem_every1``), and, as the floor of a checkpoint at every step, copying the state into a
preallocated buffer and hashing it with xxh3 at every step (``copy_hash_every1``). Targets: every
10 steps ≤ 3.5 % CPU time and fit wall time over no checkpointing; at every step, CPU per
checkpoint ≤ 1.5 × the floor per step.

Usage::

    .venv/bin/python benchmarks/bench_lightning.py            # full run, about 10 minutes on a quiet machine
    .venv/bin/python benchmarks/bench_lightning.py --model transformer --tf-threads 1   # the Transformer alone
    .venv/bin/python benchmarks/bench_lightning.py --quick    # smoke test, about two minutes
    .venv/bin/python benchmarks/bench_lightning.py --model transformer --tf-threads 1 \
        --tf-contenders none,ours_disk50,ours_mem,ours_mem_every1,copy_hash_every1   # memory level, ~15 minutes

Outputs: ``benchmarks/out/bench_lightning.{md,json,png}`` (``--model transformer``:
``bench_lightning_transformer.{md,json}``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lightning_job import (LABELS, OURS, PEERS, TARGET_VS_PEER, Contender, Job, RunResult, Runner,  # noqa: E402
                            base_step_s, drift_corrected, local_costs, mean, median, step_times, warm_up)
import _transformer_bench  # noqa: E402
from _transformer_job import CONTENDERS as TF_CONTENDERS, DEFAULT_CONTENDERS as TF_DEFAULT, TransformerJob  # noqa: E402



def contenders(k: int) -> list[Contender]:
    return [Contender("none", "none"), Contender("mc_sync", "mc_sync", every=k),
            Contender("mc_async", "mc_async", every=k), Contender("ours", "ours", every=k, pipeline=False),
            Contender("ours_pipe", "ours", every=k, pipeline=True)]


def measure(runner: Runner, job: Job, cs: list[Contender], reps: int) -> list[RunResult]:
    results = []
    for rep in range(reps):  # the rotation starts at 1: no-checkpointing is not the first fit of the run
        order = cs[(rep + 1) % len(cs):] + cs[:(rep + 1) % len(cs)]
        for c in order:
            results.append(runner(job, c, rep=rep))
    return results


def summarize(job: Job, results: list[RunResult], cs: list[Contender]) -> dict[str, Any]:
    """Per contender: medians over repetitions, overhead ratios against ``none``."""
    by = {c.name: [r for r in results if r.contender == c.name] for c in cs}
    base = by["none"]
    base_loop, base_durable = median([r.loop_s for r in base]), median([r.durable_s for r in base])
    base_by_rep = {r.rep: r for r in base}
    rows = {}
    for c in cs:
        rs = by[c.name]
        loop, durable = median([r.loop_s for r in rs]), median([r.durable_s for r in rs])
        stalls = [s for r in rs for s in r.stalls_ms]
        steady = [s for r in rs for s in r.stalls_ms[1:]]
        figs = [f for r in rs for f in r.figures if f["step"] in set(r.save_steps)]
        dc = [drift_corrected(r, base_by_rep[r.rep]) for r in rs if r.rep in base_by_rep]
        rows[c.name] = {
            "dc_overhead": median(dc), "dc_overhead_per_rep": dc,
            "local_cost_ms": mean([x * 1e3 for r in rs for x in local_costs(r)]),
            "clean_step_ms": median([base_step_s(r) * 1e3 for r in rs]),
            "profile_ms": phase_profile(rs),
            "work": work_table(rs),
            "label": LABELS[c.name], "every": c.every, "pipeline": c.pipeline, "reps": len(rs),
            "loop_s": loop, "durable_s": durable,
            "overhead": loop / base_loop - 1, "durable_overhead": durable / base_durable - 1,
            "overhead_per_rep": [r.loop_s / base_by_rep[r.rep].loop_s - 1 for r in rs if r.rep in base_by_rep],
            "loop_s_per_rep": [r.loop_s for r in rs],
            "n_ckpt": median([float(r.n_ckpt) for r in rs]),
            "stall_ms": mean(stalls), "stall_first_ms": mean([r.stalls_ms[0] for r in rs if r.stalls_ms]),
            "stall_steady_ms": mean(steady),
            "engine_stall_ms": mean([f["stall_ms"] for f in figs]),
            "engine_snapshot_ms": mean([f["snapshot_ms"] for f in figs]),
            "engine_persist_ms": mean([f["persist_ms"] for f in figs]),
            "final_ms": mean([r.final_save_ms for r in rs]) if c.kind == "ours" else math.nan,
            "train_cpu_ms": mean([x for r in rs for x in r.train_cpu_ms]),
            "train_cpu_steady_ms": mean([x for r in rs for x in r.train_cpu_ms[1:]]),
            "foreign_cores_max": max(r.foreign_cores for r in rs),
        }
        n = rows[c.name]["n_ckpt"]
        rows[c.name]["cost_per_ckpt_ms"] = (loop - base_loop) / n * 1e3 if n else math.nan
        rows[c.name]["dc_cost_per_ckpt_ms"] = (rows[c.name]["dc_overhead"] * job.steps * rows[c.name]["clean_step_ms"]
                                               / n if n else math.nan)
    loops = [r.loop_s for r in base]
    noise = (max(loops) - min(loops)) / base_loop if len(loops) > 1 else math.nan
    return {"devices": job.devices, "steps": job.steps, "rows": rows, "baseline_spread": noise,
            "iteration_ms": base_loop / job.steps * 1e3}


def work_table(rs: list[RunResult]) -> dict[str, dict[str, float]]:
    """Mean wall and CPU time per item of checkpoint work, by kind and thread (see ``WORK``)."""
    acc: dict[str, list[tuple[float, float]]] = {}
    for r in rs:
        for what, where, wall, cpu in r.work:
            acc.setdefault(f"{what} ({where})", []).append((wall, cpu))
    return {k: {"n_per_run": len(v) / len(rs), "wall_ms": mean([w * 1e3 for w, _ in v]),
                "cpu_ms": mean([c * 1e3 for _, c in v])} for k, v in acc.items()}


def phase_profile(rs: list[RunResult]) -> list[float]:
    """Mean step time (ms) by position after a checkpoint (1 = the step that follows it, which
    holds its stall), over every interval of every repetition; all steps for no checkpointing."""
    if not rs[0].save_steps:
        return [mean([dt * 1e3 for r in rs for dt in step_times(r)[5:]])]
    k = rs[0].save_steps[1] - rs[0].save_steps[0] if len(rs[0].save_steps) > 1 else 1
    acc: dict[int, list[float]] = {i: [] for i in range(1, k + 1)}
    for r in rs:
        dts = step_times(r)
        for s in r.save_steps:
            for i in range(1, k + 1):
                if s + i - 2 < len(dts):
                    acc[i].append(dts[s + i - 2] * 1e3)
    return [mean(acc[i]) for i in range(1, k + 1)]


def verdicts(s: dict[str, Any]) -> list[str]:
    rows, noise = s["rows"], s["baseline_spread"]
    lines = []
    for key, what in (("overhead", "wall-time overhead"), ("dc_overhead", "drift-corrected overhead")):
        best = min(PEERS, key=lambda p: rows[p][key])
        bo = rows[best][key]
        for o in OURS:
            ov = rows[o][key]
            if bo <= 0:
                verdict = "inconclusive (best peer's overhead ≤ 0: noise)"
            else:
                ratio = ov / bo
                passed = "PASS" if ratio <= TARGET_VS_PEER else "FAIL"
                verdict = f"{ratio:.2f} × best peer → {passed} (target ≤ 0.33)"
            lines.append(f"- {s['devices']} device(s), {what}, {LABELS[o]}: {ov * 100:+.1f} % vs best peer "
                         f"({LABELS[best]}) {bo * 100:+.1f} %: {verdict}")
    p0, p1 = rows["ours"], rows["ours_pipe"]
    moved = p0["engine_stall_ms"] - p1["engine_stall_ms"]
    hidden = moved >= 0.5 * p0["engine_snapshot_ms"]
    gain = p0["local_cost_ms"] - p1["local_cost_ms"]
    lines.append(f"- {s['devices']} device(s), pipeline=True vs False: the snapshot copy "
                 f"({p0['engine_snapshot_ms']:.1f} ms) is {'' if hidden else 'NOT '}taken off the training thread "
                 f"(engine stall_ms {p1['engine_stall_ms']:.1f} vs {p0['engine_stall_ms']:.1f}; whole callback "
                 f"{p1['stall_ms']:.1f} vs {p0['stall_ms']:.1f} ms per checkpoint); cost per checkpoint (local) "
                 f"{p1['local_cost_ms']:.0f} vs {p0['local_cost_ms']:.0f} ms ({gain:+.0f} ms for pipelining), overhead "
                 f"{p1['overhead'] * 100:+.1f} % vs {p0['overhead'] * 100:+.1f} % (drift-corrected "
                 f"{p1['dc_overhead'] * 100:+.1f} % vs {p0['dc_overhead'] * 100:+.1f} %); step after a checkpoint "
                 f"{p1['profile_ms'][0]:.1f} vs {p0['profile_ms'][0]:.1f} ms (baseline spread {noise * 100:.1f} %)")
    return lines


def _f(x: float, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or x != x else fmt.format(x)


def markdown(summaries: list[dict[str, Any]], config: dict[str, Any]) -> str:
    lines = [f"# bench_lightning: checkpoint every {config['every']} steps, {config['state_mib']:.0f} MiB state "
             f"({config['params_m']:.2f} M params + Adam), {config['cpu_count']} cores, torch {config['torch']}, "
             f"Lightning {config['lightning']}", ""]
    for s in summaries:
        lines += [f"## {s['devices']} device(s){' (ddp_spawn, 1 thread per rank)' if s['devices'] > 1 else ''}: "
                  f"{s['steps']} steps, {config['reps'] if s['devices'] == 1 else config['ddp_reps']} repetitions, "
                  f"iteration ≈ {s['iteration_ms']:.0f} ms, baseline spread {s['baseline_spread'] * 100:.1f} %", "",
                  "| configuration | loop s (median) | overhead vs none | per repetition | drift-corrected overhead "
                  "| to durable, overhead | checkpoints | cost per ckpt ms (wall / drift-corr. / local) "
                  "| stall per ckpt ms (all / first / steady) | training-thread CPU per ckpt ms (all / steady) "
                  "| engine stall_ms | engine snapshot / persist ms | clean step ms | foreign load (max cores) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in s["rows"].items():
            per = ", ".join(f"{x * 100:+.1f}" for x in r["overhead_per_rep"])
            lines.append(
                f"| {r['label']} | {r['loop_s']:.2f} | {r['overhead'] * 100:+.1f} % | {per} "
                f"| {r['dc_overhead'] * 100:+.1f} % "
                f"| {r['durable_overhead'] * 100:+.1f} % | {r['n_ckpt']:.0f} | {_f(r['cost_per_ckpt_ms'])} / "
                f"{_f(r['dc_cost_per_ckpt_ms'])} / {_f(r['local_cost_ms'])} "
                f"| {_f(r['stall_ms'])} / {_f(r['stall_first_ms'])} / {_f(r['stall_steady_ms'])} "
                f"| {_f(r['train_cpu_ms'])} / {_f(r['train_cpu_steady_ms'])} "
                f"| {_f(r['engine_stall_ms'])} | {_f(r['engine_snapshot_ms'])} / {_f(r['engine_persist_ms'])} "
                f"| {r['clean_step_ms']:.1f} | {r['foreign_cores_max']:.2f} |")
        lines += ["", *verdicts(s), "",
                  "Where the checkpoint work runs (rank 0; mean per item; CPU = that thread's user + system time):", "",
                  "| configuration | work item (thread) | items per run | wall ms | CPU ms |", "|---|---|---|---|---|"]
        for name, r in s["rows"].items():
            for item, w in r["work"].items():
                lines.append(f"| {r['label']} | {item} | {w['n_per_run']:.0f} | {w['wall_ms']:.1f} "
                             f"| {w['cpu_ms']:.1f} |")
        lines += ["", "Mean step time by position after a checkpoint (ms; 1 = the step that holds its stall):", "",
                  "| configuration | " + " | ".join(str(i) for i in range(1, 11)) + " |",
                  "|---|" + "---|" * 10]
        for name, r in s["rows"].items():
            if len(r["profile_ms"]) > 1:
                lines.append(f"| {r['label']} | " + " | ".join(f"{x:.1f}" for x in r["profile_ms"][:10]) + " |")
        lines += [f"| no checkpointing (any step) | {s['rows']['none']['profile_ms'][0]:.1f} |" + " |" * 9, ""]
    lines += [
        "Notes:",
        "- Overhead = median loop time ÷ median loop time without checkpointing − 1 (loop: `on_train_start` .. "
        "`on_train_end`, start-up excluded). Per repetition: the same ratio against that repetition's "
        "no-checkpoint run. To durable: until every checkpoint is written (AsyncCheckpointIO drained at "
        "teardown, ours waited for in `on_train_end`); ours fsyncs, torch.save does not.",
        "- Drift-corrected overhead: each run measured in its own clean iteration time (median step time over the "
        "last 30 % of each interval between checkpoints): loop ÷ (steps × clean step) minus the same figure of the "
        "no-checkpoint run of that repetition. On this VM whole runs come out uniformly 20-50 % faster or slower "
        "than their neighbours (clean step time differs by run, not within one), which the wall-time ratio cannot "
        "tell from checkpoint cost; this figure can, but misses a slowdown that lasts whole intervals.",
        "- Cost per checkpoint = (loop − no-checkpoint loop) ÷ checkpoints (wall), or drift-corrected overhead × "
        "steps × clean step ÷ checkpoints, or local: excess of the steps that follow each checkpoint up to the next "
        "(all 10 here) over the late-interval steps just before it: stall plus the slowdown of the steps that "
        "run beside a background write.",
        "- Stall per checkpoint: training-thread time inside the checkpoint callback's hooks for that checkpoint "
        "(minus the median of the same hooks at steps without one); for ours it includes Lightning's "
        "`dump_checkpoint`, the RNG/buffer capture and the schedule's bookkeeping, which ours' own `stall_ms` "
        "(`Checkpointer.save` only) leaves out. First = the first checkpoint of a fit (buffer allocation).",
        "- Training-thread CPU per checkpoint: `time.thread_time` on the training thread for the checkpoint: "
        "ours' `train_cpu_ms` of `figures.jsonl` (Lightning's dictionary, encoding, its part of the copy), "
        "`ModelCheckpoint._save_checkpoint` for Lightning's (its dictionary, then `torch.save` or "
        "AsyncCheckpointIO's clone). Steady: without the first checkpoint of each fit.",
        "- Foreign load: CPU cores used by other processes during the fit (the machine is shared).",
        "",
    ]
    return "\n".join(lines) + "\n"


def plot(summaries: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["mc_sync", "mc_async", "ours", "ours_pipe"]
    colors = ["tab:red", "tab:orange", "tab:blue", "tab:cyan"]
    short = ["MC sync", "MC+AsyncIO", "ours", "ours pipe"]
    fig, axes = plt.subplots(len(summaries), 3, figsize=(16, 3.8 * len(summaries)), squeeze=False)
    for (ax1, ax2, ax3), s in zip(axes, summaries):
        rows = s["rows"]
        for i, (n, c, sh) in enumerate(zip(names, colors, short)):
            ov = rows[n]["overhead"] * 100
            ax1.bar(i, ov, color=c)
            ax1.text(i, ov, f"{ov:+.1f}%", ha="center", va="bottom" if ov >= 0 else "top", fontsize=8)
            for x in rows[n]["overhead_per_rep"]:
                ax1.plot(i, x * 100, "k.", ms=4)
            ax1.plot(i + 0.25, rows[n]["dc_overhead"] * 100, "D", color="black", ms=5,
                     label="drift-corrected" if i == 0 else None)
            prof = [x / rows[n]["clean_step_ms"] for x in rows[n]["profile_ms"]]
            ax3.plot(range(1, len(prof) + 1), prof, "o-", color=c, ms=3, label=sh)
            st = rows[n]["stall_ms"]
            ax2.bar(i, st, color=c)
            ax2.text(i, st, f"{st:.0f}", ha="center", va="bottom", fontsize=8)
        best = min(rows[p]["overhead"] for p in PEERS) * 100
        ax1.axhline(best * TARGET_VS_PEER, color="gray", ls="--", lw=1, label="target: 1/3 of best peer")
        ax1.axhline(0, color="black", lw=0.5)
        ax1.set_xticks(range(len(names)), short)
        ax1.set_ylabel("training-time overhead %")
        ax1.set_title(f"{s['devices']} device(s), k={rows['ours']['every']}: overhead vs no checkpointing "
                      "(dots: repetitions)", fontsize=9)
        ax1.legend(fontsize=7)
        ax2.set_xticks(range(len(names)), short)
        ax2.set_ylabel("ms")
        ax2.set_title("training-thread stall per checkpoint (mean)", fontsize=9)
        ax3.axhline(1, color="gray", lw=0.8)
        ax3.set_xlabel("step after the checkpoint (1 = the one that holds its stall)")
        ax3.set_ylabel("step time ÷ the run's clean step")
        ax3.set_title("mean step time by position in the interval", fontsize=9)
        ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--ddp-steps", type=int, default=60)
    p.add_argument("--ddp-reps", type=int, default=2)
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank on one device (0: all cores)")
    p.add_argument("--quick", action="store_true", help="smoke test: few steps, one repetition")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--budget-s", type=float, default=210.0,
                   help="wall-time budget: no waiting for a quiet machine or re-runs beyond it")
    p.add_argument("--quiet", type=float, default=0.3,
                   help="re-run a fit during which other processes used more cores than this (once)")
    p.add_argument("--model", choices=("all", "mlp", "transformer"), default="all",
                   help="the MLP sections, Lightning's demo Transformer, or both (default)")
    p.add_argument("--tf-steps", type=int, default=120)
    p.add_argument("--tf-every", type=int, default=10)
    p.add_argument("--tf-rounds", type=int, default=3)
    p.add_argument("--tf-threads", type=int, default=0,
                   help="torch threads of the Transformer fits (0: torch's default, all cores)")
    p.add_argument("--tf-contenders", default=",".join(TF_DEFAULT),
                   help=f"comma-separated, among {','.join(TF_CONTENDERS)} (none is always run; default "
                        f"{','.join(TF_DEFAULT)})")
    p.add_argument("--tf-disk-mb-s", type=float, default=50.0,
                   help="the slow disk's rate of ours_disk50, ours_mem and ours_mem_every1 (MB/s)")
    p.add_argument("--tf-from", default=None, metavar="JSON",
                   help="no fits: the Transformer section again from a saved bench_lightning_transformer.json")
    a = p.parse_args()
    if a.tf_from:
        rerender_transformer(a.tf_from, a.out)
        return
    if a.quick:
        a.steps, a.reps, a.ddp_steps, a.ddp_reps = 30, 1, 20, 1
        a.tf_steps, a.tf_rounds = 30, 1
    scratch = a.dir or tempfile.mkdtemp(prefix="bench_lightning-")
    workdir = os.path.join(scratch, "run")
    job = Job(steps=a.steps, batch=a.batch, hidden=a.hidden, threads=a.threads)
    cs = contenders(a.every)
    config = {"every": a.every, "steps": a.steps, "reps": a.reps, "ddp_steps": a.ddp_steps, "ddp_reps": a.ddp_reps,
              "batch": a.batch, "hidden": a.hidden, "threads": a.threads, "params_m": job.params() / 1e6,
              "state_mib": job.state_mib(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "lightning": __import__("pytorch_lightning").__version__, "python": platform.python_version(),
              "quick": a.quick}
    runner = Runner(workdir, a.budget_s, quiet=a.quiet)
    summaries: list[dict[str, Any]] = []
    results: list[RunResult] = []
    if a.model in ("all", "mlp"):
        print(f"bench_lightning: {job.params() / 1e6:.2f} M params, {job.state_mib():.0f} MiB state, k={a.every}",
              flush=True)
        warm_up(job, workdir)
        results = measure(runner, job, cs, a.reps)
        summaries = [summarize(job, results, cs)]
        if not a.no_ddp:
            ddp = Job(steps=a.ddp_steps, batch=a.batch, hidden=a.hidden, devices=2, threads=1)
            results_ddp = measure(runner, ddp, cs, a.ddp_reps)
            summaries.append(summarize(ddp, results_ddp, cs))
            results += results_ddp
    transformer: dict[str, Any] | None = None
    if a.model in ("all", "transformer"):
        transformer = run_transformer(a, workdir)
    config.update(elapsed_s=runner.elapsed(), waited_for_quiet_s=runner.waited_s, reruns=runner.reruns)
    os.makedirs(a.out, exist_ok=True)
    name = "bench_lightning" if a.model != "transformer" else "bench_lightning_transformer"
    text = markdown(summaries, config) if summaries else f"# bench_lightning, {a.model} only\n\n"
    if transformer is not None:
        text += "\n".join(_transformer_bench.markdown(transformer["summary"])) + "\n"
    with open(os.path.join(a.out, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump({"config": config, "summaries": summaries, "runs": [r.as_json() for r in results],
                   "transformer": transformer}, f, indent=1)
    if summaries:
        plot(summaries, os.path.join(a.out, "bench_lightning.png"))
    print(text)
    print(f"elapsed {runner.elapsed():.0f} s (waited {runner.waited_s:.0f} s for a quiet machine, "
          f"{runner.reruns} re-runs); wrote {a.out}/{name}.{{md,json{',png' if summaries else ''}}}")


def rerender_transformer(path: str, out: str) -> None:
    """``--tf-from``: the Transformer section of a saved run, summarized again (its fits unchanged)."""
    with open(path) as f:
        doc = json.load(f)
    doc["transformer"] = _transformer_bench.resummarize(doc["transformer"])
    lines = _transformer_bench.markdown(doc["transformer"]["summary"])
    text = "# bench_lightning, transformer only\n\n" + "\n".join(lines)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_lightning_transformer.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "bench_lightning_transformer.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(text)


def run_transformer(a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """The demo Transformer section: alternated rounds of one fresh process per fit."""
    chosen = [c.strip() for c in a.tf_contenders.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in TF_CONTENDERS]
    if unknown:
        raise SystemExit(f"--tf-contenders: unknown {unknown}; choose among {', '.join(TF_CONTENDERS)}")
    contenders = ["none"] + [c for c in TF_CONTENDERS if c in chosen and c != "none"]
    job = TransformerJob(steps=a.tf_steps, every=a.tf_every, threads=a.tf_threads, disk_mb_s=a.tf_disk_mb_s)
    print(f"bench_lightning: Lightning's demo Transformer, {a.tf_steps} steps, k={a.tf_every}, "
          f"{a.tf_rounds} rounds of {', '.join(contenders)}", flush=True)
    fits = _transformer_bench.measure(job, contenders, a.tf_rounds, workdir, quiet=a.quiet)
    return {"summary": _transformer_bench.summarize(job, fits, contenders),
            "fits": [{**r.as_json(), "foreign_cores": load} for r, load in fits]}


if __name__ == "__main__":
    main()
