"""Per-checkpoint figures as the front ends report them: one flat row per finished save.

A row holds the save's own figures (stall, snapshot, persist, commit ms, bytes, GB/s, committed,
skipped) and the policy's (interval, measured overhead, expected lost work...). Rank 0 appends it
to ``figures.jsonl`` beside the checkpoints on a local root; object stores have no append, so there
each row is one ``figures/step-*.json`` object.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping

from .persist import SaveRecord
from .storage import Storage


def figure_row(rec: SaveRecord, policy_figures: Mapping[str, Any]) -> dict[str, Any]:
    """The row of one finished (committed, failed or skipped) save."""
    return {"step": rec.step, "stall_ms": rec.stall_s * 1e3, "snapshot_ms": rec.snapshot_s * 1e3,
            "persist_ms": rec.persist_s * 1e3, "commit_ms": rec.commit_s * 1e3, "bytes": rec.bytes,
            "gb_per_s": rec.bytes / rec.persist_s / 1e9 if rec.persist_s else 0.0,
            "committed": rec.committed, "skipped": rec.skipped, "time": time.time(),
            **{k: v for k, v in policy_figures.items() if not (isinstance(v, float) and math.isnan(v))}}


def write_figure_row(storage: Storage, row: Mapping[str, Any]) -> None:
    """Append ``row`` to ``figures.jsonl`` (local roots) or write ``figures/step-*.json``."""
    line = json.dumps(dict(row)).encode() + b"\n"
    if storage.local:
        with open(os.path.join(storage.root, "figures.jsonl"), "ab") as f:
            f.write(line)
    else:
        storage.write_atomic(f"figures/step-{row['step']:012d}.json", line)
