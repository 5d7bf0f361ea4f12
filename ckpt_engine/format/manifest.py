"""The on-storage metadata: one manifest per checkpoint, one index file per rank.

Both are JSON written by this module only and parsed back with strict validation, because a
checkpoint may come from an untrusted place: unknown format versions, file names that could
leave the checkpoint directory, negative or overlong ranges and sizes that disagree with the
dtype are rejected with a :class:`FormatError` naming the file and the field.

* ``rank-NNNNN.index.json`` (per rank, small): the rank's slices of the replicated state
  (tensor, element range, byte offset in ``rank-NNNNN.bin``, xxh3-64 checksum; for a sharded
  tensor also the chunk the range is of) and its own ``local`` state whole. Per-slice checksums
  live here so the manifest stays bounded.
* ``manifest.json`` (written last, its presence is the commit): step, world size, tensor
  metadata and placement rule, the state's typed-JSON tree, and per rank the data/index file
  names, sizes and the index file's checksum.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import xxhash

from ..errors import CorruptionError, FormatError
from ..sharding.boxes import Box, numel, tiling_error, within
from ..state.decode import check_tree
from .entries import (FORMAT_VERSION, ITEMSIZE, MAX_CREATED_AT, MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, SHARDED,
                      IndexEntry, RankRecord, TensorEntry, data_file, index_file)
from .validate import Validator, capped, check_locals, check_tiling, load_json


@dataclass(frozen=True)
class RankIndex:
    """What one rank wrote for one checkpoint."""

    step: int
    rank: int
    world_size: int
    attempt: str
    data_bytes: int
    entries: tuple[IndexEntry, ...]
    local_tensors: tuple[TensorEntry, ...]
    local: Any
    stats: dict

    def to_json(self) -> bytes:
        body = {
            "format_version": _version(any(e.box is not None for e in self.entries)), "step": self.step,
            "rank": self.rank, "world_size": self.world_size, "attempt": self.attempt,
            "data_file": data_file(self.rank), "data_bytes": self.data_bytes,
            "entries": [[int(e.local), e.tensor, e.start, e.stop, e.offset, e.nbytes, e.xxh3]
                        + ([[list(r) for r in e.box]] if e.box is not None else []) for e in self.entries],
            "local_tensors": [_tensor_json(t) for t in self.local_tensors],
            "local": self.local, "stats": self.stats,
        }
        return capped(json.dumps(body, separators=(",", ":"), allow_nan=False).encode(), MAX_INDEX_BYTES,
                       f"rank {self.rank}'s index file (its local state)")

    @staticmethod
    def from_json(raw: bytes, where: str) -> "RankIndex":
        """Parse and validate an index file; ``where`` names it in errors."""
        d = load_json(raw, where)
        v = Validator(where)
        rank, world = v.int(d, "rank"), v.int(d, "world_size", minimum=1)
        if d.get("data_file") != data_file(rank):
            raise FormatError(f"{where}: data_file {d.get('data_file')!r} is not {data_file(rank)!r}")
        local_tensors = tuple(v.tensor(t, f"local_tensors[{i}]") for i, t in enumerate(v.list(d, "local_tensors")))
        data_bytes = v.int(d, "data_bytes")
        entries = tuple(v.entry(e, i, data_bytes) for i, e in enumerate(v.list(d, "entries")))
        check_tiling(entries, data_bytes, where)
        check_locals(entries, local_tensors, where)
        if not isinstance(d.get("stats"), dict) or not isinstance(d.get("attempt"), str):
            raise FormatError(f"{where}: missing 'stats' or 'attempt'")
        v.shallow(d["stats"], "stats")
        check_tree(d.get("local"), [t.dtype for t in local_tensors], where)
        return RankIndex(v.int(d, "step"), rank, world, d["attempt"], data_bytes, entries, local_tensors,
                         d.get("local"), d["stats"])


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint. Written last; a directory without one is not a checkpoint."""

    step: int
    world_size: int
    created_at: float
    split_threshold: int
    tensors: tuple[TensorEntry, ...]
    state: Any
    ranks: tuple[RankRecord, ...]
    meta: dict

    @property
    def total_bytes(self) -> int:
        return sum(r.data_bytes for r in self.ranks)

    def body(self) -> dict:
        """The manifest's JSON body as a dictionary (what :meth:`to_json` seals)."""
        return {
            "format_version": _version(any(t.sharding is not None for t in self.tensors)), "step": self.step,
            "world_size": self.world_size,
            "created_at": self.created_at, "split_threshold": self.split_threshold,
            "tensors": [_tensor_json(t) for t in self.tensors], "state": self.state,
            "ranks": [asdict(r) | {"data_file": data_file(r.rank), "index_file": index_file(r.rank)}
                      for r in self.ranks],
            "meta": self.meta,
        }

    def to_json(self) -> bytes:
        return seal(capped(json.dumps(self.body(), separators=(",", ":"), allow_nan=False).encode(), MAX_MANIFEST_BYTES - 64,
                            "the manifest (the state's plain values and tensor table)"))

    @staticmethod
    def from_json(raw: bytes, where: str) -> "Manifest":
        """Verify the seal, parse and validate a manifest; ``where`` names it in errors."""
        d = load_json(unseal(raw, where), where)
        v = Validator(where)
        world = v.int(d, "world_size", minimum=1)
        tensors = tuple(v.tensor(t, f"tensors[{i}]") for i, t in enumerate(v.list(d, "tensors")))
        for i, t in enumerate(tensors):
            if t.owner >= world:
                raise FormatError(f"{where}: tensors[{i}] owner {t.owner} is not a rank of {world}")
            if (t.owner == SHARDED) != (t.sharding is not None):
                raise FormatError(f"{where}: tensors[{i}] has owner {t.owner} "
                                  f"{'with' if t.sharding else 'without'} a sharding record")
        ranks = tuple(v.rank_record(r, i) for i, r in enumerate(v.list(d, "ranks")))
        if len(ranks) != world:
            raise FormatError(f"{where}: {len(ranks)} rank records for world_size {world}")
        created = d.get("created_at")
        if type(created) not in (int, float) or not 0 <= created <= MAX_CREATED_AT:
            raise FormatError(f"{where}: field 'created_at' must be Unix seconds between 0 and {MAX_CREATED_AT:.0f}, "
                              f"got {str(created)[:40]}")
        if not isinstance(d.get("meta"), dict):
            raise FormatError(f"{where}: missing 'meta'")
        v.shallow(d["meta"], "meta")
        check_tree(d.get("state"), [t.dtype for t in tensors], where)
        return Manifest(v.int(d, "step"), world, float(created), v.int(d, "split_threshold"), tensors,
                        d.get("state"), ranks, d["meta"])


_SEAL_HEAD = b'{"xxh3":"'
_SEAL_MID = b'","body":'


def seal(body: bytes) -> bytes:
    """Wrap JSON ``body`` as ``{"xxh3":"<hex of body>","body":<body>}`` (still one JSON document).

    The checksum covers the body's exact bytes, so any flipped byte of a manifest is detected
    without re-serializing; readers in other languages slice the same fixed-size prefix.
    """
    return _SEAL_HEAD + xxhash.xxh3_64_hexdigest(body).encode() + _SEAL_MID + body + b"}"


def unseal(raw: bytes, where: str) -> bytes:
    """The body of a sealed document; :class:`CorruptionError` if its checksum does not match."""
    head = len(_SEAL_HEAD) + 16 + len(_SEAL_MID)
    if len(raw) < head + 1 or not raw.startswith(_SEAL_HEAD) or raw[head - len(_SEAL_MID):head] != _SEAL_MID \
            or not raw.endswith(b"}"):
        raise CorruptionError(f"{where}: not a sealed manifest (truncated or not written by ckpt-suite)")
    body = raw[head:-1]
    if xxhash.xxh3_64_hexdigest(body).encode() != raw[len(_SEAL_HEAD):len(_SEAL_HEAD) + 16]:
        raise CorruptionError(f"{where}: checksum mismatch (the manifest was modified or damaged)")
    return body


def _version(sharded: bool) -> int:
    """The format version a file is written as: 2 only when it uses what version 1 lacks."""
    return FORMAT_VERSION if sharded else 1


def _tensor_json(t: TensorEntry) -> list:
    out: list = [t.dtype, list(t.shape), t.owner, t.name]
    if t.sharding is not None:
        out.append({"mesh": list(t.sharding.mesh), "placements": list(t.sharding.placements),
                    "mesh_dims": list(t.sharding.mesh_dims)})
    return out


def check_coverage(manifest: Manifest, indexes: Sequence[RankIndex], where: Callable[[int], str]) -> None:
    """Every element of every tensor is stored exactly once, with the byte count its dtype implies.

    A replicated tensor's ranges tile its elements; a sharded tensor's chunks tile its shape, and
    each chunk's ranges tile the chunk's elements. Raises :class:`FormatError` naming the tensor
    otherwise (a tampered or mismatched index).
    """
    ranges: list[dict[Box | None, list[tuple[int, int]]]] = [{} for _ in manifest.tensors]
    for idx in indexes:
        for e in idx.entries:
            if e.local:
                continue
            if e.tensor >= len(manifest.tensors):
                raise FormatError(f"{where(idx.rank)}: entry names tensor {e.tensor}, the table has "
                                  f"{len(manifest.tensors)}")
            t = manifest.tensors[e.tensor]
            if e.nbytes != (e.stop - e.start) * ITEMSIZE[t.dtype]:
                raise FormatError(f"{where(idx.rank)}: range {e.start}:{e.stop} of tensor {e.tensor} "
                                  f"has {e.nbytes} bytes, its dtype {t.dtype} implies otherwise")
            if (e.box is not None) != (t.owner == SHARDED) or (e.box is not None and not within(e.box, t.shape)):
                raise FormatError(f"{where(idx.rank)}: range {e.start}:{e.stop} of tensor {e.tensor} "
                                  f"({t.dtype}{list(t.shape)}) names chunk {e.box}, which "
                                  f"{'is not in the tensor' if e.box is not None else 'a sharded tensor needs'}")
            ranges[e.tensor].setdefault(e.box, []).append((e.start, e.stop))
    for i, t in enumerate(manifest.tensors):
        chunks = ranges[i] if t.owner == SHARDED else {None: ranges[i].get(None, [])}
        problem = tiling_error((b for b in chunks if b is not None), t.shape) if t.owner == SHARDED else None
        for box, found in chunks.items():
            if problem is None and not _tiles(found, math.prod(t.shape) if box is None else numel(box)):
                problem = (f"the index files do not cover the elements{'' if box is None else f' of chunk {list(box)}'} "
                           f"exactly once (ranges {sorted(found)[:4]}...)")
        if problem is not None:
            raise FormatError(f"tensor {i} ({t.dtype}{list(t.shape)}): {problem}")


def _tiles(found: Sequence[tuple[int, int]], count: int) -> bool:
    """Whether the element ranges ``found`` cover ``[0, count)`` exactly once."""
    end = 0
    for start, stop in sorted(found):
        if start != end:
            return False
        end = stop
    return end == count
