"""``Checkpointer``: the engine's public entry point (two-phase, rank-sliced checkpoints).

Order of calls, on every rank of the job, from the training thread::

    ck = Checkpointer(path, comm=...)     # collective: agrees on the job incarnation
    ck.save(state, step, local)           # every rank, same steps; returns after the snapshot
    ck.wait()                             # optional: until the last save is committed
    state = ck.load(); local = ck.load_local()   # any rank, no communication
    ck.close()                            # waits for pending persists

``state`` is the replicated part (identical on every rank: parameters, optimizer state) and is
sliced across ranks; ``local`` differs per rank (RNG, data position, per-rank buffers) and each
rank stores its own whole.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import catalog
from .catalog import dir_name
from .comm import Comm, LocalComm
from .commit import CommitInputs, retain, sweep, wait_for_commit, write_abort
from .errors import CheckpointError, CheckpointWarning, CorruptionError, NoCheckpointError
from .manifest import Manifest, RankRecord, TensorEntry
from .persist import PersistJob, PersistWorker, SaveRecord
from .plan import Plan, TensorMeta, make_plan
from .restore import Opened, open_checkpoint, read_local, read_state
from .snapshot import BufferPool, Piece, copy_into, layout
from .storage import Storage
from .values import Encoded, dtype_name, encode


@dataclass(frozen=True)
class _Layout:
    """The plan and buffer layout for one state signature (cached: shapes rarely change)."""

    plan: Plan
    tensors: tuple[TensorEntry, ...]
    local_tensors: tuple[TensorEntry, ...]
    pieces: tuple[Piece, ...]
    nbytes: int


class SaveHandle:
    """Returned by :meth:`Checkpointer.save`; ``wait_snapshot()`` before mutating the state."""

    def __init__(self, record: SaveRecord, snapshot: "Future[None] | None") -> None:
        self.record = record
        self._snapshot = snapshot

    @property
    def step(self) -> int:
        return self.record.step

    def snapshot_done(self) -> bool:
        """Whether the copy finished (always true for a non-deferred save)."""
        return self._snapshot is None or self._snapshot.done()

    def wait_snapshot(self) -> None:
        """Block until the state may be mutated again (re-raises a failed copy)."""
        if self._snapshot is not None:
            self._snapshot.result()


class Checkpointer:
    """Two-phase, rank-sliced checkpoints of a training state to any fsspec path.

    Args:
        path: checkpoint root: a local directory, ``file://``, ``memory://`` (one process only),
            ``s3://bucket/prefix`` or any fsspec URL; or a :class:`Storage` (tests wrap one).
        comm: the job's communicator; default :class:`LocalComm` (single process).
        keep_last: keep this many committed checkpoints (by step); ``None`` keeps all.
        storage_options: passed to fsspec (credentials are better left to fsspec's own
            configuration: environment variables, config files).
        max_inflight: snapshots that may exist at once (each holds one host buffer of the
            rank's share).
        on_busy: when every buffer is still being persisted: ``"wait"`` for one, or ``"skip"``
            this checkpoint (counted in ``counters["skipped"]``).
        on_error: a failed background persist is re-raised once on the training side
            (``"raise"``), or reported as a :class:`CheckpointWarning` and counted in
            ``counters["failed"]`` so training goes on (``"warn"``). Either way the failed
            checkpoint never becomes visible and the previous one stays loadable.
        commit_timeout: seconds rank 0 waits for every rank's files before failing the commit.
        read_threads: parallel reads per rank in ``load()``; default: this machine's cores
            divided among the ranks that share it (``LOCAL_WORLD_SIZE``, else the world size).
    """

    def __init__(self, path: "str | Storage", *, comm: Comm | None = None, keep_last: int | None = None,
                 storage_options: dict[str, Any] | None = None, max_inflight: int = 1,
                 on_busy: Literal["wait", "skip"] = "wait", on_error: Literal["raise", "warn"] = "raise",
                 commit_timeout: float = 600.0,
                 read_threads: int | None = None) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        if commit_timeout <= 0:
            raise ValueError(f"commit_timeout must be > 0, got {commit_timeout!r}")
        self.comm: Comm = comm if comm is not None else LocalComm()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.storage = path if isinstance(path, Storage) else Storage(path, storage_options)
        if self.storage.protocol == "memory" and self.world_size > 1:
            raise CheckpointError(f"{path!r}: memory:// lives in one process and cannot hold a checkpoint of "
                                  f"{self.world_size} ranks; use a shared filesystem or object store")
        self.keep_last, self.on_busy, self.on_error = keep_last, on_busy, on_error
        self.commit_timeout = commit_timeout
        self.read_threads = read_threads or _default_read_threads(self.world_size)
        if self.rank == 0:
            self.storage.makedirs("")
            sweep(self.storage)
        # One collective at start: names this incarnation's attempts and orders them after the sweep.
        self._generation: str = self.comm.broadcast(_new_generation() if self.rank == 0 else None)
        self._pool = BufferPool(max_inflight)
        self._worker = PersistWorker(self.storage, self._pool, commit_timeout, self._after_commit)
        self._snapshots: ThreadPoolExecutor | None = None
        # Retention deletes (about 0.2 s per GiB here) run beside the persist worker, not in it,
        # so the next checkpoint's persist never queues behind them.
        self._janitor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-retain")
        self._retaining: list[Future[Any]] = []
        self._pending: SaveHandle | None = None
        self._layouts: dict[tuple, _Layout] = {}
        self._seq = 0
        self._last_dir: str | None = None
        self._opened: Opened | None = None
        self.load_failures: list[str] = []
        self._closed = False
        self._lock = threading.Lock()
        self.records: deque[SaveRecord] = deque(maxlen=1000)
        self.counters = {"saves": 0, "skipped": 0, "waited_s": 0.0, "committed": 0, "failed": 0}

    # ---- saving -------------------------------------------------------------------------------
    def save(self, state: Any, step: int, local: Any = None, *, defer: bool = False) -> SaveHandle | None:
        """Snapshot ``state`` (sliced) and ``local`` (whole) for ``step``; persist in the background.

        Returns when the snapshot is taken: both may be mutated right after. With ``defer=True``
        it returns at once and the copy runs in the background: call ``wait_snapshot()`` on the
        handle before mutating either. Returns ``None`` when ``on_busy="skip"`` skipped it.
        Every rank must call it for the same steps, in the same order.
        """
        self._check_open()
        self._raise_background_error()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if self._pending is not None:
            self._pending.wait_snapshot()
        start = time.perf_counter()
        enc, lenc = encode(state, "state"), encode(local, "local")
        lay = self._layout(enc, lenc)
        self._seq += 1
        attempt = f"{self._generation}{self._seq:08d}"
        dirname = dir_name(step, attempt)
        record = SaveRecord(step, dirname, lay.nbytes, started_at=start)
        self.counters["saves"] += 1
        self._last_dir = dirname
        cuda = any(t.is_cuda for t in enc.tensors + lenc.tensors)
        buf = self._pool.acquire(lay.nbytes, pinned=cuda, block=False)
        if buf is None and self.on_busy == "skip":
            return self._skip(dirname, record)
        if buf is None:
            buf = self._pool.acquire(lay.nbytes, pinned=cuda, block=True)
            self.counters["waited_s"] += time.perf_counter() - start
        job = PersistJob(dirname, step, self.rank, self.world_size, attempt, buf, lay.nbytes, lay.pieces,
                         lay.local_tensors, lenc.tree, record, commit=self._commit_inputs(step, attempt, lay, enc))
        snapshot: Future[None] | None = None
        if defer:
            snapshot = self._snapshot_pool().submit(self._copy, job, enc, lenc)
            job.snapshot = snapshot
        else:
            self._copy(job, enc, lenc)
        self._worker.submit(job)
        record.stall_s = time.perf_counter() - start
        self.records.append(record)
        handle = SaveHandle(record, snapshot)
        self._pending = handle if defer else None
        return handle

    def reserve(self, state: Any, local: Any = None) -> None:
        """Plan ``state``/``local`` and allocate the snapshot buffers now (call it at set-up).

        Optional: without it the first ``save()`` allocates them, and first-touch page faults
        then land in that save's stall (about 0.2 s per GiB here).
        """
        self._check_open()
        enc, lenc = encode(state, "state"), encode(local, "local")
        lay = self._layout(enc, lenc)
        self._pool.reserve(lay.nbytes, pinned=any(t.is_cuda for t in enc.tensors + lenc.tensors))

    def wait(self, *, retention: bool = False) -> None:
        """Block until every pending save is committed (or dropped); re-raise a background error.

        Deleting older checkpoints (``keep_last``) runs on its own thread and is not waited for,
        unless ``retention=True``; ``close()`` always waits for it.
        """
        self._check_open()
        self._drain()
        if retention:
            self._check_retention(wait=True)

    def close(self) -> None:
        """Wait for pending saves, then stop the background threads. Idempotent."""
        if self._closed:
            return
        try:
            self._drain()
        finally:
            self._closed = True
            self._worker.stop()
            self._janitor.shutdown(wait=True)
            self._check_retention(wait=True)
            if self._snapshots is not None:
                self._snapshots.shutdown(wait=True)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- loading ------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first."""
        return [e.step for e in catalog.committed(self.storage)]

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, step: int | None = None, *, fallback: bool = False) -> Any:
        """The replicated state of the newest committed checkpoint (or of ``step``), on CPU.

        Every byte read is verified; a mismatch raises :class:`CorruptionError` naming the file
        and tensor. With ``fallback=True`` a checkpoint that fails verification is skipped (and
        recorded in ``load_failures``) for the next newest one. Works with any world size,
        including a single process. Raises :class:`NoCheckpointError` when there is nothing.
        """
        found = catalog.manifest_dirs(self.storage, step)
        if not found:
            which = "" if step is None else f" of step {step}"
            raise NoCheckpointError(f"no committed checkpoint{which} at {self.storage.describe('')}; "
                                    f"committed steps: {self.steps()}")
        self.load_failures = []
        for _, dirname in reversed(found):
            try:
                opened = open_checkpoint(self.storage, dirname)
                state = read_state(self.storage, opened, self.read_threads)
            except CheckpointError as e:
                if not fallback or isinstance(e, NoCheckpointError):
                    raise
                self.load_failures.append(f"{dirname}: {e}")
                continue
            self._opened = opened
            return state
        raise CorruptionError(f"no checkpoint at {self.storage.describe('')} verifies: "
                              + "; ".join(self.load_failures))

    def load_local(self, rank: int | None = None) -> Any:
        """This rank's ``local`` from the checkpoint of the last ``load()`` (or the newest).

        With a different world size, rank ``r`` gets writer ``r``'s local when ``r`` is below
        the writers' world size and ``None`` otherwise; ``rank=`` reads any writer's.
        """
        if self._opened is None:
            found = catalog.manifest_dirs(self.storage)
            if not found:
                raise NoCheckpointError(f"no committed checkpoint at {self.storage.describe('')}")
            self._opened = open_checkpoint(self.storage, found[-1][1])
        opened = self._opened
        rank = self.rank if rank is None else rank
        if rank >= opened.manifest.world_size:
            return None
        return read_local(self.storage, opened, rank)

    def busy(self) -> bool:
        """Whether a snapshot is still being persisted (policies count its contention)."""
        return not self._pool.idle()

    @property
    def loaded_manifest(self) -> Manifest | None:
        """The manifest of the checkpoint the last ``load()`` read."""
        return self._opened.manifest if self._opened else None

    # ---- internals ----------------------------------------------------------------------------
    def _layout(self, enc: Encoded, lenc: Encoded) -> _Layout:
        key = (tuple((t.dtype, t.shape) for t in enc.tensors), tuple((t.dtype, t.shape) for t in lenc.tensors))
        lay = self._layouts.get(key)
        if lay is None:
            metas = [TensorMeta(dtype_name(t.dtype), tuple(t.shape), t.element_size()) for t in enc.tensors]
            plan = make_plan(metas, self.world_size)
            slices = plan.slices_for(self.rank, metas)
            pieces, nbytes = layout(slices, [m.itemsize for m in metas], lenc.tensors)
            tensors = tuple(TensorEntry(m.dtype, m.shape, o, n) for m, o, n in zip(metas, plan.owner, enc.names))
            local = tuple(TensorEntry(dtype_name(t.dtype), tuple(t.shape), self.rank, n)
                          for t, n in zip(lenc.tensors, lenc.names))
            lay = self._layouts[key] = _Layout(plan, tensors, local, pieces, nbytes)
        return lay

    def _commit_inputs(self, step: int, attempt: str, lay: _Layout, enc: Encoded) -> CommitInputs | None:
        if self.rank != 0:
            return None
        world, tree, tensors, threshold = self.world_size, enc.tree, lay.tensors, lay.plan.split_threshold

        def body(ranks: tuple[RankRecord, ...], created_at: float) -> Manifest:
            return Manifest(step, world, created_at, threshold, tensors, tree, ranks, {"attempt": attempt})

        return CommitInputs(step, world, attempt, body)

    def _copy(self, job: PersistJob, enc: Encoded, lenc: Encoded) -> None:
        start = time.perf_counter()
        copy_into(job.buffer, job.pieces, enc.tensors, lenc.tensors)
        job.record.snapshot_s = time.perf_counter() - start

    def _skip(self, dirname: str, record: SaveRecord) -> None:
        record.skipped = True
        self.counters["skipped"] += 1
        self.records.append(record)
        if self.world_size > 1:
            write_abort(self.storage, dirname, self.rank, "skipped")
        return None

    def _after_commit(self, job: PersistJob) -> None:
        self.counters["committed"] += 1
        self._retaining.append(self._janitor.submit(retain, self.storage, job.dirname, self.keep_last,
                                                    self._generation))

    def _snapshot_pool(self) -> ThreadPoolExecutor:
        if self._snapshots is None:
            self._snapshots = ThreadPoolExecutor(1, thread_name_prefix="ckpt-snapshot")
        return self._snapshots

    def _drain(self) -> None:
        if self._pending is not None:
            try:
                self._pending.wait_snapshot()
            finally:
                self._pending = None
        self._worker.drain()
        self._raise_background_error()
        self._check_retention(wait=False)
        if self.rank != 0 and self._last_dir is not None:
            wait_for_commit(self.storage, self._last_dir, self.world_size, self.commit_timeout)
            self._last_dir = None

    def _check_retention(self, wait: bool) -> None:
        """Warn about failed deletions (nothing is lost: the next commit retries them)."""
        pending = []
        for f in self._retaining:
            if not wait and not f.done():
                pending.append(f)
            elif f.exception() is not None:
                warnings.warn(f"retention failed: {f.exception()}", CheckpointWarning, stacklevel=4)
        self._retaining = pending

    def _raise_background_error(self) -> None:
        error = self._worker.take_error()
        if error is None:
            return
        self.counters["failed"] += 1
        if not isinstance(error, CheckpointError):
            wrapped = CheckpointError(f"background persist failed: {type(error).__name__}: {error}")
            wrapped.__cause__ = error
            error = wrapped
        if self.on_error == "warn":
            warnings.warn(f"checkpoint not saved: {error}", CheckpointWarning, stacklevel=3)
            return
        raise error

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")


def _default_read_threads(world_size: int) -> int:
    """Cores per co-located rank, 1 to 4: more threads than cores only add contention."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, min(4, (os.cpu_count() or 1) // max(1, local)))


def _new_generation() -> str:
    """12 lowercase hex digits, increasing with time, so attempts of later incarnations sort later."""
    return f"{int(time.time() * 1000) % (1 << 44):011x}{secrets.randbelow(16):x}"
