"""A Lightning job for tests/test_interop_dcp_lightning.py: a tiny regression model under
``ModelParallelStrategy`` (FSDP2) on CPU ranks (gloo), or on one device (``--devices 1``).

Usage: ``python dcp_lightning_worker.py OUT TAG [--devices 2] [--max-steps 8] [--ckpt-path P]
[--root R] [--lightning-dcp D] [--plain-dcp D] [--load-dcp D]``.

* ``--lightning-dcp D``: at the end, ``trainer.save_checkpoint(D)`` (Lightning's own sharded DCP);
* ``--plain-dcp D``: at the end, ``dcp.save({"model": ..., "optim": ..., "train_state": ...}, D)``
  on every rank (torchtitan's layout);
* ``--load-dcp D``: before training, ``dcp.load`` of such a checkpoint into the live sharded state by
  hand (continuing from the DCP checkpoint directly: the reference);
* ``--root R``: ``AsyncShardedCheckpoint(R)`` in the callbacks (resume="auto", every 100 steps);
* ``--ckpt-path P``: ``trainer.fit(model, ckpt_path=P)``.

Rank 0 writes ``final-TAG.pt``: the whole model and optimizer state at the end.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_ckpt import AsyncShardedCheckpoint  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def configure_model(self):
        if self.args.devices > 1:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1) + 0.1 * torch.randn(64, generator=g)), batch_size=8, shuffle=True)

    def on_train_start(self):
        if self.args.load_dcp:  # the reference: dcp.load by hand into the live state
            model, opt = self.trainer.strategy.model, self.trainer.optimizers[0]
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=self.args.load_dcp)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, optim_state_dict=state["optim"])

    def on_train_end(self):
        model, opt = self.trainer.strategy.model, self.trainer.optimizers[0]
        if self.args.plain_dcp:
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                      "train_state": {"step": self.global_step}}, checkpoint_id=self.args.plain_dcp)
        weights, optim = get_state_dict(model, [opt], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.global_rank == 0:
            torch.save({"model": weights, "optim": optim, "step": self.global_step},
                       os.path.join(self.args.out, f"final-{self.args.tag}.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--ckpt-path")
    p.add_argument("--root")
    p.add_argument("--lightning-dcp")
    p.add_argument("--plain-dcp")
    p.add_argument("--load-dcp")
    args = p.parse_args()
    pl.seed_everything(1234)
    callbacks = [AsyncShardedCheckpoint(args.root, every_n_train_steps=100)] if args.root else []
    strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1) \
        if args.devices > 1 else "auto"
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
                         callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)
    model = Net(args)
    trainer.fit(model, ckpt_path=args.ckpt_path)
    if args.lightning_dcp:
        trainer.save_checkpoint(args.lightning_dcp)


if __name__ == "__main__":
    main()
