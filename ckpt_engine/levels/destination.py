"""Where checkpoints go: the one interface a ``Checkpointer`` delegates to, whatever the levels.

Implementations: :class:`~ckpt_engine.levels.single.SingleLevel` (one path: a set of one level)
and :class:`~ckpt_engine.levels.multilevel.MultiLevel` (a fast first level, flushed in the
background to slower ones). A new kind of first level (node memory, a peer's memory) is a new
:class:`~ckpt_engine.levels.first.FirstLevel` that ``MultiLevel`` composes with its flushers;
neither the ``Checkpointer`` nor this interface changes.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from ..save.commit import CommitInputs
    from ..errors import CheckpointError
    from .open import Level
    from ..save.persist import PersistJob
    from ..load.agreed import Loaded
    from ..load.exchange import Exchange


class Destination(Protocol):
    """The levels a ``Checkpointer`` writes, commits, keeps and reads its checkpoints on.

    Order of calls (every rank, the same calls in the same order; "training" is the thread that
    calls the ``Checkpointer``, "persist" its background worker, "retention" a thread the
    destination runs itself):

    1. **open** (construction, training, a collective): create and sweep the levels, agree on
       this incarnation's :attr:`generation` (the prefix of its attempt tags), so that every sweep
       is done before any rank writes;
    2. ``reserve()`` (training): :meth:`admit` with the part's size, whose answer (the snapshot
       buffers committed checkpoints keep) sizes the buffer pool; per ``save()`` (training):
       :meth:`admit` again, then :meth:`saving` with what a commit of the attempt needs, returning
       what the persist worker commits with (``None``: this rank does not commit through it); or,
       when back-pressure dropped the attempt, :meth:`skipped` instead;
    3. after every persist job, failed ones included (persist): :meth:`persisted`, which commits or
       hands the attempt on as the destination requires and runs retention on its own thread;
       ``True`` when this rank committed it (counted in ``counters["committed"]``);
    4. ``wait()`` / ``close()`` (training): :meth:`await_commit` of the last attempt once the
       worker drained, :meth:`drain` (the lower levels, when asked), :meth:`take_error`,
       :meth:`retention_failures`; then :meth:`close`, once, last;
    5. reading (training, any time): :meth:`steps`; :meth:`load` (no communication on a single
       level, a collective on several), :meth:`restore` (a collective). ``load_local()`` before any
       load opens the newest checkpoint of the shared :attr:`levels` itself
       (:func:`~ckpt_engine.levels.restore.open_newest_shared`, no communication).
    """

    levels: tuple[Level, ...]
    """Fastest first; ``levels[0].storage`` is where ``save()`` writes (node-local: this rank's part)."""
    generation: str
    """This incarnation's tag (see :func:`new_generation`), agreed at open."""
    make_room: bool
    """Whether persist may delete committed checkpoints beyond ``keep_last - 1`` when the storage is full."""
    full_is_warning: bool
    """Whether a save that found level 1 full is a warning whatever ``on_error`` (a memory level)."""
    buffers: Callable[[int, bool], Any] | None
    """What makes the snapshot buffers, when not ordinary host memory (a memory level: files of it)."""

    def admit(self, nbytes: int) -> int:
        """``save()`` and ``reserve()`` (training), before a buffer is taken, with this rank's part
        size: raise :class:`CheckpointError` when the levels cannot hold a checkpoint of it. Returns
        how many snapshot buffers committed checkpoints hold in steady state (a memory level's are
        its checkpoints' files), which ``reserve()`` allocates at set-up beside those in flight."""
        ...

    def saving(self, dirname: str, inputs: CommitInputs) -> CommitInputs | None:
        """``save()`` of attempt ``dirname``: the commit inputs the persist worker gets, if any."""
        ...

    def skipped(self, dirname: str, step: int, saved_at: float) -> None:
        """``save()`` dropped ``dirname`` (``on_busy="skip"``): tell whoever waits for this rank."""
        ...

    def persisted(self, job: PersistJob) -> bool:
        """Persist thread, after every job (``job.durable``: this rank's files are durable): commit
        or hand it on, schedule retention; whether this rank committed it."""
        ...

    def await_commit(self, dirname: str, timeout: float) -> None:
        """Training thread, after the worker drained: block until ``dirname``, persisted by this rank,
        is committed where it counts (raises :class:`CheckpointError` after ``timeout`` seconds)."""
        ...

    def drain(self, timeout: float) -> None:
        """Block until every level has the newest checkpoint; :class:`CheckpointError` after ``timeout``."""
        ...

    def take_error(self) -> CheckpointError | None:
        """A background failure of the destination's own (a flush that failed for good), once."""
        ...

    def retention_failures(self, wait: bool) -> list[BaseException]:
        """Failed retention deletes since the last call (``wait``: after the pending ones finished)."""
        ...

    def close(self, release_memory: bool = True) -> list[BaseException]:
        """Last call: final retention, stop the background threads (a memory level: release it when
        ``release_memory`` and the slower levels hold its newest); the retention failures left."""
        ...

    def steps(self) -> list[int]:
        """Committed steps this process can see on any level, oldest first (no communication)."""
        ...

    def load(self, step: int | None, fallback: bool, threads: int, failures: list[str],
             progress: bool, into: Any = None) -> tuple[Any, Loaded]:
        """``Checkpointer.load()``: the state of the newest checkpoint (or ``step``) that verifies
        (``into`` filled in place from it, when given: load/into.py)."""
        ...

    def restore(self, step: int | None, fallback: bool, threads: int, failures: list[str],
                into: Any = None, exchange: Exchange | None = None) -> tuple[Any, Loaded]:
        """``Checkpointer.restore()``, every rank together: the same, verified on every rank
        (``exchange``: the route of the replicated state's large pieces, load/exchange.py)."""
        ...


class Retention:
    """The retention thread of a destination: deletes (about 0.2 s per GiB here) run beside the
    persist worker, not in it, so the next checkpoint's persist never queues behind them.

    :meth:`submit` from any thread; :meth:`failures` and :meth:`shutdown` from the training thread.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-retain")
        self._futures: list[Future[Any]] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the retention thread."""
        with self._lock:
            self._futures.append(self._pool.submit(fn, *args))

    def failures(self, wait: bool) -> list[BaseException]:
        """What failed since the last call; ``wait``: wait for the pending deletes first."""
        with self._lock:
            taken, self._futures = self._futures, []
        pending = [f for f in taken if not wait and not f.done()]
        failed = [e for e in (f.exception() for f in taken if wait or f.done()) if e is not None]
        with self._lock:
            self._futures[:0] = pending
        return failed

    def shutdown(self) -> list[BaseException]:
        """Finish the pending deletes and end the thread; what failed."""
        self._pool.shutdown(wait=True)
        return self.failures(wait=True)


def new_generation() -> str:
    """This incarnation's tag: 27 lowercase hex digits, Unix milliseconds (11) then 64 random bits (16).

    The time prefix makes attempts of a later incarnation sort after an earlier one's (restore's
    tie-break between attempts of one step, the flusher's order, docs/FORMAT.md); the random part
    makes two starts in the same millisecond (or with clocks that disagree) collide with odds of
    2**-64, where a shared tag would mix two writers' files in one attempt directory.
    """
    millis = int(time.time() * 1000) % (1 << 44)
    return f"{millis:011x}{secrets.token_hex(8)}"
