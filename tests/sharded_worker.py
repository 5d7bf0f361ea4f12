"""One rank of a real sharded job (FSDP2, HSDP, FSDP2 + tensor parallel, DDP) on CPU with gloo.

Usage: ``python sharded_worker.py MODE LAYOUT ROOT OUT [STEPS]``, with RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT in the environment (``LAYOUT single`` runs alone, without torch.distributed). Layouts:

* ``fsdp``: ``fully_shard`` on a 1-D mesh of every rank (uneven shards: the last layer is 6 x 3);
* ``hsdp``: ``fully_shard`` on a 2-D mesh (replicate x shard), ``WORLD_SIZE / 2`` x 2 (``hsdp:RxS``: R x S);
* ``fsdp_tp``: tensor parallel (colwise, rowwise) on the inner mesh dimension of 2, FSDP2 on the outer
  (``fsdp_tp:DxT``: D x T);
* ``ddp``: ``DistributedDataParallel``, every tensor replicated;
* ``single``: one process, a plain module.

With ``SHARDED_LEVELS=1`` in the environment the checkpoints go to a node-local level 1
(``ROOT/node{rank}``) flushed to a shared level 2 (``ROOT/shared``); with ``SHARDED_LEVELS=memory``
to a memory level (``ROOT/mem``, job ``sharded``, the node from ``CKPT_NODE``) flushed to ``ROOT/shared``; with ``SHARDED_COUNT=1`` the
``load`` mode writes the bytes it read from data files to ``OUT/read-RANK.json``.

Modes:

* ``save``: train STEPS steps with AdamW, save the sharded state (``get_state_dict``) at STEPS, then
  (rank 0) write the full state at STEPS and after two more steps to OUT (``torch.save``);
* ``load``: a fresh model of LAYOUT on this world size, ``restore(into=...)`` + ``set_state_dict``,
  then write its full state at once and after two more steps (rank 0) to OUT;
* ``loop``: resume from the newest checkpoint if there is one (``resumed N``), then save the sharded
  state every step until killed, printing ``saved N`` lines;
* ``train``: ``train LAYOUT[,LAYOUT...] ROOT OUT STEPS EVERY [KILL_AT]``: each layout trains as a user
  would (:class:`Training`: a sampler over the data-parallel ranks, dropout, clipping, a schedule),
  side by side, resuming from its newest checkpoint under ``ROOT/<layout>``; a fresh job SIGKILLs
  every rank after step KILL_AT. Every rank appends the sample ids of each step to
  ``OUT/seen-<layout>-rank<r>.jsonl`` and writes its final state, its own chunks, to
  ``OUT/final-<layout>-rank<r>.pt`` (``:`` in a layout becomes ``-``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from itertools import islice

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from worker_exit import leave  # noqa: E402
from ckpt_engine import Checkpointer  # noqa: E402
from ckpt_engine.sharding.dtensors import is_dtensor  # noqa: E402
from ckpt_engine.training.resumable import ResumableSampler, rng_state, set_rng_state  # noqa: E402

MODES = ("save", "load", "loop", "train")


def make_model(seed: int, dropout: float = 0.0) -> nn.Module:
    """A tiny network of uneven shards; ``dropout`` > 0 appends a ``Dropout`` (per-rank random streams)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(13, 8), nn.ReLU(), nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 3)]
    return nn.Sequential(*layers, *([nn.Dropout(dropout)] if dropout else []))


def mesh_shape(layout: str, world: int) -> tuple[int, int]:
    """The 2-D mesh of ``hsdp`` / ``fsdp_tp`` (``hsdp:2x4``: 2 x 4; default ``world / 2`` x 2)."""
    shape = layout.partition(":")[2]
    outer, inner = (int(n) for n in shape.split("x")) if shape else (world // 2, 2)
    if outer * inner != world:
        raise SystemExit(f"layout {layout}: a {outer} x {inner} mesh needs {outer * inner} ranks, not {world}")
    return outer, inner


def data_split(layout: str, rank: int, world: int) -> tuple[int, int]:
    """``(replicas, index)``: how many data-parallel ranks split each batch and this rank's index among
    them. Tensor parallel ranks of one data-parallel index (the inner mesh dimension) see the same data;
    every other layout is data parallel on all ranks (HSDP's replicate and shard dimensions alike)."""
    if layout.partition(":")[0] == "fsdp_tp":
        dp, tp = mesh_shape(layout, world)
        return dp, rank // tp
    return world, rank


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 13, generator=torch.Generator().manual_seed(step))


def build(layout: str, seed: int, dropout: float = 0.0):
    """The model of ``layout`` on this process's ranks, its AdamW, and the communicator."""
    model = make_model(seed, dropout)
    if layout == "single":
        return model, torch.optim.AdamW(model.parameters(), lr=0.01), None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckpt_engine import TorchDistComm

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world, kind = dist.get_world_size(), layout.partition(":")[0]
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "hsdp":
        mesh = init_device_mesh("cpu", mesh_shape(layout, world), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    elif kind == "fsdp_tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", mesh_shape(layout, world), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    elif kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        raise SystemExit(f"unknown layout {layout}")
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), TorchDistComm()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        opt.step()


def sharded_state(model, opt, layout: str) -> dict:
    """What a user checkpoints: the model's and optimizer's state as they are sharded (no gather)."""
    if layout == "single":
        return {"model": model.state_dict(), "optim": _fqn_optim(model, opt)}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=False, cpu_offload=False))
    return {"model": msd, "optim": osd}


def full_state(model, opt, layout: str) -> dict | None:
    """The whole state on rank 0 (``None`` elsewhere), keyed as ``get_state_dict`` keys it."""
    if layout == "single":
        return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": _fqn_optim(model, opt)}
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _cloned({"model": msd, "optim": osd}) if dist.get_rank() == 0 else None


def _cloned(value):
    """A deep copy of the tensors (``step`` tensors are the optimizer's own objects)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


def _fqn_optim(model, opt) -> dict:
    """A plain optimizer's state keyed by parameter names, as ``get_state_dict`` keys it."""
    names = {id(p): n for n, p in model.named_parameters()}
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {names[id(params[i])]: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for i, s in sd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(params[i])] for i in g["params"]]}
              for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_into(model, opt, layout: str, state: dict) -> None:
    if layout == "single":
        model.load_state_dict(state["model"])
        names = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        osd = {"state": {names[k]: v for k, v in state["optim"]["state"].items()},
               "param_groups": [{**g, "params": [names[n] for n in g["params"]]} for g in state["optim"]["param_groups"]]}
        opt.load_state_dict(osd)
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


SAMPLES, BATCH = 64, 4
"""The ``train`` mode's data set (ids 0..63) and batch per data-parallel rank."""


class Training:
    """One layout's job in ``train`` mode, as a user writes it: a sharded model with AdamW, a StepLR,
    dropout, a ``DistributedSampler`` (over the data-parallel ranks) made resumable, gradient clipping,
    a checkpoint of the sharded state every ``every`` steps (the random streams and data position per
    rank), and a resume from the newest committed one. Several layouts train side by side in one
    process (one job start for all); each has random streams of its own, swapped in around its step,
    so it runs as if it were alone."""

    def __init__(self, layout: str, root: str, out: str, every: int) -> None:
        import torch.distributed as dist
        from torch.utils.data import DistributedSampler

        self.layout, self.every, self.out = layout, every, out
        self.model, self.opt, comm = build(layout, seed=0, dropout=0.25)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=4, gamma=0.5)
        self.rank = dist.get_rank()
        replicas, index = data_split(layout, self.rank, dist.get_world_size())
        split = DistributedSampler(range(SAMPLES), replicas, index, seed=7, drop_last=True)
        self.sampler = ResumableSampler(split, batch_size=BATCH)
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(SAMPLES, 13, generator=g), torch.randn(SAMPLES, 3, generator=g)
        # per data-parallel rank streams (dropout): tensor parallel ranks of one index draw the same
        # masks, or the chunks they hold as replicas would drift apart
        for seed in (torch.manual_seed, random.seed, np.random.seed):
            seed(100 + index)
        self.rng, self.step, self.epoch, self.batches = rng_state(), 0, 0, None
        self.ck = Checkpointer(os.path.join(root, layout.replace(":", "-")), comm=comm)
        self.resumed_from = self._resume() if self.ck.latest_step() is not None else None

    def state(self) -> dict:
        return {**sharded_state(self.model, self.opt, self.layout), "sched": self.sched.state_dict()}

    def _resume(self) -> int:
        state = self.state()  # the shapes to fill (get_state_dict gives the optimizer its state)
        restored = self.ck.restore(into=state)
        load_into(self.model, self.opt, self.layout, state)
        self.sched.load_state_dict(state["sched"])
        self.step, self.rng = restored.step, restored.local["rng"]
        set_rng_state(self.rng)
        self.epoch, _ = self.sampler.resume_at(restored.first["data"])
        return restored.step

    def _next_ids(self) -> list[int]:
        while True:
            if self.batches is None:
                self.sampler.set_epoch(self.epoch)
                self.batches = iter(self.sampler)
            ids = list(islice(self.batches, BATCH))
            if len(ids) == BATCH:
                return ids
            self.batches, self.epoch = None, self.epoch + 1

    def train_step(self) -> None:
        """One optimizer step with this layout's random streams; a checkpoint when one is due."""
        set_rng_state(self.rng)
        ids = self._next_ids()
        self.opt.zero_grad(set_to_none=True)
        (self.model(self.x[ids]) - self.y[ids]).pow(2).mean().backward()
        clip_grad_norm(list(self.model.parameters()), 0.5)
        self.opt.step()
        self.sched.step()
        self.sampler.note_step()
        self.step += 1
        self.rng = rng_state()
        with open(self._path("seen", "jsonl"), "a") as f:
            f.write(json.dumps({"step": self.step, "epoch": self.epoch, "ids": ids}) + "\n")
        if self.step % self.every == 0:
            self.ck.save(self.state(), self.step, local={"rng": self.rng, "data": self.sampler.data_position()})

    def finish(self) -> None:
        """This rank's final state as it holds it (its own chunks, ``to_local()``) and torch's random
        stream (dropout's) to ``OUT``."""
        self.ck.wait()
        state = self.state()
        torch.save({"state": _local(state), "rng": self.rng["torch"], "step": self.step,
                    "resumed_from": self.resumed_from}, self._path("final", "pt"))
        self.ck.close()

    def _path(self, what: str, ext: str) -> str:
        return os.path.join(self.out, f"{what}-{self.layout.replace(':', '-')}-rank{self.rank}.{ext}")


def clip_grad_norm(params: list, max_norm: float) -> None:
    """``clip_grad_norm_`` for parameters on several meshes (FSDP2 + tensor parallel: torch's refuses
    to stack norms of different meshes): one norm per mesh, each reduced over its mesh, then combined."""
    groups: dict = {}
    for p in params:
        groups.setdefault(p.device_mesh if is_dtensor(p) else None, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups.values()]
    total = torch.stack([n.full_tensor() if is_dtensor(n) else n for n in norms]).norm()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def _local(value):
    """``value`` with every ``DTensor`` replaced by a copy of this rank's chunk (``to_local()``)."""
    if is_dtensor(value):
        return value.to_local().detach().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    return _cloned(value)


def train_jobs(layouts: list[str], root: str, out: str, steps: int, every: int, kill_at: int | None) -> None:
    """``train`` mode: every layout trains to ``steps`` side by side (resuming where a checkpoint is);
    a fresh job SIGKILLs every rank right after step ``kill_at`` (once the checkpoints taken so far
    are committed: the newest one is then known)."""
    import torch.distributed as dist

    jobs = [Training(layout, root, out, every) for layout in layouts]
    start = jobs[0].step
    assert all(job.step == start for job in jobs), [job.step for job in jobs]
    for step in range(start + 1, steps + 1):
        for job in jobs:
            job.train_step()
        if step == kill_at and start == 0:
            for job in jobs:
                job.ck.wait()
            dist.barrier()  # no rank dies while another still waits for its commit
            os.kill(os.getpid(), signal.SIGKILL)
    for job in jobs:
        job.finish()
    dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    mode, layout, root, out = sys.argv[1:5]
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    if mode == "train":  # train LAYOUT[,LAYOUT...] ROOT OUT STEPS EVERY [KILL_AT]
        kill_at = int(sys.argv[7]) if len(sys.argv) > 7 else None
        train_jobs(layout.split(","), root, out, steps, int(sys.argv[6]), kill_at)
        return
    rank = int(os.environ.get("RANK", "0"))
    model, opt, comm = build(layout, seed=0 if mode != "load" else 99)
    if os.environ.get("SHARDED_LEVELS") == "memory":  # node memory (CKPT_NODE), flushed to a shared level 2
        mem = {"kind": "memory", "path": os.path.join(root, "mem"), "job": "sharded"}
        ck = Checkpointer(levels=[mem, os.path.join(root, "shared")], comm=comm)
    elif os.environ.get("SHARDED_LEVELS"):  # a node-local level 1 (one directory per rank), a shared level 2
        ck = Checkpointer(levels=[os.path.join(root, f"node{rank}"), os.path.join(root, "shared")], comm=comm)
    elif os.environ.get("SHARDED_COUNT"):  # count the bytes read from data files
        from ckpt_engine.testing import CountingStorage

        ck = Checkpointer(CountingStorage(root), comm=comm)
    else:
        ck = Checkpointer(root, comm=comm)
    if mode == "save":
        train(model, opt, range(1, steps + 1))
        ck.save(sharded_state(model, opt, layout), steps)
        ck.wait()
        full = full_state(model, opt, layout)
        train(model, opt, range(steps + 1, steps + 3))
        after = full_state(model, opt, layout)
        if rank == 0:
            torch.save(full, os.path.join(out, "full.pt"))
            torch.save(after, os.path.join(out, "after.pt"))
    elif mode == "load":
        if layout == "single":  # one process: the checkpoint's whole tensors, loaded as torch loads them
            restored = ck.restore()
            state = restored.state
        else:
            train(model, opt, range(1, 2))  # a different state to overwrite, with optimizer state
            state = sharded_state(model, opt, layout)
            restored = ck.restore(into=state)
            assert restored.state is state
        if os.environ.get("SHARDED_COUNT"):
            with open(os.path.join(out, f"read-{rank}.json"), "w") as f:
                f.write(f'{{"read": {ck.storage.data_read}}}')
        load_into(model, opt, layout, state)
        full = full_state(model, opt, layout)
        train(model, opt, range(restored.step + 1, restored.step + 3))
        after = full_state(model, opt, layout)
        if rank == 0:
            with open(os.path.join(out, "level.txt"), "w") as f:
                f.write(str(restored.level))
            torch.save(full, os.path.join(out, "loaded.pt"))
            torch.save(after, os.path.join(out, "loaded_after.pt"))
    elif mode == "loop":
        step = 0
        if ck.latest_step() is not None:  # a restart: resume from the newest committed checkpoint
            train(model, opt, range(0, 1))  # the optimizer's state exists before it is loaded into
            state = sharded_state(model, opt, layout)
            step = ck.restore(into=state).step
            load_into(model, opt, layout, state)
            print(f"resumed {step}", flush=True)
        while True:
            step += 1
            train(model, opt, range(step, step + 1))
            ck.save(sharded_state(model, opt, layout), step)
            print(f"saved {step}", flush=True)
    if os.environ.get("SHARDED_LEVELS") == "memory" and mode == "save":
        ck.wait(flush=True)
        leave()  # the job dies here: its memory stays for the restart (close() would release it)
    ck.close()
    if comm is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()  # worker_exit.py: no interpreter finalization once the work is done
