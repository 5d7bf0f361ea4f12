"""Horovod on more than 2 ranks (#44 item 2): with tensor fusion off (``deterministic_reduction``),
two runs of the example at ``-np 4`` end bit-identical, and so does a run SIGKILLed mid-epoch and
resumed; then the rules of ``horovod_ckpt.reduction`` in process.

The example (``examples/horovod_train.py``) at 4 ranks x 4 samples per batch: 128 samples, 8 steps
per epoch, 3 epochs, a checkpoint every 5 steps. Its model has tensors of 10 to 65,536 elements
(three linear layers, BatchNorm), which Horovod fuses by timing when fusion is on: then two
uninterrupted runs already differ in every weight.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_engine.comm import LocalComm
from ckpt_engine.config import ConfigError
from helpers import assert_same, assert_same_samples_once_per_epoch
from ranks import kill_tree
from test_horovod import (EXAMPLE, HAVE_HOROVOD, committed_steps, job, launch, load_final, needs_horovod, run,
                          steps_logged, wait_until)

RANKS, STEPS_PER_EPOCH, EPOCHS, SAMPLES = 4, 8, 3, 128
FLAGS = ["--batch-size", "4", "--hidden", "1024", "--epochs", str(EPOCHS), "--every", "5", "--deterministic-reduction"]


def job_args(where: Path) -> list[str]:
    """The example's flags for a job keeping its checkpoints, sample log and final state in ``where``."""
    (where / "log").mkdir(parents=True, exist_ok=True)
    return [*FLAGS, "--ckpt-dir", str(where / "ck"), "--sample-log", str(where / "log"), "--out", str(where / "out")]


@needs_horovod
@job
def test_four_ranks_with_deterministic_reduction_end_bit_identical_run_to_run_and_after_a_sigkill(tmp_path):
    """``--deterministic-reduction`` (``horovod_ckpt.init()`` starts Horovod with tensor fusion off): a second
    uninterrupted run, and a run SIGKILLed mid-epoch then resumed, end with every rank's model, optimizer and
    scheduler state bit-identical to the first run's; the resumed run saw the first run's samples at every
    step (each once per epoch), and nothing warned that the resume is inexact."""
    ref, twin, got = tmp_path / "ref", tmp_path / "twin", tmp_path / "got"
    run(RANKS, EXAMPLE, *job_args(ref))
    run(RANKS, EXAMPLE, *job_args(twin))
    for rank in range(RANKS):
        assert_same(load_final(twin / "out", rank), load_final(ref / "out", rank))

    killed = launch(RANKS, EXAMPLE, *job_args(got), "--step-delay", "0.1")
    wait_until(lambda: max(steps_logged(got / "log"), default=0) >= 12 and 10 in committed_steps(got / "ck"), killed)
    kill_tree(killed)
    resumed_from = max(committed_steps(got / "ck"))
    assert resumed_from % STEPS_PER_EPOCH != 0, "the test wants a mid-epoch resume"

    out = run(RANKS, EXAMPLE, *job_args(got))
    assert f"resumed from step {resumed_from}," in out, out[-4000:]
    assert "tensor fusion" not in out, out[-4000:]
    for rank in range(RANKS):
        assert_same(load_final(got / "out", rank), load_final(ref / "out", rank))
    assert_same_samples_once_per_epoch([steps_logged(got / "log", r) for r in range(RANKS)],
                                       [steps_logged(ref / "log", r) for r in range(RANKS)],
                                       EPOCHS * STEPS_PER_EPOCH, list(range(EPOCHS)), SAMPLES)


# ---- the rules, in process -------------------------------------------------------------------------

def test_fusion_is_off_where_horovod_parses_the_threshold_to_zero_or_less():
    """``hvd.init()`` reads ``HOROVOD_FUSION_THRESHOLD`` with C's ``strtol``: "0", " 0", "0MB", "-1" and
    "off" (no digits: 0) turn fusion off; unset (128 MiB), "1" (rounded up to a fusion unit) and
    "67108864" leave it on."""
    from horovod_ckpt.reduction import fusion_off

    assert all(fusion_off(v) for v in ("0", " 0", "+0", "0MB", "-1", "off"))
    assert not any(fusion_off(v) for v in (None, "1", "67108864", " 64"))


def test_refusal_and_resume_warning_name_the_ranks_the_value_and_the_fixes():
    from horovod_ckpt.reduction import refusal, resume_warning

    off, fused = ["0"] * 4, ["0", None, "0", "1024"]
    assert refusal(True, off) is None and refusal(False, fused) is None and resume_warning(off) is None
    assert refusal(True, []) is None and resume_warning([]) is None  # 1 or 2 ranks: nothing gathered
    error = refusal(True, fused)
    assert "deterministic_reduction=True" in error and "rank(s) 1, 3" in error
    assert "HOROVOD_FUSION_THRESHOLD='1024'" in error and "HOROVOD_FUSION_THRESHOLD unset (128 MiB)" in error
    assert "horovod_ckpt.init(config) in place of hvd.init()" in error and "--fusion-threshold-mb 0" in error
    said = resume_warning([None] * 4)
    assert "resumed on 4 ranks" in said and "on every rank" in said and "`deterministic_reduction: true`" in said


def test_the_key_is_validated_in_yaml_and_keywords_and_checked_where_it_cannot_hold(tmp_path, monkeypatch):
    """The YAML key and the keyword pass the core's one validation; on one rank (fusion cannot matter) the
    hook takes ``deterministic_reduction=True`` as it is; an elastic state asked for it with fusion on in
    its environment refuses to start (an elastic job may grow past 2 ranks)."""
    from horovod_ckpt import HorovodCheckpointer
    from horovod_ckpt.reduction import requested

    config = tmp_path / "ck.yaml"
    config.write_text(f"dirpath: {tmp_path / 'ck'}\ndeterministic_reduction: true\n")
    assert requested(str(config)) is True and requested(str(config), False) is False and requested() is False
    config.write_text(f"dirpath: {tmp_path / 'ck'}\ndeterministic_reduction: 1\n")
    with pytest.raises(ConfigError, match=r"deterministic_reduction=1 is invalid: expected true or false"):
        requested(str(config))
    with pytest.raises(ConfigError, match=r"deterministic_reduction='yes' is invalid"):
        requested(None, "yes")
    ck = HorovodCheckpointer(str(tmp_path / "ck"), model=torch.nn.Linear(2, 2), _comm=LocalComm(),
                             save_on_sigterm=False, deterministic_reduction=True)
    assert ck.config.deterministic_reduction and ck.restore() is None
    ck.close()

    if HAVE_HOROVOD:
        from horovod_ckpt import DurableTorchState

        monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
        with pytest.raises(ConfigError, match=r"tensor fusion is on \(HOROVOD_FUSION_THRESHOLD unset"):
            DurableTorchState(model=torch.nn.Linear(2, 2), config={"dirpath": str(tmp_path / "el"),
                                                                   "deterministic_reduction": True})


@needs_horovod
def test_init_turns_fusion_off_before_horovod_starts_and_refuses_once_it_runs(monkeypatch):
    """``horovod_ckpt.init`` starts Horovod (one process here) with ``HOROVOD_FUSION_THRESHOLD=0``; once
    Horovod runs with fusion on, asking for it fails naming the remedy instead of starting Horovod again."""
    import os

    import horovod.torch as hvd

    import horovod_ckpt

    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    assert not hvd.is_initialized()
    try:
        hvd.init()
        with pytest.raises(ConfigError, match=r"after Horovod was started with tensor fusion on \(HOROVOD_FUSION_"
                                              r"THRESHOLD unset.*in place of hvd.init\(\).*--fusion-threshold-mb 0"):
            horovod_ckpt.init(deterministic_reduction=True)
        assert "HOROVOD_FUSION_THRESHOLD" not in os.environ and horovod_ckpt.init() is False
        hvd.shutdown()
        assert horovod_ckpt.init(deterministic_reduction=True) is True and hvd.is_initialized()
        assert os.environ["HOROVOD_FUSION_THRESHOLD"] == "0" and horovod_ckpt.init({"dirpath": "/x",
                                                                                   "deterministic_reduction": True})
    finally:
        hvd.shutdown()
        os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
