"""Every use of Lightning's private API, in one place (each is covered by the tests).

Lightning has no public way to (a) get the checkpoint dictionary it would save, without writing
it, or (b) restore from a dictionary it did not load itself. Both exist on the trainer's checkpoint
connector; ``resume="auto"`` needs (b) because ``Trainer._select_ckpt_path`` runs before any
callback hook, so the callback cannot change ``ckpt_path`` and instead hands the connector the
dictionary it would otherwise have read (``resume_start(None)`` leaves it in place).
"""

from __future__ import annotations

from typing import Any, Callable

import pytorch_lightning as pl


def dump_checkpoint(trainer: "pl.Trainer") -> dict[str, Any]:
    """The full checkpoint dictionary Lightning would save now (weights, optimizers, loops...)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def inject_loaded_checkpoint(trainer: "pl.Trainer", checkpoint: dict[str, Any]) -> None:
    """Make the coming restore steps of ``fit()`` use ``checkpoint`` (call from ``setup``)."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def wrap_process_dataloader(trainer: "pl.Trainer", after: Callable[[Any], Any]) -> None:
    """Pass every dataloader the strategy prepares (samplers injected) through ``after``.

    ``FitLoop.setup_data()`` calls ``iter()`` on the train loader before it sets the sampler's
    epoch and with no callback hook in between; this is the last place to make it resumable.
    """
    strategy = trainer.strategy
    original = strategy.process_dataloader
    if getattr(original, "_ckpt_wrapped", False):
        return

    def process_dataloader(dataloader: Any) -> Any:
        return after(original(dataloader))

    process_dataloader._ckpt_wrapped = True  # type: ignore[attr-defined]
    strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]


def restores_loader_states(trainer: "pl.Trainer") -> bool:
    """Whether the fit loop is about to restore saved states of stateful train loaders.

    Lightning saves a ``StatefulDataLoader``'s ``state_dict()`` with its loops and loads it right
    after the loaders are processed (``FitLoop._load_combined_loader_states``).
    """
    return bool(getattr(trainer.fit_loop, "_combined_loader_states_to_load", None))


def unsupported_strategy(trainer: "pl.Trainer") -> str | None:
    """The name of a sharded strategy (whose state is not replicated), or ``None``."""
    from pytorch_lightning.strategies import DeepSpeedStrategy, FSDPStrategy

    strategy = trainer.strategy
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
        return type(strategy).__name__
    return None
