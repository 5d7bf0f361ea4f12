"""How often the engine polls a storage for files that other processes write: the one place.

Two waits poll, both for a file another rank writes:

* ``commit``: rank 0 waits for every rank's index file, and the other ranks for rank 0's
  manifest. It is on the path to ``wait()`` returning (a save's time to durable), so the pauses
  stay short.
* ``flush``: a rank's flusher waits for rank 0's decision about which attempt goes to the next
  level. That copy runs in the background, takes far longer than the wait, and the wait lasts
  as long as rank 0's own level-1 commit, so the pauses may be longer.

Each wait starts with a short pause (the file usually lands within milliseconds of the first
look) and doubles it up to a cap. The cap is the storage's: a local listing is a system call
(cheap, so polled often), an object-store listing is a billed, rate-limited HTTP request taking
tens of milliseconds itself (so polled a few times a second at most). Implementations pick one
:class:`Polling` as their ``polling`` class attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Backoff:
    """Pauses of ``first`` seconds, doubling up to ``cap`` seconds."""

    first: float
    cap: float

    def pauses(self) -> Iterator[float]:
        """The pauses between looks, in order (an endless iterator: one per look that found nothing)."""
        pause = min(self.first, self.cap)
        while True:
            yield pause
            pause = min(pause * 2, self.cap)


@dataclass(frozen=True)
class Polling:
    """The pauses of one kind of storage for each wait that polls it (see the module docstring)."""

    commit: Backoff
    flush: Backoff


LOCAL = Polling(
    # 2 ms: a rank's index file usually lands within a few ms of rank 0's own; 10 ms cap: a local
    # listing costs microseconds, and a commit seen 10 ms late is 10 ms of time to durable lost.
    commit=Backoff(first=0.002, cap=0.01),
    # 5 ms, cap 20 ms: a background copy waiting on rank 0's commit; 50 looks a second at most.
    flush=Backoff(first=0.005, cap=0.02),
)
"""Local and shared POSIX filesystems: a listing is a system call."""

OBJECT_STORE = Polling(
    # 0.1 s cap: every look is a LIST request (billed, throttled per prefix, itself 10-50 ms);
    # 10 a second per waiting rank keeps a large job's polling well under a store's rate limits.
    commit=Backoff(first=0.002, cap=0.1),
    # 0.5 s cap: the background flush to an object store takes seconds; two requests a second.
    flush=Backoff(first=0.005, cap=0.5),
)
"""Object stores and every other fsspec filesystem: a listing is a remote request."""
