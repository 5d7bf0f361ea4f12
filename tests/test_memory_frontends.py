"""The node-memory level under the front ends, as users run them: a Lightning DDP job on 2 simulated
nodes x 2 ranks loses a node (every rank SIGKILLed, node 1's memory deleted) and resumes from the
memory node 0 holds, ending bit-identical to an uninterrupted run; the same for the Horovod hook
(``examples/horovod_train.py`` under ``horovodrun`` on two "hosts" of this machine)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from helpers import assert_same  # noqa: E402
from ranks import kill_tree, start_ranks, torchrun_env, torchrun_nodes  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LIGHTNING_WORKER = os.path.join(os.path.dirname(__file__), "lightning_worker.py")


def _lightning_ranks(out, ckpt, mem, nodes: int, per_node: int, *args: str, tag: str) -> list:
    """``nodes * per_node`` ranks of lightning_worker.py launched as torchrun launches them:
    ``Trainer(num_nodes=nodes, devices=per_node, strategy="ddp")``, rank ``r`` on node ``r // per_node``
    (``GROUP_RANK``: read by Lightning and by the memory level)."""
    env = torchrun_env(nodes, per_node)
    return start_ranks(nodes * per_node, [str(out), str(ckpt), "--devices", str(per_node), "--nodes", str(nodes),
                                          "--strategy", "ddp", "--memory", str(mem), "--tag", tag, "--every", "3",
                                          *args], worker=LIGHTNING_WORKER, rank_env=env)


def _finish(procs, timeout: float = 300) -> None:
    for p in procs:
        output, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, output[-6000:]


def _kill_lose_node_1_and_resume(tmp_path, run, nodes: int, per_node: int, *resume_args: str) -> dict:
    """Kill the job after rank 0 committed step 20 in memory (every rank SIGKILLed, nothing closed),
    delete node 1's memory (a replaced node), start it again; what rank 0 resumed from.
    ``resume_args`` go to both jobs (``--dump-restored`` acts in the resumed one only)."""
    procs = _lightning_ranks(run, tmp_path / "ck", tmp_path / "mem", nodes, per_node, "--max-steps", "30",
                             "--kill-at", "20", *resume_args, tag="run")
    try:
        out0, _ = procs[0].communicate(timeout=300)
        assert procs[0].returncode == -signal.SIGKILL, out0[-6000:]
    finally:
        for p in procs[1:]:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    shutil.rmtree(tmp_path / "mem" / "run" / "node-1")
    _finish(_lightning_ranks(run, tmp_path / "ck", tmp_path / "mem", nodes, per_node, "--max-steps", "30",
                             *resume_args, tag="run"))
    resumed = json.loads((run / "resumed-run.json").read_text())
    assert resumed["restores"] == 1 and resumed["global_step"] == 30
    assert resumed["resumed_level"] == 0 and 15 <= resumed["resumed_from"] <= 21, resumed  # from memory
    return resumed


def _same(a: dict, b: dict) -> None:
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for i, st in a["optimizer"]["state"].items():
        for name, value in st.items():
            assert torch.equal(value, b["optimizer"]["state"][i][name]), (i, name)


def test_lightning_ddp_on_two_nodes_resumes_a_lost_node_from_memory_bit_identical(tmp_path):
    """2 nodes x 1 rank: the resumed run ends bit-identical to an uninterrupted one."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    for d in (ref, run):
        d.mkdir()
    _finish(_lightning_ranks(ref, tmp_path / "ck-ref", tmp_path / "mem", 2, 1, "--max-steps", "30", tag="ref"))
    assert not (tmp_path / "mem" / "ref").exists()  # a job that ended released its memory
    _kill_lose_node_1_and_resume(tmp_path, run, 2, 1)
    _same(torch.load(ref / "final-ref.pt"), torch.load(run / "final-run.pt"))
    assert not (tmp_path / "mem" / "run").exists()


def test_lightning_ddp_two_nodes_of_two_ranks_resume_a_lost_node_from_memory_bit_identical(tmp_path):
    """2 nodes x 2 ranks: the state restored from memory (node 1's parts from node 0's replicas) is
    the uninterrupted run's at that step, and the run ends bit-identical to it, under plain ``ddp``
    with its defaults (the callback replays DDP's gradient bucket order: test_ddp_exact.py)."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    for d in (ref, run):
        d.mkdir()
    resumed = _kill_lose_node_1_and_resume(tmp_path, run, 2, 2, "--dump-restored")
    _finish(_lightning_ranks(ref, tmp_path / "ck-ref", tmp_path / "mem", 2, 2, "--max-steps", "30",
                             tag="ref"))
    _same(torch.load(ref / "final-ref.pt"), torch.load(run / "final-run.pt"))
    restored = torch.load(run / "restored-run.pt")
    assert restored["step"] == resumed["resumed_from"]


# ---- Horovod: examples/horovod_train.py under horovodrun, two hosts on this machine -----------------
ROOT = Path(__file__).resolve().parent.parent
HOROVOD_EXAMPLE = ROOT / "examples" / "horovod_train.py"
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


def _horovodrun(*args: str) -> subprocess.Popen:
    """The example on 2 ranks on two "hosts" (localhost and 127.0.0.1: two nodes to Horovod,
    ``HOROVOD_CROSS_RANK`` 0 and 1), in a new session."""
    cmd = [str(HOROVODRUN), "-np", "2", "-H", "localhost:1,127.0.0.1:1", "--gloo", "--network-interface", "lo",
           sys.executable, str(HOROVOD_EXAMPLE), *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)


def _steps_done(log: Path) -> int:
    try:
        lines = (log / "rank-0.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(line)["step"] for line in lines[:-1]), default=0)  # the last line may be torn


def _memory_steps(mem: Path, node: int, writer: int) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in
                  (mem / "hvd" / f"node-{node}" / f"rank-{writer:05d}").glob("step-*/rank-commit.json"))


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="horovod is not installed")
def test_horovod_hook_resumes_a_lost_node_and_a_lost_disk_from_the_other_nodes_memory_bit_identical(tmp_path):
    """2 hosts x 1 rank; every process SIGKILLed mid-epoch, node 1's memory and the whole disk level
    deleted: the only copy left is node 0's memory (its own part and node 1's replica)."""
    config = tmp_path / "ckpt.yaml"  # the example's file, with this test's places
    config.write_text((ROOT / "examples" / "horovod_ckpt_memory.yaml").read_text()
                      .replace("path: /dev/shm/ckpt-suite,", f"path: {tmp_path / 'mem'}, job: hvd,")
                      .replace("/tmp/hvd-ck", str(tmp_path / "ck")).replace("every_n_train_steps: 2", "every_n_train_steps: 5"))
    ref, run = tmp_path / "ref", tmp_path / "run"
    for d in (ref, ref / "log", run, run / "log"):
        d.mkdir()
    (tmp_path / "ref.yaml").write_text(config.read_text().replace("/ck", "/ck-ref").replace("job: hvd", "job: ref"))
    done = _horovodrun("--ckpt-config", str(tmp_path / "ref.yaml"), "--sample-log", str(ref / "log"),
                       "--out", str(ref / "out"))
    out, _ = done.communicate(timeout=240)
    assert done.returncode == 0 and "done at step 32" in out, out[-4000:]
    assert not (tmp_path / "mem" / "ref").exists()  # the job ended: its memory released
    rows = [json.loads(line) for line in (tmp_path / "ck-ref" / "figures.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"save", "flush"}  # beside the checkpoints that outlive the job

    job = _horovodrun("--ckpt-config", str(config), "--sample-log", str(run / "log"), "--out", str(run / "out"),
                      "--step-delay", "0.1")
    deadline = time.monotonic() + 180
    while not (_steps_done(run / "log") >= 21 and 20 in _memory_steps(tmp_path / "mem", 0, 1)):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-4000:]
        time.sleep(0.05)
    kill_tree(job)
    shutil.rmtree(tmp_path / "mem" / "hvd" / "node-1")
    shutil.rmtree(tmp_path / "ck")
    again = _horovodrun("--ckpt-config", str(config), "--sample-log", str(run / "log"), "--out", str(run / "out"))
    out, _ = again.communicate(timeout=240)
    assert again.returncode == 0 and "done at step 32" in out, out[-4000:]
    resumed = int(out.split("resumed from step ")[1].split(",")[0])
    assert resumed >= 20, out[-4000:]
    for rank in (0, 1):
        a = torch.load(ref / "out" / f"final-rank{rank}.pt", weights_only=False)
        b = torch.load(run / "out" / f"final-rank{rank}.pt", weights_only=False)
        assert_same(a, b)


# ---- the core: examples/plain_train.py under torchrun, two simulated nodes ------------------------------
def _torchrun_two_nodes(base: Path, ck: Path, *args: str, expect_ok: bool = True) -> str:
    """The example on 2 nodes of 2 ranks with a memory level; rank 0's agent's output."""
    return torchrun_nodes(2, 2, "examples/plain_train.py", "--steps", "40", "--every", "5", "--dir", str(ck),
                          "--memory", str(base / "mem"), *args, expect_ok=expect_ok)[0]


def test_plain_ddp_under_torchrun_resumes_a_lost_node_and_a_lost_disk_from_memory_bit_identical(tmp_path):
    _torchrun_two_nodes(tmp_path, tmp_path / "ref-ck", "--out-weights", str(tmp_path / "ref.pt"))
    out = _torchrun_two_nodes(tmp_path, tmp_path / "ck", "--kill-at-step", "23", expect_ok=False)
    assert "simulated crash" in out, out[-3000:]
    [job] = os.listdir(tmp_path / "mem")
    shutil.rmtree(tmp_path / "mem" / job / "node-1")
    shutil.rmtree(tmp_path / "ck")  # only node 0's memory holds the checkpoint now
    out = _torchrun_two_nodes(tmp_path, tmp_path / "ck", "--out-weights", str(tmp_path / "run.pt"))
    assert "RESUMED from committed checkpoint at step 20" in out, out[-3000:]
    a, b = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    assert a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())
    assert os.listdir(tmp_path / "mem") == []  # the clean end released the memory
