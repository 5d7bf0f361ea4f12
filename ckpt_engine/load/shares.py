"""Which thread of a restore reads which run of pieces: a share each, and the others' when done.

A restore reads the pieces it needs on ``read_threads`` threads. Each thread owns a share of
consecutive pieces of about equal bytes (``restore.split_by_bytes``) and reads it from the front,
so that its reads stay sequential in the file (what the kernel's readahead and object stores'
ranged reads are good at). A thread that has read its own share then takes runs from the *back*
of the share with the most bytes left, until nothing is left anywhere.

Why: with fixed shares a thread that started late or ran on a core the host slowed down held the
whole restore up: over 8 warm loads of 1 GiB on 2 threads here, one thread finished 2-35 ms after
the other (150-580 ms in the 2 of 8 loads the host stalled), not by its bytes or pieces but by
its core. The snapshot copy met the same problem (snapshot._Chunks). Reads cannot simply be dealt out
in turn as the copy's chunks are: interleaved runs would make every thread's reads jump through
the file, where now only the runs taken at the end do.

A run is what one ``Reader.read_steps`` call reads: pieces that follow each other in one file
(with their padding), spanning at most the reader's ``run_max`` bytes; a larger piece is a run
of its own. Pure bookkeeping under one lock: no I/O here.
"""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

from ..format.entries import IndexEntry

Job = tuple[int, IndexEntry]
"""A piece to read: the rank whose data file holds it, and its index entry."""


class Shares:
    """The shares of a threaded read (each sorted by file, then offset) and what is left of each.

    :meth:`claim` hands out runs: from the front of the caller's own share, then from the back of
    the share with the most bytes left. Every piece is handed out exactly once; :meth:`stop` makes
    every later claim return ``None`` (a thread failed: the others stop at their current run).
    """

    def __init__(self, shares: Sequence[Sequence[Job]], ends: Mapping[int, Mapping[IndexEntry, int]]) -> None:
        self._shares = [list(s) for s in shares]
        self._ends = ends
        self._front = [0] * len(self._shares)
        self._back = [len(s) for s in self._shares]
        self._left = [sum(e.nbytes for _, e in s) for s in self._shares]
        self._lock = threading.Lock()
        self._stopped = False

    def claim(self, mine: int, run_max: int) -> tuple[int, list[IndexEntry]] | None:
        """The next run for the thread owning share ``mine``, as ``(rank, pieces)``; ``None`` when
        nothing is left (or after :meth:`stop`). ``run_max``: the most bytes a run spans."""
        with self._lock:
            if self._stopped:
                return None
            if self._front[mine] < self._back[mine]:
                return self._from_front(mine, run_max)
            other = max(range(len(self._shares)), key=lambda k: (self._back[k] - self._front[k] > 0, self._left[k]))
            if self._front[other] >= self._back[other]:
                return None
            return self._from_back(other, run_max)

    def stop(self) -> None:
        """No more claims (a thread failed)."""
        with self._lock:
            self._stopped = True

    def _from_front(self, k: int, run_max: int) -> tuple[int, list[IndexEntry]]:
        """Pieces from the front of share ``k`` while each directly follows the last in the same
        file and the run spans at most ``run_max`` bytes (its first piece in any case)."""
        share, i, stop = self._shares[k], self._front[k], self._back[k]
        rank, ends = share[i][0], self._ends[share[i][0]]
        run = [share[i][1]]
        i += 1
        while (i < stop and share[i][0] == rank and ends[run[-1]] == share[i][1].offset
               and ends[share[i][1]] - run[0].offset <= run_max):
            run.append(share[i][1])
            i += 1
        self._front[k] = i
        self._left[k] -= sum(e.nbytes for e in run)
        return rank, run

    def _from_back(self, k: int, run_max: int) -> tuple[int, list[IndexEntry]]:
        """The same from the back of share ``k``: pieces while each directly precedes the first."""
        share, i, start = self._shares[k], self._back[k] - 1, self._front[k]
        rank, ends = share[i][0], self._ends[share[i][0]]
        last = share[i][1]
        backwards = [last]
        while (i > start and share[i - 1][0] == rank and ends[share[i - 1][1]] == backwards[-1].offset
               and ends[last] - share[i - 1][1].offset <= run_max):
            i -= 1
            backwards.append(share[i][1])
        self._back[k] = i
        self._left[k] -= sum(e.nbytes for e in backwards)
        return rank, backwards[::-1]
