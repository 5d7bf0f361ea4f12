"""Writing a torch.distributed.checkpoint (DCP) directory from a checkpoint of ours: ``ckpt export --format dcp``.

:func:`write_dcp` (``ckpt_engine.export(..., format="dcp")``) runs DCP's own ``dcp.save`` on one process
(``no_dist=True``), giving it the checkpoint's state tree with a placeholder for every tensor (a
zero-stride view of one element: the tensor's shape and dtype, no memory of its size), and its
planner's ``resolve_data`` reads each tensor from our checkpoint only when DCP's writer asks for it
(:func:`~ckpt_engine.load.read.tensor_reader`: every byte verified). Keys, planner data and
``.metadata`` are DCP's own (``flatten_state_dict``'s dotted paths: ``model.0.weight``,
``optim.state.0.weight.exp_avg``), so ``dcp.load({"model": m.state_dict(), ...})`` on any number of
ranks and any mesh finds them and ``dcp_to_torch_save`` rebuilds the nested state. A sharded tensor
(``DTensor``) is written whole, one chunk; DCP's reader cuts each rank's part out of it.

Memory: DCP's file writer keeps every tensor of the file it is writing until that file is done,
so the tensors go into files of about ``file_bytes`` each (:class:`_Bucketed`): the peak is the
larger of the largest tensor and one file's tensors, plus the reader's pieces, never the state.

Non-tensor values are DCP bytes items (``torch.save`` of the value, as DCP writes them); NumPy
scalars become Python numbers and NumPy arrays tensors (as ``ckpt export --format torch``), a
tuple that holds tensors a list (DCP walks lists, not tuples). DCP keeps no empty container.

Reading a DCP directory (``ckpt import``): dcp_import.py. Resuming a live (sharded) state straight
from a DCP directory needs nothing of ours: that is ``dcp.load(state, checkpoint_id=path)`` itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StoragePrefix
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ..errors import CheckpointError
from ..format.entries import MANIFEST_NAME, TensorEntry
from ..load.open import Opened
from ..load.read import tensor_reader
from ..progress import Bar
from ..state.decode import decode
from ..state.values import parse_dtype
from ..storage import Storage

METADATA = ".metadata"
"""The file that makes a directory a DCP checkpoint (written last, by a rename)."""
FILE_BYTES = 64 << 20
"""Default tensor bytes per data file of an export: what the writer holds beyond the largest tensor."""


@dataclass(frozen=True)
class DcpExport:
    """What :func:`write_dcp` wrote: flat DCP keys counted, data bytes as stored (without ``.metadata``)."""

    out: str
    step: int
    tensors: int
    tensor_bytes: int
    values: int
    file_bytes: int
    files: int


# ---- out ---------------------------------------------------------------------------------------


class _Slot:
    """Table tensor ``index`` while the state tree is decoded (``as: numpy`` refs too)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def numpy(self) -> "_Slot":
        return self


def _placeholder(t: TensorEntry) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype that holds one element: what DCP plans with."""
    return torch.zeros((), dtype=parse_dtype(t.dtype)).expand(t.shape)


def dcp_tree(value: object, table: tuple[TensorEntry, ...], index: dict[int, int]) -> object:
    """The decoded state as DCP takes it: placeholders for slots (``index``: id -> table index),
    NumPy values as torch/Python ones, tuples that hold tensors as lists."""
    if isinstance(value, _Slot):
        t = _placeholder(table[value.index])
        index[id(t)] = value.index
        return t
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: dcp_tree(v, table, index) for k, v in value.items()}
    if isinstance(value, list) or type(value) is tuple:
        items = [dcp_tree(v, table, index) for v in value]  # type: ignore[union-attr]
        return items if isinstance(value, list) or any(isinstance(v, torch.Tensor) for v in items) else tuple(items)
    return value


class _ReadingPlanner(DefaultSavePlanner):
    """DCP's default save planner, but each tensor is read from our checkpoint when written."""

    def __init__(self, read: Callable[[int], torch.Tensor], index: dict[int, int]) -> None:
        super().__init__()
        self._read, self._index = read, index

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        return self._read(self._index[id(self.state_dict[write_item.index.fqn])])


def buckets(items: list[WriteItem], file_bytes: int) -> Iterator[list[WriteItem]]:
    """``items`` in order, cut into files: the bytes items with the first tensors, then runs of
    tensors of at most ``file_bytes`` together (a larger tensor alone). Pure."""
    run: list[WriteItem] = [i for i in items if i.type == WriteItemType.BYTE_IO]
    size = 0
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        n = item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize  # type: ignore[union-attr]
        if size and size + n > file_bytes:
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run


class _Bucketed:
    """A DCP file writer that writes one file per :func:`buckets` run (named ``__0_<k>_0.distcp``)."""

    file_bytes: int = FILE_BYTES

    def write_data(self, plan: Any, planner: Any) -> "torch.futures.Future[list[Any]]":
        prefix = plan.storage_data.prefix
        results: list[Any] = []
        for k, items in enumerate(buckets(plan.items, self.file_bytes)):
            part = dataclasses.replace(plan, items=items, storage_data=_StoragePrefix(f"{prefix}{k}_"))
            results += super().write_data(part, planner).wait()  # type: ignore[misc]
        done: torch.futures.Future[list[Any]] = torch.futures.Future()
        done.set_result(results)
        return done


class _FileWriter(_Bucketed, FileSystemWriter):
    pass


class _FsspecWriter(_Bucketed, FsspecWriter):
    pass


def unwrapped(e: CheckpointException) -> BaseException:
    """The exception a rank raised inside DCP (DCP wraps them per rank), ours first."""
    found = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    ours = [f for f in found if isinstance(f, CheckpointError)]
    return (ours or [f for f in found if isinstance(f, BaseException)] or [e])[0]


def write_dcp(storage: Storage, ck: Opened, out: str, *, out_options: dict[str, Any] | None = None,
              file_bytes: int = FILE_BYTES, threads: int = 4, progress: bool = False) -> DcpExport:
    """Write checkpoint ``ck`` of ``storage`` as a DCP checkpoint in directory ``out`` (a path or fsspec URL).

    Tensor by tensor, each verified (see the module docstring). Raises :class:`CheckpointError`
    when ``out`` already holds a DCP checkpoint, :class:`CorruptionError` when a checksum fails (no
    ``.metadata`` is written then, so ``out`` is no checkpoint), :class:`InsufficientMemoryError`
    when a tensor cannot be allocated (each is checked against this process's memory before it is read).
    """
    m = ck.manifest
    table = m.tensors
    where = storage.describe(f"{ck.dirname}/{MANIFEST_NAME}")
    index: dict[int, int] = {}
    state = dcp_tree(decode(m.state, _Slot, count=len(table), where=where), table, index)
    if not isinstance(state, dict):
        state = {"state": state}
    remote = "://" in out and not out.startswith("file://")
    writer_class = _FsspecWriter if remote else _FileWriter
    writer = writer_class(out, overwrite=False, **dict(out_options or {}))
    writer.file_bytes = file_bytes
    if writer.fs.exists(writer.fs.concat_path(writer.path, METADATA)):
        raise CheckpointError(f"{out} already holds a DCP checkpoint ({METADATA}); export into a new directory")
    with Bar(sum(t.nbytes for t in table), "export", progress) as bar:
        read = tensor_reader(storage, ck, threads, bar.update)
        try:
            written = dcp.save(state, storage_writer=writer, planner=_ReadingPlanner(read, index), no_dist=True)
        except CheckpointException as e:
            raise unwrapped(e) from e
    infos = list((written.storage_data or {}).values())
    kinds = list(written.state_dict_metadata.values())
    tensors = [k for k in kinds if isinstance(k, dcp_metadata.TensorStorageMetadata)]
    return DcpExport(out, m.step, len(tensors), sum(t.size.numel() * t.properties.dtype.itemsize for t in tensors),
                     len(kinds) - len(tensors), sum(i.length for i in infos), len({i.relative_path for i in infos}))
