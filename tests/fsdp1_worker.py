"""One rank of a real FSDP1 job (``FullyShardedDataParallel``) on CPU with gloo.

Usage: ``python fsdp1_worker.py MODE ROOT OUT [STEPS]``, with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in
the environment. The model, its training and the files written are ``sharded_worker.py``'s, so that
worker's ``load`` mode restores what this one saves into FSDP2 or into one process. Modes:

* ``save``: FSDP1 with ``device_mesh=`` (its sharded state dict holds ``DTensor`` values): train
  STEPS steps, save ``get_state_dict(..., full_state_dict=False)`` at STEPS, then (rank 0) write the
  full state at STEPS and after two more steps to OUT (``full.pt``, ``after.pt``);
* ``sharded_tensor``: FSDP1 without a mesh (its sharded state dict holds the deprecated
  ``ShardedTensor``): try to save it and print ``REFUSED <message>`` or ``FAILED <type>: <message>``.

FSDP1 refuses to run on CPU unless given ``device_id=torch.device("cpu")``, and on CPU its full
state dict with ``cpu_offload=True`` kills rank 0 (SIGSEGV in its post-state-dict clone, torch 2.13):
the whole state is therefore gathered without offload here.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from worker_exit import leave  # noqa: E402
from ckpt_engine import Checkpointer, TorchDistComm, UnsupportedValueError  # noqa: E402
from sharded_worker import _cloned, make_model, sharded_state, train  # noqa: E402


def full_state(model: FSDP, opt: torch.optim.Optimizer) -> dict | None:
    """The whole state on rank 0 (``None`` elsewhere), as ``sharded_worker.full_state`` writes it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return _cloned({"model": msd, "optim": osd}) if dist.get_rank() == 0 else None


def main() -> None:
    mode, root, out = sys.argv[1:4]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1's own ShardedTensor deprecation notes
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),)) if mode == "save" else None
    model = FSDP(make_model(0), device_mesh=mesh, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ck = Checkpointer(root, comm=TorchDistComm())
    train(model, opt, range(1, steps + 1))
    if mode == "save":
        ck.save(sharded_state(model, opt, "fsdp"), steps)
        ck.wait()
        full = full_state(model, opt)
        train(model, opt, range(steps + 1, steps + 3))
        after = full_state(model, opt)
        if dist.get_rank() == 0:
            torch.save(full, os.path.join(out, "full.pt"))
            torch.save(after, os.path.join(out, "after.pt"))
    elif mode == "sharded_tensor":
        try:
            ck.save(sharded_state(model, opt, "fsdp"), steps)
            ck.wait()
            print("SAVED", flush=True)
        except UnsupportedValueError as e:
            print(f"REFUSED {e}", flush=True)
        except Exception as e:  # noqa: BLE001 - the test reports what else happened
            print(f"FAILED {type(e).__name__}: {e}", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()  # worker_exit.py: no interpreter finalization once the work is done
