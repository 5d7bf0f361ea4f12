"""When to checkpoint: every N steps, every T seconds, or adaptively under an overhead budget.

A policy runs on rank 0 only and answers one question after each checkpoint (and once at the
start): *at which step is the next one due?* The :class:`~ckpt_engine.training.schedule.Schedule` then
broadcasts that step, so every rank takes the same decision with one small collective per
checkpoint instead of one per step (a per-step broadcast would itself show in the overhead).

Policies learn from what the schedule reports: the wall time of every iteration, whether a
persist was running during it, and the stall of each snapshot. Times are seconds from an
injectable clock, so the adaptive rule is tested with scripted timings and no sleeps.

Adaptive (CheckFreq, FAST'21):

1. *profile*: after a few warm-up iterations, time plain iterations (no checkpoint in flight):
   their median is the baseline iteration time ``t``;
2. *pick* ``k``: each checkpoint's cost ``C`` is the excess over ``t`` of the iterations that
   overlapped its work: the one that took the snapshot and every one the persist ran beside (so
   it holds the stall *and* the slowdown from persist and training sharing cores, and nothing
   from slowdowns elsewhere on the machine, which a no-checkpoint run would suffer too). ``t`` here
   is the *mean* clean iteration (outliers above 3x the median dropped), the figure wall time is
   made of. The interval is the smallest ``k`` with ``C / (k·t) ≤ budget`` that also lets the
   persist finish before the next snapshot;
3. *tune*: ``C`` is a moving average over recent intervals, so a slower storage or a larger state
   raises ``k`` within a few checkpoints; ``k`` grows at once but shrinks only when the
   measured overhead stayed well under budget twice in a row and at most by half (no oscillation),
   and grows at most 4x per checkpoint (one interval disturbed by something else does not explode it).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class Policy:
    """Base class: decides the step of the next checkpoint, on rank 0."""

    name = "policy"

    def first_due(self, step: int) -> int:
        """The step of the first checkpoint, decided when training (re)starts at ``step``."""
        raise NotImplementedError

    def next_due(self, step: int) -> int:
        """The step of the next checkpoint, decided right after the one at ``step``."""
        raise NotImplementedError

    def observe_iteration(self, seconds: float, persist_busy: bool, checkpointed: bool) -> None:
        """Wall time of one training iteration; whether a persist overlapped it; whether it saved."""

    def observe_persist(self, seconds: float) -> None:
        """Time from a snapshot until its checkpoint was durable."""

    def figures(self) -> dict[str, float]:
        """What the front ends log (interval, measured overhead, expected lost work...)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Plain values to store in the checkpoint, so a resumed job does not start from scratch."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class EveryNSteps(Policy):
    """A checkpoint every ``n`` optimizer steps."""

    name = "every_n_steps"

    def __init__(self, n: int) -> None:
        if type(n) is not int or n < 1:
            raise ValueError(f"every_n_steps must be a positive integer, got {n!r}")
        self.n = n

    def first_due(self, step: int) -> int:
        return (step // self.n + 1) * self.n

    def next_due(self, step: int) -> int:
        return (step // self.n + 1) * self.n

    def figures(self) -> dict[str, float]:
        return {"interval_steps": float(self.n)}


@dataclass
class _IterationClock:
    """The baseline iteration time: median of recent iterations that ran alone."""

    warmup: int = 3
    window: deque = field(default_factory=lambda: deque(maxlen=64))
    seen: int = 0

    def add(self, seconds: float, clean: bool) -> None:
        self.seen += 1
        if clean and self.seen > self.warmup:
            self.window.append(seconds)

    @property
    def ready(self) -> bool:
        return len(self.window) >= 5

    @property
    def seconds(self) -> float:
        return statistics.median(self.window) if self.window else math.nan

    @property
    def mean_seconds(self) -> float:
        """Mean clean iteration, without outliers (> 3x the median: validation, a stray pause)."""
        if not self.window:
            return math.nan
        cap = 3 * statistics.median(self.window)
        return statistics.fmean(x for x in self.window if x <= cap)


class EverySeconds(Policy):
    """A checkpoint about every ``seconds`` of training: converted to a step count from the
    measured iteration time at each checkpoint (so the decision needs no per-step collective)."""

    name = "every_seconds"

    def __init__(self, seconds: float) -> None:
        if not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"every_seconds must be a positive number, got {seconds!r}")
        self.seconds = float(seconds)
        self.clock = _IterationClock()

    def observe_iteration(self, seconds: float, persist_busy: bool, checkpointed: bool) -> None:
        self.clock.add(seconds, clean=not (persist_busy or checkpointed))

    def steps(self) -> int:
        """The interval in steps that ``seconds`` is worth now."""
        if not self.clock.ready:
            return 0
        return max(1, math.floor(self.seconds / self.clock.mean_seconds))

    def first_due(self, step: int) -> int:
        return step + max(self.steps(), 10)

    def next_due(self, step: int) -> int:
        return step + max(1, self.steps() or 10)

    def figures(self) -> dict[str, float]:
        return {"interval_steps": float(self.steps()), "iteration_s": self.clock.mean_seconds}


class MaxInterval(Policy):
    """``inner``, but at least every ``seconds`` (the earlier of the two)."""

    def __init__(self, inner: Policy, seconds: float) -> None:
        self.inner, self.bound = inner, EverySeconds(seconds)
        self.name = f"{inner.name}+max_interval"

    def first_due(self, step: int) -> int:
        return min(self.inner.first_due(step), self.bound.first_due(step))

    def next_due(self, step: int) -> int:
        return min(self.inner.next_due(step), self.bound.next_due(step))

    def observe_iteration(self, seconds: float, persist_busy: bool, checkpointed: bool) -> None:
        self.inner.observe_iteration(seconds, persist_busy, checkpointed)
        self.bound.observe_iteration(seconds, persist_busy, checkpointed)

    def observe_persist(self, seconds: float) -> None:
        self.inner.observe_persist(seconds)

    def figures(self) -> dict[str, float]:
        return self.inner.figures() | {"max_interval_steps": float(self.bound.steps())}

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class Adaptive(Policy):
    """Checkpoint as often as possible while the measured slowdown stays under ``overhead_budget``.

    Args:
        overhead_budget: allowed fraction of training wall time, e.g. ``0.035``.
        profile_steps: clean iterations to time before the first checkpoint.
        min_interval / max_steps: bounds on the interval, in steps.
        smoothing: weight of the newest interval in the moving average of the cost.
    """

    name = "adaptive"

    def __init__(self, overhead_budget: float, *, profile_steps: int = 10, min_interval: int = 1,
                 max_steps: int = 1_000_000, smoothing: float = 0.5) -> None:
        if not isinstance(overhead_budget, (int, float)) or not 0 < overhead_budget < 1:
            raise ValueError(f"overhead_budget must be a fraction in (0, 1), e.g. 0.035; got {overhead_budget!r}")
        if type(profile_steps) is not int or profile_steps < 5:
            raise ValueError(f"profile_steps must be an integer >= 5, got {profile_steps!r}")
        self.budget = float(overhead_budget)
        self.profile_steps, self.min_interval, self.max_steps = profile_steps, min_interval, max_steps
        self.smoothing = smoothing
        self.clock = _IterationClock()
        self.k = 0
        self.cost = math.nan         # moving average of the per-checkpoint cost C (seconds)
        self.persist = math.nan      # moving average of the persist time (seconds)
        self.last_overhead = math.nan
        self._overlapping: list[float] = []  # this interval's iterations beside checkpoint work
        self._interval_steps = 0
        self._low_streak = 0
        self._checkpoints = 0

    # -- observations --------------------------------------------------------------------------
    def observe_iteration(self, seconds: float, persist_busy: bool, checkpointed: bool) -> None:
        self.clock.add(seconds, clean=not (persist_busy or checkpointed))
        if persist_busy or checkpointed:
            self._overlapping.append(seconds)
        self._interval_steps += 1

    def observe_persist(self, seconds: float) -> None:
        self.persist = seconds if math.isnan(self.persist) else self._avg(self.persist, seconds)

    # -- decisions -----------------------------------------------------------------------------
    def first_due(self, step: int) -> int:
        if self.k:  # resumed with a learned interval
            return step + self.k
        return step + self.clock.warmup + self.profile_steps

    def next_due(self, step: int) -> int:
        t = self.clock.mean_seconds
        # The interval that ends at the first checkpoint held no checkpoint cost: measure from there.
        if self._checkpoints and self._interval_steps and not math.isnan(t):
            cost = max(0.0, sum(self._overlapping) - len(self._overlapping) * t)
            self.cost = cost if math.isnan(self.cost) else self._avg(self.cost, cost)
            self.last_overhead = cost / (self._interval_steps * t)
        self._checkpoints += 1
        self._overlapping, self._interval_steps = [], 0
        if math.isnan(t) or math.isnan(self.cost):
            self.k = self.k or self.profile_steps
            return step + self.k
        self.k = self._choose(t)
        return step + self.k

    def _choose(self, t: float) -> int:
        by_budget = math.ceil(self.cost / (self.budget * t)) if self.cost > 0 else self.min_interval
        by_persist = math.ceil(self.persist / t) + 1 if not math.isnan(self.persist) else 1
        target = min(self.max_steps, max(self.min_interval, by_budget, by_persist))
        if self.k:  # one noisy interval (a load spike elsewhere) moves k at most 4x per checkpoint
            target = min(target, 4 * self.k)
        if target >= self.k or not self.k:
            self._low_streak = 0
            return target
        # Shrink only after two intervals well under budget, and at most by half: no oscillation.
        low = not math.isnan(self.last_overhead) and self.last_overhead < 0.7 * self.budget
        self._low_streak = self._low_streak + 1 if low else 0
        if self._low_streak >= 2:
            self._low_streak = 0
            return max(target, self.k // 2, self.min_interval)
        return self.k

    def _avg(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new

    # -- reporting and state -------------------------------------------------------------------
    def figures(self) -> dict[str, float]:
        t = self.clock.mean_seconds
        return {"interval_steps": float(self.k), "iteration_s": t, "checkpoint_cost_s": self.cost,
                "measured_overhead": self.last_overhead, "persist_s": self.persist,
                "expected_lost_work_s": self.k / 2 * t if self.k else math.nan}

    def state_dict(self) -> dict[str, Any]:
        return {"k": self.k, "cost": self.cost, "persist": self.persist, "iteration_s": self.clock.mean_seconds,
                "budget": self.budget}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("budget") != self.budget:
            return  # another budget: profile again
        self.k = int(state.get("k", 0))
        self.cost = float(state.get("cost", math.nan))
        self.persist = float(state.get("persist", math.nan))
