"""The decision loop shared by the front ends: time iterations, ask the policy, agree on all ranks.

Order of calls, on every rank, from the training thread::

    sched = Schedule(policy, ck)           # ck: the job's Checkpointer (its comm is used)
    for step in ...:                       # after every real optimizer step:
        if sched.should_save(step):        # collective only on the first call
            ck.save(state, step, local)
            sched.saved(step)              # collective: rank 0's policy picks the next due step

Rank 0's policy decides; the step it picks is broadcast once per checkpoint, so all ranks save at
the same steps (invariant 7) and no rank's local timings can split the decision.
"""

from __future__ import annotations

import time
from typing import Callable

from ..checkpointer import Checkpointer
from ..save.tally import SaveRecord
from .policy import Policy


class Schedule:
    """Feeds ``policy`` with this job's timings and keeps every rank's decision identical."""

    def __init__(self, policy: Policy, ck: Checkpointer,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.policy, self.ck, self.clock = policy, ck, clock
        self.due: int | None = None
        self._last: float | None = None
        self._saved_last = False
        self._busy_seen = False
        self._pending: list[SaveRecord] = []

    def should_save(self, step: int) -> bool:
        """Call after every optimizer step on every rank: whether to checkpoint now."""
        now = self.clock()
        busy = self.ck.busy()
        if self._last is not None and self.ck.rank == 0:
            self.policy.observe_iteration(now - self._last, busy or self._busy_seen, self._saved_last)
            self._observe_persists()
        self._last, self._saved_last, self._busy_seen = now, False, busy
        if self.due is None:
            self.due = self._agree(lambda: self.policy.first_due(step))
        return step >= self.due

    def saved(self, step: int) -> None:
        """Call right after ``ck.save(...)`` for ``step``, on every rank."""
        self._saved_last = True
        self._busy_seen = True
        if self.ck.records and self.ck.records[-1].step == step:
            self._pending.append(self.ck.records[-1])
        self.due = self._agree(lambda: self.policy.next_due(step))

    def restart_clock(self) -> None:
        """Forget the running iteration timer (after validation, a pause, a restore)."""
        self._last = None

    def _agree(self, decide: Callable[[], int]) -> int:
        return int(self.ck.comm.broadcast(decide() if self.ck.rank == 0 else None))

    def _observe_persists(self) -> None:
        for rec in [r for r in self._pending if r.finished_at]:
            if not rec.skipped:
                self.policy.observe_persist(rec.finished_at - rec.started_at)
        self._pending = [r for r in self._pending if not r.finished_at]
