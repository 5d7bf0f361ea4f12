"""Every use of Lightning's private API, in one place (each is covered by the tests).

Lightning has no public way to (a) get the checkpoint dictionary it would save, without writing
it, or (b) restore from a dictionary it did not load itself, or (c) see which checkpoint
``fit(ckpt_path=...)`` is about to restore. All three exist on the trainer's checkpoint connector;
``Trainer._select_ckpt_path`` runs before any callback hook, so the callback cannot change
``ckpt_path``: it intercepts the connector's ``resume_start`` (which sees the resolved path) and
hands the connector the dictionary to restore from.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from . import _lightning

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


def dump_checkpoint(trainer: "Trainer", weights: bool = True) -> dict[str, Any]:
    """The full checkpoint dictionary Lightning would save now (weights, optimizers, loops...).

    ``weights=False``: without ``state_dict`` and ``optimizer_states``, which the strategy is then
    not asked for at all (a sharded strategy copies every chunk to CPU for them, or gathers them:
    see ``lightning_ckpt._sharded``, which takes them itself).
    """
    if weights:
        return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    strategy = trainer.strategy
    strategy.lightning_module_state_dict = lambda: {}  # instance attributes over the methods, for this call
    strategy.optimizer_state = lambda optimizer: {}
    try:
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    finally:
        del strategy.lightning_module_state_dict, strategy.optimizer_state
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def inject_loaded_checkpoint(trainer: "Trainer", checkpoint: dict[str, Any], path: str) -> None:
    """Make the coming restore steps of ``fit()`` use ``checkpoint``, read from ``path`` (which
    ``trainer.ckpt_path`` then reports)."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint
    trainer._checkpoint_connector._ckpt_path = path


def wrap_resume_start(trainer: "Trainer", around: Callable[[Any, Callable[[Any], None]], None]) -> None:
    """Route ``fit()``'s restore through ``around(ckpt_path, lightning)`` (call from ``setup``).

    The checkpoint connector's ``resume_start(ckpt_path)`` runs after every ``setup`` hook and
    before anything is restored, with ``ckpt_path`` already resolved (``"last"`` is a file by
    then); it is the one place that sees both candidates. ``lightning(path)`` does what Lightning
    would have done (load ``path`` into the connector; ``None`` loads nothing).
    """
    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
            around(checkpoint_path, lambda path: original(path, weights_only=weights_only))
        return resume_start

    _wrap_once(trainer._checkpoint_connector, "resume_start", wrap)


def loaded_checkpoint(trainer: "Trainer") -> dict[str, Any]:
    """The dictionary the coming restore steps of ``fit()`` will use."""
    return trainer._checkpoint_connector._loaded_checkpoint


def last_checkpoint_files(trainer: "Trainer") -> set[str]:
    """What ``ckpt_path="last"`` resolves among: every ``ModelCheckpoint``'s ``last*.ckpt`` files."""
    found: set[str] = set()
    for cb in trainer.checkpoint_callbacks:
        find = getattr(cb, "_find_last_checkpoints", None)
        if find is not None:
            found |= {os.path.abspath(p) for p in find(trainer)}
    return found


def lightning_checkpoint_dirs(trainer: "Trainer") -> list[str]:
    """The local folders Lightning's own checkpoint callbacks write to."""
    dirs = [getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks]
    return [str(d) for d in dirs if d and "://" not in str(d)]


def guard_fit_loop(trainer: "Trainer", on_failure: Callable[[BaseException], None]) -> None:
    """Call ``on_failure(exception)`` when training ends by an exception, in the process that trains.

    Lightning calls ``on_exception`` only where ``fit()`` was called: under ``ddp_spawn`` that is
    the launcher, not the ranks that hold the checkpoints in flight, so the ranks' exits are
    caught here, around the fit loop they run.
    """
    def wrap(original: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                original()
            except BaseException as exception:
                on_failure(exception)
                raise
        return run

    _wrap_once(trainer.fit_loop, "run", wrap)


def as_between_epochs(checkpoint: dict[str, Any]) -> None:
    """Rewrite Lightning's loop state in ``checkpoint`` (dumped after an epoch's end has run: at the
    next epoch's start or at the end of training) as it stands between two epochs.

    At those moments the training-epoch loop still holds the finished epoch's *current* counters
    (it resets them when the next epoch's loop starts); restored as they are, the next epoch would
    look finished at once, or a further epoch would be counted. Totals stay as they are.
    """
    fit = checkpoint["loops"]["fit_loop"]
    for key in ("epoch_loop.batch_progress", "epoch_loop.scheduler_progress"):
        fit[key]["current"] = {k: 0 for k in fit[key]["current"]}
    fit["epoch_loop.batch_progress"]["is_last_batch"] = False
    for progress in fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"].values():
        progress["current"] = {k: 0 for k in progress["current"]}


def end_restarted_epoch_normally(trainer: "Trainer") -> None:
    """Let the end of the first epoch after a restore from one of our checkpoints step the
    epoch-interval LR schedulers (``ReduceLROnPlateau`` included), as the uninterrupted run did
    (call from ``on_train_epoch_end``).

    ``FitLoop.on_advance_end`` skips them while the loop is "restarting", which stays true for the
    whole first epoch after any restore under ``max_steps`` and after a mid-epoch one (Lightning's
    guard for its own end-of-epoch checkpoints, whose metrics it does not save). Ours are taken
    mid-epoch or between epochs, so that epoch's metrics are complete when it ends; the flag is
    cleared for the rest of the epoch, as the loop clears it right after (``on_iteration_done``).
    """
    trainer.fit_loop._restarting = False


def wrap_process_dataloader(trainer: "Trainer", after: Callable[[Any], Any]) -> None:
    """Pass every train dataloader the strategy prepares (samplers injected) through ``after``;
    validation, test and sanity-check loaders go through the strategy alone.

    ``FitLoop.setup_data()`` calls ``iter()`` on the train loader before it sets the sampler's
    epoch and with no callback hook in between; this is the last place to make it resumable.
    """
    def wrap(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def process_dataloader(loader: Any) -> Any:
            loader = original(loader)
            return after(loader) if trainer.training else loader
        return process_dataloader

    _wrap_once(trainer.strategy, "process_dataloader", wrap)


def _wrap_once(owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace the method ``owner.<name>`` by ``wrap(original)``, once: a second ``setup`` (another
    ``fit()`` on the same trainer) finds it wrapped already."""
    original = getattr(owner, name)
    if getattr(original, "_ckpt_wrapped", False):
        return
    wrapper = wrap(original)
    wrapper._ckpt_wrapped = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def set_batches_done(trainer: "Trainer", batches: int) -> None:
    """Make the restored training-epoch loop count ``batches`` of the running epoch as done (call
    after Lightning loaded its loops: from ``process_dataloader``).

    After a resume on another number of devices the rest of the epoch is re-split and takes
    another number of batches per device than the writer's loop counted; the epoch loop ends an
    epoch by its count (``is_last_batch``, validation, epoch-interval schedulers), so its current
    counters are shifted to the new split's. Totals stay as they are.
    """
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = batches - current.ready
    for name in ("ready", "started", "processed", "completed"):
        setattr(current, name, getattr(current, name) + shift)


def restores_loader_states(trainer: "Trainer") -> bool:
    """Whether the fit loop is about to restore saved states of stateful train loaders.

    Lightning saves a ``StatefulDataLoader``'s ``state_dict()`` with its loops and loads it right
    after the loaders are processed (``FitLoop._load_combined_loader_states``).
    """
    return bool(getattr(trainer.fit_loop, "_combined_loader_states_to_load", None))


def planned_optimizers(trainer: "Trainer") -> list[Any]:
    """The optimizers, or before the strategy set them up (DDP, one device: ``fit(ckpt_path=...)``
    restores first) those ``configure_optimizers`` gives (called once more; only their number is used)."""
    optimizers = list(trainer.optimizers)
    if optimizers:
        return optimizers
    found, _ = _lightning.resolve(_lightning.of(trainer), "core.optimizer")._init_optimizers_and_lr_schedulers(
        trainer.lightning_module)
    return list(found)


def unsupported_strategy(trainer: "Trainer") -> str | None:
    """Why this callback cannot take the state of ``trainer``'s strategy (``DeepSpeedStrategy``: ZeRO
    partitions it in its own layout, with no ``DTensor`` form), or ``None``. The other sharded
    strategies go through ``lightning_ckpt._sharded``."""
    strategy = trainer.strategy
    if isinstance(strategy, _lightning.of(trainer).strategies.DeepSpeedStrategy):
        return (f"{type(strategy).__name__}: its ZeRO-partitioned state has no DTensor form to take; use "
                "ModelParallelStrategy (FSDP2, tensor parallel), FSDPStrategy, DDP, ddp_spawn or a single device")
    return None
