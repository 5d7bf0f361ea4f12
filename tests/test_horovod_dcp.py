"""Horovod from a DCP checkpoint: ``HorovodCheckpointer.restore_dcp()`` on 2 ranks (``horovodrun --gloo``)
starts from a ``dcp.save`` of ``{"model", "optim", "step"}`` (torchtitan's layout) bit-identically to
loading it with ``dcp.load`` and training on; a model of another shape is refused on every rank, naming
the key."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from ckpt_engine import CheckpointError
from horovod_dcp_worker import make, train  # noqa: E402
from test_horovod import WORKER, job, run

WORKER_DCP = WORKER.parent / "horovod_dcp_worker.py"


def _saved(tmp_path) -> str:
    """A DCP checkpoint of the model after 3 steps, with its Adam state and its own step (5)."""
    model, optimizer = make(seed=0)
    train(model, optimizer, 3)
    src = str(tmp_path / "dcp")
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
              "step": 5}, checkpoint_id=src, no_dist=True)
    return src


@pytest.fixture(scope="module")
def restored(tmp_path_factory) -> tuple:
    """One 2-rank ``horovodrun``: a model of another shape refused, then the checkpoint's model
    restored and trained two steps. Returns the DCP directory, the job's output and its dump."""
    tmp_path = tmp_path_factory.mktemp("hvd-dcp")
    src = _saved(tmp_path)
    out = run(2, WORKER_DCP, "--dcp", src, "--root", str(tmp_path / "ck"), "--out", str(tmp_path / "got.pt"),
              "--case", "wide", "--case", "same")
    return src, out, tmp_path / "got.pt"


@job
def test_horovod_starts_from_a_dcp_checkpoint_bit_for_bit(restored):
    src, out, dump = restored
    assert "rank 0 step 5" in out and "rank 1 step 5" in out, out[-3000:]
    assert "started from the DCP checkpoint" in out and "the optimizer from 'optim'" in out, out[-3000:]
    model, optimizer = make(seed=1)  # the direct path: dcp.load into a fresh model, then the same two steps
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=src, no_dist=True)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    train(model, optimizer, 2)
    got = torch.load(str(dump), weights_only=True)
    assert got["step"] == 5
    for name, tensor in model.state_dict().items():
        assert torch.equal(got["model"][name], tensor), name
    want = optimizer.state_dict()["state"]
    assert sorted(got["optim"]["state"]) == sorted(want)
    for i, moments in want.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["optim"]["state"][i][key], moments[key]), (i, key)


@job
def test_a_model_of_another_shape_is_refused_on_every_rank_naming_the_key(restored):
    src, out, _ = restored
    for rank in (0, 1):
        assert f"rank {rank} error: CheckpointError: {src}: the model does not take the checkpoint's 'model'" in out
    assert "size mismatch for 0.weight" in out, out[-3000:]


def test_weights_only_are_loaded_when_the_checkpoint_has_no_optimizer(tmp_path):
    """In one process (no Horovod needed): the rule's 'no optimizer keys' case and the step default."""
    from horovod_ckpt._dcp import load_dcp

    model, optimizer = make(seed=0)
    src = str(tmp_path / "weights")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=src, no_dist=True)
    fresh, fresh_opt = make(seed=3)
    step, what = load_dcp(src, fresh, fresh_opt)
    assert step == 0 and "no optimizer state" in what
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    dcp.save({"other": torch.ones(2)}, checkpoint_id=str(tmp_path / "none"), no_dist=True)
    with pytest.raises(CheckpointError, match="no module weights.*'other'"):
        load_dcp(str(tmp_path / "none"), fresh, None)
