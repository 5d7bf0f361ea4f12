"""Persist (phase 2): a background worker writes each snapshot, and on rank 0 commits it.

One worker thread per ``Checkpointer`` handles jobs in save order: wait for the snapshot copy
(deferred or CUDA), checksum each slice (xxh3-64, which releases the GIL), write the rank's data
file straight from the host buffer, write its index file, give the buffer back, and on rank 0
run the commit. Every failure is counted and kept, in order, for the training side (next
``save``, ``wait`` or ``close``: :func:`failure.surface`); the failing rank removes its partial
files and writes an abort marker so the committer stops waiting, and the checkpoint never gets a
manifest (who removes what of a failed attempt: ``failure.py``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import xxhash

from ..errors import CheckpointError, CheckpointWarning
from ..format.entries import IndexEntry, Piece, TensorEntry, data_file, index_file
from ..format.manifest import RankIndex
from ..storage import Storage
from . import failure
from .buffers import BufferPool, HostBuffer
from .commit import Abandoned, CommitInputs, commit, write_abort
from .filebuffers import link_data
from .tally import SaveRecord, Tally


_OVERLAP_MIN = 8 << 20
"""Below this the hand-off to the hashing thread costs more than the overlap gains."""


@dataclass
class PersistJob:
    """Everything the worker needs to write one rank's part of one checkpoint."""

    dirname: str
    step: int
    rank: int
    world_size: int
    attempt: str
    buffer: HostBuffer
    nbytes: int
    pieces: tuple[Piece, ...]
    local_tensors: tuple[TensorEntry, ...]
    local_tree: Any
    record: SaveRecord
    snapshot: "Future[Any] | None" = None
    commit: CommitInputs | None = None
    durable: bool = False
    """Set once this rank's files are durable (and, on the committer, committed)."""
    index: bytes | None = None
    """The index file's bytes once written (a node-local commit records their checksum)."""


def write_rank(storage: Storage, job: PersistJob, hasher: ThreadPoolExecutor | None = None) -> None:
    """Checksum and write the rank's data file (on a memory level, a buffer that is a file of the
    level is linked instead: save/filebuffers.py), then its index file (both durable on return).
    ``hasher``: a thread that computes the checksums beside the write (the worker's own); without
    it they are computed after."""
    if job.snapshot is not None:
        job.snapshot.result()
    if job.buffer.event is not None:
        job.buffer.event.synchronize()
    start, cpu = time.perf_counter(), time.thread_time()
    view = job.buffer.view(job.nbytes)
    ends = [p.offset for p in job.pieces[1:]] + [job.nbytes]  # layout order: each piece padded up to the next

    copied = job.buffer.checksums  # computed by the copy, a piece at a time (save/copy.py)
    known = copied if copied is not None and len(copied) == len(job.pieces) else None

    def checksums() -> tuple[tuple[IndexEntry, ...], float]:
        begin = time.thread_time()
        digests = known or [xxhash.xxh3_64_hexdigest(view[p.offset:end]) for p, end in zip(job.pieces, ends)]
        entries = tuple(IndexEntry(p.local, p.tensor, p.start, p.stop, p.offset, p.nbytes, d, box=p.box)
                        for p, d in zip(job.pieces, digests))
        return entries, time.thread_time() - begin

    storage.makedirs(job.dirname)
    rel = f"{job.dirname}/{data_file(job.rank)}"
    if link_data(storage, rel, job.buffer, job.nbytes):  # the buffer is the memory checkpoint's file
        hashing, (entries, hash_cpu) = None, checksums()
    else:
        # The checksums (xxh3 releases the GIL) are computed beside the write, which reads the same
        # buffer and mostly waits on the device; the index that holds them is written after both.
        overlap = hasher is not None and job.nbytes >= _OVERLAP_MIN and known is None
        hashing = hasher.submit(checksums) if overlap else None  # type: ignore[union-attr]
        # No directory fsync here: the index file's atomic write below syncs the same directory.
        storage.write_stream(rel, [view], sync_dir=False)
        entries, hash_cpu = hashing.result() if hashing is not None else checksums()
    job.record.persist_s = time.perf_counter() - start
    job.record.persist_cpu_s = time.thread_time() - cpu + (hash_cpu if hashing is not None else 0.0)
    index = RankIndex(job.step, job.rank, job.world_size, job.attempt, job.nbytes, entries, job.local_tensors,
                      job.local_tree, {"snapshot_s": job.record.snapshot_s, "persist_s": job.record.persist_s,
                                       "stall_s": job.record.stall_s})
    raw = index.to_json()
    storage.write_atomic(f"{job.dirname}/{index_file(job.rank)}", raw)
    job.index = raw


class PersistWorker:
    """The background thread of one ``Checkpointer``; jobs run one at a time, in order.

    ``on_finished(job)`` is called on this thread at the end of every job, failed ones included
    (``job.durable`` says which), after the commit (``job.commit`` given) and before the record's
    ``finished_at`` is set where no commit set it; an exception there fails the job. ``tally``
    (the checkpointer's) gets ``failed`` (each failed save, once) and ``disk_full`` (each save
    whose write found the storage full: failed, or saved after making room). ``make_room``: under
    ``ENOSPC``, remove committed checkpoints beyond ``keep_last - 1`` and write again, once
    (single-level checkpointers with ``keep_last``; see ``failure.py``). ``full_is_warning``: a
    save that failed because the storage is full is reported as a :class:`CheckpointWarning`
    whatever ``on_error`` says (a memory level: the job goes on, its earlier checkpoints and the
    slower levels stay as they are, and the next save that fits commits).
    """

    def __init__(self, storage: Storage, pool: BufferPool, commit_timeout: float,
                 on_finished: Callable[[PersistJob], None], *, tally: Tally | None = None,
                 keep_last: int | None = None, make_room: bool = False, full_is_warning: bool = False) -> None:
        self._storage = storage
        self._full_is_warning = full_is_warning
        self._pool = pool
        self._timeout = commit_timeout
        self._on_finished = on_finished
        self._queue: "queue.Queue[PersistJob | None]" = queue.Queue()
        self._tally = tally if tally is not None else Tally()
        self._keep_last, self._make_room = keep_last, make_room and keep_last is not None
        self._reports: deque[failure.Report] = deque()
        self._dead: list[tuple[str, int]] = []
        """Rank 0: attempts it will not commit whose files wait for every rank to finish with them."""
        self._lock = threading.Lock()
        # At the training thread's priority, on purpose: lowered (nice 10) it is preempted while it
        # holds the GIL, and training waits for it; measured, each checkpoint then cost the
        # Transformer +125-150 ms of CPU and +70 ms of wall (bench_lightning, 2026-11-26, 532da76).
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
        """The checksums beside the write (xxh3 releases the GIL); its thread starts at the first
        large write and ends with :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="ckpt-persist", daemon=True)
        self._thread.start()

    def submit(self, job: PersistJob) -> None:
        """Queue ``job``; its buffer is already taken from the pool (that bounds the queue)."""
        self._queue.put(job)

    def drain(self) -> None:
        """Block until every submitted job finished (committed on rank 0)."""
        self._queue.join()

    def take_reports(self, until_error: bool = False) -> list[failure.Report]:
        """What the background found since the last call, oldest first, each once: failed saves
        (exceptions) and warnings. ``until_error``: stop after the first failed save, leaving
        later ones for the next call (``on_error="raise"`` raises one per call)."""
        taken: list[failure.Report] = []
        with self._lock:
            while self._reports and not (until_error and taken and not isinstance(taken[-1], Warning)):
                taken.append(self._reports.popleft())
        return taken

    def stop(self) -> None:
        """Finish queued jobs, then end the thread and the hashing thread."""
        self._queue.put(None)
        self._thread.join()
        self._hasher.shutdown(wait=True)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                self._discard_dead()
                if job is None:
                    return
                self._process(job)
            finally:
                self._queue.task_done()

    def _process(self, job: PersistJob) -> None:
        try:
            self._persist_and_commit(job)
            try:
                self._on_finished(job)
            except BaseException as e:  # noqa: BLE001 - kept and re-raised on the training side
                job.durable = False
                self._fail(job, e)
        finally:
            job.record.finished_at = job.record.finished_at or time.perf_counter()

    def _persist_and_commit(self, job: PersistJob) -> None:
        try:
            try:
                self._write(job)
            finally:
                self._pool.release(job.buffer)
            if job.commit is not None:
                start, cpu = time.perf_counter(), time.thread_time()
                commit(self._storage, job.dirname, job.commit, self._timeout, on_hint_error=self._report)
                job.record.commit_s = time.perf_counter() - start
                job.record.commit_cpu_s = time.thread_time() - cpu
                job.record.committed = True
                job.record.finished_at = time.perf_counter()
            job.durable = True
        except Abandoned:
            job.record.skipped = True
            self._dead_attempt(job)
        except BaseException as e:  # noqa: BLE001 - kept and re-raised on the training side
            self._fail(job, e)

    def _write(self, job: PersistJob) -> None:
        """``write_rank``; on a full storage, make room (when allowed) and write once more."""
        try:
            write_rank(self._storage, job, self._hasher)
        except CheckpointError as e:
            if not (self._make_room and failure.is_disk_full(e)):
                raise
            failure.discard_rank(self._storage, job.dirname, job.rank)
            removed = failure.make_room(self._storage, self._keep_last)  # type: ignore[arg-type]
            if not removed:
                raise
            self._report(CheckpointWarning(
                f"{e}: the storage was full; removed {removed} (older than the keep_last={self._keep_last} newest, "
                f"which the commit of step {job.step} removes anyway) to make room, and wrote it again"))
            write_rank(self._storage, job, self._hasher)
            self._count("disk_full")  # a failed retry is counted by ``_fail``

    def _fail(self, job: PersistJob, error: BaseException) -> None:
        """Count and keep the failure (once per save), free this rank's space, tell the committer."""
        if job.record.error is not None:
            return  # a later consequence of a failure already reported
        if failure.is_disk_full(error):
            error = failure.disk_full(self._storage, error, job.step, job.nbytes, self._keep_last)
            self._count("disk_full")
        job.record.error = f"{type(error).__name__}: {error}"
        self._count("failed")
        full = self._full_is_warning and failure.is_disk_full(error)
        self._report(CheckpointWarning(f"checkpoint not saved: {error}; training goes on") if full else error)
        failure.discard_rank(self._storage, job.dirname, job.rank)
        if job.world_size > 1:
            try:
                write_abort(self._storage, job.dirname, job.rank, "failed", job.record.error)
            except Exception:  # noqa: BLE001 - storage is failing already; the original error is what matters
                pass
        self._dead_attempt(job)

    def _dead_attempt(self, job: PersistJob) -> None:
        """On the committer: ``job``'s attempt will not commit; remove its files once settled."""
        if job.commit is not None and not job.record.committed:
            self._dead.append((job.dirname, job.world_size))
            self._discard_dead()

    def _discard_dead(self) -> None:
        self._dead = [d for d in self._dead if not failure.discard_attempt(self._storage, *d)]

    def _report(self, item: failure.Report) -> None:
        with self._lock:
            self._reports.append(item)

    def _count(self, key: str) -> None:
        self._tally.count(key)
