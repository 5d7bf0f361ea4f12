"""Training overhead of checkpointing in a real Lightning job: ours against Lightning's own, CPU.

What it measures, against which peers and targets: ``benchmarks/README.md``, section bench_lightning.
Each fit runs in a fresh process (``_lightning_job``); the contenders alternate within a round, each
figure is a contender's minimum over the rounds, overheads against the minimum of no checkpointing.

Usage::

    .venv/bin/python benchmarks/bench_lightning.py --model transformer --tf-threads 1   # ~8 min
    .venv/bin/python benchmarks/bench_lightning.py --model transformer --tf-threads 1 \
        --tf-contenders none,ours_disk50,ours_mem,ours_mem_every1,copy_hash_every1   # memory level
    .venv/bin/python benchmarks/bench_lightning.py --quick    # smoke run: 30 steps, one round
    .venv/bin/python benchmarks/bench_lightning.py --tf-from benchmarks/out/bench_lightning_transformer.json
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from dataclasses import asdict, fields
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt, parser, pct, table, verdict, write_report  # noqa: E402
from _lightning_job import (CONTENDERS, DEFAULT_CONTENDERS, EVERY_STEP, LABELS, MARK, MEMORY_CONTENDERS,  # noqa: E402
                            MEMORY_LEVEL, OURS, PEERS, TARGET_VS_PEER, FitJob, FitResult, clean_step,
                            drift_corrected, every_of, label, local_costs, mean, median, quiet_fit, warm_up)

MEMORY_TARGET = 0.035
"""Target: ours with the memory level in front of a slow disk, every 10 steps, at most 3.5 % of CPU
time and of fit wall time over no checkpointing."""
FLOOR_TARGET = 1.5
"""Target: at every step, ours' CPU per checkpoint at most 1.5 × copying the state into a preallocated
buffer and hashing it (xxh3) alone."""
OURS_ALL = OURS + tuple(c for c in MEMORY_CONTENDERS if c.startswith("ours"))
"""Every configuration of ours (the tables of ours' own figures)."""
REF = ("process_cpu_s", "fit_cpu_s", "fit_wall_s", "end_wall_s")


def measure(job: FitJob, contenders: list[str], rounds: int, workdir: str,
            quiet: float = 0.3) -> list[tuple[FitResult, float]]:
    """``rounds`` rounds of one fit per contender (rotating order; no checkpointing is not the first fit),
    after unmeasured warm-up fits; each fit with the cores other processes used meanwhile."""
    warm_up(job, workdir, memory=any(c in MEMORY_LEVEL for c in contenders))
    out = []
    for rnd in range(rounds):
        k = (rnd + 1) % len(contenders)
        out += [quiet_fit(job, c, workdir, quiet, rep=rnd) for c in contenders[k:] + contenders[:k]]
    return out


def resummarize(saved: dict[str, Any]) -> dict[str, Any]:
    """The section (``{"summary", "fits"}``) again from the fits a run saved, with this module's figures."""
    known = {f.name for f in fields(FitJob)}
    job = FitJob(**{k: v for k, v in saved["summary"]["job"].items() if k in known})
    fits = [(FitResult.of(f), f["foreign_cores"]) for f in saved["fits"]]
    return {"summary": summarize(job, fits, list(saved["summary"]["rows"])), "fits": saved["fits"]}


def _background(r: FitResult) -> float:
    """CPU seconds of the Python threads other than the main one (the checkpoint writers)."""
    return sum(r.threads_cpu_s.values())


def _own_cpu_s(r: FitResult) -> float:
    """CPU seconds of the checkpoint work on the threads that ran it, within the fit: the training thread's
    part of each checkpoint and every Python thread but the main one (blind to indirect costs)."""
    return sum(x for x in r.train_cpu_ms if x == x) / 1e3 + _background(r)


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / min(values) if len(values) > 1 else math.nan


def summarize(job: FitJob, measured: list[tuple[FitResult, float]], contenders: list[str]) -> dict[str, Any]:
    """Per contender, the figures of its fits (see :func:`markdown`)."""
    base = [r for r, _ in measured if r.contender == "none"]
    base_by_round = {r.rep: r for r in base}
    ref = {k: min(getattr(r, k) for r in base) for k in REF}
    rows: dict[str, Any] = {}
    for c in contenders:
        rs, foreign = [r for r, _ in measured if r.contender == c], [f for r, f in measured if r.contender == c]
        best = {k: min(getattr(r, k) for r in rs) for k in ref}
        n = median([float(r.n_ckpt) for r in rs])
        figs = [f for r in rs for f in r.figures if f.get("kind", "save") == "save"]
        row: dict[str, Any] = {
            "label": label(c, job), "every": every_of(job, c), "rounds": len(rs),
            **{f"{k}_min": v for k, v in best.items()}, **{f"{k}_overhead": best[k] / ref[k] - 1 for k in ref},
            "per_round_cpu": [r.process_cpu_s for r in rs], "per_round_wall": [r.fit_wall_s for r in rs],
            "n_ckpt": n, "foreign_cores_max": max(foreign) if foreign else math.nan,
            "main_cpu_s": median([r.main_cpu_s for r in rs]), "other_cpu_s": median([r.other_cpu_s for r in rs]),
            "threads_cpu_s": {name: median([r.threads_cpu_s.get(name, 0.0) for r in rs])
                              for name in sorted({k for r in rs for k in r.threads_cpu_s})},
            "train_cpu_ms": mean([x for r in rs for x in r.train_cpu_ms]),
            "train_cpu_first_ms": mean([r.train_cpu_ms[0] for r in rs if r.train_cpu_ms]),
            "train_cpu_steady_ms": mean([x for r in rs for x in r.train_cpu_ms[1:]]),
            "background_cpu_per_ckpt_ms": mean([_background(r) / r.n_ckpt * 1e3 for r in rs if r.n_ckpt]),
            "extra_cpu_per_ckpt_ms": (best["process_cpu_s"] - ref["process_cpu_s"]) / n * 1e3 if n else math.nan,
            "import_cpu_ms": median([r.import_cpu_ms for r in rs]),
            "clean_step_ms": median([clean_step(r) * 1e3 for r in rs]),
            **{key: mean([f[key] for f in figs if key in f])
               for key in ("encode_cpu_ms", "snapshot_cpu_ms", "persist_cpu_ms", "commit_cpu_ms", "stall_ms")},
        }
        for key, i, total in (("dc_cpu_overhead", 2, "fit_cpu_s"), ("dc_wall_overhead", 0, "fit_wall_s")):
            # every step: no step is clear of a checkpoint, no clean step to correct by
            row[key] = math.nan if c in EVERY_STEP else median(
                [drift_corrected(r, base_by_round[r.rep], i, total) for r in rs if r.rep in base_by_round])
        for name, i in MARK.items():
            row[f"local_{name}_ms"] = mean([x * 1e3 for r in rs for x in local_costs(r, job.every, i)]
                                           if c not in EVERY_STEP else [])
        if c in MEMORY_CONTENDERS:
            row.update(_memory_figures(rs, base_by_round, ref))
        rows[c] = row
    return {"job": {**asdict(job), "params": base[0].params, "state_mb": base[0].params * 12 / 1e6}, "rows": rows,
            "cpu_spread": _spread([r.process_cpu_s for r in base]),
            "wall_spread": _spread([r.fit_wall_s for r in base])}


def _memory_figures(rs: list[FitResult], base_by_round: dict[int, FitResult], ref: dict[str, float]) -> dict[str, Any]:
    """The node-memory section's figures of one contender (see :func:`memory_markdown`)."""
    committed = [float(sum(1 for f in r.figures if f.get("kind", "save") == "save" and f.get("committed")))
                 if r.figures else float(r.n_ckpt) for r in rs]
    n = median(committed)
    flushes = [f for r in rs for f in r.figures if f.get("kind") == "flush" and f.get("committed")]
    steady = [cpu for r in rs for _, cpu in r.copy_hash[1:]]
    own = [_own_cpu_s(r) for r in rs]
    counter = {k: median([r.counters.get(k, math.nan) for r in rs]) for k in ("waited_s", "flushed", "flush_skipped")}
    return {
        **counter, "committed": n,
        "own_cpu_per_ckpt_ms": median([o / k * 1e3 for o, k in zip(own, committed) if k]),
        "own_cpu_overhead": median([(o + r.import_cpu_ms / 1e3) / (r.process_cpu_s - o - r.import_cpu_ms / 1e3)
                                    for o, r in zip(own, rs)]),
        "own_cpu_steady_overhead": median([(o - r.threads_cpu_s.get("ckpt-reserve", 0.0))
                                           / (r.process_cpu_s - o - r.import_cpu_ms / 1e3) for o, r in zip(own, rs)]),
        "reserve_cpu_ms": median([r.threads_cpu_s.get("ckpt-reserve", 0.0) * 1e3 for r in rs]),
        "flush_lag_ms": mean([f["lag_ms"] for f in flushes]), "flush_copy_ms": mean([f["copy_ms"] for f in flushes]),
        "final_wait_s": median([r.fit_wall_s - r.end_wall_s for r in rs]),
        "cpu_per_ckpt_ms": (min(r.process_cpu_s for r in rs) - ref["process_cpu_s"]) / n * 1e3 if n else math.nan,
        "cpu_per_ckpt_paired_ms": median([(r.process_cpu_s - base_by_round[r.rep].process_cpu_s) / k * 1e3
                                          for r, k in zip(rs, committed) if r.rep in base_by_round and k]),
        "floor_thread_cpu_steady_ms": mean([cpu * 1e3 for cpu in steady]) if steady else math.nan,
        "shm_left_fits": sum(1 for r in rs if r.shm_left),
        "shm_left_example": next((r.shm_left[:5] for r in rs if r.shm_left), []),
    }


def verdicts(s: dict[str, Any]) -> list[str]:
    """Ours' overhead ÷ the best peer's, per figure, against :data:`TARGET_VS_PEER`."""
    rows, lines = s["rows"], []
    peers = [p for p in PEERS if p in rows]
    for key, what in (("process_cpu_s_overhead", "whole-process CPU"), ("fit_wall_s_overhead", "fit wall time"),
                      ("dc_cpu_overhead", "drift-corrected fit CPU"), ("dc_wall_overhead", "drift-corrected fit wall"),
                      ("local_cpu_ms", "local process CPU per checkpoint"),
                      ("local_wall_ms", "local wall time per checkpoint")) if peers else ():
        best = min(peers, key=lambda p: rows[p][key])
        bo = rows[best][key]
        shown = (lambda x: f"{x:.0f} ms") if key.startswith("local") else pct
        for o in (o for o in OURS if o in rows):
            ov = rows[o][key]
            result = ("inconclusive (best peer's overhead ≤ 0: noise)" if bo <= 0 else
                      f"{ov / bo:.2f} × best peer → {verdict(ov / bo <= TARGET_VS_PEER)} (target ≤ 0.33)")
            lines.append(f"- Transformer, {what}, {LABELS[o]}: {shown(ov)} vs best peer ({LABELS[best]}) "
                         f"{shown(bo)}: {result}")
    return lines


def markdown(s: dict[str, Any]) -> list[str]:
    """The report: every contender's overheads, its local costs, the verdicts, where ours' CPU goes, the
    CPU by thread; then the node-memory section when its contenders ran."""
    j, rows = s["job"], s["rows"]
    model = ("Lightning's demo Transformer (`LightningTransformer`" if j.get("model", "transformer") == "transformer"
             else "An MLP (512 → 2048 → 2048 → 10")
    lines = [f"## {model}, {j['params'] / 1e6:.1f} M parameters + Adam, {j['state_mb']:.0f} MB state), 1 CPU device, "
             f"{j['steps']} steps, checkpoint every {j['every']}, torch threads {j['threads'] or 'default'}: min of "
             f"{rows['none']['rounds']} alternated rounds, one process per fit", "",
             f"Spread of the no-checkpointing fits (max ÷ min − 1): process CPU {s['cpu_spread'] * 100:.1f} %, "
             f"fit wall {s['wall_spread'] * 100:.1f} %.", "",
             *table(["configuration", "process CPU s (min)", "overhead", "fit CPU s (min)", "overhead",
                     "fit wall s (min)", "overhead", "per round: CPU / wall s", "drift-corrected CPU / wall overhead",
                     "checkpoints", "extra process CPU per ckpt ms",
                     "training-thread CPU per ckpt ms (first / steady)", "background CPU per ckpt ms",
                     "foreign load (max cores)"], [[
                 r["label"], f"{r['process_cpu_s_min']:.2f}", pct(r["process_cpu_s_overhead"]),
                 f"{r['fit_cpu_s_min']:.2f}", pct(r["fit_cpu_s_overhead"]), f"{r['fit_wall_s_min']:.2f}",
                 pct(r["fit_wall_s_overhead"]),
                 ", ".join(f"{c:.1f}/{w:.1f}" for c, w in zip(r["per_round_cpu"], r["per_round_wall"])),
                 f"{pct(r['dc_cpu_overhead'])} / {pct(r['dc_wall_overhead'])}", f"{r['n_ckpt']:.0f}",
                 fmt(r["extra_cpu_per_ckpt_ms"]), f"{fmt(r['train_cpu_first_ms'])} / {fmt(r['train_cpu_steady_ms'])}",
                 fmt(r["background_cpu_per_ckpt_ms"]), fmt(r["foreign_cores_max"], "{:.2f}")] for r in rows.values()])]
    lines += ["", f"Local cost per checkpoint (ms, mean over checkpoints and rounds; the excess of the {j['every']} "
              "steps after each checkpoint over the late steps before it; no checkpointing: the same windows, a "
              "control):", "",
              *table(["configuration", "process CPU", "main-thread CPU", "wall", "clean step ms", "import CPU ms"],
                     [[r["label"], *(fmt(r[k]) for k in ("local_cpu_ms", "local_main_cpu_ms", "local_wall_ms",
                                                         "clean_step_ms", "import_cpu_ms"))] for r in rows.values()])]
    lines += ["", *verdicts(s), "", "Where ours' CPU goes per checkpoint (`figures.jsonl`, mean; ms):", "",
              *table(["configuration", "training thread (`train_cpu_ms`)", "encode + layout", "copy (all threads)",
                      "persist (hash + write)", "commit", "stall ms"],
                     [[rows[o]["label"], *(fmt(rows[o][k]) for k in ("train_cpu_ms", "encode_cpu_ms", "snapshot_cpu_ms",
                                                                     "persist_cpu_ms", "commit_cpu_ms", "stall_ms"))]
                      for o in OURS_ALL if o in rows])]
    lines += ["", "CPU by thread (s per fit, median): main = the training thread (start-up and imports included), "
              "other = native threads (torch's intra-op workers):", "",
              *table(["configuration", "main", "Python threads", "other"], [[
                  r["label"], f"{r['main_cpu_s']:.2f}",
                  ", ".join(f"{k} {v:.2f}" for k, v in r["threads_cpu_s"].items() if v >= 0.005) or "-",
                  f"{r['other_cpu_s']:.2f}"] for r in rows.values()])]
    lines += ["", "Notes: the method and the meaning of each figure: benchmarks/README.md, section bench_lightning.",
              ""]
    return lines + (memory_markdown(s) if any(c in rows for c in MEMORY_CONTENDERS) else [])


def memory_verdicts(s: dict[str, Any]) -> list[str]:
    """The node-memory targets: :data:`MEMORY_TARGET` (every ``every`` steps) and :data:`FLOOR_TARGET` (every step)."""
    rows, j, lines = s["rows"], s["job"], []
    foreign = max(r["foreign_cores_max"] for r in rows.values())
    disk = f"memory + {j['disk_mb_s']:g} MB/s disk, every {j['every']}"
    if "ours_mem" in rows:
        r = rows["ours_mem"]
        cpu, own, wall, end = (r[k] for k in ("process_cpu_s_overhead", "own_cpu_overhead", "fit_wall_s_overhead",
                                              "end_wall_s_overhead"))
        lines.append(f"- {disk}, CPU time (target ≤ {MEMORY_TARGET * 100:g} %): whole process {pct(cpu)} → "
                     f"{verdict(cpu <= MEMORY_TARGET)}; the checkpoint threads' own CPU ÷ the rest of the fit's "
                     f"{pct(own)} → {verdict(own <= MEMORY_TARGET)} (no-checkpointing fits spread "
                     f"{s['cpu_spread'] * 100:.1f} %); without the one-time set-up (the import of "
                     f"`lightning_ckpt`, {r['import_cpu_ms']:.0f} ms, and the buffers' reservation, "
                     f"{r.get('reserve_cpu_ms', 0.0):.0f} ms), per checkpoint interval "
                     f"{pct(r.get('own_cpu_steady_overhead', own))} → "
                     f"{verdict(r.get('own_cpu_steady_overhead', own) <= MEMORY_TARGET)}")
        lines.append(f"- {disk}, wall time (target ≤ {MEMORY_TARGET * 100:g} %): fit {pct(wall)} → "
                     f"{verdict(wall <= MEMORY_TARGET)}, of which {r['final_wait_s']:.1f} s (median) is `fit` waiting "
                     f"at its end for the disk to hold the last checkpoint; training alone (up to `on_train_end`) "
                     f"{pct(end)} → {verdict(end <= MEMORY_TARGET)} (no-checkpointing fits spread "
                     f"{s['wall_spread'] * 100:.1f} %" + (f"; other processes used up to {foreign:.2f} of "
                                                         f"{os.cpu_count()} cores during these fits: wall-time "
                                                         "figures not conclusive" if foreign > 0.3 else "") + ")")
        if "ours_disk50" in rows:
            d = rows["ours_disk50"]
            lines.append(f"- the same disk as the only level, every {j['every']}: process CPU "
                         f"{pct(d['process_cpu_s_overhead'])} (own {pct(d['own_cpu_overhead'])}), fit wall "
                         f"{pct(d['fit_wall_s_overhead'])}, training alone {pct(d['end_wall_s_overhead'])}; saves "
                         f"waited {d['waited_s']:.1f} s per fit for the disk")
    if "ours_mem_every1" in rows and "copy_hash_every1" in rows:
        r, f = rows["ours_mem_every1"], rows["copy_hash_every1"]
        ratio = r["own_cpu_per_ckpt_ms"] / f["own_cpu_per_ckpt_ms"]
        lines.append(f"- every step, CPU per checkpoint on the threads that do the work (target ≤ {FLOOR_TARGET:g} × "
                     f"the floor): ours (memory + disk) {r['own_cpu_per_ckpt_ms']:.1f} ms vs copy + xxh3 "
                     f"{f['own_cpu_per_ckpt_ms']:.1f} ms per step ({f['floor_thread_cpu_steady_ms']:.1f} ms without "
                     f"the first, which allocates the buffer): {ratio:.2f} × → {verdict(ratio <= FLOOR_TARGET)}")
        noise = s["cpu_spread"] * rows["none"]["process_cpu_s_min"] / j["steps"] * 1e3
        for what, key in (("min of rounds", "cpu_per_ckpt_ms"), ("paired by round, median", "cpu_per_ckpt_paired_ms")):
            shown = f"{r[key] / f[key]:.2f} ×" if f[key] > 0 else "- (floor ≤ 0)"
            lines.append(f"- every step, process CPU over no checkpointing ÷ checkpoints ({what}): ours {r[key]:.1f} "
                         f"ms vs copy + xxh3 {f[key]:.1f} ms per step: {shown}; the floor is within the noise here "
                         f"(the no-checkpointing fits' CPU spread is {noise:.0f} ms per step)")
    left = {c: rows[c]["shm_left_fits"] for c in MEMORY_LEVEL if c in rows}
    if left:
        lines.append("- /dev/shm after `fit` (before the job's own clean-up): " + "; ".join(
            f"{rows[c]['label']}: {n} of {rows[c]['rounds']} fits left files"
            + (f" (e.g. {', '.join(rows[c]['shm_left_example'])})" if n else "") for c, n in left.items()))
    return lines


def memory_markdown(s: dict[str, Any]) -> list[str]:
    """The node-memory section: ours with a memory level in front of a slow disk, and the copy + hash floor."""
    rows, j = s["rows"], s["job"]
    floor = rows["copy_hash_every1"]["own_cpu_per_ckpt_ms"] if "copy_hash_every1" in rows else math.nan
    cells = []
    for c in ["none"] + [c for c in MEMORY_CONTENDERS if c in rows]:
        r, mem = rows[c], c in MEMORY_CONTENDERS
        g = {k: r.get(k, math.nan) for k in ("waited_s", "flushed", "flush_skipped", "flush_copy_ms", "flush_lag_ms",
                                             "final_wait_s", "own_cpu_per_ckpt_ms", "cpu_per_ckpt_ms",
                                             "cpu_per_ckpt_paired_ms")}
        cells.append([
            r["label"], f"{r['committed'] if mem else 0:.0f}", fmt(g["waited_s"]),
            f"{fmt(g['flushed'], '{:.0f}')} / {fmt(g['flush_skipped'], '{:.0f}')}",
            f"{fmt(g['flush_copy_ms'], '{:.0f}')} / {fmt(g['flush_lag_ms'], '{:.0f}')}",
            pct(r["process_cpu_s_overhead"]), pct(r.get("own_cpu_overhead", 0.0)), pct(r["fit_wall_s_overhead"]),
            pct(r.get("end_wall_s_overhead", 0.0)), fmt(g["final_wait_s"]),
            f"{fmt(g['own_cpu_per_ckpt_ms'])} / {fmt(g['cpu_per_ckpt_ms'])} / {fmt(g['cpu_per_ckpt_paired_ms'])}",
            fmt(g["own_cpu_per_ckpt_ms"] / floor if mem and floor > 0 else math.nan, "{:.2f}")])
    return [f"## Node-memory level in front of a {j['disk_mb_s']:g} MB/s disk (same rounds as above)", "",
            *table(["configuration", "checkpoints (committed)", "saves' wait for a buffer s",
                    "flushed / skipped to disk", "flush copy ms / lag ms", "process CPU overhead", "own CPU overhead",
                    "fit wall overhead", "training wall overhead", "final wait s",
                    "CPU per checkpoint ms: own / process Δ min / paired", "own CPU ÷ floor's"], cells),
            "", *memory_verdicts(s), "",
            f"Notes: the disk is this machine's, paced to at most {j['disk_mb_s']:g} MB/s per data-file write "
            "(`_slow_storage`); own CPU = the threads doing the checkpoint work, within each fit; process Δ = "
            "(process CPU − no checkpointing's) ÷ checkpoints, of the minima (min) or per round (paired).", ""]


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, scratch=None, quiet=True)
    p.add_argument("--model", choices=("transformer", "mlp"), default="transformer",
                   help="Lightning's demo Transformer (default) or an MLP")
    p.add_argument("--quick", action="store_true", help="smoke run: 30 steps, one round")
    p.add_argument("--tf-steps", type=int, default=120)
    p.add_argument("--tf-every", type=int, default=10)
    p.add_argument("--tf-rounds", type=int, default=3)
    p.add_argument("--tf-threads", type=int, default=0, help="torch threads of the fits (0: torch's default)")
    p.add_argument("--tf-contenders", default=",".join(DEFAULT_CONTENDERS),
                   help=f"comma-separated, among {','.join(CONTENDERS)} (none is always run)")
    p.add_argument("--tf-disk-mb-s", type=float, default=50.0, help="the slow disk's rate (MB/s)")
    p.add_argument("--tf-from", default=None, metavar="JSON", help="no fits: re-render a saved run's JSON")
    a = p.parse_args(argv)
    if a.tf_from:
        with open(a.tf_from) as f:
            doc = json.load(f)
        doc["transformer"] = resummarize(doc["transformer"])
    else:
        chosen = [c.strip() for c in a.tf_contenders.split(",") if c.strip()]
        if set(chosen) - set(CONTENDERS):
            raise SystemExit(f"--tf-contenders: unknown {sorted(set(chosen) - set(CONTENDERS))}; choose among "
                             f"{', '.join(CONTENDERS)}")
        contenders = ["none"] + [c for c in CONTENDERS if c in chosen and c != "none"]
        steps, rounds = (30, 1) if a.quick else (a.tf_steps, a.tf_rounds)
        job = FitJob(model=a.model, steps=steps, every=a.tf_every, threads=a.tf_threads, disk_mb_s=a.tf_disk_mb_s)
        print(f"bench_lightning: {a.model}, {steps} steps, k={a.tf_every}, {rounds} rounds of "
              f"{', '.join(contenders)}", flush=True)
        fits = measure(job, contenders, rounds, os.path.join(a.dir or tempfile.mkdtemp(prefix="bench_lightning-"),
                                                             "run"), quiet=a.quiet)
        doc = {"config": {"quick": a.quick, "cpu_count": os.cpu_count(), "argv": sys.argv[1:]},
               "transformer": {"summary": summarize(job, fits, contenders),
                               "fits": [{**r.as_json(), "foreign_cores": load} for r, load in fits]}}
    name = f"bench_lightning_{doc['transformer']['summary']['job'].get('model', 'transformer')}"
    write_report(a.out, name, "\n".join(markdown(doc["transformer"]["summary"])) + "\n", doc)


if __name__ == "__main__":
    main()
