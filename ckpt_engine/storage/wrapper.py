"""A storage that passes every operation to another: the base of fault injection and other layers.

:class:`StorageWrapper` holds an opened storage (``inner``) and hands each method of the contract to it
unchanged, settings included (``url``, ``protocol``, ``polling``, ``can_append``, ``in_memory``...), so
the engine treats a wrapper as the storage it wraps. A subclass overrides the operations it changes and
calls ``super()`` for the real one::

    class FullDisk(StorageWrapper):
        def write_stream(self, rel, chunks, **kw):
            if rel.endswith(".bin"):
                return self.run("write", rel, fail)   # fails as a backend error would
            return super().write_stream(rel, chunks, **kw)

    storage = FullDisk(open_storage("s3://bucket/run"))

What a wrapper sees are the calls made to it: the inner storage's own calls (a ``write_atomic`` that
writes a temporary file and renames it) stay inside it. To fail halfway through a write, hand the real
write chunks that fail (``ckpt_engine.testing.FailingStorage``); to fail the way a backend error does,
raise from inside :meth:`run` (a ``StorageError`` naming the action and the path, retried where the
inner storage retries). :meth:`child` is the same wrapper, with its state (a gate, a fault to inject),
over the inner storage's child. A wrapper pickles when its own state does.

Why the constructor also takes a URL (``FailingStorage("/ckpt")``): tests and users build a double
where they would have written the URL, and ``Checkpointer`` takes a URL or a storage alike; a URL is
opened with :func:`~.open.open_storage` and its arguments, so there is one way to open one.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Iterator, TypeVar

from . import guard
from .base import Chunks, Reader, Storage
from .open import open_storage
from .poll import Polling

T = TypeVar("T")


class StorageWrapper(Storage):
    """``inner`` with every operation passed through (see the module docstring).

    ``inner``: the storage to wrap, or a URL (``str`` or path) opened with
    ``open_storage(inner, storage_options, retry_deadline=...)``; those two arguments are for a URL only.
    """

    inner: Storage
    """The storage every operation goes to."""

    def __init__(self, inner: Storage | str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
                 retry_deadline: float | None = None) -> None:
        if isinstance(inner, Storage):
            if storage_options is not None or retry_deadline is not None:
                raise TypeError(f"{type(self).__name__}: storage_options and retry_deadline open a URL; "
                                f"{inner.describe('')} is open already (pass them to open_storage)")
        elif isinstance(inner, (str, os.PathLike)):
            inner = open_storage(os.fspath(inner), storage_options,
                                 retry_deadline=60.0 if retry_deadline is None else retry_deadline)
        else:
            raise TypeError(f"{type(self).__name__} wraps a Storage or opens a URL, not {type(inner).__name__} "
                            f"{inner!r}")
        self.inner = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    # ---- settings: the inner storage's -----------------------------------------------------------
    @property  # type: ignore[override]
    def url(self) -> str:
        return self.inner.url

    @property  # type: ignore[override]
    def protocol(self) -> str:
        return self.inner.protocol

    @property  # type: ignore[override]
    def retry_deadline(self) -> float:
        return self.inner.retry_deadline

    @property  # type: ignore[override]
    def polling(self) -> Polling:
        return self.inner.polling

    @property  # type: ignore[override]
    def can_append(self) -> bool:
        return self.inner.can_append

    @property  # type: ignore[override]
    def in_memory(self) -> bool:
        return self.inner.in_memory

    @in_memory.setter
    def in_memory(self, value: bool) -> None:  # the inner storage's readers are the ones that map
        self.inner.in_memory = value

    # ---- naming ---------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return self.inner.path(*parts)

    def describe(self, *parts: str) -> str:
        return self.inner.describe(*parts)

    def child(self, name: str) -> "StorageWrapper":
        """This wrapper (same class, same state) over ``inner.child(name)``."""
        sub = copy.copy(self)
        sub.inner = self.inner.child(name)
        return sub

    # ---- writing --------------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        self.inner.makedirs(rel)

    def write_stream(self, rel: str, chunks: Chunks, *, sync_dir: bool = True) -> int:
        return self.inner.write_stream(rel, chunks, sync_dir=sync_dir)

    def write_atomic(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        self.inner.write_atomic(rel, data, durable=durable)

    def append(self, rel: str, data: bytes) -> None:
        self.inner.append(rel, data)

    def remove(self, rel: str) -> None:
        self.inner.remove(rel)

    def abort_uploads(self) -> list[str]:
        return self.inner.abort_uploads()

    # ---- reading --------------------------------------------------------------------------------
    def read_bytes(self, rel: str, limit: int = guard.MAX_METADATA_BYTES) -> bytes:
        return self.inner.read_bytes(rel, limit)

    def regular_size(self, rel: str) -> int | None:
        return self.inner.regular_size(rel)

    def reader(self, rel: str) -> Reader:
        return self.inner.reader(rel)

    def exists(self, rel: str) -> bool:
        return self.inner.exists(rel)

    def size(self, rel: str) -> int | None:
        return self.inner.size(rel)

    def listdir(self, rel: str = "") -> list[str]:
        return self.inner.listdir(rel)

    def entries(self, rel: str = "") -> list[tuple[str, str]]:
        return self.inner.entries(rel)

    def usage(self, rel: str) -> tuple[int, float | None]:
        return self.inner.usage(rel)

    def free_bytes(self) -> int | None:
        return self.inner.free_bytes()

    def stale_temp_files(self, rel: str = "") -> Iterator[str]:
        return self.inner.stale_temp_files(rel)

    # ---- the hook -------------------------------------------------------------------------------
    def run(self, action: str, rel: str, fn: Callable[[], T]) -> T:
        return self.inner.run(action, rel, fn)
