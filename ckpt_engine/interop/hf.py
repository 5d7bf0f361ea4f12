"""Hugging Face ``save_pretrained`` folders: ``ckpt export ROOT OUT_DIR --format hf --prefix model.``

The tensors under a key prefix of the replicated state (``model.`` for ``{"model":
model.state_dict(), "optim": ...}``; the prefix is stripped) are written as transformers'
``save_pretrained`` writes a model, so that ``from_pretrained(OUT_DIR)`` loads them:

* one ``model.safetensors`` when they fit ``max_shard_size`` (default ``5GB``, decimal units as
  transformers counts them; ``KiB``/``MiB``/``GiB`` binary), else ``model-00001-of-0000N.safetensors``
  files cut greedily in the state's order (a tensor larger than a shard gets a shard of its own)
  and ``model.safetensors.index.json``: ``{"metadata": {"total_parameters": n, "total_size":
  bytes}, "weight_map": {key: file}}``, keys sorted, as transformers writes it (for a GPT-2 the
  files are byte for byte ``save_pretrained``'s with transformers 5.24.0: tests/test_interop_hf.py);
* every file's header carries ``{"format": "pt"}`` (transformers refuses a file without it);
* tied tensors (one tensor of the checkpoint under several keys, such as GPT-2's
  ``lm_head.weight`` and ``transformer.wte.weight``) are written once, under the key that comes
  first in the state (the module registered first: the input embedding), as transformers drops
  the tied copy and ties it again when loading;
* ``config.json`` copied in when given (checked to be a JSON object first).

Tensors are read one at a time (:func:`ckpt_engine.load.read.tensor_reader`, every byte verified
against its checksum) and written straight into the file: memory stays bounded by the largest
tensor, never the whole state. The safetensors files are written here (an 8-byte header length,
the JSON header, the data: tensors of wider dtypes first so that each is aligned), so neither the
safetensors package nor transformers is needed. Local files are written under temporary names and
renamed once all are complete (the index last); files of an earlier export into the same folder
that the new one does not write (shards, index) are then removed, as ``save_pretrained`` does.
"""

from __future__ import annotations

import json
import os
import re
import struct
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterator, Sequence

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from ..state.tree import TensorRef, flatten, is_tensor, refs_tree
from ..errors import CheckpointError, StorageError
from ..load.open import Opened
from ..load.read import tensor_reader
from ..progress import Bar
from ..storage import Storage

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
"""Our dtype names (torch's, NumPy's for inline arrays) → safetensors' (``safetensors.torch``'s table)."""
ITEMSIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass(frozen=True)
class Weight:
    """One tensor to write: its key in the folder, safetensors dtype, shape, bytes, and where it
    comes from (a table index of the checkpoint, or an array held inline in the manifest)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    source: int | np.ndarray = field(compare=False)


@dataclass(frozen=True)
class HfResult:
    """What was written: the files (in ``out``), tensor count and bytes (tied ones once), the tied
    keys left out (``{dropped: kept}``) and the plain values under the prefix that were skipped."""

    out: str
    step: int
    prefix: str
    files: tuple[str, ...]
    tensors: int
    total_size: int
    tied: dict[str, str]
    skipped: tuple[str, ...]


def parse_size(size: int | str) -> int:
    """Bytes of a shard size: an integer, or ``"5GB"`` / ``"500MB"`` (decimal, as transformers) or
    ``"2GiB"`` (binary). Raises :class:`CheckpointError` for anything else or a size under 1 byte."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]?I?B)?\s*", size, re.IGNORECASE)
        if m is None or (m.group(2) or "").upper() not in _UNITS:
            raise CheckpointError(f"max shard size {size!r} is not a size: write e.g. 5GB, 500MB, 2GiB or a byte count")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if n < 1:
        raise CheckpointError(f"max shard size {size!r} must be at least 1 byte")
    return n


def select(ck: Opened, prefix: str) -> tuple[list[Weight], dict[str, str], list[str]]:
    """The tensors under ``prefix`` (stripped) in the state's order, without reading any:
    ``(weights, tied {dropped key: kept key}, skipped plain-value keys)``.

    Raises :class:`CheckpointError` when no tensor is under ``prefix`` (naming the prefixes that
    hold tensors) or a tensor's dtype has no safetensors name.
    """
    flat = flatten(refs_tree(ck.manifest.state))
    weights: list[Weight] = []
    kept: dict[int, str] = {}
    tied: dict[str, str] = {}
    skipped: list[str] = []
    for full, leaf in flat.items():
        if not full.startswith(prefix):
            continue
        key = full[len(prefix):]
        if not is_tensor(leaf):
            skipped.append(key)
            continue
        if isinstance(leaf, TensorRef):
            if leaf.index in kept:
                tied[key] = kept[leaf.index]
                continue
            kept[leaf.index] = key
            meta = ck.manifest.tensors[leaf.index]
            name, shape, source = meta.dtype, tuple(meta.shape), leaf.index  # type: ignore[assignment]
        else:
            array = np.asarray(leaf)
            name, shape, source = array.dtype.name, tuple(array.shape), array
        if name not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {full!r} is {name}, which safetensors cannot hold; "
                                  "export with --format torch")
        dtype = SAFETENSORS_DTYPES[name]
        size = ITEMSIZES[dtype] * int(np.prod(shape, dtype=np.int64))
        weights.append(Weight(key, dtype, shape, size, source))
    if not weights:
        heads = sorted({k.split(".")[0] + "." for k, v in flat.items() if is_tensor(v)})
        raise CheckpointError(f"no tensor under prefix {prefix!r} in the state of step {ck.manifest.step}; "
                              f"its tensors are under {', '.join(heads) or 'no key'}")
    if any(w.key == "__metadata__" for w in weights):
        raise CheckpointError(f"key {prefix}__metadata__ is reserved by safetensors; choose another prefix")
    return weights, tied, skipped


def shard(weights: Sequence[Weight], max_bytes: int) -> list[list[Weight]]:
    """``weights`` cut into shards of at most ``max_bytes`` each, in order, by huggingface_hub's
    rule (``split_torch_state_dict_into_shards``, which ``save_pretrained`` uses): a new shard when
    the next tensor would tip the current one over; a larger tensor in a shard of its own, listed
    when it is met (before the shard being filled then)."""
    shards: list[list[Weight]] = []
    current: list[Weight] = []
    size = 0
    for w in weights:
        if w.nbytes > max_bytes:
            shards.append([w])
            continue
        if current and size + w.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(w)
        size += w.nbytes
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """File names of ``count`` shards as ``save_pretrained`` names them."""
    if count == 1:
        return [WEIGHTS]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def layout(weights: Sequence[Weight]) -> tuple[list[Weight], bytes]:
    """``(weights in data order, header bytes)`` of one safetensors file: wider dtypes first (each
    tensor then starts at a multiple of its item size), then by key, as the safetensors package
    orders them; the header padded with spaces to 8 bytes."""
    ordered = sorted(weights, key=lambda w: (-ITEMSIZES[w.dtype], w.key))
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for w in ordered:
        head[w.key] = {"dtype": w.dtype, "shape": list(w.shape), "data_offsets": [offset, offset + w.nbytes]}
        offset += w.nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return ordered, struct.pack("<Q", len(text)) + text


def _data(w: Weight, read: Callable[[int], torch.Tensor]) -> memoryview:
    """The bytes of ``w`` (read and verified now when it is a table tensor)."""
    if isinstance(w.source, np.ndarray):
        data = memoryview(np.ascontiguousarray(w.source).reshape(-1).view(np.uint8))
    else:
        data = memoryview(read(w.source).contiguous().reshape(-1).view(torch.uint8).numpy())
    if data.nbytes != w.nbytes:
        raise CheckpointError(f"tensor {w.key!r}: read {data.nbytes} bytes where its dtype and shape make {w.nbytes}")
    return data


class _Folder:
    """Files written into ``out``: locally under temporary names until :meth:`commit` renames them
    (in order, so the index lands last); elsewhere (fsspec URLs) in place."""

    def __init__(self, out: str, options: dict[str, Any]) -> None:
        self.fs, path = fsspec.core.url_to_fs(out, **options)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.path = os.path.abspath(path) if self.local else path.rstrip("/")
        self.pending: list[tuple[str, str]] = []
        self.fs.makedirs(self.path, exist_ok=True)

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """Write file ``name``: yields the open file."""
        final = f"{self.path}/{name}"
        target = f"{self.path}/.tmp-{uuid.uuid4().hex}-{name}" if self.local else final
        self.pending.append((target, final))
        with self.fs.open(target, "wb") as f:
            yield f
            if self.local:
                f.flush()
                os.fsync(f.fileno())

    def commit(self, written: Sequence[str]) -> None:
        """Rename the temporaries into place, then remove the weight files of an earlier export."""
        for target, final in self.pending:
            if target != final:
                os.replace(target, final)
        self.pending = []
        for path in self.fs.ls(self.path, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if (name in (WEIGHTS, INDEX) or _SHARD.fullmatch(name)) and name not in written:
                self.fs.rm(path)

    def abort(self) -> None:
        """Remove what was written (temporaries only, locally)."""
        for target, final in self.pending:
            if target != final and os.path.exists(target):
                os.unlink(target)


def _config_text(config: str | None) -> bytes | None:
    if config is None:
        return None
    try:
        with fsspec.open(config, "rb") as f:
            text = f.read()
        parsed = json.loads(text)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--config {config}: cannot read it as JSON ({type(e).__name__}: {e})") from e
    if not isinstance(parsed, dict):
        raise CheckpointError(f"--config {config}: a model config is a JSON object, this is a {type(parsed).__name__}")
    return text


def export_hf(storage: Storage, ck: Opened, out: str, *, prefix: str,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, config: str | None = None,
              out_options: dict[str, Any] | None = None, progress: bool = False, threads: int = 4) -> HfResult:
    """Write the tensors of ``ck`` under ``prefix`` into folder ``out`` as ``save_pretrained`` does
    (see the module docstring); ``config`` (a JSON file) is copied in as ``config.json``.

    A non-empty ``prefix`` without a trailing dot gets one (``model`` → ``model.``); ``""`` takes
    every tensor. Raises :class:`CheckpointError` for an empty selection, an unsupported dtype, a
    bad size or config, :class:`CorruptionError` when a checksum fails and :class:`StorageError`
    when a file cannot be written (no file of a failed local export is left behind or renamed).
    """
    if prefix and not prefix.endswith("."):
        prefix += "."
    limit = parse_size(max_shard_size)
    config_text = _config_text(config)
    weights, tied, skipped = select(ck, prefix)
    shards = shard(weights, limit)
    names = shard_names(len(shards))
    total = sum(w.nbytes for w in weights)
    try:
        folder = _Folder(out, dict(out_options or {}))
    except (OSError, ValueError) as e:
        raise StorageError(f"could not create {out}: {type(e).__name__}: {e}") from e
    try:
        with Bar(sum(w.nbytes for w in weights if not isinstance(w.source, np.ndarray)), "export", progress) as bar:
            read = tensor_reader(storage, ck, threads, bar.update)
            for name, part in zip(names, shards):
                ordered, head = layout(part)
                with folder.open(name) as f:
                    f.write(head)
                    for w in ordered:
                        f.write(_data(w, read))
        if config_text is not None:
            with folder.open(CONFIG) as f:
                f.write(config_text)
        if len(shards) > 1:
            params = sum(int(np.prod(w.shape, dtype=np.int64)) for w in weights)
            index = {"metadata": {"total_parameters": params, "total_size": total},
                     "weight_map": {w.key: name for name, part in zip(names, shards) for w in part}}
            with folder.open(INDEX) as f:
                f.write((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        folder.commit(names + ([INDEX] if len(shards) > 1 else []))
    except OSError as e:
        folder.abort()
        raise StorageError(f"could not write {out}: {type(e).__name__}: {e}") from e
    except BaseException:
        folder.abort()
        raise
    files = tuple(names + ([CONFIG] if config_text is not None else []) + ([INDEX] if len(shards) > 1 else []))
    return HfResult(out, ck.manifest.step, prefix, files, len(weights), total, tied, tuple(skipped))
