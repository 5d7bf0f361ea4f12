"""The Lightning callback with a real Trainer on CPU, killed and resumed: 2 ranks under ``ddp`` on gloo,
launched as torchrun launches them (tests/lightning_jobs.py; ``ddp_spawn``: test_ddp_exact, test_lightning_failures),
SIGKILL mid-epoch, bit-identical resume, every sample of an epoch exactly once (also with torchdata's
StatefulDataLoader, on another number of devices, and with epoch schedulers and validation)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import committed
import lightning_jobs
from lightning_jobs import assert_bitwise, assert_epoch_resplit, final, killed_and_resumed, run, seen

flavour = lightning_jobs.flavour  # autouse: the unified lightning distribution
uninterrupted = lightning_jobs.uninterrupted  # the reference runs, shared by the modules of the session

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real training jobs, killed and resumed


def test_both_ranks_write_their_files_and_the_manifest_records_them(uninterrupted):
    ck_root = uninterrupted[0] / "ck"
    entry = committed(Checkpointer(str(ck_root)).storage)[-1]
    assert entry.manifest.world_size == 2 and entry.step == 40
    files = sorted(f for f in os.listdir(ck_root / entry.dirname) if f.endswith(".bin"))
    assert files == ["rank-00000.bin", "rank-00001.bin"]
    assert all(r.data_bytes > 0 for r in entry.manifest.ranks)
    rows = [json.loads(line) for line in open(ck_root / "figures.jsonl")]
    assert [r["step"] for r in rows][:3] == [5, 10, 15] and all(r["stall_ms"] > 0 for r in rows)
    assert all(r["train_cpu_ms"] > 0 for r in rows)  # Lightning's dictionary, encoding and the copy, on rank 0
    metrics = open(next((uninterrupted[0] / "ref").rglob("metrics.csv"))).read()
    assert "ckpt/stall_ms" in metrics


@pytest.mark.parametrize("workers, every, kill_at, expected", [
    (0, 5, 23, (15, 20)), (2, 5, 23, (15, 20)),
    (0, 8, 19, (16,)),  # step 16 is the last batch of epoch 0: the resume starts the next epoch
])
def test_sigkill_mid_epoch_then_auto_resume_is_bitwise_identical(uninterrupted, tmp_path, workers, every, kill_at,
                                                                   expected):
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--workers", str(workers), "--every", str(every), "--kill-at", str(kill_at), "--tag", "killed",
        expect_rc=None)
    assert not (tmp_path / "final-killed.pt").exists()
    restored = Checkpointer(str(ck)).latest_step()
    assert restored in expected
    run(tmp_path, ck, "--workers", str(workers), "--every", str(every), "--tag", "resumed")
    info = json.load(open(tmp_path / "resumed-resumed.json"))
    assert info["resumed_from"] == restored and info["global_step"] == 40
    assert_bitwise(final(uninterrupted[workers], "ref"), final(tmp_path, "resumed"))
    # within the interrupted epoch (steps 17..32), each rank sees every one of its samples once
    for rank in (0, 1):
        before = [r for r in seen(tmp_path, "killed", rank) if r["epoch"] == 1 and r["step"] <= restored]
        after = [r for r in seen(tmp_path, "resumed", rank) if r["epoch"] == 1]
        ids = [i for r in before + after for i in r["ids"]]
        reference = [i for r in seen(uninterrupted[workers], "ref", rank) if r["epoch"] == 1 for i in r["ids"]]
        assert len(ids) == len(set(ids)) == 128
        assert ids == reference  # the same order as the uninterrupted run
        assert seen(tmp_path, "resumed", rank)[0]["step"] == restored + 1


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_under_ddp_resumes_bitwise_and_exactly_once(tmp_path, workers):
    """torchdata's StatefulDataLoader: Lightning restores its state; under DDP its sampler is wrapped
    in DistributedSamplerWrapper and its RandomSampler draws from a generator of its own."""
    ref, restored = killed_and_resumed(tmp_path, ["--stateful", "--workers", str(workers)], 23, (15, 20))
    for rank in (0, 1):
        before = [r for r in seen(tmp_path, "killed", rank) if r["epoch"] == 1 and r["step"] <= restored]
        after = [r for r in seen(tmp_path, "resumed", rank) if r["epoch"] == 1]
        ids = [i for r in before + after for i in r["ids"]]
        assert ids == [i for r in seen(ref, "ref", rank) if r["epoch"] == 1 for i in r["ids"]]
        assert len(set(ids)) == 128


def test_resume_on_one_rank_from_a_two_rank_checkpoint(uninterrupted, tmp_path):
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--max-steps", "20", "--tag", "two")
    run(tmp_path, ck, "--devices", "1", "--max-steps", "24", "--dump-restored", "--tag", "one")
    info = json.load(open(tmp_path / "resumed-one.json"))
    assert info["resumed_from"] == 20 and info["global_step"] == 24
    restored = torch.load(tmp_path / "restored-one.pt", weights_only=True)
    assert restored["step"] == 20
    assert_bitwise(final(tmp_path, "two"), restored)  # the state matches; data order may differ


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resumed_on_another_number_of_devices_each_remaining_sample_of_the_epoch_once(tmp_path, before, after):
    """Killed mid-epoch on ``before`` devices, resumed on ``after``: the unseen rest of the interrupted
    epoch is re-split among the new devices (every sample of the epoch once, none twice), and
    Lightning's loop counts the new split, so the epoch ends exactly when the rest runs out and the
    next one is whole. One device: the single-device strategy (the loader's RandomSampler) when
    resumed on, DDP (a DistributedSampler) when the checkpoint's writer."""
    one = ["--ddp-on-one"] if before == 1 else []
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--devices", str(before), *one, "--kill-at", "23", "--tag", "killed", expect_rc=None)
    restored = Checkpointer(str(ck)).latest_step()
    batches = {devices: 256 // (8 * devices) for devices in (1, 2)}  # per epoch and device
    epoch, into = divmod(restored, batches[before])
    assert restored in (5, 10, 15, 20) and into, restored  # mid-epoch; 20 unless its commit had not landed
    share = -(-(256 - into * 8 * before) // after)  # samples of the rest per device: 256 is divisible by all
    left = -(-share // 8)  # batches, the last one partial
    run(tmp_path, ck, "--devices", str(after), "--max-steps", str(restored + left + 2), "--tag", "resumed")
    assert json.load(open(tmp_path / "resumed-resumed.json"))["resumed_from"] == restored
    assert_epoch_resplit(tmp_path, "killed", before, after, restored, epoch, left, batches[after])


@pytest.mark.parametrize("scheduler", ["plateau", "exp"])
def test_epoch_schedulers_and_validation_across_a_resume_are_bitwise(tmp_path, scheduler):
    """Lightning steps no epoch-interval scheduler (ReduceLROnPlateau included) at the end of an epoch
    it restarted, and skips an epoch's end (validation, schedulers) entirely when restarted from its
    last batch. Resumed from our checkpoints, mid-epoch (step 20) and at an epoch's end (step 16),
    the run must match the uninterrupted one."""
    flags = ["--val", "--scheduler", scheduler]
    ref = tmp_path / "ref"
    run(ref, ref / "ck", *flags, "--tag", "ref")
    for every, kill_at, expected in ((5, 23, (15, 20)), (8, 22, (16,))):  # mid-epoch; an epoch boundary
        out = tmp_path / f"every{every}"
        ck = out / "ck"
        run(out, ck, *flags, "--every", str(every), "--kill-at", str(kill_at), "--tag", "killed", expect_rc=None)
        restored = Checkpointer(str(ck)).latest_step()
        assert restored in expected
        run(out, ck, *flags, "--every", str(every), "--tag", "resumed")
        assert json.load(open(out / "resumed-resumed.json"))["resumed_from"] == restored
        a, b = final(ref, "ref"), final(out, "resumed")
        assert a["scheduler"] == b["scheduler"], restored
        assert_bitwise(a, b)
