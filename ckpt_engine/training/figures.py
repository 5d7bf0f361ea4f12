"""Per-checkpoint figures as the front ends report them: one flat row per finished save.

A row holds the save's own figures (stall, snapshot, persist, commit ms, bytes, GB/s, committed,
skipped; the CPU ms of each phase on the thread that ran it; ``train_cpu_ms``, the CPU the training
thread spent on the checkpoint: the front end's capture, encoding and its part of the copy) and the
policy's (interval, measured overhead, expected lost work...). Rank 0 appends it to ``figures.jsonl``
beside the checkpoints on a local root; object stores have no append, so there each row is one
``figures/step-*.json`` object.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Mapping

from ..save.tally import SaveRecord
from ..storage import Storage


def figure_row(rec: SaveRecord, policy_figures: Mapping[str, Any],
               train_cpu_s: float = math.nan) -> dict[str, Any]:
    """The row of one finished (committed, failed or skipped) save; ``error`` says why it failed.
    ``train_cpu_s``: the training thread's CPU seconds for it (``time.thread_time()`` around the
    capture and ``Checkpointer.save``; unknown: left out of the row)."""
    return {"step": rec.step, "stall_ms": rec.stall_s * 1e3, "snapshot_ms": rec.snapshot_s * 1e3,
            "persist_ms": rec.persist_s * 1e3, "commit_ms": rec.commit_s * 1e3, "bytes": rec.bytes,
            "gb_per_s": rec.bytes / rec.persist_s / 1e9 if rec.persist_s else 0.0,
            "committed": rec.committed, "skipped": rec.skipped, "error": rec.error, "time": time.time(),
            "deferred": rec.deferred, "encode_ms": rec.encode_s * 1e3, "encode_cpu_ms": rec.encode_cpu_s * 1e3,
            "snapshot_cpu_ms": rec.snapshot_cpu_s * 1e3, "persist_cpu_ms": rec.persist_cpu_s * 1e3,
            "commit_cpu_ms": rec.commit_cpu_s * 1e3,
            **({} if math.isnan(train_cpu_s) else {"train_cpu_ms": train_cpu_s * 1e3}),
            **{k: v for k, v in policy_figures.items() if not (isinstance(v, float) and math.isnan(v))}}


def write_figure_row(storage: Storage, row: Mapping[str, Any]) -> None:
    """Append ``row`` to ``figures.jsonl`` (local roots) or write ``figures/step-*.json`` (a flush
    row: ``figures/step-*-level-*.json``)."""
    line = json.dumps(dict(row)).encode() + b"\n"
    if storage.can_append:
        storage.append("figures.jsonl", line)
    else:
        level = f"-level-{row['level']}" if row.get("kind") == "flush" else ""
        storage.write_atomic(f"figures/step-{row['step']:012d}{level}.json", line)


class FigureReporter:
    """Rank 0's bookkeeping of the figures a front end still has to report.

    ``track`` each save record after ``Checkpointer.save`` (with the training thread's CPU
    seconds for it, when measured); ``collect`` (after every step, cheap
    when nothing finished) returns the rows of saves that finished since the last call, and of
    flushes to lower levels (``"kind": "flush"``), each already written beside the checkpoints.
    """

    def __init__(self, ck: Any, policy: Any) -> None:
        self.ck, self.policy = ck, policy
        self._saves: list[tuple[SaveRecord, float]] = []
        self._flushes_seen: set[int] = set()

    def track(self, rec: SaveRecord, train_cpu_s: float = math.nan) -> None:
        """Report ``rec`` once its save finished (committed, failed or skipped); ``train_cpu_s``:
        the training thread's CPU seconds for it (the row's ``train_cpu_ms``)."""
        self._saves.append((rec, train_cpu_s))

    def collect(self) -> list[dict[str, Any]]:
        """Rows of what finished since the last call, written to ``figures.jsonl`` (or objects)."""
        rows: list[dict[str, Any]] = []
        done = [(r, cpu) for r, cpu in self._saves if r.finished_at or r.skipped]
        if done:
            self._saves = [(r, cpu) for r, cpu in self._saves if not (r.finished_at or r.skipped)]
            figures = self.policy.figures()
            rows += [{"kind": "save", **figure_row(rec, figures, cpu)} for rec, cpu in done]
        flushes = list(self.ck.flush_records)
        current = {id(f) for f in flushes}
        self._flushes_seen &= current
        for f in flushes:
            if id(f) not in self._flushes_seen and (f.committed or f.skipped or f.error):
                self._flushes_seen.add(id(f))
                rows.append({"kind": "flush", **f.row(), "time": time.time()})
        for row in rows:
            write_figure_row(self.ck.record_storage, row)
        return rows
