"""Trigger policies with a simulated clock and scripted timings (no sleeps)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from ckpt_engine.training.policy import Adaptive, EveryNSteps, EverySeconds, MaxInterval


@dataclass
class SimJob:
    """Training in simulated time.

    Iterations take ``t`` seconds (with ``noise``); a checkpoint stalls the training thread for
    ``stall`` seconds; its persist then runs ``persist`` seconds in the background and slows every
    iteration it overlaps by ``contention`` (two cores shared by training and persist). When a
    checkpoint is due while the previous persist still runs, the snapshot waits (back-pressure).
    """

    t: float = 0.1
    stall: float = 0.02
    persist: float = 1.0
    contention: float = 1.2
    noise: float = 0.02
    now: float = 0.0
    base: float = 0.0
    persist_end: float = -1.0
    saved_at: float = 0.0
    checkpoints: list = field(default_factory=list)  # (step, k, measured overhead)
    waits: list = field(default_factory=list)  # indices of checkpoints that had to wait
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    def run(self, policy, steps: int, start: int = 0) -> None:
        due = policy.first_due(start)
        pending_stall, saved = 0.0, False
        for step in range(start + 1, start + steps + 1):
            busy = self.now < self.persist_end
            plain = self.t * (1 + self.noise * (self.rng.random() - 0.5))
            self.base += plain
            dt = plain * (self.contention if busy else 1.0) + pending_stall
            self.now += dt
            if self.persist_end <= self.now and self.persist_end > 0:
                policy.observe_persist(self.persist_end - self.saved_at)  # save() call to durable
                self.persist_end = 0.0
            policy.observe_iteration(dt, busy, saved)
            pending_stall, saved = 0.0, False
            if step >= due:
                wait = max(0.0, self.persist_end - self.now)
                if wait > 0:
                    self.waits.append(len(self.checkpoints))
                pending_stall = self.stall + wait
                self.saved_at = self.now
                self.persist_end = self.now + pending_stall + self.persist
                due = policy.next_due(step)
                saved = True
                self.checkpoints.append((step, due - step, policy.figures().get("measured_overhead")))

    def overhead(self) -> float:
        return self.now / self.base - 1


def test_every_n_steps():
    p = EveryNSteps(50)
    assert p.first_due(0) == 50 and p.first_due(120) == 150 and p.next_due(150) == 200
    with pytest.raises(ValueError, match="every_n_steps must be a positive integer, got 0"):
        EveryNSteps(0)


def test_every_seconds_converts_to_steps_from_measured_iterations():
    p = EverySeconds(2.0)
    for _ in range(20):
        p.observe_iteration(0.1, persist_busy=False, checkpointed=False)
    assert p.next_due(100) == 120
    p.observe_iteration(5.0, persist_busy=True, checkpointed=False)  # not clean: ignored
    assert p.next_due(100) == 120


def test_max_interval_takes_the_earlier_trigger():
    p = MaxInterval(EveryNSteps(1000), 3.0)
    for _ in range(20):
        p.observe_iteration(0.1, False, False)
    assert p.next_due(0) == 30
    assert MaxInterval(EveryNSteps(10), 3.0).first_due(0) == 10


@pytest.mark.parametrize("budget", [0.02, 0.035, 0.10])
def test_adaptive_interval_follows_the_rule_and_overhead_stays_in_budget(budget):
    job = SimJob()
    policy = Adaptive(budget)
    job.run(policy, 6000)
    # the rule: cost per checkpoint = stall + slowdown of the iterations beside the persist
    cost = job.stall + (job.persist / job.t) * job.t * (job.contention - 1)
    expected_k = max(math.ceil(cost / (budget * job.t)), math.ceil(job.persist / job.t) + 1)
    assert abs(policy.k - expected_k) <= max(2, 0.1 * expected_k), (policy.k, expected_k)
    assert job.overhead() <= budget + 0.01, job.overhead()
    assert job.waits == []  # persists never queue up behind each other
    assert len(job.checkpoints) >= 6000 / (expected_k * 1.2)


def test_slower_storage_makes_the_interval_grow_until_back_under_budget():
    job = SimJob()
    policy = Adaptive(0.035)
    job.run(policy, 3000)
    k_fast = policy.k
    job.persist *= 4  # the storage becomes 4x slower
    start_ckpt = len(job.checkpoints)
    before = (job.now, job.base)
    job.run(policy, 12000, start=3000)
    after = job.checkpoints[start_ckpt:]
    assert policy.k >= 3 * k_fast
    reacted = next(i for i, (_, k, _) in enumerate(after) if k >= 3 * k_fast)
    assert reacted <= 5  # within a bounded number of checkpoints
    tail = [o for _, _, o in after[reacted + 2:]]
    assert tail and sum(tail) / len(tail) <= 0.035 + 0.01
    assert (job.now - before[0]) / (job.base - before[1]) - 1 <= 0.035 + 0.01


def test_faster_storage_makes_the_interval_shrink_without_oscillating():
    job = SimJob(persist=4.0)
    policy = Adaptive(0.035)
    job.run(policy, 8000)
    k_slow = policy.k
    job.persist = 1.0
    start_ckpt = len(job.checkpoints)
    job.run(policy, 20000, start=8000)
    ks = [k for _, k, _ in job.checkpoints[start_ckpt:]]
    assert policy.k <= k_slow / 2
    direction_changes = sum(1 for a, b, c in zip(ks, ks[1:], ks[2:]) if (b - a) * (c - b) < 0)
    assert direction_changes <= 2, ks
    # only the second checkpoint may wait, before the first persist time is known (start-up)
    assert all(i <= 1 for i in job.waits), job.waits


def test_adaptive_state_survives_a_restart():
    job = SimJob()
    policy = Adaptive(0.035)
    job.run(policy, 3000)
    resumed = Adaptive(0.035)
    resumed.load_state_dict(policy.state_dict())
    assert resumed.first_due(3000) == 3000 + policy.k  # no profiling from scratch
    other = Adaptive(0.1)
    other.load_state_dict(policy.state_dict())
    assert other.first_due(3000) == 3000 + other.clock.warmup + other.profile_steps  # budget changed


def test_adaptive_figures_report_interval_overhead_and_lost_work():
    job = SimJob()
    policy = Adaptive(0.035)
    job.run(policy, 3000)
    f = policy.figures()
    assert f["interval_steps"] == policy.k
    assert f["expected_lost_work_s"] == pytest.approx(policy.k / 2 * f["iteration_s"])
    assert 0 <= f["measured_overhead"] < 0.1


@pytest.mark.parametrize("budget", [0, 1, -0.1, "0.03"])
def test_adaptive_rejects_bad_budgets(budget):
    with pytest.raises(ValueError, match="overhead_budget"):
        Adaptive(budget)


def test_slowdowns_that_no_checkpoint_caused_are_not_charged_to_it():
    """Iterations that stall for reasons of their own (input pipeline, another job, a GC pause)
    are as frequent with or without checkpoints: only the excess of the iterations beside
    checkpoint work counts, measured against the mean clean iteration, so k stays where the
    checkpoint's own cost puts it."""

    @dataclass
    class SpikyJob(SimJob):
        spike_p: float = 0.05
        spike: float = 2.5

        def run(self, policy, steps, start=0):
            rng = random.Random(11)
            real_random = self.rng.random
            # every iteration, busy or not, may be a spike: scale t for that iteration
            base_t = self.t

            def draw():
                self.t = base_t * (self.spike if rng.random() < self.spike_p else 1.0)
                return real_random()

            self.rng.random = draw
            try:
                super().run(policy, steps, start)
            finally:
                self.t = base_t

    budget = 0.035
    plain, spiky = SimJob(), SpikyJob()
    p_plain, p_spiky = Adaptive(budget), Adaptive(budget)
    plain.run(p_plain, 6000)
    spiky.run(p_spiky, 6000)
    # Spikes make the mean iteration 7.5 % longer; charging them to checkpoints would push k far up.
    assert p_spiky.k <= 1.5 * p_plain.k, (p_spiky.k, p_plain.k)
    assert spiky.overhead() <= budget + 0.01
