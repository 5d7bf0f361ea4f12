"""The one implementation of a resumable sampler: :class:`Cursor` follows a sampler's iteration,
reports its data position (:mod:`.position`) and resumes it from one; :mod:`.resumable` mounts it
on a sampler (wrapped, or in place).

The cursor keeps no reference to the sampler: every call passes a :class:`Source` (the sampler
holding the split and the class whose ``__iter__``/``__len__`` iterate it), so the same code
serves a wrapper and a sampler whose class was swapped, and a pickled sampler holds no cycle.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.data.distributed import DistributedSampler

from .position import global_order, position, read_position, remaining_share, share_length


@dataclass(frozen=True)
class Source:
    """The sampler a cursor follows: ``sampler`` (holding the split: ``num_replicas``, ``rank``,
    ``dataset``...) iterated as its class ``cls`` iterates (the class before any swap)."""

    sampler: Any
    cls: type

    def iterate(self) -> Iterator[int]:
        return iter(self.cls.__iter__(self.sampler))

    def length(self) -> int | None:
        try:
            return int(self.cls.__len__(self.sampler))
        except (AttributeError, TypeError, NotImplementedError):
            return None

    @property
    def is_global(self) -> bool:
        """A plain ``DistributedSampler``: one global order, read interleaved by the ranks."""
        return issubclass(self.cls, DistributedSampler) and self.cls.__iter__ is DistributedSampler.__iter__

    @property
    def world_size(self) -> int:
        return int(getattr(self.sampler, "num_replicas", 1))

    @property
    def rank(self) -> int:
        return int(getattr(self.sampler, "rank", 0))

    @property
    def drop_last(self) -> bool:
        """Whether the ranks' equal shares drop the rest's tail rather than pad it."""
        return bool(getattr(self.sampler, "drop_last", False))

    def dataset_length(self) -> int | None:
        """How many samples the sampler draws indices from (``None``: not known)."""
        data = getattr(self.sampler, "dataset", getattr(self.sampler, "data_source", None))
        try:
            return None if data is None else len(data)
        except TypeError:
            return None

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def order(self) -> dict[str, Any]:
        s = self.sampler
        return {"n": len(s.dataset), "seed": int(s.seed), "shuffle": bool(s.shuffle), "drop_last": bool(s.drop_last)}


class Cursor:
    """Where a sampler's running iteration stands, and the resume armed for its next one.

    The mounts (:class:`ResumableSampler`, :func:`make_resumable`) call it from the training
    thread; it keeps no reference to the sampler (each call passes the :class:`Source`).
    """

    def __init__(self, batch_size: int | None = None) -> None:
        self.batch_size: int | None = None
        self.batch_size_given = False
        if batch_size is not None:
            self.give_batch_size(batch_size)
        self.iterations = 0          # iterations started: the epoch of samplers without set_epoch
        self.started = False         # an iteration ran since construction
        self.pending: tuple[dict[str, Any], Callable[[], None] | None] | None = None
        self._reset(0, 0, None, None, 1, None)

    def _reset(self, epoch: int, offset: int, total: int | None, order: dict[str, Any] | None, world: int,
               length: int | None) -> None:
        self.epoch, self.offset, self.total, self.order = epoch, offset, total, order
        self.world, self.length = world, length  # length: indices this iteration yields, when known
        self.yielded = self.steps = self.last_yielded = 0
        self.epoch_rng: torch.Tensor | None = None
        self.generators: list[torch.Tensor] = []

    def give_batch_size(self, batch_size: int) -> None:
        """Samples per step of this rank, as the caller knows it (never learned then)."""
        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.batch_size, self.batch_size_given = batch_size, True

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "pending": None}  # a resume armed in this process stays here

    def next_epoch(self, src: Source) -> int:
        """The epoch the next iteration belongs to."""
        s = src.sampler
        return int(s.epoch) if callable(getattr(s, "set_epoch", None)) and hasattr(s, "epoch") else self.iterations

    # ---- iteration ----------------------------------------------------------------------------
    def iterate(self, src: Source) -> Iterator[int]:
        """The body of the sampler's ``__iter__``: a resumed epoch's rest, else a whole epoch."""
        epoch = self.next_epoch(src)
        self.iterations, self.started = epoch + 1, True
        pending, self.pending = self.pending, None
        if pending is not None and pending[0]["epoch"] > epoch:
            self.pending = pending  # an earlier epoch runs first: keep the resume for later
        if pending is not None and pending[0]["epoch"] == epoch:
            it = self._resumed(src, pending[0])
            if pending[1] is not None:
                pending[1]()
        else:
            self._reset(epoch, 0, self._total(src), src.order() if src.is_global else None, src.world_size,
                        src.length())
            it = self._start(src, None, None)
        for index in it:
            self.yielded += 1
            yield index

    def _total(self, src: Source) -> int | None:
        return int(src.sampler.total_size) if src.is_global else None

    def _start(self, src: Source, replay: torch.Tensor | None, generators: list[torch.Tensor] | None) -> Iterator[int]:
        gens = sampler_generators(src.sampler)
        if generators and len(generators) == len(gens):
            for g, state in zip(gens, generators):
                g.set_state(state)
        self.generators = [g.get_state() for g in gens]
        self.epoch_rng, it = _replayed_iter(src.iterate, replay)
        return it

    def _resumed(self, src: Source, pos: dict[str, Any]) -> Iterator[int]:
        done = pos["done"]
        if pos["mode"] == "global":  # any sampler finishes the epoch in the writers' order, then its own
            share = remaining_share(global_order(pos), done, src.world_size, src.rank, src.drop_last)
            self._reset(pos["epoch"], done, pos["total"], pos["order"], src.world_size, len(share))
            return iter(share)
        full = src.length()
        self._reset(pos["epoch"], done, None, None, src.world_size, None if full is None else full - done)
        return itertools.islice(self._start(src, pos["epoch_rng"], pos["generators"]), done, None)

    # ---- position -----------------------------------------------------------------------------
    def note_step(self) -> None:
        """One batch of the running iteration was consumed (see :meth:`ResumableSampler.note_step`)."""
        self.steps += 1
        taken = self.yielded - self.last_yielded
        self.last_yielded = self.yielded
        exhausted = self.length is not None and self.yielded >= self.length
        if not self.batch_size_given and taken > 0 and not exhausted:
            self.batch_size = min(taken, self.batch_size or taken)

    def consumed(self) -> int:
        """Indices of the running iteration this rank has trained on."""
        counted = self.steps * self.batch_size if self.batch_size else self.yielded
        return min(counted, self.yielded)

    def position(self, src: Source, consumed: int | None = None, complete: bool | None = None) -> dict[str, Any]:
        """The data position now (:mod:`.position`)."""
        if self.pending is not None:  # armed, not started: the data stands where the resume goes
            return dict(self.pending[0])
        if not self.started:  # nothing iterated yet: the start of the next epoch
            return position(self.next_epoch(src), "global" if src.is_global else "rank", 0, complete=False,
                            world_size=src.world_size, batch_size=self.batch_size, total=self._total(src),
                            order=src.order() if src.is_global else None)
        count = self.consumed() if consumed is None else int(consumed)
        if self.order is not None:
            done = min(self.total, self.offset + count * self.world)
            ended = done >= self.total
            return position(self.epoch, "global", done, complete=ended if complete is None else complete,
                            world_size=self.world, batch_size=self.batch_size, total=self.total, order=self.order)
        done = self.offset + count
        full = src.length()
        ended = full is not None and done >= full
        return position(self.epoch, "rank", done, complete=ended if complete is None else complete,
                        world_size=self.world, batch_size=self.batch_size, epoch_rng=self.epoch_rng,
                        generators=self.generators)

    def resume_at(self, src: Source, raw: Mapping[str, Any], on_start: Callable[[], None] | None = None,
                  epoch_batches: int | None = None) -> tuple[int, int]:
        """Arm the next iteration to continue ``raw`` (see :meth:`ResumableSampler.resume_at`)."""
        pos = read_position(raw, epoch_batches)
        if pos is None:
            raise ValueError("resume_at: the checkpoint holds no data position (taken without a resumable sampler)")
        if pos["batch_size"] and not self.batch_size_given:
            self.batch_size = pos["batch_size"]
        epoch, done, name = pos["epoch"], pos["done"], self._name(src)
        complete = pos["complete"]
        if complete is None:
            full = src.length()
            complete = pos["mode"] == "rank" and full is not None and done >= full
        if complete:
            epoch, done = epoch + 1, 0
        elif not done:
            pass  # the epoch from its start
        elif pos["mode"] == "global" and pos["order"]["n"] != src.dataset_length():
            warnings.warn(f"resumable sampler: the dataset had {pos['order']['n']} samples when the checkpoint was "
                          f"taken and this {name} draws from {src.dataset_length()}; epoch {epoch} restarts",
                          stacklevel=3)
            done = 0
        elif pos["mode"] == "global" and pos["total"] - done < (src.world_size if src.drop_last else 1):
            epoch, done = epoch + 1, 0  # too few left to give every rank one (drop_last)
        elif pos["mode"] == "rank" and pos["world_size"] not in (None, src.world_size):
            consumed = done * pos["world_size"]  # by all the writer ranks together
            done = consumed // src.world_size
            warnings.warn(f"resumable sampler: a {name} cannot re-split the rest of epoch {epoch} from "
                          f"{pos['world_size']} ranks over {src.world_size} exactly (only a DistributedSampler's "
                          f"global order can be): each rank skips {done} of its own, so that the epoch still "
                          f"has {consumed} samples fewer, but some may be seen twice and others not at all",
                          stacklevel=3)
        src.set_epoch(epoch)
        self.iterations = epoch
        self.pending = ({**pos, "epoch": epoch, "done": done, "complete": False}, on_start) if done else None
        return epoch, done

    def resumed_length(self, src: Source) -> int | None:
        """How many indices the armed resume's iteration yields on this rank; ``None`` when none is armed."""
        if self.pending is None:
            return None
        pos = self.pending[0]
        if pos["mode"] == "global":
            return share_length(pos["total"] - pos["done"], src.world_size, src.drop_last)
        full = src.length()
        return None if full is None else max(0, full - pos["done"])

    @staticmethod
    def _name(src: Source) -> str:
        return src.cls.__name__


def _replayed_iter(start: Callable[[], Iterator[Any]],
                   replay: torch.Tensor | None) -> tuple[torch.Tensor, Iterator[Any]]:
    """Start an iteration whose first ``next()`` may draw from the global torch RNG (a
    ``RandomSampler`` draws its seed there): that draw sees ``replay`` when given, the caller's
    RNG state is put back afterwards. Returns the RNG state the draw saw (the epoch-start RNG)."""
    current = torch.get_rng_state()
    if replay is not None:
        torch.set_rng_state(replay)
    epoch_rng = torch.get_rng_state()
    try:
        it = start()
        done = object()
        first = next(it, done)  # samplers draw their seed on the first next()
    finally:
        if replay is not None:
            torch.set_rng_state(current)
    return epoch_rng, iter(()) if first is done else itertools.chain((first,), it)


_CHAIN = ("generator", "inner", "sampler", "_sampler", "base_sampler", "dataset")


def sampler_generators(sampler: Any, depth: int = 5) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a sampler chain draws from (wrappers followed; datasets are
    entered only when they hold a sampler, as Lightning's ``DistributedSamplerWrapper``'s does)."""
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
