"""SIGTERM under several ranks: every rank learns of it at the same optimizer step.

Lightning's own multi-rank SIGTERM path cannot carry a final checkpoint: its signal handler issues a
collective from inside the handler (a broadcast no other rank pairs with: we saw 2 CPU ranks hang
on it with ``strategy="ddp"``), and with ``ddp_spawn`` the exception it raises never reaches a
callback in the ranks (``on_exception`` runs only in the launching process). So with more than one
rank the callback takes the signal over for the duration of training, with the core's :class:`~ckpt_engine.training.preempt.SignalAgreement` (a flag set by the handler, an
asynchronous 4-byte reduction per optimizer step, read a step later) over a one-integer ``MAX``
all-reduce on a gloo group of its own.

With ``ddp_spawn`` the launching process dies at once on a job-wide SIGTERM; the ranks hear of
it as SIGINT (see :func:`stop_agreement`) and go on to the final checkpoint all the same.

The callback then commits a final checkpoint at that step on every rank and raises Lightning's
``SIGTERMException``, so the ranks end the way Lightning ends them on SIGTERM.
"""

from __future__ import annotations

import multiprocessing
import signal
from typing import Callable

import torch
import torch.distributed as dist

from ckpt_engine.training.preempt import SignalAgreement


def stop_agreement() -> SignalAgreement:
    """The agreement for this job's ranks (collective: every rank constructs it at set-up).

    Signals: SIGTERM; in a rank that ``torch.multiprocessing`` spawned (``ddp_spawn``) SIGINT too:
    torch makes the death of the launching process arrive in its ranks as SIGINT
    (``PR_SET_PDEATHSIG``), and a scheduler's SIGTERM to the whole job kills the launcher at once,
    so for the ranks that SIGINT is the same news.
    """
    group = dist.new_group(backend="gloo")

    def reduce(flag: int) -> Callable[[], int]:
        value = torch.tensor([flag], dtype=torch.int32)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group, async_op=True)
        return lambda: (work.wait(), int(value.item()))[1]

    signums = [signal.SIGTERM]
    if multiprocessing.parent_process() is not None:
        signums.append(signal.SIGINT)
    return SignalAgreement(reduce, signums)
