"""``load(into=state)``: fill an existing state in place, reading only what its tensors need.

``state`` is matched with the checkpoint's value tree key by key (dicts by key, lists and tuples
by position), the way ``torch.distributed.checkpoint.load`` matches a state dict:

* a ``DTensor`` (any mesh, any placements, any world size) receives the region of the global
  tensor its rank holds (sharding/dtensors.py), a plain tensor the whole tensor, each copied into
  its own memory (``copy_``: on its device, no new tensor); only the stored pieces that meet
  those regions are read, each verified whole (read.py), so no rank materialises a whole
  sharded tensor;
* any other value (a number, a string, ``None``) is replaced by the checkpoint's (in the
  containers of ``state``, which are updated in place), a tensor stored where ``state`` holds none
  is read whole;
* keys the checkpoint has and ``state`` lacks are left out (``state`` says what to load); a key
  ``state`` has and the checkpoint lacks, or a tensor of another shape or dtype, is a
  :class:`MismatchError` naming the key, raised before anything is read or changed.

The containers of ``state`` are changed only once every piece was read and verified; its tensors
are written as their pieces arrive, so after a failed read they may hold part of that checkpoint
(``restore()`` then fills them again from the one it falls back to).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..errors import MismatchError
from ..format.manifest import Manifest
from ..sharding.boxes import full_box, numel
from ..sharding.dtensors import chunk_box, is_dtensor
from ..state.decode import decode
from ..state.values import parse_dtype
from .places import Target, whole_targets

__all__ = ["fill"]


class _Ref:
    """Table tensor ``index`` in the decoded tree, before anything is read."""

    def __init__(self, index: int, numpy: bool = False) -> None:
        self.index, self.as_numpy = index, numpy

    def numpy(self) -> "_Ref":
        return _Ref(self.index, True)


def fill(into: Any, manifest: Manifest, where: str, read: Callable[[Sequence[Target]], None]) -> Any:
    """``into`` with every tensor filled from the checkpoint of ``manifest`` and every other value
    replaced (see the module docstring); ``read(targets)`` reads the regions (restore.read_targets)."""
    stored = decode(manifest.state, _Ref, count=len(manifest.tensors), where=where)
    targets: list[Target] = []
    wanted: set[int] = set()
    changes: list[tuple[Any, Any, Any]] = []
    merged = _merge(into, stored, "state", manifest, targets, wanted, changes)
    whole = {t.tensor: t for t in whole_targets(manifest.tensors, sorted(wanted), where=where,
                                                what=f"reading step {manifest.step}")}
    read(targets + list(whole.values()))
    for container, key, value in changes:
        container[key] = _resolve(value, whole)
    return merged if merged is into else _resolve(merged, whole)


def _merge(into: Any, stored: Any, path: str, manifest: Manifest, targets: list[Target], wanted: set[int],
           changes: list[tuple[Any, Any, Any]]) -> Any:
    """The value ``into`` becomes (``into`` itself for tensors, dicts and lists, whose changed
    items are appended to ``changes``, applied after the read); collects the targets to read."""
    if isinstance(into, torch.Tensor):
        if not isinstance(stored, _Ref) or stored.as_numpy:
            raise MismatchError(f"{path}: the state to load into holds a tensor, the checkpoint "
                              f"{'a NumPy array' if isinstance(stored, _Ref) else f'a {type(stored).__name__}'}")
        targets.extend(_targets(into, stored.index, path, manifest))
        return into
    if isinstance(into, dict):
        if not isinstance(stored, dict):
            raise MismatchError(f"{path}: the state to load into holds a dict, the checkpoint a {_kind(stored)}")
        missing = [k for k in into if k not in stored]
        if missing:
            raise MismatchError(f"{path}: keys {missing[:8]} are not in the checkpoint (it has {list(stored)[:8]}"
                              f"{'...' if len(stored) > 8 else ''}); load without into= to see what it holds")
        for k in into:
            new = _merge(into[k], stored[k], f"{path}[{k!r}]", manifest, targets, wanted, changes)
            if new is not into[k]:
                changes.append((into, k, new))
        return into
    if isinstance(into, (list, tuple)):
        if not isinstance(stored, (list, tuple)) or len(stored) != len(into):
            raise MismatchError(f"{path}: the state to load into holds a {type(into).__name__} of {len(into)}, the "
                              f"checkpoint a {_kind(stored)}")
        items = [_merge(x, y, f"{path}[{i}]", manifest, targets, wanted, changes)
                 for i, (x, y) in enumerate(zip(into, stored))]
        if isinstance(into, list):
            changes.extend((into, i, new) for i, (old, new) in enumerate(zip(into, items)) if new is not old)
            return into
        return type(into)(items) if type(into) is tuple else type(into)(*items)
    _want(stored, wanted)
    return stored


def _targets(t: torch.Tensor, i: int, path: str, manifest: Manifest) -> list[Target]:
    """The region of table tensor ``i`` that ``t`` (a ``DTensor`` or a plain tensor) receives."""
    entry = manifest.tensors[i]
    if tuple(t.shape) != entry.shape or t.dtype != parse_dtype(entry.dtype):
        raise MismatchError(f"{path}: the checkpoint holds {entry.dtype}{list(entry.shape)}, the state to load into "
                          f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}; convert one to the other")
    if is_dtensor(t):
        box = chunk_box(t, path)
        return [Target(i, box, t.to_local().detach())] if numel(box) > 0 else []
    return [Target(i, full_box(entry.shape), t.detach())]


def _want(stored: Any, wanted: set[int]) -> None:
    """Table tensors anywhere in ``stored`` (a value the state to load into did not hold): read whole."""
    if isinstance(stored, _Ref):
        wanted.add(stored.index)
    elif isinstance(stored, dict):
        for v in stored.values():
            _want(v, wanted)
    elif isinstance(stored, (list, tuple)):
        for v in stored:
            _want(v, wanted)


def _resolve(value: Any, whole: dict[int, Target]) -> Any:
    """Replace the placeholders left by :func:`_merge` with the tensors read (in the checkpoint's
    own containers, or in new tuples; the containers of ``into`` are never entered here)."""
    if isinstance(value, _Ref):
        out = whole[value.index].out
        return out.numpy() if value.as_numpy else out
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            value[k] = _resolve(v, whole)
        return value
    if isinstance(value, list):
        value[:] = [_resolve(v, whole) for v in value]
        return value
    if isinstance(value, tuple):
        items = [_resolve(v, whole) for v in value]
        return type(value)(items) if type(value) is tuple else type(value)(*items)
    return value


def _kind(v: Any) -> str:
    return "tensor" if isinstance(v, _Ref) else type(v).__name__
