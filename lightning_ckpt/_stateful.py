"""The train sampler the callback installs: exact mid-epoch resume, also for torchdata's loader.

Two things beyond :class:`~ckpt_engine.training.resumable.ResumableSampler`:

* **Private generators.** A ``RandomSampler`` built with ``generator=g`` (``DataLoader(generator=g)``)
  and torchdata's stateful ``RandomSampler`` (which seeds a generator of its own once, at
  construction) draw each epoch's permutation from that generator, not from the global torch RNG,
  and advance it every epoch. Replaying the global RNG is then not enough: the states of the
  generators in the sampler chain are recorded when an epoch's iteration starts and put back before
  the resumed iteration starts.
* **torchdata's ``StatefulDataLoader``.** Lightning saves the loader's ``state_dict()`` with its loops
  and loads it on resume; the loader then restores its sampler's position itself, through the
  sampler's ``state_dict``/``load_state_dict`` when it has them, or else by drawing and discarding
  the consumed indices from a *fresh* iteration, which under DDP is a different permutation
  (Lightning's ``DistributedSamplerWrapper`` redraws it). This sampler has torchdata's ``Stateful``
  protocol: its state is the epoch, the epoch-start RNG and generator states and the indices
  yielded so far, and loading it arms the exact resume. torchdata keeps that state in step with the
  batches the training loop received, also with worker processes (its snapshots).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ckpt_engine.training.resumable import ResumableSampler

_CHAIN = ("generator", "inner", "sampler", "_sampler", "base_sampler", "dataset")


def sampler_generators(sampler: Any, depth: int = 5) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a sampler chain draws from (wrappers followed, datasets not:
    only Lightning's sampler-holding dataset wrapper is entered)."""
    found: list[torch.Generator] = []
    seen: set[int] = set()

    def walk(obj: Any, left: int) -> None:
        if obj is None or id(obj) in seen or left < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Generator):
            found.append(obj)
            return
        for name in _CHAIN:
            child = getattr(obj, name, None)
            if name == "dataset" and not hasattr(child, "_sampler"):
                continue
            walk(child, left - 1)

    walk(sampler, depth)
    return found


class LoaderSampler(ResumableSampler):
    """The callback's resumable sampler (see the module docstring)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.epoch_generators: list[torch.Tensor] = []
        self._replay_generators: list[torch.Tensor] | None = None
        self._yielded = 0
        self._next_start = 0

    def resume(self, epoch: int, consumed: int, epoch_rng: torch.Tensor | None,
               generators: list[torch.Tensor] | None = None) -> None:
        """As :meth:`ResumableSampler.resume`, plus the epoch-start states of the chain's generators."""
        super().resume(epoch, consumed, epoch_rng)
        self._next_start = consumed
        self._replay_generators = list(generators) if generators else None

    def __iter__(self) -> Iterator[int]:
        gens = sampler_generators(self.inner)
        if self._replay_generators is not None and len(self._replay_generators) == len(gens):
            for g, state in zip(gens, self._replay_generators):
                g.set_state(state)
        self._replay_generators = None
        self.epoch_generators = [g.get_state() for g in gens]
        self._yielded, self._next_start = self._next_start, 0
        for index in super().__iter__():
            self._yielded += 1
            yield index

    def state_dict(self) -> dict[str, Any]:
        """Epoch, epoch-start RNG and generators, indices yielded this epoch (torchdata's ``Stateful``)."""
        return super().state_dict() | {"generators": self.epoch_generators, "yielded": self._yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration continues the saved one exactly (called by the loader on resume)."""
        self.resume(int(state["epoch"]), int(state["yielded"]), state["epoch_rng"], state.get("generators"))


def is_stateful_loader(loader: Any) -> bool:
    """A loader that saves and restores its own position (torchdata's ``StatefulDataLoader``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
