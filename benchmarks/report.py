"""Run the benchmarks, then write their figures into ``benchmarks/README.md`` with PNG plots.

Each benchmark script writes its own JSON into ``benchmarks/out/`` (not committed); this script
collects them and renders, for the current machine, one section per benchmark (ours next to the
physical limit and the best peer, as ratios taken within one run) between the markers
``<!-- report:begin -->`` and ``<!-- report:end -->`` of ``benchmarks/README.md``, and plots into
``benchmarks/plots/``. Everything outside the markers (the hand-written analysis) is left as is;
without markers the section is appended.

Usage::

    .venv/bin/python benchmarks/report.py                 # run all four (~12 min on a quiet 2-core VM), render
    .venv/bin/python benchmarks/report.py --quick         # small sizes, few steps (~3 min): a smoke run
    .venv/bin/python benchmarks/report.py --only save,s3  # run and render some
    .venv/bin/python benchmarks/report.py --from-json     # re-render from benchmarks/out/*.json, run nothing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"


@dataclass(frozen=True)
class Bench:
    """A benchmark script, its JSON output, and the arguments of a quick run."""

    script: str
    title: str
    quick: tuple[str, ...]


BENCHES = {
    "save": Bench("bench_save.py", "Save, restore and memory (bench_save)",
                  ("--size-mib", "64", "--reps", "2", "--peer-reps", "1")),
    "s3": Bench("bench_s3.py", "Persist to S3, moto over HTTP (bench_s3)", ("--size-mib", "32", "--reps", "1")),
    "lightning": Bench("bench_lightning.py", "Training overhead in Lightning (bench_lightning)", ("--quick",)),
    "overhead": Bench("bench_overhead.py", "Adaptive frequency under an overhead budget (bench_overhead)",
                      ("--quick",)),
}


@dataclass(frozen=True)
class Section:
    """Markdown lines of one benchmark and the plots (paths relative to the README) they show."""

    title: str
    lines: tuple[str, ...]
    plots: tuple[str, ...] = ()


# ---- formatting -------------------------------------------------------------------------------
def num(x: Any, fmt: str | None = None) -> str:
    """A figure for a table (3 significant digits, whole numbers from 1000 on); ``-`` for missing and NaN."""
    if x is None or not isinstance(x, (int, float)) or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if fmt is None:
        fmt = "{:.0f}" if abs(x) >= 1000 else "{:.3g}"
    return fmt.format(x)


def named(name: str, value: Any) -> str:
    """``"memcpy of share: 52.6"``, or ``-`` when there is no such contender."""
    return "-" if value is None or name in ("", "-") else f"{name}: {num(value)}"


def pct(x: Any) -> str:
    return num(None if x is None else x * 100, "{:+.1f} %")


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + \
           ["| " + " | ".join(r) + " |" for r in rows]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, labels: list[str], values: list[float], colors: list[str], fmt: str) -> None:
    for i, (v, c) in enumerate(zip(values, colors)):
        v = 0.0 if v is None or v != v else v
        ax.bar(i, v, color=c)
        ax.text(i, v, fmt.format(v), ha="center", va="bottom" if v >= 0 else "top", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=15)


def _color(name: str) -> str:
    if name.startswith("ours"):
        return "tab:blue"
    return "tab:gray" if "raw" in name or "limit" in name else "tab:orange"


# ---- sections ---------------------------------------------------------------------------------
def section_save(d: dict[str, Any], plots: str) -> Section:
    """Headline rows of bench_save (ours, limit, best peer, target) and a ratio plot."""
    c = d["config"]
    rows = [[r["world"], r["metric"], r["unit"], num(r["ours"]), named(r["limit_name"], r["limit"]),
             num(r.get("ours_vs_limit")), named(r["peer_name"], r["peer"]), num(r.get("ours_vs_peer")),
             r["target"], "info" if r["passed"] is None else ("PASS" if r["passed"] else "FAIL")] for r in d["rows"]]
    lines = [f"State {c['size_mib']} MiB, ranks {c.get('worlds')}, {c['cpu_count']} cores, torch {c['torch']}.", "",
             *table(["ranks", "metric", "unit", "ours", "physical limit", "ours ÷ limit", "best peer",
                     "ours ÷ best peer", "target", "result"], rows)]
    plt = _pyplot()
    picked = [r for r in d["rows"] if r.get("ours_vs_limit") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.35 * len(picked) + 1.5), squeeze=False)
    names = [f"{r['world']}: {r['metric']} ({r['unit']})" for r in picked]
    colors = ["tab:gray" if r["passed"] is None else ("tab:green" if r["passed"] else "tab:red") for r in picked]
    for ax, key, title in ((axes[0][0], "ours_vs_limit", "ours ÷ physical limit"),
                           (axes[0][1], "ours_vs_peer", "ours ÷ best peer")):
        for i, (r, c) in enumerate(zip(picked, colors)):
            v = r.get(key)
            if v is None or not v > 0:
                continue
            ax.barh(i, v - 1.0, left=1.0, color=c if key == "ours_vs_limit" else "tab:blue")  # from 1.0 = on par
            ax.text(v, i, f" {v:.2f} ", va="center", ha="left" if v >= 1 else "right", fontsize=7)
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_yticks(range(len(picked)), names if key == "ours_vs_limit" else [""] * len(picked), fontsize=7)
        ax.set_ylim(len(picked) - 0.5, -0.5)
        ax.set_title(f"{title} (log; time, memory: lower is better; GB/s: higher)"
                     + ("; green PASS, red FAIL, gray info" if key == "ours_vs_limit" else ""), fontsize=8)
    return Section(BENCHES["save"].title, tuple(lines), (_save(fig, plt, plots, "report_save.png"),))


def section_s3(d: dict[str, Any], plots: str) -> Section:
    """bench_s3: median time and GB/s per contender, ratio to its raw limit."""
    limit = {"ours to s3": "raw s3fs upload", "ours to local disk": "raw local write+fsync"}
    gbs = d["gb_per_s"]
    rows = [[k, num(sorted(v)[len(v) // 2]), num(gbs[k]), num(gbs[k] / gbs[limit[k]]) if k in limit else "1 (limit)"]
            for k, v in d["seconds"].items()]
    lines = [f"{d['size_mib']} MiB state; moto is single-threaded Python, so only ratios mean anything.", "",
             *table(["contender", "median s", "GB/s", "÷ its raw limit"], rows)]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    _bars(ax, list(gbs), list(gbs.values()), [_color(k) for k in gbs], "{:.2f}")
    ax.set_ylabel("GB/s")
    ax.set_title("persist throughput: ours vs raw upload / raw write (same bytes)", fontsize=9)
    return Section(BENCHES["s3"].title, tuple(lines), (_save(fig, plt, plots, "report_s3.png"),))


def section_lightning(d: dict[str, Any], plots: str) -> Section:
    """bench_lightning: overhead vs no checkpointing per configuration, per device count."""
    lines: list[str] = [f"{d['config']['state_mib']:.0f} MiB state, checkpoint every {d['config']['every']} steps; "
                        "overhead = loop time ÷ loop time without checkpointing − 1 (median of repetitions)."]
    plt = _pyplot()
    summaries = d["summaries"]
    fig, axes = plt.subplots(1, len(summaries), figsize=(6.5 * len(summaries), 3.8), squeeze=False)
    for ax, s in zip(axes[0], summaries):
        rows = {n: r for n, r in s["rows"].items() if n != "none"}
        lines += ["", f"{s['devices']} device(s), {s['steps']} steps, clean step {num(s.get('iteration_ms'))} ms, "
                      f"baseline spread {pct(s.get('baseline_spread'))}:", "",
                  *table(["configuration", "overhead", "drift-corrected", "stall per ckpt ms", "checkpoints"],
                         [[r["label"], pct(r["overhead"]), pct(r.get("dc_overhead")), num(r.get("stall_ms")),
                           num(r.get("n_ckpt"), "{:.0f}")] for r in rows.values()])]
        _bars(ax, [r["label"].replace(" (sync torch.save)", " sync") for r in rows.values()],
              [r["overhead"] * 100 for r in rows.values()], [_color(n) for n in rows], "{:+.1f}%")
        ax.axhline(0, color="black", lw=0.5)
        ax.set_ylabel("training-time overhead %")
        ax.set_title(f"{s['devices']} device(s)", fontsize=9)
    return Section(BENCHES["lightning"].title, tuple(lines), (_save(fig, plt, plots, "report_lightning.png"),))


def section_overhead(d: dict[str, Any], plots: str) -> Section:
    """bench_overhead: measured overhead per budget, peers at the same interval, the slowdown run."""
    s = d["summary"]
    rows = s["rows"]
    table_rows = [[n, pct(r["overhead"]), pct(r.get("dc_overhead")), num(r.get("n_ckpt"), "{:.1f}"),
                   num(r.get("mean_interval"), "{:.1f}"), num(r.get("stall_ms"))] for n, r in rows.items()]
    lines = [f"{d['config']['steps']} steps, iteration ≈ {num(s.get('iteration_ms'), '{:.0f}')} ms; peers checkpoint "
             f"every k = {s.get('k')} steps (the interval adaptive 3.5 % chose). Target: overhead ≤ budget + 1 point.",
             "", *table(["configuration", "overhead", "drift-corrected", "checkpoints", "mean interval",
                         "stall ms"], table_rows)]
    more = s.get("more_checkpoints")
    if more:
        lines += ["", f"Checkpoints at the same overhead, ours (3.5 %) ÷ best peer ({more['peer']}): "
                      f"{num(more['ratio'], '{:.2f}')} × (target ≥ 3 ×)."]
    slow = d.get("slowdown")
    if slow:
        lines += ["", f"Storage slowed at step {slow['slow_at_step']} (~{num(slow['effective_mb_per_s'], '{:.0f}')} "
                      f"MB/s): mean interval {num(slow['interval_before'], '{:.0f}')} → "
                      f"{num(slow['interval_after'], '{:.0f}')} steps, overhead {pct(slow['overhead_before'])} → "
                      f"{pct(slow['overhead_after'])}."]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    shown = [n for n in rows if n != "none"]
    _bars(ax, shown, [rows[n]["overhead"] * 100 for n in shown], [_color(n) for n in shown], "{:+.1f}%")
    for i, n in enumerate(shown):
        if n.startswith("ours_"):
            budget = float(n.split("_", 1)[1].rstrip("%"))
            ax.plot([i - 0.4, i + 0.4], [budget + 1] * 2, "k--", lw=1)
        ax.plot(i, (rows[n].get("dc_overhead") or 0) * 100, "D", color="black", ms=4)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_ylabel("overhead %")
    ax.set_title("measured overhead (bars), drift-corrected (diamonds), budget + 1 point (dashes)", fontsize=9)
    shown_plots = [_save(fig, plt, plots, "report_overhead.png")]
    slow_png = os.path.join(d.get("_out_dir", ""), "bench_overhead_slowdown.png")
    if slow and os.path.exists(slow_png):  # the benchmark's own plot of the tuning over time
        shutil.copyfile(slow_png, os.path.join(plots, "bench_overhead_slowdown.png"))
        shown_plots.append("bench_overhead_slowdown.png")
    return Section(BENCHES["overhead"].title, tuple(lines), tuple(shown_plots))


SECTIONS: dict[str, Callable[[dict[str, Any], str], Section]] = {
    "save": section_save, "s3": section_s3, "lightning": section_lightning, "overhead": section_overhead}


def _save(fig: Any, plt: Any, plots: str, name: str) -> str:
    os.makedirs(plots, exist_ok=True)
    fig.tight_layout()
    fig.savefig(os.path.join(plots, name), dpi=100)
    plt.close(fig)
    return name


# ---- assembling -------------------------------------------------------------------------------
def load_results(out: str, names: list[str]) -> dict[str, tuple[dict[str, Any], float]]:
    """``{name: (JSON, file mtime)}`` of the benchmarks whose JSON exists in ``out``."""
    found = {}
    for name in names:
        path = os.path.join(out, f"bench_{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            data["_out_dir"] = out  # where the benchmark's own plots lie (see section_overhead)
            found[name] = (data, os.path.getmtime(path))
    return found


def render(results: dict[str, tuple[dict[str, Any], float]], plots: str, plots_rel: str) -> str:
    """The generated Markdown (without markers): one section per benchmark found."""
    out = ["## Generated figures", "",
           "Written by `benchmarks/report.py` from `benchmarks/out/*.json`; every ratio is taken within one run on "
           "the machine it names. Re-render with `.venv/bin/python benchmarks/report.py --from-json`."]
    for name, (data, mtime) in results.items():
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(mtime))
        try:
            sec = SECTIONS[name](data, plots)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            print(f"report: bench_{name}.json: cannot render ({type(e).__name__}: {e}); re-run the benchmark",
                  file=sys.stderr)
            out += ["", f"### {BENCHES[name].title}", "",
                    f"(not rendered: bench_{name}.json of {when} lacks {e}; "
                    f"re-run `benchmarks/{BENCHES[name].script}`)"]
            continue
        out += ["", f"### {sec.title}", "", f"Measured {when}.", "", *sec.lines]
        out += [line for p in sec.plots for line in ("", f"![{name}]({plots_rel}/{p})")]
    return "\n".join(out) + "\n"


def splice(readme: str, generated: str) -> str:
    """``readme`` with the text between the markers replaced (markers appended when absent)."""
    block = f"{BEGIN}\n{generated}{END}"
    if BEGIN in readme and END in readme and readme.index(BEGIN) < readme.index(END):
        return readme[:readme.index(BEGIN)] + block + readme[readme.index(END) + len(END):]
    return readme.rstrip("\n") + "\n\n" + block + "\n"


def run_benchmarks(names: list[str], quick: bool, out: str) -> list[str]:
    """Run each benchmark script (a fresh interpreter each); returns the names that failed."""
    failed = []
    for name in names:
        bench = BENCHES[name]
        cmd = [sys.executable, os.path.join(HERE, bench.script), "--out", out, *(bench.quick if quick else ())]
        print(f"report: running {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        if subprocess.run(cmd, cwd=os.path.dirname(HERE)).returncode != 0:
            failed.append(name)
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes and few steps (a smoke run)")
    p.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {','.join(BENCHES)}")
    p.add_argument("--from-json", action="store_true", help="render from existing JSON, run nothing")
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="benchmark JSON directory")
    p.add_argument("--readme", default=os.path.join(HERE, "README.md"))
    p.add_argument("--plots", default=os.path.join(HERE, "plots"))
    a = p.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        p.error(f"--only: unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")
    failed = [] if a.from_json else run_benchmarks(names, a.quick, a.out)
    results = load_results(a.out, list(BENCHES))  # every section found, so a partial run keeps the others
    if not results:
        print(f"report: no benchmark JSON in {a.out}; run without --from-json first", file=sys.stderr)
        return 2
    plots_rel = os.path.relpath(a.plots, os.path.dirname(os.path.abspath(a.readme)))
    generated = render(results, a.plots, plots_rel)
    readme = open(a.readme).read() if os.path.exists(a.readme) else "# Benchmarks\n"
    with open(a.readme, "w") as f:
        f.write(splice(readme, generated))
    print(f"report: wrote {a.readme} ({', '.join(results)}) and plots in {a.plots}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
