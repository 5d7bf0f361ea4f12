"""Bit-identical resume under DDP with its default arguments on more than 2 ranks, as users launch it.

DDP (``find_unused_parameters=False``) rebuilds its gradient buckets after a process's first backward;
a resumed process would reduce its first step in the construction layout, and on more than 2 ranks a
sum's order then changes the last bits. ``DDPBucketOrder`` records the order and replays it
(ckpt_engine/training/ddp_buckets.py); the Lightning callback does it by itself under ``ddp`` and
``ddp_spawn``. These tests run 4 real gloo ranks: with 2, ``a + b == b + a`` hides every order.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from lightning_jobs import assert_bitwise, assert_epoch_resplit, run, seen  # noqa: E402
from ranks import start_ranks, torchrun_nodes  # noqa: E402

from ckpt_engine import Checkpointer  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
WORLD = 4


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _once(ref: list[dict], run_rows: list[dict], restored: int) -> None:
    """The resumed job's batches are the uninterrupted job's, each step once: the first incarnation's
    up to the ``restored`` step, then the second's (the steps after it that the first ran are redone)."""
    first_end = next(i for i, row in enumerate(run_rows) if i and row["step"] <= run_rows[i - 1]["step"])
    kept = [row for row in run_rows[:first_end] if row["step"] <= restored] + run_rows[first_end:]
    assert [row["step"] for row in kept] == [row["step"] for row in ref]
    assert kept == ref


@pytest.fixture(scope="module")
def order_cases(tmp_path_factory) -> dict:
    """One 4-rank job (tests/ddp_order_worker.py): every case, every rank."""
    out = tmp_path_factory.mktemp("ddp-order")
    procs = start_ranks(WORLD, [str(out)], worker=os.path.join(os.path.dirname(__file__), "ddp_order_worker.py"))
    for p in procs:
        output, _ = p.communicate(timeout=240)
        assert p.returncode == 0, output[-5000:]
    return {rank: json.load(open(out / f"rank{rank}.json")) for rank in range(WORLD)}


@pytest.mark.parametrize("case", ["defaults", "static_graph", "static_graph_at_1", "bucket_view_accumulating"])
def test_a_replayed_order_makes_a_restarted_ddp_reduce_as_the_uninterrupted_one(order_cases, case):
    """A new DDP (a restarted process) that replays the order recorded before its checkpoint ends with the
    uninterrupted run's model and optimizer state on every rank; the warm-up left the restored
    parameters, buffers (BatchNorm), RNG and gradients as they were, the order recorded again is the
    one replayed, and once recorded no hook of ours is left on any parameter (nothing per step)."""
    for rank, cases in order_cases.items():
        got = cases[case]
        assert got["replayed"] is True and got["warnings"] == [], (rank, got)
        assert got["untouched"], (rank, case)
        assert got["differ"] == 0, (rank, case, got["differ"])
        assert got["recorded_again"]["ready"] == got["order"]["ready"] and len(got["order"]["ready"]) == 11  # every parameter
        assert got["hooks_left"] == 0


def test_stopping_before_the_order_is_complete_leaves_no_hook(order_cases):
    assert all(cases["removed_early"]["hooks_left"] == 0 for cases in order_cases.values())


def test_a_forward_set_on_the_module_instance_is_put_back_after_the_warm_up(order_cases):
    assert all(cases["instance_forward"] == {"replayed": True, "kept": True} for cases in order_cases.values())


def test_without_the_replay_four_ranks_drift_apart_so_the_cases_above_can_tell(order_cases):
    """The same resume without the replay differs: what the cases above check is not vacuous."""
    assert all(cases["defaults_not_replayed"]["differ"] > 0 for cases in order_cases.values())


def test_nothing_to_replay_before_any_backward_or_when_ddp_never_rebuilds(order_cases):
    for cases in order_cases.values():
        assert cases["at_step_0"]["order"] == {"ready": [], "passes": 0}
        for case in ("at_step_0", "find_unused"):
            assert cases[case]["replayed"] is False and cases[case]["warnings"] == [], case
            assert cases[case]["differ"] == 0, case


def test_a_checkpoint_without_the_order_is_said_once_naming_the_setting_that_makes_it_exact(order_cases):
    for cases in order_cases.values():
        got = cases["no_order_in_checkpoint"]
        assert got["replayed"] is False and got["untouched"]
        [warning] = got["warnings"]
        assert "holds no DDP gradient order" in warning and "on 4 ranks" in warning
        assert "find_unused_parameters=True" in warning and "ddp_find_unused_parameters_true" in warning


def test_plain_ddp_with_default_arguments_on_2_nodes_of_2_ranks_resumes_bit_identical_and_on_2_ranks_once(tmp_path):
    """examples/plain_train.py (DDP(model), AdamW, a checkpoint every 5 steps) under ``torchrun --nnodes 2
    --nproc-per-node 2``, every rank SIGKILLed after step 25:

    * the same command again: at step 40 every rank's model and optimizer state equal the uninterrupted
      run's, and each rank trained on the same samples, each once;
    * resumed on one node of 2 ranks instead: the state restored is the uninterrupted run's at that step
      on both ranks, the interrupted epoch goes on with each sample once (every sample the uninterrupted
      epoch trained on among them), and the training after it, summed over 2 ranks, is not the 4-rank run's.
    """
    common = ("--steps", "40", "--every", "5", "--keep-last", "8")
    torchrun_nodes(2, 2, "examples/plain_train.py", *common, "--dir", str(tmp_path / "ref-ck"),
                   "--record", str(tmp_path / "ref"))
    out = torchrun_nodes(2, 2, "examples/plain_train.py", *common, "--dir", str(tmp_path / "ck"),
                         "--record", str(tmp_path / "run"), "--kill-at-step", "25", expect_ok=False)[0]
    assert "simulated crash: SIGKILL right after step 25" in out, out[-3000:]
    restored = Checkpointer(str(tmp_path / "ck"), readonly=True).latest_step()
    assert restored in (20, 25)
    shutil.copytree(tmp_path / "ck", tmp_path / "ck-on-2")
    out = torchrun_nodes(2, 2, "examples/plain_train.py", *common, "--dir", str(tmp_path / "ck"),
                         "--record", str(tmp_path / "run"))[0]
    assert f"RESUMED from committed checkpoint at step {restored} on 4 rank(s)" in out, out[-3000:]
    for rank in range(WORLD):
        a = torch.load(tmp_path / "ref" / f"final-rank{rank}.pt", weights_only=True)
        b = torch.load(tmp_path / "run" / f"final-rank{rank}.pt", weights_only=True)
        assert_bitwise(a, b)
        _once(_rows(tmp_path / "ref" / f"seen-rank{rank}.jsonl"), _rows(tmp_path / "run" / f"seen-rank{rank}.jsonl"),
              restored)

    out = torchrun_nodes(1, 2, "examples/plain_train.py", *common, "--dir", str(tmp_path / "ck-on-2"),
                         "--record", str(tmp_path / "on2"))[0]
    assert f"RESUMED from committed checkpoint at step {restored} on 2 rank(s), written by 4" in out, out[-3000:]
    saved = Checkpointer(str(tmp_path / "ref-ck"), readonly=True).load(step=restored)
    for rank in range(2):
        got = torch.load(tmp_path / "on2" / f"restored-rank{rank}.pt", weights_only=True)
        assert got["step"] == restored
        assert_bitwise({"model": saved["model"], "optimizer": saved["optimizer"]}, got)
    ref_rows = [_rows(tmp_path / "ref" / f"seen-rank{rank}.jsonl") for rank in range(WORLD)]
    epoch = next(row["epoch"] for row in ref_rows[0] if row["step"] == restored)  # the interrupted one
    before = [i for rows in ref_rows for row in rows if row["epoch"] == epoch and row["step"] <= restored
              for i in row["ids"]]  # the same as the killed run's (checked above)
    after = [i for rank in range(2) for row in _rows(tmp_path / "on2" / f"seen-rank{rank}.jsonl")
             if row["epoch"] == epoch for i in row["ids"]]
    assert after and len(set(before + after)) == len(before + after)  # each sample of the interrupted epoch once
    assert {i for rows in ref_rows for row in rows if row["epoch"] == epoch for i in row["ids"]} <= set(before + after)
    final = torch.load(tmp_path / "on2" / "final-rank0.pt", weights_only=True)
    reference = torch.load(tmp_path / "ref" / "final-rank0.pt", weights_only=True)
    assert any(not torch.equal(final["model"][k], v) for k, v in reference["model"].items())


@pytest.mark.timeout(900)  # four fits, 14 processes that import Lightning
def test_lightning_ddp_spawn_on_4_devices_resumes_mid_epoch_bit_identical_and_on_2_exactly_once(tmp_path):
    """Lightning's MNIST example's shape (BatchNorm, dropout, ReduceLROnPlateau on a validation metric,
    EarlyStopping, gradient accumulation) under ``ddp_spawn`` with ``devices=4`` and the strategy's
    defaults, SIGKILLed mid-epoch:

    * resumed by the same command, every rank's model (its BatchNorm statistics included) and optimizer
      state, the scheduler and EarlyStopping's state end as in the uninterrupted run, and every rank saw
      the same batches, each once;
    * resumed on 2 devices instead (docs/troubleshooting.md, "Another number of ranks"), what stays exact
      is: the state restored is the uninterrupted run's at that step, bit for bit, and the rest of the
      interrupted epoch is re-split so that each of its samples is seen once. What cannot stay exact is
      the training after it: 2 ranks sum other partial gradients than 4 (and split the data otherwise),
      so its weights are not the 4-device run's.
    """
    flags = ("--devices", "4", "--strategy", "ddp_spawn", "--scheduler", "plateau", "--val", "--early-stopping",
             "--accumulate", "2", "--every", "6", "--max-steps", "30", "--every-rank")
    ref = tmp_path / "ref"
    run(ref, ref / "ck", *flags, "--tag", "ref")
    ck = tmp_path / "ck"
    run(tmp_path, ck, *flags, "--kill-at", "20", "--tag", "killed", expect_rc=None)
    restored = Checkpointer(str(ck), readonly=True).latest_step()
    assert restored == 18  # mid-epoch: 4 optimizer steps an epoch (256 samples, 4 ranks x 8, 2 batches a step)
    shutil.copytree(ck, tmp_path / "ck-on-2")
    run(tmp_path, ck, *flags, "--tag", "resumed")
    assert json.load(open(tmp_path / "resumed-resumed.json"))["resumed_from"] == restored
    for rank in range(WORLD):
        a = torch.load(ref / f"final-ref-rank{rank}.pt", weights_only=True)
        b = torch.load(tmp_path / f"final-resumed-rank{rank}.pt", weights_only=True)
        assert_bitwise(a, b)
        assert a["early_stopping"] == b["early_stopping"]
        kept = [row for row in seen(tmp_path, "killed", rank) if row["step"] <= restored]
        assert kept + seen(tmp_path, "resumed", rank) == seen(ref, "ref", rank)
    assert torch.load(ref / "final-ref.pt", weights_only=True)["scheduler"] == \
        torch.load(tmp_path / "final-resumed.pt", weights_only=True)["scheduler"]

    on2 = tmp_path / "on2"  # the same checkpoint, resumed on 2 devices: 4 steps finish the epoch, 2 more
    two = [*flags[2:]]
    two[two.index("--max-steps") + 1] = str(restored + 6)
    run(on2, tmp_path / "ck-on-2", "--devices", "2", *two, "--dump-restored", "--tag", "resumed")
    state = torch.load(on2 / "restored-resumed.pt", weights_only=True)
    saved = Checkpointer(str(ref / "ck"), readonly=True).load(step=restored)  # the uninterrupted run's, step 18
    assert state["step"] == restored
    for name, tensor in saved["state_dict"].items():
        assert torch.equal(state["model"][name], tensor), name
    for index, moments in saved["optimizer_states"][0]["state"].items():
        for key, value in moments.items():
            assert torch.equal(torch.as_tensor(state["optimizer"]["state"][int(index)][key]), torch.as_tensor(value))
    assert_epoch_resplit(on2, "killed", 4, 2, restored, epoch=4, left=8, per_epoch=16, first_out=tmp_path,
                         next_batches=4)
    after = torch.load(on2 / "final-resumed.pt", weights_only=True)
    at = Checkpointer(str(ref / "ck"), readonly=True).load(step=24)["state_dict"]  # the 4-device run's
    assert after["step"] == 24 and any(not torch.equal(after["model"][k], v) for k, v in at.items())
