"""The figures a ``Checkpointer`` keeps: counters and the records of recent saves and flushes.

One :class:`Tally` per ``Checkpointer``, written by its threads (training, persist, flushers),
read by anyone through ``ck.counters``, ``ck.records`` and ``ck.flush_records``. Components report
through it instead of holding each other's dictionaries; every write takes its lock.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass
class SaveRecord:
    """Figures of one checkpoint on this rank (seconds and bytes).

    Wall seconds: ``stall_s`` (``save()`` on the training thread), ``encode_s`` (encoding and
    layout, part of the stall), ``snapshot_s`` (the copy), ``persist_s`` (checksums and data
    file), ``commit_s`` (rank 0). CPU seconds of the threads
    that did the work (``time.thread_time()`` where it runs): ``encode_cpu_s`` (encoding and
    layout, training thread), ``snapshot_cpu_s`` (the copy: the training thread, or a background
    one when ``deferred``), ``persist_cpu_s`` (the persist thread, plus the hashing thread when
    checksums ran beside the write), ``commit_cpu_s`` (rank 0's persist thread).
    """

    step: int
    dirname: str
    bytes: int
    stall_s: float = 0.0
    snapshot_s: float = 0.0
    persist_s: float = 0.0
    commit_s: float = 0.0
    committed: bool = False
    skipped: bool = False
    started_at: float = 0.0
    finished_at: float = 0.0
    """``time.perf_counter()`` at ``save()`` and when this rank's job ended (after the commit on rank 0)."""
    error: str | None = None
    """Why this save failed on this rank (``None``: it did not)."""
    deferred: bool = False
    """The snapshot copy ran in the background (``save(defer=True)``), not on the training thread."""
    encode_s: float = 0.0
    encode_cpu_s: float = 0.0
    snapshot_cpu_s: float = 0.0
    persist_cpu_s: float = 0.0
    commit_cpu_s: float = 0.0


@dataclass
class FlushRecord:
    """Figures of one checkpoint flushed (or skipped) to one lower level, on this rank (reported to
    the ``Checkpointer``'s ``flush_records`` once done)."""

    step: int
    dirname: str
    level: int
    """Index of the level, 0 being the fast one."""
    bytes: int = 0
    copy_s: float = 0.0
    commit_s: float = 0.0
    durable_s: float = 0.0
    """From ``save()`` to durable on this level (rank 0: committed there)."""
    lag_s: float = 0.0
    """From durable on level 1 to durable on this level."""
    lag_steps: int = 0
    """Newest step durable on level 1 at that moment, minus this step."""
    attempts: int = 0
    committed: bool = False
    skipped: bool = False
    error: str = ""

    def row(self) -> dict[str, Any]:
        """Flat figures for a logger, like ``figures.figure_row`` (level numbered from 1)."""
        return {"step": self.step, "level": self.level + 1, "durable_ms": self.durable_s * 1e3,
                "lag_ms": self.lag_s * 1e3, "lag_steps": self.lag_steps, "copy_ms": self.copy_s * 1e3,
                "commit_ms": self.commit_s * 1e3, "bytes": self.bytes, "attempts": self.attempts,
                "committed": self.committed, "skipped": self.skipped}


KEEP = 1000
"""Records kept of each kind (the newest)."""


class Tally:
    """Counters and records of one ``Checkpointer``; safe to write from any thread.

    Counters: ``saves``, ``skipped``, ``waited_s``, ``committed``, ``failed``, ``disk_full``, and
    the keys a component :meth:`declare` s (the flushers: ``flushed``, ``flush_skipped`` ...).
    ``records`` holds one :class:`SaveRecord` per ``save()`` (appended at the
    save and completed by the persist thread); ``flush_records`` one
    :class:`FlushRecord` per checkpoint and lower level, once done.
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
