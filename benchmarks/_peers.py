"""The peers every save benchmark measures ours against, written once: ``torch.save``, Lightning's
``AsyncCheckpointIO`` and ``torch.distributed.checkpoint``'s ``save``, ``load`` and ``async_save`` with the
stagers it ships. Each starts a save and hands back what completes it, so that a benchmark times the call
(the stall), the wait until the state may change and the wait until durable as its own method says;
``bench_save`` and ``bench_sharded`` on CPU ranks, ``bench_gpu`` on one device.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from typing import Any, Callable, Optional

import torch

from _common import empty_like_state, fsync_path, timed

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
