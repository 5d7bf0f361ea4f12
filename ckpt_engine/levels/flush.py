"""Flush (multi-level persistence): copy checkpoints committed on level 1 to a slower level, in the background.

One :class:`Flusher` thread per lower level, on every rank. Each rank copies only its own files of
a checkpoint, ``rank-NNNNN.bin`` streamed in chunks and checked against its index while it passes,
then ``rank-NNNNN.index.json`` atomically, last: so a node-local level 1 works (no rank needs
another rank's level-1 files), and the index file on the lower level says "this rank's part is
there", exactly as after a direct save. Rank 0 then runs the ordinary commit there (commit.py:
wait for every rank's index file, check, write the manifest last), with the level-1 manifest's
body, so the checksums are the same ones.

Which checkpoint to flush is rank 0's decision, so that every rank copies the same one: when its
flusher is free it takes the newest checkpoint committed on level 1, skips the older ones not yet
flushed (counted: the lower level is slower than the checkpoint rate), and writes its choice to the
lower level's ``flushing`` file before copying. The other ranks follow that file; a rank that does
not have the chosen checkpoint (it skipped or failed it) writes its abort marker there, so rank 0
stops waiting. Never a collective: this runs beside training (invariant 7).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from ..errors import CheckpointError
from ..format.catalog import parse_dir, split_dir
from ..format.entries import RankRecord, index_file
from ..format.manifest import Manifest
from ..save.commit import Abandoned, CommitInputs, commit, retain, write_abort
from ..save.tally import FlushRecord, Tally
from ..storage import Storage
from .transfer import copy_rank

log = logging.getLogger("ckpt_engine.levels.flush")

FLUSHING = "flushing"
"""Lower-level root file: rank 0's current decision, ``{"dir": <attempt dir>, "flush": true|false}``."""
COUNTERS = ("flushed", "flush_skipped", "flush_failed", "flush_bytes")
"""Keys this module adds to ``Checkpointer.counters`` (summed over the lower levels)."""

ManifestSource = Callable[[str], Callable[[tuple[RankRecord, ...]], Manifest]]
"""Rank 0: for an attempt directory, a function building its manifest from the lower level's rank records."""


@dataclass(frozen=True)
class FlushItem:
    """One save attempt as this rank's flusher sees it (offered once its level-1 part is settled)."""

    dirname: str
    step: int
    ok: bool
    """This rank's level-1 part is complete (on rank 0 with a shared level 1: the checkpoint is committed)."""
    reason: str = ""
    """Why not ``ok``: ``"skipped"`` (back-pressure), ``"failed"``, or ``"removed"`` (level-1
    retention took it before it was copied: it was committed there, so dropping it counts as a skip)."""

    @property
    def committed(self) -> bool:
        """Whether it was committed on level 1 (so not flushing it is a skipped flush)."""
        return self.ok or self.reason == "removed"
    saved_at: float = 0.0
    durable_at: float = 0.0
    """``time.perf_counter()`` at ``save()`` and when durable on level 1."""

    @property
    def key(self) -> str:
        """Orders attempts: incarnation, then save counter (fixed width, so text order is save order)."""
        return split_dir(self.dirname)[1]


def publish(target: Storage, dirname: str, flush: bool) -> None:
    """Rank 0: tell the other ranks which attempt to copy next (or to drop)."""
    target.write_atomic(FLUSHING, json.dumps({"dir": dirname, "flush": flush}).encode(), durable=False)


def read_decision(target: Storage) -> tuple[str, bool] | None:
    """Rank 0's current decision ``(dirname, flush)``, or ``None`` when there is none (yet)."""
    try:
        doc = json.loads(target.read_bytes(FLUSHING))
    except (CheckpointError, ValueError):
        return None
    if not isinstance(doc, dict) or parse_dir(str(doc.get("dir"))) is None:
        return None
    return str(doc["dir"]), bool(doc.get("flush"))


class Flusher:
    """The background copy of this rank's checkpoints from ``source`` (level 1) to ``target``.

    Order of calls: :meth:`offer` every save attempt once its level-1 part is settled (persist
    thread); :meth:`protected` from level-1 retention; :meth:`drain` / :meth:`take_error` /
    :meth:`stop` from the training thread. ``manifest_of`` (called on rank 0) builds a checkpoint's
    manifest from the lower level's rank records.
    """

    def __init__(self, source: Storage, target: Storage, *, level: int, rank: int, world_size: int,
                 generation: str, keep_last: int | None, commit_timeout: float, retries: int,
                 manifest_of: ManifestSource, tally: Tally | None = None) -> None:
        self.source, self.target, self.level = source, target, level
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.keep_last, self.commit_timeout, self.retries = keep_last, commit_timeout, retries
        self._manifest_of = manifest_of
        self._cond = threading.Condition()
        self._pending: dict[str, FlushItem] = {}
        self._current: FlushItem | None = None
        self._decided: str | None = None  # other ranks: rank 0's last decision seen
        self.last_copied: str | None = None
        """The attempt this rank copied last (rank 0: committed there)."""
        self._newest_step = -1
        self._stopping = False
        self._error: BaseException | None = None
        self.tally = tally if tally is not None else Tally()
        """Where the figures go (the ``Checkpointer``'s, shared by its flushers)."""
        self.tally.declare(COUNTERS)
        self._thread = threading.Thread(target=self._run, name=f"ckpt-flush-{level}", daemon=True)
        self._thread.start()

    # ---- training / persist side ----------------------------------------------------------------
    def offer(self, item: FlushItem) -> None:
        """A save attempt whose level-1 part is settled (``item.ok``: this rank has it)."""
        with self._cond:
            self._pending[item.dirname] = item
            if item.ok:
                self._newest_step = max(self._newest_step, item.step)
            self._cond.notify_all()

    def forget(self, dirnames: Sequence[str]) -> None:
        """Level-1 retention removed these: should rank 0 still choose one, say so at once."""
        with self._cond:
            for name in dirnames:
                item = self._pending.get(name)
                if item is not None and item.ok:
                    self._pending[name] = replace(item, ok=False, reason="removed")

    def protected(self) -> set[str]:
        """Level-1 directories retention must keep: the one being copied, the newest not yet copied,
        and (other ranks) the one rank 0 chose last, when not yet copied."""
        with self._cond:
            keep = {self._current.dirname} if self._current is not None else set()
            ok = [i for i in self._pending.values() if i.ok]
            if ok:
                keep.add(max(ok, key=lambda i: i.key).dirname)
            if self._decided in self._pending:
                keep.add(self._decided)
            return keep

    def drain(self, timeout: float) -> bool:
        """Wait until every offered attempt is flushed or skipped; ``False`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._current is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 1.0))
        return True

    def waiting_for(self) -> list[int]:
        """Steps still to flush (for messages)."""
        with self._cond:
            items = list(self._pending.values()) + ([self._current] if self._current else [])
            return sorted({i.step for i in items})

    def take_error(self) -> BaseException | None:
        """The first flush that failed for good since the last call, once."""
        with self._cond:
            error, self._error = self._error, None
        return error

    def stop(self, timeout: float = 0.0) -> None:
        """Stop taking new work; wait up to ``timeout`` seconds for a copy in progress."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        _background_priority()
        while True:
            item = self._choose_as_leader() if self.rank == 0 else self._choose_as_follower()
            if item is None:
                return
            try:
                if item.ok or self.rank != 0:
                    self._flush(item)
                elif self.world_size > 1:  # rank 0 drops it: let the other ranks drop it too
                    self._quietly(lambda: publish(self.target, item.dirname, False), "publish")
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _choose_as_leader(self) -> FlushItem | None:
        """Rank 0: the newest attempt committed on level 1 (older ones pending are skipped), or,
        when none is, the newest attempt, to drop (it is returned with ``ok`` false)."""
        with self._cond:
            while not self._pending and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            ok = [i for i in self._pending.values() if i.ok]
            chosen = max(ok or self._pending.values(), key=lambda i: i.key)
            for name in [n for n, i in self._pending.items() if i.key <= chosen.key]:
                dropped = self._pending.pop(name)
                if dropped.committed and dropped is not chosen:
                    self._skipped(dropped)
            self._current = chosen
            return chosen

    def _choose_as_follower(self) -> FlushItem | None:
        """Other ranks: wait for rank 0's decision about one of the pending attempts."""
        pauses = self.target.polling.flush.pauses()
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return None
            decision = read_decision(self.target)
            with self._cond:
                if decision is not None:
                    name, flush = decision
                    self._decided = name
                    cut = split_dir(name)[1]
                    for older in [n for n, i in self._pending.items() if i.key < cut]:
                        dropped = self._pending.pop(older)
                        if dropped.committed:
                            self._skipped(dropped)
                    item = self._pending.pop(name, None)
                    if item is not None and flush:
                        self._current = item
                        return item
                    if item is not None:
                        if item.committed:
                            self._skipped(item)
                        continue
                self._cond.wait(next(pauses))

    def _flush(self, item: FlushItem) -> None:
        record = FlushRecord(item.step, item.dirname, self.level)
        try:
            if not item.ok:  # rank 0 chose an attempt this rank does not have: say so, so it stops waiting
                record.skipped = True
                if item.committed:
                    self._count("flush_skipped")
                reason = "failed" if item.reason == "failed" else "skipped"
                self._quietly(lambda: write_abort(self.target, item.dirname, self.rank, reason,
                                                  f"not on this rank's level 1 ({item.reason})"), "abort")
                return
            for attempt in range(1, self.retries + 1):
                record.attempts = attempt
                try:
                    self._copy_and_commit(item, record)
                    return
                except Abandoned:
                    self._skipped(item, record)
                    return
                except Exception as e:  # noqa: BLE001 - retried, then kept and raised on the training side
                    if self._source_gone(item):  # level-1 retention took it meanwhile: superseded, not failed
                        self._skipped(item, record)
                        if self.rank != 0:
                            self._quietly(lambda: write_abort(self.target, item.dirname, self.rank, "skipped",
                                                              "removed from level 1 meanwhile"), "abort")
                        return
                    self._failed(item, record, e, final=attempt == self.retries)
                    if attempt < self.retries and not self._pause(0.5 * 2 ** (attempt - 1)):
                        return
        finally:
            self.tally.flushed(record)

    def _copy_and_commit(self, item: FlushItem, record: FlushRecord) -> None:
        start = time.perf_counter()
        if self.rank == 0 and self.world_size > 1:
            publish(self.target, item.dirname, True)
        record.bytes = copy_rank(self.source, self.target, item.dirname, self.rank)
        record.copy_s = time.perf_counter() - start
        if self.rank == 0:
            build = self._manifest_of(item.dirname)
            step, attempt = split_dir(item.dirname)
            begin = time.perf_counter()
            commit(self.target, item.dirname, CommitInputs(step, self.world_size, attempt, lambda r, _t: build(r)),
                   self.commit_timeout)
            record.commit_s = time.perf_counter() - begin
            record.committed = True
        now = time.perf_counter()
        with self._cond:
            record.durable_s, record.lag_s = now - item.saved_at, now - item.durable_at
            record.lag_steps = max(0, self._newest_step - item.step)
            self.last_copied = item.dirname
        self._count("flushed")
        self._count("flush_bytes", record.bytes)
        log.info("level %d: step %d durable (%d bytes, copy %.3f s, commit %.3f s, lag %.3f s / %d steps)",
                 self.level + 1, item.step, record.bytes, record.copy_s, record.commit_s, record.lag_s,
                 record.lag_steps)
        if self.rank == 0:
            self._quietly(lambda: retain(self.target, item.dirname, self.keep_last, self.generation), "retention")

    def _skipped(self, item: FlushItem, record: FlushRecord | None = None) -> None:
        if record is None:
            self.tally.flushed(FlushRecord(item.step, item.dirname, self.level, skipped=True))
        else:
            record.skipped = True
        self._count("flush_skipped")

    def _count(self, key: str, n: int = 1) -> None:
        self.tally.count(key, n)

    def _failed(self, item: FlushItem, record: FlushRecord, error: Exception, final: bool) -> None:
        self._count("flush_failed")
        record.error = f"{type(error).__name__}: {error}"
        log.warning("level %d: flush of step %d failed (attempt %d of %d): %s", self.level + 1, item.step,
                    record.attempts, self.retries, record.error)
        if not final:
            return
        with self._cond:
            if self._error is None:
                self._error = error
        if self.rank != 0:  # rank 0 stops waiting for this rank at once
            self._quietly(lambda: write_abort(self.target, item.dirname, self.rank, "failed", record.error), "abort")

    def _source_gone(self, item: FlushItem) -> bool:
        try:
            return not self.source.exists(f"{item.dirname}/{index_file(self.rank)}")
        except CheckpointError:
            return False

    def _pause(self, seconds: float) -> bool:
        """Sleep before a retry; ``False`` when stopping meanwhile."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping, seconds)
            return not self._stopping

    def _quietly(self, action: Callable[[], object], what: str) -> None:
        """Best effort: a failure is logged (the next flush or start-up sweep repairs it)."""
        try:
            action()
        except Exception as e:  # noqa: BLE001
            log.warning("level %d: %s failed: %s: %s", self.level + 1, what, type(e).__name__, e)


def _background_priority() -> None:
    """Lower this thread's CPU priority (Linux: per thread), so that training wins the cores."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
