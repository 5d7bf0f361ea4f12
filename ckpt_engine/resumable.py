"""Exact resume of the data order and the random streams, shared by both front ends.

* :class:`ResumableSampler` wraps the sampler a DataLoader (or a Horovod script) already uses —
  typically a ``DistributedSampler`` — so that an interrupted epoch continues with the next unseen
  sample: the front end tells it how many samples this rank consumed, and its next ``__iter__``
  skips them (indices only: skipped samples are never loaded).
* A ``RandomSampler`` draws its permutation seed from the global torch RNG when iteration starts,
  and so does every DataLoader ``iter()``. The sampler records the RNG state at the start of each
  epoch's iteration; on resume it replays that state around its own first draw, then puts the
  caller's RNG state back, so the resumed order is the uninterrupted order and the training
  stream (restored separately, at the step) is left exactly as restored.
* :func:`rng_state` / :func:`set_rng_state` capture and restore Python's, NumPy's, torch's and CUDA's
  global generators as plain values (typed-JSON friendly, no pickle).
"""

from __future__ import annotations

import random
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """A sampler that can continue an interrupted epoch; delegates everything else to ``inner``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.epoch: int = int(getattr(inner, "epoch", 0))
        self.epoch_rng: torch.Tensor | None = None
        self._resume: tuple[int, int, torch.Tensor | None] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler (``DistributedSampler`` reshuffles per epoch)."""
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)
        self.epoch = epoch

    def resume(self, epoch: int, consumed: int, epoch_rng: torch.Tensor | None) -> None:
        """The next iteration of ``epoch`` skips its first ``consumed`` indices."""
        self.set_epoch(epoch)
        self._resume = (epoch, consumed, epoch_rng)

    def state_dict(self) -> dict[str, Any]:
        """Epoch and epoch-start RNG (the consumed count comes from the training loop)."""
        return {"epoch": self.epoch, "epoch_rng": self.epoch_rng}

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        skip, replay = 0, None
        if self._resume is not None and self._resume[0] == self.epoch:
            _, skip, replay = self._resume
        self._resume = None
        current = torch.get_rng_state()
        if replay is not None:
            torch.set_rng_state(replay)
        self.epoch_rng = torch.get_rng_state()
        it = iter(self.inner)
        done = object()
        try:
            first = next(it, done)  # samplers draw their seed on the first next()
        finally:
            if replay is not None:
                torch.set_rng_state(current)
        if first is done:
            return
        position = 0
        for index in _chain(first, it):
            if position >= skip:
                yield index
            position += 1


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def rng_state() -> dict[str, Any]:
    """Every global random generator's state, as plain values and tensors."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (after a round trip through a checkpoint)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
