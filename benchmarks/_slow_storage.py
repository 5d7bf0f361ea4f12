"""A slower disk for the benchmarks: local storage whose data-file writes take longer, at no CPU cost.

Its own module (no Lightning, no ``lightning_ckpt``: only ``ckpt_engine.storage``), so that a fit of
``_lightning_job`` imports it without charging another contender's imports to its CPU.

:data:`SLOW` is process-wide: a fit on a disk of a fixed rate sets it once with :func:`throttle`;
``bench_overhead``'s slowed fit calls :func:`throttle` from the training thread at a given step.
"""

from __future__ import annotations

import collections.abc
import threading
import time
from typing import Any, Iterator

from ckpt_engine.storage import Storage

SLOW: dict[str, Any] = {"on": False, "sleep_s": 0.0, "seconds_per_byte": 0.0, "pace": False, "writes": 0,
                        "bytes": 0, "slept_s": 0.0}
"""Switch and settings of :class:`SlowStorage`; ``writes``, ``bytes`` and ``slept_s`` count what it slowed.
``pace``: sleep only what the real write left of its time (a disk of that rate), else all of it on top."""
_LOCK = threading.Lock()


def throttle(mb_per_s: float) -> None:
    """From now on every data-file write takes at least ``bytes / (mb_per_s * 1e6)`` seconds in all,
    the real write included (a disk of that rate; this machine's own disk is faster)."""
    SLOW.update(on=True, sleep_s=0.0, seconds_per_byte=1.0 / (mb_per_s * 1e6), pace=True, writes=0, bytes=0,
                slept_s=0.0)


class SlowStorage(Storage):
    """Local storage whose data-file writes (``write_stream``) take ``sleep_s + bytes *
    seconds_per_byte`` longer once :data:`SLOW` is on (``pace``: at least that long in all), a
    slower disk or network for the writing thread at no CPU cost.

    Without ``pace`` a sequence of chunks is slept for before the write. A stream (an iterable
    whose every ``iter()`` is a fresh pass, such as a flush from another level, whose chunks are
    views of one reused buffer) is never materialized (a list of those views would hold the last
    chunk only, and the file would be written wrong): its bytes are counted as they pass and slept
    for after the write.
    """

    def write_stream(self, rel: str, chunks: Any, *, sync_dir: bool = True) -> int:
        if not SLOW["on"]:
            return super().write_stream(rel, chunks, sync_dir=sync_dir)
        start = time.perf_counter()
        if isinstance(chunks, collections.abc.Sequence):  # kept a sequence: the same write path as unthrottled
            nbytes = sum(memoryview(c).nbytes for c in chunks)
            if not SLOW["pace"]:
                _sleep_for(nbytes, 0.0)
                return super().write_stream(rel, chunks, sync_dir=sync_dir)
            written = super().write_stream(rel, chunks, sync_dir=sync_dir)
        else:
            counted = _Counted(chunks)
            written = super().write_stream(rel, counted, sync_dir=sync_dir)
            nbytes = counted.last_pass
        _sleep_for(nbytes, time.perf_counter() - start if SLOW["pace"] else 0.0)
        return written


def _sleep_for(nbytes: int, spent_s: float) -> None:
    """Sleep for ``nbytes`` at :data:`SLOW`'s rate, less ``spent_s`` already spent writing them."""
    seconds = max(0.0, SLOW["sleep_s"] + nbytes * SLOW["seconds_per_byte"] - spent_s)
    with _LOCK:
        SLOW["writes"] += 1
        SLOW["bytes"] += nbytes
        SLOW["slept_s"] += seconds
    time.sleep(seconds)


class _Counted:
    """A re-iterable stream of chunks, passed through unchanged; ``last_pass``: bytes of the last pass."""

    def __init__(self, chunks: Any) -> None:
        self.chunks, self.last_pass = chunks, 0

    def __iter__(self) -> Iterator[Any]:
        self.last_pass = 0
        for chunk in self.chunks:
            self.last_pass += memoryview(chunk).nbytes
            yield chunk
