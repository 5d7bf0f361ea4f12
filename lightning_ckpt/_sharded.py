"""Sharded strategies: the model's and optimizers' state as ``DTensor`` chunks, each rank its own.

Under ``ModelParallelStrategy`` (FSDP2, tensor parallel, both) and ``FSDPStrategy`` the state is
not replicated, and the dictionary Lightning assembles is no use to this callback: the strategy
copies every chunk to CPU for it (``cpu_offload=True``) or, for a full state dict, gathers it on
rank 0, and its restore methods do nothing (the strategy loads its own files in
``load_checkpoint``). So the weights and optimizer states are taken here, at the step boundary,
with ``get_state_dict(..., full_state_dict=False, cpu_offload=False)``: ``DTensor`` views of the
live shards, which the engine copies into its host buffers, each rank its own chunks, before
training goes on. Lightning's ``dump_checkpoint`` then provides only the rest (loops, schedulers,
callbacks), without collecting the weights at all.

Restore runs once the strategy has sharded the model and created the optimizers (both strategies
restore after their ``setup``): the engine fills the fresh model's and optimizers' own sharded
state in place (``restore(into=...)``: each rank reads only the pieces its chunks need, on any
number of ranks), and ``set_state_dict`` loads it. Plain (non-``DTensor``) buffers, such as
BatchNorm statistics, differ per rank and are kept per rank, as under DDP.

A checkpoint holds ``{"model": ..., "optim": ...}`` as ``get_state_dict`` keys them (parameter
names, no wrapper prefixes), so ``Checkpointer.load()`` gives it back whole in any process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_engine.errors import CheckpointError, MismatchError
from ckpt_engine.interop.lightning import plain_misc
from ckpt_engine.sharding.dtensors import is_dtensor
from ckpt_engine.training.parts import Parts, Resumed

from . import _lightning

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from ckpt_engine.training.session import TrainingSession

WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Module names that wrappers insert and that ``get_state_dict`` leaves out of the keys."""


def applies(trainer: "Trainer") -> bool:
    """Whether ``trainer``'s strategy shards the state (``ModelParallelStrategy``, ``FSDPStrategy``)."""
    strategies = _lightning.of(trainer).strategies
    return isinstance(trainer.strategy, (strategies.ModelParallelStrategy, strategies.FSDPStrategy))


def state(trainer: "Trainer") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(sharded, buffers)``: the model's and optimizers' state as ``{"model", "optim"}`` (``DTensor``
    views of this rank's shards, no copy), and this rank's plain buffers, cloned (a forward may
    update them while the snapshot is taken). Every rank, after the strategy's ``setup``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optimizers = trainer.strategy.model, list(trainer.optimizers)
    if model is None or not optimizers:
        raise CheckpointError("AsyncShardedCheckpoint: the sharded strategy's model and optimizers are not set up "
                              "yet; the state can only be taken or restored during fit()")
    weights, optim = get_state_dict(model, optimizers,
                                    options=StateDictOptions(full_state_dict=False, cpu_offload=False))
    _refuse_sharded_tensors(weights)
    names = {_fqn(name) for name, _ in trainer.lightning_module.named_buffers()}
    buffers = {k: v.detach().clone() for k, v in weights.items() if k in names and not is_dtensor(v)}
    return {"model": {k: v for k, v in weights.items() if k not in buffers}, "optim": optim}, buffers


def split(trainer: "Trainer", misc: dict[str, Any]) -> Parts:
    """What a checkpoint holds under a sharded strategy: the sharded state (replicated part: the engine
    writes each rank's chunks) and, per rank, the plain buffers and Lightning's dictionary ``misc``
    (dumped without weights: :func:`lightning_ckpt._trainer_api.dump_checkpoint`)."""
    sharded, buffers = state(trainer)
    return Parts(sharded, {"misc": plain_misc(misc), "buffers": buffers})


def _refuse_sharded_tensors(weights: dict[str, Any]) -> None:
    """FSDP1 without a device mesh shards its state dict as the deprecated ``ShardedTensor``, which has
    no ``DTensor`` form: refuse it, naming the key and the fix."""
    for key, value in weights.items():
        if type(value).__name__ == "ShardedTensor":
            raise CheckpointError(f"AsyncShardedCheckpoint: state_dict[{key!r}] is a ShardedTensor (FSDP1 without a "
                                  "device mesh), which cannot be stored; give FSDP1 a device mesh (FSDPStrategy("
                                  "device_mesh=...), or FullyShardedDataParallel(..., device_mesh=...) in "
                                  "configure_model) so that it shards as DTensor, or use ModelParallelStrategy (FSDP2)")


def _fqn(name: str) -> str:
    """``name`` without the wrappers' own module names, as ``get_state_dict`` keys it (a module that the
    user wrapped in FSDP1, activation checkpointing or ``torch.compile`` inside the LightningModule)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def restore(session: "TrainingSession", trainer: "Trainer", step: int | None) -> Resumed | None:
    """``session.restore(step)`` for a sharded strategy (every rank, a collective): fill the model's and
    optimizers' sharded state from the checkpoint, each rank reading its chunks, and load it with
    ``set_state_dict`` (this rank's buffers from its per-rank part). Returns the :class:`Resumed`
    (``None``: nothing committed, nothing changed)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    target, _ = state(trainer)  # creates the optimizers' state (a zero step) so that there is one to fill
    try:
        resumed = session.restore(step, into=target)
    except MismatchError as e:
        raise CheckpointError(f"AsyncShardedCheckpoint: the checkpoint under {session.config.location} cannot be "
                              f"restored into this sharded model: {e}. One written under DDP or a single device "
                              "holds Lightning's state dict, not get_state_dict()'s: resume it with such a "
                              "strategy") from e
    if resumed is None:
        return None
    set_state_dict(trainer.strategy.model, list(trainer.optimizers),
                   model_state_dict={**target["model"], **resumed.per_rank["buffers"]},
                   optim_state_dict=target["optim"], options=StateDictOptions(full_state_dict=False, cpu_offload=False))
    return resumed
