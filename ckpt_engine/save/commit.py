"""Commit, retention and sweeping: what makes a set of rank files a checkpoint, and what removes one.

Coordination goes through storage only, never through a collective (the committer runs on a
background thread, and a collective there would deadlock against the training process group):

1. every rank writes its data file, then its index file (atomically), or an abort marker
   ``rank-NNNNN.abort.json`` saying it skipped this checkpoint or failed;
2. rank 0's background worker polls the attempt directory (fresh listings) until every rank's
   index file is there, reads and checks them, and writes ``manifest.json`` last, atomically
   (temp + rename on filesystems, a single PUT on object stores): that write is the commit;
3. then the ``latest`` pointer (a hint: failing to write it is a warning, never a failed save,
   since only the manifest decides visibility), then retention.

Removal goes the other way round: the manifest first (the checkpoint stops existing at once),
then the files.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Collection

import xxhash

from ..errors import CheckpointError, CheckpointWarning, CommitTimeoutError, FormatError
from ..format.catalog import LATEST, attempt_dirs, parse_dir
from ..format.entries import MANIFEST_NAME, RankRecord, TensorEntry, index_file
from ..format.manifest import Manifest, RankIndex, check_coverage
from ..storage import Storage
from .retention import retention


def abort_file(rank: int) -> str:
    """Name of the marker a rank writes when it will not deliver its files for an attempt."""
    return f"rank-{rank:05d}.abort.json"


class Abandoned(CheckpointError):
    """A rank skipped this checkpoint (back-pressure): it is dropped without an error."""


def write_abort(storage: Storage, dirname: str, rank: int, reason: str, message: str = "") -> None:
    """Tell the committer (and waiting ranks) that ``rank`` will not deliver ``dirname``."""
    storage.makedirs(dirname)
    storage.write_atomic(f"{dirname}/{abort_file(rank)}", json.dumps({"reason": reason, "message": message}).encode())


def _check_aborts(storage: Storage, dirname: str, names: set[str], world_size: int) -> None:
    for rank in range(world_size):
        if abort_file(rank) in names:
            try:
                info = json.loads(storage.read_bytes(f"{dirname}/{abort_file(rank)}"))
            except (ValueError, CheckpointError):
                info = {"reason": "failed", "message": "unreadable abort marker"}
            if info.get("reason") == "skipped":
                raise Abandoned(f"rank {rank} skipped {dirname}")
            raise CheckpointError(f"rank {rank} failed to persist {storage.describe(dirname)}: "
                                  f"{info.get('message', '')}")


def _poll(storage: Storage, dirname: str, timeout: float, done: Callable[[set[str]], bool],
          timed_out: Callable[[set[str]], CheckpointError]) -> None:
    """List ``dirname`` (fresh) with growing pauses (``storage.polling.commit``) until ``done(names)``;
    ``timed_out`` builds the error."""
    deadline = time.monotonic() + timeout
    pauses = storage.polling.commit.pauses()
    while True:
        names = set(storage.listdir(dirname))
        if done(names):
            return
        if time.monotonic() > deadline:
            raise timed_out(names)
        time.sleep(next(pauses))


def wait_for_ranks(storage: Storage, dirname: str, world_size: int, timeout: float) -> None:
    """Block until every rank's index file is in ``dirname``.

    Raises :class:`Abandoned` or :class:`CheckpointError` when a rank wrote an abort marker, and
    :class:`CommitTimeoutError` naming the missing ranks after ``timeout`` seconds.
    """
    wanted = {index_file(r) for r in range(world_size)}

    def done(names: set[str]) -> bool:
        _check_aborts(storage, dirname, names, world_size)
        return wanted <= names

    def timed_out(names: set[str]) -> CheckpointError:
        ranks = sorted(int(n[5:10]) for n in wanted - names)
        return CommitTimeoutError(f"{storage.describe(dirname)}: ranks {ranks} did not report their files within "
                                  f"{timeout:.0f} s; is every rank calling save() for the same steps?")

    _poll(storage, dirname, timeout, done, timed_out)


def wait_for_commit(storage: Storage, dirname: str, world_size: int, timeout: float) -> None:
    """On a rank other than 0: block until rank 0 committed ``dirname`` (or it was abandoned)."""
    def done(names: set[str]) -> bool:
        if MANIFEST_NAME in names:
            return True
        try:
            _check_aborts(storage, dirname, names, world_size)
        except Abandoned:
            return True
        return False

    _poll(storage, dirname, timeout, done, lambda names: CommitTimeoutError(
        f"{storage.describe(dirname)}: rank 0 did not commit within {timeout:.0f} s"))


@dataclass(frozen=True)
class CommitInputs:
    """What rank 0 knows from its own save: everything of the manifest but the rank records."""

    step: int
    world_size: int
    attempt: str
    manifest_body: Callable[[tuple[RankRecord, ...], float], Manifest]

    @staticmethod
    def of_save(step: int, world_size: int, attempt: str, split_threshold: int, tensors: tuple[TensorEntry, ...],
                tree: Any) -> "CommitInputs":
        """The inputs of a save whose manifest has this tensor table and state tree."""
        def body(ranks: tuple[RankRecord, ...], created_at: float) -> Manifest:
            return Manifest(step, world_size, created_at, split_threshold, tensors, tree, ranks, {"attempt": attempt})

        return CommitInputs(step, world_size, attempt, body)


def commit(storage: Storage, dirname: str, inputs: CommitInputs, timeout: float, *,
           on_hint_error: Callable[[CheckpointWarning], None] | None = None) -> Manifest:
    """Wait for all ranks, check their index files, write the manifest, then ``latest``.

    Raises when there is no manifest; once it is written the checkpoint is committed and this
    returns, whatever happens to ``latest`` (see :func:`point_latest`).
    """
    wait_for_ranks(storage, dirname, inputs.world_size, timeout)
    records, indexes = [], []
    for rank in range(inputs.world_size):
        raw = storage.read_bytes(f"{dirname}/{index_file(rank)}")
        where = storage.describe(f"{dirname}/{index_file(rank)}")
        idx = RankIndex.from_json(raw, where)
        if (idx.step, idx.rank, idx.world_size, idx.attempt) != (inputs.step, rank, inputs.world_size, inputs.attempt):
            raise FormatError(f"{where}: written for step {idx.step} attempt {idx.attempt!r} by rank {idx.rank} of "
                              f"{idx.world_size}, expected step {inputs.step} attempt {inputs.attempt!r}")
        indexes.append(idx)
        records.append(RankRecord(rank, idx.data_bytes, len(raw), xxhash.xxh3_64_hexdigest(raw)))
    manifest = inputs.manifest_body(tuple(records), time.time())
    check_coverage(manifest, indexes, lambda r: storage.describe(f"{dirname}/{index_file(r)}"))
    storage.write_atomic(f"{dirname}/{MANIFEST_NAME}", manifest.to_json())
    point_latest(storage, dirname, on_hint_error)
    return manifest


def point_latest(storage: Storage, dirname: str,
                 on_error: Callable[[CheckpointWarning], None] | None = None) -> None:
    """Point the ``latest`` hint at the committed ``dirname`` (atomic, not fsynced).

    The manifest already made the checkpoint visible and decided the save's success; readers find
    checkpoints by listing (docs/FORMAT.md). So a failure here is a :class:`CheckpointWarning`
    handed to ``on_error`` (default: warned where it happens), never a failed save.
    """
    try:
        storage.write_atomic(LATEST, dirname.encode(), durable=False)
    except CheckpointError as e:
        warning = CheckpointWarning(f"{storage.describe(dirname)} is committed, but the hint file "
                                    f"{storage.describe(LATEST)} was not updated ({e}); nothing is lost (readers "
                                    "list the root), it names an older checkpoint until a later save updates it")
        if on_error is not None:
            on_error(warning)
        else:
            warnings.warn(warning, stacklevel=2)


def remove_checkpoint(storage: Storage, dirname: str, marker: str = MANIFEST_NAME) -> None:
    """Delete a checkpoint directory: its commit ``marker`` first, so it stops being one at once."""
    storage.remove(f"{dirname}/{marker}")
    storage.remove(dirname)


def retain(storage: Storage, committed_dir: str, keep_last: int | None, attempt_prefix: str, *,
           marker: str = MANIFEST_NAME, protect: Collection[str] = ()) -> list[str]:
    """After committing ``committed_dir``: drop what it makes obsolete. Returns removed names.

    * committed checkpoints the retention rule drops (save/retention.py: one attempt per step, the
      newest commit, ``committed_dir``, whatever its step, then the highest steps, ``keep_last`` in all);
    * uncommitted attempts of the same step (the new one replaces them), and this job's attempts
      older than it that never committed (rank 0 commits in order, so they never will: a rank
      skipped or failed them).

    Directories named in ``protect`` stay whatever the rules say, and are not counted (multi-level:
    the checkpoint a flush still reads). ``marker`` is the file whose presence is the commit (the
    manifest, or a rank's own marker on a node-local level).
    """
    step, attempt = parse_dir(committed_dir)  # type: ignore[misc]
    removed, committed = [], [committed_dir]
    for name in attempt_dirs(storage):
        if name == committed_dir or name in protect:
            continue
        other_step, other_attempt = parse_dir(name)  # type: ignore[misc]
        if storage.exists(f"{name}/{marker}"):
            committed.append(name)
        elif other_step == step or (other_attempt.startswith(attempt_prefix) and other_attempt < attempt):
            remove_checkpoint(storage, name, marker)
            removed.append(name)
    for name in sorted(retention(committed, keep_last, newest=committed_dir).remove):
        remove_checkpoint(storage, name, marker)
        removed.append(name)
    return removed


def sweep(storage: Storage, marker: str = MANIFEST_NAME) -> list[str]:
    """At start, before any rank writes: remove uncommitted attempts, stale temp files and
    unfinished multipart uploads.

    Call it on one rank only, while no save of this path is in progress (the job's previous
    incarnation is dead). Returns the removed names. ``marker``: the file that commits a directory.
    """
    removed = []
    for name in attempt_dirs(storage):
        if not storage.exists(f"{name}/{marker}"):
            storage.remove(name)
            removed.append(name)
    for tmp in storage.stale_temp_files():
        storage.remove(tmp)
        removed.append(tmp)
    removed += [f"upload:{key}" for key in storage.abort_uploads()]
    return removed
