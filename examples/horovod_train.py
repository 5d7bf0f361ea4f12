"""A standard Horovod PyTorch training script with ckpt-suite's hook added (lines marked ``# ckpt``).

Data parallel on CPU with gloo: ``hvd.DistributedOptimizer``, broadcast of the initial parameters
and optimizer state, a ``DistributedSampler``, per-rank dropout and augmentation noise (drawn
from the global RNG), BatchNorm (per-rank statistics) and a warm-up LR scheduler. The data set is
synthetic and deterministic (no downloads). Run::

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_train.py --ckpt-dir /tmp/hvd-ck

Kill it at any point (``kill -9`` every process of the job) and run the same command again: it
continues from the newest committed checkpoint, with the same weights, optimizer state, RNG streams
and the exact next sample of the interrupted epoch, so the final weights are bit for bit those of
an uninterrupted run. With another ``-np`` it continues the same state, with the unseen rest of the
epoch split across the new ranks. The checkpoint flags can also come from YAML:
``--ckpt-config examples/horovod_ckpt.yaml``. On more than 2 ranks the resume is bit for bit only
with ``--deterministic-reduction`` (or ``deterministic_reduction: true`` in the YAML, as the
example's file has it): ``horovod_ckpt.init`` then starts Horovod with tensor fusion off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

try:
    import horovod_ckpt  # ckpt
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import horovod_ckpt
from horovod_ckpt import HorovodCheckpointer  # ckpt

FEATURES, CLASSES = 32, 10


class Blobs(Dataset):
    """``n`` points around 10 fixed class centres; a little noise is added at every access, drawn
    from the global torch RNG (so the data depends on the RNG stream a resume must restore)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.centres = torch.randn(CLASSES, FEATURES, generator=g) * 2
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        self.points = self.centres[self.labels] + torch.randn(n, FEATURES, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.points[i] + 0.1 * torch.randn(FEATURES), self.labels[i], i


class Net(nn.Module):
    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.fc1, self.bn = nn.Linear(FEATURES, hidden), nn.BatchNorm1d(hidden)
        self.fc2, self.fc3 = nn.Linear(hidden, hidden), nn.Linear(hidden, CLASSES)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(F.relu(self.bn(self.fc1(x))))
        return self.fc3(self.drop(F.relu(self.fc2(x))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt-dir", default=None, help="checkpoint root (local path or fsspec URL)")
    p.add_argument("--ckpt-config", default=None, help="YAML with the checkpoint flags")
    p.add_argument("--every", type=int, default=None, help="checkpoint every N steps (when no YAML)")
    p.add_argument("--deterministic-reduction", action="store_true", default=None,
                   help="tensor fusion off: bit-identical resume on more than 2 ranks (else the YAML's key)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--first-epoch", type=int, default=0, help="number of the first epoch (Horovod examples: 1)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps in all")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--hidden", type=int, default=256, help="width of the hidden layers")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (lets tests kill mid-epoch)")
    p.add_argument("--sample-log", default=None, help="each rank appends the sample ids of every step here")
    p.add_argument("--out", default=None, help="each rank saves its final model and optimizer state here")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[Any, ...]:
    """Data, model, optimizer and scheduler as every Horovod PyTorch script builds them."""
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    dataset = Blobs(args.samples, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = Net(args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=20)
    torch.manual_seed(args.seed + 1 + hvd.rank())  # per-rank dropout and noise streams
    return sampler, loader, model, optimizer, scheduler


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)              # two ranks share two cores; fixed reduction order
    torch.use_deterministic_algorithms(True)
    horovod_ckpt.init(args.ckpt_config, deterministic_reduction=args.deterministic_reduction)  # ckpt: was hvd.init()
    sampler, loader, model, optimizer, scheduler = build(args)
    say = print if hvd.rank() == 0 else (lambda *a, **k: None)

    def figures(row: dict) -> None:  # ckpt: a row per checkpoint saved, and (with levels) per flush to a lower level
        if row["kind"] == "save":
            say(f"checkpoint step {row['step']}: stall {row['stall_ms']:.2f} ms, persist {row['persist_ms']:.1f} ms, "
                f"{row['bytes']} bytes/rank", flush=True)
        else:
            say(f"checkpoint step {row['step']} flushed to level {row['level']} in {row['durable_ms']:.0f} ms"
                f"{' (skipped)' if row['skipped'] else ''}", flush=True)

    ck = HorovodCheckpointer(args.ckpt_dir, model=model, optimizer=optimizer, sampler=sampler,  # ckpt
                             scheduler=scheduler, config=args.ckpt_config, every_n_train_steps=args.every,
                             deterministic_reduction=args.deterministic_reduction, on_figures=figures)
    restored = ck.restore()  # ckpt: None on a fresh start
    say(f"resumed from step {restored.step}, epoch {ck.epoch}, {ck.samples_in_epoch} samples of it done "
        f"({restored.sources['state']})" if restored else "fresh start", flush=True)
    log = open(os.path.join(args.sample_log, f"rank-{hvd.rank()}.jsonl"), "a") if args.sample_log else None

    step = ck.step  # the restored step (0 on a fresh start)
    for epoch in ck.epochs(args.first_epoch, args.first_epoch + args.epochs):  # ckpt: was range(...)
        model.train()
        sampler.set_epoch(epoch)  # ck.epochs() set it already: harmless, as in any existing script
        for x, y, ids in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ck.after_step()  # ckpt
            step += 1
            if log is not None:
                log.write(json.dumps({"step": step, "epoch": epoch, "ids": ids.tolist()}) + "\n")
                log.flush()
            if step % 8 == 0:
                say(f"step {step} epoch {epoch} loss {loss.item():.4f}", flush=True)
            time.sleep(args.step_delay)
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break
    ck.close()  # ckpt

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step},
                   os.path.join(args.out, f"final-rank{hvd.rank()}.pt"))
    say(f"done at step {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
