"""SIGTERM → one final checkpoint, taken by every rank at the same step.

The agreement is the core's :class:`~ckpt_engine.training.preempt.SignalAgreement` over a Horovod
asynchronous allreduce (sum) of each rank's flag, under one fixed name (Horovod matches operations
by name, and one is in flight at a time); the training session installs it, polls it after every
step and takes the final checkpoint. Afterwards the handler that was installed before is put back
and the signal is raised again (:func:`end_by_sigterm`), so the process ends as it would have
without the hook (on every rank: the job is being preempted).
"""

from __future__ import annotations

import signal
from typing import Callable

import torch

from ckpt_engine.training.preempt import SignalAgreement

from .comm import import_horovod


def agreement(world_size: int, name: str = "ckpt.sigterm") -> SignalAgreement:
    """The SIGTERM agreement of this job's ranks (every rank builds it at set-up; one process
    needs no collective)."""
    if world_size == 1:
        return SignalAgreement(None)
    hvd = import_horovod()

    def reduce(flag: int) -> Callable[[], int]:
        handle = hvd.allreduce_async(torch.tensor([flag], dtype=torch.int32), name=name, op=hvd.Sum)
        return lambda: int(hvd.synchronize(handle).item())

    return SignalAgreement(reduce)


def end_by_sigterm() -> None:
    """Deliver SIGTERM again, under the handler the agreement had replaced (the default one ends
    the process); call after the session's ``stop()`` gave the signal back."""
    signal.raise_signal(signal.SIGTERM)
