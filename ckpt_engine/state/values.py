"""Encode a nested training state as typed JSON plus a list of tensors, and back.

Why typed JSON and not pickle: loading must never run code from a checkpoint, and a reader in
another language must be able to parse the non-tensor values. Every node is plain JSON or a
one-key object whose key starts with ``$`` (see ``docs/FORMAT.md``):

=====================  ==============================================
Python value           JSON
=====================  ==============================================
``None``/bool/int/str  itself
float                  ``{"$f": 1.5}`` (``"nan"``, ``"inf"``, ``"-inf"`` as strings)
list                   array
tuple                  ``{"$tuple": [...]}``
dict                   ``{"$dict": [[key, value], ...]}`` (keys typed, order kept)
bytes                  ``{"$bytes": base64}``
torch.Tensor           ``{"$tensor": index}`` into the tensor table
numpy array            ``{"$tensor": index, "as": "numpy"}`` or ``{"$ndarray": {...}}`` inline
numpy scalar           ``{"$np": [dtype, value]}``
torch.dtype/Size/device ``{"$dtype": "float32"}`` / ``{"$size": [...]}`` / ``{"$device": "cpu"}``
=====================  ==============================================

Tensors that are the same view of the same memory (tied weights) get one table entry, so they
are stored once and come back as one tensor object. A ``DTensor`` (sharded state) is a table entry
like any tensor, of its global shape; this rank's chunk of it goes in the table, and
:attr:`Encoded.shards` says where that chunk lies (sharding/dtensors.py).
"""

from __future__ import annotations

import base64
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import FormatError, UnsupportedValueError
from ..sharding.dtensors import LocalChunk, is_dtensor, local_chunk

__all__ = ["JSON", "TORCH_DTYPES", "MAX_DEPTH", "MAX_NDIM", "Encoded", "encode", "dtype_name", "parse_dtype",
           "tensor_refusal"]
"""The writing side; the reading side (typed JSON back to values, safe on hostile input) is decode.py."""

JSON = Any

#: dtypes a checkpoint may name; a manifest naming anything else is rejected (no getattr on torch).
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "bool",
        "float8_e4m3fn", "float8_e5m2",
    )
    if hasattr(torch, name)
}
#: numpy dtypes that travel as tensors (torch shares their memory layout).
_NUMPY_AS_TENSOR = {"bool", "uint8", "int8", "int16", "int32", "int64",
                    "float16", "float32", "float64", "complex64", "complex128"}
_NUMPY_INLINE = _NUMPY_AS_TENSOR | {"uint16", "uint32", "uint64"}

MAX_DEPTH = 64
"""Containers (lists, tuples, dicts, NumPy scalars) nest at most this deep in a value tree.

Real training states nest under 15 levels. Every reader walks a tree recursively (decode,
``ckpt inspect``, ``export``, ``torch.save``), a few Python frames per level, and Python stops at
1000 frames: a deeper tree is refused when saved (:class:`UnsupportedValueError`) and when read
(:class:`FormatError`), never a ``RecursionError`` half-way through a restore."""
MAX_NDIM = 64
"""Most dimensions a tensor or inline array may have (NumPy's own limit: a tensor beyond it could
not be returned as an array)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"``; raises for dtypes a checkpoint cannot name."""
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise UnsupportedValueError(f"tensor dtype {dtype} is not supported by ckpt_engine")
    return name


def parse_dtype(name: object, where: str = "") -> torch.dtype:
    """The torch dtype a checkpoint names, from an allow-list (hostile names are rejected);
    ``where`` (the file) prefixes the error."""
    if not isinstance(name, str) or name not in TORCH_DTYPES:
        raise FormatError(f"{where + ': ' if where else ''}unknown tensor dtype {str(name)[:40]!r} (known: "
                          f"{', '.join(TORCH_DTYPES)}); the checkpoint is damaged or was not written by ckpt-suite")
    return TORCH_DTYPES[name]


@dataclass
class Encoded:
    """A state split into a JSON tree and the tensors it references by index."""

    tree: JSON
    tensors: list[torch.Tensor]
    """Plain tensors; for a ``DTensor``, this rank's chunk of it."""
    names: list[str]
    shards: list[LocalChunk | None]
    """For each tensor, where its chunk lies when it is a ``DTensor`` (``None``: a plain tensor)."""

    @property
    def sharded(self) -> bool:
        return any(c is not None for c in self.shards)


def encode(state: object, root: str = "state", *, sharded: bool = True) -> Encoded:
    """Split ``state`` into typed JSON and a tensor table.

    Raises :class:`UnsupportedValueError` naming the key path of the first value that cannot be
    stored without pickle (a lambda, a custom class, ...) or a tensor :func:`tensor_refusal`
    refuses (meta, sparse, a ``DTensor`` with a ``Partial`` placement, ...), before any tensor's
    memory is touched. ``sharded=False`` refuses ``DTensor`` values too (per-rank state, whole).
    """
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    shards: list[LocalChunk | None] = []
    seen: dict[tuple, int] = {}

    def add_tensor(t: torch.Tensor, path: str) -> int:
        chunk = None
        if type(t) not in _PLAIN_TYPES and is_dtensor(t):  # a plain type is never a DTensor
            if not sharded:
                raise UnsupportedValueError(
                    f"{path}: cannot store a DTensor in the per-rank `{root}` state (shape {list(t.shape)}, "
                    f"placements {tuple(t.placements)}); put sharded values in the replicated `state`, where "
                    "each rank stores its chunk, or store t.to_local() here")
            chunk = local_chunk(t, path)
            t = chunk.local
        refusal = tensor_refusal(t)
        if refusal is not None:
            raise UnsupportedValueError(f"{path}: cannot store {refusal}")
        if chunk is None and t.requires_grad:
            t = t.detach()  # a chunk is detached already; the copy must not be recorded by autograd
        if t.numel() > 0:
            alias = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), chunk and (chunk.shape, chunk.box))
            if alias in seen:
                return seen[alias]
            seen[alias] = len(tensors)
        tensors.append(t)
        names.append(path)
        shards.append(chunk)
        return len(tensors) - 1

    def enc(v: object, path: str, depth: int = 0) -> JSON:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int) and type(v) is int:
            return v
        if isinstance(v, float) and type(v) is float:
            return {"$f": v if math.isfinite(v) else repr(v)}
        if isinstance(v, torch.Tensor):
            return {"$tensor": add_tensor(v, path)}
        if isinstance(v, (list, tuple, dict, np.generic)) and depth >= MAX_DEPTH:
            raise UnsupportedValueError(f"{path}: nested deeper than {MAX_DEPTH} levels of lists, tuples and dicts, "
                                        "which readers refuse; flatten that part of the state")
        if isinstance(v, list):
            return [enc(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
        if isinstance(v, tuple) and type(v) is tuple:
            return {"$tuple": [enc(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, dict):
            return {"$dict": [[enc_key(k, path, depth + 1), enc(x, f"{path}[{k!r}]", depth + 1)]
                              for k, x in v.items()]}
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, np.ndarray):
            return enc_ndarray(v, path)
        if isinstance(v, np.generic) and v.dtype.name in _NUMPY_INLINE:
            return {"$np": [v.dtype.name, enc(v.item(), path, depth + 1)]}
        if isinstance(v, torch.dtype):
            return {"$dtype": dtype_name(v)}
        if isinstance(v, torch.Size):
            return {"$size": list(v)}
        if isinstance(v, torch.device):
            return {"$device": str(v)}
        raise UnsupportedValueError(
            f"{path}: cannot store a value of type {type(v).__module__}.{type(v).__qualname__} "
            "without pickle; convert it to tensors, numbers, strings, lists or dicts first"
        )

    def enc_key(k: object, path: str, depth: int) -> JSON:
        if type(k) is str:  # the common case, without building a path
            return k
        if isinstance(k, (torch.Tensor, np.ndarray, list, dict)):
            raise UnsupportedValueError(f"{path}: dict key {k!r} is not a plain hashable value")
        return enc(k, f"{path}.<key>", depth)

    def enc_ndarray(a: np.ndarray, path: str) -> JSON:
        if a.dtype.name in _NUMPY_AS_TENSOR:
            return {"$tensor": add_tensor(torch.from_numpy(np.ascontiguousarray(a)), path), "as": "numpy"}
        if a.dtype.name in _NUMPY_INLINE and a.ndim <= MAX_NDIM:
            data = base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")
            return {"$ndarray": {"dtype": a.dtype.name, "shape": list(a.shape), "data": data}}
        raise UnsupportedValueError(f"{path}: numpy dtype {a.dtype} cannot be stored without pickle")

    return Encoded(enc(state, root), tensors, names, shards)


_SPARSE = {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
_NO_DISPATCH = torch.Tensor.__torch_dispatch__
_PLAIN_TYPES = frozenset(k for k in (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", None))
                         if isinstance(k, type))
_DTYPES = frozenset(TORCH_DTYPES.values())
_is_functional = getattr(torch, "_is_functional_tensor", lambda _: False)


def _plainly_storable(t: torch.Tensor) -> bool:
    """The common case, decided in a few attribute reads (asked for every tensor of every save):
    a plain-typed, dense, strided tensor of a named dtype on CPU or CUDA with real storage."""
    return (type(t) in _PLAIN_TYPES and t.layout is torch.strided and t.dtype in _DTYPES and not t.is_meta
            and (t.is_cpu or t.is_cuda) and not t.is_quantized and not t.is_nested and t.dim() <= MAX_NDIM
            and not _is_functional(t) and (t.numel() == 0 or _has_storage(t)))


def tensor_refusal(t: torch.Tensor) -> str | None:
    """What ``t`` is and what to do instead, when a checkpoint cannot hold it; ``None`` when it can.

    The snapshot copies a tensor's bytes straight from ``data_ptr()`` (``memmove`` on CPU, an
    asynchronous copy on CUDA), so only a tensor whose own storage holds its values is accepted:
    dense and strided, on CPU or CUDA, with real (not meta, fake or functional) storage, of a
    dtype the format names, and of type ``torch.Tensor``, ``Parameter``, ``Buffer`` or a subclass
    that does not override ``__torch_dispatch__``. Anything else would copy from a null or foreign
    pointer (a SIGSEGV) or store bytes that are not its values, so it must be refused before the
    copy. Pure: reads metadata only, never the data.
    """
    if _plainly_storable(t):
        return None
    if is_dtensor(t):
        return (f"a DTensor ({_facts(t)}, placements {tuple(t.placements)}) given as a plain tensor: store it in "
                "a state passed to encode(), which stores this rank's chunk (its to_local())")
    sharded = _loaded_class("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")
    if sharded is not None and isinstance(t, sharded):
        meta = t.metadata()
        return (f"a ShardedTensor (dtype {meta.tensor_properties.dtype}, global shape {tuple(meta.size)}), the "
                "deprecated kind FSDP1's sharded state dict holds when the model was wrapped without a device "
                "mesh: wrap it with FullyShardedDataParallel(..., device_mesh=init_device_mesh(...)) so that "
                "get_state_dict() gives DTensors, which each rank stores as its chunk (or use FSDP2, fully_shard)")
    fake = _loaded_class("torch._subclasses.fake_tensor", "FakeTensor")
    if fake is not None and isinstance(t, fake):
        return (f"a FakeTensor ({_facts(t)}): it has no data (it comes from FakeTensorMode, e.g. torch.compile "
                "tracing); save real tensors, outside the fake mode")
    if t.is_nested:
        return (f"a nested tensor (layout {t.layout}, dtype {t.dtype}, device {t.device}): store its components "
                "instead, list(t.unbind()), or t.to_padded_tensor(0.0)")
    if _is_functional(t):
        return (f"a functional tensor ({_facts(t)}): a functionalization wrapper (torch.func, torch.compile) "
                "without storage of its own; save the real tensors, outside the transform")
    kind = type(t)
    if getattr(kind, "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH:
        return (f"a tensor subclass {kind.__module__}.{kind.__qualname__} that overrides __torch_dispatch__ "
                f"({_facts(t)}): its values are not in its own storage; convert it to a plain dense tensor first")
    if t.layout in _SPARSE:
        return (f"a sparse tensor (layout {t.layout}, {_facts(t)}): store t.to_dense(), or its index and value "
                "tensors")
    if t.layout != torch.strided:
        return f"a tensor of layout {t.layout} ({_facts(t)}): store t.to_dense()"
    if t.is_quantized:
        return (f"a quantized tensor ({_facts(t)}): store t.dequantize(), or t.int_repr() with its quantization "
                "parameters")
    if t.is_meta:
        return (f"a meta tensor ({_facts(t)}): it has no data (e.g. a module built under torch.device('meta') and "
                "never materialized); materialize it first: module.to_empty(device=...), then initialize or "
                "load its values")
    if t.device.type not in ("cpu", "cuda"):
        return f"a tensor on device {t.device} ({_facts(t)}): only CPU and CUDA tensors are supported; store t.cpu()"
    if t.dim() > MAX_NDIM:
        return f"a tensor of {t.dim()} dimensions ({_facts(t)}): the format allows {MAX_NDIM}; reshape it"
    if str(t.dtype).removeprefix("torch.") not in TORCH_DTYPES:
        return (f"a tensor of {_facts(t)}: the checkpoint format has no such dtype; convert it to one of "
                + ", ".join(TORCH_DTYPES))
    if t.numel() > 0 and not _has_storage(t):
        return (f"a tensor of type {kind.__module__}.{kind.__qualname__} without accessible storage "
                f"({_facts(t)}); convert it to a plain dense tensor first")
    return None


def _facts(t: torch.Tensor) -> str:
    try:
        shape = f", shape {tuple(t.shape)}"
    except RuntimeError:
        shape = ""
    return f"dtype {t.dtype}, device {t.device}{shape}"


def _loaded_class(module: str, name: str) -> type | None:
    """``module.name`` if that module is imported (no instance can exist otherwise): no import cost."""
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return cls if isinstance(cls, type) else None


def _has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` has real memory on its own device (not a null, fake or invalid storage)."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr() != 0 and storage.device == t.device
    except (RuntimeError, NotImplementedError):
        return False
