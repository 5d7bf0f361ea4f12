"""A Hugging Face GPT-2 trained with Lightning on one GPU, checkpointed every 10 steps: through the
node-memory level (with and without ``pipeline=True``) against the local disk alone and no checkpoints.

The ``gpt2`` model of ``_lightning_job`` (bf16-mixed), its fits in this process, in rounds that alternate
the contenders; the figures (train, drain, fit, stalls, counters): ``benchmarks/README.md``, section
bench_gpu. ``--tiny``: a 2-layer model for a few steps on the CPU (tests/test_gpu.py).

    PYTHONPATH=. python3 benchmarks/bench_gpu_lightning.py --out benchmarks/out           # one GPU
    PYTHONPATH=. python3 benchmarks/bench_gpu_lightning.py --tiny --out /tmp/bgl          # CPU, seconds
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import parser, table, write_report  # noqa: E402
from _fit_figures import run_line  # noqa: E402
from _lightning_job import FIRST_TIMED, GPU_CONTENDERS as CONTENDERS, FitJob, FitResult, run_fit  # noqa: E402


def row_of(r: FitResult, tag: str) -> dict[str, Any]:
    """The figures of one fit (the ``none`` fit has no checkpointer's)."""
    row: dict[str, Any] = {"contender": r.contender, "tag": tag, "steps": len(r.marks),
                           "train_s": r.end_wall_s - r.timed_start_s, "drain_s": r.drain_s,
                           "fit_s": r.fit_wall_s - r.timed_start_s}
    if r.contender != "none":
        stalls = [stall for _, stall, _ in r.records]
        row.update({"counters": {k: v for k, v in r.counters.items() if v},
                    "stall_ms_median": statistics.median(stalls) if stalls else float("nan"),
                    "stall_ms_max": max(stalls) if stalls else float("nan"),
                    "checkpoint_bytes": r.records[-1][2] if r.records else 0,
                    "stalls_ms": [[step, round(stall, 1)] for step, stall, _ in r.records],
                    "allocations": r.allocations, "buffers": r.buffers})
    return {**row, "params": r.params}


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The figures as Markdown: per contender the median of its fits, against the fastest baseline."""
    base = min((r["train_s"] for r in rows if r["contender"] == "none"), default=float("nan"))
    base_fit = min((r["fit_s"] for r in rows if r["contender"] == "none"), default=float("nan"))
    head = meta.get("run") or (f"Run {meta['date'][:10]}, device {meta['device']}, torch {meta['torch']}, lightning "
                               f"{meta['lightning']}, {meta['cpus']} cores, commit {meta['commit']}")
    lines = [f"{head}; transformers {meta['transformers']}; {meta['steps']} steps, a checkpoint every {meta['every']}, "
             f"timed from step {FIRST_TIMED}; memory level in {meta['shm']}, disk level in {meta['disk']}.", ""]
    cells = []
    for name in CONTENDERS:
        mine = [r for r in rows if r["contender"] == name]
        if not mine:
            continue
        train, last = [r["train_s"] for r in mine], mine[-1]
        cells.append([name, len(mine), f"{statistics.median(train):.2f}", f"{min(train) / base - 1:+.1%}",
                      f"{statistics.median(train) / base - 1:+.1%}",
                      f"{statistics.median(r['drain_s'] for r in mine):.2f}",
                      f"{min(r['fit_s'] for r in mine) / base_fit - 1:+.1%}",
                      f"{last.get('stall_ms_median', float('nan')):.1f} / {last.get('stall_ms_max', float('nan')):.0f}",
                      f"{', '.join(last.get('buffers', [])) or '-'} ({last.get('allocations', 0)})",
                      json.dumps(last.get("counters", {}), sort_keys=True) if "counters" in last else "-"])
    lines += table(["contender", "fits", "train s (median)", "overhead, steps (min vs min)",
                    "overhead, steps (median)", "drain s", "fit incl. drain", "median / max stall ms",
                    "buffers (made)", "counters"], cells)
    median = {name: statistics.median(r["train_s"] for r in rows if r["contender"] == name) / base - 1
              for name in CONTENDERS if any(r["contender"] == name for r in rows)}
    lines.append("")
    if "memory" in median and "memory_pipeline" in median:
        worst = max(median["memory"], median["memory_pipeline"])
        lines += [f"- target: a checkpoint every {meta['every']} steps through the memory level costs ≤ 5 % of the "
                  f"training time (median of the fits): {median['memory']:+.1%} without `pipeline`, "
                  f"{median['memory_pipeline']:+.1%} with → {'PASS' if worst <= 0.05 else 'FAIL'}",
                  f"- target: `pipeline=True` never slower than without: {median['memory_pipeline']:+.1%} against "
                  f"{median['memory']:+.1%} → {'PASS' if median['memory_pipeline'] <= median['memory'] else 'FAIL'}"]
    lines.append("- the drain (the callback's `on_train_end`: the last checkpoint on every level) is reported on its "
                 "own; `fit incl. drain` adds it, against the fastest fit without checkpoints")
    return "\n".join(lines) + "\n"


def rendered(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """:func:`report`, then each fit that failed."""
    return report(rows, meta) + "".join(f"\nFailed: {e}\n" for e in meta.get("errors", []))


def _meta(a: argparse.Namespace) -> dict[str, Any]:
    """The run's facts: :func:`_fit_figures.run_line`, the versions, the levels' places and free space."""
    import transformers

    def where(path: str) -> str:
        st = os.statvfs(path) if os.path.exists(path) else None
        return f"{path} ({st.f_bavail * st.f_frsize / 2**30:.0f} GiB free)" if st else path

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
            "run": run_line(f"`bench_gpu_lightning.py {' '.join(sys.argv[1:])}`"), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpus": os.cpu_count(), "steps": a.steps, "every": a.every,
            "shm": where(os.path.dirname(a.shm.rstrip("/")) or "/"), "disk": where(a.work), "argv": sys.argv[1:]}


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, scratch="")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--budget-s", type=float, default=300.0, help="start no new round after this many seconds")
    p.add_argument("--work", default="/var/tmp/bench_gpu_lightning", help="the disk level's parent directory")
    p.add_argument("--shm", default="/dev/shm/ckpt-bench", help="the memory level's directory")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--from", dest="source", help="re-render the report of this bench_gpu_lightning.json into --out")
    a = p.parse_args(argv)
    if a.source:
        with open(a.source) as f:
            saved = json.load(f)
        write_report(a.out, "bench_gpu_lightning", rendered(saved["rows"], saved["meta"]), saved)
        return
    if a.tiny:
        a.steps, a.every, a.rounds = min(a.steps, 12), min(a.every, 4), 1
    warnings.filterwarnings("ignore")
    os.makedirs(a.work, exist_ok=True)
    meta, rows, t0, errors = _meta(a), [], time.perf_counter(), []
    job = FitJob(model="gpt2-tiny" if a.tiny else "gpt2", steps=a.steps, every=a.every, keep=2,
                 device="cpu" if a.tiny else "gpu", precision="bf16-mixed", shm=a.shm)
    names = [c for c in a.contenders.split(",") if c]
    for r in range(a.rounds):
        if r and time.perf_counter() - t0 > a.budget_s:
            break
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            try:
                row = row_of(run_fit(job, name, os.path.join(a.work, f"disk-{name}-{r}"), here=True,
                                     mem_job=f"bench-{name}-{r}"), f"{name}-{r}")
            except Exception as e:  # reported in the table's notes; the other contenders still run
                traceback.print_exc()
                errors.append(f"{name}, round {r}: {type(e).__name__}: {e}")
                continue
            finally:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta["total_s"], meta["errors"] = time.perf_counter() - t0, errors
    write_report(a.out, "bench_gpu_lightning", rendered(rows, meta), {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
