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


def cores_per_rank(world_size: int) -> int:
    """Cores per co-located rank, 1 to 4 (read and copy threads): more threads than cores only add
    contention, and past 4 a copy or a read is limited by memory or storage, not by a core."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, min(4, (os.cpu_count() or 1) // max(1, local)))


COPY_HELPERS_FROM = 4
"""A CPU snapshot copy is shared among threads by default only where a rank has this many cores."""


def copy_threads_for(world_size: int) -> int:
    """Threads of a CPU snapshot copy by default: the rank's cores (:func:`cores_per_rank`) where it
    has at least :data:`COPY_HELPERS_FROM`, else one. Why: with two cores, a second thread copying a
    176 MiB state beside training cut the wait from 23.5 to 20.4 ms but cost 32 ms of CPU instead of
    22 (2026-11-28), CPU the persist and flush threads and the data loader need on such a machine."""
    cores = cores_per_rank(world_size)
    return cores if cores >= COPY_HELPERS_FROM else 1
