"""SIGTERM → one final checkpoint, taken by every rank at the same step.

A scheduler may signal one rank, some, or all, at slightly different steps. Agreement costs no
wait: after every step each rank starts a tiny asynchronous allreduce (sum) of its "signal seen"
flag and collects the previous step's result, which has long completed. When the sum is positive,
every rank sees it at the same step (the operations are matched by name, in order) and saves.

The handler only sets a flag; the checkpoint is taken by the training thread. Afterwards the
handler that was installed before is put back and the signal is raised again, so the process
ends as it would have without the hook (on every rank: the job is being preempted).
"""

from __future__ import annotations

import signal
import threading
import warnings
from types import FrameType
from typing import Any

import torch


class PreemptionWatch:
    """Installs a SIGTERM handler (main thread only) and agrees on preemption across ranks."""

    def __init__(self, hvd: Any, world_size: int, name: str, enabled: bool = True) -> None:
        self._hvd, self._world, self._name = hvd, world_size, name
        self.received = False
        self._handle: Any = None
        self._previous: Any = None
        self.installed = False
        if not enabled:
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("horovod_ckpt: not in the main thread, so no SIGTERM handler (no preemption checkpoint)",
                          stacklevel=3)
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self.installed = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def agreed(self) -> bool:
        """Call after every step on every rank: whether any rank has seen SIGTERM (the same
        answer on every rank at the same step, one step after the first rank saw it)."""
        if not self.installed:
            return False
        if self._world == 1:
            return self.received
        seen = False
        if self._handle is not None:
            seen = int(self._hvd.synchronize(self._handle).item()) > 0
            self._handle = None
        if not seen:
            flag = torch.tensor([int(self.received)], dtype=torch.int32)
            self._handle = self._hvd.allreduce_async(flag, name=self._name, op=self._hvd.Sum)
        return seen

    def finish(self) -> None:
        """Collect the operation still in flight (every rank, at the same point)."""
        if self._handle is not None:
            self._hvd.synchronize(self._handle)
            self._handle = None

    def uninstall(self) -> None:
        """Put the previous SIGTERM handler back."""
        if self.installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self.installed = False

    def reraise(self) -> None:
        """Deliver SIGTERM again under the previous handler (the default one ends the process)."""
        self.uninstall()
        signal.raise_signal(signal.SIGTERM)
