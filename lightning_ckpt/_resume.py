"""Between Lightning's checkpoint dictionary and ours (both ways), and ``ckpt_path`` support:
which checkpoint a resume restores (:func:`resume_start`)."""

from __future__ import annotations

import os
import posixpath
from typing import Any, Callable, Optional, Protocol

from ckpt_engine.agree import on_rank0
from ckpt_engine.config import CheckpointConfig
from ckpt_engine.errors import NoCheckpointError
from ckpt_engine.format.catalog import parse_dir
from ckpt_engine.interop.lightning import plain_misc
from ckpt_engine.training.parts import Parts, split_weights
from ckpt_engine.training.session import TrainingSession

from . import _dcp, _lightning, _trainer_api


class Resuming(Protocol):
    """What resuming asks of the callback (``AsyncShardedCheckpoint``, callback.py)."""

    config: CheckpointConfig
    session: TrainingSession
    resume: str
    _sharded: bool

    def lightning_checkpoint(self, step: int | None) -> dict[str, Any] | None:
        """Lightning's checkpoint dictionary of our newest checkpoint (or ``step``), restored on every
        rank; ``None`` when nothing is committed."""


def split(checkpoint: dict[str, Any], buffer_names: Any) -> Parts:
    """Lightning's checkpoint dictionary (consumed) as ours: the weights and optimizer states
    replicated; this rank's buffers (named in ``buffer_names``) and the rest (``misc``) per rank."""
    weights, buffers = split_weights(checkpoint.pop("state_dict"), buffer_names)
    return Parts({"state_dict": weights, "optimizer_states": checkpoint.pop("optimizer_states", [])},
                 {"misc": plain_misc(checkpoint), "buffers": buffers})


def resume_start(callback: Resuming, trainer: Any, path: Any, lightning: Callable[[Any], None]) -> None:
    """Restore exactly one checkpoint (README, "Which checkpoint a resume restores"), in place of
    the checkpoint connector's ``resume_start`` (``lightning(path)`` does what it would have done):

    * ``ckpt_path`` is one of ours: that one (read once, through :class:`CheckpointIOWrapper`; under a
      sharded strategy, whose ``load_checkpoint`` reads its own format, directly);
    * ``ckpt_path`` is Lightning's ``last`` checkpoint (``"last"``): the newer of it and our
      newest, ours on a tie (it also restores the data position and RNG exactly), and ours when
      Lightning's newer one cannot resume exactly (mid-epoch, its loader not resumable) and ours is
      at most one of our intervals older;
    * a DCP directory (``.metadata``: ``dcp.save``, torchtitan; Lightning's own sharded checkpoints
      only under DDP or one device, a sharded strategy loads those itself): its weights and optimizers,
      resharded into the live model (``lightning_ckpt._dcp``);
    * any other ``ckpt_path``: that one (an explicit choice wins);
    * none: our newest with ``resume="auto"``, else nothing.

    The candidate not used is named in a log line (a warning when it is the newer one). Ours are
    listed once, by the restore, except to compare them with another ``ckpt_path``. Every rank.
    """
    root = callback.config.location
    which = is_our_checkpoint(path, root) if path is not None else None
    if which is not None and callback._sharded:  # a sharded strategy loads its own files, not through CheckpointIO
        _trainer_api.inject_loaded_checkpoint(trainer, chosen(callback, which), path)
        return
    if which is not None:
        lightning(path)
        return
    if path is not None and _dcp.takes(trainer, path):  # a DCP directory: its weights and optimizers, resharded
        _trainer_api.inject_loaded_checkpoint(trainer, _dcp.restore(trainer, path), path)
        return
    ck = callback.session.ck
    steps = on_rank0(ck.comm, ck.steps) if path is not None else []  # a failure: raised on every rank
    lightning(path)
    if (path is None and callback.resume != "auto") or \
            (path is not None and not _ours_instead(trainer, path, steps, callback)):
        return
    checkpoint = callback.lightning_checkpoint(None)  # the newest that verifies everywhere (a damaged one is skipped)
    if checkpoint is not None:
        _trainer_api.inject_loaded_checkpoint(trainer, checkpoint, root)


def chosen(callback: Resuming, which: str) -> dict[str, Any]:
    """The checkpoint of ours that ``fit(ckpt_path=...)`` names (``which``: ``"newest"`` for the root,
    else a step), restored on every rank; :class:`NoCheckpointError` when it names nothing committed."""
    checkpoint = callback.lightning_checkpoint(None if which == "newest" else int(which))
    if checkpoint is None:
        raise NoCheckpointError(f"AsyncShardedCheckpoint: fit(ckpt_path=...) names {callback.config.location}, "
                                "which holds no committed checkpoint; remove ckpt_path to start fresh")
    return checkpoint


def _ours_instead(trainer: Any, path: Any, steps: list[int], callback: Resuming) -> bool:
    """Whether our newest (the last of ``steps``, committed) is restored instead of the explicit
    ``path`` that Lightning loaded; says which of the two is used and why.

    Ours replaces Lightning's ``last`` checkpoint (``ckpt_path="last"``, ``resume="auto"``) when it is
    as new, or when Lightning's newer one cannot resume exactly (:func:`inexact`) and ours is at most
    one of our intervals older (:func:`interval`): ours restores the data position and RNG too."""
    if not steps:
        return False
    ours, root = steps[-1], callback.config.location
    loaded = _trainer_api.loaded_checkpoint(trainer)
    theirs = int(loaded.get("global_step", -1))
    last = callback.resume == "auto" and os.path.abspath(str(path)) in _trainer_api.last_checkpoint_files(trainer)
    if last and ours >= theirs:
        _lightning.notice(trainer, f"AsyncShardedCheckpoint: ckpt_path={str(path)!r} is Lightning's last checkpoint "
                          f"(step {theirs}); this callback's checkpoint at step {ours} is as new or newer and "
                          f"is restored instead (it also restores the data position and RNG); {path} is not used.")
        return True
    why, every = inexact(loaded) if last else None, interval(callback.config.every_n_train_steps, steps)
    if why is not None and theirs - ours <= every:
        _lightning.notice(trainer, f"AsyncShardedCheckpoint: ckpt_path={str(path)!r} is Lightning's last checkpoint "
                          f"(step {theirs}), taken {why}: restored, the batches of that epoch before it would be "
                          f"trained again. This callback's checkpoint at step {ours}, {theirs - ours} step(s) older "
                          f"(at most one of its intervals, {every} steps), resumes exactly (data position and RNG "
                          f"too) and is restored instead; {path} is not used.")
        return True
    _lightning.notice(trainer, f"AsyncShardedCheckpoint: restoring ckpt_path={str(path)!r} (step {theirs}); not "
                      f"restoring this callback's newest checkpoint (step {ours} under {root}). To resume from it, "
                      f"call fit() without ckpt_path or with ckpt_path={root!r}.", warn=ours > theirs)
    return False


def inexact(checkpoint: dict[str, Any]) -> Optional[str]:
    """Why Lightning cannot resume ``checkpoint`` (its own dictionary) exactly, or ``None``: taken in
    the middle of an epoch (its loop had started batches and the last was not among them) without a
    stateful train loader's state (``StatefulDataLoader``: Lightning saves it with the loops). Lightning
    then restarts that epoch's data from its beginning (it warns that the loader is not resumable).
    A checkpoint without loops (weights only) says nothing either way: ``None``."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if not isinstance(fit, dict):
        return None
    batches = fit.get("epoch_loop.batch_progress") or {}
    started = int((batches.get("current") or {}).get("ready", 0))
    if started == 0 or batches.get("is_last_batch", False) or (fit.get("state_dict") or {}).get("combined_loader"):
        return None
    return (f"mid-epoch (epoch {checkpoint.get('epoch', '?')}, after its batch {started}) with a train loader that "
            "saves no position")


def interval(every_n_train_steps: Optional[int], steps: list[int]) -> int:
    """One of our intervals, in steps: ``every_n_train_steps`` when configured, else (a time or
    overhead policy) the gap between our two newest checkpoints ``steps`` (the first one's step alone)."""
    if every_n_train_steps:
        return every_n_train_steps
    return steps[-1] - steps[-2] if len(steps) > 1 else steps[-1]


def name_newer_files(trainer: Any, step: int, taken: float) -> None:
    """After a restore of ``step`` (its snapshot taken at Unix time ``taken``): name the Lightning
    checkpoint files the interrupted run wrote after it, which stay in place (rank 0 says it)."""
    newer = newer_files(_trainer_api.lightning_checkpoint_dirs(trainer), taken)
    if newer:
        _lightning.notice(trainer, f"AsyncShardedCheckpoint: resumed from step {step}; Lightning checkpoints "
                          f"written after it by the interrupted run stay in place: {', '.join(newer)}")


def newer_files(dirs: list[str], since: float) -> list[str]:
    """Lightning checkpoint files (``*.ckpt``) in ``dirs`` modified after ``since`` (a Unix time)."""
    found = []
    for d in dirs:
        if os.path.isdir(d):
            found += [os.path.join(d, f) for f in sorted(os.listdir(d))
                      if f.endswith(".ckpt") and os.path.getmtime(os.path.join(d, f)) > since]
    return found


def is_our_checkpoint(path: Any, root: str) -> Optional[int | str]:
    """``"newest"`` when ``path`` is the callback's root, the step when it is one of its
    checkpoint directories, ``None`` for anything else (another CheckpointIO's file)."""
    text = str(path)
    if _same_place(text, root):
        return "newest"
    parent, name = posixpath.split(text.rstrip("/"))
    parsed = parse_dir(name)
    if parsed is not None and _same_place(parent, root):
        return parsed[0]
    return None


def _same_place(a: str, b: str) -> bool:
    a, b = a.rstrip("/"), b.rstrip("/")
    if "://" in a or "://" in b:
        return a.removeprefix("file://") == b.removeprefix("file://")
    return os.path.abspath(a) == os.path.abspath(b)


class CheckpointIOWrapper(*_lightning.bases("plugins.io.CheckpointIO")):  # type: ignore[misc]
    """The strategy's CheckpointIO, except that ``load_checkpoint`` of one of our checkpoints
    (``trainer.fit(ckpt_path=<root or step directory>)``) assembles it from our files.
    ``trainer.save_checkpoint`` and everything else go to the wrapped IO unchanged."""

    def __init__(self, inner: Any, callback: Resuming) -> None:
        self.inner, self.callback = inner, callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        which = is_our_checkpoint(path, self.callback.config.location)
        if which is None:
            return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return chosen(self.callback, which)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()
