"""Multi-level persistence: the levels of a checkpointer, fastest first, opened and checked together.

Level 1 (the fast one, e.g. a node-local NVMe or RAM disk) receives the saves; every lower level
(a parallel filesystem, an object store) receives copies from the flushers (flush.py). At start,
in a few collectives on the training thread, the ranks find out whether level 1 is **shared**
(every rank sees rank 0's probe file there) or **node-local**:

* shared: level 1 has the ordinary layout and commit (rank 0 writes the manifest), exactly as a
  single-level checkpointer would;
* node-local: no process sees all of it, so each rank keeps its own files below
  ``rank-NNNNN/`` and commits them itself with a sealed ``rank-commit.json`` (its index file's
  checksum plus the manifest body rank 0 would write, without the rank table). The job-wide
  commit that counts is the one on the shared lower level; a restore uses level 1 only when the
  ranks hold every writer's part of the checkpoint between them, however many ranks wrote it
  (levels/restore.py).

Every lower level must be shared (rank 0 commits there), which the same probe checks.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import xxhash

from ..agree import on_rank0
from ..comm import Comm
from ..config import LevelSpec
from ..errors import CheckpointError, FormatError
from ..format.catalog import manifest_dirs, split_dir
from ..format.entries import MANIFEST_NAME, RankRecord, data_file, index_file
from ..format.manifest import Manifest, RankIndex, seal, unseal
from ..format.strict_json import parse_json
from ..save.commit import sweep
from ..storage import Storage, open_storage
from .flush import FLUSHING
from .memory import NodeTable, claim, in_memory_fs, job_tag, node_dir, node_key, sweep_dead_jobs

RANK_COMMIT = "rank-commit.json"
"""On a node-local level 1: a rank's own commit of its files, written last."""
_PROBE = ".tmp-probe-"
_RANK_DIR = re.compile(r"rank-\d{5,}")


def rank_dir(rank: int) -> str:
    """The directory of ``rank``'s own files on a node-local level 1."""
    return f"rank-{rank:05d}"


def level_storage(spec: LevelSpec) -> Storage:
    """The level's storage (a ``Storage`` given in code is used as it is)."""
    return spec.path if isinstance(spec.path, Storage) else open_storage(spec.path, dict(spec.storage_options))


@dataclass(frozen=True)
class Level:
    """One opened level: ``storage`` is where this rank reads and writes it (node-local: its own subtree)."""

    index: int
    storage: Storage
    keep_last: int | None
    node_local: bool = False

    @property
    def marker(self) -> str:
        """The file whose presence commits a directory on this level."""
        return RANK_COMMIT if self.node_local else MANIFEST_NAME

    @property
    def name(self) -> str:
        """How messages name it: ``level 1 (/local/run)``."""
        return f"level {self.index + 1} ({self.storage.describe('').rstrip('/')})"


# ---- a rank's own commit on a node-local level ------------------------------------------------------
@dataclass(frozen=True)
class RankCommit:
    """``rank-commit.json``: one rank's files of one checkpoint are complete on a node-local level."""

    step: int
    rank: int
    world_size: int
    attempt: str
    created_at: float
    record: RankRecord
    body: dict
    """The manifest body without ``ranks`` (tensor table, state tree, ...): the same on every rank."""

    def to_json(self) -> bytes:
        doc = {"format_version": 1, "step": self.step, "rank": self.rank, "world_size": self.world_size,
               "attempt": self.attempt, "created_at": self.created_at, "data_bytes": self.record.data_bytes,
               "index_bytes": self.record.index_bytes, "index_xxh3": self.record.index_xxh3, "manifest": self.body}
        return seal(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())

    @staticmethod
    def from_json(raw: bytes, where: str) -> "RankCommit":
        """Check the seal and fields; :class:`FormatError` / ``CorruptionError`` name ``where``."""
        d = parse_json(unseal(raw, where), where)
        try:
            record = RankRecord(d["rank"], d["data_bytes"], d["index_bytes"], d["index_xxh3"])
            rc = RankCommit(d["step"], d["rank"], d["world_size"], d["attempt"], float(d["created_at"]), record,
                            d["manifest"])
        except (ValueError, KeyError, TypeError, OverflowError) as e:
            raise FormatError(f"{where}: not a rank commit ({type(e).__name__}: {e})") from None
        if d.get("format_version") != 1 or not isinstance(rc.body, dict) or rc.body.get("step") != rc.step:
            raise FormatError(f"{where}: unknown format_version or inconsistent fields")
        return rc

    def manifest(self, records: Sequence[RankRecord], where: str) -> Manifest:
        """The job-wide manifest, once every rank's record is known (validated like a read one)."""
        ranks = [asdict(r) | {"data_file": data_file(r.rank), "index_file": index_file(r.rank)} for r in records]
        body = dict(self.body, ranks=ranks)
        return Manifest.from_json(seal(json.dumps(body, separators=(",", ":"), allow_nan=False).encode()), where)


def write_rank_commit(storage: Storage, dirname: str, rank: int, template: Manifest,
                      written: tuple[bytes, int] | None = None) -> RankCommit:
    """After ``rank``'s data and index files of ``dirname`` are durable: commit them on this rank.
    ``written``: the index file's bytes and the data file's size, as persist just wrote them (else the
    index is read back and parsed: 1.4 ms for 306 entries, at every save of a memory level)."""
    if written is None:
        raw = storage.read_bytes(f"{dirname}/{index_file(rank)}")
        written = raw, RankIndex.from_json(raw, storage.describe(f"{dirname}/{index_file(rank)}")).data_bytes
    raw, data_bytes = written
    body = template.body()
    body.pop("ranks")
    attempt = split_dir(dirname)[1]
    rc = RankCommit(template.step, rank, template.world_size, attempt, template.created_at,
                    RankRecord(rank, data_bytes, len(raw), xxhash.xxh3_64_hexdigest(raw)), body)
    storage.write_atomic(f"{dirname}/{RANK_COMMIT}", rc.to_json())
    return rc


def local_catalog(storage: Storage) -> list[tuple[int, str, int]]:
    """This rank's committed directories on a node-local level: ``(step, dirname, writers)``, sorted."""
    out = []
    for step, name in manifest_dirs(storage, marker=RANK_COMMIT):
        try:
            rc = RankCommit.from_json(storage.read_bytes(f"{name}/{RANK_COMMIT}"), storage.describe(name))
        except CheckpointError:
            continue  # damaged: never a candidate
        out.append((step, name, rc.world_size))
    return out


def complete_everywhere(catalogs: Sequence[Sequence[Sequence[Any]]], world_size: int) -> list[tuple[int, str]]:
    """Pure: the ``(step, dirname)`` every rank committed on its node-local level, by the same writers' world."""
    common: set[tuple[int, str]] | None = None
    for cat in catalogs:
        mine = {(int(s), str(d)) for s, d, w in cat if int(w) == world_size}
        common = mine if common is None else common & mine
    return sorted(common or set())


# ---- opening ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Opening:
    """What :func:`open_levels` agreed on with the other ranks."""

    levels: tuple[Level, ...]
    generation: str
    complete: tuple[tuple[int, str], ...]
    """Node-local level 1: the checkpoints the ranks can assemble from it (at start), written by any
    number of ranks."""
    recover: tuple[tuple[int, str] | None, ...]
    """Per lower level: the newest level-1 checkpoint it lacks, ``(step, dirname)`` (a flush a crash
    cut short), to flush again."""
    memory: NodeMemory | None = None
    """Level 1 is the node's memory: where, and which node each rank is on."""


@dataclass(frozen=True)
class NodeMemory:
    """A memory level 1 as opened (levels/memory.py)."""

    node: Storage
    """This node's directory: every rank's part this node holds, below ``rank-NNNNN/``."""
    nodes: NodeTable
    """Which node each rank is on."""


def open_levels(specs: Sequence[LevelSpec], comm: Comm, new_generation: Callable[[], str]) -> Opening:
    """Open every level on every rank (a collective: broadcast, all-gather, broadcast).

    Rank 0 writes a probe file on every level; each rank reports which it sees (and, with a
    memory level, its node and the parts its node holds). Then the sweeps (rank 0 on shared
    levels, each rank on its own node-local files) and the stale ``flushing`` decisions are
    removed before the last collective, so no rank writes anything before that.
    """
    rank, world = comm.rank, comm.world_size
    memory = specs[0].memory
    key = node_key() if memory else ""
    storages = [open_memory(specs, rank, key) if i == 0 and memory else level_storage(s) for i, s in enumerate(specs)]
    for i, s in enumerate(storages):
        if s.protocol == "memory" and world > 1:
            raise CheckpointError(f"levels[{i}] ({s.describe('')}): memory:// lives in one process and cannot hold "
                                  f"a checkpoint of {world} ranks; use a filesystem or object store")
    generation = on_rank0(comm, lambda: _create_roots(storages, world, new_generation()))
    shared, held = [True] * len(storages), [held_catalog(storages[0], rank, memory)]
    keys = [key]
    if world > 1:
        seen = [s.exists(f"{_PROBE}{generation}") for s in storages]
        views = comm.all_gather({"seen": seen, "held": held[0], "node": key})
        shared = [all(v["seen"][i] for v in views) for i in range(len(storages))]
        held, keys = [v["held"] for v in views], [v["node"] for v in views]
        if rank == 0:
            for s in storages:
                s.remove(f"{_PROBE}{generation}")
        unseen = [i for i in range(1, len(storages)) if not shared[i]]
        if unseen:
            i = unseen[0]
            blind = [r for r, v in enumerate(views) if not v["seen"][i]]
            raise CheckpointError(f"levels[{i}] ({storages[i].describe('')}): ranks {blind} do not see rank 0's files "
                                  "there; every level after the first must be storage all ranks share")
    node_local = memory or not shared[0]
    nodes = NodeTable.of(keys) if memory else None
    levels = tuple(Level(i, s.child(rank_dir(rank)) if i == 0 and node_local else s, spec.keep_last,
                         i == 0 and node_local) for i, (s, spec) in enumerate(zip(storages, specs)))
    if node_local:
        levels[0].storage.makedirs("")
        sweep(levels[0].storage, RANK_COMMIT)
    if nodes is not None:
        for senders in nodes.sources(rank, specs[0].replicas):
            for sender in senders:  # replicas this rank receives: what a crash left half-written
                sweep(storages[0].child(rank_dir(sender)), RANK_COMMIT)
    complete = [(s, d) for s, d, _ in assemblable(held)] if node_local else []
    own = complete_everywhere([v.get(str(r), []) for r, v in enumerate(held)], world) if node_local else []
    # Also: every sweep is done before any rank writes (rank 0's failure is raised on every rank).
    recover = on_rank0(comm, lambda: _sweep_shared(levels, node_local, own, world))
    again = tuple(None if r is None else (int(r[0]), str(r[1])) for r in recover)  # broadcast: lists
    return Opening(levels, generation, tuple((int(s), str(d)) for s, d in complete), again,
                   NodeMemory(storages[0], nodes) if nodes is not None else None)


def open_memory(specs: Sequence[LevelSpec], rank: int, node: str) -> Storage:
    """This node's directory of the memory level ``specs[0]``: dead jobs' memory on this node swept
    first, then claimed by this process (levels/memory.py)."""
    spec = specs[0]
    job = job_tag(spec, specs[1:])
    sweep_dead_jobs(spec.location, job, node)
    path = node_dir(spec, job, node)
    try:
        claim(path, rank)
    except OSError as e:
        raise CheckpointError(f"memory level: cannot create {path} ({e}); name a writable tmpfs directory as the "
                              "level's 'path'") from e
    storage = open_storage(path)
    storage.in_memory = in_memory_fs(path)
    return storage


def held_catalog(node: Storage, rank: int, memory: bool) -> dict[str, list[tuple[int, str, int]]]:
    """The committed parts this rank can read on a node-local level 1, by writer (as text, for JSON):
    on a memory level every ``rank-NNNNN/`` of its node (its own, its node's ranks', the replicas
    it received); else its own."""
    if not memory:
        return {str(rank): local_catalog(node.child(rank_dir(rank)))}
    out = {}
    for name in node.listdir(""):
        if _RANK_DIR.fullmatch(name):
            out[str(int(name[5:]))] = local_catalog(node.child(name))
    return out


def assemblable(held: Sequence[Mapping[str, Sequence[Sequence[Any]]]]) -> list[tuple[int, str, tuple[int, ...]]]:
    """Pure: the checkpoints the ranks of this job can assemble from what they hold, with who reads each writer's part.

    ``held[r]``: what rank ``r`` of this job holds, ``{writer: [(step, dirname, writers), ...]}``, where
    ``writers`` is how many ranks wrote the checkpoint: any number, so that a job restarted on fewer
    or more ranks (nodes lost, nodes added) restores from what the surviving nodes hold and reshards
    it. A checkpoint counts when every writer ``0..writers-1`` of it is held by some rank. Its reader
    of writer ``w`` is ``w`` itself when that rank holds it, else the holder with the fewest parts to
    read so far (the lowest rank on a tie). Sorted by step.
    """
    out = []
    for (step, dirname, writers), by_writer in _holders(held):
        if len(by_writer) != writers:
            continue
        load = [0] * len(held)
        readers = []
        for w in range(writers):
            have = by_writer[w]
            reader = w if w in have else min(have, key=lambda r: (load[r], r))
            load[reader] += 1
            readers.append(reader)
        out.append((step, dirname, tuple(readers)))
    return out


@dataclass(frozen=True)
class Partial:
    """A checkpoint of a node-local level 1 of which the ranks of this job hold only some parts."""

    step: int
    dirname: str
    writers: int
    """How many ranks wrote it."""
    missing: tuple[int, ...]
    """The writers whose part no rank of this job holds."""


def partial(held: Sequence[Mapping[str, Sequence[Sequence[Any]]]]) -> list[Partial]:
    """Pure: the checkpoints some rank holds a part of that cannot be assembled (``held`` as in
    :func:`assemblable`): each part of a writer lost with its node and the nodes its replicas were on,
    or never written (a save the job did not finish). Sorted by step."""
    return [Partial(step, dirname, writers, tuple(w for w in range(writers) if w not in by_writer))
            for (step, dirname, writers), by_writer in _holders(held) if len(by_writer) != writers]


def _holders(held: Sequence[Mapping[str, Sequence[Sequence[Any]]]]
             ) -> list[tuple[tuple[int, str, int], dict[int, list[int]]]]:
    """Pure: per ``(step, dirname, writers)``, sorted, which ranks hold each writer's part."""
    holders: dict[tuple[int, str, int], dict[int, list[int]]] = {}
    for r, view in enumerate(held):
        for writer, cat in view.items():
            for s, d, w in cat:
                if 0 <= int(writer) < int(w):
                    holders.setdefault((int(s), str(d), int(w)), {}).setdefault(int(writer), []).append(r)
    return sorted(holders.items())


def _create_roots(storages: Sequence[Storage], world: int, generation: str) -> str:
    """Rank 0: create every level's root and, with several ranks, a probe file each rank looks for."""
    for s in storages:
        s.makedirs("")
        if world > 1:
            s.write_atomic(f"{_PROBE}{generation}", b"", durable=False)
    return generation


def _sweep_shared(levels: Sequence[Level], node_local: bool, complete: Sequence[tuple[int, str]],
                  world: int) -> list[tuple[int, str] | None]:
    """Rank 0: sweep the shared levels, drop stale ``flushing`` decisions; per lower level, the
    checkpoint to flush again (see :func:`_to_recover`)."""
    for level in levels if not node_local else levels[1:]:
        sweep(level.storage)
    for level in levels[1:]:
        level.storage.remove(FLUSHING)
    return [_to_recover(levels[0], level, complete, world) for level in levels[1:]]


def _to_recover(fast: Level, lower: Level, complete: Sequence[tuple[int, str]],
                world: int) -> tuple[int, str] | None:
    """The newest checkpoint of level 1, ``(step, dirname)``, when ``lower`` has no checkpoint of that
    step and it was written by this many ranks (each rank copies its own files)."""
    if fast.node_local:
        newest = max(complete, default=None)
    else:
        found = manifest_dirs(fast.storage)
        newest = found[-1] if found else None
        if newest is not None:
            try:
                manifest = Manifest.from_json(fast.storage.read_bytes(f"{newest[1]}/{MANIFEST_NAME}"), newest[1])
            except CheckpointError:
                return None
            if manifest.world_size != world:
                return None
    below = manifest_dirs(lower.storage)
    if newest is None or (below and below[-1][0] >= newest[0]):
        return None
    return newest
