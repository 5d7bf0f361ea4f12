"""Lightning's ``.ckpt`` both ways, as plain data (Lightning is not imported here).

A checkpoint of ``lightning_ckpt.AsyncShardedCheckpoint`` holds Lightning's own checkpoint
dictionary split the way data parallelism splits it (``lightning_ckpt/_resume.py``):

* replicated: ``{"state_dict": weights without buffers, "optimizer_states": [...], "policy": ...}``;
* per writer rank (``local``): ``{"misc": the rest of Lightning's dictionary (epoch, global_step,
  loops, callbacks, lr_schedulers, hyper_parameters, ...), "buffers": this rank's module buffers,
  "data": the data position, "rng": the RNG states}``.

:func:`to_lightning` puts a ``.ckpt`` dictionary back together from that (writer rank 0's part,
as Lightning's own checkpoints hold rank 0's loops and buffers); :func:`from_lightning` splits a
``.ckpt`` dictionary into what the callback would have written; :func:`import_lightning` writes
that as a checkpoint of ours. The data position and RNG states are the callback's own and have no
place in a ``.ckpt``: a ``.ckpt`` exported mid-epoch resumes as Lightning resumes any mid-epoch
checkpoint (its loader restarts the epoch unless it is stateful), and a checkpoint imported from
a ``.ckpt`` resumes the data the same way.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import fsspec
import torch

from ..errors import CheckpointError, UnsupportedValueError
from ..state.values import encode

CALLBACK = "lightning_ckpt.AsyncShardedCheckpoint"
WEIGHTS = ("state_dict", "optimizer_states")
"""The replicated entries of a checkpoint the callback wrote under DDP or on one device."""
NEEDED = ("epoch", "global_step", "pytorch-lightning_version", "loops")
"""What ``Trainer.fit(ckpt_path=...)`` needs in a ``.ckpt`` beside the weights (``misc`` holds them)."""


def plain_misc(checkpoint: Mapping[str, Any], who: str = "AsyncShardedCheckpoint") -> dict[str, Any]:
    """Lightning's checkpoint minus weights, with the hyper-parameters that are not plain values
    dropped with a warning naming ``who`` (resume does not need them). Anything else unstorable
    fails in ``Checkpointer.save`` naming its key, so only the hyper-parameters are checked here."""
    out = {}
    for key, value in checkpoint.items():
        if "hyper_parameters" in key or "hparams" in key:
            try:
                encode(value, key)
            except UnsupportedValueError as e:
                if not isinstance(value, dict):
                    warnings.warn(f"{who}: {key} not stored: {e}", stacklevel=3)
                    continue
                value = {k: v for k, v in value.items() if _plain(k, v, who)}
        out[key] = value
    return out


def _plain(key: str, value: Any, who: str) -> bool:
    try:
        encode(value, key)
        return True
    except UnsupportedValueError:
        warnings.warn(f"{who}: hyper-parameter {key!r} is not a plain value and is not stored "
                      "(resume does not need it)", stacklevel=4)
        return False


def assemble(state: Mapping[str, Any], misc: Mapping[str, Any],
             buffers: Mapping[str, Any] | None) -> dict[str, Any]:
    """Lightning's checkpoint dictionary: the replicated weights and optimizer states, one rank's
    buffers, and the rest (loops, schedulers, callbacks, ...) from writer rank 0. ``buffers``
    ``None``: the rest alone (a sharded strategy's state is loaded by ``lightning_ckpt._sharded``,
    and the strategy's own restore methods do nothing)."""
    checkpoint = dict(misc)
    if buffers is None:
        return checkpoint
    checkpoint["state_dict"] = {**state["state_dict"], **buffers}
    checkpoint["optimizer_states"] = state["optimizer_states"]
    return checkpoint


def to_lightning(state: Mapping[str, Any], local: Mapping[str, Any] | None, step: int) -> dict[str, Any]:
    """The ``.ckpt`` dictionary of checkpoint ``step``: its replicated ``state`` and one writer rank's
    ``local`` part (rank 0's for Lightning's own rule). Raises :class:`CheckpointError` naming what is
    missing when the checkpoint was not written by the Lightning callback under DDP or on one device."""
    keys = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
    if isinstance(state, Mapping) and {"model", "optim"} <= set(state) and not set(WEIGHTS) <= set(state):
        raise CheckpointError(f"step {step} was written by {CALLBACK} under a sharded strategy (FSDP2, tensor "
                              "parallel, FSDP1): its state holds get_state_dict()'s 'model' and 'optim', which a "
                              ".ckpt does not; export it with --format dcp (or resume it with such a strategy)")
    missing = [k for k in WEIGHTS if not isinstance(state, Mapping) or k not in state]
    misc = local.get("misc") if isinstance(local, Mapping) else None
    if missing or not isinstance(misc, Mapping):
        lacks = [f"state[{k!r}]" for k in missing] + ([] if isinstance(misc, Mapping) else ["local['misc']"])
        raise CheckpointError(f"step {step} was not written by {CALLBACK}: it has no {', '.join(lacks)} (its state "
                              f"holds {keys}); a Lightning .ckpt is made only from the callback's checkpoints. "
                              "Export it with --format torch or --format safetensors instead")
    absent = [k for k in NEEDED if k not in misc]
    if absent:
        raise CheckpointError(f"step {step}: Lightning's dictionary in local['misc'] has no {', '.join(absent)}, "
                              f"which Trainer.fit(ckpt_path=...) needs; it holds {sorted(misc)}")
    buffers = local.get("buffers", {}) if isinstance(local, Mapping) else {}
    return assemble(state, misc, buffers)


def from_lightning(checkpoint: Mapping[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any], int]:
    """``(state, local, step)`` as the callback writes them, from a ``.ckpt`` dictionary read from
    ``source`` (for messages). Every module tensor goes to the replicated weights (no module here
    to say which are buffers; a restore merges both); the data position is left empty (Lightning's
    loops and a stateful loader's state, in ``misc``, say where the data stands). Raises
    :class:`CheckpointError` naming what is missing."""
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(f"{source} holds a {type(checkpoint).__name__}, not a Lightning checkpoint dictionary")
    missing = [k for k in ("state_dict", *NEEDED) if k not in checkpoint]
    if missing:
        raise CheckpointError(f"{source} is not a Lightning checkpoint that a fit can resume from: it has no "
                              f"{', '.join(missing)} (its keys: {sorted(map(str, checkpoint))})")
    if "optimizer_states" not in checkpoint:
        raise CheckpointError(f"{source} holds no optimizer_states (saved with save_weights_only=True?): a run "
                              "cannot resume from it; load its weights with LightningModule.load_from_checkpoint")
    rest = {k: v for k, v in checkpoint.items() if k not in WEIGHTS}
    state = {"state_dict": dict(checkpoint["state_dict"]), "optimizer_states": list(checkpoint["optimizer_states"]),
             "policy": {}}
    local = {"misc": plain_misc(rest, who=f"ckpt import {os.path.basename(source)}"), "buffers": {}, "data": {}}
    return state, local, int(checkpoint["global_step"])


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_lightning` wrote: the checkpoint root and step, the tensors and their bytes,
    the other values (leaves)."""

    root: str
    step: int
    tensors: int
    tensor_bytes: int
    values: int


def import_lightning(source: str, root: str, *, step: int | None = None, storage_options: dict[str, Any] | None = None,
                     source_options: dict[str, Any] | None = None, trust: bool = False) -> ImportResult:
    """Write the Lightning ``.ckpt`` file ``source`` (a path or fsspec URL) as a checkpoint of ours
    under ``root`` (an empty root: refused when it holds a committed checkpoint), at ``step`` (default:
    the ``.ckpt``'s global step), as ``AsyncShardedCheckpoint`` writes one under DDP; a fit with that
    callback on ``root`` then resumes from it (``resume="auto"``), on any number of ranks.

    The file is read with ``torch.load(weights_only=True)``: plain values and tensors only (Lightning
    saves those, except hyper-parameters of other types such as an OmegaConf container, which fail
    here naming the type); ``trust=True`` unpickles anything (only for files you trust), and values
    our format cannot store are then refused naming their key. Raises :class:`CheckpointError`."""
    from ..checkpointer import Checkpointer

    try:
        with fsspec.open(source, "rb", **(source_options or {})) as f:
            checkpoint = torch.load(f, map_location="cpu", weights_only=not trust)
    except FileNotFoundError as e:
        raise CheckpointError(f"ckpt import: {source} does not exist") from e
    except Exception as e:  # torch raises UnpicklingError (or RuntimeError) for what weights_only refuses
        raise CheckpointError(f"ckpt import: cannot read {source} as a torch checkpoint of plain values and "
                              f"tensors ({type(e).__name__}: {str(e)[:500]}); if you trust the file, pass --trust "
                              "(trust=True)") from e
    state, local, own_step = from_lightning(checkpoint, source)
    step = own_step if step is None else step
    ck = Checkpointer(root, storage_options=storage_options)
    try:
        existing = ck.steps()
        if existing:
            raise CheckpointError(f"ckpt import: {root} already holds checkpoints (steps {existing}); import into "
                                  "an empty root (a run resumes from the newest there, which might not be this one)")
        ck.save(state, step, local)
        ck.wait()
    finally:
        ck.close()
    leaves = _leaves(state) + _leaves(local)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    return ImportResult(root, step, len(tensors), sum(t.numel() * t.element_size() for t in tensors),
                        len(leaves) - len(tensors))


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _leaves(v)]
    return [value]
