"""The figures a ``Checkpointer`` keeps: counters and the records of recent saves and flushes.

One :class:`Tally` per ``Checkpointer``, written by its threads (training, persist, flushers),
read by anyone through ``ck.counters``, ``ck.records`` and ``ck.flush_records``. Components report
through it instead of holding each other's dictionaries; every write takes its lock.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .levels.flush import FlushRecord
    from .persist import SaveRecord

KEEP = 1000
"""Records kept of each kind (the newest)."""


class Tally:
    """Counters and records of one ``Checkpointer``; safe to write from any thread.

    Counters: ``saves``, ``skipped``, ``waited_s``, ``committed``, ``failed``, ``disk_full``, and
    the keys a component :meth:`declare` s (the flushers: ``flushed``, ``flush_skipped`` ...).
    ``records`` holds one :class:`~ckpt_engine.persist.SaveRecord` per ``save()`` (appended at the
    save and completed by the persist thread); ``flush_records`` one
    :class:`~ckpt_engine.levels.flush.FlushRecord` per checkpoint and lower level, once done.
    """

    def __init__(self) -> None:
        self.counters: dict[str, float] = {"saves": 0, "skipped": 0, "waited_s": 0.0, "committed": 0, "failed": 0,
                                           "disk_full": 0}
        self.records: deque[SaveRecord] = deque(maxlen=KEEP)
        self.flush_records: deque[FlushRecord] = deque(maxlen=KEEP)
        self._lock = threading.Lock()

    def declare(self, keys: Iterable[str]) -> None:
        """Make ``keys`` counters starting at 0 (so that readers find them before the first count)."""
        with self._lock:
            for key in keys:
                self.counters.setdefault(key, 0)

    def count(self, key: str, n: float = 1) -> None:
        """Add ``n`` to counter ``key``."""
        with self._lock:
            self.counters[key] = self.counters.get(key, 0) + n

    def saved(self, record: SaveRecord) -> None:
        """A ``save()`` took place (its record is completed later, in place)."""
        with self._lock:
            self.records.append(record)

    def flushed(self, record: FlushRecord) -> None:
        """A checkpoint was flushed to (or skipped for, or failed on) a lower level."""
        with self._lock:
            self.flush_records.append(record)
