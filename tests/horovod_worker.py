"""Rank processes for tests/test_horovod.py, started under ``horovodrun``.

``restore``: for each ``--case NAME:ROUTE:DIR``, in order, build the example's model, optimizer and
sampler on however many ranks there are, ``restore()`` the checkpoint in DIR (written by another number
of ranks) by ROUTE, and dump what each rank holds to ``NAME-rank{r}-of{n}.pt``: its state and the
indices its sampler yields for the rest of the interrupted epoch, or the error every rank raised
(restore errors are agreed by all ranks, so one case failing leaves the next ones to run). One
``horovodrun`` so checks several restores without paying its start for each.

``elastic``: an ``hvd.elastic.run`` job with :class:`~horovod_ckpt.DurableTorchState`; every
batch is committed (and so checkpointed). It dumps its weights when ``train`` first starts (after
the durable restore and the sync) and at the end.

``hparams``: Adam with its learning rate scaled by ``hvd.size()``, as Horovod's examples scale it.
``--phase save`` trains 3 steps and closes (final checkpoint); ``--phase restore`` restores that
checkpoint once per ``--modes`` entry (``optimizer_hparams``; "checkpoint" is passed as nothing,
the default) and dumps the learning rates and the optimizer state each restore left.

``fault``: ``restore()`` of a committed checkpoint with a failure injected on one rank
(``--fail latest``: rank 0's listing of the checkpoints; ``--fail load``: rank 1's read), then a
collective, as training would make.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import horovod.torch as hvd
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import horovod_train  # noqa: E402  (the example: same model, data and optimizer)

from horovod_ckpt import HorovodCheckpointer  # noqa: E402


def restore(args: argparse.Namespace) -> None:
    import ckpt_engine.load.exchange as exchange

    default_piece = exchange.MIN_PIECE
    for case in args.case:
        name, route, ckpt_dir = case.split(":", 2)
        ex = horovod_train.parse_args(["--ckpt-dir", ckpt_dir])
        sampler, _, model, optimizer, scheduler = horovod_train.build(ex)
        # the example's tensors are small: with the exchange route, exchange all but the tiniest
        exchange.MIN_PIECE = 4096 if route == "exchange" else default_piece
        ck = HorovodCheckpointer(ckpt_dir, model=model, optimizer=optimizer, sampler=sampler,
                                 scheduler=scheduler, save_on_train_end=False, restore_route=route)
        try:
            step = ck.restore().step
        except Exception as e:  # every rank raises the same error: the next case starts together
            result = {"error": f"{type(e).__name__}: {e}"}
        else:
            figures = ck.ck.restore_figures
            sampler.set_epoch(ck.epoch)
            result = {"step": step, "epoch": ck.epoch, "samples_in_epoch": ck.samples_in_epoch,
                      "rest": list(sampler), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "scheduler": scheduler.state_dict(), "world": hvd.size(),
                      "received": figures.received_bytes if figures else 0}
        ck.close()
        torch.save(result, os.path.join(args.out, f"{name}-rank{hvd.rank()}-of{hvd.size()}.pt"))


def elastic(args: argparse.Namespace) -> None:
    from horovod_ckpt import DurableTorchState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    levels = [{"kind": "memory", "path": args.memory, "job": "elastic"}, args.ckpt_dir] if args.memory else None
    state = DurableTorchState(None if levels else args.ckpt_dir, model=model, optimizer=optimizer, levels=levels,
                              epoch=0, batch=0)
    started = []

    @hvd.elastic.run
    def train(state: DurableTorchState) -> None:
        if not started:
            started.append(True)
            print(json.dumps({"start": state.restored_step, "epoch": state.epoch, "batch": state.batch,
                              "rank": hvd.rank(), "size": hvd.size()}), flush=True)
            _dump(model, optimizer, os.path.join(args.out, f"start-rank{hvd.rank()}.pt"))
        while state.epoch < args.epochs:
            while state.batch < args.batches:
                g = torch.Generator().manual_seed(1000 * state.epoch + 10 * state.batch + hvd.rank())
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                state.batch += 1
                state.commit()
                time.sleep(args.step_delay)
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)
    state.close()
    _dump(model, optimizer, os.path.join(args.out, f"final-rank{hvd.rank()}.pt"))
    print(json.dumps({"done": state.durable_step, "rank": hvd.rank()}), flush=True)


def _adam_job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * hvd.size())  # Horovod: scale lr by size
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def hparams(args: argparse.Namespace) -> None:
    rank, size = hvd.rank(), hvd.size()
    if args.phase == "save":
        model, optimizer = _adam_job()
        ck = HorovodCheckpointer(args.ckpt_dir, model=model, optimizer=optimizer)
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 4)).backward()
            optimizer.step()
            ck.after_step()
        ck.close()
        torch.save(optimizer.state_dict(), os.path.join(args.out, f"saved-rank{rank}.pt"))
        return
    for mode in args.modes.split(","):
        model, optimizer = _adam_job()
        chosen = {} if mode == "checkpoint" else {"optimizer_hparams": mode}
        ck = HorovodCheckpointer(args.ckpt_dir, model=model, optimizer=optimizer, save_on_train_end=False, **chosen)
        ck.restore()
        ck.close()
        torch.save({"lr": [g["lr"] for g in optimizer.param_groups], "state": optimizer.state_dict()["state"]},
                   os.path.join(args.out, f"{mode}-rank{rank}-of{size}.pt"))


def fault(args: argparse.Namespace) -> None:
    from ckpt_engine import CorruptionError

    ex = horovod_train.parse_args(["--ckpt-dir", args.ckpt_dir])
    sampler, _, model, optimizer, scheduler = horovod_train.build(ex)
    ck = HorovodCheckpointer(args.ckpt_dir, model=model, optimizer=optimizer, sampler=sampler,
                             scheduler=scheduler, save_on_train_end=False)
    from ckpt_engine.load import agreed as restore_agreed

    rank, function, what = {"latest": (0, "manifest_dirs", "the listing"),
                            "load": (1, "read_locals", "the read")}[args.fail]  # after the state, either route
    if hvd.rank() == rank:
        def fail(*a: object, **k: object) -> None:
            raise CorruptionError(f"injected into {what} on rank {rank}")

        setattr(restore_agreed, function, fail)
    ck.restore()
    hvd.allreduce(torch.zeros(1), name="training.goes.on")
    ck.close()


def _dump(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["restore", "elastic", "hparams", "fault"])
    p.add_argument("--ckpt-dir", help="every mode but restore (which names its directories in --case)")
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--memory", default=None, help="elastic: a memory level in this directory before --ckpt-dir")
    p.add_argument("--phase", choices=["save", "restore"], default="save")
    p.add_argument("--case", action="append", default=[], metavar="NAME:ROUTE:DIR",
                   help="restore: one restore of the checkpoint in DIR by ROUTE (auto, read or exchange)")
    p.add_argument("--modes", default="checkpoint")
    p.add_argument("--fail", choices=["latest", "load"], default="latest")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    hvd.init()
    os.makedirs(args.out, exist_ok=True)
    {"restore": restore, "elastic": elastic, "hparams": hparams, "fault": fault}[args.mode](args)


if __name__ == "__main__":
    main()
