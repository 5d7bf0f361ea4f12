"""``Checkpointer``: the engine's public entry point (two-phase, rank-sliced checkpoints).

Order of calls, on every rank of the job, from the training thread::

    ck = Checkpointer(path, comm=...)     # collective: agrees on the job incarnation
    ck.save(state, step, local)           # every rank, same steps; returns after the snapshot
    ck.wait()                             # optional: until the last save is committed
    state = ck.load(); local = ck.load_local()   # any rank, no communication (one level)
    r = ck.restore()                      # resuming: every rank together, r.state / r.local / r.first
    ck.close()                            # waits for pending persists

``state`` is the replicated part (identical on every rank: parameters, optimizer state) and is
sliced across ranks; ``local`` differs per rank (RNG, data position, per-rank buffers) and each
rank stores its own whole.

The ``Checkpointer`` runs the pipeline (encode, plan, snapshot, persist: state/ then save/)
and hands everything about *where* checkpoints go to a :class:`~ckpt_engine.levels.destination.Destination`:
one path (levels/single.py) or several levels (``Checkpointer(levels=["/local_nvme/run",
"s3://bucket/run"])``, levels/multilevel.py: saves commit on the first level, background flushers
copy them to the others, and ``load()`` takes the newest checkpoint that verifies from the fastest
level that has it; there, with several ranks, ``load()`` is a collective: every rank calls it).
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from typing import Any, Literal, Sequence

from .comm import Comm, LocalComm, cores_per_rank
from .config import CheckpointConfig
from .config_levels import level_specs
from .errors import CheckpointError, CheckpointWarning
from .format.catalog import dir_name
from .host.collector import pause_collector, resume_collector
from .levels import open_destination
from .load.agreed import Loaded
from .load.exchange import Exchange, Route
from .reading import CheckpointReading
from .save.commit import CommitInputs
from .save.failure import surface
from .save.persist import PersistJob, PersistWorker
from .save.snapshot import SaveHandle, Snapshots
from .save.tally import FlushRecord, SaveRecord, Tally
from .state.values import encode
from .storage import Storage


class Checkpointer(CheckpointReading):
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
        read_threads: parallel reads per rank in ``load()``; default: the cores this process may run
            on divided among the ranks that share them (``LOCAL_WORLD_SIZE``, else the world size).
        copy_threads: threads of a snapshot copy training waits for (CPU tensors; a deferred
            copy uses one); default: as ``read_threads``, one per core the rank has (a helper where it
            has a spare core, :func:`~ckpt_engine.comm.cores_per_rank`).
        restore_route: how ``restore()`` on several ranks gets the replicated state's large
            pieces: ``"read"`` (every rank reads all of them from storage), ``"exchange"`` (each
            rank reads 1/N and the communicator brings the rest), or ``"auto"`` (the default:
            both measured at the first restore, the faster kept; see ``restore_figures``). The
            same on every rank.
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
                 read_threads: int | None = None, copy_threads: int | None = None, flush_retries: int = 3,
                 readonly: bool = False, restore_route: Route = "auto") -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        if commit_timeout <= 0:
            raise ValueError(f"commit_timeout must be > 0, got {commit_timeout!r}")
        for name, value in (("read_threads", read_threads), ("copy_threads", copy_threads)):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if type(flush_retries) is not int or flush_retries < 1:
            raise ValueError(f"flush_retries must be a positive integer, got {flush_retries!r}")
        specs = level_specs(path, levels, storage_options, keep_last)
        if readonly and (len(specs) > 1 or specs[0].memory):
            raise CheckpointError("readonly=True takes one path: open the level to read directly "
                                  "(e.g. Checkpointer(levels[-1], readonly=True))")
        self.readonly = readonly
        self.comm: Comm = comm if comm is not None else LocalComm()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.on_busy, self.on_error = on_busy, on_error
        self.commit_timeout = commit_timeout
        cores = cores_per_rank(self.world_size)
        self.read_threads, self.copy_threads = read_threads or cores, copy_threads or cores
        self._exchange = Exchange(self.comm, restore_route)
        self._tally = Tally()
        self._dest = open_destination(specs, self.comm, readonly, commit_timeout, flush_retries, self._tally)
        self.storage: Storage = self._dest.levels[0].storage
        self.keep_last: int | None = self._dest.levels[0].keep_last
        self._snapshots = Snapshots(self.rank, self.world_size, max_inflight, self.copy_threads)
        self._pool = self._snapshots.pool
        if self._dest.buffers is not None:
            self._pool.make = self._dest.buffers
        self._worker = PersistWorker(self.storage, self._pool, commit_timeout, self._persisted, tally=self._tally,
                                     keep_last=self.keep_last, make_room=self._dest.make_room,
                                     full_is_warning=self._dest.full_is_warning)
        self._pending: SaveHandle | None = None
        self._seq = 0
        self._last_dir: str | None = None
        self._loaded: Loaded | None = None
        self.load_failures: list[str] = []
        self._closed = False

    @classmethod
    def from_config(cls, config: CheckpointConfig, *, comm: Comm | None = None, **kwargs: Any) -> "Checkpointer":
        """The checkpointer a validated :class:`CheckpointConfig` describes (``dirpath`` or ``levels``,
        ``keep_last``, ``storage_options``, ``restore_route``); ``kwargs`` are the other constructor arguments
        (``max_inflight``, ``on_busy``, ``on_error``, ``commit_timeout``, ``flush_retries`` ...).

        What the front ends call, so that ``levels`` works from YAML in all of them.
        """
        where = {"levels": config.levels} if config.levels is not None else {"path": config.dirpath}
        return cls(**where, comm=comm, keep_last=config.keep_last, storage_options=dict(config.storage_options),
                   restore_route=config.restore_route, **kwargs)  # type: ignore[arg-type]

    # ---- figures ------------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, float]:
        """``saves``, ``skipped``, ``waited_s``, ``committed``, ``failed``, ``disk_full`` (multi-level
        also ``flushed``, ``flush_skipped``, ``flush_failed``, ``flush_bytes``), kept up to date."""
        return self._tally.counters

    @property
    def records(self) -> "deque[SaveRecord]":
        """This rank's figures of recent saves, oldest first (completed in place as they finish)."""
        return self._tally.records

    @property
    def flush_records(self) -> "deque[FlushRecord]":
        """Multi-level: figures of each checkpoint flushed (or skipped) to each lower level."""
        return self._tally.flush_records

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

        No automatic garbage collection of the process starts inside it (collector.py).
        """
        pause_collector()
        try:
            return self._save(state, step, local, defer)
        finally:
            resume_collector()

    def _save(self, state: Any, step: int, local: Any, defer: bool) -> SaveHandle | None:
        self._check_open()
        if self.readonly:
            raise CheckpointError(f"{self.storage.describe('')} was opened with readonly=True; open it "
                                  "without to save (as the one job that writes this path)")
        self._raise_background_error(stacklevel=4)  # a warning names save()'s caller
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if self._pending is not None:
            self._pending.wait_snapshot()
        start, cpu = time.perf_counter(), time.thread_time()
        enc, lenc = encode(state, "state"), encode(local, "local", sharded=False)
        lay, plan = self._snapshots.plan(enc, lenc)
        self._dest.admit(lay.nbytes)
        self._seq += 1
        attempt = f"{self._dest.generation}{self._seq:08d}"
        dirname = dir_name(step, attempt)
        record = SaveRecord(step, dirname, lay.nbytes, started_at=start, deferred=defer,
                            encode_s=time.perf_counter() - start, encode_cpu_s=time.thread_time() - cpu)
        self._tally.count("saves")
        self._last_dir = dirname
        cuda = bool(plan.devices)
        buf = self._pool.acquire(plan.nbytes, pinned=cuda, block=False)
        if buf is None and self.on_busy == "skip":
            return self._skip(dirname, record)
        if buf is None:
            buf = self._pool.acquire(plan.nbytes, pinned=cuda, block=True)
            self._tally.count("waited_s", time.perf_counter() - start)
        inputs = self._dest.saving(dirname, CommitInputs.of_save(step, self.world_size, attempt,
                                                                 lay.plan.split_threshold, lay.tensors, enc.tree))
        job = PersistJob(dirname, step, self.rank, self.world_size, attempt, buf, lay.nbytes, lay.pieces,
                         lay.local_tensors, lenc.tree, record, commit=inputs)
        job.snapshot = self._snapshots.take(buf, plan, record, defer)
        self._worker.submit(job)
        record.stall_s = time.perf_counter() - start
        self._tally.saved(record)
        handle = SaveHandle(record, job.snapshot)
        self._pending = handle if defer else None
        return handle

    def reserve(self, state: Any, local: Any = None, *, background: bool = False) -> None:
        """Plan ``state``/``local`` and allocate the snapshot buffers now (call it at set-up).

        Optional: without it the first ``save()`` allocates them, and first-touch page faults
        then land in that save's stall (about 0.2 s per GiB here). ``background``: allocate them
        on a background thread while training goes on (what the front ends do); a save that needs
        one before it is made waits for the one being made.
        """
        self._check_open()
        # the plan includes the staging areas
        lay, plan = self._snapshots.plan(encode(state, "state"), encode(local, "local", sharded=False))
        kept = self._dest.admit(lay.nbytes)
        self._pool.reserve(plan.nbytes, pinned=bool(plan.devices), kept=kept, background=background)

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
            self._warn_retention(self._dest.retention_failures(wait=True))
        if flush:
            self._dest.drain(self.commit_timeout if timeout is None else timeout)
        self._raise_flush_error()

    def close(self, timeout: float | None = None, *, release_memory: bool = True) -> None:
        """Wait for pending saves (and, multi-level, flushes: up to ``timeout`` seconds, default
        ``commit_timeout``), then stop the background threads. Idempotent.

        A flush still unfinished after ``timeout`` raises :class:`CheckpointError` (warns with
        ``on_error="warn"``); its checkpoint stays committed on the first level and the next
        start flushes the newest one again. A memory level is released (its node directory
        removed) when every slower level holds its newest checkpoint, unless ``release_memory=False``
        (a job ending on an error keeps it for its restart; the next start of another job on the
        node removes it once no process of this job is alive).
        """
        if self._closed:
            return
        try:
            self._drain()
            try:
                self._dest.drain(self.commit_timeout if timeout is None else timeout)
            except CheckpointError as e:
                self._report(e)
            self._raise_flush_error()
        finally:
            self._closed = True
            self._pool.stop_reserving()
            self._worker.stop()
            self._raise_background_error("warn")
            self._warn_retention(self._dest.close(release_memory))
            self._pool.drop_all()
            self._snapshots.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def busy(self) -> bool:
        """Whether a snapshot is still being persisted (policies count its contention)."""
        return not self._pool.idle()

    @property
    def record_storage(self) -> Storage:
        """Where records beside the checkpoints go (the front ends' ``figures.jsonl``): the first level
        every rank shares (a node-local or memory level 1 is one rank's, and is released at the end)."""
        return next((level.storage for level in self._dest.levels if not level.node_local), self.storage)

    @property
    def levels(self) -> tuple[Storage, ...]:
        """Each level's storage, fastest first (node-local level 1: this rank's own part of it)."""
        return tuple(level.storage for level in self._dest.levels)

    # ---- internals ----------------------------------------------------------------------------
    def _skip(self, dirname: str, record: SaveRecord) -> None:
        record.skipped = True
        self._tally.count("skipped")
        self._tally.saved(record)
        self._dest.skipped(dirname, record.step, record.started_at)
        return None

    def _persisted(self, job: PersistJob) -> None:
        """Persist thread, after every job: the destination commits or hands it on."""
        if self._dest.persisted(job):
            self._tally.count("committed")

    def _drain(self) -> None:
        if self._pending is not None:
            try:
                self._pending.wait_snapshot()
            finally:
                self._pending = None
        self._worker.drain()
        last, self._last_dir = self._last_dir, None
        self._raise_background_error()
        self._warn_retention(self._dest.retention_failures(wait=False))
        mine = self.records[-1] if self.records else None  # this rank's own failure was reported just above
        ended_here = mine is not None and mine.dirname == last and (mine.error is not None or mine.skipped)
        if last and not ended_here:
            try:
                self._dest.await_commit(last, self.commit_timeout)
            except CheckpointError as e:
                self._report(e)

    def _warn_retention(self, failures: list[BaseException]) -> None:
        """Warn about failed deletions (nothing is lost: the next commit retries them)."""
        for error in failures:
            warnings.warn(f"retention failed: {error}", CheckpointWarning, stacklevel=4)

    def _raise_background_error(self, on_error: Literal["raise", "warn"] | None = None, stacklevel: int = 3) -> None:
        on_error = on_error or self.on_error  # close() warns what is left after raising the earliest
        surface(self._worker.take_reports(until_error=on_error == "raise"), on_error, stacklevel=stacklevel)

    def _raise_flush_error(self) -> None:
        error = self._dest.take_error()
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

