"""A DCP checkpoint as a LightningModule's state: which keys are its weights and optimizers (the rule),
Lightning's ``meta.pt`` beside them, and the loads that ``fit(ckpt_path=<DCP directory>)`` and
``ckpt import`` of Lightning's sharded checkpoints use (Lightning is not imported here; reading the
DCP files themselves: :mod:`ckpt_engine.interop.dcp_import`, ``top_keys`` and ``load_into``).

The rule, on the DCP checkpoint's top-level keys (the first part of each saved key):

* weights: ``state_dict`` (Lightning's sharded ``save_checkpoint``: ``ModelParallelStrategy``,
  ``FSDPStrategy(state_dict_type="sharded")``), else ``model`` (``dcp.save({"model": ..., "optim": ...})``,
  torchtitan, this callback's own sharded layout); keyed as ``get_model_state_dict`` keys the module;
* optimizer ``i`` (in ``configure_optimizers``' order): ``optimizer_{i}`` (Lightning); with a single
  optimizer also ``optim`` or ``optimizer`` (torchtitan); keyed as ``get_optimizer_state_dict`` keys it
  (parameter names, not ids). A checkpoint with none of these holds weights only: the optimizers start
  fresh. One with some but not all of them is refused, naming the missing key;
* Lightning's loops, epoch, step, schedulers and callbacks' state: its ``meta.pt`` (``torch.save``), which
  only Lightning's own sharded checkpoints have. Anything else (torchtitan's ``train_state``,
  ``lr_scheduler``, ``dataloader``) is not restored, and named.
"""

from __future__ import annotations

import pickle
from typing import Any, Iterable, Sequence

import fsspec
import torch

from ..errors import CheckpointError
from .lightning import plain_misc

META = "meta.pt"
"""Lightning's file beside a sharded checkpoint's DCP files: its dictionary without weights."""
WEIGHT_KEYS = ("state_dict", "model")
SINGLE_OPTIMIZER_KEYS = ("optim", "optimizer")


def layout(keys: Iterable[str], optimizers: int, src: str) -> tuple[str, list[str]]:
    """``(weights key, optimizer keys)`` of a checkpoint with top-level ``keys`` for a module with
    ``optimizers`` optimizers, by the rule in the module docstring (no optimizer keys: weights only)."""
    top = set(keys)
    weights = next((k for k in WEIGHT_KEYS if k in top), None)
    if weights is None:
        raise CheckpointError(f"{src}: no module weights in this DCP checkpoint: looked for the top-level key "
                              "'state_dict' (Lightning's sharded save_checkpoint) or 'model' (dcp.save of {'model': "
                              f"..., 'optim': ...}}, torchtitan); it holds {sorted(top)}")
    named = [f"optimizer_{i}" for i in range(optimizers)]
    if optimizers == 1 and named[0] not in top:
        single = [k for k in SINGLE_OPTIMIZER_KEYS if k in top]
        named = single[:1] or named
    found = [k for k in named if k in top]
    if found and len(found) < len(named):
        missing = [k for k in named if k not in top]
        raise CheckpointError(f"{src}: the module has {optimizers} optimizers but this DCP checkpoint has no "
                              f"{', '.join(map(repr, missing))} (it holds {sorted(top)})")
    return weights, found


def unused(keys: Iterable[str], weights: str, optimizers: Sequence[str]) -> list[str]:
    """The top-level keys a restore by :func:`layout` leaves out."""
    return sorted(set(keys) - {weights, *optimizers})


def read_meta(src: str, *, options: dict[str, Any] | None = None, trust: bool = False) -> dict[str, Any] | None:
    """Lightning's ``meta.pt`` beside the DCP files in ``src`` (loops, epoch, global_step, schedulers,
    callbacks...), read with ``weights_only`` unless ``trust``; ``None`` when there is none."""
    fs, path = fsspec.core.url_to_fs(src, **(options or {}))
    where = f"{path.rstrip('/')}/{META}"
    if not fs.isfile(where):
        return None
    with fs.open(where, "rb") as f:
        try:
            meta = torch.load(f, map_location="cpu", weights_only=not trust)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{src}/{META} needs code to unpickle ({str(e).splitlines()[0]}); if you trust "
                                  "this checkpoint, pass trust=True (ckpt import --trust)") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{src}/{META} holds a {type(meta).__name__}, not Lightning's checkpoint dictionary")
    return meta


def optimizer_by_ids(optim: dict[str, Any], src: str, key: str) -> dict[str, Any]:
    """``get_optimizer_state_dict``'s form (parameters by name) of one optimizer as ``Optimizer.state_dict()``
    holds it (by number, in the order of its parameter groups), for a module that is not sharded."""
    groups = optim.get("param_groups")
    if not isinstance(groups, list) or not isinstance(optim.get("state"), dict):
        raise CheckpointError(f"{src}: {key!r} is not an optimizer state dict (no 'state' and 'param_groups'); "
                              f"it holds {sorted(map(str, optim))}")
    ids: dict[str, int] = {}
    out_groups = []
    for group in groups:
        names = list(group["params"])
        out_groups.append({**group, "params": [ids.setdefault(name, len(ids)) for name in names]})
    state = {}
    for name, value in optim["state"].items():
        if name not in ids:
            raise CheckpointError(f"{src}: {key!r} has state for {name!r}, which is in none of its param_groups")
        state[ids[name]] = value
    return {"state": state, "param_groups": out_groups}


def merged_optimizers(optims: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several optimizers' ``get_optimizer_state_dict`` forms as one, the way ``get_state_dict`` merges them."""
    if len(optims) == 1:
        return optims[0]
    state: dict[str, Any] = {}
    groups: list[Any] = []
    for optim in optims:
        state.update(optim.get("state", {}))
        groups += list(optim.get("param_groups", []))
    return {"state": state, "param_groups": groups}


def from_lightning_dcp(state: dict[str, Any], meta: dict[str, Any], src: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(replicated, local)`` of a checkpoint of ours, as ``AsyncShardedCheckpoint`` writes one under a
    sharded strategy, from Lightning's sharded checkpoint (``state``: the whole DCP state, ``meta``: its
    ``meta.pt``): ``{"model", "optim", "policy"}`` and ``{"misc": meta, "buffers": {}, "data": {}}``."""
    optimizers = sorted((k for k in state if k.startswith("optimizer_") and k[10:].isdigit()),
                        key=lambda k: int(k[10:]))
    if "state_dict" not in state:
        raise CheckpointError(f"{src}: Lightning's sharded checkpoint has no 'state_dict' (it holds {sorted(state)})")
    replicated = {"model": state["state_dict"], "optim": merged_optimizers([state[k] for k in optimizers])
                  if optimizers else {"state": {}, "param_groups": []}, "policy": {}}
    rest = {k: v for k, v in meta.items() if k not in ("state_dict", "optimizer_states")}
    return replicated, {"misc": plain_misc(rest, who=f"ckpt import {src}"), "buffers": {}, "data": {}}
