"""What a ``DTensor`` is on this rank: the chunk of the global tensor it holds, and its replicas.

A ``DTensor`` (FSDP2's parameters and optimizer state, HSDP's, tensor parallel's) is a global
tensor laid out on a ``DeviceMesh`` by one placement per mesh dimension: ``Shard(d)`` cuts
dimension ``d`` among the ranks along that mesh dimension (FSDP2's ``_StridedShard`` too),
``Replicate()`` gives every rank along it the same chunk. This rank holds one chunk, a box of the
global tensor (``to_local()``); the ranks that differ only along replicated mesh dimensions hold
the same chunk, and split writing it between them (:func:`~ckpt_engine.state.plan.chunk_slice`).

A ``DTensor`` on a sub-mesh of a larger mesh (FSDP2 on the ``dp`` dimension of a ``dp x tp`` mesh:
a LayerNorm weight tensor parallel leaves whole) is replicated along the dimensions of the larger
(root) mesh its own mesh leaves out, without saying so in its placements: the ranks at the same
position of the other sub-meshes hold the same chunk. Those dimensions are found from the ranks
of the two meshes (the ones along which the sub-mesh does not vary) and count as replicas too.

``Partial()`` (values still to be reduced) cannot be stored: the chunk is not the tensor's value.
The box comes from torch's own ``compute_local_shape_and_global_offset``, what
``torch.distributed.checkpoint`` records for the same tensor. Nothing here communicates.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from math import prod
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import UnsupportedValueError
from .boxes import Box, box_of, numel, sizes


@dataclass(frozen=True)
class Sharding:
    """How a sharded tensor was laid out when saved (recorded in the manifest, shown by ``ckpt inspect``)."""

    mesh: tuple[int, ...]
    """The mesh's size in each dimension."""
    placements: tuple[str, ...]
    """One placement per mesh dimension, as torch prints it (``Shard(dim=0)``, ``Replicate()``)."""
    mesh_dims: tuple[str, ...] = ()
    """The mesh dimensions' names, when it has them (``("replicate", "shard")``)."""


class LocalChunk(NamedTuple):
    """This rank's part of one ``DTensor`` (a named tuple: one is made per ``DTensor`` per save)."""

    local: torch.Tensor
    """The chunk's values (``to_local()``, detached): a plain tensor of the box's sizes."""
    shape: tuple[int, ...]
    """The global tensor's shape."""
    box: Box
    """Where the chunk lies in the global tensor (empty when this rank holds none of it)."""
    replica: int
    replicas: int
    """This rank is the ``replica``-th of ``replicas`` ranks holding the same chunk."""
    sharding: Sharding


_DTENSOR: list[type] = []
"""The ``DTensor`` class once it was seen imported (asked for every tensor of every save)."""


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` when it is imported (no instance exists otherwise)."""
    if _DTENSOR:
        return _DTENSOR[0]
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        cls = getattr(sys.modules.get(module), "DTensor", None)
        if isinstance(cls, type):
            _DTENSOR.append(cls)
            return cls
    return None


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (without importing torch.distributed)."""
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_chunk(t: Any, path: str) -> LocalChunk:
    """This rank's chunk of the ``DTensor`` ``t`` at key ``path``.

    Raises :class:`UnsupportedValueError` naming ``path`` for a ``Partial`` placement, or when the
    local tensor is not the chunk torch's layout rule gives (a padded local shard).
    """
    shape = tuple(t.shape)
    placements = t.placements
    box, replica, replicas, sharding = _layout(t.device_mesh, placements if type(placements) is tuple
                                               else tuple(placements), shape, path)
    inner = getattr(t, "_local_tensor", None)  # what to_local() returns, without its autograd call
    local = (inner if isinstance(inner, torch.Tensor) else t.to_local()).detach()
    if local.shape != sizes(box) and numel(box):
        raise UnsupportedValueError(
            f"{path}: the DTensor's local tensor has shape {tuple(local.shape)}, its chunk of the global "
            f"{list(shape)} is {list(sizes(box))} ({_facts(t, sharding)}): a padded or uneven local shard this "
            "layout rule does not describe; store t.full_tensor() instead")
    return LocalChunk(local, shape, box, replica, replicas, sharding)


def chunk_box(t: Any, path: str = "") -> Box:
    """The box of the global tensor this rank's ``to_local()`` of ``t`` holds (torch's rule;
    empty when this rank is not in the tensor's mesh)."""
    return _layout(t.device_mesh, tuple(t.placements), tuple(t.shape), path)[0]


_Layout = tuple[Box, int, int, Sharding]
_LAYOUTS: dict[tuple, tuple[Any, _Layout]] = {}
""":func:`_layout` by (mesh id, placements, shape), with the mesh kept so its id is not reused:
asked for every ``DTensor`` at every save (in the stall), it is worked out once."""


def _layout(mesh: Any, placements: tuple, shape: tuple[int, ...], path: str) -> _Layout:
    """(chunk box, replica, replicas, sharding) of this rank for a tensor of ``shape`` laid out by
    ``placements`` on ``mesh``; pure in its arguments (and this rank), cached. Raises
    :class:`UnsupportedValueError` naming ``path`` for a ``Partial`` placement."""
    key = (id(mesh), placements, shape)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    sharding = Sharding(tuple(mesh.shape), tuple(str(p) for p in placements), tuple(mesh.mesh_dim_names or ()))
    for p in placements:
        if p.is_partial():
            raise UnsupportedValueError(
                f"{path}: cannot store a DTensor with a Partial placement (shape {list(shape)}, mesh "
                f"{list(sharding.mesh)}, placements {', '.join(sharding.placements)}): its chunks are not yet "
                "reduced to the tensor's value; redistribute it first, e.g. "
                "t.redistribute(placements=[Replicate()] * mesh.ndim)")
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh: it holds none of it
        out: _Layout = (tuple((0, 0) for _ in shape), 0, 1, sharding)
    else:
        try:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        except ImportError as e:  # pragma: no cover - every torch with DTensor has it
            raise UnsupportedValueError(f"{path}: this torch ({torch.__version__}) does not say where a DTensor's "
                                        "chunk lies; store t.full_tensor() instead") from e
        lengths, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        replica, replicas = 0, 1
        for d, p in enumerate(placements):
            if p.is_replicate():
                replica, replicas = replica * mesh.size(d) + coord[d], replicas * mesh.size(d)
        extra, extras = _implicit_replica(mesh, path)
        out = (box_of(offsets, lengths), replica * extras + extra, replicas * extras, sharding)
    if len(_LAYOUTS) > 65536:
        _LAYOUTS.clear()
    _LAYOUTS[key] = (mesh, out)
    return out


def _implicit_replica(mesh: Any, path: str) -> tuple[int, int]:
    """(index, count) of this rank among the ranks holding what it holds on ``mesh`` because ``mesh``
    is a sub-mesh of a larger one (the root mesh's dimensions along which ``mesh`` does not vary)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root is mesh or root.size() == mesh.size():
        return 0, 1
    grid = root.mesh.cpu().numpy()
    where = {int(r): idx for idx, r in np.ndenumerate(grid)}
    members = [where[int(r)] for r in mesh.mesh.cpu().reshape(-1).tolist()]
    fixed = [d for d in range(grid.ndim) if len({c[d] for c in members}) == 1]
    mine = root.get_coordinate()
    count = prod(grid.shape[d] for d in fixed)
    if mine is None or count * mesh.size() != root.size():
        raise UnsupportedValueError(
            f"{path}: the DTensor's mesh {list(mesh.shape)} is not a slice of its root mesh {list(root.shape)} along "
            "whole dimensions, so the ranks holding the same chunk cannot be told; save it on a mesh sliced by "
            "dimension names (mesh['dp']), or store t.full_tensor()")
    index = 0
    for d in fixed:
        index = index * grid.shape[d] + mine[d]
    return index, count


def _facts(t: Any, sharding: Sharding) -> str:
    return (f"shape {list(t.shape)}, dtype {t.dtype}, mesh {list(sharding.mesh)}, "
            f"placements {', '.join(sharding.placements)}")
