"""A checkpoint as one file other tools read without ckpt-suite (``ckpt_engine.export``, ``ckpt export``).

Five formats in all: ``torch`` and ``safetensors`` here (one file), ``lightning`` (a Lightning ``.ckpt``:
:mod:`ckpt_engine.interop.lightning`), ``hf`` (a ``save_pretrained`` folder: :mod:`ckpt_engine.interop.hf`)
and ``dcp`` (a ``torch.distributed.checkpoint`` directory: :mod:`ckpt_engine.interop.dcp`), the last two
streamed tensor by tensor:

* ``torch``: ``torch.save`` of the replicated state as saved (nested dicts, lists, tuples,
  tensors, plain values; tied tensors stay one tensor), or with ``flat=True`` a flat
  ``{"model.emb.weight": tensor, ...}`` dict (keys of :mod:`ckpt_engine.state.tree`). NumPy arrays
  become tensors and NumPy scalars Python numbers, so ``torch.load(f, weights_only=True)``
  loads it with nothing but torch installed.
* ``safetensors``: tensors only, under flat keys; every plain value goes into the header's
  ``__metadata__`` as a JSON string under its flat key (tuples as lists, bytes as base64, dtypes
  and devices as strings), plus ``"format": "pt"``. safetensors refuses tensors that share
  memory, so a tied tensor is written once per key (cloned).

``include_local`` adds one writer rank's ``local`` values: nested as ``{"state": ..., "local":
...}``, flat under ``state.`` / ``local.`` prefixes. Every byte is verified while reading (the
restore path). The output is written to a temporary name and renamed (local paths) or uploaded
in one piece (fsspec URLs), so a failed export never leaves a plausible-looking partial file.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import fsspec
from fsspec.implementations.local import LocalFileSystem
import numpy as np
import torch

from ..errors import CheckpointError, StorageError
from ..load.open import Opened, check_room
from ..load.read import read_local, read_state
from ..progress import Bar
from ..state.tree import flatten, iter_leaves
from ..storage import Storage
from .lightning import to_lightning

FORMATS = ("torch", "safetensors", "hf", "lightning", "dcp")


@dataclass(frozen=True)
class ExportResult:
    """What was written: tensor and value counts count flat leaves."""

    out: str
    format: str
    step: int
    tensors: int
    tensor_bytes: int
    values: int
    file_bytes: int | None


def plain(value: object) -> object:
    """``value`` with NumPy arrays as tensors and NumPy scalars as Python numbers (containers rebuilt).

    Everything ckpt_engine decodes is then something ``torch.load(weights_only=True)`` accepts.
    """
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if type(value) is tuple:
        return tuple(plain(v) for v in value)
    return value


def jsonable(value: object) -> Any:
    """A plain value as JSON data: tuples as lists, bytes as base64, dtypes/devices as strings."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def build(state: object, local: object | None, flat: bool) -> object:
    """The object to save: the state (nested or flat), with ``local`` alongside when given."""
    if local is not None:
        if flat:
            return {**{f"state.{k}": v for k, v in flatten(plain(state)).items()},
                    **{f"local.{k}": v for k, v in flatten(plain(local)).items()}}
        return {"state": plain(state), "local": plain(local)}
    return flatten(plain(state)) if flat else plain(state)


def safetensors_parts(flat: dict[str, object]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` for ``safetensors.torch.save`` from a flat dict.

    Tensors sharing memory with an earlier one are cloned (safetensors refuses shared memory).
    """
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    seen: set[int] = set()
    for key, v in flat.items():
        if isinstance(v, torch.Tensor):
            ptr = v.untyped_storage().data_ptr()
            if v.numel() and ptr in seen:
                v = v.clone()
            seen.add(ptr)
            tensors[key] = v.contiguous()
        else:
            metadata[key] = json.dumps(jsonable(v))
    metadata.setdefault("format", "pt")
    return tensors, metadata


def _safetensors_save() -> Callable[..., bytes]:
    try:
        from safetensors.torch import save
    except ImportError as e:
        raise CheckpointError("--format safetensors needs the safetensors package: "
                              "pip install 'ckpt-suite[export]'") from e
    return save


def _write(out: str, options: dict[str, Any], write: Callable[[Any], None]) -> int | None:
    """Run ``write(file)`` into ``out``: local paths via a temporary name and a rename."""
    fs, path = fsspec.core.url_to_fs(out, **options)
    if isinstance(fs, LocalFileSystem):
        path = os.path.abspath(path)
        tmp = os.path.join(os.path.dirname(path), f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return os.path.getsize(path)
    with fs.open(path, "wb") as f:
        write(f)
    try:
        return int(fs.size(path))
    except (OSError, ValueError, TypeError):
        return None


def export(storage: Storage, ck: Opened, out: str, *, fmt: str = "torch", flat: bool = False,
           local_rank: int | None = None, out_options: dict[str, Any] | None = None, progress: bool = False,
           threads: int = 4) -> ExportResult:
    """Write checkpoint ``ck`` to ``out`` (a path or fsspec URL) in format ``fmt``.

    ``local_rank``: also include that writer rank's ``local`` values. Raises
    :class:`CheckpointError` for a bad format or rank, :class:`CorruptionError` when a checksum
    fails (nothing is written then), :class:`StorageError` when the output cannot be written,
    :class:`InsufficientMemoryError` before reading when the state (and that ``local``) would not
    fit in this process's memory.
    """
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "hf":
        raise CheckpointError("format hf writes a folder under a key prefix: call ckpt_engine.export(..., format='hf', prefix=...)")
    if fmt == "dcp":  # a directory, written tensor by tensor (interop/dcp.py; DCP imported only for it)
        from .dcp import write_dcp

        d = write_dcp(storage, ck, out, out_options=out_options, threads=threads, progress=progress)
        return ExportResult(d.out, fmt, d.step, d.tensors, d.tensor_bytes, d.values, d.file_bytes)
    m = ck.manifest
    if fmt == "lightning" and local_rank is None:
        local_rank = 0  # Lightning's dictionary (loops, callbacks...) and buffers: writer 0's (interop/lightning)
    if local_rank is not None and not 0 <= local_rank < m.world_size:
        raise CheckpointError(f"--local-rank {local_rank}: the checkpoint of step {m.step} has ranks "
                              f"0..{m.world_size - 1}")
    save_safetensors = _safetensors_save() if fmt == "safetensors" else None
    check_room(storage, ck, local_ranks=() if local_rank is None else (local_rank,))
    total = sum(e.nbytes for idx in ck.indexes for e in idx.entries
                if not e.local or (local_rank is not None and idx.rank == local_rank))
    with Bar(total, "export", progress) as bar:
        state = read_state(storage, ck, threads, bar.update)
        local = read_local(storage, ck, local_rank, bar.update) if local_rank is not None else None
    if fmt == "lightning":
        obj = to_lightning(plain(state), plain(local), m.step)  # type: ignore[arg-type]
    else:
        obj = build(state, local, flat or save_safetensors is not None)
    leaves = list(iter_leaves(obj))
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    if save_safetensors is not None:
        try:
            data = save_safetensors(*safetensors_parts(obj))  # type: ignore[arg-type]
        except Exception as e:  # safetensors raises plain exceptions for unsupported dtypes
            raise CheckpointError(f"safetensors cannot hold this state ({e}); export with --format torch") from e

        def write(f: Any) -> None:
            f.write(data)
    else:
        def write(f: Any) -> None:
            torch.save(obj, f)
    try:
        size = _write(out, dict(out_options or {}), write)
    except (OSError, ValueError) as e:
        raise StorageError(f"could not write {out}: {type(e).__name__}: {e}") from e
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return ExportResult(out, fmt, m.step, len(tensors), sum(unique.values()), len(leaves) - len(tensors), size)
