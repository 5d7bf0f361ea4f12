"""One exception family for everything the engine raises.

Callers catch :class:`CheckpointError`; the subclasses say which part failed so that a
front end can decide (retry, fall back to an older checkpoint, stop the job).
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by ckpt_engine."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state cannot be stored safely (it would need pickle)."""


class FormatError(CheckpointError, ValueError):
    """A manifest or index file is malformed, hostile or of an unknown format version."""


class MismatchError(CheckpointError, ValueError):
    """The state given to ``load(into=...)`` does not match the checkpoint (a key it lacks, another
    shape or dtype): a property of the caller's state, so no older checkpoint is tried instead."""


class CorruptionError(CheckpointError):
    """Bytes read back do not match their checksum, or a file is missing or truncated."""


class InsufficientMemoryError(CheckpointError, MemoryError):
    """A read would allocate more memory than this process can have (headroom.py): refused before
    allocating. The checkpoint may be genuine (``load(into=...)`` fills tensors already held) or
    claim sizes it never wrote."""


class StorageError(CheckpointError, OSError):
    """The storage backend failed (write, read, rename, listing)."""


class DiskFullError(StorageError):
    """A write found the storage full (``ENOSPC``, or ``EDQUOT`` past a quota): nothing was committed."""


class CommitTimeoutError(CheckpointError, TimeoutError):
    """Not every rank reported its bytes durable within the commit timeout."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (or not the requested step) exists at the path."""


class CheckpointWarning(UserWarning):
    """A checkpoint failed in the background and ``on_error="warn"`` let training go on."""


class ConfigError(CheckpointError, ValueError):
    """A configuration key or value is invalid."""
