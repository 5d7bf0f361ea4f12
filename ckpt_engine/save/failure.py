"""A failed save: what it leaves behind, who removes it, making room on a full disk, reporting it.

Why this matters: a save that fails half-way leaves a partial data file, and other ranks' whole
files, in an attempt directory that will never commit. Left until the next successful commit,
those bytes can keep a full disk full, so that no later save ever commits again.

Who removes what (one shared root, ``world_size`` ranks, coordination through storage only, as for
the commit; every function here runs on a rank's persist thread):

* a rank whose own write fails removes its own data file of that attempt at once, when its index
  file is not there (so the attempt can no longer commit), *then* writes its abort marker: its
  space is free before anyone acts on the marker (:func:`discard_rank`);
* rank 0, the committer, knows an attempt is *dead* when it will not commit it (its own write
  failed, a rank aborted or skipped, the commit timed out or failed with no manifest written).
  Once the attempt is *settled*, every rank's index file or abort marker present so that no rank
  writes there any more, rank 0 removes every rank's data and index files. The abort markers stay
  (a few bytes: ranks may still be waiting on them) until the next commit's retention or the next
  start's sweep removes the directory; with one rank the directory goes at once. An attempt not
  settled yet is looked at again before each later job of rank 0 (:func:`discard_attempt`);
* a rank whose write finds the storage full (``ENOSPC``/``EDQUOT``), when ``keep_last`` is set on a
  single-level checkpointer, removes the committed checkpoints that this save's commit would remove
  anyway (the retention rule, save/retention.py, with this save counted: never the newest), then writes once more
  (:func:`make_room`). Without ``keep_last`` nothing committed is deleted: the user asked to keep all.
  Multi-level checkpointers do not make room (level 1 keeps what the flushers still need).

Nothing here deletes a directory that holds a manifest, except :func:`make_room` as said.
"""

from __future__ import annotations

import errno
import warnings
from typing import Literal, Sequence, Union

from ..errors import CheckpointError, CheckpointWarning, DiskFullError
from ..format.catalog import manifest_dirs
from ..format.entries import MANIFEST_NAME, data_file, index_file
from ..storage import Storage
from .commit import abort_file, remove_checkpoint
from .retention import retention

Report = Union[BaseException, CheckpointWarning]
"""What the persist thread hands to the training thread: a failed save, or a warning."""

_FULL = {errno.ENOSPC, errno.EDQUOT}


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) says the storage is full."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, DiskFullError) or (isinstance(e, OSError) and e.errno in _FULL):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def disk_full(storage: Storage, error: BaseException, step: int, nbytes: int, keep_last: int | None) -> DiskFullError:
    """``error`` restated for the user: what was written, the bytes needed and free, what to do."""
    if isinstance(error, DiskFullError):
        return error
    free = storage.free_bytes()
    room = (f"{free} bytes free there" if free is not None
            else f"the bytes free there are unknown on {storage.protocol}://")
    advice = ("set keep_last so that older checkpoints make room" if keep_last is None
              else f"lower keep_last (now {keep_last}: the {keep_last - 1} newest checkpoints and this one must fit)"
              if keep_last > 1 else "use a larger disk (keep_last=1 already keeps only the newest)")
    full = DiskFullError(f"{error}: the storage is full; this rank's part of step {step} needs {nbytes} bytes, "
                         f"{room} ({storage.describe('')}). Nothing was committed and this save's partial files "
                         f"are removed; free space there or {advice}")
    full.__cause__ = error
    return full


def discard_rank(storage: Storage, dirname: str, rank: int) -> bool:
    """This rank's files of ``dirname`` after its write failed, when its index file is absent.

    Without its index file the attempt cannot commit (and this rank will not write it any more),
    so its data file is garbage. With the index there (it failed later, e.g. after a commit) nothing
    is touched. Returns whether the files were removed; storage errors leave them (best effort).
    """
    try:
        if storage.exists(f"{dirname}/{index_file(rank)}"):
            return False
        storage.remove(f"{dirname}/{data_file(rank)}")
    except CheckpointError:
        return False
    return True


def settled(names: Sequence[str] | set[str], world_size: int) -> bool:
    """Whether every rank left its final word in an attempt: its index file or its abort marker."""
    have = set(names)
    return all(index_file(r) in have or abort_file(r) in have for r in range(world_size))


def discard_attempt(storage: Storage, dirname: str, world_size: int) -> bool:
    """Rank 0: remove every rank's files of the dead attempt ``dirname`` once it is settled.

    Returns ``True`` when nothing is left to do (removed, already gone, or committed after all: a
    manifest there is never touched), ``False`` when some rank has not finished with it yet (call
    again later). Abort markers stay for ranks still waiting on them, except with one rank, where
    the whole directory goes.
    """
    try:
        names = set(storage.listdir(dirname))
        if MANIFEST_NAME in names:
            return True
        if world_size == 1:  # nobody else writes there or waits on it
            storage.remove(dirname)
            return True
        if not names:  # gone: removed by retention meanwhile
            return True
        if not settled(names, world_size):
            return False
        for rank in range(world_size):
            for name in (data_file(rank), index_file(rank)):
                if name in names:
                    storage.remove(f"{dirname}/{name}")
    except CheckpointError:
        return False
    return True


def make_room(storage: Storage, keep_last: int, marker: str = MANIFEST_NAME) -> list[str]:
    """Under ``ENOSPC``: remove the committed checkpoints the next commit would remove anyway.

    The retention rule (save/retention.py) with the save being written counted: the newest commit
    and the highest other steps, ``keep_last - 1`` in all (at least the newest commit, always), one
    attempt per step. Removal is the commit's way (manifest first). Any rank may call it (deletions
    are idempotent, and follow the same rule as rank 0's retention). Returns the directories removed.
    """
    committed = [name for _, name in manifest_dirs(storage, marker=marker)]
    removed = sorted(retention(committed, keep_last, writing=True).remove)
    for name in removed:
        remove_checkpoint(storage, name, marker)
    return removed


def as_checkpoint_error(error: BaseException) -> CheckpointError:
    """A background failure as the engine's error family (the original kept as the cause)."""
    if isinstance(error, CheckpointError):
        return error
    wrapped = CheckpointError(f"background persist failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def surface(reports: Sequence[Report], on_error: Literal["raise", "warn"], stacklevel: int = 2) -> None:
    """On the training thread: report what the persist thread found, in order.

    A warning is warned. A failed save is its own :class:`CheckpointWarning` with ``on_error="warn"``
    (each one, so three failures are three warnings), or raised with ``on_error="raise"``: the caller
    passes the reports up to the earliest failure only, so each call raises the next unreported one.
    """
    for item in reports:
        if isinstance(item, Warning):
            warnings.warn(item, stacklevel=stacklevel + 1)
        elif on_error == "warn":
            warnings.warn(f"checkpoint not saved: {as_checkpoint_error(item)}", CheckpointWarning,
                          stacklevel=stacklevel + 1)
        else:
            raise as_checkpoint_error(item)
