"""Plain PyTorch DDP training (no Lightning) with ckpt_engine checkpoints and exact resume.

A tiny character-level transformer language model, trained with DistributedDataParallel on 2
gloo ranks on CPU. Every ``--every`` steps it saves a checkpoint with :class:`Checkpointer`:

* ``state`` (replicated, sliced across ranks): model, optimizer, LR scheduler, step, and the order
  DDP's gradients become ready (:class:`DDPBucketOrder`: replayed after a restore so that DDP, with
  its default arguments, reduces as the uninterrupted run on any number of ranks);
* ``local`` (per rank, whole): torch / Python / NumPy RNG states and the resumable sampler's data
  position (the epoch's global order and how much of it all ranks consumed).

When the checkpoint directory already holds a committed checkpoint, the run resumes from the
newest one: same weights, optimizer moments, LR schedule, RNG streams and the exact sample where
the interrupted epoch stopped, so an uninterrupted run and a killed-then-resumed run end with
bitwise-identical weights, on 2 ranks or more. Resumed on another number of ranks, the state is
the same and the rest of the interrupted epoch is re-split among the ranks, each sample once; the
training after it sums other partial gradients and is not the uninterrupted run's, bit for bit.

Launch with torchrun::

    torchrun --nproc-per-node 2 examples/plain_train.py --steps 120 --every 10 --dir /tmp/ck

or start the ranks yourself with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE in the
environment (that is what ``examples/demo.py`` does). ``--kill-at-step K`` makes every rank
SIGKILL itself right after step K, to simulate a crash; run the same command again and it
resumes. torchrun can also restart it for you (the kill fires only in the first incarnation)::

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/plain_train.py \
        --dir /tmp/ck --kill-at-step 73

(``--standalone`` matters: with torch 2.13's default static rendezvous the restarted ranks fail
to reconnect in gloo's connectFullMesh.)

With ``--memory /dev/shm/ckpt-suite`` the checkpoints commit in each node's memory first, each rank's
part replicated to a rank on another node, and ``--dir`` receives them in the background: on two
nodes (``--nnodes 2 --node-rank 0|1 --master-addr HOST``) a job that lost a node resumes from the
other node's memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import signal
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

try:
    from ckpt_engine import Checkpointer, DDPBucketOrder, TorchDistComm
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from ckpt_engine import Checkpointer, DDPBucketOrder, TorchDistComm
from ckpt_engine import ResumableSampler

SEQ = 64
SEED = 1234

# ---- data: a synthetic corpus, generated deterministically (no downloads) -------------------------

_SUBJECTS = ["the old sailor", "a quiet engineer", "my neighbour", "the tired cat", "every student",
             "the small robot", "a travelling merchant", "the night guard", "our teacher", "the baker"]
_VERBS = ["repairs", "watches", "paints", "remembers", "carries", "forgets", "measures", "follows",
          "builds", "describes"]
_OBJECTS = ["the broken clock", "a red lantern", "the river bank", "an empty bottle", "the long road",
            "a wooden boat", "the morning train", "a paper map", "the stone bridge", "a quiet garden"]
_TAILS = ["before dawn", "in the rain", "without a word", "every tuesday", "with great care",
          "near the harbour", "after supper", "for the third time", "as the bells ring", "alone"]


def make_corpus(n_sentences: int = 900, seed: int = SEED) -> str:
    """About 40 KB of simple English-like text from a fixed seed (own RNG: global RNG untouched)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.6:
            s += f" {rng.choice(_TAILS)}"
        out.append(s.capitalize() + rng.choice([".", ".", ".", "!", "?"]))
    return " ".join(out)


class CharWindows(Dataset):
    """Windows of ``SEQ + 1`` characters with light augmentation drawn from the *global* RNGs.

    The start of each window is jittered with Python's ``random`` and a few input characters
    are replaced using NumPy's global RNG. That makes the data depend on both RNG streams, so
    the exact-resume proof fails unless the checkpoint restores them (it does, per rank).
    """

    def __init__(self, text: str, stride: int = 32, jitter: int = 8, noise: float = 0.02) -> None:
        self.chars = sorted(set(text))
        self.data = torch.tensor([self.chars.index(c) for c in text], dtype=torch.long)
        self.stride, self.jitter, self.noise = stride, jitter, noise
        self.n = (len(self.data) - SEQ - 1 - jitter) // stride

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        start = i * self.stride + random.randrange(self.jitter)
        chunk = self.data[start:start + SEQ + 1]
        x, y = chunk[:-1].clone(), chunk[1:]
        flip = torch.from_numpy(np.random.random_sample(SEQ) < self.noise)
        x[flip] = torch.from_numpy(np.random.randint(0, len(self.chars), SEQ))[flip]
        return x, y, i  # the window's id: --record writes which samples each step trained on


# ---- model: a 2-layer pre-norm GPT-style character LM ---------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))
        self.attn_drop, self.resid_drop = nn.Dropout(dropout), nn.Dropout(dropout)
        self.register_buffer("causal", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)), persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = self.attn_drop(att.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(-1))
        return self.resid_drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, d)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, d: int = 128, layers: int = 2, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, SEQ, d))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(d, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: the checkpoint stores this tensor once
        for m in self.modules():  # GPT-2 style init: small logits at start
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos[:, :idx.shape[1]])
        return self.head(self.ln_f(self.blocks(x)))


# ---- checkpoint helpers ---------------------------------------------------------------------------

def rng_snapshot(data: dict[str, Any]) -> dict[str, Any]:
    """This rank's ``local``: RNG streams and the sampler's data position (plain values and tensors only)."""
    return {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(), "data": data}


def rng_restore(local: dict[str, Any]) -> None:
    torch.set_rng_state(local["torch_rng"])
    random.setstate(local["python_rng"])
    np.random.set_state(local["numpy_rng"])


def fmt_record(r: Any) -> str:
    gbps = r.bytes / r.persist_s / 1e9 if r.persist_s > 0 else float("nan")
    return (f"ckpt step {r.step:>4}: stall {r.stall_s * 1e3:7.2f} ms (snapshot {r.snapshot_s * 1e3:6.2f} ms)"
            f"  persist {r.persist_s * 1e3:7.2f} ms  commit {r.commit_s * 1e3:7.2f} ms"
            f"  {r.bytes / 2**20:6.2f} MiB (this rank)  {gbps:5.2f} GB/s"
            + ("" if r.committed else "  [not committed]"))


# ---- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120, help="total optimizer steps")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps (0: never)")
    p.add_argument("--dir", required=True, help="checkpoint root (local path or fsspec URL)")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--memory", default=None, metavar="TMPFS_DIR",
                   help="a node-memory level first (e.g. /dev/shm/ckpt-suite), --dir flushed from it")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--kill-at-step", type=int, default=None,
                   help="SIGKILL every rank right after this step (first incarnation only under torchrun)")
    p.add_argument("--out-weights", default=None, help="rank 0 saves the final weights here (torch.save)")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="every rank appends the sample ids of each step to DIR/seen-rank<r>.jsonl and saves its "
                        "final model and optimizer state to DIR/final-rank<r>.pt (to check a resume, rank by rank)")
    p.add_argument("--metrics", default=None, help="rank 0 writes timings as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Two ranks share two cores: one intra-op thread each avoids oversubscription (which would
    # slow every step and make timings noisy) and leaves the checkpoint's background persist
    # thread room to run. It also fixes the reduction order of CPU kernels independently of the
    # machine's core count, which the bitwise resume proof relies on.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")  # env:// (torchrun or examples/demo.py sets the variables)
    rank, world = dist.get_rank(), dist.get_world_size()
    log = (lambda *a: print("[rank0]", *a, flush=True)) if rank == 0 else (lambda *a: None)

    corpus = make_corpus()
    ds = CharWindows(corpus)
    torch.manual_seed(SEED)  # identical initial weights on every rank
    model = CharTransformer(len(ds.chars))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps, pct_start=0.2)
    # Resumable: the position is the epoch's global order and how much of it all ranks consumed, so a
    # resume continues at the next unseen sample, also on another number of ranks (the rest re-split).
    sampler = ResumableSampler(DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=SEED,
                                                  drop_last=True), batch_size=args.batch_size)
    # A dedicated generator: a DataLoader draws a seed per iterator, and drawing it from the
    # global torch RNG would shift the dropout stream differently in a resumed run.
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator().manual_seed(SEED))
    per_epoch = len(sampler) // args.batch_size
    # Per-rank streams for dropout and augmentation (ranks must not share masks or noise).
    torch.manual_seed(SEED + 1 + rank)
    random.seed(SEED + 1 + rank)
    np.random.seed(SEED + 1 + rank)

    where = {"path": args.dir}
    if args.memory:  # node memory first (replicated to a rank of another node), the directory flushed from it
        where = {"levels": [{"kind": "memory", "path": args.memory}, args.dir]}
    ck = Checkpointer(**where, comm=TorchDistComm(), keep_last=args.keep_last)
    # DDP with its defaults rebuilds its gradient buckets after the first backward, in the order the
    # gradients became ready; DDPBucketOrder records that order and, after a restore, replays it, so a
    # resumed process reduces (and on more than 2 ranks rounds) exactly as the uninterrupted run.
    ddp = DDP(model)
    buckets = DDPBucketOrder(ddp)
    if args.record:
        os.makedirs(args.record, exist_ok=True)
    step, epoch, resumed_from, restore_s = 0, 0, None, None
    t0 = time.perf_counter()
    restored = ck.restore()  # every rank: the newest checkpoint every rank can read, verified; None: none yet
    if restored is not None:
        restore_s = time.perf_counter() - t0
        state = restored.state
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        buckets.load_state_dict(state.get("ddp"))  # every rank: one zero-valued warm-up step
        on_start = None
        if restored.local is not None:  # None on a rank that had no writer (more ranks than before)
            rng_restore(restored.local)
            # The DataLoader draws its seed when the resumed iteration starts: put the RNG back after.
            on_start = lambda: rng_restore(restored.local)  # noqa: E731
        epoch, done = sampler.resume_at(restored.first["data"], on_start)  # the same on every rank
        step = resumed_from = restored.step
        log(f"RESUMED from committed checkpoint at step {step} on {world} rank(s), written by "
            f"{restored.manifest.world_size} (epoch {epoch}, {done} of its samples already consumed; RNG "
            f"streams restored per rank; read + verified in {restore_s * 1e3:.1f} ms)")
        if args.record:  # the state as restored, to compare with the checkpoint's writer
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                       os.path.join(args.record, f"restored-rank{rank}.pt"))
    else:
        log(f"fresh start: {sum(p.numel() for p in model.parameters()):,} parameters, corpus {len(corpus):,} chars, "
            f"vocab {len(ds.chars)}, {len(ds)} windows, {per_epoch} steps/epoch x {world} ranks x {args.batch_size}")

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    step_times: list[float] = []
    reported = 0
    t_start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    seen = open(os.path.join(args.record, f"seen-rank{rank}.jsonl"), "a") if args.record else None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y, ids in loader:
            if seen:
                seen.write(json.dumps({"step": step + 1, "epoch": epoch, "ids": ids.tolist()}) + "\n")
                seen.flush()
            t0 = time.perf_counter()
            logits = ddp(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            sampler.note_step()
            step += 1
            step_times.append(time.perf_counter() - t0)
            if step % 10 == 0:
                log(f"step {step:>4}/{args.steps}  epoch {epoch}  loss {loss.item():.4f}  "
                    f"lr {sched.get_last_lr()[0]:.2e}")
            if args.every and step % args.every == 0:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                         "scheduler": sched.state_dict(), "step": step, "ddp": buckets.state_dict()}
                ck.save(state, step, local=rng_snapshot(sampler.data_position()))
            while reported < len(ck.records) and (ck.records[reported].committed or ck.records[reported].skipped):
                log(fmt_record(ck.records[reported]))
                reported += 1
            if step == args.kill_at_step and not restarted:
                log(f"simulated crash: SIGKILL right after step {step}")
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= args.steps:
                break
        epoch += 1

    train_s = time.perf_counter() - t_start
    if seen:
        seen.close()
    ck.wait()
    for r in list(ck.records)[reported:]:
        log(fmt_record(r))
    log(f"done: step {step}, final rank-0 loss {loss.item():.4f}, {train_s:.1f} s of training")
    mine = [{"step": r.step, "bytes": r.bytes, "stall_s": r.stall_s, "snapshot_s": r.snapshot_s,
             "persist_s": r.persist_s, "commit_s": r.commit_s, "committed": r.committed} for r in ck.records]
    records = ck.comm.all_gather(mine)  # the engine's JSON collective: no pickle
    if rank == 0 and args.metrics:
        with open(args.metrics, "w") as f:
            json.dump({"world_size": world, "resumed_from": resumed_from, "restore_s": restore_s,
                       "steps": step, "train_s": train_s,
                       "step_times": step_times, "final_loss": loss.item(), "records": records}, f)
    if rank == 0 and args.out_weights:
        torch.save(model.state_dict(), args.out_weights)
    if args.record:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(args.record, f"final-rank{rank}.pt"))
    ck.close()
    # Free DDP (its C++ Reducer holds the process group) before destroying the group. Otherwise
    # the group's last reference can drop inside the Reducer's destructor, which runs with the
    # GIL held, while a gloo worker thread needs the GIL to free a finished collective's tensors:
    # an intermittent hang at exit (torch 2.13, same family as pytorch/pytorch#56297).
    del ddp
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
