"""DCP checkpoints into the Lightning callback, with Lightning and DCP themselves on the other side.

(a) Lightning's own sharded checkpoint (``ModelParallelStrategy``: FSDP2 on 2 CPU ranks, gloo) imported
with ``ckpt import`` and resumed by ``AsyncShardedCheckpoint`` (``resume="auto"``) ends bit-identical to
Lightning continuing from its own DCP (``fit(ckpt_path=<dir>)``); (b) ``fit(ckpt_path=<dir>)`` of a
plain ``dcp.save`` (torchtitan's ``{"model", "optim"}``) with the callback ends bit-identical to a run
that ``dcp.load``-s it into the live model by hand, on 2 ranks (resharded DTensors) and on one device
(whole tensors, optimizer renumbered). The jobs are ``dcp_lightning_worker.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ckpt_engine.cli import main
from ckpt_engine.errors import CheckpointError
from ckpt_engine.interop.dcp_import import load_into
from ckpt_engine.interop.dcp_lightning import layout, optimizer_by_ids

import forkserver

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dcp_lightning_worker.py")


def job(out, tag: str, *args: str) -> dict:
    """Run one worker job to its end; rank 0's final state and the job's output."""
    proc = forkserver.run([sys.executable, WORKER, str(out), tag, *args], cwd=str(out),
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    final = torch.load(out / f"final-{tag}.pt", weights_only=True)
    return {**final, "log": proc.stdout + proc.stderr}


def assert_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """4 steps of FSDP2 on 2 ranks, then Lightning's sharded save_checkpoint and a plain dcp.save."""
    out = tmp_path_factory.mktemp("dcp-lightning")
    first = job(out, "first", "--max-steps", "4", "--lightning-dcp", str(out / "ldcp"),
                "--plain-dcp", str(out / "pdcp"))
    assert (out / "ldcp" / ".metadata").is_file() and (out / "ldcp" / "meta.pt").is_file()
    assert (out / "pdcp" / ".metadata").is_file()
    return out, first


@pytest.mark.slow
def test_lightning_sharded_dcp_imported_resumes_like_lightning(written, capsys):
    out, first = written
    theirs = job(out, "lightning", "--ckpt-path", str(out / "ldcp"))  # Lightning continues from its own DCP
    assert main(["import", str(out / "ldcp"), str(out / "root")]) == 0
    assert "as step 4" in capsys.readouterr().out  # the step: meta.pt's global_step
    ours = job(out, "ours", "--root", str(out / "root"))  # resume="auto" from the imported checkpoint
    assert ours["step"] == theirs["step"] == 8
    assert_equal(ours["model"], theirs["model"], "model")
    assert_equal(ours["optim"], theirs["optim"], "optim")
    assert not torch.equal(ours["model"]["net.0.weight"], first["model"]["net.0.weight"])  # it trained on
    # the callback leaves Lightning's own sharded checkpoint to Lightning under a sharded strategy
    left = job(out, "left", "--root", str(out / "root-left"), "--ckpt-path", str(out / "ldcp"))
    assert "restoring the DCP checkpoint" not in left["log"]
    assert_equal(left["model"], theirs["model"], "model")


@pytest.mark.slow
@pytest.mark.parametrize("devices", ["2", "1"])
def test_fit_ckpt_path_plain_dcp_resumes_like_dcp_load(written, devices):
    out, first = written
    direct = job(out, f"direct{devices}", "--devices", devices, "--max-steps", "4", "--load-dcp", str(out / "pdcp"))
    ours = job(out, f"path{devices}", "--devices", devices, "--max-steps", "4", "--root", str(out / f"root{devices}"),
               "--ckpt-path", str(out / "pdcp"))
    assert "restoring the DCP checkpoint" in ours["log"] and "not restored: 'train_state'" in ours["log"]
    assert_equal(ours["model"], direct["model"], "model")
    assert_equal(ours["optim"], direct["optim"], "optim")
    assert int(ours["optim"]["state"]["net.0.weight"]["step"]) == 8  # 4 restored + 4 trained


def test_layout_rule_and_its_errors():
    assert layout(["state_dict", "optimizer_0"], 1, "d") == ("state_dict", ["optimizer_0"])
    assert layout(["model", "optim", "train_state"], 1, "d") == ("model", ["optim"])
    assert layout(["model"], 1, "d") == ("model", [])  # weights only: the optimizer starts fresh
    with pytest.raises(CheckpointError, match=r"looked for the top-level key 'state_dict'.*holds \['weights'\]"):
        layout(["weights"], 1, "d")
    with pytest.raises(CheckpointError, match="no 'optimizer_1'"):
        layout(["state_dict", "optimizer_0"], 2, "d")


def test_load_into_names_missing_key_and_shape(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.ones(2, 3)}}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    with pytest.raises(CheckpointError, match="model.b"):
        load_into(str(tmp_path / "d"), {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}})
    with pytest.raises(CheckpointError, match=r"model\.w"):
        load_into(str(tmp_path / "d"), {"model": {"w": torch.zeros(3, 3)}})
    state = {"model": {"w": torch.zeros(2, 3)}}
    load_into(str(tmp_path / "d"), state)
    assert torch.equal(state["model"]["w"], torch.ones(2, 3))


def test_optimizer_by_ids_numbers_parameters_in_group_order():
    named = {"state": {"b": {"step": 1}, "a": {"step": 2}},
             "param_groups": [{"lr": 0.1, "params": ["a"]}, {"lr": 0.2, "params": ["b"]}]}
    assert optimizer_by_ids(named, "d", "optim") == {
        "state": {1: {"step": 1}, 0: {"step": 2}},
        "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}]}
    with pytest.raises(CheckpointError, match="'c', which is in none of its param_groups"):
        optimizer_by_ids({"state": {"c": {}}, "param_groups": []}, "d", "optim")
