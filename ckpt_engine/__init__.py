"""ckpt_engine: framework-agnostic two-phase, rank-sliced checkpointing.

Imports neither Lightning nor Horovod; the front ends (``lightning_ckpt``, ``horovod_ckpt``)
are thin adapters over :class:`Checkpointer`.
"""

from .checkpointer import Checkpointer, SaveHandle
from .comm import Comm, LocalComm, TorchDistComm
from .errors import (CheckpointError, CheckpointWarning, CommitTimeoutError, CorruptionError, DiskFullError,
                     FormatError, InsufficientMemoryError, MismatchError, NoCheckpointError, StorageError,
                     UnsupportedValueError)
from .interop import export
from .save.tally import SaveRecord
from .training.ddp_buckets import DDPBucketOrder

__all__ = [
    "Checkpointer", "SaveHandle", "SaveRecord", "DDPBucketOrder", "export", "Comm", "LocalComm", "TorchDistComm",
    "CheckpointError", "CheckpointWarning", "CommitTimeoutError", "CorruptionError", "FormatError", "NoCheckpointError",
    "StorageError", "DiskFullError", "UnsupportedValueError", "MismatchError", "InsufficientMemoryError",
]
__version__ = "0.1.0"
