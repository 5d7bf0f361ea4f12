"""Crash at any instant: a 2-rank job is SIGKILLed at random instants during snapshot, persist,
commit and retention, then restarted, 20 times on local disk and 10 on S3 (moto: each restart
costs ~10 s of start-up there). Every restart must restore the
newest fully committed checkpoint bit for bit, never a torn one, and sweep the leftovers."""

from __future__ import annotations

import queue
import random
import time

import pytest

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import attempt_dirs, manifest_dirs
from dist_worker import digest, make_state
from ranks import kill_job, lines_of, next_line, start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # processes killed at random instants
KILLS = {"local": 20, "s3": 10}


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_crash_at_any_instant(backend, tmp_path, request):
    if backend == "s3":
        root = f"{request.getfixturevalue('s3_url')}/crash"
    else:
        root = str(tmp_path / "ck")
    rng = random.Random(20211)
    newest_committed, restored_ok = None, 0
    kills = KILLS[backend]
    for trial in range(kills + 1):
        procs = start_ranks(2, ["crashloop", root, str(tmp_path)], {"KEEP_LAST": "2"})
        q = lines_of(procs[0])
        deadline = time.monotonic() + 120
        try:
            if trial > 0:
                restored = next_line(q, "restored", deadline).split()
                assert restored[2] == "ok", f"kill {trial}: restored step {restored[1]} is not what was saved"
                assert int(restored[1]) >= newest_committed, (restored, newest_committed)
                restored_ok += 1
            if trial == kills:
                break
            newest_committed = int(next_line(q, "committed", deadline).split()[1])
            delay = rng.uniform(0.0, 0.25)
            end = time.monotonic() + delay
            while time.monotonic() < end:  # keep track of commits until the kill lands
                try:
                    line = q.get(timeout=max(0.001, end - time.monotonic()))
                    if line.startswith("committed"):
                        newest_committed = int(line.split()[1])
                except queue.Empty:
                    break
        finally:
            kill_job(procs)
    print(f"\ncrash-at-any-instant [{backend}]: {restored_ok}/{kills} restarts restored the newest committed "
          "checkpoint bit for bit")
    assert restored_ok == kills
    ck = Checkpointer(root, keep_last=2)  # a last restart: leftovers swept, only whole checkpoints remain
    latest = ck.latest_step()
    assert digest(ck.load()) == digest(make_state(latest))
    committed = {d for _, d in manifest_dirs(ck.storage)}
    assert set(attempt_dirs(ck.storage)) == committed
    # Kills that land between a commit and its retention leave extra committed checkpoints (retention
    # only runs after a newer commit); the next commit of the job catches up.
    ck.save(make_state(latest + 1), latest + 1)
    ck.close()
    assert len(manifest_dirs(ck.storage)) == 2 and set(attempt_dirs(ck.storage)) == {
        d for _, d in manifest_dirs(ck.storage)}
