"""Assembling a checkpoint from the parts the ranks hold on a node-local level 1, once levels/restore.py
chose it and no rank's node holds every part.

Each writer's part is read and verified whole by one rank that holds it, its *reader*
(:func:`~ckpt_engine.levels.open.assemblable`): :func:`read_parts`, on every rank, before the
ranks agree that every part verified. Then :meth:`Parts.finish` rebuilds the manifest from what
the readers reported and exchanges the bytes: in rounds, every rank contributes the next
``EXCHANGE`` bytes of its *stream* (the parts it read, end to end) to one all-gather
(:func:`round_sizes`: the longest contribution of each round, to which the all-gather pads), and
keeps what it needs: the whole replicated state, resharded whatever the number of writers, and
the ``local`` of its own writer and of writer 0. :class:`Assembly` says what a rank moved.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
import xxhash

from ..comm import Comm
from ..errors import CorruptionError, FormatError
from ..format.entries import IndexEntry, RankRecord, data_file, index_file
from ..format.manifest import RankIndex, check_coverage
from ..host import headroom
from ..load.agreed import Loaded, local_ranks
from ..load.into import fill
from ..load.open import Opened
from ..load.places import Places, Target, whole_targets
from ..state.decode import decode
from ..state.values import parse_dtype
from .open import RANK_COMMIT, Level, RankCommit
from .transfer import StreamCheck

if TYPE_CHECKING:
    from ..storage import Storage

EXCHANGE = 64 << 20
"""Bytes each rank contributes per round when rebuilding the state from node-local copies."""


@dataclass(frozen=True)
class Assembly:
    """What one rank did to restore a node-local checkpoint (``MultiLevel.assembly``)."""

    step: int
    writers: int
    """How many ranks wrote the checkpoint (the ranks restoring it may be fewer or more)."""
    whole: bool
    """Every rank's node held every part: each read it all itself, nothing was exchanged."""
    read: int
    """Bytes this rank read from its node's memory: the parts it read (exchange), or the state and
    the ``local`` sections it uses (whole)."""
    sent: int
    """Bytes of this rank's stream: what it contributed to the exchange."""
    received: int
    """Bytes of the other ranks' streams that reached this rank."""
    wire: int
    """Bytes an all-gather in a ring moves into this rank (and out of it): per round, the other
    ranks' contributions padded to the longest one (see :func:`round_sizes`)."""
    rounds: int
    seconds: float
    """From reading the first part to the state decoded (after the choice)."""


def round_sizes(streams: Sequence[int], chunk: int = EXCHANGE) -> list[int]:
    """Pure: the longest contribution of each round of the exchange, for ranks whose streams are
    ``streams`` bytes long: every rank takes part in every round (its contribution possibly empty)
    until the longest stream has gone through, ``chunk`` bytes a round."""
    longest = max(streams, default=0)
    return [max(min(chunk, max(0, s - lo)) for s in streams) for lo in range(0, longest, chunk)]


@dataclass
class Parts:
    """The verified parts of a node-local checkpoint this rank read (``parts``: by writer), before the exchange."""

    level: Level
    step: int
    dirname: str
    readers: tuple[int, ...]
    rank: int
    parts: dict[int, np.ndarray]
    report: dict
    started: float

    def finish(self, comm: Comm, reports: Sequence[dict], into: Any = None) -> tuple[tuple[Any, Loaded], Assembly]:
        """Every rank, once every part verified: build the manifest from every writer's part as its
        reader reported it, then exchange the bytes and decode (or fill ``into``: load/into.py)."""
        dirname, readers = self.dirname, self.readers
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
        lengths = [sum(indexes[w].data_bytes for w in ws) for ws in streams]
        moved = [0, 0, 0]  # received, wire, rounds

        def read(wanted: Sequence[Target]) -> None:
            places = Places(manifest.tensors, wanted)
            targets = [_targets(idx, places, local_tensors.get(idx.rank)) for idx in indexes]
            for k in range(len(round_sizes(lengths))):  # every rank takes part in every round, whatever it keeps
                lo = k * EXCHANGE
                gathered = _gather_bytes(comm, _cut(mine, lo, lo + EXCHANGE))
                others = [len(part) for r, part in enumerate(gathered) if r != self.rank]
                moved[0] += sum(others)
                moved[1] += len(others) * max(len(part) for part in gathered)
                moved[2] += 1
                for r, part in enumerate(gathered):
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
        figures = Assembly(self.step, manifest.world_size, False, sum(len(p) for p in self.parts.values()),
                           lengths[self.rank], moved[0], moved[1], moved[2], time.perf_counter() - self.started)
        return (state, Loaded(opened, self.level.storage, self.level.index, locals_, node_local=True)), figures


def read_parts(fast: Level, part_storage: Callable[[int], Storage], step: int, dirname: str,
               readers: Sequence[int], rank: int) -> Parts:
    """Read and verify the parts ``rank`` reads of ``dirname`` (``readers[w]``: the reader of writer
    ``w``; ``part_storage(w)``: where this rank finds ``w``'s part): each one's marker, index and whole data file."""
    started = time.perf_counter()
    parts, told = {}, {}
    for writer, reader in enumerate(readers):
        if reader == rank:
            parts[writer], told[str(writer)] = _read_part(part_storage(writer), dirname, writer)
    return Parts(fast, step, dirname, tuple(readers), rank, parts, {"ok": True, "parts": told}, started)


def whole_figures(step: int, opened: Opened, rank: int, started: float) -> Assembly:
    """What a rank whose node held every part read: the replicated state and the ``local`` of the
    writers in :func:`~ckpt_engine.load.agreed.local_ranks`, nothing exchanged."""
    keep = local_ranks(rank, opened.manifest.world_size)
    read = sum(e.nbytes for idx in opened.indexes for e in idx.entries if not e.local or idx.rank in keep)
    return Assembly(step, opened.manifest.world_size, True, read, 0, 0, 0, 0, time.perf_counter() - started)


def _cut(parts: Sequence[np.ndarray], lo: int, hi: int) -> np.ndarray:
    """Bytes ``[lo, hi)`` of the parts laid end to end (a rank's stream in the exchange)."""
    pieces, base = [], 0
    for data in parts:
        a, b = max(lo, base), min(hi, base + len(data))
        if a < b:
            pieces.append(data[a - base:b - base])
        base += len(data)
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.empty(0, dtype=np.uint8)


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
