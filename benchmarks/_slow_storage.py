"""A slower disk for the benchmarks: local storage whose data-file writes take longer, at no CPU cost.

Its own module (only ``ckpt_engine.storage``), so that a fit of ``_lightning_job`` imports it without
charging another contender's imports to its CPU. :data:`SLOW` is process-wide: :func:`throttle` sets it
once, or from the training thread at a given step (``bench_overhead``'s slowed fit).
"""

from __future__ import annotations

import collections.abc
import threading
import time
from typing import Any, Iterator

from ckpt_engine.storage import StorageWrapper

SLOW: dict[str, Any] = {"on": False, "seconds_per_byte": 0.0, "writes": 0, "bytes": 0, "slept_s": 0.0}
"""Switch and rate of :class:`SlowStorage`; ``writes``, ``bytes`` and ``slept_s`` count what it slowed."""
_LOCK = threading.Lock()


def throttle(mb_per_s: float) -> None:
    """From now on every data-file write takes at least ``bytes / (mb_per_s * 1e6)`` seconds in all, the
    real write included (a disk of that rate; this machine's own disk is faster)."""
    SLOW.update(on=True, seconds_per_byte=1.0 / (mb_per_s * 1e6), writes=0, bytes=0, slept_s=0.0)


class SlowStorage(StorageWrapper):
    """Local storage whose data-file writes (``write_stream``) take at least ``bytes * seconds_per_byte``
    once :data:`SLOW` is on: the writing thread sleeps what the real write left of that time. A stream
    (an iterable whose every ``iter()`` is a fresh pass, such as a flush from another level, whose chunks
    are views of one reused buffer) is passed through unchanged and its bytes counted as they pass: a
    list of those views would hold the last chunk only, and the file would be written wrong."""

    def write_stream(self, rel: str, chunks: Any, *, sync_dir: bool = True) -> int:
        if not SLOW["on"]:
            return super().write_stream(rel, chunks, sync_dir=sync_dir)
        start = time.perf_counter()
        if isinstance(chunks, collections.abc.Sequence):
            nbytes = sum(memoryview(c).nbytes for c in chunks)
            written = super().write_stream(rel, chunks, sync_dir=sync_dir)
        else:
            counted = _Counted(chunks)
            written = super().write_stream(rel, counted, sync_dir=sync_dir)
            nbytes = counted.last_pass
        seconds = max(0.0, nbytes * SLOW["seconds_per_byte"] - (time.perf_counter() - start))
        with _LOCK:
            SLOW["writes"], SLOW["bytes"], SLOW["slept_s"] = SLOW["writes"] + 1, SLOW["bytes"] + nbytes, \
                SLOW["slept_s"] + seconds
        time.sleep(seconds)
        return written


class _Counted:
    """A re-iterable stream of chunks, passed through unchanged; ``last_pass``: bytes of the last pass."""

    def __init__(self, chunks: Any) -> None:
        self.chunks, self.last_pass = chunks, 0

    def __iter__(self) -> Iterator[Any]:
        self.last_pass = 0
        for chunk in self.chunks:
            self.last_pass += memoryview(chunk).nbytes
            yield chunk
