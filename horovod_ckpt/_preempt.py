"""SIGTERM → one final checkpoint, taken by every rank at the same step.

The agreement is the core's :class:`~ckpt_engine.training.preempt.SignalAgreement` over a Horovod
asynchronous allreduce (sum) of each rank's flag, under one fixed name (Horovod matches operations
by name, and one is in flight at a time). Afterwards the handler that was installed before is put
back and the signal is raised again, so the process ends as it would have without the hook (on
every rank: the job is being preempted).
"""

from __future__ import annotations

import signal
from typing import Any, Callable

import torch

from ckpt_engine.training.preempt import SignalAgreement


class PreemptionWatch(SignalAgreement):
    """Installs a SIGTERM handler (main thread only) and agrees on preemption across ranks."""

    def __init__(self, hvd: Any, world_size: int, name: str, enabled: bool = True) -> None:
        def reduce(flag: int) -> Callable[[], int]:
            handle = hvd.allreduce_async(torch.tensor([flag], dtype=torch.int32), name=name, op=hvd.Sum)
            return lambda: int(hvd.synchronize(handle).item())

        super().__init__(reduce if world_size > 1 else None)
        if enabled:
            self.install()

    def agreed(self) -> bool:
        """Call after every step on every rank: whether any rank has seen SIGTERM (the same
        answer on every rank at the same step, one step after the first rank saw it)."""
        return self.poll()

    def reraise(self) -> None:
        """Deliver SIGTERM again under the previous handler (the default one ends the process)."""
        self.uninstall()
        signal.raise_signal(signal.SIGTERM)
