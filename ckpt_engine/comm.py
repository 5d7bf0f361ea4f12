"""The communicator the engine uses on the training thread: rank, world size, a few collectives.

The engine calls these only from the thread that calls ``Checkpointer`` methods, and only in
calls every rank makes in the same order (construction, the front ends' decisions); background
work coordinates through storage instead. Payloads are JSON values (sent as UTF-8 bytes in a
uint8 tensor), never pickles. Front ends inject their own implementation (e.g. Horovod's).
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol, runtime_checkable

import torch

from .errors import CheckpointError


@runtime_checkable
class Comm(Protocol):
    """What ``Checkpointer`` needs from the job's communicator."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """Every rank returns ``src``'s JSON-serializable ``value``."""
        ...

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank returns the list of all ranks' JSON-serializable values, by rank."""
        ...


class LocalComm:
    """A single process, no distributed setup at all."""

    rank = 0
    world_size = 1

    def broadcast(self, value: Any, src: int = 0) -> Any:
        return value

    def all_gather(self, value: Any) -> list[Any]:
        return [value]


class TorchDistComm:
    """``torch.distributed`` (gloo, or NCCL with CUDA tensors) on ``group`` (default: WORLD).

    ``torch.distributed`` must be initialized before this is constructed.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CheckpointError("TorchDistComm needs torch.distributed.init_process_group() to be called first")
        self._dist = dist
        self._group = group
        self._device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    @property
    def rank(self) -> int:
        return self._dist.get_rank(self._group)

    @property
    def world_size(self) -> int:
        return self._dist.get_world_size(self._group)

    def broadcast(self, value: Any, src: int = 0) -> Any:
        payload = _encode(value) if self.rank == src else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self._device)
        self._dist.broadcast(size, self._global(src), group=self._group)
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        payload = payload.to(self._device)
        self._dist.broadcast(payload, self._global(src), group=self._group)
        return _decode(payload)

    def all_gather(self, value: Any) -> list[Any]:
        return [_decode(payload) for payload in self.all_gather_tensor(_encode(value))]

    def all_gather_tensor(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Every rank returns all ranks' 1-D uint8 CPU tensors (of any lengths), by rank.

        Optional in :class:`Comm`: restoring from a node-local level uses it to exchange slices.
        """
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self._device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        self._dist.all_gather(sizes, size, group=self._group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self._device)
        padded[: data.numel()] = data.to(self._device)
        out = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._dist.all_gather(out, padded, group=self._group)
        return [o[: int(s.item())].cpu() for o, s in zip(out, sizes)]

    def broadcast_tensor(self, data: torch.Tensor, src: int) -> None:
        """``src``'s bytes into ``data`` (a contiguous CPU tensor, the same size on every rank), in place.

        Optional in :class:`Comm`: a collective restore sends the pieces each rank read to the
        others with it (load/exchange.py). With NCCL the bytes go through the current device.
        """
        if self._device.type == "cpu":
            self._dist.broadcast(data, self._global(src), group=self._group)
            return
        staged = data.to(self._device)
        self._dist.broadcast(staged, self._global(src), group=self._group)
        data.copy_(staged.cpu())

    def _global(self, rank: int) -> int:
        return rank if self._group is None else self._dist.get_global_rank(self._group, rank)


def _encode(value: Any) -> torch.Tensor:
    raw = json.dumps(value, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> Any:
    return json.loads(bytes(payload.cpu().numpy().tobytes()).decode())


def cores_available() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a cgroup's cpuset, a
    scheduler's binding), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def cores_per_rank(world_size: int, cores: int | None = None) -> int:
    """Cores per co-located rank, 1 to 4: ``cores`` (default :func:`cores_available`) shared among the
    ranks of this node (``LOCAL_WORLD_SIZE``, else ``world_size``). A ``Checkpointer``'s default read
    threads and snapshot copy threads: one per core the rank has. More threads than cores only add
    contention, and past 4 a copy or a read is limited by memory or storage, not by a core.

    So a rank with a spare core (1 rank on 2 cores, 2 ranks on 4) copies its snapshot with a helper on
    it (training waits for the copy, so the copy's wall time is the stall), and a rank with one core
    copies alone: a helper there competes with the rank's own persist and flush threads and with the
    data loader for that core (2 ranks on 2 cores, 2026-11-28: 10 ms more CPU to save 3 ms of wall time).
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, min(4, (cores if cores is not None else cores_available()) // max(1, local)))
