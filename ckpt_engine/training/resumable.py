"""Exact resume of the data order and the random streams, shared by both front ends.

One implementation (:class:`~.cursor.Cursor`) follows a sampler's iteration and resumes it from a data
position (:mod:`.position`: one documented dict, the same for every front end). It is mounted on
a sampler in one of two ways, with the same methods:

* :class:`ResumableSampler` wraps the sampler (the Lightning callback puts it into the train
  loader's batch sampler); it is also torchdata's ``Stateful`` (``state_dict``/``load_state_dict``),
  so a ``StatefulDataLoader`` resumes through it.
* :func:`make_resumable` makes a sampler resumable in place (the Horovod hook only ever sees the
  sampler the DataLoader already holds): its class is swapped for a subclass.

What it does, either way:

* **Skip, never load.** After :meth:`~ResumableSampler.resume_at`, the next iteration yields only
  the unseen rest of the interrupted epoch (indices only: skipped samples are never loaded).
* **Re-split.** A plain ``DistributedSampler``'s epoch is one global order that the ranks read
  interleaved; its position counts the global order done, and a resume on another number of ranks
  splits the rest among them (each unseen sample once, plus the padding a ``DistributedSampler``
  adds for equal shares), whatever sampler they resume with (a single device's ``RandomSampler``
  too); the next epochs are that sampler's own. Any other sampler's position is its rank's count:
  exact on the same number of ranks.
* **Random streams.** A ``RandomSampler`` draws its permutation seed from the global torch RNG
  when iteration starts, and so does every DataLoader ``iter()``; samplers with a generator of
  their own (``DataLoader(generator=...)``, torchdata's ``RandomSampler``) draw from it and advance
  it every epoch. The cursor records the RNG and the generators' states at the start of each
  epoch's iteration; a resume replays them around its own first draw, then puts the caller's RNG
  state back, so the resumed order is the uninterrupted one and the training stream (restored
  separately, at the step) is left exactly as restored.

Order of calls (training thread, every rank)::

    sampler.note_step()                  # after every batch the training loop consumed
    pos = sampler.data_position()        # any time: store it with the checkpoint, per rank
    sampler.resume_at(pos, on_start)     # after a restore: the next iteration continues there

:func:`rng_state` / :func:`set_rng_state` capture and restore Python's, NumPy's, torch's and
CUDA's global generators as plain values.
"""

from __future__ import annotations

import random
import types
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
from torch.utils.data import Sampler

from .cursor import Cursor, Source, sampler_generators
from .position import remaining_share

__all__ = ["Cursor", "InPlaceResumable", "ResumableSampler", "make_resumable", "remaining_share",
           "rng_state", "sampler_generators", "set_rng_state"]


# ---- the two mounts ------------------------------------------------------------------------------

class _Mounted:
    """The resume API of a resumable sampler, either mount; state lives in ``_ckpt_cursor``."""

    __slots__ = ()
    _ckpt_cursor: Cursor

    def _ckpt_source(self) -> Source:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        return self._ckpt_cursor.iterate(self._ckpt_source())

    def note_step(self) -> None:
        """After every batch the training loop consumed (optimizer step or accumulation step).

        Positions count steps × batch size, so prefetching DataLoader workers do not over-count.
        Without a given batch size it is learned as the smallest number of indices the DataLoader
        took between two steps (exact with ``num_workers=0``; with workers the first step also
        takes the prefetched batches: pass ``batch_size`` to be exact from the first step).
        """
        self._ckpt_cursor.note_step()

    def data_position(self, consumed: int | None = None, complete: bool | None = None) -> dict[str, Any]:
        """Where the running epoch stands (:mod:`ckpt_engine.training.position`); store it per rank.

        ``consumed``: indices of the running iteration this rank trained on (default: counted by
        :meth:`note_step`). ``complete``: the caller knows whether the epoch ended (default: all
        of it was consumed). Before the armed resume's iteration starts, that resume's position.
        """
        return self._ckpt_cursor.position(self._ckpt_source(), consumed, complete)

    def resume_at(self, pos: Mapping[str, Any], on_start: Callable[[], None] | None = None,
                  epoch_batches: int | None = None) -> tuple[int, int]:
        """Continue from ``pos`` (a :meth:`data_position` of a restored checkpoint, any version).

        Sets the sampler's epoch; returns ``(epoch, done)``: the epoch the next iteration belongs
        to and how much of it is already done (0 when ``pos`` ended an epoch; counted as ``pos``
        counts, see ``mode``). ``on_start`` runs when the resumed iteration starts (after the
        DataLoader's own set-up draws), e.g. to put the restored RNG back. ``epoch_batches``:
        see :func:`~ckpt_engine.training.position.read_position`. Warns when the position cannot
        be continued exactly here (another sampler kind, dataset length or, for a per-rank
        position, number of ranks).
        """
        return self._ckpt_cursor.resume_at(self._ckpt_source(), pos, on_start, epoch_batches)

    def resumed_length(self) -> int | None:
        """Indices the next iteration yields on this rank when a mid-epoch resume is armed (this
        rank's share of the rest), else ``None``."""
        return self._ckpt_cursor.resumed_length(self._ckpt_source())

    @property
    def running_epoch(self) -> int:
        """The epoch of the running iteration (of the last one once it ended; before the first,
        :attr:`next_epoch`)."""
        cursor = self._ckpt_cursor
        return cursor.epoch if cursor.started else cursor.next_epoch(self._ckpt_source())

    @property
    def next_epoch(self) -> int:
        """The epoch the next iteration belongs to (``set_epoch``'s, or counted iterations)."""
        return self._ckpt_cursor.next_epoch(self._ckpt_source())

    @property
    def epoch_rng(self) -> torch.Tensor | None:
        """torch's global RNG state when the running iteration started."""
        return self._ckpt_cursor.epoch_rng


class ResumableSampler(_Mounted, Sampler[int]):
    """Wraps ``inner`` (any sampler, typically a ``DistributedSampler``) to resume it exactly;
    ``len()``, ``set_epoch`` and ``epoch`` are the inner sampler's. ``batch_size``: samples per
    step of this rank (see :meth:`note_step`).

    Also torchdata's ``Stateful``: :meth:`state_dict` is the position with every index yielded so
    far counted as consumed (torchdata keeps that state in step with the batches the training
    loop received, also with worker processes), :meth:`load_state_dict` arms its resume.
    """

    def __init__(self, inner: Any, batch_size: int | None = None) -> None:
        self.inner = inner
        self._ckpt_cursor = Cursor(batch_size)

    def _ckpt_source(self) -> Source:
        return Source(self.inner, type(self.inner))

    @property
    def epoch(self) -> int:
        return self.next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler (a ``DistributedSampler`` reshuffles per epoch)."""
        self._ckpt_source().set_epoch(epoch)
        self._ckpt_cursor.iterations = epoch

    def __len__(self) -> int:
        return len(self.inner)

    def state_dict(self) -> dict[str, Any]:
        """The data position, counting every index yielded so far (torchdata's ``Stateful``)."""
        return self.data_position(consumed=self._ckpt_cursor.yielded)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next iteration continues ``state`` (called by a ``StatefulDataLoader`` on resume)."""
        self.resume_at(state)


def make_resumable(sampler: Any, batch_size: int | None = None) -> Any:
    """Make ``sampler`` itself resumable and return it (the same object); idempotent.

    A DataLoader keeps a reference to its sampler, and a front end such as the Horovod hook only
    ever sees that sampler, so it cannot be wrapped: its class is swapped for a subclass that
    mixes in :class:`InPlaceResumable` (dunder methods are looked up on the type, so patching
    ``__iter__`` on the instance would not work). It then has the methods of
    :class:`ResumableSampler` (``note_step``, ``data_position``, ``resume_at``, ``running_epoch``,
    ``next_epoch``...); everything else is the sampler's own.

    ``batch_size`` (per rank) turns counted steps into samples; without it the sampler learns it
    from how many indices the DataLoader takes per step (see :meth:`ResumableSampler.note_step`).
    """
    if not isinstance(sampler, InPlaceResumable):
        base = type(sampler)
        sampler.__class__ = _resumable_class(base)
        sampler._ckpt_base_cls = base
        sampler._ckpt_cursor = Cursor()
    if batch_size is not None:
        sampler._ckpt_cursor.give_batch_size(batch_size)
    return sampler


class InPlaceResumable(_Mounted):
    """Mixed into a sampler's class by :func:`make_resumable`; its state is ``_ckpt_``-prefixed."""

    __slots__ = ()
    _ckpt_base_cls: type

    def _ckpt_source(self) -> Source:
        return Source(self, self._ckpt_base_cls)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as the original class plus the resume state (the swapped class is not importable)."""
        return _unpickle, (self._ckpt_base_cls, dict(self.__dict__))


_RESUMABLE_CLASSES: dict[type, type] = {}


def _resumable_class(base: type) -> type:
    cls = _RESUMABLE_CLASSES.get(base)
    if cls is None:
        # The mixin's methods go into the new class itself: with the mixin as the first base the
        # layouts would differ (CPython then refuses the ``__class__`` assignment).
        members = {k: v for c in reversed(InPlaceResumable.__mro__[:-1]) for k, v in vars(c).items()
                   if isinstance(v, (types.FunctionType, property))}
        cls = _RESUMABLE_CLASSES[base] = type(f"Resumable{base.__name__}", (base, InPlaceResumable),
                                              {**members, "__module__": base.__module__})
    return cls


def _unpickle(base: type, state: dict[str, Any]) -> Any:
    obj = base.__new__(base)
    obj.__dict__.update(state)
    obj.__class__ = _resumable_class(base)
    return obj


# ---- the global random generators ----------------------------------------------------------------

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
