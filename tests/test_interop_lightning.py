"""Lightning's ``.ckpt`` both ways (``ckpt export --format lightning``, ``ckpt import --format lightning``)
and ``fit(ckpt_path="last")`` beside ``ModelCheckpoint``, chosen for exactness (issue #38, items 3 and 4).

Real tools on both sides: Lightning's ``Trainer`` fits, ``LightningModule.load_from_checkpoint`` and
``fit(ckpt_path=...)`` read what the export wrote, the callback resumes from what the import wrote, and a
2-rank ``ddp`` job (launched as torchrun does) killed at step 23 resumes with ``ckpt_path="last"``."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckpt_engine import Checkpointer
from ckpt_engine.cli import main as ckpt
from ckpt_engine.errors import CheckpointError
from ckpt_engine.interop.lightning import from_lightning, import_lightning, to_lightning
import lightning_jobs
from lightning_jobs import assert_bitwise, final, lightning_module, run
from lightning_ckpt._resume import inexact, interval

flavour = lightning_jobs.flavour  # autouse: the unified lightning distribution
each_distribution = lightning_jobs.each_distribution
uninterrupted = lightning_jobs.uninterrupted  # the reference runs, shared by the modules of the session


def regression(pl):
    """A small deterministic LightningModule (no dropout, the data not shuffled, a per-step scheduler):
    two fits that restore the same dictionary end bit for bit alike."""

    class Regression(pl.LightningModule):
        def __init__(self, width: int = 8, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
                                           torch.nn.Linear(width, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.7),
                                                       "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(32, 4, generator=g)
            return DataLoader(TensorDataset(x, x.sum(1)), batch_size=8)  # 4 batches an epoch

    return Regression


def fit(pl, tmp_path, max_steps: int, *, callbacks=(), ckpt_path=None, model=None):
    """A single-device fit of :func:`regression` to ``max_steps``; returns the trainer and the module."""
    torch.manual_seed(0)
    model = model if model is not None else regression(pl)()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=list(callbacks), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def assert_same_training(a, b) -> None:
    """The two fits ended with bit-identical weights, optimizer state and position."""
    (ta, ma), (tb, mb) = a, b
    assert ta.global_step == tb.global_step and ta.current_epoch == tb.current_epoch
    sa, sb = ma.state_dict(), mb.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    oa, ob = ta.optimizers[0].state_dict(), tb.optimizers[0].state_dict()
    for p in oa["state"]:
        for k in oa["state"][p]:
            assert torch.equal(torch.as_tensor(oa["state"][p][k]), torch.as_tensor(ob["state"][p][k])), (p, k)
    assert oa["param_groups"] == ob["param_groups"]


@pytest.mark.slow
def test_exported_ckpt_loads_in_load_from_checkpoint_and_resumes_as_ours(tmp_path, each_distribution):
    """A checkpoint of ours at step 8 exported as a .ckpt: load_from_checkpoint gives its weights and
    hyper-parameters; fit(ckpt_path=<.ckpt>) to step 16 ends where continuing from ours ends."""
    from lightning_ckpt import AsyncShardedCheckpoint

    pl = lightning_module(each_distribution)
    root = tmp_path / "ours"
    fit(pl, tmp_path, 8, callbacks=[AsyncShardedCheckpoint(str(root), every_n_train_steps=4)])
    assert Checkpointer(str(root)).steps() == [4, 8]
    out = tmp_path / "exported.ckpt"
    assert ckpt(["export", str(root), str(out), "--format", "lightning", "--step", "8", "--quiet"]) == 0

    written = torch.load(out, weights_only=True)  # plain values and tensors only
    assert written["global_step"] == 8
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "hyper_parameters",
            "pytorch-lightning_version"} <= set(written)
    reader = Checkpointer(str(root))
    weights = {**reader.load(8)["state_dict"], **reader.load_local(rank=0)["buffers"]}  # buffers: rank 0's
    loaded = regression(pl).load_from_checkpoint(str(out))
    assert dict(loaded.hparams) == {"width": 8, "lr": 0.05}
    assert set(loaded.state_dict()) == set(weights)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, weights[k]), k

    continued = fit(pl, tmp_path, 16, callbacks=[AsyncShardedCheckpoint(str(root), every_n_train_steps=100)])
    assert continued[0].callbacks[0].resumed_from == 8
    assert_same_training(continued, fit(pl, tmp_path, 16, ckpt_path=str(out)))


@pytest.mark.slow
def test_lightning_written_ckpt_imported_resumes_with_the_callback(tmp_path, flavour):
    """A .ckpt that Lightning wrote (trainer.save_checkpoint at step 8) imported with `ckpt import`:
    the callback resumes from it, ending where fit(ckpt_path=<that .ckpt>) ends."""
    from lightning_ckpt import AsyncShardedCheckpoint

    pl = lightning_module(flavour)
    trainer, _ = fit(pl, tmp_path, 8)
    source = tmp_path / "lightning.ckpt"
    trainer.save_checkpoint(str(source))
    root = tmp_path / "imported"
    assert ckpt(["import", str(source), str(root), "--format", "lightning", "--quiet"]) == 0
    assert Checkpointer(str(root)).steps() == [8]

    callback = AsyncShardedCheckpoint(str(root), every_n_train_steps=100)
    resumed = fit(pl, tmp_path, 16, callbacks=[callback])
    assert callback.resumed_from == 8
    assert_same_training(resumed, fit(pl, tmp_path, 16, ckpt_path=str(source)))


def test_export_of_a_checkpoint_not_written_by_the_callback_names_what_is_missing(tmp_path, capsys):
    root = tmp_path / "plain"
    with Checkpointer(str(root)) as ck:
        ck.save({"model": {"w": torch.ones(3)}}, 5, {"note": 1})
    assert ckpt(["export", str(root), str(tmp_path / "x.ckpt"), "--format", "lightning"]) == 2
    err = capsys.readouterr().err
    assert "step 5 was not written by lightning_ckpt.AsyncShardedCheckpoint" in err
    assert "state['state_dict'], state['optimizer_states'], local['misc']" in err and "--format torch" in err
    assert not (tmp_path / "x.ckpt").exists()
    with pytest.raises(CheckpointError, match="sharded strategy .* --format dcp"):
        to_lightning({"model": {}, "optim": {}, "policy": {}}, {"misc": {}}, 3)
    with pytest.raises(CheckpointError, match="has no loops, which Trainer.fit"):
        to_lightning({"state_dict": {}, "optimizer_states": []},
                     {"misc": {"epoch": 0, "global_step": 3, "pytorch-lightning_version": "2.6"}}, 3)


def test_import_refuses_what_cannot_seed_a_run(tmp_path):
    weights_only = tmp_path / "w.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 0, "global_step": 4, "loops": {},
                "pytorch-lightning_version": "2.6"}, weights_only)
    with pytest.raises(CheckpointError, match="no optimizer_states .*save_weights_only"):
        import_lightning(str(weights_only), str(tmp_path / "a"))
    not_lightning = tmp_path / "n.ckpt"
    torch.save({"model": torch.ones(2)}, not_lightning)
    with pytest.raises(CheckpointError, match="has no state_dict, epoch, global_step"):
        import_lightning(str(not_lightning), str(tmp_path / "b"))
    with pytest.raises(CheckpointError, match="does not exist"):
        import_lightning(str(tmp_path / "absent.ckpt"), str(tmp_path / "c"))
    good = tmp_path / "g.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "optimizer_states": [], "epoch": 0, "global_step": 4,
                "loops": {}, "pytorch-lightning_version": "2.6", "hyper_parameters": {"n": 1}}, good)
    assert import_lightning(str(good), str(tmp_path / "d")).step == 4
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(steps \[4\]\)"):
        import_lightning(str(good), str(tmp_path / "d"))
    state, local, step = from_lightning(torch.load(good, weights_only=True), str(good))
    assert step == 4 and local["misc"]["hyper_parameters"] == {"n": 1} and "state_dict" not in local["misc"]


def _loops(ready: int, last: bool, loader_state: bool = False) -> dict:
    fit = {"epoch_loop.batch_progress": {"current": {"ready": ready, "completed": max(ready - 1, 0)},
                                         "is_last_batch": last},
           "state_dict": {"combined_loader": [{"i": 1}]} if loader_state else {}}
    return {"epoch": 1, "loops": {"fit_loop": fit}}


def test_which_lightning_checkpoints_resume_exactly():
    assert "mid-epoch (epoch 1, after its batch 5)" in inexact(_loops(5, False))
    assert inexact(_loops(16, True)) is None  # the epoch's last batch: the next epoch starts
    assert inexact(_loops(0, False)) is None  # between epochs
    assert inexact(_loops(5, False, loader_state=True)) is None  # a stateful loader: Lightning resumes it
    assert inexact({"state_dict": {}}) is None  # no loops: nothing to say
    assert interval(5, [10, 15, 20]) == 5
    assert interval(None, [12, 20]) == 8 and interval(None, [7]) == 7


@pytest.mark.integration
@pytest.mark.slow
def test_ckpt_path_last_prefers_ours_when_lightnings_newer_last_cannot_resume_exactly(uninterrupted, tmp_path):
    """The issue's run: 2 ranks, ours every 5 steps, ModelCheckpoint(every_n_train_steps=3, save_last=True),
    SIGKILL at step 23, fit(ckpt_path="last"): Lightning's last.ckpt of step 21 is mid-epoch with a loader
    that is not resumable, ours of step 20 is one interval older: ours is restored, said why, and the run
    ends bit for bit where the uninterrupted one did."""
    ck = tmp_path / "ck"
    run(tmp_path, ck, "--lightning-last", "3", "--kill-at", "23", "--tag", "killed", expect_rc=None)
    ours = Checkpointer(str(ck)).latest_step()
    assert ours == 20  # the worker waits for the commits before the kill
    assert torch.load(tmp_path / "mc" / "last.ckpt", weights_only=False)["global_step"] == 21
    proc = run(tmp_path, ck, "--lightning-last", "3", "--ckpt-path", "last", "--tag", "last")
    info = json.load(open(tmp_path / "resumed-last.json"))
    assert info == {"resumed_from": 20, "global_step": 40, "restores": 1}
    log = proc.stdout + proc.stderr
    assert "is Lightning's last checkpoint (step 21), taken mid-epoch" in log, log[-3000:]
    assert "checkpoint at step 20, 1 step(s) older (at most one of its intervals, 5 steps)" in log
    assert "last.ckpt is not used" in log and "dataloader is not resumable" not in log
    assert_bitwise(final(uninterrupted[0], "ref"), final(tmp_path, "last"))
