"""One rank of a real sharded job (FSDP2, HSDP, FSDP2 + tensor parallel, DDP) on CPU with gloo.

Usage: ``python sharded_worker.py MODE LAYOUT ROOT OUT [STEPS]``, with RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT in the environment (``LAYOUT single`` runs alone, without torch.distributed). Layouts:

* ``fsdp``: ``fully_shard`` on a 1-D mesh of every rank (uneven shards: the last layer is 6 x 3);
* ``hsdp``: ``fully_shard`` on a 2-D mesh (replicate x shard), ``WORLD_SIZE / 2`` x 2;
* ``fsdp_tp``: tensor parallel (colwise, rowwise) on the inner mesh dimension of 2, FSDP2 on the outer;
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
  state every step until killed, printing ``saved N`` lines.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from worker_exit import leave  # noqa: E402
from ckpt_engine import Checkpointer  # noqa: E402

MODES = ("save", "load", "loop")


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 8), nn.ReLU(), nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 13, generator=torch.Generator().manual_seed(step))


def build(layout: str, seed: int):
    """The model of ``layout`` on this process's ranks, its AdamW, and the communicator."""
    model = make_model(seed)
    if layout == "single":
        return model, torch.optim.AdamW(model.parameters(), lr=0.01), None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckpt_engine import TorchDistComm

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    elif layout == "fsdp_tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "ddp":
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


def main() -> None:
    mode, layout, root, out = sys.argv[1:5]
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 3
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
