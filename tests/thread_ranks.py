"""Jobs of ranks as threads of the test's process (``ckpt_engine.testing.run_ranks``): what
``tests/dist_worker.py``'s modes do on gloo ranks, for the tests of the protocol (which rank writes
what, which checkpoint every rank restores, how the state comes back), where a process adds nothing.

Each rank has its own ``Checkpointer`` and a real communicator: collectives rendezvous, in the same
order on every rank, and values cross as JSON, as over ``torch.distributed``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import torch

from ckpt_engine import Checkpointer
from ckpt_engine.testing import run_ranks
from dist_worker import digest, make_local, make_state

def on_threads(world: int, fn: Callable[[Any], Any]) -> list:
    """``fn(comm)`` on ``world`` ranks as threads; their results by rank, once none raised (the first
    exception a rank raised is raised here)."""
    results = run_ranks(world, fn)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class TensorComm:
    """A rank of :class:`~ckpt_engine.testing.ThreadComm` with ``broadcast_tensor`` (what a restore's
    exchange needs): the bytes go through the JSON broadcast, base64-encoded, as over a wire."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.broadcast, self.all_gather = comm.broadcast, comm.all_gather

    def broadcast_tensor(self, data: torch.Tensor, src: int) -> None:
        """``src``'s bytes into ``data`` (a contiguous uint8 tensor of the same size on every rank)."""
        sent = base64.b64encode(data.numpy().tobytes()).decode() if self.rank == src else None
        got = self.comm.broadcast(sent, src)
        if self.rank != src:
            data.copy_(torch.frombuffer(bytearray(base64.b64decode(got)), dtype=torch.uint8).view(data.shape))


def save(root: str, world: int, steps: int = 3) -> None:
    """dist_worker.py's ``save``: ``make_state(s)`` for s in 1..steps (each rank its ``make_local``), keep_last 3."""
    def job(comm: Any) -> None:
        with Checkpointer(root, comm=comm, keep_last=3) as ck:
            for step in range(1, steps + 1):
                ck.save(make_state(step), step, make_local(step, comm.rank))
            ck.wait()

    on_threads(world, job)


def load(root: str, world: int) -> list[dict]:
    """dist_worker.py's ``load``: each rank's digests of the newest checkpoint, by rank."""
    def job(comm: Any) -> dict:
        with Checkpointer(root, comm=comm, keep_last=3) as ck:
            state = ck.load()
            return {"rank": comm.rank, "state": digest(state), "step": ck.loaded_manifest.step,
                    "tied": state["model"]["emb.weight"] is state["model"]["head.weight"],
                    "local": digest(ck.load_local()), "writers": ck.loaded_manifest.world_size}

    return on_threads(world, job)


def restore(root: str, world: int, route: str) -> list[dict]:
    """dist_worker.py's ``restore`` (but the bytes the kernel counts, a process's own): the collective
    restore twice by ``route``, with its figures, by rank."""
    def job(comm: Any) -> dict:
        done = []
        with Checkpointer(root, comm=TensorComm(comm), restore_route=route, readonly=True) as ck:
            for _ in range(2):
                restored = ck.restore()
                figures = ck.restore_figures
                done.append({"step": restored.step, "state": digest(restored.state), "local": digest(restored.local),
                             "failures": list(ck.load_failures),
                             "figures": None if figures is None else dict(figures.__dict__)})
        return {"rank": comm.rank, "restores": done}

    return on_threads(world, job)
