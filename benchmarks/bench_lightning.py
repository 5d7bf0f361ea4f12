"""Training overhead of checkpointing in a real Lightning job: ours against Lightning's own, CPU.

Lightning's demo Transformer (``--model transformer``, the default; 14.6 M parameters + Adam, ~176 MB
of state) or an MLP (``--model mlp``, ~63 MB), one CPU device, ``--tf-steps`` steps, a checkpoint every
``--tf-every``. Each fit runs in a fresh process (``_lightning_job.run_fit``); the contenders alternate
within a round (the order rotates), each figure of a contender is its minimum over ``--tf-rounds``
rounds (the least disturbed fit on a shared machine), overheads taken against the minimum of no
checkpointing: whole-process CPU and fit wall time, drift-corrected, per checkpoint (local cost), by
thread. Verdict: ours' overhead ÷ the best peer's, target ≤ 1/3.

With the node-memory contenders (``--tf-contenders none,ours_disk50,ours_mem,ours_mem_every1,copy_hash_every1``,
a disk paced to ``--tf-disk-mb-s``) a second section: ours with the memory level every ``every`` steps
against :data:`MEMORY_TARGET` of CPU and fit wall overhead, and at every step its CPU per checkpoint
against :data:`FLOOR_TARGET` × the copy + checksum floor.

Usage::

    .venv/bin/python benchmarks/bench_lightning.py --model transformer --tf-threads 1   # ~8 min
    .venv/bin/python benchmarks/bench_lightning.py --model transformer --tf-threads 1 \
        --tf-contenders none,ours_disk50,ours_mem,ours_mem_every1,copy_hash_every1   # memory level, ~15 min
    .venv/bin/python benchmarks/bench_lightning.py --quick    # smoke run: 30 steps, one round
    .venv/bin/python benchmarks/bench_lightning.py --tf-from benchmarks/out/bench_lightning_transformer.json

Outputs: ``benchmarks/out/bench_lightning_<model>.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import CpuLoad, wait_quiet  # noqa: E402
from _lightning_job import (CONTENDERS, DEFAULT_CONTENDERS, EVERY_STEP, LABELS, MARK, MEMORY_CONTENDERS,  # noqa: E402
                            MEMORY_LEVEL, OURS, PEERS, TARGET_VS_PEER, FitJob, FitResult, clean_step,
                            drift_corrected, every_of, label, local_costs, mean, median, run_fit, warm_up)

MEMORY_TARGET = 0.035
"""Issue target: ours with the memory level in front of a slow disk, a checkpoint every 10 steps,
at most 3.5 % of CPU time and of fit wall time over no checkpointing."""
FLOOR_TARGET = 1.5
"""Issue target: at every step, ours' CPU per checkpoint at most 1.5 × copying the state into a
preallocated buffer and hashing it (xxh3) alone."""
OURS_ALL = OURS + tuple(c for c in MEMORY_CONTENDERS if c.startswith("ours"))
"""Every configuration of ours (the tables of ours' own figures)."""


def measure(job: FitJob, contenders: list[str], rounds: int, workdir: str, quiet: float = 0.3,
            log: Callable[[str], None] = print) -> list[tuple[FitResult, float]]:
    """``rounds`` rounds of one fit per contender (rotating order), after unmeasured warm-up fits;
    each fit with the foreign load (CPU cores other processes used meanwhile) it ran beside."""
    pycache = os.path.join(tempfile.gettempdir(), "ckpt-suite-bench-pycache")  # kept: compiled once per machine
    warm_up(job, workdir, pycache, memory=any(c in MEMORY_LEVEL for c in contenders))
    out = []
    for rnd in range(rounds):
        k = (rnd + 1) % len(contenders)  # no checkpointing is not the first fit of the run
        for c in contenders[k:] + contenders[:k]:
            wait_quiet(quiet, max_wait=10.0)
            load = CpuLoad()
            r = run_fit(job, c, workdir, rep=rnd, pycache=pycache)
            foreign = load.foreign_cores()
            out.append((r, foreign))
            flushed = f"  flushed {r.counters['flushed']:.0f}" if "flushed" in r.counters else ""
            log(f"  {job.model} round {rnd} {c:10s} process CPU {r.process_cpu_s:6.2f} s  fit CPU "
                f"{r.fit_cpu_s:6.2f} s  fit wall {r.fit_wall_s:6.2f} s  ckpts {r.n_ckpt:2d}{flushed}  foreign load "
                f"{foreign:.2f} cores{'  LEFT IN /dev/shm: ' + str(len(r.shm_left)) if r.shm_left else ''}")
    return out


def resummarize(saved: dict[str, Any]) -> dict[str, Any]:
    """The Transformer section (``{"summary", "fits"}``) again from the fits a run saved (its JSON's
    ``transformer``), with this module's figures: a saved run re-rendered without new fits."""
    fields = {f.name for f in dataclasses.fields(FitJob)}
    job = FitJob(**{k: v for k, v in saved["summary"]["job"].items() if k in fields})
    fits = [(FitResult(**{k: v for k, v in f.items() if k != "foreign_cores"}), f["foreign_cores"])
            for f in saved["fits"]]
    return {"summary": summarize(job, fits, list(saved["summary"]["rows"])), "fits": saved["fits"]}


def _background(r: FitResult) -> float:
    """CPU seconds of the Python threads other than the main one (the checkpoint writers)."""
    return sum(r.threads_cpu_s.values())


def summarize(job: FitJob, measured: list[tuple[FitResult, float]], contenders: list[str]) -> dict[str, Any]:
    by = {c: [r for r, _ in measured if r.contender == c] for c in contenders}
    foreign = {c: [f for r, f in measured if r.contender == c] for c in contenders}
    base = by["none"]
    base_by_round = {r.rep: r for r in base}
    ref = {k: min(getattr(r, k) for r in base) for k in ("process_cpu_s", "fit_cpu_s", "fit_wall_s", "end_wall_s")}
    rows: dict[str, Any] = {}
    for c in contenders:
        rs = by[c]
        every = every_of(job, c)
        best = {k: min(getattr(r, k) for r in rs) for k in ref}
        n = median([float(r.n_ckpt) for r in rs])
        figs = [f for r in rs for f in r.figures if f.get("kind", "save") == "save"]
        row: dict[str, Any] = {
            "label": label(c, job), "every": every, "rounds": len(rs), **{f"{k}_min": v for k, v in best.items()},
            **{f"{k}_median": median([getattr(r, k) for r in rs]) for k in ref},
            **{f"{k}_overhead": best[k] / ref[k] - 1 for k in ref},
            "per_round_cpu": [r.process_cpu_s for r in rs], "per_round_wall": [r.fit_wall_s for r in rs],
            "n_ckpt": n, "foreign_cores_max": max(foreign[c]) if foreign[c] else math.nan,
            "main_cpu_s": median([r.main_cpu_s for r in rs]), "other_cpu_s": median([r.other_cpu_s for r in rs]),
            "threads_cpu_s": {name: median([r.threads_cpu_s.get(name, 0.0) for r in rs])
                              for name in sorted({k for r in rs for k in r.threads_cpu_s})},
            "train_cpu_ms": mean([x for r in rs for x in r.train_cpu_ms]),
            "train_cpu_first_ms": mean([r.train_cpu_ms[0] for r in rs if r.train_cpu_ms]),
            "train_cpu_steady_ms": mean([x for r in rs for x in r.train_cpu_ms[1:]]),
            "background_cpu_per_ckpt_ms": mean([_background(r) / r.n_ckpt * 1e3 for r in rs if r.n_ckpt]),
            "extra_cpu_per_ckpt_ms": (best["process_cpu_s"] - ref["process_cpu_s"]) / n * 1e3 if n else math.nan,
            "torch_save_cpu_ms": mean([cpu * 1e3 for r in rs for _, _, cpu in r.torch_save]),
            "import_cpu_ms": median([r.import_cpu_ms for r in rs]),
            "clean_step_ms": median([clean_step(r) * 1e3 for r in rs]),
        }
        for key, i, total in (("dc_cpu_overhead", 2, "fit_cpu_s"), ("dc_wall_overhead", 0, "fit_wall_s")):
            dc = [drift_corrected(r, base_by_round[r.rep], i, total) for r in rs if r.rep in base_by_round]
            if c in EVERY_STEP:  # no step is clear of a checkpoint: no clean step to correct by
                dc = [math.nan for _ in dc]
            row[key], row[f"{key}_per_round"] = median(dc), dc
        for name, i in MARK.items():
            local = [x for r in rs for x in local_costs(r, job.every, i)] if c not in EVERY_STEP else []
            row[f"local_{name}_ms"] = mean([x * 1e3 for x in local])
        for key in ("encode_cpu_ms", "snapshot_cpu_ms", "persist_cpu_ms", "commit_cpu_ms", "stall_ms"):
            row[key] = mean([f[key] for f in figs if key in f])
        if c in MEMORY_CONTENDERS:
            row.update(_memory_figures(rs, base_by_round, ref))
        rows[c] = row
    return {"job": {**job.__dict__, "params": base[0].params, "state_mb": base[0].params * 12 / 1e6},
            "rows": rows, "cpu_spread": _spread([r.process_cpu_s for r in base]),
            "wall_spread": _spread([r.fit_wall_s for r in base])}


def _memory_figures(rs: list[FitResult], base_by_round: dict[int, FitResult], ref: dict[str, float]
                    ) -> dict[str, Any]:
    """The node-memory section's figures of one contender (see :func:`memory_markdown`)."""
    committed = [float(sum(1 for f in r.figures if f.get("kind", "save") == "save" and f.get("committed")))
                 if r.figures else float(r.n_ckpt) for r in rs]
    n = median(committed)
    paired = [(r.process_cpu_s - base_by_round[r.rep].process_cpu_s) / k * 1e3
              for r, k in zip(rs, committed) if r.rep in base_by_round and k]
    flushes = [f for r in rs for f in r.figures if f.get("kind") == "flush" and f.get("committed")]
    steady = [cpu for r in rs for _, cpu in r.copy_hash[1:]]
    own = [_own_cpu_s(r) for r in rs]
    return {
        "own_cpu_per_ckpt_ms": median([o / k * 1e3 for o, k in zip(own, committed) if k]),
        "own_cpu_overhead": median([(o + r.import_cpu_ms / 1e3) / (r.process_cpu_s - o - r.import_cpu_ms / 1e3)
                                    for o, r in zip(own, rs)]),
        "committed": n, "saves_skipped": median([r.counters.get("skipped", 0.0) for r in rs]),
        "waited_s": median([r.counters.get("waited_s", math.nan) for r in rs]),
        "flushed": median([r.counters.get("flushed", math.nan) for r in rs]),
        "flush_skipped": median([r.counters.get("flush_skipped", math.nan) for r in rs]),
        "flush_lag_ms": mean([f["lag_ms"] for f in flushes]), "flush_copy_ms": mean([f["copy_ms"] for f in flushes]),
        "flush_thread_cpu_s": median([r.threads_cpu_s.get("ckpt-flush-1", math.nan) for r in rs]),
        "end_wall_s_overhead": min(r.end_wall_s for r in rs) / ref["end_wall_s"] - 1,
        "final_wait_s": median([r.fit_wall_s - r.end_wall_s for r in rs]),
        "cpu_per_ckpt_ms": (min(r.process_cpu_s for r in rs) - ref["process_cpu_s"]) / n * 1e3 if n else math.nan,
        "cpu_per_ckpt_paired_ms": median(paired), "cpu_per_ckpt_paired_per_round": paired,
        "floor_thread_cpu_ms": mean([cpu * 1e3 for r in rs for _, cpu in r.copy_hash]) if steady else math.nan,
        "floor_thread_cpu_steady_ms": mean([cpu * 1e3 for cpu in steady]) if steady else math.nan,
        "floor_wall_steady_ms": mean([w * 1e3 for r in rs for w, _ in r.copy_hash[1:]]) if steady else math.nan,
        "shm_left_fits": sum(1 for r in rs if r.shm_left),
        "shm_left_example": next((r.shm_left[:5] for r in rs if r.shm_left), []),
    }


def _own_cpu_s(r: FitResult) -> float:
    """CPU seconds the fit's checkpoint work took on the threads that ran it: the training thread's
    part of each checkpoint (ours' ``train_cpu_ms``; the floor's copy and hash) and every Python
    thread but the main one (ours' ``ckpt-*``). Within one fit, so not blurred by the drift between
    fits that the process CPU differences are; blind to indirect costs (a training step slowed by
    the caches and memory bandwidth a background copy takes)."""
    return sum(x for x in r.train_cpu_ms if x == x) / 1e3 + _background(r)


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / min(values) if len(values) > 1 else math.nan


def verdicts(s: dict[str, Any]) -> list[str]:
    rows = s["rows"]
    peers = [p for p in PEERS if p in rows]
    lines = []
    for key, what in (("process_cpu_s_overhead", "whole-process CPU"), ("fit_wall_s_overhead", "fit wall time"),
                      ("dc_cpu_overhead", "drift-corrected fit CPU"), ("dc_wall_overhead", "drift-corrected fit wall"),
                      ("local_cpu_ms", "local process CPU per checkpoint"),
                      ("local_wall_ms", "local wall time per checkpoint")):
        if not peers:
            break
        best = min(peers, key=lambda p: rows[p][key])
        bo = rows[best][key]
        for o in (o for o in OURS if o in rows):
            ov = rows[o][key]
            if bo <= 0:
                verdict = "inconclusive (best peer's overhead ≤ 0: noise)"
            else:
                passed = "PASS" if ov / bo <= TARGET_VS_PEER else "FAIL"
                verdict = f"{ov / bo:.2f} × best peer → {passed} (target ≤ 0.33)"
            shown = (lambda x: f"{x:.0f} ms") if key.startswith("local") else (lambda x: f"{x * 100:+.1f} %")
            lines.append(f"- Transformer, {what}, {LABELS[o]}: {shown(ov)} vs best peer ({LABELS[best]}) "
                         f"{shown(bo)}: {verdict}")
    return lines


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or x != x else fmt.format(x)


def markdown(s: dict[str, Any]) -> list[str]:
    j, rows = s["job"], s["rows"]
    model = ("Lightning's demo Transformer (`LightningTransformer`" if j.get("model", "transformer") == "transformer"
             else "An MLP (512 → 2048 → 2048 → 10")
    lines = [f"## {model}, {j['params'] / 1e6:.1f} M parameters + Adam, "
             f"{j['state_mb']:.0f} MB state), 1 CPU device, {j['steps']} steps, checkpoint every {j['every']}, "
             f"torch threads {j['threads'] or 'default'}: min of {rows['none']['rounds']} alternated rounds, "
             f"one process per fit", "",
             f"Spread of the no-checkpointing fits (max ÷ min − 1): process CPU {s['cpu_spread'] * 100:.1f} %, "
             f"fit wall {s['wall_spread'] * 100:.1f} %.", "",
             "| configuration | process CPU s (min) | overhead | fit CPU s (min) | overhead | fit wall s (min) "
             "| overhead | per round: CPU / wall s | drift-corrected CPU / wall overhead | checkpoints "
             "| extra process CPU per ckpt ms | training-thread CPU per ckpt ms (first / steady) "
             "| background CPU per ckpt ms | foreign load (max cores) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows.values():
        per = ", ".join(f"{c:.1f}/{w:.1f}" for c, w in zip(r["per_round_cpu"], r["per_round_wall"]))
        lines.append(f"| {r['label']} | {r['process_cpu_s_min']:.2f} | {r['process_cpu_s_overhead'] * 100:+.1f} % "
                     f"| {r['fit_cpu_s_min']:.2f} | {r['fit_cpu_s_overhead'] * 100:+.1f} % | {r['fit_wall_s_min']:.2f} "
                     f"| {r['fit_wall_s_overhead'] * 100:+.1f} % | {per} | {r['dc_cpu_overhead'] * 100:+.1f} % / "
                     f"{r['dc_wall_overhead'] * 100:+.1f} % | {r['n_ckpt']:.0f} "
                     f"| {_f(r['extra_cpu_per_ckpt_ms'])} | {_f(r['train_cpu_first_ms'])} / "
                     f"{_f(r['train_cpu_steady_ms'])} | {_f(r['background_cpu_per_ckpt_ms'])} "
                     f"| {_f(r['foreign_cores_max'], '{:.2f}')} |")
    lines += ["", "Local cost per checkpoint (ms, mean over checkpoints and rounds; the excess of the 10 steps after "
              "each checkpoint over the late steps before it; no checkpointing: the same windows, a control):", "",
              "| configuration | process CPU | main-thread CPU | wall | clean step ms | import CPU ms |",
              "|---|---|---|---|---|---|"]
    for r in rows.values():
        lines.append(f"| {r['label']} | {_f(r['local_cpu_ms'])} | {_f(r['local_main_cpu_ms'])} "
                     f"| {_f(r['local_wall_ms'])} | {_f(r['clean_step_ms'])} | {_f(r['import_cpu_ms'])} |")
    lines += ["", *verdicts(s), "", "Where ours' CPU goes per checkpoint (`figures.jsonl`, mean; ms):", "",
              "| configuration | training thread (`train_cpu_ms`) | encode + layout | copy (all threads) "
              "| persist (hash + write) | commit | stall ms |", "|---|---|---|---|---|---|---|"]
    for name in (o for o in OURS_ALL if o in rows):
        r = rows[name]
        lines.append(f"| {r['label']} | {_f(r['train_cpu_ms'])} | {_f(r['encode_cpu_ms'])} "
                     f"| {_f(r['snapshot_cpu_ms'])} | {_f(r['persist_cpu_ms'])} | {_f(r['commit_cpu_ms'])} "
                     f"| {_f(r['stall_ms'])} |")
    lines += ["", "CPU by thread (s per fit, median): main = the training thread (start-up and imports included), "
              "other = native threads (torch's intra-op workers):", "",
              "| configuration | main | " + " | ".join(["Python threads", "other"]) + " |", "|---|---|---|---|"]
    for r in rows.values():
        threads = ", ".join(f"{k} {v:.2f}" for k, v in r["threads_cpu_s"].items() if v >= 0.005) or "-"
        lines.append(f"| {r['label']} | {r['main_cpu_s']:.2f} | {threads} | {r['other_cpu_s']:.2f} |")
    lines += ["", "Notes: process CPU = `getrusage(RUSAGE_SELF)` of the fit's own process at its end (every thread, "
              "start-up and imports included: ours' import of `lightning_ckpt` counts, the others never import it); "
              "overhead = min over rounds ÷ min of no checkpointing − 1. Extra process CPU per checkpoint = that "
              "difference ÷ checkpoints. Training-thread CPU per checkpoint: `time.thread_time` on the training "
              "thread (ours: `train_cpu_ms`, Lightning's: `ModelCheckpoint._save_checkpoint`, whose "
              "AsyncCheckpointIO clone runs there). Background CPU: the Python threads other than the main one "
              "(ours' `ckpt-*`, AsyncCheckpointIO's `ThreadPoolExecutor`).", ""]
    if any(c in rows for c in MEMORY_CONTENDERS):
        lines += memory_markdown(s)
    return lines


def _pct(x: float) -> str:
    return "-" if x != x else f"{x * 100:+.1f} %"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def memory_verdicts(s: dict[str, Any]) -> list[str]:
    """The node-memory targets: :data:`MEMORY_TARGET` (every ``every`` steps) and :data:`FLOOR_TARGET` (every step)."""
    rows, j, lines = s["rows"], s["job"], []
    none = rows["none"]
    per_step_noise = s["cpu_spread"] * none["process_cpu_s_min"] / j["steps"] * 1e3
    foreign = max(r["foreign_cores_max"] for r in rows.values())
    if "ours_mem" in rows:
        r = rows["ours_mem"]
        cpu, own, wall, end = (r["process_cpu_s_overhead"], r["own_cpu_overhead"], r["fit_wall_s_overhead"],
                               r["end_wall_s_overhead"])
        lines.append(f"- memory + {j['disk_mb_s']:g} MB/s disk, every {j['every']}, CPU time (target ≤ "
                     f"{MEMORY_TARGET * 100:g} %): whole process {_pct(cpu)} → {_verdict(cpu <= MEMORY_TARGET)}; "
                     f"the checkpoint threads' own CPU ÷ the rest of the fit's {_pct(own)} → "
                     f"{_verdict(own <= MEMORY_TARGET)} (no-checkpointing fits spread {s['cpu_spread'] * 100:.1f} %)")
        lines.append(f"- memory + {j['disk_mb_s']:g} MB/s disk, every {j['every']}, wall time (target ≤ "
                     f"{MEMORY_TARGET * 100:g} %): fit {_pct(wall)} → {_verdict(wall <= MEMORY_TARGET)}, of which "
                     f"{r['final_wait_s']:.1f} s (median) is `fit` waiting at its end for the disk to hold the last "
                     f"checkpoint; training alone (up to `on_train_end`) {_pct(end)} → "
                     f"{_verdict(end <= MEMORY_TARGET)} (no-checkpointing fits spread {s['wall_spread'] * 100:.1f} %"
                     + (f"; other processes used up to {foreign:.2f} of {os.cpu_count()} cores during these fits: "
                        "wall-time figures not conclusive" if foreign > 0.3 else "") + ")")
        if "ours_disk50" in rows:
            d = rows["ours_disk50"]
            lines.append(f"- the same disk as the only level, every {j['every']}: process CPU "
                         f"{_pct(d['process_cpu_s_overhead'])} (own {_pct(d['own_cpu_overhead'])}), fit wall "
                         f"{_pct(d['fit_wall_s_overhead'])}, training alone {_pct(d['end_wall_s_overhead'])}; saves "
                         f"waited {d['waited_s']:.1f} s per fit for the disk")
    if "ours_mem_every1" in rows and "copy_hash_every1" in rows:
        r, f = rows["ours_mem_every1"], rows["copy_hash_every1"]
        ratio = r["own_cpu_per_ckpt_ms"] / f["own_cpu_per_ckpt_ms"]
        lines.append(f"- every step, CPU per checkpoint on the threads that do the work (target ≤ "
                     f"{FLOOR_TARGET:g} × the floor): ours (memory + disk) {r['own_cpu_per_ckpt_ms']:.1f} ms vs "
                     f"copy + xxh3 {f['own_cpu_per_ckpt_ms']:.1f} ms per step "
                     f"({f['floor_thread_cpu_steady_ms']:.1f} ms without the first, which allocates the buffer): "
                     f"{ratio:.2f} × → {_verdict(ratio <= FLOOR_TARGET)}")
        for what, key in (("min of rounds", "cpu_per_ckpt_ms"), ("paired by round, median", "cpu_per_ckpt_paired_ms")):
            ours, base = r[key], f[key]
            shown = f"{ours / base:.2f} ×" if base > 0 else "- (floor ≤ 0)"
            lines.append(f"- every step, process CPU over no checkpointing ÷ checkpoints ({what}): ours "
                         f"{ours:.1f} ms vs copy + xxh3 {base:.1f} ms per step: {shown}; the floor is within the "
                         f"noise here (the no-checkpointing fits' CPU spread is {per_step_noise:.0f} ms per step)")
    left = {c: rows[c]["shm_left_fits"] for c in MEMORY_LEVEL if c in rows}
    if left:
        lines.append("- /dev/shm after `fit` (before the job's own clean-up): "
                     + "; ".join(f"{rows[c]['label']}: {n} of {rows[c]['rounds']} fits left files"
                                 + (f" (e.g. {', '.join(rows[c]['shm_left_example'])})" if n else "")
                                 for c, n in left.items()))
    return lines


def memory_markdown(s: dict[str, Any]) -> list[str]:
    """The node-memory section: ours with a memory level in front of a slow disk, and the copy + checksum floor."""
    rows, j = s["rows"], s["job"]
    names = ["none"] + [c for c in MEMORY_CONTENDERS if c in rows]
    lines = [f"## Node-memory level in front of a {j['disk_mb_s']:g} MB/s disk (same rounds as above)", "",
             "| configuration | checkpoints (committed) | saves' wait for a buffer s | flushed / skipped to disk "
             "| flush copy ms / lag ms | process CPU overhead | own CPU overhead | fit wall overhead "
             "| training wall overhead | final wait s | CPU per checkpoint ms: own / process Δ min / paired "
             "| own CPU ÷ floor's |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    floor = rows["copy_hash_every1"]["own_cpu_per_ckpt_ms"] if "copy_hash_every1" in rows else math.nan
    for c in names:
        r = rows[c]
        mem = c in MEMORY_CONTENDERS
        own = r.get("own_cpu_per_ckpt_ms", math.nan)
        lines.append(
            f"| {r['label']} | {r['committed'] if mem else 0:.0f} | {_f(r.get('waited_s', math.nan))} "
            f"| {_f(r.get('flushed', math.nan), '{:.0f}')} / {_f(r.get('flush_skipped', math.nan), '{:.0f}')} "
            f"| {_f(r.get('flush_copy_ms', math.nan), '{:.0f}')} / {_f(r.get('flush_lag_ms', math.nan), '{:.0f}')} "
            f"| {_pct(r['process_cpu_s_overhead'])} | {_pct(r.get('own_cpu_overhead', 0.0))} "
            f"| {_pct(r['fit_wall_s_overhead'])} | {_pct(r.get('end_wall_s_overhead', 0.0))} "
            f"| {_f(r.get('final_wait_s', math.nan))} | {_f(own)} / {_f(r.get('cpu_per_ckpt_ms', math.nan))} / "
            f"{_f(r.get('cpu_per_ckpt_paired_ms', math.nan))} "
            f"| {_f(own / floor if mem and floor > 0 else math.nan, '{:.2f}')} |")
    lines += ["", *memory_verdicts(s), "",
              f"Notes: the disk is this machine's, paced to at most {j['disk_mb_s']:g} MB/s per data-file write "
              "(`_slow_storage.SlowStorage`: a write takes at least bytes ÷ rate, the real write included); the "
              "memory level is a directory below `/dev/shm` named for the fit. Checkpoints = saves committed on "
              "the first level (every step: from step 2, the first step reserves the buffers); flushed / skipped = "
              "the memory level's checkpoints copied to the disk or passed over (newest first: the disk takes what "
              "it can). Fit wall = `trainer.fit` whole, which ends when the disk holds the last checkpoint; "
              "training wall = `fit` up to the first `on_train_end` hook, before that wait (final wait = the "
              "difference). Own CPU = CPU of the threads doing the checkpoint work, within each fit: the training "
              "thread's part of each checkpoint (`train_cpu_ms`; for the floor its copy and hash) plus every Python "
              "thread but the main one (`ckpt-*`); own CPU overhead = that plus ours' import ÷ the rest of the "
              "fit's process CPU (median over rounds); it leaves out indirect costs (training slowed by the caches "
              "and memory bandwidth a background copy takes), which the process CPU difference includes with the "
              "drift between fits. Process Δ = (process CPU − that of no checkpointing) ÷ checkpoints: min = of "
              "the minima over rounds, paired = the median over rounds of each fit against the no-checkpointing fit of "
              "its round; for the floor, ÷ steps. The floor copies the parameters, buffers and optimizer tensors "
              "into one preallocated buffer on the training thread and hashes it with xxh3 at every step, nothing "
              "else.", ""]
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("transformer", "mlp"), default="transformer",
                   help="Lightning's demo Transformer (default) or an MLP")
    p.add_argument("--quick", action="store_true", help="smoke run: 30 steps, one round")
    p.add_argument("--tf-steps", type=int, default=120)
    p.add_argument("--tf-every", type=int, default=10)
    p.add_argument("--tf-rounds", type=int, default=3)
    p.add_argument("--tf-threads", type=int, default=0, help="torch threads of the fits (0: torch's default)")
    p.add_argument("--tf-contenders", default=",".join(DEFAULT_CONTENDERS),
                   help=f"comma-separated, among {','.join(CONTENDERS)} (none is always run)")
    p.add_argument("--tf-disk-mb-s", type=float, default=50.0,
                   help="the slow disk's rate of ours_disk50, ours_mem and ours_mem_every1 (MB/s)")
    p.add_argument("--tf-from", default=None, metavar="JSON", help="no fits: re-render a saved run's JSON")
    p.add_argument("--quiet", type=float, default=0.3, help="wait (a little) for other processes to use fewer cores")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    a = p.parse_args(argv)
    if a.tf_from:
        with open(a.tf_from) as f:
            doc = json.load(f)
        doc["transformer"] = resummarize(doc["transformer"])
    else:
        chosen = [c.strip() for c in a.tf_contenders.split(",") if c.strip()]
        unknown = [c for c in chosen if c not in CONTENDERS]
        if unknown:
            raise SystemExit(f"--tf-contenders: unknown {unknown}; choose among {', '.join(CONTENDERS)}")
        contenders = ["none"] + [c for c in CONTENDERS if c in chosen and c != "none"]
        if a.quick:
            a.tf_steps, a.tf_rounds = 30, 1
        job = FitJob(model=a.model, steps=a.tf_steps, every=a.tf_every, threads=a.tf_threads,
                     disk_mb_s=a.tf_disk_mb_s)
        print(f"bench_lightning: {a.model}, {a.tf_steps} steps, k={a.tf_every}, {a.tf_rounds} rounds of "
              f"{', '.join(contenders)}", flush=True)
        workdir = os.path.join(a.dir or tempfile.mkdtemp(prefix="bench_lightning-"), "run")
        fits = measure(job, contenders, a.tf_rounds, workdir, quiet=a.quiet)
        doc = {"config": {"quick": a.quick, "cpu_count": os.cpu_count(), "argv": sys.argv[1:]},
               "transformer": {"summary": summarize(job, fits, contenders),
                               "fits": [{**r.as_json(), "foreign_cores": load} for r, load in fits]}}
    text = "\n".join(markdown(doc["transformer"]["summary"])) + "\n"
    name = f"bench_lightning_{doc['transformer']['summary']['job'].get('model', 'transformer')}"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(text)
    print(f"wrote {a.out}/{name}.{{md,json}}")


if __name__ == "__main__":
    main()
