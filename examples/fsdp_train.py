"""FSDP2 (``fully_shard``) training in plain PyTorch with ckpt_engine checkpoints and exact resume.

The model and data are those of ``examples/plain_train.py`` (a tiny character-level transformer
on a synthetic corpus); what differs is the sharding and what goes into a checkpoint:

* ``state``: the model's and optimizer's state dicts *as they are sharded* (``DTensor`` values from
  ``get_state_dict(..., full_state_dict=False)``: each rank writes only its own chunk, nothing is
  gathered), and the LR scheduler;
* ``local`` (per rank, whole): the RNG streams and the resumable sampler's data position.

When the checkpoint directory holds a committed checkpoint, every rank restores it in place
(``ck.restore(into=state)``, then ``set_state_dict``) and training continues at the exact next
sample, so a killed-then-resumed run ends with the uninterrupted run's weights, bit for bit.
It also resumes on another number of ranks: the checkpoint holds global tensors, and the rest
of the interrupted epoch is split among the new ranks. Launch with torchrun::

    torchrun --standalone --nproc-per-node 2 examples/fsdp_train.py --steps 60 --every 10 --dir /tmp/ck-fsdp

``--kill-at-step K`` makes every rank of a fresh run SIGKILL itself right after step K (a simulated
crash, once the checkpoints taken so far are committed); run the same command again to resume, or
with ``--nproc-per-node 1`` to resume on one rank. Resume with the same ``--steps``: the restored
LR schedule spans that many steps.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

from plain_train import SEED, CharTransformer, CharWindows, make_corpus  # examples/ is the script's folder

try:
    from ckpt_engine import Checkpointer, TorchDistComm
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from ckpt_engine import Checkpointer, TorchDistComm
from ckpt_engine import ResumableSampler, rng_state, set_rng_state

SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)  # DTensors: this rank's chunks
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)       # whole tensors, on rank 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="total optimizer steps")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps (0: never)")
    p.add_argument("--dir", required=True, help="checkpoint root (local path or fsspec URL)")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--kill-at-step", type=int, default=None, help="SIGKILL every rank right after this step")
    p.add_argument("--out-weights", default=None,
                   help="rank 0 saves the final full model and optimizer state here (torch.save)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # ranks share the cores; a fixed reduction order (bitwise resume)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")  # env:// (torchrun sets the variables)
    rank, world = dist.get_rank(), dist.get_world_size()
    log = (lambda *a: print("[rank0]", *a, flush=True)) if rank == 0 else (lambda *a: None)

    ds = CharWindows(make_corpus())
    sampler = ResumableSampler(DistributedSampler(ds, num_replicas=world, rank=rank, seed=SEED, drop_last=True),
                               batch_size=args.batch_size)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(SEED)  # identical initial weights on every rank; each keeps its shard
    model = CharTransformer(len(ds.chars))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps, pct_start=0.2)
    for seed in (torch.manual_seed, random.seed, np.random.seed):  # per-rank dropout and augmentation streams
        seed(SEED + 1 + rank)
    ck = Checkpointer(args.dir, comm=TorchDistComm(), keep_last=args.keep_last)

    def sharded_state() -> dict:
        msd, osd = get_state_dict(model, opt, options=SHARDED)
        return {"model": msd, "optimizer": osd, "scheduler": sched.state_dict()}

    step, epoch, resumed_from = 0, 0, None
    # Only when there is a checkpoint: get_state_dict() gives a fresh optimizer its state by taking a
    # zero-gradient step (AdamW's step count becomes 1), which a fresh run must not have.
    if ck.latest_step() is not None:
        state = sharded_state()  # the shapes to fill: this rank's chunks
        restored = ck.restore(into=state)  # a collective: every rank agrees, reads what its chunks need
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = resumed_from = restored.step
        on_start = None
        if restored.local is not None:  # None on a rank that had no writer (more ranks than before)
            rng = restored.local["rng"]
            set_rng_state(rng)
            # The DataLoader draws its seed from the global RNG when the resumed iteration starts
            # (mid-epoch, unlike the uninterrupted run): put the restored RNG back after that draw.
            on_start = lambda: set_rng_state(rng)  # noqa: E731
        # The position is the epoch's global order and how much of it all ranks consumed: the same
        # on every rank, so writer 0's serves a new rank, and the rest is split among the ranks now.
        epoch, done = sampler.resume_at(restored.first["data"], on_start)
        log(f"RESUMED from step {step} on {world} rank(s) (written by {restored.manifest.world_size}); "
            f"epoch {epoch}, {done} samples of it already done")
    else:
        log(f"fresh start on {world} rank(s): {len(sampler)} samples per rank and epoch")

    loss = torch.tensor(float("nan"))
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y, _ids in loader:  # CharWindows yields each window's id too (plain_train.py --record)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            sampler.note_step()
            step += 1
            if step % 10 == 0:
                log(f"step {step:>4}/{args.steps}  epoch {epoch}  loss {loss.item():.4f}")
            if args.every and step % args.every == 0:
                ck.save(sharded_state(), step, local={"rng": rng_state(), "data": sampler.data_position()})
            if step == args.kill_at_step and resumed_from is None:  # a fresh run only: no crash loop
                ck.wait()  # the crash comes after every checkpoint taken so far committed
                log(f"simulated crash: SIGKILL right after step {step}")
                # torchrun stops the other ranks as soon as one dies: without this, a rank whose wait()
                # returned first killed rank 0 (SIGTERM) before it said so (seen once under load)
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= args.steps:
                break
        epoch += 1

    ck.wait()
    for r in ck.records:
        log(f"checkpoint step {r.step}: stall {r.stall_s * 1e3:.1f} ms, persist {r.persist_s * 1e3:.1f} ms, "
            f"{r.bytes / 2**10:.0f} KiB on this rank{'' if r.committed else ' [not committed]'}")
    if args.out_weights:  # a collective (every rank gathers), then rank 0 writes the whole state
        msd, osd = get_state_dict(model, opt, options=FULL)
        if rank == 0:
            torch.save({"model": msd, "optimizer": osd, "step": step}, args.out_weights)
    log(f"done: step {step}, last rank-0 loss {loss.item():.4f}")
    ck.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
