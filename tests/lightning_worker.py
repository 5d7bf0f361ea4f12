"""A small real Lightning job for the integration tests (CPU, 1 to 4 ranks; ``ddp_spawn`` unless
``--strategy`` says otherwise; launched outside, as torchrun does, when ``RANK`` and ``LOCAL_RANK`` are set).

Usage: ``python lightning_worker.py OUT CKPT [--devices 2] [--workers 0] [--max-steps 40]
[--every 5] [--kill-at K] [--sigterm-at K] [--tag NAME] [--ckpt-path PATH] [--model-checkpoint]
[--stateful] [--ddp-on-one] [--strategy ddp_spawn|ddp|fsdp2|fsdp2_tp|fsdp1] [--no-mesh] [--accumulate N]
[--early-stopping] [--every-rank]``.
``fsdp2``: ``ModelParallelStrategy`` with every device on the data-parallel dimension (FSDP2:
``fully_shard`` in ``configure_model``); ``fsdp2_tp``: a data-parallel dimension of ``devices / 2``
and tensor parallel over 2 (colwise then rowwise), FSDP2 over the data-parallel dimension; their
final and restored states are gathered whole (``get_state_dict(full_state_dict=True)``). ``fsdp1``:
a subclass of ``FSDPStrategy`` (Lightning refuses FSDPStrategy itself on CPU) with the network wrapped
in FSDP1 in ``configure_model`` (with a device mesh unless ``--no-mesh``) and no ``ModelCheckpoint``.
Every rank appends the sample ids of each batch to ``OUT/seen-<tag>-rank<r>.jsonl``; rank 0 writes
the final weights and optimizer state to ``OUT/final-<tag>.pt`` and the resumed step to
``OUT/resumed-<tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_ckpt import AsyncShardedCheckpoint  # noqa: E402

# Which Lightning distribution this job uses (tests/lightning_jobs.py: the unified one, both where they differ).
if os.environ.get("LIGHTNING_PACKAGE", "lightning") == "lightning":
    import lightning.pytorch as pl
else:
    import pytorch_lightning as pl


class Numbered(Dataset):
    """A fixed synthetic regression set; each item carries its id."""

    def __init__(self, n: int = 256, dim: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x @ torch.randn(dim, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class Counting(AsyncShardedCheckpoint):
    """The callback, counting how often a checkpoint of ours is read (must be once per resume)."""

    restores = 0

    resumed_level = None

    def lightning_checkpoint(self, step):
        self.restores += 1
        restored = super().lightning_checkpoint(step)
        self.resumed_level = self.session.ck.loaded_level
        return restored


class Net(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.3), torch.nn.Linear(64, 1))

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # two ranks share two cores

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        with open(os.path.join(self.args.out, f"seen-{self.args.tag}-rank{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": self.global_step + 1, "epoch": self.current_epoch, "batch": batch_idx,
                                "ids": ids.tolist()}) + "\n")
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        step = self.global_step
        if step == self.args.raise_at:  # every rank, right after the callbacks' hooks (a save just started)
            raise RuntimeError(f"injected failure at step {step}")
        if self.global_rank == 0 and step == self.args.kill_at:
            # The checkpoints taken so far are committed first (rank 0 commits; the other ranks' files
            # are written by their persist threads meanwhile): the tests expect the newest one, and on
            # a loaded machine a commit can take longer than the steps between it and the kill (seen:
            # step 16's commit still pending at step 22). Kills at any instant: test_crash.py.
            next(c for c in self.trainer.callbacks if isinstance(c, AsyncShardedCheckpoint)).session.ck.wait()
            signal_job(self.args, signal.SIGKILL)  # the whole job, mid-epoch
        if self.global_rank == 0 and step == self.args.sigterm_at:
            if self.trainer.world_size > 1:
                signal_job(self.args, signal.SIGTERM)  # what a scheduler sends: every process of the job
            else:
                os.kill(os.getpid(), signal.SIGTERM)

    def validation_step(self, batch, batch_idx):
        ids, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x).squeeze(1), y), sync_dist=True)
        self.log("val_flat", 1.0, sync_dist=True)  # never improves: a plateau scheduler reduces every epoch

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        if self.args.scheduler == "plateau":
            sched = {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0),
                     "monitor": "val_flat"}
        elif self.args.scheduler == "exp":  # interval "epoch": steps at every epoch end
            sched = {"scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)}
        else:
            sched = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)}
        return {"optimizer": opt, "lr_scheduler": sched}

    def val_dataloader(self):
        return DataLoader(Numbered(32), batch_size=8)

    def train_dataloader(self):
        loader = DataLoader
        if self.args.stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader as loader
        return loader(Numbered(), batch_size=8, shuffle=True, num_workers=self.args.workers,
                      persistent_workers=self.args.workers > 0)

    def full_state(self) -> dict:
        """The whole model and optimizer state (rank 0's)."""
        return {"model": self.state_dict(), "optimizer": self.trainer.optimizers[0].state_dict()}

    def on_train_start(self):
        if self.args.dump_restored:
            state = self.full_state()  # every rank: a collective when sharded
            if self.global_rank == 0:
                torch.save({**state, "step": self.global_step},
                           os.path.join(self.args.out, f"restored-{self.args.tag}.pt"))

    def on_train_end(self):
        if self.args.model_checkpoint:  # every rank calls it; Lightning writes on rank 0
            self.trainer.save_checkpoint(os.path.join(self.args.out, "manual.ckpt"))
        state = self.full_state()  # every rank: a collective when sharded
        if self.args.every_rank:  # this rank's own (buffers differ across DDP ranks), and the callbacks' states
            stopper = next((c for c in self.trainer.callbacks if isinstance(c, pl.callbacks.EarlyStopping)), None)
            torch.save({**state, "early_stopping": stopper.state_dict() if stopper else None},
                       os.path.join(self.args.out, f"final-{self.args.tag}-rank{self.global_rank}.pt"))
        if self.global_rank == 0:
            sched = self.trainer.lr_scheduler_configs[0].scheduler
            torch.save({**state, "step": self.global_step,
                        "scheduler": {k: v for k, v in sched.state_dict().items() if k != "optimizer"}},
                       os.path.join(self.args.out, f"final-{self.args.tag}.pt"))
            cb = next(c for c in self.trainer.callbacks if isinstance(c, AsyncShardedCheckpoint))
            with open(os.path.join(self.args.out, f"resumed-{self.args.tag}.json"), "w") as f:
                resumed = {"resumed_from": cb.resumed_from, "global_step": self.global_step, "restores": cb.restores}
                if self.args.memory:  # which level the resume read (0: the memory level)
                    resumed["resumed_level"] = cb.resumed_level
                json.dump(resumed, f)


class ShardedNet(Net):
    """``Net`` sharded by ``ModelParallelStrategy`` (``--strategy fsdp2`` or ``fsdp2_tp``)."""

    def configure_model(self):
        if self.args.strategy == "fsdp1":
            self.wrap_fsdp1()
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh
        if self.args.strategy == "fsdp2_tp":
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self.net, mesh["tensor_parallel"], {  # BatchNorm1d sees the whole hidden layer
                "0": ColwiseParallel(output_layouts=Replicate()), "4": RowwiseParallel(input_layouts=Replicate())})
        dp = mesh["data_parallel"]
        for layer in (self.net[0], self.net[4]):
            fully_shard(layer, mesh=dp)
        fully_shard(self.net, mesh=dp)

    def wrap_fsdp1(self):
        """FSDP1 on CPU, wrapped here (Lightning's own wrapping gives it no ``device_id``, which CPU needs);
        with a device mesh, its sharded state dict holds DTensors."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        mesh = None if self.args.no_mesh else init_device_mesh("cpu", (self.trainer.world_size,))
        self.net = FSDP(self.net, device_mesh=mesh, device_id=torch.device("cpu"), use_orig_params=True)

    def full_state(self) -> dict:
        """The whole model and optimizer state (a collective; meaningful on rank 0)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        offload = self.args.strategy != "fsdp1"  # FSDP1's offloaded full state dict kills rank 0 on CPU (SIGSEGV)
        model, optim = get_state_dict(self.trainer.strategy.model, self.trainer.optimizers,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
        return {"model": model, "optimizer": optim}


def pid_file(args: argparse.Namespace, rank: int) -> str:
    """Where an externally launched rank writes its process id (``OUT/pid-TAG-rankR``)."""
    return os.path.join(args.out, f"pid-{args.tag}-rank{rank}")


def signal_job(args: argparse.Namespace, sig: int) -> None:
    """Send ``sig`` to every process of the job, as a scheduler does: the job's process group when Lightning
    started the ranks (they share it); when they were launched outside, as ``torchrun`` launches them (each
    leads a group of its own, with its DataLoader workers), the other ranks' groups first, then its own."""
    if args.external:
        for rank in range(1, int(os.environ["WORLD_SIZE"])):
            with open(pid_file(args, rank)) as f:
                os.killpg(int(f.read()), sig)  # written before torch.distributed started: there by the first step
    os.killpg(os.getpgid(0), sig)


def strategy(args: argparse.Namespace):
    """The trainer's strategy for ``--strategy`` (and ``--ddp-on-one``)."""
    if args.strategy == "fsdp2":
        return pl.strategies.ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    if args.strategy == "fsdp2_tp":
        return pl.strategies.ModelParallelStrategy(data_parallel_size=args.devices // 2, tensor_parallel_size=2)
    if args.strategy == "fsdp1":  # Lightning refuses FSDPStrategy itself on CPU, not a subclass
        return type("CPUFSDPStrategy", (pl.strategies.FSDPStrategy,), {})()
    return args.strategy if args.devices > 1 or args.ddp_on_one else "auto"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("ckpt")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu", help="cpu, or gpu (tests/test_gpu.py)")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--sigterm-at", type=int, default=-1)
    p.add_argument("--tag", default="run")
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--resume", default="auto")
    p.add_argument("--model-checkpoint", action="store_true")
    p.add_argument("--strategy", default="ddp_spawn", help="a Lightning strategy name, fsdp2 or fsdp2_tp")
    p.add_argument("--ddp-on-one", action="store_true",
                   help="one device under --strategy (Lightning injects a DistributedSampler), not the single-device one")
    p.add_argument("--dump-restored", action="store_true")
    p.add_argument("--no-mesh", action="store_true", help="fsdp1: no device mesh (ShardedTensor state)")
    p.add_argument("--stateful", action="store_true", help="torchdata's StatefulDataLoader")
    p.add_argument("--level2", default=None, help="a second level: levels=[CKPT, LEVEL2]")
    p.add_argument("--memory", default=None,
                   help="a node-memory level first: levels=[{kind: memory, path: MEMORY}, CKPT]")
    p.add_argument("--nodes", type=int, default=1,
                   help="Trainer(num_nodes=...): ranks launched outside (LOCAL_RANK set)")
    p.add_argument("--raise-at", type=int, default=-1, help="every rank raises right after this step")
    p.add_argument("--lightning-last", type=int, default=0,
                   help="also ModelCheckpoint(save_last=True, every_n_train_steps=N) in OUT/mc")
    p.add_argument("--scheduler", default="step", choices=["step", "plateau", "exp"])
    p.add_argument("--val", action="store_true", help="validate at every epoch end")
    p.add_argument("--pipeline", action="store_true", help="the callback's pipeline=True (deferred snapshot)")
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=N)")
    p.add_argument("--early-stopping", action="store_true", help="EarlyStopping on val_loss (patience 10; with --val)")
    p.add_argument("--every-rank", action="store_true", help="every rank writes OUT/final-<tag>-rank<r>.pt")
    args = p.parse_args()
    # Launched outside, as torchrun launches ranks (tests/lightning_jobs.py): RANK and LOCAL_RANK set before the
    # start (Lightning's own launchers set no RANK); each rank says where its process group is.
    args.external = "RANK" in os.environ and "LOCAL_RANK" in os.environ
    if args.external:
        with open(pid_file(args, int(os.environ["RANK"])), "w") as f:
            f.write(str(os.getpgid(0)))
    pl.seed_everything(1234, workers=True)
    where = {"levels": [args.ckpt, args.level2]} if args.level2 else {"dirpath": args.ckpt}
    if args.memory:
        where = {"levels": [{"kind": "memory", "path": args.memory, "job": args.tag}, args.ckpt]}
    cb = Counting(**where, every_n_train_steps=args.every, keep_last=3, resume=args.resume, pipeline=args.pipeline)
    callbacks = [cb]
    if args.lightning_last:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.out, "mc"), save_last=True,
                                                      save_top_k=0, every_n_train_steps=args.lightning_last))
    if args.model_checkpoint:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.out, "mc"), monitor="loss",
                                                      save_top_k=2, every_n_train_steps=4))
    if args.early_stopping:
        callbacks.append(pl.callbacks.EarlyStopping(monitor="val_loss", patience=10, min_delta=0.01))
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy(args),
                         num_nodes=args.nodes, accumulate_grad_batches=args.accumulate,
                         max_steps=args.max_steps,
                         callbacks=callbacks, logger=pl.loggers.CSVLogger(args.out, name=args.tag),
                         enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=4 if args.val else 0, num_sanity_val_steps=0, deterministic=True,
                         enable_checkpointing=args.strategy != "fsdp1")  # Lightning's FSDP1 save: the SIGSEGV above
    model = ShardedNet(args) if args.strategy.startswith("fsdp") else Net(args)
    trainer.fit(model, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
