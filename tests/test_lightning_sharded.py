"""The Lightning callback under ``ModelParallelStrategy`` (FSDP2, FSDP2 + tensor parallel) with a real
Trainer on CPU (gloo): sharded state taken with ``get_state_dict`` and written asynchronously (each
rank its own chunks), SIGKILL mid-epoch and a bit-identical resume, a resume on another number of
devices with the same state and the rest of the epoch re-split. The jobs are ``lightning_worker.py``
with ``--strategy fsdp2`` / ``fsdp2_tp``."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import committed
from helpers import assert_same
import lightning_jobs
from lightning_jobs import (assert_bitwise, assert_epoch_resplit, final, killed_and_resumed,
                            run, seen)

flavour = lightning_jobs.flavour  # autouse: the unified lightning distribution

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real training jobs, killed and resumed
FSDP2 = ("--strategy", "fsdp2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted FSDP2 run on 2 devices: 40 steps, a checkpoint every 5."""
    out = tmp_path_factory.mktemp("fsdp2-ref")
    run(out, out / "ck", *FSDP2, "--tag", "ref")
    return out


def test_fsdp2_ranks_write_their_own_chunks_asynchronously(reference):
    """Each rank wrote its chunk of every sharded tensor (no gather to rank 0), the manifest holds the
    whole tensors' shapes, and a plain ``load()`` in this process (no torch.distributed) gives the
    trained weights whole: those of the reference's final state."""
    ck = Checkpointer(str(reference / "ck"), readonly=True)
    entry = committed(ck.storage)[-1]
    assert entry.step == 40 and entry.manifest.world_size == 2
    assert all(r.data_bytes > 0 for r in entry.manifest.ranks)
    state = ck.load()
    ref = final(reference, "ref")
    for name, whole in ref["model"].items():
        if "running_" in name or "num_batches" in name:  # per-rank buffers: not in the sharded state
            continue
        assert torch.equal(state["model"][name], whole), name
    assert state["optim"]["state"]["net.0.weight"]["exp_avg"].shape == (64, 16)
    rows = [json.loads(line) for line in open(reference / "ck" / "figures.jsonl")]
    assert [r["step"] for r in rows][:3] == [5, 10, 15] and all(r["committed"] for r in rows)


def test_fsdp2_sigkill_mid_epoch_then_auto_resume_is_bitwise_identical(reference, tmp_path):
    ck = tmp_path / "ck"
    run(tmp_path, ck, *FSDP2, "--kill-at", "23", "--tag", "killed", expect_rc=None)
    assert not (tmp_path / "final-killed.pt").exists()
    restored = Checkpointer(str(ck)).latest_step()
    assert restored in (15, 20)
    run(tmp_path, ck, *FSDP2, "--tag", "resumed")
    info = json.load(open(tmp_path / "resumed-resumed.json"))
    assert info == {"resumed_from": restored, "global_step": 40, "restores": 1}
    a, b = final(reference, "ref"), final(tmp_path, "resumed")
    assert a["scheduler"] == b["scheduler"]
    assert_bitwise(a, b)
    for rank in (0, 1):  # the interrupted epoch (steps 17..32): every sample once, in the reference order
        before = [r for r in seen(tmp_path, "killed", rank) if r["epoch"] == 1 and r["step"] <= restored]
        after = [r for r in seen(tmp_path, "resumed", rank) if r["epoch"] == 1]
        ids = [i for r in before + after for i in r["ids"]]
        assert ids == [i for r in seen(reference, "ref", rank) if r["epoch"] == 1 for i in r["ids"]]
        assert seen(tmp_path, "resumed", rank)[0]["step"] == restored + 1


def test_fsdp2_exception_right_after_a_checkpoint_then_resume_is_bitwise(reference, tmp_path):
    """Every rank raises right after the step-10 checkpoint started: it is committed, and the
    resumed run ends where the uninterrupted one did."""
    ck = tmp_path / "ck"
    proc = run(tmp_path, ck, *FSDP2, "--raise-at", "10", "--tag", "raised", expect_rc=None)
    assert proc.returncode != 0 and "injected failure at step 10" in proc.stdout + proc.stderr
    assert Checkpointer(str(ck)).latest_step() == 10
    run(tmp_path, ck, *FSDP2, "--tag", "resumed")
    assert json.load(open(tmp_path / "resumed-resumed.json"))["resumed_from"] == 10
    assert_bitwise(final(reference, "ref"), final(tmp_path, "resumed"))


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_fsdp2_resumed_on_another_number_of_devices_same_state_rest_of_epoch_once(tmp_path, before, after):
    """Stopped mid-epoch (step 20) under FSDP2 on ``before`` devices, resumed on ``after``: the
    restored state is the writer's, bit for bit, and the unseen rest of the epoch is re-split among
    the new devices (every sample of the epoch once), the epoch ending when it runs out."""
    ck = tmp_path / "ck"
    run(tmp_path, ck, *FSDP2, "--devices", str(before), "--max-steps", "20", "--tag", "first")
    restored = Checkpointer(str(ck)).latest_step()
    batches = {devices: 256 // (8 * devices) for devices in (1, 2)}  # per epoch and device
    epoch, into = divmod(restored, batches[before])
    assert restored == 20 and into
    share = -(-(256 - into * 8 * before) // after)  # samples of the rest per device
    left = -(-share // 8)  # batches, the last one partial
    run(tmp_path, ck, *FSDP2, "--devices", str(after), "--max-steps", str(restored + left + 2), "--dump-restored",
        "--tag", "resumed")
    assert json.load(open(tmp_path / "resumed-resumed.json"))["resumed_from"] == restored
    restored_state = torch.load(tmp_path / "restored-resumed.pt", weights_only=True)
    assert restored_state["step"] == restored
    assert_bitwise(final(tmp_path, "first"), restored_state)  # rank 0's buffers come back on rank 0
    assert_epoch_resplit(tmp_path, "first", before, after, restored, epoch, left, batches[after])


def test_fsdp2_with_tensor_parallel_on_four_processes_resumes_bitwise(tmp_path):
    """A 2 x 2 mesh (FSDP2 over data parallel, tensor parallel inside): the checkpoint holds every
    tensor whole (chunks of both dimensions), and a run killed mid-epoch resumes bit-identical: the
    whole weights and optimizer state, and on every rank its BatchNorm statistics and random streams
    (the final checkpoints, taken at the end of both runs) and the samples it trained on."""
    flags = ["--strategy", "fsdp2_tp", "--devices", "4", "--max-steps", "24"]
    ref = tmp_path / "ref"
    run(ref, ref / "ck", *flags, "--tag", "ref")
    whole = Checkpointer(str(ref / "ck"), readonly=True).load()
    reference = final(ref, "ref")
    assert torch.equal(whole["model"]["net.0.weight"], reference["model"]["net.0.weight"])
    assert torch.equal(whole["optim"]["state"]["net.4.weight"]["exp_avg_sq"],
                       reference["optimizer"]["state"]["net.4.weight"]["exp_avg_sq"])
    _, restored = killed_and_resumed(tmp_path, flags, 13, (5, 10), ref=ref)
    ends = [Checkpointer(str(where / "ck"), readonly=True) for where in (ref, tmp_path)]
    assert_same(*(ck.load(24) for ck in ends))
    for rank in range(4):  # what each rank holds for itself
        mine, theirs = ({k: ck.load_local(rank=rank)[k] for k in ("buffers", "rng")} for ck in ends)
        assert_same(mine, theirs, f"rank {rank}")
    for rank in range(4):  # ranks 0, 1 and 2, 3 share a data-parallel index: the same batches
        before = [r for r in seen(tmp_path, "killed", rank) if r["step"] <= restored]
        ids = [i for r in before + seen(tmp_path, "resumed", rank) for i in r["ids"]]
        assert ids == [i for r in seen(ref, "ref", rank) for i in r["ids"]]


def test_fsdp1_under_fsdp_strategy_resumes_bitwise(tmp_path):
    """FSDPStrategy (FSDP1) goes through the same path. Lightning runs it only on CUDA; the job uses a
    subclass (its accelerator check is for FSDPStrategy itself) and wraps the network in FSDP1 with a
    device mesh and ``device_id=cpu`` in ``configure_model``, which FSDPStrategy keeps."""
    killed_and_resumed(tmp_path, ["--strategy", "fsdp1", "--max-steps", "24"], 13, (5, 10))


def test_fsdp1_without_a_device_mesh_is_refused_naming_the_key_and_the_fix(tmp_path):
    proc = run(tmp_path, tmp_path / "ck", "--strategy", "fsdp1", "--no-mesh", "--max-steps", "6", "--tag", "nm",
               expect_rc=None)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "state_dict['net.0.weight'] is a ShardedTensor (FSDP1 without a device mesh)" in log, log[-3000:]
    assert "FSDPStrategy(device_mesh=...)" in log
    assert not list((tmp_path / "ck").glob("step-*"))


def test_fsdp2_explicit_ckpt_path_of_ours_reads_it_once(tmp_path):
    """``fit(ckpt_path=<one of ours>)``: ModelParallelStrategy loads its own files (not through the
    CheckpointIO), so the callback restores that checkpoint itself, once, with the weights."""
    ck = tmp_path / "ck"
    run(tmp_path, ck, *FSDP2, "--max-steps", "12", "--tag", "first")
    older = sorted(p for p in os.listdir(ck) if p.startswith("step-000000000010"))[-1]
    run(tmp_path, ck, *FSDP2, "--max-steps", "14", "--resume", "never", "--ckpt-path", str(ck / older),
        "--dump-restored", "--tag", "second")
    assert json.load(open(tmp_path / "resumed-second.json")) == {"resumed_from": 10, "global_step": 14,
                                                                 "restores": 1}
    restored = torch.load(tmp_path / "restored-second.pt", weights_only=True)
    assert restored["step"] == 10
    whole = Checkpointer(str(ck), readonly=True).load(10)
    for name, value in whole["model"].items():
        assert torch.equal(restored["model"][name], value), name


def test_a_ddp_checkpoint_resumed_under_fsdp2_fails_saying_which_strategy_wrote_it(tmp_path):
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--max-steps", "6", "--tag", "ddp")
    proc = run(tmp_path, ck, *FSDP2, "--max-steps", "8", "--tag", "fsdp2", expect_rc=None)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "cannot be restored into this sharded model" in log and "One written under DDP" in log, log[-3000:]
