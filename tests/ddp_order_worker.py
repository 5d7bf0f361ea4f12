"""One rank of a real gloo job (CPU) that checks DDPBucketOrder against DDP itself, driven by
tests/test_ddp_exact.py: ``python ddp_order_worker.py OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in the environment.

For each case, the rank trains a model of about 2.3 MiB (several DDP buckets once rebuilt, BatchNorm,
dropout) for ``STEPS`` steps without interruption, keeping a copy of the model, the optimizer, the RNG
and ``DDPBucketOrder.state_dict()`` at the case's checkpoint step; then, in the same process, a new
model and a new DDP (as a restarted process has) restore that copy, call ``load_state_dict`` (or not)
and train to the end. ``OUT/rank<r>.json`` lists per case: whether it replayed, how many values of
the final model differ from the uninterrupted run's, whether the warm-up left buffers, gradients and
the RNG as they were, and the warnings raised.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
import types
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckpt_engine import CheckpointWarning, DDPBucketOrder  # noqa: E402

STEPS = 9

# name: (DDP keyword arguments, micro-batches per step (the first ones under no_sync), checkpoint step, replay)
CASES = {
    "defaults": ({}, 1, 4, True),
    "defaults_not_replayed": ({}, 1, 4, False),
    "static_graph_at_1": ({"static_graph": True}, 1, 1, True),
    "static_graph": ({"static_graph": True}, 1, 4, True),
    "bucket_view_accumulating": ({"gradient_as_bucket_view": True}, 2, 4, True),
    "at_step_0": ({}, 1, 0, True),
    "find_unused": ({"find_unused_parameters": True}, 1, 4, True),
    "no_order_in_checkpoint": ({}, 1, 4, None),
}


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 32), nn.Flatten(), nn.Linear(32 * 8, 512), nn.BatchNorm1d(512), nn.ReLU(),
                         nn.Dropout(0.2), nn.Linear(512, 512), nn.LayerNorm(512), nn.Linear(512, 64))


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 64, (8, 8), generator=g), torch.randint(0, 64, (8,), generator=g)


def train(ddp: DDP, opt: torch.optim.Optimizer, start: int, end: int, accum: int, rank: int) -> None:
    for step in range(start, end):
        opt.zero_grad(set_to_none=True)
        for micro in range(accum):
            x, y = batch(step, micro, rank)
            with ddp.no_sync() if micro < accum - 1 else torch.enable_grad():
                nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def case(kwargs: dict, accum: int, at: int, replay: bool | None, rank: int) -> dict:
    torch.manual_seed(100 + rank)  # dropout: per-rank streams
    model = make()
    ddp = DDP(model, **kwargs)
    order = DDPBucketOrder(ddp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(ddp, opt, 0, at, accum, rank)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                           "rng": torch.get_rng_state(), "order": order.state_dict()})
    train(ddp, opt, at, STEPS, accum, rank)

    model2 = make()
    ddp2 = DDP(model2, **kwargs)  # a restarted process: a new DDP, its construction layout
    order2 = DDPBucketOrder(ddp2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    before = [t.clone() for t in model2.state_dict().values()]
    replayed, caught = None, []
    if replay is not False:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            replayed = order2.load_state_dict(saved["order"] if replay else None)
        caught = [str(w.message) for w in got if issubclass(w.category, CheckpointWarning)]
    untouched = (all(torch.equal(a, b) for a, b in zip(before, model2.state_dict().values()))
                 and torch.equal(torch.get_rng_state(), saved["rng"])
                 and all(p.grad is None for p in model2.parameters()))
    train(ddp2, opt2, at, STEPS, accum, rank)
    differ = sum(int((a != b).sum()) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    differ += sum(int((torch.as_tensor(a) != torch.as_tensor(b)).sum())
                  for kept, again in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values())
                  for a, b in zip(kept.values(), again.values()))
    hooks_left = sum(p._backward_hooks is not None for p in [*model.parameters(), *model2.parameters()])
    del ddp, ddp2
    return {"replayed": replayed, "differ": differ, "untouched": untouched, "warnings": caught,
            "order": saved["order"], "recorded_again": order2.state_dict(), "hooks_left": hooks_left}


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {name: case(*spec, rank) for name, spec in CASES.items()}
    ddp = DDP(make())
    DDPBucketOrder(ddp).remove()  # stopped before any backward (a fit that ended early): nothing left behind
    results["removed_early"] = {"hooks_left": sum(p._backward_hooks is not None for p in ddp.parameters())}
    model = make()
    own = model.forward = types.MethodType(type(model).forward, model)  # as a wrapping library sets one
    replayed = DDPBucketOrder(DDP(model)).load_state_dict(results["defaults"]["order"])
    results["instance_forward"] = {"replayed": replayed, "kept": model.__dict__.get("forward") is own}
    del ddp
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    gc.collect()  # every DDP (its Reducer holds the group) gone first: docs/troubleshooting.md, a hang at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
