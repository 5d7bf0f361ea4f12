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

import itertools
import random
import warnings
from typing import Any, Callable, Iterator

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
        self.epoch_rng, it = _replayed_iter(lambda: iter(self.inner), replay)
        yield from itertools.islice(it, skip, None)


def _replayed_iter(start: Callable[[], Iterator[Any]],
                   replay: torch.Tensor | None) -> tuple[torch.Tensor, Iterator[Any]]:
    """Start an iteration whose first ``next()`` may draw from the global torch RNG (a
    ``RandomSampler`` draws its seed there): that draw sees ``replay`` when given, the caller's
    RNG state is put back afterwards. Returns the RNG state the draw saw (the epoch-start RNG)."""
    current = torch.get_rng_state()
    if replay is not None:
        torch.set_rng_state(replay)
    epoch_rng = torch.get_rng_state()
    it = start()
    done = object()
    try:
        first = next(it, done)  # samplers draw their seed on the first next()
    finally:
        if replay is not None:
            torch.set_rng_state(current)
    return epoch_rng, iter(()) if first is done else itertools.chain((first,), it)


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


# ---- resuming a sampler in place (for front ends that never see the DataLoader) -----------------

def make_resumable(sampler: Any, batch_size: int | None = None) -> Any:
    """Make ``sampler`` itself resumable and return it (the same object).

    A DataLoader keeps a reference to its sampler, and a front end such as the Horovod hook only
    ever sees that sampler, so it cannot be wrapped: its class is swapped for a subclass that
    mixes in :class:`InPlaceResumable` (dunder methods are looked up on the type, so patching
    ``__iter__`` on the instance would not work). Idempotent.

    ``batch_size`` (per rank) turns counted steps into samples; without it the sampler learns it
    from how many indices the DataLoader takes per step (see :meth:`InPlaceResumable.note_step`).
    """
    if not isinstance(sampler, InPlaceResumable):
        base = type(sampler)
        sampler.__class__ = _resumable_class(base)
        sampler._ckpt_init(base)
    if batch_size is not None:
        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        sampler._ckpt_batch_size, sampler._ckpt_batch_size_given = batch_size, True
    return sampler


_RESUMABLE_CLASSES: dict[type, type] = {}


def _resumable_class(base: type) -> type:
    cls = _RESUMABLE_CLASSES.get(base)
    if cls is None:
        # The mixin's methods go into the new class itself: with the mixin as the first base the
        # layouts would differ (CPython then refuses the ``__class__`` assignment).
        methods = {k: v for k, v in vars(InPlaceResumable).items() if callable(v)}
        cls = _RESUMABLE_CLASSES[base] = type(f"Resumable{base.__name__}", (base, InPlaceResumable),
                                              {**methods, "__module__": base.__module__})
    return cls


def _unpickle(base: type, state: dict[str, Any]) -> Any:
    obj = base.__new__(base)
    obj.__dict__.update(state)
    obj.__class__ = _resumable_class(base)
    return obj


class InPlaceResumable:
    """Mixed into a sampler's class by :func:`make_resumable`; every attribute is ``_ckpt_``-prefixed.

    Order of calls (from the training thread)::

        pos = sampler.data_position()        # any time: where this epoch stands (plain values)
        sampler.note_step()                  # after every optimizer step: one batch consumed
        sampler.resume_at(pos, on_start)     # after a restore: the next iteration continues there

    Two modes. A plain ``DistributedSampler`` ("global" mode): an epoch is one global order of
    indices (deterministic from seed, epoch and dataset length) that rank ``r`` of ``W`` reads as
    ``order[r::W]``, so after every rank consumed ``p`` samples the first ``p * W`` of the order are
    done. The position is that global count, the same on every rank; a resume re-splits the rest
    of the order across however many ranks there are now (so another world size continues the
    epoch with each unseen sample once, plus the padding a ``DistributedSampler`` adds to make the
    shares equal). Any other sampler ("rank" mode): the position is this rank's own count, and a
    resume skips that many indices (exact on the same world size).
    """

    __slots__ = ()

    def _ckpt_init(self, base: type) -> None:
        from torch.utils.data.distributed import DistributedSampler

        self._ckpt_base_cls = base
        self._ckpt_global = issubclass(base, DistributedSampler) and base.__iter__ is DistributedSampler.__iter__
        self._ckpt_batch_size: int | None = None
        self._ckpt_batch_size_given = False
        self._ckpt_iterations = 0      # epochs of samplers without set_epoch
        self._ckpt_pending: tuple[dict[str, Any], Callable[[], None] | None] | None = None
        self._ckpt_reset(self._ckpt_next_epoch(), 0, self._ckpt_default_total(), None)

    def _ckpt_reset(self, epoch: int, base: int, total: int | None, order: dict[str, Any] | None,
                    length: int | None = None) -> None:
        self._ckpt_epoch, self._ckpt_offset, self._ckpt_total = epoch, base, total
        self._ckpt_length = length      # indices this iteration yields, when known
        self._ckpt_order = order        # seed/shuffle/drop_last/n of the running epoch's global order
        self._ckpt_world = getattr(self, "num_replicas", 1)
        self._ckpt_yielded = self._ckpt_steps = 0
        self._ckpt_last_yielded = 0
        self.epoch_rng: torch.Tensor | None = None

    def _ckpt_next_epoch(self) -> int:
        return int(self.epoch) if hasattr(self, "set_epoch") and hasattr(self, "epoch") else self._ckpt_iterations

    def _ckpt_default_total(self) -> int | None:
        return int(self.total_size) if self._ckpt_global else None

    def _ckpt_order_of_this_sampler(self) -> dict[str, Any]:
        return {"n": len(self.dataset), "seed": int(self.seed), "shuffle": bool(self.shuffle),
                "drop_last": bool(self.drop_last)}

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as the original class plus the resume state (the swapped class is not importable)."""
        return _unpickle, (self._ckpt_base_cls, {**self.__dict__, "_ckpt_pending": None})

    # ---- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        epoch = self._ckpt_next_epoch()
        self._ckpt_iterations = epoch + 1
        pending, self._ckpt_pending = self._ckpt_pending, None
        if pending is not None and pending[0]["epoch"] > epoch:
            self._ckpt_pending = pending  # an earlier epoch runs first: keep the resume for later
        if pending is not None and pending[0]["epoch"] == epoch:
            it = self._ckpt_resumed(pending[0])
            if pending[1] is not None:
                pending[1]()
        else:
            self._ckpt_reset(epoch, 0, self._ckpt_default_total(),
                             self._ckpt_order_of_this_sampler() if self._ckpt_global else None, _length(self))
            self.epoch_rng, it = _replayed_iter(lambda: self._ckpt_base_cls.__iter__(self), None)
        for index in it:
            self._ckpt_yielded += 1
            yield index

    def _ckpt_resumed(self, pos: dict[str, Any]) -> Iterator[int]:
        if pos["mode"] == "global":
            share = remaining_share(self._ckpt_global_order(pos), pos["done"], self.num_replicas, self.rank,
                                    bool(self.drop_last))
            self._ckpt_reset(pos["epoch"], pos["done"], pos["total"], pos["order"], len(share))
            return iter(share)
        full = _length(self)
        self._ckpt_reset(pos["epoch"], pos["done"], None, None, None if full is None else full - pos["done"])
        self.epoch_rng, it = _replayed_iter(lambda: self._ckpt_base_cls.__iter__(self), pos.get("epoch_rng"))
        return itertools.islice(it, pos["done"], None)

    def _ckpt_global_order(self, pos: dict[str, Any]) -> list[int]:
        """The epoch's global order as the ranks that saved ``pos`` drew it."""
        from torch.utils.data.distributed import DistributedSampler

        proxy = object.__new__(DistributedSampler)
        order = pos["order"]
        proxy.__dict__.update(dataset=self.dataset, num_replicas=1, rank=0, epoch=pos["epoch"],
                              drop_last=order["drop_last"], shuffle=order["shuffle"], seed=order["seed"],
                              num_samples=pos["total"], total_size=pos["total"])
        return list(DistributedSampler.__iter__(proxy))

    # ---- position -----------------------------------------------------------------------------
    def note_step(self) -> None:
        """One optimizer step consumed one batch of this rank's current epoch.

        Without a given batch size, it is learned as the smallest number of indices the DataLoader
        took between two steps (exact with ``num_workers=0``; with worker processes the first step
        also takes the prefetched batches, so a position taken at the first step of the first epoch
        over-counts; pass ``batch_size`` to be exact from the start).
        """
        self._ckpt_steps += 1
        taken = self._ckpt_yielded - self._ckpt_last_yielded
        self._ckpt_last_yielded = self._ckpt_yielded
        if not self._ckpt_batch_size_given and taken > 0 and not self._ckpt_exhausted():
            self._ckpt_batch_size = min(taken, self._ckpt_batch_size or taken)

    def _ckpt_exhausted(self) -> bool:
        return self._ckpt_length is not None and self._ckpt_yielded >= self._ckpt_length

    def _ckpt_consumed(self) -> int:
        """Samples of the running iteration this rank has trained on."""
        counted = self._ckpt_steps * self._ckpt_batch_size if self._ckpt_batch_size else self._ckpt_yielded
        return min(counted, self._ckpt_yielded)

    def data_position(self) -> dict[str, Any]:
        """Where the running epoch stands, as plain values (store it per rank)."""
        pos: dict[str, Any] = {"epoch": self._ckpt_epoch, "batch_size": self._ckpt_batch_size}
        if self._ckpt_global and self._ckpt_order is not None:  # its order draws nothing from the global RNG
            done = min(self._ckpt_total, self._ckpt_offset + self._ckpt_consumed() * self._ckpt_world)
            pos.update(mode="global", done=done, total=self._ckpt_total, order=self._ckpt_order,
                       complete=done >= self._ckpt_total)
        else:
            done = self._ckpt_offset + self._ckpt_consumed()
            full = _length(self)
            pos.update(mode="rank", done=done, complete=full is not None and done >= full, epoch_rng=self.epoch_rng)
        return pos

    def resume_at(self, pos: dict[str, Any], on_start: Callable[[], None] | None = None) -> tuple[int, int]:
        """Continue from ``pos`` (a :meth:`data_position` of a restored checkpoint).

        Returns ``(epoch, done)``: the epoch the next iteration belongs to and how much of it is
        already done (0 when ``pos`` ended an epoch). ``on_start`` runs when the resumed iteration
        starts (after the DataLoader's own set-up draws), e.g. to put the restored RNG back.
        """
        if pos.get("batch_size") and not self._ckpt_batch_size_given:
            self._ckpt_batch_size = int(pos["batch_size"])
        epoch, done = int(pos["epoch"]), int(pos["done"])
        if pos.get("complete"):
            epoch, done = epoch + 1, 0
        elif pos["mode"] == "global" and not self._ckpt_global:
            warnings.warn("resumable sampler: the checkpoint's data position is a DistributedSampler's, this "
                          f"sampler is a {self._ckpt_base_cls.__name__}; epoch {epoch} restarts", stacklevel=2)
            done = 0
        elif pos["mode"] == "global" and pos["order"]["n"] != len(self.dataset):
            warnings.warn(f"resumable sampler: the dataset had {pos['order']['n']} samples when the checkpoint "
                          f"was taken and has {len(self.dataset)} now; epoch {epoch} restarts", stacklevel=2)
            done = 0
        elif pos["mode"] == "global" and pos["total"] - done < (self.num_replicas if self.drop_last else 1):
            epoch, done = epoch + 1, 0    # too few left to give every rank one (drop_last)
        if hasattr(self, "set_epoch"):
            self.set_epoch(epoch)
        self._ckpt_iterations = epoch
        self._ckpt_pending = ({**pos, "epoch": epoch, "done": done}, on_start) if done else None
        return epoch, done


def _length(sampler: Any) -> int | None:
    try:
        return len(sampler)
    except TypeError:
        return None


def remaining_share(order: list[int], done: int, world_size: int, rank: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s share of ``order[done:]`` split over ``world_size`` ranks, interleaved as a
    ``DistributedSampler`` splits (``rest[rank::world_size]``), with equal shares: padded by
    wrapping around the rest (or its tail dropped with ``drop_last``)."""
    rest = order[done:]
    if not rest:
        return []
    per = len(rest) // world_size if drop_last else -(-len(rest) // world_size)
    need = per * world_size
    if need > len(rest):
        rest = (rest * -(-need // len(rest)))[:need]
    return rest[rank:need:world_size]
