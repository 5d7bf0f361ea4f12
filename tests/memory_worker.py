"""One rank of a real job with a node-memory level (gloo, CPU), driven by test_memory_level.py.

Usage: ``python memory_worker.py MODE MEM DISK OUT [STEPS]`` with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
and ``CKPT_NODE`` (the simulated node) in the environment. The levels are the memory level at ``MEM``
(job ``test``, ``REPLICAS`` replicas, default 1) and, unless ``DISK`` is ``-``, a disk level at ``DISK``
(``HOLD_DISK=1`` holds its data-file writes at a gate that never opens: a disk that never receives a
checkpoint, so only memory has the newest ones).

Modes:

* ``save``: save ``make_state(s)`` / ``make_local(s, rank)`` for s in 1..STEPS, ``wait()`` after each,
  then ``wait(flush=True)`` unless the disk is held; write the counters, print ``saved``, then stay
  alive (the test SIGKILLs every rank: nothing is closed);
* ``restore``: ``latest_step()``, then ``restore()``; write both steps (``None`` when there was no
  checkpoint), the level, digests of the state and of this rank's local, the warnings; then ``close()``;
* ``loop``: ``restore()`` (``restored <step> <level> <ok>``: ok when the state and this rank's local
  are those of that step), then save every step from there until SIGKILLed, printing
  ``committed <step>`` once ``wait()`` returned (this rank's part is in its node's memory) and
  ``replica_failed <n>`` when that counter grows. With ``LOCKSTEP=1`` a barrier follows every step,
  as training's collectives keep ranks within a step of each other; without, ranks go on when a
  peer dies;
* ``train``: see :func:`train` (tests/test_memory_nodes.py: nodes lost, replaced, removed, added).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from worker_exit import leave  # noqa: E402
from ckpt_engine import Checkpointer, CheckpointWarning, TorchDistComm  # noqa: E402
from ckpt_engine.testing import GatedStorage  # noqa: E402
from dist_worker import digest, make_local, make_state, write_result  # noqa: E402


def levels(mem: str, disk: str) -> list:
    out: list = [{"kind": "memory", "path": mem, "job": "test", "replicas": int(os.environ.get("REPLICAS", "1")),
                  "keep_last": int(os.environ.get("KEEP_MEM", "2"))}]
    if disk != "-":
        level2 = GatedStorage(disk)
        if os.environ.get("HOLD_DISK") != "1":
            level2.gate.set()
        out.append({"path": level2, "keep_last": 3})
    return out


# ---- a tiny training job whose sums do not depend on the number of ranks' order of arrival --------------
SAMPLES, BATCH = 96, 24
"""A global batch of 24 samples: 2, 4, 6 or 8 ranks split it evenly; 4 steps an epoch."""
EPOCH_STEPS = SAMPLES // BATCH


def samples(step: int, rank: int, world: int) -> list[int]:
    """What rank ``rank`` of ``world`` trains on at global step ``step`` (from 1): the step's global
    batch (the epoch's seeded order, ``BATCH`` at a time), split as a ``DistributedSampler`` splits."""
    epoch, k = divmod(step - 1, EPOCH_STEPS)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + epoch)).tolist()
    return order[k * BATCH:(k + 1) * BATCH][rank::world]


def _step(model: torch.nn.Sequential, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
          local: dict, world: int) -> None:
    """One step: per-rank noise from this rank's generator, gradients summed over the ranks in rank
    order (an all-gather of one flattened gradient: the same sum on every rank, bit for bit, whatever
    the transport), and a per-rank running mean of the hidden layer (as BatchNorm keeps)."""
    gen = torch.Generator()
    gen.set_state(local["rng"])
    h = torch.tanh(model[0](x) + 0.01 * torch.randn(len(x), 8, generator=gen))
    loss = ((model[2](h) - y) ** 2).sum() / BATCH
    opt.zero_grad(set_to_none=True)
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    total = gathered[0].clone()
    for g in gathered[1:]:
        total += g
    offset = 0
    for p in model.parameters():
        p.grad.copy_(total[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    opt.step()
    local["rng"] = gen.get_state()
    local["running"].mul_(0.9).add_(h.detach().mean(0), alpha=0.1)


def _part_sizes(ck: Checkpointer, step: int, rank: int) -> dict:
    """This rank's part of the checkpoint of ``step`` in its node's memory: data, index, commit bytes."""
    own = ck.levels[0]
    [name] = [n for n in own.listdir("") if n.startswith(f"step-{step:012d}-")]
    files = (f"rank-{rank:05d}.bin", f"rank-{rank:05d}.index.json", "rank-commit.json")
    data, index, commit = (os.path.getsize(own.path(f"{name}/{f}")) for f in files)
    return {"data": data, "part": data + index + commit}


def train(mem: str, disk: str, out: str, rank: int, world: int) -> None:
    """A tiny model (6 -> 8 -> 2, AdamW) and a 4 MiB ``ballast`` tensor that never changes, trained to
    step ``STEPS``; resumed with ``restore()`` when a level has a checkpoint (a rank without a writer
    takes writer 0's running mean and keeps its own noise stream). A checkpoint at every step up to
    ``SAVE_UNTIL`` (default none); after step ``DISK_UNTIL`` (and a flush) the disk takes no more.

    Writes to OUT, per rank: ``restored-rank-R.pt`` (what ``restore()`` returned, before training
    touches it, and its warnings), ``saved-S-rank-R.pt`` at each checkpoint and ``final-rank-R.pt``
    (state and local), ``rank-R.json`` (the samples of each step, each checkpoint's part sizes and
    replication bytes, the restore's :class:`~ckpt_engine.levels.assemble.Assembly`). Prints ``done``;
    then stays alive with ``KILL=1`` (the test SIGKILLs it: nothing closed), else closes."""
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(SAMPLES, 6, generator=data), torch.randn(SAMPLES, 2, generator=data)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    init = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=init))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    ballast = torch.randn(1 << 20, generator=torch.Generator().manual_seed(13))
    local = {"rng": torch.Generator().manual_seed(1000 + rank).get_state(), "running": torch.zeros(8)}
    specs = levels(mem, disk)
    ck = Checkpointer(levels=specs, comm=TorchDistComm(), on_error="warn")
    result: dict = {"rank": rank, "ids": {}, "replication": [], "assembly": None, "restored": None}
    step = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.perf_counter()
        r = ck.restore()  # None: nothing committed
        seconds = time.perf_counter() - started
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    if r is not None:
        restored = {"state": r.state, "local": r.local, "first": r.first}
        torch.save(restored, os.path.join(out, f"restored-rank-{rank}.pt"))
        assembly = ck._dest.assembly
        result.update(restored={"step": r.step, "level": r.level, "writers": r.manifest.world_size,
                                "seconds": seconds, "warnings": said},
                      assembly=None if assembly is None else dataclasses.asdict(assembly))
        model.load_state_dict(r.state["model"])
        opt.load_state_dict(r.state["optimizer"])
        step = r.state["epoch"] * EPOCH_STEPS + r.state["done"]
        local = r.local if r.local is not None else {"rng": local["rng"], "running": r.first["running"].clone()}
    counted = {"sent": 0, "received": 0}
    while step < int(os.environ["STEPS"]):
        step += 1
        ids = samples(step, rank, world)
        result["ids"][step] = ids
        _step(model, opt, xs[ids], ys[ids], local, world)
        if step <= int(os.environ.get("SAVE_UNTIL", "0")):
            epoch, done = divmod(step, EPOCH_STEPS)
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "done": done,
                     "ballast": ballast}
            ck.save(state, step, local)
            torch.save({"state": state, "local": local}, os.path.join(out, f"saved-{step}-rank-{rank}.pt"))
            ck.wait()  # committed in this node's memory and replicated to the peers
            now = {"sent": ck.counters.get("replica_sent_bytes", 0), "received": ck.counters.get("replica_bytes", 0)}
            result["replication"].append({"step": step, **_part_sizes(ck, step, rank),
                                          **{k: now[k] - counted[k] for k in now}})
            counted = now
            if step == int(os.environ.get("DISK_UNTIL", "0")):
                ck.wait(flush=True)
                specs[1]["path"].gate.clear()
    epoch, done = divmod(step, EPOCH_STEPS)
    torch.save({"state": {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "done": done},
                "local": local}, os.path.join(out, f"final-rank-{rank}.pt"))
    write_result(out, rank, result)
    print("done", flush=True)
    if os.environ.get("KILL") == "1":
        time.sleep(600)
    ck.close()


def loop(ck: Checkpointer, rank: int) -> None:
    r = ck.restore()
    if r is not None:
        ok = digest(r.state) == digest(make_state(r.step)) and digest(r.local) == digest(make_local(r.step, rank))
        print(f"restored {r.step} {r.level} {ok}", flush=True)
        step = r.step
    else:
        print("restored none", flush=True)
        step = 0
    failed = 0
    while True:
        step += 1
        ck.save(make_state(step), step, make_local(step, rank))
        ck.wait()
        print(f"committed {step}", flush=True)
        if os.environ.get("LOCKSTEP") == "1":
            dist.barrier()
        if ck.counters.get("replica_failed", 0) > failed:
            failed = ck.counters["replica_failed"]
            print(f"replica_failed {failed}", flush=True)


def main() -> None:
    mode, mem, disk, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)  # several ranks share 2 cores in tests
    if mode == "train":
        train(mem, disk, out, rank, dist.get_world_size())
        dist.destroy_process_group()
        return
    ck = Checkpointer(levels=levels(mem, disk), comm=TorchDistComm(), on_error="warn")
    result: dict = {"rank": rank}
    if mode == "save":
        for step in range(1, int(sys.argv[5]) + 1):
            ck.save(make_state(step), step, make_local(step, rank))
            ck.wait()
        if disk != "-" and os.environ.get("HOLD_DISK") != "1":
            ck.wait(flush=True)
        result.update(counters=dict(ck.counters))
        write_result(out, rank, result)
        print("saved", flush=True)
        time.sleep(600)
    elif mode == "loop":
        loop(ck, rank)
    elif mode == "restore":
        latest = ck.latest_step()  # what a script asks first (examples/plain_train.py)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = ck.restore()
            if r is not None:
                result.update(step=r.step, level=r.level, state=digest(r.state), local=digest(r.local))
            else:  # a script starts afresh: restore() said why in a warning
                result.update(step=None)
        result.update(latest=latest, failures=ck.load_failures,
                      warnings=[str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)])
        ck.close()
        write_result(out, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()
