"""``HorovodComm``: the core's :class:`~ckpt_engine.comm.Comm` over Horovod's object collectives.

Horovod matches collectives across ranks by *name*, and two operations in flight under the same
name collide (``broadcast_object`` defaults to the value's type name). Every call here therefore
gets its own name, ``<prefix>.<kind>.<n>`` with a per-instance counter: all ranks make the same
calls in the same order (the engine's contract), so the names agree without communication.

Payloads are JSON values, sent as JSON text: the same values pass or fail as with
:class:`~ckpt_engine.comm.TorchDistComm`, and nothing but a string is pickled by Horovod.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ckpt_engine.errors import CheckpointError


def import_horovod() -> Any:
    """``horovod.torch``, or an error saying how this project installs it."""
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise CheckpointError("horovod_ckpt needs Horovod with PyTorch support; install it with "
                              f"`bash scripts/install_horovod.sh` (see the README) ({e})") from e
    return hvd


class HorovodComm:
    """Rank, world size, broadcast and all-gather for the engine, over ``horovod.torch``.

    ``hvd.init()`` must have been called. ``prefix`` keeps the names of several communicators
    apart; use the same prefix on every rank.
    """

    def __init__(self, prefix: str = "ckpt") -> None:
        self._hvd = import_horovod()
        try:
            self._rank, self._size = int(self._hvd.rank()), int(self._hvd.size())
        except ValueError as e:
            raise CheckpointError(f"HorovodComm needs hvd.init() to be called first ({e})") from e
        self._prefix = prefix
        self._calls = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    def next_name(self, kind: str) -> str:
        """A collective name no other call of this communicator uses."""
        self._calls += 1
        return f"{self._prefix}.{kind}.{self._calls}"

    def broadcast(self, value: Any, src: int = 0) -> Any:
        name = self.next_name("bcast")  # advanced on every rank, even when there is one
        if self._size == 1:
            return json.loads(json.dumps(value))
        text = json.dumps(value, separators=(",", ":")) if self._rank == src else None
        return json.loads(self._hvd.broadcast_object(text, root_rank=src, name=name))

    def all_gather(self, value: Any) -> list[Any]:
        name = self.next_name("gather")
        text = json.dumps(value, separators=(",", ":"))
        if self._size == 1:
            return [json.loads(text)]
        return [json.loads(t) for t in self._hvd.allgather_object(text, name=name)]

    def all_gather_tensor(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Every rank returns all ranks' 1-D uint8 CPU tensors (of any lengths), by rank (the
        optional part of the core's comm, for restoring from a node-local level)."""
        name = self.next_name("gather_tensor")
        data = data.detach().reshape(-1).cpu()
        if self._size == 1:
            return [data.clone()]
        sizes = self._hvd.allgather(torch.tensor([data.numel()], dtype=torch.int64), name=name + ".sz")
        joined = self._hvd.allgather(data, name=name + ".t")  # Horovod concatenates rows of any count
        return list(torch.split(joined, [int(n) for n in sizes]))

    def broadcast_tensor(self, data: torch.Tensor, src: int) -> None:
        """``src``'s bytes into ``data`` (a contiguous CPU tensor, the same size on every rank), in
        place (the optional part of the core's comm, for a collective restore's exchange)."""
        name = self.next_name("bcast_tensor")
        if self._size > 1:
            self._hvd.broadcast_(data, root_rank=src, name=name)
