"""Starting a Horovod run from a DCP checkpoint (``torch.distributed.checkpoint``: written by ``dcp.save``,
torchtitan or Lightning's sharded ``save_checkpoint``): :meth:`HorovodCheckpointer.restore_dcp`.

Under Horovod the model is replicated, so every rank reads the whole state (DCP's reader puts every
writer's chunks together, whatever mesh wrote them) and loads it into its model and optimizer. Which
top-level keys are the weights and the optimizer is the rule of :mod:`ckpt_engine.interop.dcp_lightning`:
weights ``state_dict`` else ``model``; the optimizer ``optimizer_0``, ``optim`` or ``optimizer`` (by
parameter name, as ``get_optimizer_state_dict`` writes it), none meaning weights only.
"""

from __future__ import annotations

from typing import Any

from ckpt_engine.errors import CheckpointError
from ckpt_engine.interop.dcp_import import own_step, read_dcp
from ckpt_engine.interop.dcp_lightning import layout, optimizer_by_ids, unused


def load_dcp(src: str, model: Any, optimizer: Any, *, trust: bool = False,
             options: dict[str, Any] | None = None) -> tuple[int, str]:
    """Load the DCP checkpoint in directory ``src`` into ``model`` (and ``optimizer``, when given and the
    checkpoint has one); ``(step, what was restored from where)``. The step is the checkpoint's own
    (``step`` or ``global_step``), else 0. Raises :class:`CheckpointError` naming the keys that are
    missing, unexpected or of another shape."""
    state = read_dcp(src, options=options, trust=trust)
    weights, optims = layout(state.keys(), 1 if optimizer is not None else 0, src)
    if not isinstance(state[weights], dict):
        raise CheckpointError(f"{src}: {weights!r} holds a {type(state[weights]).__name__}, not a state dict")
    try:
        model.load_state_dict(state[weights])
    except RuntimeError as e:  # torch names the missing and unexpected keys and the shapes that differ
        raise CheckpointError(f"{src}: the model does not take the checkpoint's {weights!r}: {e}") from e
    if optims:
        try:
            optimizer.load_state_dict(optimizer_by_ids(state[optims[0]], src, optims[0]))
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{src}: the optimizer does not take the checkpoint's {optims[0]!r}: {e}") from e
    step = own_step(state) or 0
    left = unused(state.keys(), weights, optims)
    what = (f"the model from {weights!r}"
            + (f", the optimizer from {optims[0]!r}" if optims else ", no optimizer state (it starts fresh)")
            + f"; step {step}" + (f"; not restored: {', '.join(map(repr, left))}" if left else ""))
    return step, what
