"""The peers every save benchmark measures ours against, written once: ``torch.save``, Lightning's
``AsyncCheckpointIO`` and ``ModelParallelStrategy`` save and ``torch.distributed.checkpoint``'s ``save``,
``load`` and ``async_save`` with the stagers it ships. Each starts a save and hands back what completes it,
so that a benchmark times the call (the stall), the wait until the state may change and the wait until
durable as its own method says; ``bench_gpu`` on one device. The tables :data:`REPLICATED` and
:data:`SHARDED` give, per peer, one round of it on a CPU rank as ``bench_save`` and ``bench_sharded`` time it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

from _common import Metrics, RankCtx, empty_like_state, fsync_path, synchronous, timed

Staged = Optional[Callable[[], Any]]
"""What returns once the state may change again (``None``: at once, the call copied it)."""


def torch_save(state: Any, path: str) -> None:
    """``torch.save`` of ``state`` to ``path``, then ``fsync``: durable when it returns."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


class LightningAsync:
    """``AsyncCheckpointIO(TorchCheckpointIO())`` to ``path``, as Lightning saves: :meth:`save` is the call
    (it clones every tensor, then writes on a thread), :meth:`durable` its ``teardown()`` (the write) and
    an ``fsync`` (Lightning does not sync), returning the ``fsync``'s seconds."""

    def __init__(self, path: str) -> None:
        pl = "pytorch_lightning" if importlib.util.find_spec("pytorch_lightning") else "lightning.pytorch"
        io = importlib.import_module(f"{pl}.plugins.io")
        self.io, self.path = io.AsyncCheckpointIO(io.TorchCheckpointIO()), path

    def save(self, state: Any) -> None:
        self.io.save_checkpoint(state, self.path)

    def durable(self) -> float:
        self.io.teardown()
        return timed(lambda: fsync_path(self.path))[0]


def dcp_save(state: Any, path: str) -> None:
    """``torch.distributed.checkpoint.save`` (synchronous, every file ``fsync``ed) on every rank."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path)


def dcp_load(state: Any, path: str) -> Any:
    """``torch.distributed.checkpoint.load`` into fresh tensors shaped as ``state``."""
    import torch.distributed.checkpoint as dcp

    target = empty_like_state(state)
    dcp.load(target, checkpoint_id=path)
    return target


def dcp_async(state: Any, path: str, **kwargs: Any) -> tuple[Staged, Callable[[], Any]]:
    """``async_save`` (``kwargs``: ``async_stager``, ``async_checkpointer_type``); returns (until the state
    may change: the staging, where the response has one; until durable). Without a process group it
    saves as one process (``no_dist``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized() and "no_dist" in inspect.signature(dcp.async_save).parameters:
        kwargs["no_dist"] = True
    res = dcp.async_save(state, checkpoint_id=path, **kwargs)
    staging = getattr(res, "staging_completion", None)
    return (staging.result if staging is not None else None), getattr(res, "upload_completion", res).result


def dcp_stager(pinned: bool, keep_copies: bool = False) -> Any:
    """A ``DefaultStager`` staging on a background thread; ``pinned``: into pinned memory with non-blocking
    copies (CUDA). ``keep_copies``: its copies reused across saves, as designed; in torch 2.11
    ``DefaultStager._stage`` closes its ``StateDictStager`` after every stage, which drops the cache and
    clears its deepcopy dispatch table (the next save fails with ``KeyError: <class 'type'>``), so that
    inner ``close`` is disabled until :func:`close_stager`."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=pinned))
    if keep_copies:
        stager._state_dict_stager.close = lambda: None
    return stager


def close_stager(stager: Any) -> None:
    """Close a stager of :func:`dcp_stager`, its kept copies too."""
    inner = stager._state_dict_stager
    if "close" in vars(inner):  # its copies kept: the class's close drops them
        type(inner).close(inner)
    stager.close()


# ---- one round of each peer on a CPU rank, as bench_save and bench_sharded time it ---------------------
@dataclass(frozen=True)
class Peer:
    """A peer of a save benchmark's table: ``label`` in its report; ``save(ctx, path, **kwargs)``, one save of
    ``ctx.state`` to ``path`` and its figures; ``load(state, path)``, where restores are timed, what the
    save left, loaded; ``rank0``: rank 0 alone saves (it writes everything); ``using()``: what its rounds
    share (a context manager yielding the ``kwargs``)."""

    label: str
    save: Callable[..., Metrics]
    load: Callable[[Any, str], Any] | None = None
    rank0: bool = False
    using: Callable[[], ContextManager[dict[str, Any]]] = lambda: contextlib.nullcontext({})


def async_round(ctx: RankCtx, path: str, **kwargs: Any) -> Metrics:
    """One ``async_save``: the call (stall), until the state may change (staging done), until durable."""
    stall, (staged, durable) = timed(lambda: dcp_async(ctx.state, path, **kwargs))
    mutable = stall + (timed(staged)[0] if staged is not None else 0.0)
    return {"stall_s": stall, "mutable_s": mutable, "total_s": mutable + timed(durable)[0]}


def lightning_async_round(ctx: RankCtx, path: str) -> Metrics:
    """:class:`LightningAsync`: the stall is the ``save_checkpoint`` call (it clones every tensor), the total
    adds ``teardown()`` and an ``fsync`` (Lightning does not sync; ``fsync_s`` apart)."""
    io = LightningAsync(path)
    stall = timed(lambda: io.save(ctx.state))[0]
    rest, fsync_s = timed(io.durable)
    return {"stall_s": stall, "fsync_s": fsync_s, "total_s": stall + rest}


def lightning_sharded_round(ctx: Any, path: str) -> Metrics:
    """What ``ModelParallelStrategy(save_distributed_checkpoint=True).save_checkpoint`` does after the
    state's collection, on ``ctx.model`` and ``ctx.opt``: ``get_*_state_dict`` with ``cpu_offload=True``,
    ``dcp.save({"state_dict", "optimizer_0"})``, ``torch.save`` of the rest on rank 0; no ``Trainer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    def save() -> None:
        options = StateDictOptions(full_state_dict=False, cpu_offload=True)
        msd, osd = get_model_state_dict(ctx.model, options=options), get_optimizer_state_dict(ctx.model, ctx.opt,
                                                                                                  options=options)
        os.makedirs(path, exist_ok=True)
        dcp.save({"state_dict": msd, "optimizer_0": osd}, checkpoint_id=path)
        if ctx.rank == 0:
            torch.save({"epoch": 0, "global_step": 1, "loops": {}, "callbacks": {}}, os.path.join(path, "meta.pt"))

    return synchronous(save)


@contextlib.contextmanager
def kept_stager() -> Iterator[dict[str, Any]]:
    """One ``DefaultStager`` kept across the rounds, staging on a background thread (pinned memory and
    non-blocking copies only where CUDA exists)."""
    stager = dcp_stager(pinned=torch.cuda.is_available())
    try:
        yield {"async_stager": stager}
    finally:
        close_stager(stager)


def in_process() -> ContextManager[dict[str, Any]]:
    """``async_checkpointer_type=PROCESS``: a checkpoint daemon process per rank writes."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return contextlib.nullcontext({"async_checkpointer_type": AsyncCheckpointerType.PROCESS})


DCP_SAVE = Peer("DCP save", lambda ctx, path: synchronous(lambda: dcp_save(ctx.state, path)))
DCP_ASYNC = Peer("DCP async_save", async_round)
REPLICATED: dict[str, Peer] = {
    "torch_save": Peer("torch.save", lambda ctx, path: synchronous(lambda: torch_save(ctx.state, path)),
                       lambda state, path: torch.load(path, weights_only=True), rank0=True),
    "lightning": Peer("Lightning AsyncCheckpointIO", lightning_async_round, rank0=True),
    "dcp_save": replace(DCP_SAVE, load=dcp_load), "dcp_async": DCP_ASYNC}
"""bench_save's peers: each on a replicated state, ``torch.save`` and Lightning on rank 0 as under DDP."""
SHARDED: dict[str, Peer] = {
    "lightning": Peer("Lightning ModelParallelStrategy save (its calls)", lightning_sharded_round),
    "dcp_save": DCP_SAVE, "dcp_async": DCP_ASYNC,
    "dcp_async_stager": Peer("DCP async_save, reused DefaultStager", async_round, using=kept_stager),
    "dcp_async_process": Peer("DCP async_save, PROCESS", async_round, using=in_process)}
"""bench_sharded's peers: each on every rank's shard (DTensors), every file ``fsync``ed."""
