"""Reading a torch.distributed.checkpoint (DCP) directory: ``ckpt import`` (the writing side: dcp.py).

A DCP directory written by ``dcp.save`` on any number of ranks, sharded or not, is read whole into
plain CPU tensors by DCP's own reader (which puts every rank's chunks of a tensor together) and
nested again by its planner data (:func:`read_dcp`); :func:`write_checkpoint` saves a state as a
checkpoint of ours, and :func:`import_dcp` does both. The whole state is in memory once (DCP's
reader fills whole tensors; our save then snapshots them).

DCP's ``.metadata`` is a pickle and its values are ``torch.save`` blobs: unless ``trust=True`` the
metadata is read by an unpickler that knows only DCP's metadata records and the values with
``weights_only=True``, so a checkpoint from elsewhere runs no code.

Resuming a live (sharded) state straight from a DCP directory is ``dcp.load`` itself (any mesh, any
world size); :func:`load_into` runs it with this module's safe reader and errors naming the key
(``lightning_ckpt``'s ``fit(ckpt_path=<DCP directory>)`` uses it).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from ..checkpointer import Checkpointer
from ..errors import CheckpointError
from .dcp import METADATA, unwrapped
from .dcp_lightning import from_lightning_dcp, read_meta

STEP_KEYS = ("step", "global_step")
"""Top-level keys whose integer value :func:`import_dcp` takes as the step when none is given."""


@dataclass(frozen=True)
class Imported:
    """What :func:`write_checkpoint` saved: the root, the step, flat leaves counted."""

    root: str
    step: int
    tensors: int
    tensor_bytes: int
    values: int

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
      ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided"), as torch's own safe loader
      ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
      ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``, refusing every class but DCP's metadata records and torch's
    dtypes, layouts and memory formats: a hostile file runs no code."""

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                                torch.memory_format))):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.where}: refers to {module}.{name}, which is not part of DCP's metadata; "
                              "if you trust this checkpoint, import it with trust=True (ckpt import --trust)")


class _SafeRead:
    """A DCP reader whose ``.metadata`` is read by :class:`_MetadataUnpickler` unless ``trust``."""

    trust = False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self.trust:
            return super().read_metadata(*args, **kwargs)  # type: ignore[misc]
        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as f:  # type: ignore[attr-defined]
            try:
                md = _MetadataUnpickler(f, str(path)).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
                raise CheckpointError(f"{path}: not a readable DCP {METADATA} ({type(e).__name__}: {e})") from e
        if not isinstance(md, dcp_metadata.Metadata):
            raise CheckpointError(f"{path}: holds a {type(md).__name__}, not DCP's Metadata")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return md


class _FileReader(_SafeRead, FileSystemReader):
    pass


class _FsspecReader(_SafeRead, FsspecReader):
    pass


class _ValuesPlanner(DefaultLoadPlanner):
    """Loads a flat ``{DCP key: placeholder}`` dict; bytes items with ``weights_only`` unless ``trust``."""

    def __init__(self, trust: bool) -> None:
        super().__init__(flatten_state_dict=False)
        self.trust = trust

    def load_bytes(self, read_item: Any, value: Any) -> None:
        key = read_item.dest_index.fqn
        try:
            self.original_state_dict[key] = torch.load(value, weights_only=not self.trust)  # the caller's dict
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"DCP value {key!r} needs code to unpickle ({str(e).splitlines()[0]}); if you "
                                  "trust this checkpoint, import it with trust=True (ckpt import --trust)") from e


def is_dcp(src: str, options: dict[str, Any] | None = None) -> bool:
    """Whether directory ``src`` (a path or fsspec URL) is a DCP checkpoint: it has a ``.metadata``."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(src, **(options or {}))
    return bool(fs.isfile(f"{path.rstrip('/')}/{METADATA}"))


def _reader(src: str, options: dict[str, Any] | None, trust: bool) -> Any:
    if not is_dcp(src, options):
        raise CheckpointError(f"{src} has no {METADATA}: not a DCP checkpoint (dcp.save writes one, last)")
    remote = "://" in src and not src.startswith("file://")
    reader = _FsspecReader(src, **(options or {})) if remote else _FileReader(src.removeprefix("file://"))
    reader.trust = trust
    return reader


def read_dcp(src: str, *, options: dict[str, Any] | None = None, trust: bool = False) -> dict[str, Any]:
    """The whole state of the DCP checkpoint in directory ``src``, nested as it was saved, on CPU.

    Written by ``dcp.save`` on any number of ranks: each tensor comes back whole (DCP's reader puts
    every rank's chunks together), every other value as saved. Keys nest by the checkpoint's planner
    data (``{"model": {"0.weight": ...}}``), or stay DCP's flat keys where it has none. Unless
    ``trust``, no code of the checkpoint runs (see the module docstring); a value that needs it
    raises :class:`CheckpointError` naming its key. Raises :class:`CheckpointError` when ``src`` is
    no DCP checkpoint.
    """
    reader = _reader(src, options, trust)
    md = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, kind in md.state_dict_metadata.items():
        if isinstance(kind, dcp_metadata.TensorStorageMetadata):
            flat[key] = torch.empty(kind.size, dtype=kind.properties.dtype)
        else:
            flat[key] = None
    try:
        dcp.load(flat, storage_reader=reader, planner=_ValuesPlanner(trust), no_dist=True)
    except CheckpointException as e:
        raise unwrapped(e) from e
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        set_element(nested, tuple(paths.get(key, (key,))), value)
    return nested


def top_keys(src: str, *, options: dict[str, Any] | None = None, trust: bool = False) -> list[str]:
    """The top-level keys of the DCP checkpoint in directory ``src`` (sorted); :class:`CheckpointError` if none."""
    md = _reader(src, options, trust).read_metadata()
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    return sorted({str(paths.get(key, (key.split(".")[0],))[0]) for key in md.state_dict_metadata})


class _Planner(DefaultLoadPlanner):
    """DCP's default load planner; values that are not tensors unpickled with ``weights_only`` unless ``trust``."""

    def __init__(self, trust: bool) -> None:
        super().__init__()
        self.trust = trust

    def load_bytes(self, read_item: Any, value: Any) -> None:
        key = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=not self.trust)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"DCP value {key!r} needs code to unpickle ({str(e).splitlines()[0]}); only "
                                  "for a checkpoint you trust: load it with trust=True") from e
        set_element(self.original_state_dict, self.mappings[key], loaded)


def load_into(src: str, state: dict[str, Any], *, options: dict[str, Any] | None = None, trust: bool = False) -> None:
    """Fill ``state`` (a live state dict: ``DTensor`` shards on any mesh, or plain tensors) from the DCP
    checkpoint in ``src`` with ``dcp.load``, on every rank of the default process group when there is one
    (a collective), resharded by DCP. A key ``state`` has and the checkpoint lacks, or a tensor of
    another shape, raises :class:`CheckpointError` naming it."""
    try:
        dcp.load(state, storage_reader=_reader(src, options, trust), planner=_Planner(trust))
    except CheckpointException as e:
        cause = unwrapped(e)
        if isinstance(cause, CheckpointError):
            raise cause from e
        raise CheckpointError(f"{src}: cannot load this DCP checkpoint into the module and its optimizers: "
                              f"{cause}") from e


def own_step(state: dict[str, Any]) -> int | None:
    """The step a state records of itself: the integer under one of :data:`STEP_KEYS`, else ``None``."""
    for key in STEP_KEYS:
        v = state.get(key)
        if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
            v = int(v.item())
        if type(v) is int and v >= 0:
            return v
    return None


def write_checkpoint(state: Any, root: str, step: int, *, storage_options: dict[str, Any] | None = None,
                     local: Any = None) -> Imported:
    """Save ``state`` (and the per-rank part ``local``) as a checkpoint of ours of ``step`` at ``root``
    (one process) and wait for its commit.

    ``root`` must be one no running job writes to (opening it for writing removes uncommitted
    attempts). Raises :class:`CheckpointError` when ``root`` already has a checkpoint of ``step``.
    """
    with Checkpointer(root, storage_options=storage_options, readonly=False) as ck:
        if step in ck.steps():
            raise CheckpointError(f"{root} already has a checkpoint of step {step}; import with another step "
                                  "(--step) or into another root")
        ck.save(state, step, local)
        ck.wait()
    leaves = list(_leaves(state)) + list(_leaves(local or {}))
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    return Imported(root, step, len(tensors), sum(t.nbytes for t in tensors), len(leaves) - len(tensors))


def _leaves(value: object) -> Iterator[object]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def import_dcp(src: str, root: str, *, step: int | None = None, options: dict[str, Any] | None = None,
               storage_options: dict[str, Any] | None = None, trust: bool = False) -> Imported:
    """Write the DCP checkpoint in ``src`` as a checkpoint of ours at ``root``: ``ckpt import SRC ROOT``.

    Its step: ``step``, else the state's own (:func:`own_step`), else 0. ``restore(into=...)`` of
    any mesh and world size then resumes from it. Lightning's sharded checkpoint (a ``meta.pt`` beside
    the DCP files) is written as ``AsyncShardedCheckpoint`` writes one under a sharded strategy
    (:func:`ckpt_engine.interop.dcp_lightning.from_lightning_dcp`; step: its ``global_step``).
    ``options``: fsspec options for ``src``. Errors: see :func:`read_dcp` and :func:`write_checkpoint`.
    """
    state = read_dcp(src, options=options, trust=trust)
    meta, local = read_meta(src, options=options, trust=trust), None
    if meta is not None:  # Lightning's sharded save_checkpoint: as AsyncShardedCheckpoint writes one
        state, local = from_lightning_dcp(state, meta, src)
    if step is None:
        step = own_step(meta if meta is not None else state) or 0
    return write_checkpoint(state, root, step, storage_options=storage_options, local=local)
