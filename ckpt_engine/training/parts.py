"""What a training checkpoint holds, split the way data parallelism splits it.

* *replicated*: identical on every rank (parameters, optimizer state, schedulers): the engine
  slices it across the ranks, each writes its share;
* *per rank*: what differs between ranks (model buffers such as BatchNorm statistics, which each
  rank updates on its own data; RNG states; the data position): each rank keeps its own, whole.

A front end captures both as :class:`Parts` (:func:`split_weights` splits a module's state dict);
the session adds its own entries (the policy's state, the RNG states) and gets back a
:class:`Resumed` on restore, with the rule for ranks that had no writer already applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ..format.manifest import Manifest

if TYPE_CHECKING:
    from ..load.agreed import Restored


@dataclass(frozen=True)
class Parts:
    """One checkpoint as a front end captured it: two mappings of plain values and tensors."""

    replicated: Mapping[str, Any]
    per_rank: Mapping[str, Any]


@dataclass(frozen=True)
class Resumed:
    """What this rank resumes from (every rank restored the same ``step``)."""

    step: int
    replicated: Mapping[str, Any]
    per_rank: Mapping[str, Any]
    """This rank's writer's per-rank part; writer 0's when this rank had no writer (the job now
    has more ranks than wrote the checkpoint)."""
    rng: Mapping[str, Any] | None
    """This rank's own RNG states; ``None`` when it had no writer (it keeps its own streams)."""
    first: Mapping[str, Any]
    """Writer 0's per-rank part: values every rank takes from writer 0 (Lightning's loops)."""
    manifest: Manifest
    """The checkpoint's manifest (``world_size``: the ranks that wrote it; ``created_at``)."""
    restored: "Restored"
    """The core's result (step, level, where each part came from): what the front ends return."""


def split_weights(weights: Mapping[str, Any], buffer_names: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(replicated, per_rank)`` of a module's ``state_dict()``: the buffers named in
    ``buffer_names`` per rank, cloned (a forward may update them in place while the snapshot is
    taken); everything else replicated."""
    buffers = set(buffer_names)
    return ({k: v for k, v in weights.items() if k not in buffers},
            {k: v.detach().clone() for k, v in weights.items() if k in buffers})
