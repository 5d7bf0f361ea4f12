"""ckpt_engine: framework-agnostic two-phase, rank-sliced checkpointing.

Imports neither Lightning nor Horovod; the front ends (``lightning_ckpt``, ``horovod_ckpt``)
are thin adapters over :class:`Checkpointer`.
"""

from .checkpointer import Checkpointer, SaveHandle
from .comm import Comm, LocalComm, TorchDistComm
from .config import CheckpointConfig, ConfigError
from .errors import (CheckpointError, CheckpointWarning, CommitTimeoutError, CorruptionError, DiskFullError,
                     FormatError, InsufficientMemoryError, MismatchError, NoCheckpointError, StorageError,
                     UnsupportedValueError)
from .interop import export
from .load.agreed import Restored
from .save.tally import SaveRecord
from .storage import Storage, StorageWrapper, open_storage
from .training.ddp_buckets import DDPBucketOrder
from .training.resumable import ResumableSampler, rng_state, set_rng_state

__all__ = [
    "Checkpointer", "SaveHandle", "SaveRecord", "Restored", "CheckpointConfig", "Storage",
    "open_storage", "StorageWrapper",
    "ResumableSampler", "rng_state", "set_rng_state", "DDPBucketOrder",
    "export", "import_dcp", "read_dcp",
    "Comm", "LocalComm", "TorchDistComm",
    "CheckpointError", "CheckpointWarning", "CommitTimeoutError", "ConfigError", "CorruptionError", "FormatError",
    "NoCheckpointError", "StorageError", "DiskFullError", "UnsupportedValueError", "MismatchError",
    "InsufficientMemoryError",
]
__version__ = "0.1.0"

_LAZY = {"import_dcp": "ckpt_engine.interop.dcp_import", "read_dcp": "ckpt_engine.interop.dcp_import"}
"""Names whose module is imported on first use (DCP's reader: only for a checkpoint of DCP's)."""


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckpt_engine' has no attribute {name!r}")
