"""Restore across levels: the newest checkpoint that verifies, from the fastest level that has it.

Order of calls: every rank calls :func:`load_levels` together (it is a collective when there are
several ranks, on the training thread):

1. one all-gather: rank 0 lists the shared levels; each rank lists the node-local level-1 parts
   it holds. Every rank then computes the same candidate list (:func:`candidates`): newest step
   first, the fastest level first on a tie; a node-local level-1 copy only when the ranks hold
   every writer's part between them (written by any number of ranks: the state is resharded);
2. each candidate is read and verified while read (never read twice), then one all-gather of
   "did it verify" moves all ranks to the next candidate together when any rank failed: a copy
   of the same step on a slower level always, an older step only with ``fallback=True``.

A shared level is read as a single-level checkpoint is (each rank reads the whole state). A
node-local level 1 holds only this rank's slices (a memory level: its node's ranks' and the
replicas the node received), so each writer's part is read and verified by one rank that holds
it (the writer itself when it can: :func:`~ckpt_engine.levels.open.assemblable`), then the ranks
exchange the bytes over the communicator in rounds of ``EXCHANGE`` bytes.

A node-local checkpoint newer than the one restored of which the ranks hold only some parts (a
node lost with the nodes holding its replicas, or a save the job did not finish) is named, with
the writers whose parts are missing, in a :class:`CheckpointWarning` on every rank
(:func:`partial_warning`): the job does not fall back to an older step without a word.
"""

from __future__ import annotations

import base64
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import numpy as np
import torch
import xxhash

from ..comm import Comm
from ..errors import (CheckpointError, CheckpointWarning, CorruptionError, FormatError, MismatchError,
                      NoCheckpointError)
from ..format.catalog import manifest_dirs
from ..format.entries import IndexEntry, RankRecord, data_file, index_file
from ..format.manifest import RankIndex, check_coverage
from ..host import headroom
from ..load.agreed import Loaded, local_ranks, read_for_rank
from ..load.into import fill
from ..load.open import Opened, open_checkpoint
from ..load.places import Places, Target, whole_targets
from ..state.decode import decode
from ..state.values import parse_dtype
from .open import RANK_COMMIT, Level, Partial, RankCommit, assemblable, partial
from .transfer import StreamCheck

if TYPE_CHECKING:
    from ..storage import Storage


class Levels(Protocol):
    """What a restore reads from: the levels of one ``MultiLevel`` (levels/multilevel.py), fastest first."""

    levels: tuple[Level, ...]
    fast: Level
    node_local: bool

    def steps(self) -> list[int]:
        """Committed steps this process can see on any level, oldest first."""

    def held(self) -> dict[str, list[tuple[int, str, int]]]:
        """The committed node-local level-1 parts this rank can read now, by writer."""

    def node_parts(self) -> Storage:
        """This node's memory as one checkpoint root."""

    def part_storage(self, writer: int) -> Storage:
        """Where this rank reads ``writer``'s part on the node-local level 1."""

EXCHANGE = 64 << 20
"""Bytes each rank contributes per round when rebuilding the state from node-local copies."""


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


def load_levels(ml: Levels, comm: Comm, step: int | None, fallback: bool, threads: int,
                failures: list[str], into: Any = None) -> tuple[Any, Loaded]:
    """Every rank: ``(state, loaded)`` of the newest checkpoint (or ``step``) that verifies on all
    ranks (``into`` filled in place from it, when given: load/into.py); see the module docstring.

    Appends what failed to ``failures``. Raises :class:`NoCheckpointError` when no level has one.
    """
    found, parts = _agree(ml, comm, step)
    if not found:
        which = "" if step is None else f" of step {step}"
        message = (f"no committed checkpoint{which} on any level ({', '.join(level.name for level in ml.levels)}); "
                   f"committed steps: {ml.steps()}")
        if parts:  # the front ends start afresh on this error: not without a word
            lost = partial_warning(ml.fast.name, parts, "no other checkpoint to restore")
            warnings.warn(CheckpointWarning(lost), stacklevel=4)
            message += "; " + lost
        raise NoCheckpointError(message)
    own_error: Exception | None = None
    for c in found:
        if c.step != found[0].step and not fallback:
            break
        level = ml.levels[c.level]
        try:
            attempt = (_read_node_whole(ml, c, threads, comm.rank, into) if c.whole
                       else _read_local_copy(ml, c, comm.rank) if c.node_local
                       else _read_shared(level, c, threads, comm.rank, into))
            report = attempt.report
        except Exception as e:  # noqa: BLE001 - reported to the other ranks first, so that none waits forever
            own_error, attempt, report = own_error or e, None, {"ok": False, "error": f"rank {comm.rank}: {e}",
                                                                "final": isinstance(e, MismatchError)}
        reports = comm.all_gather(report) if comm.world_size > 1 else [report]
        bad = [r["error"] for r in reports if not r["ok"]]
        if not bad:
            try:
                done = (attempt.finish(comm, reports, into) if c.node_local and not c.whole  # type: ignore[union-attr]
                        else attempt.result)  # type: ignore[union-attr]
            except CheckpointError as e:  # the same on every rank: it depends on the gathered reports only
                own_error, bad = own_error or e, [str(e)]
            else:
                skipped = [p for p in parts if p.step > c.step]
                if skipped:
                    warnings.warn(CheckpointWarning(partial_warning(
                        ml.fast.name, skipped, f"restored step {c.step} from {level.name}")), stacklevel=4)
                return done
        failures.extend(f"{level.name} {c.dirname}: {b}" for b in bad)
        if any(r.get("final") for r in reports):  # the caller's state does not fit: no other copy will
            break
    if own_error is not None:
        raise own_error
    raise CorruptionError("no checkpoint verifies on every rank: " + "; ".join(failures))


def _agree(ml: Levels, comm: Comm, step: int | None) -> tuple[list[Candidate], list[Partial]]:
    """One all-gather: rank 0's view of the shared levels and every rank's node-local commits; the
    candidates, and the node-local checkpoints held only in part (of ``step`` only, when given)."""
    mine: dict[str, Any] = {"held": ml.held() if ml.node_local else {}}
    if comm.rank == 0:
        mine["shared"] = [[level.index, manifest_dirs(level.storage, step)] for level in ml.levels
                          if not level.node_local]
    views = comm.all_gather(mine) if comm.world_size > 1 else [mine]
    shared = {int(i): dirs for i, dirs in views[0]["shared"]}
    held = [v["held"] for v in views] if ml.node_local else None
    parts = [p for p in partial(held) if step is None or p.step == step] if held else []
    return candidates(shared, held, comm.world_size, step), parts


# ---- a shared level ---------------------------------------------------------------------------------
@dataclass
class _Shared:
    result: tuple[Any, Loaded]
    report: dict


def _read_shared(level: Level, c: Candidate, threads: int, rank: int, into: Any) -> _Shared:
    """The state and the ``local`` sections this rank will use (its writer's, writer 0's), verified."""
    opened = open_checkpoint(level.storage, c.dirname)
    state, verified = read_for_rank(level.storage, opened, rank, threads, into=into)
    return _Shared((state, Loaded(opened, level.storage, level.index, verified)), {"ok": True})


# ---- a node that holds every part -------------------------------------------------------------------
def _read_node_whole(ml: Levels, c: Candidate, threads: int, rank: int, into: Any) -> _Shared:
    """Every part of ``c`` is in this rank's node memory: open it from the writers' commits and read
    it as a shared level is read (this rank's share of the state, its own and writer 0's ``local``),
    every byte verified, with no exchange."""
    view = ml.node_parts()
    opened = _open_parts(ml, view, c.dirname, len(c.readers))
    state, verified = read_for_rank(view, opened, rank, threads, into=into)
    return _Shared((state, Loaded(opened, view, ml.fast.index, verified)), {"ok": True})


def _open_parts(ml: Levels, view: Storage, dirname: str, writers: int) -> Opened:
    """The manifest of ``dirname`` rebuilt from its writers' ``rank-commit.json`` and their index
    files, each index checked against its writer's commit (what ``open_checkpoint`` does with a manifest)."""
    where = view.describe(dirname)
    commits = [RankCommit.from_json(ml.part_storage(w).read_bytes(f"{dirname}/{RANK_COMMIT}"),
                                    ml.part_storage(w).describe(f"{dirname}/{RANK_COMMIT}")) for w in range(writers)]
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


# ---- a node-local level 1 -----------------------------------------------------------------------------
@dataclass
class _LocalCopy:
    """The verified parts of a node-local checkpoint this rank read (``parts``: by writer), before the exchange."""

    level: Level
    candidate: Candidate
    rank: int
    parts: dict[int, np.ndarray]
    report: dict

    def finish(self, comm: Comm, reports: Sequence[dict], into: Any = None) -> tuple[Any, Loaded]:
        """Build the manifest from every writer's part as its reader reported it, then exchange the
        bytes and decode (or fill ``into``: load/into.py)."""
        dirname, readers = self.candidate.dirname, self.candidate.readers
        where = self.level.storage.describe(dirname)
        told = [reports[reader]["parts"][str(w)] for w, reader in enumerate(readers)]
        rc = RankCommit.from_json(base64.b64decode(told[0]["commit"]), f"{where} (writer 0's {RANK_COMMIT})")
        records = [RankRecord(w, *part["record"]) for w, part in enumerate(told)]
        manifest = rc.manifest(records, where)
        indexes = tuple(RankIndex.from_json(part["index"].encode(), f"{where} ({index_file(w)})")
                        for w, part in enumerate(told))
        for w, idx in enumerate(indexes):
            expected = (manifest.step, w, manifest.world_size, rc.attempt)
            if (idx.step, idx.rank, idx.world_size, idx.attempt) != expected:
                raise FormatError(f"{where}: {index_file(w)} of writer {w} belongs to another checkpoint")
        check_coverage(manifest, indexes, lambda w: f"{where} ({index_file(w)})")
        keep = local_ranks(self.rank, manifest.world_size)
        local_tensors = {w: [torch.empty(t.shape, dtype=parse_dtype(t.dtype)) for t in indexes[w].local_tensors]
                         for w in keep}
        streams = [[w for w, reader in enumerate(readers) if reader == r] for r in range(comm.world_size)]
        mine = [self.parts[w] for w in streams[self.rank]]
        length = max(sum(indexes[w].data_bytes for w in ws) for ws in streams)

        def read(wanted: Sequence[Target]) -> None:
            places = Places(manifest.tensors, wanted)
            targets = [_targets(idx, places, local_tensors.get(idx.rank)) for idx in indexes]
            for k in range(-(-length // EXCHANGE)):  # every rank takes part in every round, whatever it keeps
                lo = k * EXCHANGE
                for r, part in enumerate(_gather_bytes(comm, _cut(mine, lo, lo + EXCHANGE))):
                    base = 0
                    for w in streams[r]:
                        size = indexes[w].data_bytes
                        if lo < base + size and lo + len(part) > base:
                            _place(targets[w], lo - base, part)
                        base += size
            for idx_targets in targets:
                for _, _, _, entry, temp in idx_targets:
                    if temp is not None:
                        places.scatter(entry, temp)

        if into is not None:
            state = fill(into, manifest, where, read)
        else:
            whole = whole_targets(manifest.tensors)
            read(whole)
            state = decode(manifest.state, lambda i: whole[i].out, count=len(whole), where=where)
        locals_ = {w: decode(indexes[w].local, local_tensors[w].__getitem__, count=len(local_tensors[w]),
                             where=f"{where} ({index_file(w)})") for w in keep}
        opened = Opened(dirname, manifest, indexes)
        return state, Loaded(opened, self.level.storage, self.level.index, locals_, node_local=True)


def _cut(parts: Sequence[np.ndarray], lo: int, hi: int) -> np.ndarray:
    """Bytes ``[lo, hi)`` of the parts laid end to end (a rank's stream in the exchange)."""
    pieces, base = [], 0
    for data in parts:
        a, b = max(lo, base), min(hi, base + len(data))
        if a < b:
            pieces.append(data[a - base:b - base])
        base += len(data)
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.empty(0, dtype=np.uint8)


def _read_local_copy(ml: Levels, c: Candidate, rank: int) -> _LocalCopy:
    """Read and verify the parts this rank reads for ``c``: each one's marker, index and whole data file."""
    parts, told = {}, {}
    for writer, reader in enumerate(c.readers):
        if reader == rank:
            parts[writer], told[str(writer)] = _read_part(ml.part_storage(writer), c.dirname, writer)
    return _LocalCopy(ml.fast, c, rank, parts, {"ok": True, "parts": told})


def _read_part(storage: Storage, dirname: str, writer: int) -> tuple[np.ndarray, dict]:
    """One writer's part of ``dirname`` on a node-local level, verified in one pass, and its report."""
    marker_raw = storage.read_bytes(f"{dirname}/{RANK_COMMIT}")
    rc = RankCommit.from_json(marker_raw, storage.describe(f"{dirname}/{RANK_COMMIT}"))
    where = storage.describe(f"{dirname}/{index_file(writer)}")
    raw = storage.read_bytes(f"{dirname}/{index_file(writer)}")
    if len(raw) != rc.record.index_bytes or xxhash.xxh3_64_hexdigest(raw) != rc.record.index_xxh3 \
            or rc.rank != writer:
        raise CorruptionError(f"{where}: checksum mismatch (the index file was modified or replaced)")
    idx = RankIndex.from_json(raw, where)
    data_where = storage.describe(f"{dirname}/{data_file(writer)}")
    size = storage.regular_size(f"{dirname}/{data_file(writer)}")
    if size != idx.data_bytes:
        raise CorruptionError(f"{data_where}: {'missing' if size is None else f'{size} bytes'}, "
                              f"{idx.data_bytes} expected (truncated or replaced)")
    headroom.refuse_beyond([(f"the part of writer {writer}", idx.data_bytes)], data_where, f"reading step {idx.step}")
    data = np.empty(idx.data_bytes, dtype=np.uint8)
    check = StreamCheck(idx, data_where)
    with storage.reader(f"{dirname}/{data_file(writer)}") as reader:
        view = memoryview(data)
        reader.read_into(0, view)
        check.feed(view)
    check.finish()
    return data, {"record": [idx.data_bytes, len(raw), rc.record.index_xxh3], "index": raw.decode(),
                  "commit": base64.b64encode(marker_raw).decode() if writer == 0 else None}


_Target = tuple[int, int, Any, IndexEntry, "torch.Tensor | None"]
"""Where one entry's bytes go: (offset in the sender's data file, byte count, destination bytes,
the entry, the temporary to scatter from afterwards or ``None`` when read in place)."""


def _targets(idx: RankIndex, places: Places, local: Sequence[torch.Tensor] | None) -> list[_Target]:
    """The sender's entries this rank keeps (those meeting ``places``; its locals if kept), by offset."""
    out: list[_Target] = []
    for e in sorted(idx.entries, key=lambda e: e.offset):
        if e.local:
            if local is None:
                continue
            t = local[e.tensor]
            dest = t.reshape(-1).view(torch.uint8).numpy()[e.start * t.element_size():e.stop * t.element_size()]
            out.append((e.offset, e.nbytes, dest, e, None))
        elif places.needed(e):
            view, temp = places.destination(e)
            out.append((e.offset, e.nbytes, np.frombuffer(view, dtype=np.uint8), e, temp))
    return out


def _place(targets: Sequence[_Target], lo: int, part: np.ndarray) -> None:
    """Copy the part of bytes ``[lo, lo + len(part))`` of a sender's file into the entries it overlaps."""
    hi = lo + len(part)
    for offset, nbytes, dest, _, _ in targets:
        start, stop = max(offset, lo), min(offset + nbytes, hi)
        if start < stop:
            dest[start - offset:stop - offset] = part[start - lo:stop - lo]


def _gather_bytes(comm: Comm, data: np.ndarray) -> list[np.ndarray]:
    """Every rank's ``data`` (uint8, any lengths), by rank: tensors when the communicator can
    (``all_gather_tensor``), else base64 over its JSON all-gather (slow, but any ``Comm`` works)."""
    if comm.world_size == 1:
        return [data]
    gather = getattr(comm, "all_gather_tensor", None)
    if gather is not None:
        tensor = torch.from_numpy(np.ascontiguousarray(data)) if len(data) else torch.empty(0, dtype=torch.uint8)
        return [t.numpy() for t in gather(tensor)]
    texts = comm.all_gather(base64.b64encode(data.tobytes()).decode())
    return [np.frombuffer(base64.b64decode(t), dtype=np.uint8) for t in texts]
