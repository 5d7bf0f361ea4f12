"""``trainer.fit(model, ckpt_path=<DCP directory>)``: a run started from a torch.distributed.checkpoint
(``dcp.save``, torchtitan, Lightning's sharded ``save_checkpoint``), for ``_resume.resume_start``.

Which keys are the module's weights and optimizers: the rule in :mod:`ckpt_engine.interop.dcp_lightning`.

* Under a sharded strategy (``ModelParallelStrategy``, ``FSDPStrategy``: restored after their set-up)
  the live sharded state (``get_model_state_dict`` / ``get_optimizer_state_dict``: ``DTensor`` shards
  or FSDP1's) is filled by ``dcp.load``, each rank reading its region, resharded to this mesh and
  world size, and loaded with ``set_*_state_dict``, as ``restore(into=...)`` does for ours.
  Lightning's own sharded checkpoints (a ``meta.pt`` beside the DCP files) are left to Lightning:
  its strategy loads them, loops and all, the same way.
* Under DDP or one device (restored before the optimizers exist) the state is read whole
  (every rank holds it whole anyway) and handed to Lightning as its checkpoint dictionary, each
  optimizer's state renumbered from parameter names to ``Optimizer.state_dict()``'s ids.

Loops, epoch, step, schedulers and callbacks come from ``meta.pt`` when there is one (Lightning's
checkpoints); a plain ``dcp.save`` has none, so training counts from step 0 with the restored
weights and optimizer states, as a loop of one's own that calls ``dcp.load`` before training does.
"""

from __future__ import annotations

from typing import Any

from ckpt_engine.interop import dcp_lightning as rule

from . import _lightning, _sharded, _trainer_api

# ckpt_engine.interop.dcp_import is imported where it is used: it imports torch.distributed.checkpoint,
# 43 ms of CPU in every fit's process otherwise, most of which never reads a DCP directory.


def takes(trainer: Any, path: Any) -> bool:
    """Whether ``ckpt_path`` is a DCP directory this callback restores (Lightning's own sharded ones
    under a sharded strategy go to Lightning). Every rank decides alike (the same directory)."""
    text = str(path)
    if "://" in text and not text.startswith("file://"):
        return False  # remote DCP directories: Lightning's strategies read local paths only; ckpt import reads them
    from ckpt_engine.interop.dcp_import import is_dcp

    if not is_dcp(text):
        return False
    return not (_sharded.applies(trainer) and rule.read_meta(text) is not None)


def restore(trainer: Any, path: Any) -> dict[str, Any]:
    """Restore the module's weights and optimizers from the DCP directory ``path`` (every rank, a collective
    under a sharded strategy) and return the checkpoint dictionary Lightning restores the rest from."""
    from ckpt_engine.interop.dcp_import import read_dcp, top_keys

    src = str(path).removeprefix("file://")
    optimizers = list(trainer.optimizers) if _sharded.applies(trainer) else _trainer_api.planned_optimizers(trainer)
    keys = top_keys(src)
    weights, optims = rule.layout(keys, len(optimizers), src)
    meta = rule.read_meta(src)
    checkpoint: dict[str, Any] = {k: v for k, v in (meta or {}).items() if k not in ("state_dict", "optimizer_states")}
    checkpoint.setdefault("lr_schedulers", [])  # none to restore: the schedulers start fresh
    if _sharded.applies(trainer):
        _load_sharded(trainer, src, weights, optims)
        checkpoint["optimizer_states"] = []  # the strategy's own restore of them does nothing
    else:
        state = read_dcp(src)
        checkpoint["state_dict"] = state[weights]
        checkpoint["optimizer_states"] = [rule.optimizer_by_ids(state[k], src, k) for k in optims]
    _lightning.notice(trainer, _said(src, weights, optims, len(optimizers), keys, meta))
    return checkpoint


def _load_sharded(trainer: Any, src: str, weights: str, optims: list[str]) -> None:
    from ckpt_engine.interop.dcp_import import load_into
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    model, optimizers = trainer.strategy.model, list(trainer.optimizers)
    state: dict[str, Any] = {weights: get_model_state_dict(model)}
    for key, optimizer in zip(optims, optimizers):  # no optimizer keys: fresh optimizers, left untouched
        state[key] = get_optimizer_state_dict(model, optimizer)
    load_into(src, state)
    set_model_state_dict(model, state[weights])
    for key, optimizer in zip(optims, optimizers):
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state[key])


def _said(src: str, weights: str, optims: list[str], optimizers: int, keys: list[str], meta: Any) -> str:
    parts = [f"the module's weights from {weights!r}"]
    parts.append(f"its optimizers from {', '.join(map(repr, optims))}" if optims else
                 f"no optimizer state ({optimizers} optimizer(s) start fresh: the checkpoint holds none)")
    parts.append("loops, epoch and step from meta.pt" if meta is not None else
                 "no loops (no meta.pt: training counts from step 0)")
    left = rule.unused(keys, weights, optims)
    tail = f"; not restored: {', '.join(map(repr, left))}" if left else ""
    return f"AsyncShardedCheckpoint: restoring the DCP checkpoint {src}: {'; '.join(parts)}{tail}."
