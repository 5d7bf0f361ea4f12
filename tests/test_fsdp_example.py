"""``examples/fsdp_train.py`` run as users run it: ``torchrun`` jobs of FSDP2 on 2 gloo CPU ranks.

One uninterrupted job is the reference. Another job is SIGKILLed (every rank, by the example's
``--kill-at-step``, after its checkpoints committed) and the same command resumes it: the final
weights and optimizer state are bit for bit the reference's. A 1-rank job resumes the reference's
last checkpoint: its state at that step is the 2-rank job's, bit for bit, and so is the checkpoint
read whole in this process (no torch.distributed).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_engine import Checkpointer
from helpers import assert_same

pytestmark = [pytest.mark.integration, pytest.mark.slow,  # four torchrun jobs: about a minute
              pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                 reason="torch.distributed with gloo is not available")]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fsdp_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS, EVERY, KILL_AT = 30, 10, 15  # 8 samples per rank and step: all of it inside the first epoch


def torchrun(nproc: int, ck_dir: Path, *args: str, expect_ok: bool = True, timeout: float = 180) -> str:
    """Run the example under ``torchrun --standalone`` and return its output (rank 0 logs)."""
    if shutil.which(str(TORCHRUN)) is None:
        pytest.skip(f"no torchrun next to {sys.executable}")
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", str(EXAMPLE), "--dir", str(ck_dir),
           "--steps", str(STEPS), "--every", str(EVERY), "--batch-size", "8", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun stops its workers (each in its own session) on SIGTERM
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{out[-4000:]}")
    assert (proc.returncode == 0) == expect_ok, f"torchrun exited with {proc.returncode}:\n{out[-4000:]}"
    return out


def committed_steps(ck_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in ck_dir.glob("step-*/manifest.json"))


def final(path: Path) -> dict:
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted 2-rank job: its checkpoint directory and its final full state."""
    base = tmp_path_factory.mktemp("fsdp-reference")
    out = torchrun(2, base / "ck", "--out-weights", str(base / "final.pt"))
    assert "fresh start on 2 rank(s)" in out and f"done: step {STEPS}" in out, out[-4000:]
    assert committed_steps(base / "ck") == [10, 20, 30]
    return base / "ck", final(base / "final.pt")


def test_killed_job_resumed_by_torchrun_ends_with_the_same_bits(reference, tmp_path):
    _, ref = reference
    ck_dir = tmp_path / "ck"
    args = ("--kill-at-step", str(KILL_AT), "--out-weights", str(tmp_path / "final.pt"))
    out = torchrun(2, ck_dir, *args, expect_ok=False)
    assert f"simulated crash: SIGKILL right after step {KILL_AT}" in out, out[-4000:]
    assert committed_steps(ck_dir) == [10] and not (tmp_path / "final.pt").exists()

    out = torchrun(2, ck_dir, *args)  # the same command: it resumes (and does not crash again)
    assert "RESUMED from step 10 on 2 rank(s) (written by 2); epoch 0, 160 samples of it already done" in out, \
        out[-4000:]
    resumed = final(tmp_path / "final.pt")
    assert resumed["step"] == STEPS
    assert_same(resumed, ref)  # weights and AdamW moments, every bit


def test_one_rank_resumes_the_two_rank_checkpoint_with_the_same_state(reference, tmp_path):
    ref_dir, ref = reference
    ck_dir = tmp_path / "ck"
    shutil.copytree(ref_dir, ck_dir)
    out = torchrun(1, ck_dir, "--out-weights", str(tmp_path / "one.pt"))  # resumes at STEPS: no step left
    assert f"RESUMED from step {STEPS} on 1 rank(s) (written by 2)" in out, out[-4000:]
    assert_same(final(tmp_path / "one.pt"), ref)

    with Checkpointer(str(ref_dir), readonly=True) as ck:  # whole tensors, in this process
        whole = ck.load()
    assert_same(whole["model"], ref["model"])
    assert_same(whole["optimizer"]["state"], ref["optimizer"]["state"])
