"""Flat key paths of a nested state, shared by ``ckpt inspect``, ``diff`` and ``export``.

One rule everywhere, so that a key printed by ``inspect`` is the key ``diff`` reports and the key
``export --flat`` / safetensors writes: dict keys and list/tuple positions joined by ``.`` down to
each tensor (``{"model": {"emb.weight": t}}`` → ``model.emb.weight``; ``{"state": {0: {"m": t}}}``
→ ``state.0.m``). A container that holds no tensor is one leaf (``param_groups`` stays one list of
dicts, ``betas`` one tuple), so plain values keep their shape; the top level is always split.
A state that is a single value has the one key ``state``.

Inspecting and diffing must not read the data files, so they flatten the manifest's typed-JSON
tree with :func:`refs_tree`, which stands a :class:`TensorRef` in for each tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import CheckpointError
from .decode import decode

ROOT_KEY = "state"


@dataclass(frozen=True)
class TensorRef:
    """Table entry ``index`` of a checkpoint, standing in for the tensor (nothing is read)."""

    index: int
    as_numpy: bool = False

    def numpy(self) -> "TensorRef":
        """What :func:`decode` calls for ``{"$tensor": i, "as": "numpy"}``."""
        return TensorRef(self.index, True)


def refs_tree(tree: Any) -> object:
    """Decode a typed-JSON value tree with a :class:`TensorRef` in place of every tensor."""
    return decode(tree, TensorRef)


def _is_container(value: object) -> bool:
    return isinstance(value, (dict, list)) or type(value) is tuple


def is_tensor(value: object) -> bool:
    """Whether a leaf is tensor data: a tensor, a NumPy array or a :class:`TensorRef`."""
    return isinstance(value, (TensorRef, torch.Tensor, np.ndarray))


def _holds_tensor(value: object) -> bool:
    if _is_container(value):
        items = value.values() if isinstance(value, dict) else value  # type: ignore[union-attr]
        return any(_holds_tensor(v) for v in items)  # type: ignore[union-attr]
    return is_tensor(value)


def iter_leaves(value: object, top: bool = True) -> Iterator[object]:
    """The leaves :func:`flatten` would key, without building keys (never raises)."""
    if _is_container(value) and (_holds_tensor(value) or (top and len(value) > 0)):  # type: ignore[arg-type]
        items = value.values() if isinstance(value, dict) else value  # type: ignore[union-attr]
        for v in items:  # type: ignore[union-attr]
            yield from iter_leaves(v, False)
    else:
        yield value


def flatten(value: object) -> dict[str, object]:
    """``{flat key: leaf}`` of a nested value, in its order.

    Raises :class:`CheckpointError` naming both paths when two leaves get the same flat key
    (``{"a.b": 1, "a": {"b": 2}}``), since a flat file could not hold both.
    """
    out: dict[str, object] = {}
    origin: dict[str, str] = {}

    def walk(v: object, parts: tuple[str, ...], path: str) -> None:
        if _is_container(v) and (_holds_tensor(v) or (not parts and len(v) > 0)):  # type: ignore[arg-type]
            items = v.items() if isinstance(v, dict) else enumerate(v)  # type: ignore[union-attr]
            for k, x in items:
                walk(x, parts + (str(k),), f"{path}[{k!r}]")
            return
        key = ".".join(parts) if parts else ROOT_KEY
        if key in out:
            raise CheckpointError(f"flat key {key!r} names two values, {origin[key]} and {path}; "
                                  "export with the nested torch format (no --flat) instead")
        out[key] = v
        origin[key] = path

    walk(value, (), "state")
    return out


def short_repr(value: object, width: int = 80) -> str:
    """``repr`` of a plain value cut to about ``width`` characters (order kept, long bytes cut first)."""
    if isinstance(value, (bytes, bytearray, str)) and len(value) > width:
        value = value[:width]
    text = repr(value)
    return text if len(text) <= width else text[:max(width - 3, 1)] + "..."


def type_name(value: object) -> str:
    """Short type name for tables (``int``, ``tuple``, ``numpy.ndarray``, ``torch.dtype``)."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__.split('.')[0]}.{t.__qualname__}"
