"""Doubles for testing code that uses the engine: several ranks in one process, storage that fails.

Public so that users can test their own failure handling the way this project's tests do, without
``torch.distributed`` or a broken disk.

Communicators follow the :class:`~ckpt_engine.comm.Comm` protocol and pass values through JSON, as
the real ones do, so a value that would not cross a real communicator fails here too:

* :class:`SequentialComm` — ranks driven one after the other by one thread (rank 0 first): a
  broadcast is recorded by the source and read by the others. Enough for the save path
  (``Checkpointer`` construction and ``save()`` broadcast only), not for ``all_gather``.
* :class:`ThreadComm` with :func:`run_ranks` — each rank on a thread of its own, with real
  rendezvous: every collective works (``restore()``, ``agree``), in the same order on every rank.

Storages are the real :class:`~ckpt_engine.storage.Storage` (any fsspec URL: ``FailingStorage(url)``
is the local or the fsspec implementation with the fault on top) with one fault injected into the
writes of data files, inside the real write path:

* :class:`FailingStorage` — a write of a file whose name contains ``fail_on`` breaks after half of
  its bytes with ``ENOSPC`` (a disk that fills up, a connection that drops mid-write);
* :class:`SlowStorage` — each data-file write first sleeps ``delay`` seconds (a slow disk or remote
  level), counting concurrent writers;
* :class:`GatedStorage` — each data-file write waits until ``gate`` is set (a level that hangs).

A fault of your own: subclass ``Storage`` (or one of these), override the operation and call
``super()`` for the real one; raise from inside :meth:`~ckpt_engine.storage.Storage.run` (e.g.
``return self.run("write", rel, fail)``) to fail exactly as a backend error does (a
``StorageError`` naming the action and the path, the original error as its cause).
"""

from __future__ import annotations

import errno
import json
import threading
import time
from typing import Any, Callable, Iterable, TypeVar

from .storage import Storage

T = TypeVar("T")


class _Board:
    value: Any = None


class SequentialComm:
    """One rank of ``world_size`` simulated in one thread; make rank 0's calls first (see module)."""

    def __init__(self, rank: int, world_size: int, board: _Board | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self._board = board if board is not None else _Board()

    @classmethod
    def group(cls, world_size: int) -> list["SequentialComm"]:
        """The communicators of ranks ``0..world_size-1``, sharing one broadcast board."""
        board = _Board()
        return [cls(r, world_size, board) for r in range(world_size)]

    def broadcast(self, value: Any, src: int = 0) -> Any:
        if self.rank == src:
            self._board.value = json.dumps(value)
        return json.loads(self._board.value)

    def all_gather(self, value: Any) -> list[Any]:
        raise AssertionError("SequentialComm has no all_gather: run the ranks on threads (run_ranks)")


class ThreadComm:
    """One rank of a group whose ranks run on threads of this process (see :func:`run_ranks`)."""

    def __init__(self, rank: int, slots: list[Any], barrier: threading.Barrier) -> None:
        self.rank, self.world_size, self._slots, self._barrier = rank, len(slots), slots, barrier

    def all_gather(self, value: Any) -> list[Any]:
        self._slots[self.rank] = json.dumps(value)
        self._barrier.wait()
        out = [json.loads(s) for s in self._slots]
        self._barrier.wait()
        return out

    def broadcast(self, value: Any, src: int = 0) -> Any:
        return self.all_gather(value if self.rank == src else None)[src]


def run_ranks(world_size: int, fn: Callable[[ThreadComm], T], timeout: float = 120.0) -> list[T | BaseException]:
    """``fn(comm)`` on ``world_size`` threads, one per rank; their results, or the exception each
    raised, by rank. A collective that some rank never reaches breaks the barrier after ``timeout``
    seconds (``threading.BrokenBarrierError`` on the others) instead of hanging the test."""
    slots: list[Any] = [None] * world_size
    barrier = threading.Barrier(world_size, timeout=timeout)
    out: list[Any] = [None] * world_size

    def run(rank: int) -> None:
        try:
            out[rank] = fn(ThreadComm(rank, slots, barrier))
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 2)
    return out


class FailingStorage(Storage):
    """The real storage; writing a file whose name contains ``fail_on`` breaks halfway (ENOSPC)."""

    fail_on: str | None = None

    def write_stream(self, rel: str, chunks: Any, **kw: Any) -> int:
        if self.fail_on and self.fail_on in rel:
            return super().write_stream(rel, _break_halfway(chunks), **kw)
        return super().write_stream(rel, chunks, **kw)


def _break_halfway(chunks: Iterable[Any]) -> Iterable[bytes]:
    """Yield the first half of the bytes, then fail as the device would, inside the real write."""
    data = b"".join(bytes(c) for c in chunks)
    yield data[: len(data) // 2]
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


class SlowStorage(Storage):
    """The real storage, sleeping ``delay`` seconds before each data-file (``.bin``) write;
    ``active``/``max_active`` count the writers at once."""

    delay = 0.05

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def write_stream(self, rel: str, chunks: Any, **kw: Any) -> int:
        if rel.endswith(".bin") and self.delay:
            with self._lock:
                self.active += 1
                self.max_active = max(self.max_active, self.active)
            try:
                time.sleep(self.delay)
            finally:
                with self._lock:
                    self.active -= 1
        return super().write_stream(rel, chunks, **kw)


class CountingStorage(Storage):
    """The real storage, counting in ``data_read`` the bytes read from data files (``.bin``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data_read = 0
        self._lock = threading.Lock()

    def reader(self, rel: str) -> Any:
        inner = super().reader(rel)
        if rel.endswith(".bin"):
            read_steps = inner.read_steps  # every read goes through it (read_many and read_into too)

            def counted(offset: int, requests: Any, landed: Any) -> None:
                read_steps(offset, requests, landed)
                with self._lock:
                    self.data_read += sum(len(d) for dests in requests for d in dests)

            inner.read_steps = counted  # type: ignore[method-assign]
        return inner


class GatedStorage(Storage):
    """The real storage; data-file (``.bin``) writes wait until ``gate`` is set. ``blocked`` is set
    once a write waits at the gate (so a test knows, without sleeping, that the writer is held)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def write_stream(self, rel: str, chunks: Any, **kw: Any) -> int:
        if rel.endswith(".bin"):
            self.blocked.set()
            self.gate.wait()
        return super().write_stream(rel, chunks, **kw)
