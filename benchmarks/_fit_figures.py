"""The figures of fits run in rounds (``_lightning_job.rounds``): what ``bench_lightning``, ``bench_overhead``
and ``bench_gpu_lightning`` read from them.

Every overhead is taken **paired**: each fit against the no-checkpointing fit of its own round, so that the
machine's drift between rounds (whole fits 5-16 % faster or slower from one minute to the next here)
cancels; over the rounds, the median of those differences and their mean ± standard error
(:class:`Paired`). A difference whose mean lies within two standard errors of zero, or measured in fewer
than two rounds, is *inside the noise*, and the reports say so instead of ranking. The CPU of the threads that
do the checkpoint work (``FitResult.own_cpu_s``) is reported apart from the rest of the process's (the
training threads', which pay the indirect costs: caches, memory bandwidth, the GIL).
"""

from __future__ import annotations

import datetime
import importlib
import math
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable

from _common import fmt, git_commit, table
from _lightning_job import CONTENDER, PL, FitJob, FitResult, every_of, label

NOISE_SE = 2.0
"""A paired difference is inside the noise when its mean is within this many standard errors of zero."""


def median(values: list[float]) -> float:
    """The median of the values that are not NaN (NaN if none)."""
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else math.nan


def mean(values: list[float]) -> float:
    """The mean of the values that are not NaN (NaN if none)."""
    vals = [v for v in values if v == v]
    return statistics.fmean(vals) if vals else math.nan


MARK = {"wall": 0, "main_cpu": 1, "cpu": 2}
"""The figures of a step mark (``FitResult.marks``)."""


def step_deltas(r: FitResult, i: int = 0) -> dict[int, float]:
    """Per step j ≥ 2, mark ``i`` of step j minus that of step j - 1 (step j holds the checkpoint work
    done at the end of step j - 1)."""
    m = r.marks
    return {j: m[j - 1][i] - m[j - 2][i] for j in range(2, len(m) + 1)}


def clean_step(r: FitResult, i: int = 0, tail: float = 0.7) -> float:
    """The fit's clean step: the median over the steps late in an interval between checkpoints (phase >
    ``tail``); every step after the fifth for a fit without checkpoints."""
    dx, saves, late = step_deltas(r, i), sorted(r.save_steps), []
    for a, b in zip(saves, saves[1:]):
        late += [dx[j] for j in range(a + 1, b + 1) if j in dx and (j - a) / (b - a) > tail]
    return median(late if r.n_ckpt and late else [dx[j] for j in sorted(dx)[4:]])


def drift_corrected(r: FitResult, base: FitResult, i: int = 0, total: str = "end_wall_s") -> float:
    """Overhead with each fit in its own clean steps: ``total`` ÷ (steps × clean step), minus the same of
    the no-checkpointing fit of its round (not fooled by whole fits running faster or slower)."""
    def steps(f: FitResult) -> int:  # the loop (``loop_s``) starts at the first step's end
        return len(f.marks) - (total == "loop_s")

    own = getattr(r, total) / (steps(r) * clean_step(r, i))
    return own - getattr(base, total) / (steps(base) * clean_step(base, i))


def local_costs(r: FitResult, window: int, i: int = 0, tail: float = 0.7) -> list[float]:
    """Seconds each in-loop checkpoint cost in mark ``i``: the excess of the ``window`` steps after it (cut
    at the next checkpoint) over the median of the late steps of the interval before it; a checkpoint
    without either is left out. For ``none``: the same windows at the same steps (a control: ~0)."""
    dx, saves, out = step_deltas(r, i), sorted(r.save_steps), []
    for k, s in enumerate(saves):
        prev = saves[k - 1] if k else s - window
        stop = min(s + window, saves[k + 1] if k + 1 < len(saves) else s + window)
        before = [dx[j] for j in range(max(2, prev + 1), s + 1) if j in dx and (j - prev) / (s - prev) > tail]
        if before and stop in dx:
            base = statistics.median(before)
            out.append(sum(dx[j] - base for j in range(s + 1, stop + 1)))
    return out




# ---- paired differences ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Paired:
    """Per-round differences of one figure against the same round's reference (as fractions of it)."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, saved: dict[str, Any]) -> "Paired":
        """The figures from their JSON (:meth:`as_json`)."""
        return cls(tuple(saved["values"]))

    @property
    def median(self) -> float:
        """The median difference (NaN without rounds)."""
        return median(list(self.values))

    @property
    def mean(self) -> float:
        """The mean difference (NaN without rounds)."""
        return mean(list(self.values))

    @property
    def se(self) -> float:
        """The standard error of the mean (NaN below two rounds)."""
        vals = [v for v in self.values if v == v]
        return statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else math.nan

    @property
    def noise(self) -> bool:
        """Whether the difference is inside the noise: fewer than two rounds, or ``|mean| ≤ NOISE_SE × se``."""
        return math.isnan(self.se) or abs(self.mean) <= NOISE_SE * self.se

    def text(self, scale: float = 100.0, unit: str = " %") -> str:
        """``median / mean ± se``, signed, with ``(noise)`` when inside the noise."""
        if not self.values:
            return "-"
        se = f" ± {self.se * scale:.1f}" if self.se == self.se else ""
        return (f"{self.median * scale:+.1f} / {self.mean * scale:+.1f}{se}{unit}"
                + (" (noise)" if self.noise else ""))

    def as_json(self) -> dict[str, Any]:
        """The figures as a JSON object."""
        return {"median": self.median, "mean": self.mean, "se": self.se, "rounds": len(self.values),
                "noise": self.noise, "values": list(self.values)}


def versus(mine: Paired, peer: Paired, target: float) -> str:
    """The verdict of ``mine`` against a peer's overhead: the ratio of their means against ``target`` (at
    most), or why there is none (the peer's difference inside the noise, or not above zero)."""
    if peer.noise:
        return "inconclusive: the peer's difference is inside the noise"
    if peer.mean <= 0:
        return "no ratio: the peer's difference is not above zero"
    ratio = mine.mean / peer.mean
    return (f"{ratio:.2f} × the peer → {'PASS' if ratio <= target else 'FAIL'} (target ≤ {target:.2f})"
            + ("; ours inside the noise" if mine.noise else ""))


def paired(fits: list[FitResult], name: str, diff: Callable[[FitResult, FitResult], float],
           reference: str = "none") -> Paired:
    """Per round where both ran, ``diff(fit of name, fit of reference)``."""
    ref = {r.rep: r for r in fits if r.name == reference}
    return Paired(tuple(diff(r, ref[r.rep]) for r in fits if r.name == name and r.rep in ref))


def _rest(r: FitResult) -> float:
    return r.process_cpu_s - r.own_cpu_s


PAIRED: dict[str, tuple[str, Callable[[FitResult, FitResult], float]]] = {
    "process_cpu": ("process CPU", lambda r, b: r.process_cpu_s / b.process_cpu_s - 1),
    "fit_wall": ("fit wall", lambda r, b: r.fit_wall_s / b.fit_wall_s - 1),
    "end_wall": ("training wall (to `on_train_end`)", lambda r, b: r.end_wall_s / b.end_wall_s - 1),
    "own_cpu": ("checkpoint threads' own CPU", lambda r, b: (r.own_cpu_s - b.own_cpu_s) / b.process_cpu_s),
    "rest_cpu": ("the rest of the process's CPU", lambda r, b: (_rest(r) - _rest(b)) / b.process_cpu_s),
}
"""The paired figures: name → (heading, the fit's difference from its round's reference, as a fraction of the
reference). ``own_cpu`` (the checkpoint threads' CPU, :attr:`FitResult.own_cpu_s`) and ``rest_cpu`` (the rest
of the process: training threads, imports, Lightning) add up to ``process_cpu``."""


# ---- a configuration's figures -----------------------------------------------------------------------
def paired_row(fits: list[FitResult], name: str) -> dict[str, Any]:
    """What :func:`paired_table` shows of configuration ``name``: its rounds, checkpoints (median), the paired
    figures (:data:`PAIRED`) and its own CPU per checkpoint (median over its fits that took one)."""
    rs = [r for r in fits if r.name == name]
    return {"rounds": len(rs), "n_ckpt": median([float(r.n_ckpt) for r in rs]),
            "paired": {k: paired(fits, name, diff).as_json() for k, (_, diff) in PAIRED.items()},
            "own_cpu_per_ckpt_ms": median([r.own_cpu_s / r.n_ckpt * 1e3 for r in rs if r.n_ckpt])}


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / min(values) if len(values) > 1 else math.nan


def summarize(job: FitJob, fits: list[FitResult], names: list[str], window: int = 0) -> dict[str, Any]:
    """Per configuration in ``names`` (``FitResult.name``), the figures of its fits: the paired overheads
    (:data:`PAIRED`), the minima of the rounds and their overheads, checkpoints, local costs over ``window``
    steps after each checkpoint (default ``job.every``), where ours' CPU goes, CPU by thread."""
    base = [r for r in fits if r.name == "none"]
    by_round = {r.rep: r for r in base}
    ref = {k: min(getattr(r, k) for r in base) for k in ("process_cpu_s", "fit_cpu_s", "fit_wall_s", "end_wall_s")}
    rows: dict[str, Any] = {}
    for n in names:
        rs = [r for r in fits if r.name == n]
        c = rs[0].contender
        best = {k: min(getattr(r, k) for r in rs) for k in ref}
        figs = [f for r in rs for f in r.figures if f.get("kind", "save") == "save"]
        shown = paired_row(fits, n)
        ck = shown["n_ckpt"]
        row: dict[str, Any] = {
            "label": label(n, job) if n in CONTENDER else n, "contender": c, "every": every_of(job, c),
            **shown, **{f"{k}_min": v for k, v in best.items()},
            **{f"{k}_overhead": best[k] / ref[k] - 1 for k in ref},
            "per_round_cpu": [r.process_cpu_s for r in rs], "per_round_wall": [r.fit_wall_s for r in rs],
            "foreign_cores_max": max(r.foreign_cores for r in rs),
            "main_cpu_s": median([r.main_cpu_s for r in rs]), "other_cpu_s": median([r.other_cpu_s for r in rs]),
            "threads_cpu_s": {t: median([r.threads_cpu_s.get(t, 0.0) for r in rs])
                              for t in sorted({k for r in rs for k in r.threads_cpu_s})},
            "train_cpu_ms": mean([x for r in rs for x in r.train_cpu_ms]),
            "train_cpu_first_ms": mean([r.train_cpu_ms[0] for r in rs if r.train_cpu_ms]),
            "train_cpu_steady_ms": mean([x for r in rs for x in r.train_cpu_ms[1:]]),
            "background_cpu_per_ckpt_ms": mean([r.background_cpu_s / r.n_ckpt * 1e3 for r in rs if r.n_ckpt]),
            "extra_cpu_per_ckpt_ms": (best["process_cpu_s"] - ref["process_cpu_s"]) / ck * 1e3 if ck else math.nan,
            "import_cpu_ms": median([r.import_cpu_ms for r in rs]),
            "clean_step_ms": median([clean_step(r) * 1e3 for r in rs]),
            **{key: mean([f[key] for f in figs if key in f])
               for key in ("encode_cpu_ms", "snapshot_cpu_ms", "persist_cpu_ms", "commit_cpu_ms", "stall_ms",
                           "measured_overhead")},
        }
        for key, i, total in (("dc_cpu_overhead", 2, "fit_cpu_s"), ("dc_wall_overhead", 0, "fit_wall_s")):
            # every step: no step is clear of a checkpoint, no clean step to correct by
            row[key] = math.nan if CONTENDER[c].every_step else median(
                [drift_corrected(r, by_round[r.rep], i, total) for r in rs if r.rep in by_round])
        for mark, i in MARK.items():
            row[f"local_{mark}_ms"] = mean([x * 1e3 for r in rs for x in local_costs(r, window or job.every, i)]
                                           if not CONTENDER[c].every_step else [])
        if CONTENDER[c].memory or CONTENDER[c].slow or CONTENDER[c].every_step:
            row.update(_memory_figures(rs, by_round, ref))
        rows[n] = row
    return {"job": {**asdict(job), "params": base[0].params, "state_mb": base[0].params * 12 / 1e6}, "rows": rows,
            "cpu_spread": _spread([r.process_cpu_s for r in base]),
            "wall_spread": _spread([r.fit_wall_s for r in base])}


def _memory_figures(rs: list[FitResult], by_round: dict[int, FitResult], ref: dict[str, float]) -> dict[str, Any]:
    """The node-memory section's figures of one configuration (``bench_lightning.memory_markdown``)."""
    committed = [float(sum(1 for f in r.figures if f.get("kind", "save") == "save" and f.get("committed")))
                 if r.figures else float(r.n_ckpt) for r in rs]
    n = median(committed)
    flushes = [f for r in rs for f in r.figures if f.get("kind") == "flush" and f.get("committed")]
    own = [r.own_cpu_s for r in rs]
    return {
        **{k: median([r.counters.get(k, math.nan) for r in rs]) for k in ("waited_s", "flushed", "flush_skipped")},
        "committed": n, "own_cpu_per_ckpt_ms": median([o / k * 1e3 for o, k in zip(own, committed) if k]),
        "own_cpu_overhead": median([(o + r.import_cpu_ms / 1e3) / (r.process_cpu_s - o - r.import_cpu_ms / 1e3)
                                    for o, r in zip(own, rs)]),
        "own_cpu_steady_overhead": median([(o - r.threads_cpu_s.get("ckpt-reserve", 0.0))
                                           / (r.process_cpu_s - o - r.import_cpu_ms / 1e3) for o, r in zip(own, rs)]),
        "reserve_cpu_ms": median([r.threads_cpu_s.get("ckpt-reserve", 0.0) * 1e3 for r in rs]),
        "flush_lag_ms": mean([f["lag_ms"] for f in flushes]), "flush_copy_ms": mean([f["copy_ms"] for f in flushes]),
        "final_wait_s": median([r.fit_wall_s - r.end_wall_s for r in rs]),
        "cpu_per_ckpt_ms": (min(r.process_cpu_s for r in rs) - ref["process_cpu_s"]) / n * 1e3 if n else math.nan,
        "cpu_per_ckpt_paired_ms": median([(r.process_cpu_s - by_round[r.rep].process_cpu_s) / k * 1e3
                                          for r, k in zip(rs, committed) if r.rep in by_round and k]),
        "floor_thread_cpu_steady_ms": mean([cpu * 1e3 for r in rs for _, cpu in r.copy_hash[1:]]),
        "shm_left_fits": sum(1 for r in rs if r.shm_left),
        "shm_left_example": next((r.shm_left[:5] for r in rs if r.shm_left), []),
    }


def run_line(what: str) -> str:
    """The report's first line, as ``report.py`` expects it: ``Run <UTC time>``, the machine, the versions and
    the commit, then ``what``."""
    import torch

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{platform.machine()} CPU"
    return (f"Run {now}, {device}, {os.cpu_count()} cores, torch {torch.__version__}, lightning "
            f"{importlib.import_module(PL.split('.')[0]).__version__}, commit {git_commit() or 'unknown'}: {what}")


def paired_table(s: dict[str, Any]) -> list[str]:
    """Every configuration's paired overheads (:data:`PAIRED`) and its own CPU per checkpoint, as a table."""
    return table(["configuration", "rounds", "checkpoints",
                  *(f"{h}: median / mean ± SE" for h, _ in PAIRED.values()), "own CPU per checkpoint ms"],
                 [[r["label"], r["rounds"], f"{r['n_ckpt']:.0f}", *(Paired.of(r["paired"][k]).text() for k in PAIRED),
                   fmt(r["own_cpu_per_ckpt_ms"])] for r in s["rows"].values()])
