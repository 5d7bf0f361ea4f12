"""Restore across levels: the newest checkpoint that verifies, from the fastest level that has it.

Order of calls: every rank calls :func:`load_levels` together (it is a collective when there are
several ranks, on the training thread):

1. one all-gather: rank 0 lists the shared levels; each rank lists the node-local level-1 parts
   it holds. Every rank then computes the same candidate list (:func:`candidates`): newest step
   first, the fastest level first on a tie; a node-local level-1 copy only when the ranks hold
   every writer's part between them (written by any number of ranks: the state is resharded);
2. the candidates go to the one restore search (load/search.py): each is read and verified while
   read (never read twice), then one all-gather of "did it verify" moves all ranks to the next
   candidate together when any rank failed: a copy of the same checkpoint on a slower level
   always, another checkpoint only with ``fallback=True``.

A shared level is read as a single-level checkpoint is (load/agreed.py: each rank reads the whole
state, or with the exchange of ``restore_route`` its share, the rest broadcast). A
node-local level 1 holds only this rank's slices (a memory level: its node's ranks' and the
replicas the node received): when each rank's node holds every part, each reads it all itself;
else each writer's part is read and verified by one rank that holds it (the writer itself when it
can: :func:`~ckpt_engine.levels.open.assemblable`), then the ranks exchange the bytes over the
communicator (levels/assemble.py). Either way, what this rank moved is left in ``ml.assembly``.

A node-local checkpoint newer than the one restored of which the ranks hold only some parts (a
node lost with the nodes holding its replicas, or a save the job did not finish) is named, with
the writers whose parts are missing, in a :class:`CheckpointWarning` on every rank
(:func:`partial_warning`): the job does not fall back to an older step without a word.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import xxhash

from ..comm import Comm
from ..errors import CheckpointWarning, CorruptionError, FormatError, NoCheckpointError
from ..format.catalog import manifest_dirs
from ..format.entries import data_file, index_file
from ..format.manifest import RankIndex, check_coverage
from ..load.agreed import Loaded, WholeRead, read_for_rank, read_whole
from ..load.exchange import Exchange
from ..load.open import Opened, open_checkpoint
from ..load.search import Read, Reading, search
from .assemble import Assembly, Parts, read_parts, whole_figures
from .open import RANK_COMMIT, Level, Partial, RankCommit, assemblable, partial

if TYPE_CHECKING:
    from ..storage import Storage
    from .first import FirstLevel


class Levels(Protocol):
    """What a restore reads from: the levels of one ``MultiLevel`` (levels/multilevel.py), fastest first."""

    levels: tuple[Level, ...]
    first: FirstLevel
    """Level 1's committer (levels/first.py): the node-local parts this rank holds, and where it reads them."""
    assembly: Assembly | None
    """Set by :func:`load_levels`: what this rank moved to restore from the node-local level 1
    (``None`` when it restored from a shared level)."""

    def steps(self) -> list[int]:
        """Committed steps this process can see on any level, oldest first."""


@dataclass(frozen=True)
class Candidate:
    """A copy of a checkpoint on one level."""

    level: int
    step: int
    dirname: str
    node_local: bool = False
    readers: tuple[int, ...] = ()
    """Node-local: which rank reads each writer's part."""
    whole: bool = False
    """Node-local: every rank's node holds every writer's part (a memory level), so each reads it all
    itself, with no exchange."""


def candidates(shared: Mapping[int, Sequence[Sequence[Any]]], held: Sequence[Mapping[str, Any]] | None,
               world_size: int, step: int | None = None) -> list[Candidate]:
    """Pure: every copy to try, in order (newest step, then fastest level, then newest attempt).

    ``shared``: per shared level, its ``(step, dirname)`` with a manifest. ``held``: per rank of the
    ``world_size`` restoring, the node-local level-1 parts it can read, ``{writer: [(step, dirname,
    writers), ...]}``; such a copy counts only when every writer's part is held by some rank, however
    many ranks wrote it (:func:`~ckpt_engine.levels.open.assemblable`).
    """
    found = [Candidate(level, int(s), str(d)) for level, dirs in shared.items() for s, d in dirs]
    if held:
        if len(held) != world_size:
            raise ValueError(f"held: {len(held)} views for a world of {world_size} ranks")
        found += [Candidate(0, s, d, True, readers, _whole(held, d, len(readers)))
                  for s, d, readers in assemblable(held)]
    if step is not None:
        found = [c for c in found if c.step == step]
    return sorted(found, key=lambda c: (-c.step, c.level, tuple(-ord(ch) for ch in c.dirname)))


def _whole(held: Sequence[Mapping[str, Any]], dirname: str, writers: int) -> bool:
    """Pure: whether each rank's view holds every writer's part of ``dirname``."""
    return all(any(str(d) == dirname for _, d, _ in view.get(str(w), ())) for view in held for w in range(writers))


def partial_warning(level: str, parts: Sequence[Partial], restored: str) -> str:
    """Pure: what a restore says of the node-local checkpoints newer than the one it restored that
    the ranks hold only in part (``parts``), by step with the missing writers; ``restored``: what it
    did instead (``"restored step 4 from level 2 (/data/run)"``)."""
    steps = sorted({p.step for p in parts})
    by_step = "; ".join(f"step {p.step}: ranks {_ranks(p.missing)} of the {p.writers} that wrote it"
                        for p in sorted(parts, key=lambda p: (p.step, p.dirname)))
    return (f"{level}: step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} skipped, their parts are not "
            f"all on the nodes of this job ({by_step}): each such part was lost with its node and the nodes holding "
            f"its replicas, or never written (a save the job did not finish); {restored}")


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def open_newest_shared(levels: Sequence[Level], world_size: int) -> Loaded:
    """The newest checkpoint of the shared levels (the fastest on a tie), opened, not read; no
    communication (``load_local()`` before any load). :class:`NoCheckpointError` names level 1."""
    shared = {lv.index: manifest_dirs(lv.storage) for lv in levels if not lv.node_local}
    found = candidates(shared, None, world_size)
    if not found:
        raise NoCheckpointError(f"no committed checkpoint at {levels[0].storage.describe('')}")
    storage = levels[found[0].level].storage
    return Loaded(open_checkpoint(storage, found[0].dirname), storage, found[0].level)


def load_levels(ml: Levels, comm: Comm, step: int | None, fallback: bool, threads: int,
                failures: list[str], into: Any = None, exchange: Exchange | None = None, *,
                rank: int | None = None) -> tuple[Any, Loaded]:
    """Every rank: ``(state, loaded)`` of the newest checkpoint (or ``step``) that verifies on all
    ranks (``into`` filled in place from it, when given: load/into.py); see the module docstring.
    The candidates are tried by the one search of load/search.py (which errors fall back, which end
    it); ``exchange``: the route of a shared level's large pieces (load/exchange.py), as on one level.

    ``rank`` given (with a ``LocalComm``): this process alone, as rank ``rank`` (``load()``): the
    shared levels, and the node-local level-1 checkpoints this rank holds every part of (a memory
    level: its node's own and replicas); no word of those it holds in part, which ``restore()`` may
    assemble across ranks. Appends what failed to ``failures``. Raises :class:`NoCheckpointError`
    when no level has one.
    """
    ml.assembly = None
    alone = rank is not None
    rank = comm.rank if rank is None else rank
    found, parts = _agree(ml, comm, step)
    if alone:
        parts = []
    names = ", ".join(level.name for level in ml.levels)
    if not found:
        which = "" if step is None else f" of step {step}"
        message = f"no committed checkpoint{which} on any level ({names}); committed steps: {ml.steps()}"
        if alone and ml.first.level.node_local:
            message += ("; this process alone reads only the checkpoints its node holds whole: restore() (every "
                        "rank together) assembles the node-local ones across the ranks")
        if parts:  # the front ends start afresh on this error: not without a word
            lost = partial_warning(ml.first.level.name, parts, "no other checkpoint to restore")
            warnings.warn(CheckpointWarning(lost), stacklevel=4)
            message += "; " + lost
        raise NoCheckpointError(message)

    def read(c: Candidate) -> Reading[tuple[tuple[Any, Loaded], Assembly | None]]:
        if c.whole:
            return Read(_read_node_whole(ml, c, threads, rank, into))
        if c.node_local:
            mine = read_parts(ml.first.level, ml.first.part_storage, c.step, c.dirname, c.readers, rank)
            return _Assembling(mine, comm, into)
        level = ml.levels[c.level]
        return _Shared(read_whole(level.storage, c.dirname, rank, threads, into=into, exchange=exchange,
                                  level=level.index))

    c, (done, ml.assembly) = search(found, read, comm, rank=rank, fallback=fallback, failures=failures,
                                    where=lambda c: f"{ml.levels[c.level].name} {c.dirname}",
                                    scope=f"on any level ({names})")
    skipped = [p for p in parts if p.step > c.step]
    if skipped:
        warnings.warn(CheckpointWarning(partial_warning(
            ml.first.level.name, skipped, f"restored step {c.step} from {ml.levels[c.level].name}")), stacklevel=4)
    return done


@dataclass(frozen=True)
class _Shared:
    """A shared level's copy, read as one level is read (load/agreed.py): nothing assembled."""

    reading: WholeRead

    @property
    def report(self) -> dict[str, Any]:
        return self.reading.report

    @property
    def collective(self) -> bool:
        return self.reading.collective

    def finish(self, reports: Sequence[dict[str, Any]]) -> tuple[tuple[Any, Loaded], Assembly | None]:
        return self.reading.finish(reports), None


@dataclass(frozen=True)
class _Assembling:
    """A node-local copy whose parts this rank read; the ranks exchange them together (levels/assemble.py)."""

    parts: Parts
    comm: Comm
    into: Any
    collective = True

    @property
    def report(self) -> dict[str, Any]:
        return self.parts.report

    def finish(self, reports: Sequence[dict[str, Any]]) -> tuple[tuple[Any, Loaded], Assembly | None]:
        return self.parts.finish(self.comm, reports, self.into)


def _agree(ml: Levels, comm: Comm, step: int | None) -> tuple[list[Candidate], list[Partial]]:
    """One all-gather: rank 0's view of the shared levels and every rank's node-local commits; the
    candidates, and the node-local checkpoints held only in part (of ``step`` only, when given)."""
    node_local = ml.first.level.node_local
    mine: dict[str, Any] = {"held": ml.first.held() if node_local else {}}
    if comm.rank == 0:
        mine["shared"] = [[level.index, manifest_dirs(level.storage, step)] for level in ml.levels
                          if not level.node_local]
    views = comm.all_gather(mine) if comm.world_size > 1 else [mine]
    shared = {int(i): dirs for i, dirs in views[0]["shared"]}
    held = [v["held"] for v in views] if node_local else None
    parts = [p for p in partial(held) if step is None or p.step == step] if held else []
    return candidates(shared, held, comm.world_size, step), parts


# ---- a node that holds every part -------------------------------------------------------------------
def _read_node_whole(ml: Levels, c: Candidate, threads: int, rank: int,
                     into: Any) -> tuple[tuple[Any, Loaded], Assembly]:
    """Every part of ``c`` is in this rank's node memory: open it from the writers' commits and read
    it as a shared level is read (this rank's share of the state, its own and writer 0's ``local``),
    every byte verified, with no exchange."""
    started = time.perf_counter()
    view = ml.first.node_parts()
    opened = _open_parts(ml, view, c.dirname, len(c.readers))
    state, verified = read_for_rank(view, opened, rank, threads, into=into)
    return (state, Loaded(opened, view, ml.first.level.index, verified)), whole_figures(c.step, opened, rank, started)


def _open_parts(ml: Levels, view: Storage, dirname: str, writers: int) -> Opened:
    """The manifest of ``dirname`` rebuilt from its writers' ``rank-commit.json`` and their index
    files, each index checked against its writer's commit (what ``open_checkpoint`` does with a manifest)."""
    where = view.describe(dirname)
    part = ml.first.part_storage
    commits = [RankCommit.from_json(part(w).read_bytes(f"{dirname}/{RANK_COMMIT}"),
                                    part(w).describe(f"{dirname}/{RANK_COMMIT}")) for w in range(writers)]
    manifest = commits[0].manifest([rc.record for rc in commits], where)
    indexes = []
    for w, rc in enumerate(commits):
        iwhere = view.describe(f"{dirname}/{index_file(w)}")
        raw = view.read_bytes(f"{dirname}/{index_file(w)}")
        if rc.rank != w or len(raw) != rc.record.index_bytes or xxhash.xxh3_64_hexdigest(raw) != rc.record.index_xxh3:
            raise CorruptionError(f"{iwhere}: checksum mismatch (the index file was modified or replaced)")
        idx = RankIndex.from_json(raw, iwhere)
        if (idx.step, idx.rank, idx.world_size, idx.attempt) != (manifest.step, w, manifest.world_size, rc.attempt):
            raise FormatError(f"{iwhere}: belongs to another checkpoint")
        size = view.regular_size(f"{dirname}/{data_file(w)}")
        if size != idx.data_bytes:
            raise CorruptionError(f"{view.describe(f'{dirname}/{data_file(w)}')}: "
                                  f"{'missing' if size is None else f'{size} bytes'}, {idx.data_bytes} expected")
        indexes.append(idx)
    check_coverage(manifest, indexes, lambda w: view.describe(f"{dirname}/{index_file(w)}"))
    return Opened(dirname, manifest, tuple(indexes))
