"""Both Lightning distributions, in this process: the unified ``lightning`` and the standalone
``pytorch_lightning`` ship the same trainer under distinct classes (lightning_ckpt/_lightning.py).

What differs between them is which classes the callback resolves and whose loop calls its hooks; that
is checked here for each distribution, without a process per job: the classes the callback derives from
and looks up for a trainer of that distribution, LightningCLI's acceptance of the callback, and a fit
checkpointed, resumed by a second fit and ending bit for bit as an uninterrupted one. The jobs in
real processes (kill, SIGTERM, spawn, sharded strategies, the CLI example) run under the unified
distribution, and under both where a process shows what this cannot (tests/lightning_jobs.py).
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckpt_engine import Restored
from lightning_ckpt import AsyncShardedCheckpoint, _lightning, _sharded, _trainer_api
from lightning_ckpt._resume import CheckpointIOWrapper

DISTRIBUTIONS = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


@pytest.fixture(params=list(DISTRIBUTIONS))
def pl(request):
    return importlib.import_module(DISTRIBUTIONS[request.param])


def _module(pl):
    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                           torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=0.01)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, 8, generator=g)
            return DataLoader(TensorDataset(x, x.sum(1)), batch_size=8, shuffle=True)

    return Tiny


def _fit(pl, ck, max_steps: int) -> tuple[dict, AsyncShardedCheckpoint]:
    """A one-device fit of ``max_steps`` with the callback every 3 steps under ``ck`` (resumes from it)."""
    pl.seed_everything(7, workers=True)
    model = _module(pl)()
    cb = AsyncShardedCheckpoint(dirpath=str(ck), every_n_train_steps=3, keep_last=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True)
    trainer.fit(model)
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optimizer": trainer.optimizers[0].state_dict(), "step": trainer.global_step}
    return state, cb


def test_the_callback_resolves_the_classes_of_the_trainers_distribution(pl, tmp_path, caplog):
    cb = AsyncShardedCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    assert _lightning.of(trainer) is pl
    assert isinstance(cb, pl.callbacks.Callback)  # what the trainer and LightningCLI check
    assert issubclass(CheckpointIOWrapper, pl.plugins.io.CheckpointIO)
    assert _lightning.sigterm_exception(trainer) is pl.utilities.exceptions.SIGTERMException
    assert pl.utilities.exceptions.SIGTERMException in _lightning.sigterm_exceptions()
    for strategy, sharded in ((pl.strategies.ModelParallelStrategy(), True), (pl.strategies.DDPStrategy(), False)):
        probe = type("Probe", (pl.Trainer,), {"strategy": property(lambda self, s=strategy: s), "world_size": 1})
        assert _sharded.applies(probe.__new__(probe)) is sharded
    deepspeed = pl.strategies.DeepSpeedStrategy
    probe = type("Probe", (pl.Trainer,), {"strategy": deepspeed.__new__(deepspeed), "world_size": 1})
    assert "DeepSpeedStrategy" in _trainer_api.unsupported_strategy(probe.__new__(probe))
    with caplog.at_level(logging.INFO):
        _lightning.notice(trainer, "said through the trainer's own rank-zero logger")
    assert any("rank-zero logger" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


def test_lightning_cli_of_each_distribution_takes_the_callback_from_yaml(pl, tmp_path):
    config = tmp_path / "cli.yaml"
    config.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n  max_steps: 1\n  logger: false\n"
                      "  callbacks:\n    - class_path: lightning_ckpt.AsyncShardedCheckpoint\n      init_args:\n"
                      f"        dirpath: {tmp_path / 'ck'}\n        every_n_train_steps: 4\n        keep_last: 2\n")
    lightning_cli = importlib.import_module(f"{pl.__name__}.cli").LightningCLI
    cli = lightning_cli(_module(pl), run=False, args=["--config", str(config)], save_config_callback=None)
    [cb] = [c for c in cli.trainer.callbacks if isinstance(c, AsyncShardedCheckpoint)]
    assert cb.config.every_n_train_steps == 4 and cb.config.keep_last == 2


def test_a_fit_of_each_distribution_checkpoints_and_a_second_fit_resumes_it_bit_for_bit(pl, tmp_path):
    """The hooks as each distribution's loop calls them: a 6-step fit checkpoints at 3 and 6 (and at its
    end), a second fit to step 9 resumes from 6 and ends where an uninterrupted 9-step fit does."""
    reference, _ = _fit(pl, tmp_path / "ref", 9)
    first, cb = _fit(pl, tmp_path / "ck", 6)
    assert first["step"] == 6 and cb.resumed_from is None and cb.restored is None
    resumed, cb = _fit(pl, tmp_path / "ck", 9)
    assert cb.resumed_from == 6 and resumed["step"] == 9
    r = cb.restored  # the one result type of every restore(): the core's
    assert isinstance(r, Restored) and (r.step, r.level) == (6, 0) and r.where.endswith(r.dirname)
    assert r.where.startswith(str(tmp_path / 'ck')) and r.sources["state"] == f"read from level 0 ({r.where})"
    for key, value in reference["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    for index, moments in reference["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(resumed["optimizer"]["state"][index][name]))
