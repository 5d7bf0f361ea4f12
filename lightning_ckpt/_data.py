"""The train loader's data position: the callback's side of :mod:`ckpt_engine.training.resumable`.

* The train loader's sampler is wrapped in a :class:`~ckpt_engine.training.resumable.ResumableSampler`
  (inside its batch sampler, where the loader draws indices from). Under DDP that sampler is the
  ``DistributedSampler`` Lightning injected: its position is global, and a resume on another
  number of devices re-splits the rest of the epoch. Lightning's ``DistributedSamplerWrapper``
  (any other sampler under DDP) resumes per rank: exact on the same number of devices.
* **torchdata's ``StatefulDataLoader``.** Lightning saves the loader's ``state_dict()`` with its
  loops and loads it on resume; the loader then restores its sampler's position itself, through
  the sampler's ``state_dict``/``load_state_dict`` (the wrapper has torchdata's ``Stateful``
  protocol), or else by drawing and discarding the consumed indices from a *fresh* iteration,
  which under DDP is a different permutation (``DistributedSamplerWrapper`` redraws it).
* **Lightning's count.** After a re-split the rest of the epoch takes another number of batches
  per device than the restored loop counted; the loop's count is set so that the epoch ends
  (validation, epoch-interval schedulers, ``is_last_batch``) exactly when the rest runs out.

Order of calls: :func:`make_resumable` when the strategy prepares the train loader, then
:func:`resume` with the restored position (Lightning has loaded its loops by then);
:func:`position` at every checkpoint.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from ckpt_engine.training.position import read_position
from ckpt_engine.training.resumable import ResumableSampler

from . import _trainer_api


def make_resumable(loader: Any) -> ResumableSampler | None:
    """Wrap ``loader``'s sampler (idempotent) and return it; ``None``, with a warning, when the
    loader has no batch sampler to hold one."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None or not hasattr(batch_sampler, "sampler"):
        warnings.warn("AsyncShardedCheckpoint: the train DataLoader has no batch sampler; a mid-epoch "
                      "resume restarts that epoch's data", stacklevel=3)
        return None
    if not isinstance(batch_sampler.sampler, ResumableSampler):
        size = getattr(batch_sampler, "batch_size", None)
        batch_sampler.sampler = ResumableSampler(batch_sampler.sampler,
                                                 batch_size=size if type(size) is int and size > 0 else None)
    return batch_sampler.sampler


def resume(trainer: Any, loader: Any, sampler: ResumableSampler, data: dict[str, Any] | None) -> int:
    """Arm ``sampler`` to continue ``data`` (this rank's stored position, any version; ``None``:
    none stored). Returns how many global-RNG draws to repeat right after the RNG is restored.

    Saved at the end of an epoch, the resume starts the next one, whose iterator Lightning creates
    before training starts: one draw from the global RNG when the loader has no generator, which in
    the uninterrupted run came after the saved RNG state, so it is repeated (``on_train_start``).
    """
    pos = read_position(data, _length(loader))
    if pos is None:
        return 0
    if pos["complete"]:
        sampler.resume_at(pos)
        return 1 if getattr(loader, "generator", None) is None else 0
    if trainer is not None and is_stateful_loader(loader) and _trainer_api.restores_loader_states(trainer):
        return 0  # Lightning loads the loader's own state next, which resumes the sampler
    sampler.resume_at(pos)
    left, batches = sampler.resumed_length(), _length(loader)
    if trainer is not None and left is not None and batches is not None:
        _trainer_api.set_batches_done(trainer, batches - _batches(left, loader.batch_sampler))
    return 0


def position(sampler: ResumableSampler | None, between_epochs: bool) -> dict[str, Any]:
    """This rank's data position now (``between_epochs``: the epoch ended), with the wall time."""
    pos = sampler.data_position(complete=True if between_epochs else None) if sampler is not None else {}
    return {**pos, "taken_at": time.time()}


def is_stateful_loader(loader: Any) -> bool:
    """A loader that saves and restores its own position (torchdata's ``StatefulDataLoader``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _batches(samples: int, batch_sampler: Any) -> int:
    size = int(getattr(batch_sampler, "batch_size", 1) or 1)
    return samples // size if getattr(batch_sampler, "drop_last", False) else -(-samples // size)


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
