"""What a Horovod job's checkpoint holds, split the way data parallelism splits it.

* replicated (identical on every rank after ``hvd.DistributedOptimizer``'s allreduce; sliced
  across ranks by the engine): model parameters, optimizer state, LR scheduler, the registered
  extra objects, the step;
* per rank (each rank stores its own whole): model buffers (BatchNorm statistics are updated on
  each rank's own data), per-rank extra objects, the RNG states, the data position.

The objects :class:`~horovod_ckpt.HorovodCheckpointer` tracks; a module is split by the core's
:func:`~ckpt_engine.training.parts.split_weights`, and the RNG states are added by the training session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckpt_engine.errors import CheckpointError
from ckpt_engine.training.parts import split_weights


@dataclass
class Tracked:
    """The objects whose state a checkpoint holds."""

    model: Any
    optimizer: Any = None
    scheduler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    extra_local: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, obj in [("model", self.model), ("optimizer", self.optimizer), ("scheduler", self.scheduler),
                          *self.extra.items(), *self.extra_local.items()]:
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{name}: expected an object with state_dict() and load_state_dict(), "
                                f"got {type(obj).__name__}")

    def register(self, name: str, obj: Any, per_rank: bool = False) -> None:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name}: expected an object with state_dict() and load_state_dict(), "
                            f"got {type(obj).__name__}")
        if name in self.extra or name in self.extra_local:
            raise ValueError(f"an object named {name!r} is already registered")
        (self.extra_local if per_rank else self.extra)[name] = obj

    def capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(replicated, per_rank)`` state dictionaries of every tracked object."""
        weights, buffers = split_weights(self.model.state_dict(), (name for name, _ in self.model.named_buffers()))
        replicated = {
            "model": weights,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "extra": {k: v.state_dict() for k, v in self.extra.items()},
        }
        per_rank = {"buffers": buffers, "extra": {k: v.state_dict() for k, v in self.extra_local.items()}}
        return replicated, per_rank

    def apply(self, replicated: dict[str, Any], per_rank: dict[str, Any] | None) -> None:
        """Load what :meth:`capture` returned (``per_rank`` of another writer rank when this rank
        has none of its own, e.g. after a restart on more ranks)."""
        weights = {**replicated["model"], **(per_rank or {}).get("buffers", {})}
        self.model.load_state_dict(weights)
        for name, obj, saved in [("optimizer", self.optimizer, replicated.get("optimizer")),
                                 ("scheduler", self.scheduler, replicated.get("scheduler"))]:
            if obj is not None:
                if saved is None:
                    raise CheckpointError(f"the checkpoint holds no {name} state, but a {name} was given")
                obj.load_state_dict(saved)
        for group, objects in [(replicated.get("extra", {}), self.extra),
                               ((per_rank or {}).get("extra", {}), self.extra_local)]:
            for name, obj in objects.items():
                if name not in group:
                    raise CheckpointError(f"the checkpoint holds no state for the registered object {name!r}; "
                                          f"it has: {sorted(group)}")
                obj.load_state_dict(group[name])
