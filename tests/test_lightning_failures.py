"""The Lightning callback with a real Trainer on CPU when the job ends badly: SIGTERM on one and two
ranks commits a final checkpoint, an exception right after a checkpoint still commits it, a damaged
newest checkpoint is skipped, and a resume names what the dead run left behind."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import committed
import forkserver
from helpers import flip_local, proc_stat
import lightning_jobs
from lightning_jobs import WORKER, assert_bitwise, final, run, seen

flavour = lightning_jobs.flavour  # autouse: the unified lightning distribution
each_distribution = lightning_jobs.each_distribution
uninterrupted = lightning_jobs.uninterrupted  # the reference runs, shared by the modules of the session

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real training jobs, killed and resumed


def test_sigterm_mid_epoch_commits_a_final_checkpoint_and_resume_continues(tmp_path, each_distribution):
    """One rank, under both distributions (the run ends with the distribution's own SIGTERMException): see the
    README for why Lightning's multi-rank SIGTERM path cannot carry it."""
    ref = tmp_path / "ref"
    run(ref, ref / "ck", "--devices", "1", "--tag", "ref")
    ck = tmp_path / "ck"
    proc = run(tmp_path, ck, "--devices", "1", "--sigterm-at", "22", "--tag", "term", expect_rc=None)
    assert "Received SIGTERM" in proc.stderr + proc.stdout  # and exits as Lightning makes it exit
    assert not (tmp_path / "final-term.pt").exists()  # training stopped at the signal
    steps = Checkpointer(str(ck)).steps()
    assert steps[-1] == 22, steps  # the current step, not the last periodic one (20)
    run(tmp_path, ck, "--devices", "1", "--tag", "after")
    assert json.load(open(tmp_path / "resumed-after.json"))["resumed_from"] == 22
    assert_bitwise(final(ref, "ref"), final(tmp_path, "after"))


def _wait_for_session_to_end(sid: int, timeout: float = 120.0) -> None:
    """Wait until no live process of session ``sid`` is left (zombies do not count)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in filter(str.isdigit, os.listdir("/proc"))
                 if (fields := proc_stat(pid)) and int(fields[3]) == sid and fields[0] != "Z"]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes of session {sid} still running after {timeout} s")


def test_sigterm_to_a_two_rank_ddp_spawn_job_commits_a_final_checkpoint_and_resume_continues(uninterrupted, tmp_path):
    """SIGTERM to every process of the job (as schedulers send it) at step 22: the launcher dies at
    once, the two ranks agree on a step within two steps, commit there and stop."""
    ck = tmp_path / "ck"
    out = tmp_path
    out.mkdir(exist_ok=True)
    proc = forkserver.launch([sys.executable, WORKER, str(out), str(ck), "--sigterm-at", "22", "--tag", "term"])
    log = proc.communicate(timeout=300)[0]
    _wait_for_session_to_end(proc.pid)
    assert not (tmp_path / "final-term.pt").exists(), log[-3000:]  # training stopped at the signal
    steps = Checkpointer(str(ck)).steps()
    assert steps[-1] in (23, 24), (steps, log[-3000:])  # not the last periodic one (20)
    entry = committed(Checkpointer(str(ck)).storage)[-1]
    assert entry.manifest.world_size == 2
    run(tmp_path, ck, "--tag", "after")
    assert json.load(open(tmp_path / "resumed-after.json"))["resumed_from"] == steps[-1]
    assert_bitwise(final(uninterrupted[0], "ref"), final(tmp_path, "after"))
    for rank in (0, 1):  # the interrupted epoch (steps 17..32): every sample once, in the reference order
        before = [r for r in seen(tmp_path, "term", rank) if r["epoch"] == 1 and r["step"] <= steps[-1]]
        after = [r for r in seen(tmp_path, "after", rank) if r["epoch"] == 1]
        ids = [i for r in before + after for i in r["ids"]]
        assert ids == [i for r in seen(uninterrupted[0], "ref", rank) if r["epoch"] == 1 for i in r["ids"]]


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp"])
def test_an_exception_right_after_a_checkpoint_still_commits_it(tmp_path, strategy):
    """Every rank raises right after the step-10 checkpoint started: fit() ends only once it is committed."""
    ck = tmp_path / "ck"
    proc = run(tmp_path, ck, "--strategy", strategy, "--raise-at", "10", "--tag", "raised", expect_rc=None)
    assert proc.returncode != 0 and "injected failure at step 10" in proc.stdout + proc.stderr
    assert Checkpointer(str(ck)).latest_step() == 10, proc.stderr[-3000:]
    entry = committed(Checkpointer(str(ck)).storage)[-1]
    assert entry.manifest.world_size == 2


def test_resume_falls_back_past_a_checkpoint_whose_per_rank_section_is_damaged(tmp_path):
    """Rank 1's per-rank section of the newest checkpoint is damaged: both ranks resume from the one before."""
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--max-steps", "20", "--tag", "first")
    newest = sorted(p for p in os.listdir(ck) if p.startswith("step-000000000020"))[-1]
    flip_local(str(ck), newest, 1)
    proc = run(tmp_path, ck, "--max-steps", "24", "--tag", "again")
    assert json.load(open(tmp_path / "resumed-again.json"))["resumed_from"] == 15, proc.stderr[-3000:]


def test_resume_names_the_dead_runs_newer_lightning_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--lightning-last", "7", "--kill-at", "23", "--tag", "killed", expect_rc=None)
    proc = run(tmp_path, ck, "--lightning-last", "7", "--max-steps", "24", "--tag", "auto")
    assert json.load(open(tmp_path / "resumed-auto.json"))["resumed_from"] in (15, 20)  # last.ckpt: step 21
    log = proc.stdout + proc.stderr
    assert "written after it by the interrupted run stay in place" in log and "last.ckpt" in log, log[-3000:]
