"""Write the latest figures of every benchmark, from ``benchmarks/results/``, into ``benchmarks/README.md``.

A run worth keeping is copied from ``benchmarks/out/`` into ``results/`` as
``<family>_<YYYY-MM-DD>[_<run>].{json,md}`` (a family is a benchmark or one of its sections), naming its
device and commit: a ``"run"`` object in a JSON file, a line starting with ``Run `` in a Markdown one.
Per benchmark, the files of each family's latest date are rendered between the README's markers
``<!-- figures:bench_X:begin -->`` and ``<!-- figures:bench_X:end -->``; the rest of the README is
written by hand. ``tests/test_report.py`` checks that the README is what ``results/`` gives.

Usage::

    .venv/bin/python benchmarks/report.py           # rewrite the figures in benchmarks/README.md
    .venv/bin/python benchmarks/report.py --check   # exit 1 if the README is not up to date with results/
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pool_runs  # noqa: E402
from _common import HERE, num, table  # noqa: E402
from bench_gpu import markdown  # noqa: E402

SECTIONS = ("bench_save", "bench_lightning", "bench_overhead", "bench_horovod", "bench_s3", "bench_sharded",
            "bench_plan", "bench_gpu", "bench_recovery", "bench_exact")
"""The benchmarks, each a ``## bench_X`` section of the README with its figures' markers."""
NAME = re.compile(r"^(?P<family>bench_[a-z0-9_]+?)_(?P<date>\d{4}-\d{2}-\d{2})(?:_(?P<run>[\w-]+))?\.(?P<ext>json|md)$")
VERDICT = re.compile(r"→|\*\*[0-9.]+ ?[x×]\*\*|target")
BESIDE = ("stall, steady state", "CPU per checkpoint", "time to committed (steady)")
"""bench_save's figures without a target shown beside each run's targets."""
TABLES = {"bench_s3": 2, "bench_lightning_mlp": 2, "bench_lightning_memory": 0, "bench_exact_ddp": 2}
"""How many of a Markdown report's tables are its headline figures (default 1)."""


def markers(section: str) -> tuple[str, str]:
    """The README's begin and end markers of ``section``'s generated figures."""
    return f"<!-- figures:{section}:begin -->", f"<!-- figures:{section}:end -->"


class Result(NamedTuple):
    """One file of ``results/``: its family, date and run name (``""`` for a single run)."""

    path: str
    family: str
    date: str
    run: str
    ext: str

    @property
    def name(self) -> str:
        """The file's name."""
        return os.path.basename(self.path)

    def load(self) -> Any:
        """The file's content: the JSON object, or the Markdown text."""
        with open(self.path) as f:
            return json.load(f) if self.ext == "json" else f.read()


def section_of(r: Result) -> str:
    """The benchmark a result's family belongs to (the longest section name it starts with)."""
    found = [s for s in SECTIONS if r.family == s or r.family.startswith(s + "_")]
    if not found:
        raise ValueError(f"{r.name}: no benchmark named {r.family}; name it after one of {SECTIONS}")
    return max(found, key=len)


def latest(results: str) -> dict[str, list[Result]]:
    """Per benchmark, the files of each family's latest date (a Markdown report preferred to the JSON of
    the same run), in name order."""
    found = []
    for name in sorted(os.listdir(results)):
        m = NAME.match(name)
        if m is None:
            raise ValueError(f"{results}/{name}: not named <family>_<YYYY-MM-DD>[_<run>].(json|md); rename it")
        found.append(Result(os.path.join(results, name), m["family"], m["date"], m["run"] or "", m["ext"]))
    newest: dict[str, str] = {}
    for r in found:
        newest[r.family] = max(newest.get(r.family, r.date), r.date)
    stems = {(r.family, r.date, r.run) for r in found if r.ext == "md"}
    out: dict[str, list[Result]] = {}
    for r in found:
        if r.date == newest[r.family] and not (r.ext == "json" and (r.family, r.date, r.run) in stems):
            out.setdefault(section_of(r), []).append(r)
    return out


def run_line(r: Result, data: Any) -> str:
    """What the file says of its run: the JSON's ``run`` object, or the Markdown's ``Run ...`` line."""
    if r.ext == "json":
        run = data.get("run", {})
        said = ", ".join(f"{k} {run[k]}" for k in ("device", "commit", "note") if k in run)
        return f"Run {r.date}" + (f", {said}" if said else "")
    return next((x for x in data.splitlines() if x.startswith("Run ")), f"Run {r.date}").rstrip(".")


def markdown_figures(text: str, tables: int = 1) -> list[str]:
    """The head of a benchmark's own Markdown report: its first ``tables`` tables (each with the line
    before it when that line introduces it, ending in ``:``) and its verdict lines."""
    out: list[str] = []
    seen, in_table, last = 0, False, ""
    for line in text.splitlines():
        if line.startswith("|"):
            if not in_table:
                seen, in_table = seen + 1, True
                if seen <= tables:
                    out += ([""] if out else []) + ([last, ""] if last.endswith(":") and last not in out else [])
            if seen <= tables:
                out.append(line)
            continue
        in_table, last = False, line.strip() or last
        if VERDICT.search(line) and not line.startswith(("Run ", "#", "Notes")):
            out += ["", line] if out and not out[-1].startswith("- ") else [line]
    return out


def save_figures(files: list[Result]) -> list[str]:
    """bench_save: each run's targets side by side, then the paired figures pooled over the runs."""
    runs, names = [r.load() for r in files], [r.run or r.date for r in files]
    rows: dict[tuple[str, str, str], list[Any]] = {}
    for i, run in enumerate(runs):
        for row in run["rows"]:
            if row["passed"] is not None:
                rows.setdefault((row["world"], row["metric"], row["target"]), [None] * len(runs))[i] = row
    cells = [[world, metric, *("-" if r is None else f"{num(r['ours_vs_limit'])} {'PASS' if r['passed'] else 'FAIL'}"
                               for r in found), target] for (world, metric, target), found in rows.items()]
    beside: dict[tuple[str, str, str], list[str]] = {}
    for i, run in enumerate(runs):
        for row in run["rows"]:
            if row["metric"].startswith(BESIDE):
                beside.setdefault((row["world"], row["metric"], row["unit"]), ["-"] * len(runs))[i] = (
                    f"{num(row['ours'])} ({num(row['ours_vs_limit'])} × {row['limit_name']}"
                    + (f"; {num(row['ours_vs_peer'])} × {row['peer_name']}" if row["peer"] else "") + ")")
    return ["Each run's targets (ours ÷ the limit; slowest rank):", "",
            *table(["ranks", "figure", *names, "target"], cells), "",
            "Each run's stall, CPU and time to committed (ours, its ratio to the limit and to the best peer):", "",
            *table(["ranks", "figure", "unit", *names], [[*key, *found] for key, found in beside.items()]),
            "", f"The paired figures pooled over runs {', '.join(names)} (`pool_runs.py`):", "",
            *pool_runs.markdown(pool_runs.pool(runs), names).splitlines()]


def render_section(section: str, files: list[Result]) -> str:
    """The generated Markdown of one benchmark (without markers)."""
    if not files:
        return (f"No run of `{section}.py` in `results/` yet: run it, copy its report from `out/` to "
                f"`results/{section}_<date>.md` with a `Run <date>, <device>, <commit>` line, and re-render.\n")
    lines = ["Generated by `report.py` from `results/` (the latest date of each family).", ""]
    if section == "bench_save":  # each family's JSON runs side by side
        for family in sorted({r.family for r in files}):
            runs = [r for r in files if r.family == family]
            lines += [f"{run_line(r, r.load())}: [`results/{r.name}`](results/{r.name})." for r in runs]
            lines += ["", *save_figures(runs), ""]
        return "\n".join(lines[:-1]) + "\n"
    for r in files:
        data = r.load()
        lines += [f"**[`results/{r.name}`](results/{r.name})**: {run_line(r, data)}.", ""]
        if r.family.startswith("bench_gpu") and r.ext == "json":
            lines += [*markdown(data).splitlines()[2:], ""]
        else:
            lines += [*markdown_figures(data, TABLES.get(r.family, 1)), ""]
    return "\n".join(lines)


def render_readme(readme: str, results: str) -> str:
    """``readme`` with every benchmark's figures replaced by what ``results`` gives."""
    found = latest(results)
    for section in SECTIONS:
        begin, end = markers(section)
        if begin not in readme or end not in readme or readme.index(begin) > readme.index(end):
            raise ValueError(f"the README lacks the markers {begin} ... {end} in its ## {section} section; add them")
        head, rest = readme.split(begin, 1)
        readme = f"{head}{begin}\n{render_section(section, found.get(section, []))}{end}{rest.split(end, 1)[1]}"
    return readme


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the README is out of date")
    p.add_argument("--readme", default=os.path.join(HERE, "README.md"))
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    with open(a.readme) as f:
        text = f.read()
    try:
        new = render_readme(text, a.results)
    except ValueError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    if a.check:
        if new != text:
            print(f"report: {a.readme} is not up to date with {a.results}; run benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    with open(a.readme, "w") as f:
        f.write(new)
    print(f"report: wrote the figures of {a.results} into {a.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
