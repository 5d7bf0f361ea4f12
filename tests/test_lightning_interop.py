"""The Lightning callback beside Lightning's own features, with a real Trainer on CPU: ``ckpt_path``
(explicit, ``"last"``), ``ModelCheckpoint``, LightningCLI with the example YAML and its configuration
errors, the strategies it refuses or shards for, and two storage levels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ckpt_engine import Checkpointer
import forkserver
import lightning_jobs
from lightning_jobs import assert_bitwise, final, lightning_module, run

flavour = lightning_jobs.flavour  # autouse: the unified lightning distribution
uninterrupted = lightning_jobs.uninterrupted  # the reference runs, shared by the modules of the session

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real training jobs, killed and resumed


def test_two_levels_from_the_callback_flush_and_log_their_figures(tmp_path):
    """levels=[local, second] through the callback: both levels get committed checkpoints, flush
    figures land in figures.jsonl and the logger, and a resume reads them back."""
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


def test_explicit_ckpt_path_and_coexistence_with_model_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--max-steps", "12", "--model-checkpoint", "--tag", "first")
    assert len(os.listdir(tmp_path / "mc")) == 2 and (tmp_path / "manual.ckpt").exists()
    run(tmp_path, ck, "--max-steps", "20", "--resume", "never", "--ckpt-path", str(ck), "--tag", "second")
    assert json.load(open(tmp_path / "resumed-second.json"))["resumed_from"] == 12
    lightning_ckpt = torch.load(tmp_path / "manual.ckpt", weights_only=False)
    assert lightning_ckpt["global_step"] == 12  # trainer.save_checkpoint still writes Lightning's own file


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")


def cli(cwd, *args, config: str = "lightning_cli.yaml") -> subprocess.CompletedProcess:
    """``python examples/lightning_train.py fit --config examples/CONFIG ARGS`` in ``cwd`` (forked from the test
    forkserver; the YAML's ``ddp_spawn`` starts its ranks as fresh interpreters)."""
    return forkserver.run([sys.executable, os.path.join(EXAMPLE, "lightning_train.py"), "fit", "--config",
                           os.path.join(EXAMPLE, config), *args], cwd=str(cwd), timeout=300)


def test_lightning_cli_with_the_example_yaml_fits_writes_and_resumes(tmp_path):
    first = cli(tmp_path, "--trainer.max_steps", "12")
    assert first.returncode == 0, first.stderr[-3000:]
    root = tmp_path / "checkpoints" / "tiny-lm"
    assert Checkpointer(str(root)).steps() == [10, 12]
    again = cli(tmp_path, "--trainer.max_steps", "14")  # the same command continues from step 12
    assert again.returncode == 0, again.stderr[-3000:]
    assert Checkpointer(str(root)).steps()[-1] == 14


def test_lightning_cli_with_the_memory_level_example_yaml_commits_in_memory_flushes_and_releases(tmp_path):
    from ckpt_engine.levels.memory import job_tag
    from ckpt_engine.config import parse_levels

    disk = tmp_path / "checkpoints" / "tiny-lm-memory"
    mem, level2 = parse_levels([{"kind": "memory", "path": "/dev/shm/ckpt-suite"}, str(disk)])
    memory = os.path.join("/dev/shm/ckpt-suite", job_tag(mem, [level2]))
    first = cli(tmp_path, "--trainer.max_steps", "12", config="lightning_cli_memory.yaml")
    assert first.returncode == 0, first.stderr[-3000:]
    assert Checkpointer(str(disk)).steps() == [10, 12]  # flushed from memory by the end of fit
    assert not os.path.exists(memory)  # the job ended with its newest on disk: its memory released
    again = cli(tmp_path, "--trainer.max_steps", "14", config="lightning_cli_memory.yaml")
    assert again.returncode == 0, again.stderr[-3000:]
    assert Checkpointer(str(disk)).steps()[-1] == 14 and not os.path.exists(memory)


BAD_CONFIGS = [
    ('{"every_n_train_steps": 5, "overhead_budget": 0.1, "dirpath": "x"}', "mutually exclusive"),
    ('{"dirpath": "x", "every_n_step": 5}', "every_n_step"),
    ('{"dirpath": "x", "keep_last": -2}', "keep_last=-2 is invalid"),
    ('{"dirpath": "x", "every_n_train_steps": -3}', "every_n_train_steps=-3 is invalid"),  # the key the user wrote
    ('{"dirpath": "x", "train_time_interval": "0:00:00"}', "train_time_interval=0.0 is invalid"),
]


@pytest.fixture(scope="module", params=lightning_jobs.FLAVOURS)
def bad_config_runs(tmp_path_factory, request):
    """``lightning_train.py fit --config`` each of BAD_CONFIGS, all in one process (tests/cli_configs.py),
    under each Lightning distribution (its LightningCLI checks the callback's class and arguments):
    {override: {"rc", "stderr"}}."""
    d = tmp_path_factory.mktemp(f"bad-configs-{request.param}")
    cfgs = {}
    for i, (override, _) in enumerate(BAD_CONFIGS):
        cfg = d / f"bad{i}.yaml"
        cfg.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n  max_steps: 1\n  callbacks:\n"
                       "    - class_path: lightning_ckpt.AsyncShardedCheckpoint\n"
                       f"      init_args: {override}\n")
        cfgs[str(cfg)] = override
    with lightning_jobs.distribution(request.param):
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


def test_ckpt_path_last_restores_exactly_one_checkpoint_the_newer(tmp_path):
    """ModelCheckpoint(save_last=True) users resume with ckpt_path="last": Lightning's last.ckpt
    (step 16, the epoch's last batch: it resumes exactly) is restored and ours (step 15) is named, not
    half-restored beside it. (Lightning's newer mid-epoch one: tests/test_interop_lightning.py.)"""
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--lightning-last", "16", "--kill-at", "17", "--tag", "killed", expect_rc=None)
    ours = Checkpointer(str(ck)).latest_step()
    assert ours in (10, 15)  # 15 unless its commit had not landed when the job was killed
    assert torch.load(tmp_path / "mc" / "last.ckpt", weights_only=False)["global_step"] == 16
    proc = run(tmp_path, ck, "--lightning-last", "16", "--ckpt-path", "last", "--tag", "last")
    info = json.load(open(tmp_path / "resumed-last.json"))
    assert info == {"resumed_from": None, "global_step": 40, "restores": 0}
    log = proc.stdout + proc.stderr
    assert f"not restoring this callback's newest checkpoint (step {ours}" in log, log[-3000:]


def test_ckpt_path_last_older_than_ours_restores_ours_bitwise(uninterrupted, tmp_path):
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


def test_explicit_ckpt_path_of_ours_with_resume_auto_reads_it_once(tmp_path):
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--max-steps", "12", "--tag", "first")
    newest = sorted(p for p in os.listdir(ck) if p.startswith("step-"))[-1]
    run(tmp_path, ck, "--max-steps", "16", "--ckpt-path", str(ck / newest), "--tag", "second")
    assert json.load(open(tmp_path / "resumed-second.json")) == {"resumed_from": 12, "global_step": 16,
                                                                 "restores": 1}
