"""FSDP1 (``FullyShardedDataParallel``) in plain PyTorch: real gloo ranks on CPU.

Given a ``device_mesh``, FSDP1's sharded state dict (``get_state_dict(..., full_state_dict=False)``)
holds ``DTensor`` values, which the core stores as each rank's chunk: the checkpoint loads into an
FSDP2 model and into one process with the state of the FSDP1 job, bit for bit. Without a mesh it
holds the deprecated ``ShardedTensor``, which a save must refuse by key (never crash).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ckpt_engine import Checkpointer
from helpers import assert_same
import forkserver
from ranks import start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                 reason="torch.distributed with gloo is not available")]

HERE = os.path.dirname(os.path.abspath(__file__))
FSDP1 = os.path.join(HERE, "fsdp1_worker.py")
SHARDED = os.path.join(HERE, "sharded_worker.py")
ENV = {"OMP_NUM_THREADS": "1"}


def run(world: int, worker: str, *args: str) -> list[str]:
    """Run ``worker`` on ``world`` gloo ranks (or alone for ``sharded_worker``'s ``single`` layout); each
    rank must exit 0; returns every rank's output."""
    if world == 1 and args[1] == "single":
        procs = [forkserver.launch([sys.executable, worker, *args])]
    else:
        procs = start_ranks(world, list(args), ENV, worker=worker)
    outputs = []
    for p in procs:
        output, _ = p.communicate(timeout=240)
        assert p.returncode == 0, output[-4000:]
        outputs.append(output)
    return outputs


def full(path) -> dict:
    """A whole state written by a worker, its optimizer state in parameter order (FSDP1 sorts it by
    name, FSDP2 and ``Optimizer.state_dict`` keep the parameters' order: the same state either way)."""
    state = torch.load(path, weights_only=True)
    optim = state["optim"]
    order = [name for group in optim["param_groups"] for name in group["params"]]
    assert sorted(order) == sorted(optim["state"]), path
    return {**state, "optim": {**optim, "state": {name: optim["state"][name] for name in order}}}


@pytest.fixture(scope="module")
def fsdp1_checkpoint(tmp_path_factory) -> tuple[str, str]:
    """A 2-rank FSDP1 job (with a device mesh) saved its sharded state at step 3: the checkpoint and
    the folder with its whole state (``full.pt``) and that after two more steps (``after.pt``)."""
    base = tmp_path_factory.mktemp("fsdp1")
    (base / "out").mkdir()
    run(2, FSDP1, "save", str(base / "ck"), str(base / "out"), "3")
    return str(base / "ck"), str(base / "out")


def test_fsdp1_with_a_mesh_stores_dtensor_chunks(fsdp1_checkpoint):
    ck, ref = fsdp1_checkpoint
    reader = Checkpointer(ck, readonly=True)
    state = reader.load()  # one process, no torch.distributed: whole plain tensors
    ref_state = full(f"{ref}/full.pt")
    assert_same(state["model"], ref_state["model"])
    assert_same(dict(sorted(state["optim"]["state"].items())), dict(sorted(ref_state["optim"]["state"].items())))
    sharded = {t.name for t in reader.loaded_manifest.tensors if t.sharding is not None}
    assert {"state['model']['0.weight']", "state['model']['4.weight']",
            "state['optim']['state']['4.weight']['exp_avg']"} <= sharded, sorted(sharded)


@pytest.mark.parametrize("layout, world", [("fsdp", 2), ("fsdp", 1), ("single", 1)])
def test_fsdp1_checkpoint_restores_into_fsdp2_and_one_process_bit_for_bit(fsdp1_checkpoint, tmp_path, layout, world):
    ck, ref = fsdp1_checkpoint
    run(world, SHARDED, "load", layout, ck, str(tmp_path))
    assert_same(full(tmp_path / "loaded.pt"), full(f"{ref}/full.pt"))
    # Two more steps from the restored state: FSDP2 (or one process) reduces gradients in its own
    # order, so the bits may differ from FSDP1's, not the values.
    after, ref_after = full(tmp_path / "loaded_after.pt"), full(f"{ref}/after.pt")
    for key, value in ref_after["model"].items():
        torch.testing.assert_close(after["model"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_fsdp1_without_a_mesh_gives_sharded_tensors_which_a_save_refuses_by_key(tmp_path):
    outputs = run(2, FSDP1, "sharded_tensor", str(tmp_path / "ck"), str(tmp_path))
    for out in outputs:
        line = next((x for x in out.splitlines() if x.startswith(("SAVED", "REFUSED", "FAILED"))), out[-2000:])
        assert line.startswith("REFUSED state['model']['0.weight']: cannot store a ShardedTensor"), line
        assert "device_mesh=" in line and "fully_shard" in line, line
    assert not list((tmp_path / "ck").glob("step-*/manifest.json"))
