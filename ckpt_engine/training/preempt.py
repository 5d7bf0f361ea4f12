"""Preemption: every rank learns of a signal at the same step, and nothing waits for it.

A scheduler may signal one rank, some, or all, at slightly different steps. The handler only sets
a flag (nothing else is safe inside a signal handler); after every step each rank starts a tiny
asynchronous reduction of its flag and collects the previous step's, long finished by then. All
ranks issue the same reductions in the same order, so they read the same value at the same step:
a signal that reached any rank during step ``s`` is agreed on at step ``s + 1`` (or ``s + 2``),
everywhere at once, for a 4-byte background collective per step. The front end then takes its
final checkpoint on the training thread and ends the run its framework's way.

The collective is the front end's (``torch.distributed``, Horovod): it passes a :data:`Reduce`.
"""

from __future__ import annotations

import signal
import threading
import warnings
from types import FrameType
from typing import Any, Callable, Sequence

Reduce = Callable[[int], Callable[[], int]]
"""Starts an asynchronous sum or max of this rank's flag over all ranks; the returned call waits
for it and gives the result."""


class SignalAgreement:
    """A per-rank signal flag, agreed on by all ranks at the same step (see the module doc).

    ``reduce``: the front end's asynchronous reduction; ``None`` for a single process, where the
    flag itself is the answer. ``signals``: what counts as a preemption notice.
    """

    def __init__(self, reduce: Reduce | None, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        self.received = False
        self._reduce = reduce
        self._signals = tuple(signals)
        self._pending: Callable[[], int] | None = None
        self._previous: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        """Whether the handlers are in place (between :meth:`install` and :meth:`uninstall`)."""
        return bool(self._previous)

    def install(self) -> bool:
        """Take the signals over; only the main thread can (elsewhere: a warning and ``False``)."""
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("not in the main thread, so no signal handler: no preemption checkpoint", stacklevel=3)
            return False
        self._previous = {s: signal.signal(s, self._on_signal) for s in self._signals}
        return True

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had before :meth:`install`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def poll(self) -> bool:
        """Call after every step on every rank: whether any rank has been signalled.

        Returns the previous call's reduction and starts the next one (none once agreed).
        """
        if not self.installed:
            return False
        if self._reduce is None:
            return self.received
        agreed = False
        if self._pending is not None:
            agreed = self._pending() > 0
            self._pending = None
        if not agreed:
            self._pending = self._reduce(int(self.received))
        return agreed

    def finish(self) -> None:
        """Collect the reduction still in flight (every rank reaches this together)."""
        if self._pending is not None:
            self._pending()
            self._pending = None
