"""Between Lightning's checkpoint dictionary and ours (both ways), and ``ckpt_path`` support."""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING, Any, Optional

import warnings

from ckpt_engine.format.catalog import parse_dir
from ckpt_engine.errors import UnsupportedValueError
from ckpt_engine.values import encode

from . import _lightning

if TYPE_CHECKING:
    from .callback import AsyncShardedCheckpoint


def assemble(state: dict[str, Any], misc: dict[str, Any], buffers: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dictionary: the replicated weights and optimizer states, this
    rank's buffers, and the rest (loops, schedulers, callbacks, ...) from writer rank 0."""
    checkpoint = dict(misc)
    checkpoint["state_dict"] = {**state["state_dict"], **buffers}
    checkpoint["optimizer_states"] = state["optimizer_states"]
    return checkpoint


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

    def __init__(self, inner: Any, callback: "AsyncShardedCheckpoint") -> None:
        self.inner, self.callback = inner, callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        which = is_our_checkpoint(path, self.callback.config.location)
        if which is None:
            return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return self.callback.restore(None if which == "newest" else int(which))

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def plain_misc(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint minus weights, with the hyper-parameters that are not plain values
    dropped with a warning (resume does not need them). Anything else unstorable fails in
    ``Checkpointer.save`` naming its key, so only the hyper-parameters are checked here."""
    out = {}
    for key, value in checkpoint.items():
        if "hyper_parameters" in key or "hparams" in key:
            try:
                encode(value, key)
            except UnsupportedValueError as e:
                if not isinstance(value, dict):
                    warnings.warn(f"AsyncShardedCheckpoint: {key} not stored: {e}", stacklevel=3)
                    continue
                value = {k: v for k, v in value.items() if _plain(k, v)}
        out[key] = value
    return out


def _plain(key: str, value: Any) -> bool:
    try:
        encode(value, key)
        return True
    except UnsupportedValueError:
        warnings.warn(f"AsyncShardedCheckpoint: hyper-parameter {key!r} is not a plain value and is not stored "
                      "(resume does not need it)", stacklevel=4)
        return False
