"""The Lightning callback with a real Trainer on CPU: 2 ranks with ddp_spawn on gloo, SIGKILL and
SIGTERM mid-epoch, bit-identical resume, data exactly once per epoch, LightningCLI, coexistence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import committed
from helpers import flip_local, proc_stat
import lightning_jobs
from lightning_jobs import (WORKER, References, assert_bitwise, assert_epoch_resplit, final, killed_and_resumed,
                            lightning_module, one_distribution, run, seen)

flavour = lightning_jobs.flavour  # autouse: both Lightning distributions (longer variations once: one_distribution)

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real training jobs, killed and resumed


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 40 steps, no interruption, with 0 and 2 DataLoader workers (each run when first used)."""
    return References(tmp_path_factory)


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
                                                                   expected, flavour):
    if (workers, every) != (0, 5):
        one_distribution(flavour)
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
def test_stateful_dataloader_under_ddp_resumes_bitwise_and_exactly_once(tmp_path, workers, flavour):
    """torchdata's StatefulDataLoader: Lightning restores its state; under DDP its sampler is wrapped
    in DistributedSamplerWrapper and its RandomSampler draws from a generator of its own."""
    one_distribution(flavour)
    ref, restored = killed_and_resumed(tmp_path, ["--stateful", "--workers", str(workers)], 23, (15, 20))
    for rank in (0, 1):
        before = [r for r in seen(tmp_path, "killed", rank) if r["epoch"] == 1 and r["step"] <= restored]
        after = [r for r in seen(tmp_path, "resumed", rank) if r["epoch"] == 1]
        ids = [i for r in before + after for i in r["ids"]]
        assert ids == [i for r in seen(ref, "ref", rank) if r["epoch"] == 1 for i in r["ids"]]
        assert len(set(ids)) == 128


def test_sigterm_mid_epoch_commits_a_final_checkpoint_and_resume_continues(tmp_path):
    """One rank: see the README for why Lightning's multi-rank SIGTERM path cannot carry it."""
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
    proc = subprocess.Popen([sys.executable, WORKER, str(out), str(ck), "--sigterm-at", "22", "--tag", "term"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
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


def test_two_levels_from_the_callback_flush_and_log_their_figures(tmp_path, flavour):
    """levels=[local, second] through the callback: both levels get committed checkpoints, flush
    figures land in figures.jsonl and the logger, and a resume reads them back."""
    one_distribution(flavour)
    ck, level2 = tmp_path / "ck", tmp_path / "level2"
    run(tmp_path, ck, "--level2", str(level2), "--max-steps", "20", "--tag", "lv")
    assert Checkpointer(str(ck), readonly=True).steps()[-1] == 20
    assert Checkpointer(str(level2), readonly=True).steps()[-1] == 20  # close() waited for the flush
    rows = [json.loads(line) for line in open(ck / "figures.jsonl")]
    flushes = [r for r in rows if r.get("kind") == "flush"]
    assert flushes and all(r["level"] == 2 for r in flushes) and any(r["committed"] for r in flushes)
    assert any(r["durable_ms"] > 0 for r in flushes if r["committed"])
    metrics = open(next((tmp_path / "lv").rglob("metrics.csv"))).read()
    assert "ckpt/level2_durable_ms" in metrics
    run(tmp_path, ck, "--level2", str(level2), "--max-steps", "24", "--tag", "lv2")
    assert json.load(open(tmp_path / "resumed-lv2.json"))["resumed_from"] == 20


def test_resume_on_one_rank_from_a_two_rank_checkpoint(uninterrupted, tmp_path, flavour):
    one_distribution(flavour)
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--max-steps", "20", "--tag", "two")
    run(tmp_path, ck, "--devices", "1", "--max-steps", "24", "--dump-restored", "--tag", "one")
    info = json.load(open(tmp_path / "resumed-one.json"))
    assert info["resumed_from"] == 20 and info["global_step"] == 24
    restored = torch.load(tmp_path / "restored-one.pt", weights_only=True)
    assert restored["step"] == 20
    assert_bitwise(final(tmp_path, "two"), restored)  # the state matches; data order may differ


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resumed_on_another_number_of_devices_each_remaining_sample_of_the_epoch_once(tmp_path, before, after, flavour):
    """Killed mid-epoch on ``before`` devices, resumed on ``after``: the unseen rest of the interrupted
    epoch is re-split among the new devices (every sample of the epoch once, none twice), and
    Lightning's loop counts the new split, so the epoch ends exactly when the rest runs out and the
    next one is whole. One device: the single-device strategy (the loader's RandomSampler) when
    resumed on, DDP (a DistributedSampler) when the checkpoint's writer."""
    one_distribution(flavour)
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


def test_explicit_ckpt_path_and_coexistence_with_model_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--max-steps", "12", "--model-checkpoint", "--tag", "first")
    assert len(os.listdir(tmp_path / "mc")) == 2 and (tmp_path / "manual.ckpt").exists()
    run(tmp_path, ck, "--max-steps", "20", "--resume", "never", "--ckpt-path", str(ck), "--tag", "second")
    assert json.load(open(tmp_path / "resumed-second.json"))["resumed_from"] == 12
    lightning_ckpt = torch.load(tmp_path / "manual.ckpt", weights_only=False)
    assert lightning_ckpt["global_step"] == 12  # trainer.save_checkpoint still writes Lightning's own file


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")


def cli(cwd, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(EXAMPLE, "lightning_train.py"), "fit", "--config",
                           os.path.join(EXAMPLE, "lightning_cli.yaml"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_lightning_cli_with_the_example_yaml_fits_writes_and_resumes(tmp_path):
    first = cli(tmp_path, "--trainer.max_steps", "12")
    assert first.returncode == 0, first.stderr[-3000:]
    root = tmp_path / "checkpoints" / "tiny-lm"
    assert Checkpointer(str(root)).steps() == [10, 12]
    again = cli(tmp_path, "--trainer.max_steps", "14")  # the same command continues from step 12
    assert again.returncode == 0, again.stderr[-3000:]
    assert Checkpointer(str(root)).steps()[-1] == 14


BAD_CONFIGS = [
    ('{"every_n_train_steps": 5, "overhead_budget": 0.1, "dirpath": "x"}', "mutually exclusive"),
    ('{"dirpath": "x", "every_n_step": 5}', "every_n_step"),
    ('{"dirpath": "x", "keep_last": -2}', "keep_last=-2 is invalid"),
    ('{"dirpath": "x", "every_n_train_steps": -3}', "every_n_train_steps=-3 is invalid"),  # the key the user wrote
    ('{"dirpath": "x", "train_time_interval": "0:00:00"}', "train_time_interval=0.0 is invalid"),
]


@pytest.fixture(scope="module")
def bad_config_runs(tmp_path_factory, flavour):
    """``lightning_train.py fit --config`` each of BAD_CONFIGS, all in one process (tests/cli_configs.py):
    {override: {"rc", "stderr"}}."""
    d = tmp_path_factory.mktemp("bad-configs")
    cfgs = {}
    for i, (override, _) in enumerate(BAD_CONFIGS):
        cfg = d / f"bad{i}.yaml"
        cfg.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n  max_steps: 1\n  callbacks:\n"
                       "    - class_path: lightning_ckpt.AsyncShardedCheckpoint\n"
                       f"      init_args: {override}\n")
        cfgs[str(cfg)] = override
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "cli_configs.py"),
                           str(d / "out.json"), *cfgs], cwd=d, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {cfgs[cfg]: r for cfg, r in json.loads((d / "out.json").read_text()).items()}


@pytest.mark.parametrize("override, message", BAD_CONFIGS)
def test_bad_callback_configuration_fails_naming_the_value(bad_config_runs, override, message):
    out = bad_config_runs[override]
    assert out["rc"] != 0 and message in out["stderr"], out["stderr"][-2000:]


def test_deepspeed_is_refused_sharded_strategies_take_the_sharded_path_unreachable_paths_named(tmp_path, flavour):
    from ckpt_engine.config import ConfigError
    from lightning_ckpt import AsyncShardedCheckpoint
    with pytest.raises(ConfigError, match="every_n_train_steps and train_time_interval are mutually exclusive"):
        AsyncShardedCheckpoint(dirpath="x", every_n_train_steps=3, train_time_interval=__import__("datetime").timedelta(1))
    with pytest.raises(ValueError, match="not both"):
        AsyncShardedCheckpoint(path="a", dirpath="b")
    pl = lightning_module(flavour)
    from ckpt_engine import CheckpointError
    cb = AsyncShardedCheckpoint(dirpath="nosuchproto://bucket/run", every_n_train_steps=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(CheckpointError, match="nosuchproto://bucket/run"):
        cb.setup(trainer, None, "fit")
    class Trainer(pl.Trainer):
        def __init__(self, strategy):  # only what setup() looks at before refusing
            self._strategy = strategy

        strategy = property(lambda self: self._strategy)
        world_size = 1

    from lightning_ckpt import _sharded, _trainer_api
    deepspeed = pl.strategies.DeepSpeedStrategy
    deepspeed = Trainer(deepspeed.__new__(deepspeed))  # its __init__ needs DeepSpeed; setup() only isinstance()s it
    with pytest.raises(CheckpointError, match="does not support DeepSpeedStrategy: its ZeRO-partitioned state"):
        AsyncShardedCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1).setup(deepspeed, None, "fit")
    for strategy in (pl.strategies.FSDPStrategy(), pl.strategies.ModelParallelStrategy()):  # the sharded path
        trainer = Trainer(strategy)
        assert _trainer_api.unsupported_strategy(trainer) is None and _sharded.applies(trainer)
    assert not _sharded.applies(Trainer(pl.strategies.DDPStrategy()))


# ---- real users' habits (issue #13) -------------------------------------------------------------
def test_ckpt_path_last_restores_exactly_one_checkpoint_the_newer(tmp_path):
    """ModelCheckpoint(save_last=True) users resume with ckpt_path="last": Lightning's last.ckpt
    (step 21, newer) is restored and ours (step 20) is named, not half-restored beside it."""
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--lightning-last", "7", "--kill-at", "23", "--tag", "killed", expect_rc=None)
    ours = Checkpointer(str(ck)).latest_step()
    assert ours in (15, 20)  # 20 unless its commit had not landed when the job was killed
    assert torch.load(tmp_path / "mc" / "last.ckpt", weights_only=False)["global_step"] == 21
    proc = run(tmp_path, ck, "--lightning-last", "7", "--ckpt-path", "last", "--tag", "last")
    info = json.load(open(tmp_path / "resumed-last.json"))
    assert info == {"resumed_from": None, "global_step": 40, "restores": 0}
    log = proc.stdout + proc.stderr
    assert f"not restoring this callback's newest checkpoint (step {ours}" in log, log[-3000:]


def test_ckpt_path_last_older_than_ours_restores_ours_bitwise(uninterrupted, tmp_path, flavour):
    one_distribution(flavour)
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--lightning-last", "13", "--kill-at", "23", "--tag", "killed", expect_rc=None)
    ours = Checkpointer(str(ck)).latest_step()
    assert ours in (15, 20)  # Lightning's last.ckpt is at step 13
    proc = run(tmp_path, ck, "--lightning-last", "13", "--ckpt-path", "last", "--tag", "last")
    info = json.load(open(tmp_path / "resumed-last.json"))
    assert info == {"resumed_from": ours, "global_step": 40, "restores": 1}
    log = proc.stdout + proc.stderr
    assert "is restored instead" in log and "last.ckpt is not used" in log, log[-3000:]
    assert "dataloader is not resumable" not in log  # the callback resumes the data position
    assert_bitwise(final(uninterrupted[0], "ref"), final(tmp_path, "last"))


def test_explicit_ckpt_path_of_ours_with_resume_auto_reads_it_once(tmp_path, flavour):
    one_distribution(flavour)
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--max-steps", "12", "--tag", "first")
    newest = sorted(p for p in os.listdir(ck) if p.startswith("step-"))[-1]
    run(tmp_path, ck, "--max-steps", "16", "--ckpt-path", str(ck / newest), "--tag", "second")
    assert json.load(open(tmp_path / "resumed-second.json")) == {"resumed_from": 12, "global_step": 16,
                                                                 "restores": 1}


def test_resume_names_the_dead_runs_newer_lightning_checkpoints(tmp_path, flavour):
    one_distribution(flavour)
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--lightning-last", "7", "--kill-at", "23", "--tag", "killed", expect_rc=None)
    proc = run(tmp_path, ck, "--lightning-last", "7", "--max-steps", "24", "--tag", "auto")
    assert json.load(open(tmp_path / "resumed-auto.json"))["resumed_from"] in (15, 20)  # last.ckpt: step 21
    log = proc.stdout + proc.stderr
    assert "written after it by the interrupted run stay in place" in log and "last.ckpt" in log, log[-3000:]


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp"])
def test_an_exception_right_after_a_checkpoint_still_commits_it(tmp_path, strategy, flavour):
    """Every rank raises right after the step-10 checkpoint started: fit() ends only once it is committed."""
    if strategy == "ddp":
        one_distribution(flavour)
    ck = tmp_path / "ck"
    proc = run(tmp_path, ck, "--strategy", strategy, "--raise-at", "10", "--tag", "raised", expect_rc=None)
    assert proc.returncode != 0 and "injected failure at step 10" in proc.stdout + proc.stderr
    assert Checkpointer(str(ck)).latest_step() == 10, proc.stderr[-3000:]
    entry = committed(Checkpointer(str(ck)).storage)[-1]
    assert entry.manifest.world_size == 2


@pytest.mark.parametrize("scheduler", ["plateau", "exp"])
def test_epoch_schedulers_and_validation_across_a_resume_are_bitwise(tmp_path, scheduler, flavour):
    """Lightning steps no epoch-interval scheduler (ReduceLROnPlateau included) at the end of an epoch
    it restarted, and skips an epoch's end (validation, schedulers) entirely when restarted from its
    last batch. Resumed from our checkpoints, mid-epoch (step 20) and at an epoch's end (step 16),
    the run must match the uninterrupted one."""
    one_distribution(flavour)
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


def test_resume_falls_back_past_a_checkpoint_whose_per_rank_section_is_damaged(tmp_path, flavour):
    """Rank 1's per-rank section of the newest checkpoint is damaged: both ranks resume from the one before."""
    one_distribution(flavour)
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--max-steps", "20", "--tag", "first")
    newest = sorted(p for p in os.listdir(ck) if p.startswith("step-000000000020"))[-1]
    flip_local(str(ck), newest, 1)
    proc = run(tmp_path, ck, "--max-steps", "24", "--tag", "again")
    assert json.load(open(tmp_path / "resumed-again.json"))["resumed_from"] == 15, proc.stderr[-3000:]
