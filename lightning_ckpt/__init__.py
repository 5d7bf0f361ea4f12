"""Lightning front end: the :class:`AsyncShardedCheckpoint` callback (``pytorch_lightning``)."""

from .callback import AsyncShardedCheckpoint

__all__ = ["AsyncShardedCheckpoint"]
