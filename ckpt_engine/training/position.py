"""The data position: where a sampler stands in an epoch, as one documented dict.

Both front ends store it per rank with every checkpoint and give it back to the sampler on
resume (:mod:`.resumable`). It is plain JSON values plus tensors (typed JSON, no pickle):

==============  ==========================================================================
key             value
==============  ==========================================================================
``version``     ``2`` (:data:`VERSION`)
``epoch``       the sampler's epoch: its ``set_epoch`` number, or without ``set_epoch`` how
                many iterations it had started before this one
``mode``        ``"global"``: a plain ``DistributedSampler``, whose epoch is one global order
                of indices (``order``, ``total``) that rank ``r`` of ``W`` reads as
                ``order[r::W]``; ``"rank"``: any other sampler (this rank's own sequence)
``done``        ``"global"``: how many of the global order all ranks together consumed (the
                same on every rank); ``"rank"``: how many of its own sequence this rank did
``complete``    the epoch ended (a resume starts ``epoch + 1``); ``None``: not recorded (an
                older format), decided on resume by the sampler's length
``world_size``  the number of ranks that were consuming (``None``: not recorded)
``batch_size``  samples per rank per step, when known (``None``: not known)
``total``       ``"global"``: the length of the global order (padded or trimmed by the
                ``DistributedSampler`` to a multiple of the ranks); else ``None``
``order``       ``"global"``: what the order is drawn from, ``{"n": dataset length, "seed",
                "shuffle", "drop_last"}``; else ``None``
``epoch_rng``   ``"rank"``: torch's global RNG state (uint8 tensor) when the epoch's iteration
                started, replayed on resume (a ``RandomSampler`` draws its seed there)
``generators``  ``"rank"``: the epoch-start states of the ``torch.Generator`` objects in the
                sampler chain (``DataLoader(generator=...)``, torchdata's ``RandomSampler``)
==============  ==========================================================================

A front end may add keys of its own (the Lightning callback adds ``taken_at``); readers ignore
them. A global position resumes on any number of ranks, with any sampler over a dataset of ``n``
samples: the rest of the order is split among the ranks (:func:`remaining_share`), then the next
epochs are the sampler's own. A rank position resumes exactly on the same number of ranks (on
another, each rank skips its share of what all the writers consumed, with a warning).

Older formats (version 1, no ``version`` key) are read by :func:`read_position`: the Horovod
hook's (the keys above but ``version``, ``world_size``, ``generators``), the Lightning callback's
(``consumed_batches`` batches of ``batch_size``, ``epoch_generators``) and the state its sampler
gave torchdata's ``StatefulDataLoader`` (``yielded`` indices).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

VERSION = 2
MODES = ("global", "rank")


def position(epoch: int, mode: str, done: int, *, complete: bool | None, world_size: int | None,
             batch_size: int | None = None, total: int | None = None, order: dict[str, Any] | None = None,
             epoch_rng: torch.Tensor | None = None, generators: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """A version-2 position (every key present, in the documented order)."""
    return {"version": VERSION, "epoch": int(epoch), "mode": mode, "done": int(done), "complete": complete,
            "world_size": world_size, "batch_size": batch_size, "total": total, "order": order,
            "epoch_rng": epoch_rng, "generators": list(generators or [])}


def read_position(raw: Mapping[str, Any] | None, epoch_batches: int | None = None) -> dict[str, Any] | None:
    """The version-2 position stored as ``raw`` (any version this code ever wrote); ``None`` when
    ``raw`` holds none (a checkpoint taken without a resumable sampler).

    ``epoch_batches``: batches per epoch of the reading loader; decides whether a position of the
    Lightning callback's first format (counted in batches) ended its epoch. Raises ``ValueError``
    naming the key and value when ``raw`` is malformed or newer than this code.
    """
    if raw is None or "epoch" not in raw:
        return None
    version = raw.get("version", 1)
    if version == VERSION:
        pos = {k: raw.get(k) for k in position(0, "rank", 0, complete=None, world_size=None)}
        pos["generators"] = list(pos["generators"] or [])
    elif version != 1:
        raise ValueError(f"data position version {version!r} is not one this code reads (1 or {VERSION}): "
                         "resume with the ckpt-suite release that wrote the checkpoint, or a newer one")
    elif "mode" in raw:  # the Horovod hook's
        pos = position(raw["epoch"], raw["mode"], raw["done"], complete=raw.get("complete"), world_size=None,
                       batch_size=raw.get("batch_size"), total=raw.get("total"), order=raw.get("order"),
                       epoch_rng=raw.get("epoch_rng"))
    elif "consumed_batches" in raw:  # the Lightning callback's
        batches, size = int(raw["consumed_batches"]), int(raw.get("batch_size") or 1)
        pos = position(raw["epoch"], "rank", batches * size,
                       complete=None if epoch_batches is None else batches >= epoch_batches,
                       world_size=None, batch_size=size, epoch_rng=raw.get("epoch_rng"),
                       generators=raw.get("epoch_generators"))
    elif "yielded" in raw:  # the state the Lightning callback's sampler gave torchdata
        pos = position(raw["epoch"], "rank", raw["yielded"], complete=None, world_size=None,
                       epoch_rng=raw.get("epoch_rng"), generators=raw.get("generators"))
    else:
        raise ValueError(f"data position without 'mode', 'consumed_batches' or 'yielded' (keys: {sorted(raw)}): "
                         "not written by ckpt-suite")
    _check(pos)
    return pos


def _check(pos: dict[str, Any]) -> None:
    def bad(key: str, want: str) -> ValueError:
        return ValueError(f"data position: {key}={pos[key]!r} is invalid ({want})")

    if pos["mode"] not in MODES:
        raise bad("mode", f"one of {MODES}")
    for key in ("epoch", "done"):
        if type(pos[key]) is not int or pos[key] < 0:
            raise bad(key, "a non-negative integer")
    if pos["total"] is not None and (type(pos["total"]) is not int or pos["total"] < 0):
        raise bad("total", "a non-negative integer or None")
    for key in ("world_size", "batch_size"):
        if pos[key] is not None and (type(pos[key]) is not int or pos[key] < 1):
            raise bad(key, "a positive integer or None")
    if pos["complete"] not in (True, False, None):
        raise bad("complete", "true, false or None")
    if pos["mode"] == "global":
        order = pos["order"]
        if pos["total"] is None or not isinstance(order, Mapping) or not {"n", "seed", "shuffle", "drop_last"} <= set(order):
            raise bad("order", "a global position needs 'total' and 'order' with n, seed, shuffle, drop_last")


def global_order(pos: Mapping[str, Any]) -> list[int]:
    """The epoch's global order of a global position, as the ranks that saved it drew it."""
    from torch.utils.data.distributed import DistributedSampler

    order, total = pos["order"], pos["total"]
    proxy = object.__new__(DistributedSampler)
    proxy.__dict__.update(dataset=range(order["n"]), num_replicas=1, rank=0, epoch=pos["epoch"], drop_last=order["drop_last"],
                          shuffle=order["shuffle"], seed=order["seed"], num_samples=total, total_size=total)
    return list(DistributedSampler.__iter__(proxy))


def share_length(rest: int, world_size: int, drop_last: bool) -> int:
    """How many indices each rank gets when ``rest`` are split into equal shares
    (:func:`remaining_share`)."""
    if rest <= 0:
        return 0
    return rest // world_size if drop_last else -(-rest // world_size)


def remaining_share(order: list[int], done: int, world_size: int, rank: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s share of ``order[done:]`` split over ``world_size`` ranks, interleaved as a
    ``DistributedSampler`` splits (``rest[rank::world_size]``), with equal shares: padded by
    wrapping around the rest (or its tail dropped with ``drop_last``)."""
    rest = order[done:]
    per = share_length(len(rest), world_size, drop_last)
    need = per * world_size
    if need > len(rest):
        rest = (rest * -(-need // len(rest)))[:need]
    return rest[rank:need:world_size]
