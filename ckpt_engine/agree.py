"""A failure on one rank, raised on every rank: the collectives that carry it.

Why: where rank 0 alone does something (creates the checkpoint root, sweeps it, lists the
checkpoints) and then broadcasts the outcome, a failure used to end rank 0 before its broadcast;
the other ranks then waited in that broadcast until the communicator shut down, and said only that
("Horovod has been shut down"). Users read the log of the rank that failed last. Here the failure
itself is what is sent: every rank raises the same error type with the same message, naming the
rank where it happened, and the job still stops.

Contract (every rank calls, in the same order, from the training thread, like any collective):

* :func:`on_rank0` — ``fn`` runs on rank 0 only; its JSON result, or its failure, is broadcast.
  A success is sent as the bare value, so the collective is the same one as a plain broadcast.
* :func:`on_every_rank` — ``fn`` runs on every rank, then one all-gather of the outcomes; when any
  rank failed every rank raises. ``fn`` itself must not contain a collective that a failing rank
  could skip.

The rank that failed raises its own exception (traceback intact); the others raise a rebuilt one of
the same class when it is the engine's or a built-in exception, else :class:`CheckpointError`.
"""

from __future__ import annotations

import builtins
from typing import Any, Callable, TypeVar

from . import errors
from .comm import Comm
from .errors import CheckpointError

T = TypeVar("T")

_FAILED = "ckpt_engine.agree.failed"
"""The key that marks a broadcast payload as a failure (no value the engine broadcasts has it)."""


def on_rank0(comm: Comm, fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0, its result broadcast to every rank; a failure is raised on every rank."""
    if comm.world_size == 1:
        return fn()
    if comm.rank != 0:
        got = comm.broadcast(None)
        if isinstance(got, dict) and _FAILED in got:
            raise rebuild(got[_FAILED])
        return got
    try:
        value = fn()
    except Exception as e:
        comm.broadcast({_FAILED: describe(e, 0)})
        raise
    return comm.broadcast(value)


def on_every_rank(comm: Comm, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank; if it failed anywhere, every rank raises (after one all-gather)."""
    if comm.world_size == 1:
        return fn()
    try:
        value, mine = fn(), None
    except Exception as e:
        value, mine = None, e
    outcomes = comm.all_gather(None if mine is None else describe(mine, comm.rank))
    if mine is not None:
        raise mine
    failed = [o for o in outcomes if o is not None]
    if len(failed) > 1:
        failed[0]["message"] += f" (ranks {[o['rank'] for o in failed]} failed)"
    if failed:
        raise rebuild(failed[0])
    return value  # type: ignore[return-value]


def describe(error: BaseException, rank: int) -> dict[str, Any]:
    """``error`` as plain values for a collective."""
    return {"type": type(error).__name__, "message": str(error), "rank": rank}


def rebuild(failure: dict[str, Any]) -> Exception:
    """The exception :func:`describe` described, raised where it did not happen: same class when
    known (the engine's errors, built-in exceptions), message prefixed with the rank."""
    cls = _known_class(str(failure["type"]))
    message = f"rank {failure['rank']}: {failure['message']}"
    try:
        return cls(message) if cls is not None else CheckpointError(f"{failure['type']}: {message}")
    except Exception:  # a class whose constructor wants more than a message
        return CheckpointError(f"{failure['type']}: {message}")


def _known_class(name: str) -> type[Exception] | None:
    known = {c.__name__: c for c in vars(errors).values()
             if isinstance(c, type) and issubclass(c, Exception)}
    cls = known.get(name, getattr(builtins, name, None))
    return cls if isinstance(cls, type) and issubclass(cls, Exception) else None
