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

Storages wrap a real one (:class:`~ckpt_engine.storage.StorageWrapper`: ``FailingStorage(open_storage(url))``,
or ``FailingStorage(url)`` for short, on any fsspec URL) and inject one fault into the writes of data
files, in the real write path:

* :class:`FailingStorage` — a write of a file whose name contains ``fail_on`` breaks after half of
  its bytes with ``ENOSPC`` (a disk that fills up, a connection that drops mid-write);
* :class:`SlowStorage` — each data-file write first sleeps ``delay`` seconds (a slow disk or remote
  level), counting concurrent writers;
* :class:`GatedStorage` — each data-file write waits until ``gate`` is set (a level that hangs);
* :class:`CrashStorage` — at a named instant of the save of one step (:data:`CRASH_INSTANTS`: before
  the data, between data and index, the manifest, ``latest``, retention...), the process is
  SIGKILLed (the job dies there; its restart shows what it makes of what was left).

* :class:`CountingStorage` — counts the bytes read from data files.

A double's :meth:`~ckpt_engine.storage.StorageWrapper.child` (a rank's subtree of a node-local level)
is the same double over the inner storage's child, sharing its gate and counts.

A fault of your own: subclass :class:`~ckpt_engine.storage.StorageWrapper` (or one of these), override
the operation and call ``super()`` for the real one; raise from inside
:meth:`~ckpt_engine.storage.Storage.run` (e.g. ``return self.run("write", rel, fail)``) to fail exactly
as a backend error does (a ``StorageError`` naming the action and the path, the original error as its
cause).
"""

from __future__ import annotations

import collections
import errno
import json
import os
import posixpath
import signal
import threading
import time
from typing import Any, Callable, Iterable, Iterator, TypeVar

from ..format.catalog import LATEST, parse_dir
from ..format.entries import MANIFEST_NAME
from ..storage import LocalStorage, Storage, StorageWrapper
from ..storage.base import temp_name

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


class FailingStorage(StorageWrapper):
    """The real storage; writing a file whose name contains ``fail_on`` breaks halfway (ENOSPC).
    ``fail_on`` may be changed at any time (``None``: no fault)."""

    def __init__(self, inner: Storage | str, *args: Any, fail_on: str | None = None, **kwargs: Any) -> None:
        super().__init__(inner, *args, **kwargs)
        self.fail_on = fail_on

    def write_stream(self, rel: str, chunks: Any, **kw: Any) -> int:
        if self.fail_on and self.fail_on in rel:
            return super().write_stream(rel, _break_halfway(chunks), **kw)
        return super().write_stream(rel, chunks, **kw)


def _break_halfway(chunks: Iterable[Any]) -> Iterable[bytes]:
    """Yield the first half of the bytes, then fail as the device would, inside the real write."""
    data = b"".join(bytes(c) for c in chunks)
    yield data[: len(data) // 2]
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


class _Tally:
    """Numbers a double and its children count together (a child is a copy: a plain int would not be shared)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()


class SlowStorage(StorageWrapper):
    """The real storage, sleeping ``delay`` seconds before each data-file (``.bin``) write;
    ``active``/``max_active`` count the writers at once (its children's too)."""

    delay = 0.05

    def __init__(self, inner: Storage | str, *args: Any, delay: float | None = None, **kwargs: Any) -> None:
        super().__init__(inner, *args, **kwargs)
        if delay is not None:
            self.delay = delay
        self._tally = _Tally()

    @property
    def active(self) -> int:
        return self._tally.counts["active"]

    @property
    def max_active(self) -> int:
        return self._tally.counts["max_active"]

    def write_stream(self, rel: str, chunks: Any, **kw: Any) -> int:
        if rel.endswith(".bin") and self.delay:
            counts = self._tally.counts
            with self._tally.lock:
                counts["active"] += 1
                counts["max_active"] = max(counts["max_active"], counts["active"])
            try:
                time.sleep(self.delay)
            finally:
                with self._tally.lock:
                    counts["active"] -= 1
        return super().write_stream(rel, chunks, **kw)


class CountingStorage(StorageWrapper):
    """The real storage, counting in ``data_read`` the bytes read from data files (``.bin``), its
    children's reads included."""

    def __init__(self, inner: Storage | str, *args: Any, **kwargs: Any) -> None:
        super().__init__(inner, *args, **kwargs)
        self._tally = _Tally()

    @property
    def data_read(self) -> int:
        return self._tally.counts["data_read"]

    def reader(self, rel: str) -> Any:
        inner = super().reader(rel)
        if rel.endswith(".bin"):
            read_steps, tally = inner.read_steps, self._tally  # every read goes through it (read_many, read_into)

            def counted(offset: int, requests: Any, landed: Any) -> None:
                read_steps(offset, requests, landed)
                with tally.lock:
                    tally.counts["data_read"] += sum(len(d) for dests in requests for d in dests)

            inner.read_steps = counted  # type: ignore[method-assign]
        return inner


class GatedStorage(StorageWrapper):
    """The real storage; data-file (``.bin``) writes wait until ``gate`` is set. ``blocked`` is set
    once a write waits at the gate (so a test knows, without sleeping, that the writer is held).
    Its children wait at the same gate."""

    def __init__(self, inner: Storage | str, *args: Any, **kwargs: Any) -> None:
        super().__init__(inner, *args, **kwargs)
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def write_stream(self, rel: str, chunks: Any, **kw: Any) -> int:
        if rel.endswith(".bin"):
            self.blocked.set()
            self.gate.wait()
        return super().write_stream(rel, chunks, **kw)


CRASH_INSTANTS: tuple[str, ...] = (
    "before-data", "torn-data", "before-index", "torn-index", "after-index", "before-manifest", "torn-manifest",
    "after-manifest", "torn-latest", "after-latest", "torn-retention")
"""The instants of a save where :class:`CrashStorage` kills, in the order a save reaches them."""

RENAME_INSTANTS = frozenset({"torn-index", "torn-manifest", "torn-latest"})
"""Instants inside an atomic write: its temporary file written, not yet renamed into place. They exist
where ``write_atomic`` renames a temporary file (this machine's files, :class:`LocalStorage`); an object
store writes the file in one PUT, whole or not at all, so there they are the ``before-``/``after-`` ones.
:class:`CrashStorage` makes such an instant as the real write would leave it: the temporary file, named as
``write_atomic`` names it (:func:`~ckpt_engine.storage.base.temp_name`), written whole, then the crash."""


class CrashStorage(StorageWrapper):
    """The real storage; at ``instant`` of the save of ``step`` it calls :meth:`crash` (default: SIGKILL
    of this process's group), in the real write path. The instants, in save order (the commit
    protocol of docs/FORMAT.md); the first five are each rank's, around its own files (whichever rank
    gets there first crashes):

    * ``before-data``: the attempt's directory is made, the rank's data file not started;
    * ``torn-data``: half of the data file's bytes went to the real write, which dies asking for the
      rest (this machine's files: a short file; an object store: nothing, the upload never completed);
    * ``before-index``: between data and index: the data file is durable, the index file (the rank's
      commit: its part of the checkpoint is complete) is not written;
    * ``torn-index``: the index's temporary file is written, not renamed (:data:`RENAME_INSTANTS`);
    * ``after-index``: the rank's index file is in place;

    the others are rank 0's, the committer's:

    * ``before-manifest``: every rank's index file is in place, the manifest not written;
    * ``torn-manifest``: the manifest's temporary file is written, not renamed;
    * ``after-manifest``: the checkpoint is committed; ``latest`` still names the one before;
    * ``torn-latest``: ``latest``'s temporary file is written, not renamed;
    * ``after-latest``: ``latest`` names the checkpoint; retention has not run;
    * ``torn-retention``: retention after this commit made its first removal (an older checkpoint's
      manifest, in the engine's order: the checkpoint stops existing before its files go), no other.

    ``crash(rel, detail)`` gets the file of the instant and, for ``torn-data``, ``"W/T"``: the bytes
    written of the total. Override it to kill more than this process's group (each rank of a test
    job in a session of its own: kill the others, then call ``super().crash``).
    """

    def __init__(self, inner: Storage | str, *args: Any, instant: str, step: int, **kwargs: Any) -> None:
        super().__init__(inner, *args, **kwargs)
        if instant not in CRASH_INSTANTS:
            raise ValueError(f"instant={instant!r} is not one of {CRASH_INSTANTS}")
        if instant in RENAME_INSTANTS and not _renames(self.inner):
            raise ValueError(f"instant={instant!r}: {self.describe('')} writes a file in one request (no temporary "
                             "file renamed into place); use the before- or after- instant of that file")
        self.instant, self.step = instant, step
        self._committed = False

    def crash(self, rel: str, detail: str = "") -> None:
        """Kill the job at the instant (``rel``: the file it concerns); default: this process group."""
        os.killpg(os.getpgrp(), signal.SIGKILL)

    def _at(self, instant: str, rel: str, detail: str = "") -> None:
        if instant == self.instant:
            self.crash(rel, detail)

    def _kind(self, rel: str, data: bytes = b"") -> str | None:
        """``data``, ``index``, ``manifest`` or ``latest`` for a file of the save of ``step``, else ``None``."""
        if rel == LATEST:
            return "latest" if (parse_dir(data.decode(errors="replace")) or (None,))[0] == self.step else None
        where, name = posixpath.split(rel)
        if (parse_dir(where) or (None,))[0] != self.step:
            return None
        if name == MANIFEST_NAME:
            return "manifest"
        if name.startswith("rank-"):
            return "data" if name.endswith(".bin") else "index" if name.endswith(".index.json") else None
        return None

    def write_stream(self, rel: str, chunks: Any, **kw: Any) -> int:
        if self._kind(rel) == "data":
            self._at("before-data", rel)
            if self.instant == "torn-data":
                chunks = _Torn(chunks, lambda written, total: self.crash(rel, f"{written}/{total}"))
        return super().write_stream(rel, chunks, **kw)

    def write_atomic(self, rel: str, data: bytes, **kw: Any) -> None:
        kind = self._kind(rel, data)
        if kind is None:
            return super().write_atomic(rel, data, **kw)
        self._at(f"before-{kind}", rel)
        if self.instant == f"torn-{kind}":
            self._torn(rel, data)
        super().write_atomic(rel, data, **kw)
        self._committed = self._committed or kind == "manifest"
        self._at(f"after-{kind}", rel)

    def _torn(self, rel: str, data: bytes) -> None:
        """Crash where the real ``write_atomic`` of ``rel`` has written its temporary file, not renamed it."""
        tmp = temp_name(rel)
        super().write_stream(tmp, [data])
        self.crash(rel)
        super().remove(tmp)  # crash() returned (an override that lets the job go on): the real write follows

    def remove(self, rel: str) -> None:
        super().remove(rel)
        if self._committed:  # the first removal after the commit: retention's
            self._at("torn-retention", rel)


def _renames(storage: Storage) -> bool:
    """Whether ``write_atomic`` of ``storage`` (below its wrappers) renames a temporary file into place."""
    while isinstance(storage, StorageWrapper):
        storage = storage.inner
    return isinstance(storage, LocalStorage)


class _Torn:
    """A write's chunks handed over lazily (an iterable, so the real write streams them): the first
    half of their bytes, then ``crash(written, total)`` where the write asks for more."""

    def __init__(self, chunks: Any, crash: Callable[[int, int], None]) -> None:
        self._views = [memoryview(c).cast("B") for c in chunks]
        self._crash = crash

    def __iter__(self) -> Iterator[memoryview]:
        total = sum(len(v) for v in self._views)
        left = half = total // 2
        for view in self._views:
            if left == 0:
                break
            yield view[:left]
            left -= min(left, len(view))
        self._crash(half, total)
