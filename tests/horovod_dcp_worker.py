"""A rank of tests/test_horovod_dcp.py, under ``horovodrun``. For each ``--case``, in order: a model
built from another seed than the DCP checkpoint's (``wide``: with a first layer of another shape),
``HorovodCheckpointer.restore_dcp()`` of it into ``ROOT/CASE``, two more steps on the same batch on every
rank, and the weights and Adam moments dumped (``--out``, rank 0), or the error every rank raised
printed (restore errors are agreed by all ranks, so the next case starts together)."""

from __future__ import annotations

import argparse
import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from horovod_ckpt import HorovodCheckpointer  # noqa: E402


def make(seed: int, wide: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The test's model and optimizer (``seed``: its initial weights; ``wide``: a first layer of 9 units)."""
    torch.manual_seed(seed)
    width = 9 if wide else 8
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The batch every step trains on (the same on every rank, so averaging changes nothing)."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    x, y = batch()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def restore(root: str, dcp_dir: str, wide: bool, out: str | None) -> None:
    """One case: restore the DCP checkpoint, train two steps, dump or print what came of it."""
    model, base = make(seed=100 + hvd.rank(), wide=wide)
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    ck = HorovodCheckpointer(root, model=model, optimizer=optimizer, save_on_train_end=False)
    try:
        step = ck.restore_dcp(dcp_dir)
    except Exception as e:  # every rank raises the same error
        print(f"rank {hvd.rank()} error: {type(e).__name__}: {e}", flush=True)
        ck.close()
        return
    train(model, optimizer, 2)
    ck.close()
    if hvd.rank() == 0 and out:
        torch.save({"step": step, "model": model.state_dict(), "optim": optimizer.state_dict()}, out)
    print(f"rank {hvd.rank()} step {step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dcp", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out")
    p.add_argument("--case", action="append", choices=["same", "wide"], default=[],
                   help="same: the checkpoint's model; wide: a first layer of another shape (refused)")
    a = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    for case in a.case:
        restore(os.path.join(a.root, case), a.dcp, case == "wide", a.out if case == "same" else None)


if __name__ == "__main__":
    main()
