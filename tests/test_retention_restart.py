"""``keep_last`` holds across restarts: a job SIGKILLed at random instants while it saves with
``keep_last=2``, restarted and saving again, a few rounds; some restarts resume (the newest step + 1),
some start below the earlier incarnation's steps (a job started afresh in the same root, or resumed
from an older checkpoint). After each restart's first commit and its retention at most ``keep_last``
committed checkpoints remain, that commit among them and the highest step committed before it too.

Before the fix, retention ranked the new commit among the earlier ones by step and never removed it:
a restart below the earlier steps kept ``keep_last`` of those beside it, 3 checkpoints for 2.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import pytest
import torch

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import attempt_dirs, manifest_dirs, parse_dir
from ckpt_engine.storage import open_storage
import forkserver
from ranks import lines_of, next_line

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real processes, killed at random instants

WORKER = os.path.join(os.path.dirname(__file__), "retention_worker.py")
KEEP = 2
ROUNDS = [("1", 3), ("resume", 2), ("1", 2), ("resume", 1)]
"""Per incarnation: the first step it saves, and how many later commits it reports before the kill
can land (the SIGKILL then falls at a random instant of the saves that follow)."""


def _committed(root: str) -> list[str]:
    return [d for _, d in manifest_dirs(open_storage(root))]


def test_keep_last_holds_after_restarts_and_random_kills(tmp_path):
    root = str(tmp_path / "ck")
    rng = random.Random(20240611)
    for first, commits in ROUNDS:
        before = _committed(root) if os.path.isdir(root) else []
        proc = forkserver.launch([sys.executable, WORKER, root, first], env=dict(os.environ, KEEP_LAST=str(KEEP)))
        try:
            q = lines_of(proc)
            deadline = time.monotonic() + 60
            _, step, mine, listing = next_line(q, "retained", deadline).split(" ", 3)
            kept = json.loads(listing)
            assert len(kept) <= KEEP, f"restart at step {step} after {before}: {kept} committed, keep_last={KEEP}"
            assert mine in kept, (mine, kept)
            if before:
                highest = max(before, key=lambda d: parse_dir(d))
                assert highest in kept or parse_dir(highest)[0] == int(step), (highest, kept)
            for _ in range(commits):
                next_line(q, "committed", deadline)
            time.sleep(rng.uniform(0.0, 0.05))
        finally:
            proc.kill()
            proc.wait()
    ck = Checkpointer(root, keep_last=KEEP)  # one more restart: leftovers swept, then a commit
    step = max(parse_dir(d)[0] for d in _committed(root)) + 1
    ck.save({"w": torch.zeros(4)}, step)
    ck.close()
    assert len(_committed(root)) == KEEP and set(attempt_dirs(open_storage(root))) == set(_committed(root))
