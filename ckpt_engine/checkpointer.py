"""``Checkpointer``: the engine's public entry point (two-phase, rank-sliced checkpoints).

Order of calls, on every rank of the job, from the training thread::

    ck = Checkpointer(path, comm=...)     # collective: agrees on the job incarnation
    ck.save(state, step, local)           # every rank, same steps; returns after the snapshot
    ck.wait()                             # optional: until the last save is committed
    state = ck.load(); local = ck.load_local()   # any rank, no communication
    r = ck.restore()                      # resuming: every rank together, r.state / r.local / r.first
    ck.close()                            # waits for pending persists

``state`` is the replicated part (identical on every rank: parameters, optimizer state) and is
sliced across ranks; ``local`` differs per rank (RNG, data position, per-rank buffers) and each
rank stores its own whole.

Multi-level (``Checkpointer(levels=["/local_nvme/run", "s3://bucket/run"])``): saves commit on
the first level, background flushers copy them to the others (multilevel.py, flush.py), and
``load()`` takes the newest checkpoint that verifies from the fastest level that has it
(restore_levels.py); there, with several ranks, ``load()`` is a collective: every rank calls it.
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
from typing import Any, Literal, Sequence

from .format import catalog
from .agree import on_rank0
from .format.catalog import dir_name
from .comm import Comm, LocalComm
from .progress import Bar
from .progress import wanted as progress_wanted
from .commit import CommitInputs, retain, sweep, wait_for_commit, write_abort
from .config import CheckpointConfig, level_specs
from .cuda_copy import CudaCopy, Origin, capture
from .errors import CheckpointError, CheckpointWarning, CorruptionError, NoCheckpointError, StorageError
from .failure import surface
from .levels.flush import FlushRecord
from .format.manifest import Manifest, RankRecord, TensorEntry
from .levels.multilevel import MultiLevel
from .persist import PersistJob, PersistWorker, SaveRecord
from .plan import Plan, TensorMeta, make_plan
from . import restore_agreed
from .restore import Opened, open_checkpoint, read_local
from .restore_agreed import Restored, read_for_rank
from .levels.restore import candidates, load_levels
from .snapshot import BufferPool, CopyPlan, Piece, copy_into, layout, plan_copy
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

    def __init__(self, record: SaveRecord, snapshot: "Future[CudaCopy | None] | None") -> None:
        self.record = record
        self._snapshot = snapshot

    @property
    def step(self) -> int:
        return self.record.step

    def snapshot_done(self) -> bool:
        """Whether ``wait_snapshot()`` would not block (always true for a non-deferred save): the
        CPU copies are done and the CUDA copies queued (they may still run on the device)."""
        return self._snapshot is None or self._snapshot.done()

    def wait_snapshot(self) -> None:
        """Return when the state may be mutated again (re-raises a failed copy).

        CPU tensors: their copy is done. CUDA tensors: a CUDA tensor is only ever mutated by work
        queued on a stream, so no host sync is needed: the caller's stream of the ``save()`` call
        (and the current stream, if another) is made to wait on the copy-done event, and work
        queued on it afterwards (the optimizer step) cannot overtake the copy. Work on any other
        stream must be ordered after that one (``wait_stream``) before it writes the state.
        """
        if self._snapshot is not None:
            copy = self._snapshot.result()
            if copy is not None:
                copy.order()


class Checkpointer:
    """Two-phase, rank-sliced checkpoints of a training state to any fsspec path.

    Args:
        path: checkpoint root: a local directory, ``file://``, ``memory://`` (one process only),
            ``s3://bucket/prefix`` or any fsspec URL; or a :class:`Storage` (tests wrap one).
        levels: instead of ``path``, the persistence levels, fastest first: each a path (or
            ``Storage``) or a mapping ``{"path": ..., "storage_options": {...}, "keep_last": N}``.
            A save commits on the first level; background flushers copy it to the others (the
            newest first: older ones pending are skipped when a level is slower than the
            checkpoint rate). The first level may be node-local (each node its own disk); the
            others must be shared. One level is exactly ``path``.
        comm: the job's communicator; default :class:`LocalComm` (single process).
        keep_last: keep this many committed checkpoints (by step); ``None`` keeps all. With
            ``levels``: the default of levels that set none (a level never deletes the newest
            checkpoint a lower level still lacks).
        storage_options: passed to fsspec (credentials are better left to fsspec's own
            configuration: environment variables, config files); with ``levels``, the default
            of levels that set none.
        max_inflight: snapshots that may exist at once (each holds one host buffer of the
            rank's share).
        on_busy: when every buffer is still being persisted: ``"wait"`` for one, or ``"skip"``
            this checkpoint (counted in ``counters["skipped"]``).
        on_error: each failed save is counted in ``counters["failed"]`` (a full storage also in
            ``counters["disk_full"]``) and re-raised once on the training side, the earliest
            unreported one by each ``save``/``wait``/``close`` (``"raise"``), or reported as its own
            :class:`CheckpointWarning` so training goes on (``"warn"``). Either way it never
            becomes visible, its files are removed, and the previous checkpoint stays loadable.
        commit_timeout: seconds rank 0 waits for every rank's files before failing the commit.
        read_threads: parallel reads per rank in ``load()``; default: this machine's cores
            divided among the ranks that share it (``LOCAL_WORLD_SIZE``, else the world size).
        flush_retries: attempts per checkpoint and lower level before a flush failure is kept
            and raised by the next ``wait()`` / ``close()`` (each failure is counted in
            ``counters["flush_failed"]``; transient storage errors are retried below that).
        readonly: only read (``load``, ``steps``...): no start-up sweep, ``save`` refused. A
            writable ``Checkpointer`` is an incarnation of the job that owns ``path``: at start it
            removes uncommitted attempts, which, if that job is still running, are its checkpoints
            in progress. Open a running job's checkpoints with ``readonly=True`` (or the ``ckpt`` CLI).
    """

    def __init__(self, path: "str | Storage | None" = None, *, levels: "Sequence[Any] | None" = None,
                 comm: Comm | None = None, keep_last: int | None = None,
                 storage_options: dict[str, Any] | None = None, max_inflight: int = 1,
                 on_busy: Literal["wait", "skip"] = "wait", on_error: Literal["raise", "warn"] = "raise",
                 commit_timeout: float = 600.0,
                 read_threads: int | None = None, flush_retries: int = 3, readonly: bool = False) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        if commit_timeout <= 0:
            raise ValueError(f"commit_timeout must be > 0, got {commit_timeout!r}")
        if type(flush_retries) is not int or flush_retries < 1:
            raise ValueError(f"flush_retries must be a positive integer, got {flush_retries!r}")
        specs = level_specs(path, levels, storage_options, keep_last)
        if readonly and len(specs) > 1:
            raise CheckpointError("readonly=True takes one path: open the level to read directly "
                                  "(e.g. Checkpointer(levels[-1], readonly=True))")
        self.readonly = readonly
        self.comm: Comm = comm if comm is not None else LocalComm()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.on_busy, self.on_error = on_busy, on_error
        self.commit_timeout = commit_timeout
        self.read_threads = read_threads or _default_read_threads(self.world_size)
        self.counters = {"saves": 0, "skipped": 0, "waited_s": 0.0, "committed": 0, "failed": 0, "disk_full": 0}
        self.flush_records: deque[FlushRecord] = deque(maxlen=1000)
        """Multi-level: figures of each checkpoint flushed (or skipped) to each lower level."""
        self._multi: MultiLevel | None = None
        if len(specs) == 1:
            path, storage_options, keep_last = specs[0].path, dict(specs[0].storage_options), specs[0].keep_last
            self.storage = path if isinstance(path, Storage) else Storage(path, storage_options)
            if self.storage.protocol == "memory" and self.world_size > 1:
                raise CheckpointError(f"{path!r}: memory:// lives in one process and cannot hold a checkpoint of "
                                      f"{self.world_size} ranks; use a shared filesystem or object store")
            # One collective at start: names this incarnation's attempts and orders them after the sweep
            # (rank 0's failure, e.g. a root that is a file, is raised on every rank).
            self._generation: str = on_rank0(self.comm, lambda: _open_root(self.storage, readonly))
        else:
            self._multi = MultiLevel(specs, self.comm, commit_timeout=commit_timeout, retries=flush_retries,
                                     new_generation=_new_generation, counters=self.counters,
                                     records=self.flush_records)
            self.storage, keep_last = self._multi.fast.storage, self._multi.fast.keep_last
            self._generation = self._multi.generation
        self.keep_last = keep_last
        self._pool = BufferPool(max_inflight)
        self._worker = PersistWorker(self.storage, self._pool, commit_timeout, self._after_commit,
                                     self._on_persisted if self._multi is not None else None,
                                     counters=self.counters, keep_last=keep_last, make_room=self._multi is None)
        self._snapshots: ThreadPoolExecutor | None = None
        # Retention deletes (about 0.2 s per GiB here) run beside the persist worker, not in it,
        # so the next checkpoint's persist never queues behind them.
        self._janitor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-retain")
        self._retaining: list[Future[Any]] = []
        self._pending: SaveHandle | None = None
        self._layouts: dict[tuple, _Layout] = {}
        self._seq = 0
        self._last_dir: str | None = None
        self._last_committed: str | None = None
        self._opened: Opened | None = None
        self._opened_from: tuple[Storage, int, dict[int, Any] | None] = (self.storage, 0, None)
        self.load_failures: list[str] = []
        self._verified: dict[int, Any] = {}
        """The ``local`` of each writer the last ``load()`` verified before choosing its checkpoint."""
        self._closed = False
        self._lock = threading.Lock()
        self.records: deque[SaveRecord] = deque(maxlen=1000)

    @classmethod
    def from_config(cls, config: CheckpointConfig, *, comm: Comm | None = None, **kwargs: Any) -> "Checkpointer":
        """The checkpointer a validated :class:`CheckpointConfig` describes (``path`` or ``levels``,
        ``keep_last``, ``storage_options``); ``kwargs`` are the other constructor arguments
        (``max_inflight``, ``on_busy``, ``on_error``, ``commit_timeout``, ``flush_retries`` ...).

        What the front ends call, so that ``levels`` works from YAML in all of them.
        """
        where = {"levels": config.levels} if config.levels is not None else {"path": config.path}
        return cls(**where, comm=comm, keep_last=config.keep_last, storage_options=dict(config.storage_options),
                   **kwargs)

    # ---- saving -------------------------------------------------------------------------------
    def save(self, state: Any, step: int, local: Any = None, *, defer: bool = False) -> SaveHandle | None:
        """Snapshot ``state`` (sliced) and ``local`` (whole) for ``step``; persist in the background.

        Returns when the snapshot is taken: both may be mutated right after. With ``defer=True``
        it returns at once and the copy runs in the background: call ``wait_snapshot()`` on the
        handle before mutating either. Returns ``None`` when ``on_busy="skip"`` skipped it.
        Every rank must call it for the same steps, in the same order.

        CUDA tensors (cuda_copy.py): the copy is queued on a side stream after an event recorded
        on the caller's current stream here, so it sees every kernel queued before the call; "may
        be mutated" means by work queued on that stream afterwards (the stream is made to wait on
        the copy-done event: by ``save()`` itself, or with ``defer=True`` by ``wait_snapshot()``,
        so the next forward and backward overlap the copy; a forward that updates BatchNorm
        statistics in place mutates those: pass a clone); there is no host sync either way.
        """
        self._check_open()
        if self.readonly:
            raise CheckpointError(f"{self.storage.describe('')} was opened with readonly=True; open it "
                                  "without to save (as the one job that writes this path)")
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
        plan = plan_copy(lay.pieces, lay.nbytes, enc.tensors, lenc.tensors)
        cuda = bool(plan.devices)
        buf = self._pool.acquire(plan.nbytes, pinned=cuda, block=False)
        if buf is None and self.on_busy == "skip":
            return self._skip(dirname, record)
        if buf is None:
            buf = self._pool.acquire(plan.nbytes, pinned=cuda, block=True)
            self.counters["waited_s"] += time.perf_counter() - start
        inputs = self._commit_inputs(step, attempt, lay, enc)
        if self._multi is not None:
            self._multi.expect(dirname, inputs)
            inputs = None if self._multi.node_local else inputs  # each rank commits its own files there
        job = PersistJob(dirname, step, self.rank, self.world_size, attempt, buf, lay.nbytes, lay.pieces,
                         lay.local_tensors, lenc.tree, record, commit=inputs)
        origin = capture(plan.devices)  # here, on the caller's thread: its current streams
        snapshot: Future[CudaCopy | None] | None = None
        if defer:
            snapshot = self._snapshot_pool().submit(self._copy, job, plan, origin)
            job.snapshot = snapshot
        else:
            copy = self._copy(job, plan, origin)
            if copy is not None:
                copy.order()
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
        plan = plan_copy(lay.pieces, lay.nbytes, enc.tensors, lenc.tensors)  # with the staging areas
        self._pool.reserve(plan.nbytes, pinned=bool(plan.devices))

    def wait(self, *, retention: bool = False, flush: bool = False, timeout: float | None = None) -> None:
        """Block until every pending save is committed (or dropped); re-raise a background error.

        Deleting older checkpoints (``keep_last``) runs on its own thread and is not waited for,
        unless ``retention=True``; ``close()`` always waits for it. Multi-level: "committed"
        means on the first level; ``flush=True`` also waits (up to ``timeout`` seconds, default
        ``commit_timeout``) until every level has the newest checkpoint. A flush that failed for
        good is raised here either way (once).
        """
        self._check_open()
        self._drain()
        if retention:
            self._check_retention(wait=True)
        if self._multi is not None:
            if flush:
                self._multi.drain(self.commit_timeout if timeout is None else timeout)
            self._raise_flush_error()

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending saves (and, multi-level, flushes: up to ``timeout`` seconds, default
        ``commit_timeout``), then stop the background threads. Idempotent.

        A flush still unfinished after ``timeout`` raises :class:`CheckpointError` (warns with
        ``on_error="warn"``); its checkpoint stays committed on the first level and the next
        start flushes the newest one again.
        """
        if self._closed:
            return
        try:
            self._drain()
            if self._multi is not None:
                try:
                    self._multi.drain(self.commit_timeout if timeout is None else timeout)
                except CheckpointError as e:
                    self._report(e)
                if self._last_committed is not None:  # what the flushes no longer need
                    self._retaining.append(self._janitor.submit(self._multi.retain_fast, self._last_committed))
                self._raise_flush_error()
        finally:
            self._closed = True
            self._worker.stop()
            self._raise_background_error("warn")
            self._janitor.shutdown(wait=True)
            self._check_retention(wait=True)
            if self._snapshots is not None:
                self._snapshots.shutdown(wait=True)
            if self._multi is not None:
                self._multi.stop()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- loading ------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first (multi-level: on any level)."""
        if self._multi is not None:
            return self._multi.steps()
        return [e.step for e in catalog.committed(self.storage)]

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, step: int | None = None, *, fallback: bool = False, progress: bool = False) -> Any:
        """The replicated state of the newest committed checkpoint (or of ``step``), on CPU.

        Every byte read is verified; a mismatch raises :class:`CorruptionError` naming the file
        and tensor. So is the ``local`` of this rank's writer and of writer 0 (what the front ends
        resume per-rank state from), so that ``load_local()`` of either cannot fail afterwards.
        With ``fallback=True`` a checkpoint any of whose parts fails verification is skipped (and
        recorded in ``load_failures``) for the next newest one. Works with any world size,
        including a single process. Raises :class:`NoCheckpointError` when there is nothing.
        Not a collective (single level): ranks may fall back differently; :meth:`restore` agrees.

        Multi-level: every level is considered, the newest step first and the fastest level
        first on a tie; a copy that fails verification falls back to the same step on the next
        level (older steps only with ``fallback=True``); with several ranks this is a collective.

        ``progress=True`` draws a byte progress bar on stderr when it is a terminal (rank 0).
        """
        if self._multi is not None:
            self.load_failures = []
            loaded = load_levels(self._multi, self.comm, step, fallback, self.read_threads, self.load_failures)
            self._opened, self._opened_from = loaded.opened, (loaded.storage, loaded.level, loaded.locals)
            self._verified = dict(loaded.locals or loaded.verified or {})
            return loaded.state
        found = catalog.manifest_dirs(self.storage, step)
        if not found:
            which = "" if step is None else f" of step {step}"
            raise NoCheckpointError(f"no committed checkpoint{which} at {self.storage.describe('')}; "
                                    f"committed steps: {self.steps()}")
        self.load_failures = []
        for _, dirname in reversed(found):
            try:
                opened = open_checkpoint(self.storage, dirname)
                total = sum(e.nbytes for idx in opened.indexes for e in idx.entries if not e.local)
                with Bar(total, f"load step {opened.manifest.step}",
                         progress and self.rank == 0 and progress_wanted()) as bar:
                    state, verified = read_for_rank(self.storage, opened, self.rank, self.read_threads, bar.update)
            except CheckpointError as e:
                if not fallback or isinstance(e, NoCheckpointError):
                    raise
                self.load_failures.append(f"{dirname}: {e}")
                continue
            self._opened, self._verified = opened, verified
            return state
        raise CorruptionError(f"no checkpoint at {self.storage.describe('')} verifies: "
                              + "; ".join(self.load_failures))

    def load_local(self, rank: int | None = None) -> Any:
        """This rank's ``local`` from the checkpoint of the last ``load()`` (or the newest).

        With a different world size, rank ``r`` gets writer ``r``'s local when ``r`` is below
        the writers' world size and ``None`` otherwise; ``rank=`` reads any writer's.
        """
        if self._opened is None:
            self._open_newest()
        opened = self._opened
        assert opened is not None
        rank = self.rank if rank is None else rank
        if rank >= opened.manifest.world_size:
            return None
        if rank in self._verified:
            return self._verified[rank]
        storage, level, locals_ = self._opened_from
        if locals_ is not None:
            if rank not in locals_:
                raise CheckpointError(f"writer {rank}'s local state of {opened.dirname} is on its own node's level "
                                      f"{level + 1}; after a restore from there only this rank's and writer 0's are "
                                      "at hand (load that step from a shared level to read any)")
            return locals_[rank]
        return read_local(storage, opened, rank)

    def restore(self, step: int | None = None, *, fallback: bool = True) -> Restored:
        """Every rank, together (a collective): the checkpoint to resume from, and this rank's parts.

        The newest checkpoint (or the newest attempt of ``step``) whose replicated state, this
        rank's writer's ``local`` and writer 0's ``local`` verify on every rank; with
        ``fallback=True`` (the default) one that fails on any rank is skipped by all ranks alike
        (recorded in ``load_failures``), so every rank resumes from the same step. Returns a
        :class:`Restored`: ``state``, ``local`` (``None`` when this rank had no writer), ``first``
        (writer 0's), ``step``, ``manifest``; ``load_local()`` then returns the same values.
        Raises :class:`NoCheckpointError` when there is nothing (the front ends start fresh).
        """
        self.load_failures = []
        if self._multi is not None:  # a collective that verifies every rank's parts already
            state = self.load(step, fallback=fallback)
        else:
            opened, state, self._verified = restore_agreed.restore(self.storage, self.comm, step, fallback,
                                                                   self.read_threads, self.load_failures)
            self._opened, self._opened_from = opened, (self.storage, 0, None)
        assert self._opened is not None
        m = self._opened.manifest
        return Restored(m.step, self._opened.dirname, state, self.load_local(), self.load_local(rank=0), m,
                        self._opened_from[1])

    def busy(self) -> bool:
        """Whether a snapshot is still being persisted (policies count its contention)."""
        return not self._pool.idle()

    @property
    def loaded_manifest(self) -> Manifest | None:
        """The manifest of the checkpoint the last ``load()`` read."""
        return self._opened.manifest if self._opened else None

    @property
    def loaded_level(self) -> int | None:
        """Which level (0: the first, fastest) the last ``load()`` read from."""
        return self._opened_from[1] if self._opened else None

    @property
    def levels(self) -> tuple[Storage, ...]:
        """Each level's storage, fastest first (node-local level 1: this rank's own part of it)."""
        return (self.storage,) if self._multi is None else tuple(level.storage for level in self._multi.levels)

    # ---- internals ----------------------------------------------------------------------------
    def _open_newest(self) -> None:
        """``load_local()`` before any ``load()``: the newest checkpoint this process sees (no communication)."""
        if self._multi is None:
            shared = {0: catalog.manifest_dirs(self.storage)}
        else:
            shared = {lv.index: catalog.manifest_dirs(lv.storage) for lv in self._multi.levels if not lv.node_local}
        found = candidates(shared, None, self.world_size)
        if not found:
            raise NoCheckpointError(f"no committed checkpoint at {self.storage.describe('')}")
        storage = self.levels[found[0].level] if self._multi is not None else self.storage
        self._opened = open_checkpoint(storage, found[0].dirname)
        self._opened_from, self._verified = (storage, found[0].level, None), {}

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
        if self.rank != 0 and not (self._multi is not None and self._multi.node_local):
            return None
        world, tree, tensors, threshold = self.world_size, enc.tree, lay.tensors, lay.plan.split_threshold

        def body(ranks: tuple[RankRecord, ...], created_at: float) -> Manifest:
            return Manifest(step, world, created_at, threshold, tensors, tree, ranks, {"attempt": attempt})

        return CommitInputs(step, world, attempt, body)

    def _copy(self, job: PersistJob, plan: CopyPlan, origin: Origin | None) -> CudaCopy | None:
        start = time.perf_counter()
        copy = copy_into(job.buffer, plan, origin)
        job.record.snapshot_s = time.perf_counter() - start
        return copy

    def _skip(self, dirname: str, record: SaveRecord) -> None:
        record.skipped = True
        self.counters["skipped"] += 1
        self.records.append(record)
        if self.world_size > 1:
            write_abort(self.storage, dirname, self.rank, "skipped")
        if self._multi is not None:
            self._multi.skipped(dirname, record.step, record.started_at)
        return None

    def _after_commit(self, job: PersistJob) -> None:
        self.counters["committed"] += 1
        self._last_committed = job.dirname
        if self._multi is None:
            self._retaining.append(self._janitor.submit(retain, self.storage, job.dirname, self.keep_last,
                                                        self._generation))

    def _on_persisted(self, job: PersistJob) -> None:
        """Multi-level, persist thread: commit this rank's files (node-local level 1), hand them to the
        flushers, then level-1 retention (after the hand-over, so it sees what the flushers need)."""
        assert self._multi is not None
        self._multi.persisted(job)
        if job.durable and self._multi.node_local:
            self._after_commit(job)  # each rank commits and keeps its own part of a node-local level 1
        if job.durable and (job.commit is not None or self._multi.node_local):
            self._retaining.append(self._janitor.submit(self._multi.retain_fast, job.dirname))

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
        last, self._last_dir = self._last_dir, None
        self._raise_background_error()
        self._check_retention(wait=False)
        mine = self.records[-1] if self.records else None  # this rank's own failure was reported just above
        ended_here = mine is not None and mine.dirname == last and (mine.error is not None or mine.skipped)
        if self.rank != 0 and last and not ended_here and not (self._multi and self._multi.node_local):
            try:
                wait_for_commit(self.storage, last, self.world_size, self.commit_timeout)
            except CheckpointError as e:
                self._report(e)

    def _check_retention(self, wait: bool) -> None:
        """Warn about failed deletions (nothing is lost: the next commit retries them)."""
        pending = []
        for f in self._retaining:
            if not wait and not f.done():
                pending.append(f)
            elif f.exception() is not None:
                warnings.warn(f"retention failed: {f.exception()}", CheckpointWarning, stacklevel=4)
        self._retaining = pending

    def _raise_background_error(self, on_error: Literal["raise", "warn"] | None = None) -> None:
        on_error = on_error or self.on_error  # close() warns what is left after raising the earliest
        surface(self._worker.take_reports(until_error=on_error == "raise"), on_error, stacklevel=3)

    def _raise_flush_error(self) -> None:
        error = self._multi.take_error() if self._multi is not None else None
        if error is not None:
            self._report(error)

    def _report(self, error: CheckpointError) -> None:
        """Raise a flush problem or another rank's failed save, or warn with ``on_error="warn"``."""
        if self.on_error == "warn":
            warnings.warn(str(error), CheckpointWarning, stacklevel=4)
            return
        raise error

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")


def _open_root(storage: Storage, readonly: bool) -> str:
    """Rank 0 at start: create and sweep the root (unless read-only); the new incarnation's name."""
    if not readonly:
        if storage.local and os.path.exists(storage.root) and not os.path.isdir(storage.root):
            raise StorageError(f"the checkpoint root {storage.root} exists and is not a directory: give the path "
                               "of a directory (it is created when missing), or move that file away")
        storage.makedirs("")
        sweep(storage)
    return _new_generation()


def _default_read_threads(world_size: int) -> int:
    """Cores per co-located rank, 1 to 4: more threads than cores only add contention."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, min(4, (os.cpu_count() or 1) // max(1, local)))


def _new_generation() -> str:
    """This incarnation's tag: 27 lowercase hex digits, Unix milliseconds (11) then 64 random bits (16).

    The time prefix makes attempts of a later incarnation sort after an earlier one's (restore's
    tie-break between attempts of one step, the flusher's order, docs/FORMAT.md); the random part
    makes two starts in the same millisecond (or with clocks that disagree) collide with odds of
    2**-64, where a shared tag would mix two writers' files in one attempt directory.
    """
    millis = int(time.time() * 1000) % (1 << 44)
    return f"{millis:011x}{secrets.token_hex(8)}"
