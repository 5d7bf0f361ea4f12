"""One rank of a job that saves or loads with ``torch.distributed.checkpoint`` itself (DCP), for
tests/test_interop_dcp.py: the other side of ``ckpt export --format dcp`` and ``ckpt import``.

Usage: ``python dcp_worker.py MODE LAYOUT DCP_DIR OUT STEPS`` with RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT in the environment (``LAYOUT single`` runs alone, without torch.distributed). Models,
layouts and the state a user checkpoints are tests/sharded_worker.py's.

* ``save``: train STEPS steps, ``dcp.save({"model", "optim", "step": STEPS})`` to DCP_DIR, then
  (rank 0) the full state at STEPS and two steps later to OUT/full.pt, OUT/after.pt;
* ``load``: a fresh model of LAYOUT on this world size, one step of training (the optimizer's state
  exists), ``dcp.load`` of its sharded state from DCP_DIR + ``set_state_dict``, then (rank 0) the full
  state at once and after two more steps to OUT/loaded.pt, OUT/loaded_after.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed.checkpoint as dcp

from sharded_worker import build, full_state, load_into, sharded_state, train
from worker_exit import leave


def main() -> None:
    mode, layout, path, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    rank = int(os.environ.get("RANK", "0"))
    model, opt, comm = build(layout, seed=0 if mode == "save" else 99)
    names = ("full.pt", "after.pt") if mode == "save" else ("loaded.pt", "loaded_after.pt")
    if mode == "save":
        train(model, opt, range(1, steps + 1))
        dcp.save({**sharded_state(model, opt, layout), "step": steps}, checkpoint_id=path)
    elif mode == "load":
        train(model, opt, range(1, 2))
        state = sharded_state(model, opt, layout)
        dcp.load(state, checkpoint_id=path)
        load_into(model, opt, layout, state)
    else:
        raise SystemExit(f"unknown mode {mode}")
    full = full_state(model, opt, layout)
    train(model, opt, range(steps + 1, steps + 3))
    after = full_state(model, opt, layout)
    if rank == 0:
        torch.save(full, os.path.join(out, names[0]))
        torch.save(after, os.path.join(out, names[1]))
    if comm is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()
