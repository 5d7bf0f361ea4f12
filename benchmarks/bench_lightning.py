"""Training overhead of checkpointing in a real Lightning job: ours against Lightning's own, CPU.

What it measures, against which peers and targets: ``benchmarks/README.md``, section bench_lightning.
Each fit runs in a fresh process (``_lightning_job``), in rounds that alternate the contenders; every
overhead is paired with the no-checkpointing fit of its round (median, mean ± standard error over the
rounds, and whether it is inside the noise: ``_fit_figures``), the minima of the rounds beside.

Usage::

    .venv/bin/python benchmarks/bench_lightning.py --model transformer --tf-threads 1 --tf-rounds 8   # ~20 min
    .venv/bin/python benchmarks/bench_lightning.py --model transformer --tf-threads 1 \
        --tf-contenders none,ours_disk50,ours_mem,ours_mem_every1,copy_hash_every1   # memory level, slow disk
    .venv/bin/python benchmarks/bench_lightning.py --quick    # smoke run: 30 steps, one round
    .venv/bin/python benchmarks/bench_lightning.py --tf-from benchmarks/out/bench_lightning_transformer.json
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from dataclasses import fields
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt, parser, pct, table, verdict, write_report  # noqa: E402
from _fit_figures import PAIRED, Paired, paired_table, run_line, summarize, versus  # noqa: E402
from _lightning_job import (CONTENDER, CONTENDERS, DEFAULT_CONTENDERS, MEMORY_CONTENDERS, OURS,  # noqa: E402
                            PEERS, FitJob, FitResult, rounds)

TARGET_VS_PEER = 1 / 3
"""Target: our overhead at most a third of the best peer's at the same interval."""
MEMORY_TARGET = 0.035
"""Target: ours with the memory level in front of a slow disk, every 10 steps, at most 3.5 % of CPU
time and of fit wall time over no checkpointing."""
FLOOR_TARGET = 1.5
"""Target: at every step, ours' CPU per checkpoint at most 1.5 × copying the state into a preallocated
buffer and hashing it (xxh3) alone."""
OURS_ALL = OURS + tuple(c for c in MEMORY_CONTENDERS if c.startswith("ours"))
"""Every configuration of ours (the tables of ours' own figures)."""


def resummarize(saved: dict[str, Any]) -> dict[str, Any]:
    """The section (``{"summary", "fits"}``) again from the fits a run saved, with this module's figures."""
    known = {f.name for f in fields(FitJob)}
    job = FitJob(**{k: v for k, v in saved["summary"]["job"].items() if k in known})
    fits = [FitResult.of(f) for f in saved["fits"]]
    return {"summary": summarize(job, fits, list(saved["summary"]["rows"])), "fits": saved["fits"]}


def verdicts(s: dict[str, Any]) -> list[str]:
    """Ours' paired overhead ÷ the best peer's, per paired figure, against :data:`TARGET_VS_PEER`; no ratio
    where the best peer's overhead is inside the noise."""
    rows, lines = s["rows"], []
    peers = [p for p in PEERS if p in rows]
    for key, (what, _) in PAIRED.items() if peers else ():
        def of(name: str) -> Paired:
            return Paired.of(rows[name]["paired"][key])

        best = min(peers, key=lambda p: of(p).mean)
        for o in (o for o in OURS if o in rows):
            lines.append(f"- {what}, {rows[o]['label']}: {of(o).text()} vs best peer ({rows[best]['label']}) "
                         f"{of(best).text()}: {versus(of(o), of(best), TARGET_VS_PEER)}")
    return lines


def markdown(s: dict[str, Any], run: str = "") -> list[str]:
    """The report: the paired overheads, every contender's minima and overheads, its local costs, the
    verdicts, where ours' CPU goes, the CPU by thread; then the node-memory section when its contenders ran."""
    j, rows = s["job"], s["rows"]
    model = ("Lightning's demo Transformer (`LightningTransformer`" if j.get("model", "transformer") == "transformer"
             else "An MLP (512 → 2048 → 2048 → 10")
    lines = [*([run, ""] if run else []),
             f"## {model}, {j['params'] / 1e6:.1f} M parameters + Adam, {j['state_mb']:.0f} MB state), 1 CPU device, "
             f"{j['steps']} steps, checkpoint every {j['every']}, torch threads {j['threads'] or 'default'}: "
             f"{rows['none']['rounds']} alternated rounds, one process per fit", "",
             "Overheads paired by round (each fit against the no-checkpointing fit of its round; median / mean ± "
             "standard error over the rounds; `(noise)`: the mean within two standard errors of zero):", "",
             *paired_table(s), "",
             f"Spread of the no-checkpointing fits (max ÷ min − 1): process CPU {s['cpu_spread'] * 100:.1f} %, "
             f"fit wall {s['wall_spread'] * 100:.1f} %. Minima of the rounds:", "",
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
        pr = {k: Paired.of(r["paired"][k]) for k in ("process_cpu", "fit_wall", "end_wall")}
        (cpu, wall, end), own = (pr[k].median for k in pr), r["own_cpu_overhead"]
        noise = {k: " (inside the noise)" if v.noise else "" for k, v in pr.items()}
        lines.append(f"- {disk}, CPU time (target ≤ {MEMORY_TARGET * 100:g} %): whole process {pct(cpu)} → "
                     f"{verdict(cpu <= MEMORY_TARGET)}{noise['process_cpu']}; the checkpoint threads' own CPU ÷ "
                     f"the rest of the fit's "
                     f"{pct(own)} → {verdict(own <= MEMORY_TARGET)} (no-checkpointing fits spread "
                     f"{s['cpu_spread'] * 100:.1f} %); without the one-time set-up (the import of "
                     f"`lightning_ckpt`, {r['import_cpu_ms']:.0f} ms, and the buffers' reservation, "
                     f"{r.get('reserve_cpu_ms', 0.0):.0f} ms), per checkpoint interval "
                     f"{pct(r.get('own_cpu_steady_overhead', own))} → "
                     f"{verdict(r.get('own_cpu_steady_overhead', own) <= MEMORY_TARGET)}")
        lines.append(f"- {disk}, wall time (target ≤ {MEMORY_TARGET * 100:g} %): fit {pct(wall)} → "
                     f"{verdict(wall <= MEMORY_TARGET)}{noise['fit_wall']}, of which {r['final_wait_s']:.1f} s "
                     f"(median) is `fit` waiting "
                     f"at its end for the disk to hold the last checkpoint; training alone (up to `on_train_end`) "
                     f"{pct(end)} → {verdict(end <= MEMORY_TARGET)}{noise['end_wall']} (no-checkpointing fits spread "
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
    left = {c: r["shm_left_fits"] for c, r in rows.items() if CONTENDER[r["contender"]].memory}
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
    p.add_argument("--tf-rounds", type=int, default=8)
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
        steps, n = (30, 1) if a.quick else (a.tf_steps, a.tf_rounds)
        job = FitJob(model=a.model, steps=steps, every=a.tf_every, threads=a.tf_threads, disk_mb_s=a.tf_disk_mb_s)
        print(f"bench_lightning: {a.model}, {steps} steps, k={a.tf_every}, {n} rounds of {', '.join(contenders)}",
              flush=True)
        fits = rounds(job, contenders, n, os.path.join(a.dir or tempfile.mkdtemp(prefix="bench_lightning-"), "run"),
                      quiet=a.quiet)
        doc = {"config": {"quick": a.quick, "cpu_count": os.cpu_count(), "argv": sys.argv[1:],
                          "run": run_line(f"`bench_lightning.py {' '.join(sys.argv[1:])}`")},
               "transformer": {"summary": summarize(job, fits, contenders), "fits": [r.as_json() for r in fits]}}
    name = f"bench_lightning_{doc['transformer']['summary']['job'].get('model', 'transformer')}"
    text = markdown(doc["transformer"]["summary"], doc["config"].get("run", ""))
    write_report(a.out, name, "\n".join(text) + "\n", doc)


if __name__ == "__main__":
    main()
