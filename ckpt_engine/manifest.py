"""The on-storage metadata: one manifest per checkpoint, one index file per rank.

Both are JSON written by this module only and parsed back with strict validation, because a
checkpoint may come from an untrusted place: unknown format versions, file names that could
leave the checkpoint directory, negative or overlong ranges and sizes that disagree with the
dtype are rejected with a :class:`FormatError` naming the file and the field.

* ``rank-NNNNN.index.json`` (per rank, small): the rank's slices of the replicated state
  (tensor, element range, byte offset in ``rank-NNNNN.bin``, xxh3-64 checksum) and its own
  ``local`` state whole. Per-slice checksums live here so the manifest stays bounded.
* ``manifest.json`` (written last, its presence is the commit): step, world size, tensor
  metadata and placement rule, the state's typed-JSON tree, and per rank the data/index file
  names, sizes and the index file's checksum.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import xxhash

from .errors import CorruptionError, FormatError
from .values import TORCH_DTYPES, parse_dtype

FORMAT_VERSION = 1
ALIGN = 64
"""Pieces start at multiples of this; a piece's checksum covers its bytes and its zero padding."""
MANIFEST_NAME = "manifest.json"
MAX_TENSOR_BYTES = 1 << 44  # 16 TiB: anything larger is a hostile or corrupt manifest
_RANK_FILE = re.compile(r"rank-(\d{5})\.(bin|index\.json)")
_HASH = re.compile(r"[0-9a-f]{16}")
_ITEMSIZE = {name: dt.itemsize for name, dt in TORCH_DTYPES.items()}


def data_file(rank: int) -> str:
    """Name of the file holding ``rank``'s bytes."""
    return f"rank-{rank:05d}.bin"


def index_file(rank: int) -> str:
    """Name of ``rank``'s index file."""
    return f"rank-{rank:05d}.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the table: dtype name, shape, owner (a rank, or -1 when split), key path."""

    dtype: str
    shape: tuple[int, ...]
    owner: int
    name: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class IndexEntry:
    """Elements ``[start, stop)`` of tensor ``tensor`` stored at ``offset`` in the rank's file."""

    local: bool
    tensor: int
    start: int
    stop: int
    offset: int
    nbytes: int
    xxh3: str


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
            "format_version": FORMAT_VERSION, "step": self.step, "rank": self.rank,
            "world_size": self.world_size, "attempt": self.attempt, "data_file": data_file(self.rank),
            "data_bytes": self.data_bytes,
            "entries": [[int(e.local), e.tensor, e.start, e.stop, e.offset, e.nbytes, e.xxh3] for e in self.entries],
            "local_tensors": [_tensor_json(t) for t in self.local_tensors],
            "local": self.local, "stats": self.stats,
        }
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()

    @staticmethod
    def from_json(raw: bytes, where: str) -> "RankIndex":
        """Parse and validate an index file; ``where`` names it in errors."""
        d = _load(raw, where)
        v = _Validator(where)
        rank, world = v.int(d, "rank"), v.int(d, "world_size", minimum=1)
        if d.get("data_file") != data_file(rank):
            raise FormatError(f"{where}: data_file {d.get('data_file')!r} is not {data_file(rank)!r}")
        local_tensors = tuple(v.tensor(t, f"local_tensors[{i}]") for i, t in enumerate(v.list(d, "local_tensors")))
        data_bytes = v.int(d, "data_bytes")
        entries = tuple(v.entry(e, i, data_bytes) for i, e in enumerate(v.list(d, "entries")))
        _check_tiling(entries, data_bytes, where)
        if not isinstance(d.get("stats"), dict) or not isinstance(d.get("attempt"), str):
            raise FormatError(f"{where}: missing 'stats' or 'attempt'")
        return RankIndex(v.int(d, "step"), rank, world, d["attempt"], data_bytes, entries, local_tensors,
                         d.get("local"), d["stats"])


@dataclass(frozen=True)
class RankRecord:
    """The manifest's record of one rank: sizes and the checksum of its index file."""

    rank: int
    data_bytes: int
    index_bytes: int
    index_xxh3: str


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

    def to_json(self) -> bytes:
        body = {
            "format_version": FORMAT_VERSION, "step": self.step, "world_size": self.world_size,
            "created_at": self.created_at, "split_threshold": self.split_threshold,
            "tensors": [_tensor_json(t) for t in self.tensors], "state": self.state,
            "ranks": [asdict(r) | {"data_file": data_file(r.rank), "index_file": index_file(r.rank)}
                      for r in self.ranks],
            "meta": self.meta,
        }
        return seal(json.dumps(body, separators=(",", ":"), allow_nan=False).encode())

    @staticmethod
    def from_json(raw: bytes, where: str) -> "Manifest":
        """Verify the seal, parse and validate a manifest; ``where`` names it in errors."""
        d = _load(unseal(raw, where), where)
        v = _Validator(where)
        world = v.int(d, "world_size", minimum=1)
        tensors = tuple(v.tensor(t, f"tensors[{i}]") for i, t in enumerate(v.list(d, "tensors")))
        for i, t in enumerate(tensors):
            if t.owner >= world:
                raise FormatError(f"{where}: tensors[{i}] owner {t.owner} is not a rank of {world}")
        ranks = tuple(v.rank_record(r, i) for i, r in enumerate(v.list(d, "ranks")))
        if len(ranks) != world:
            raise FormatError(f"{where}: {len(ranks)} rank records for world_size {world}")
        created = d.get("created_at")
        if not isinstance(created, (int, float)) or not isinstance(d.get("meta"), dict):
            raise FormatError(f"{where}: missing 'created_at' or 'meta'")
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


def extents(entries: Sequence[IndexEntry], data_bytes: int) -> list[int]:
    """End offset of each entry's checksummed extent (its bytes plus padding up to the next)."""
    order = sorted(range(len(entries)), key=lambda i: entries[i].offset)
    ends = [0] * len(entries)
    for pos, i in enumerate(order):
        ends[i] = entries[order[pos + 1]].offset if pos + 1 < len(order) else data_bytes
    return ends


def _check_tiling(entries: Sequence[IndexEntry], data_bytes: int, where: str) -> None:
    """The entries' extents tile the data file exactly, so every byte of it is under a checksum."""
    position = 0
    for e in sorted(entries, key=lambda e: e.offset):
        if e.offset != position:
            raise FormatError(f"{where}: entries leave bytes {position}:{e.offset} of the data file uncovered "
                              "or overlap")
        position = e.offset + -(-e.nbytes // ALIGN) * ALIGN
    if position != data_bytes and not (not entries and data_bytes == 0):
        raise FormatError(f"{where}: entries cover {position} bytes of a {data_bytes}-byte data file")


def _tensor_json(t: TensorEntry) -> list:
    return [t.dtype, list(t.shape), t.owner, t.name]


def _load(raw: bytes, where: str) -> dict:
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise FormatError(f"{where}: top level is not an object")
    version = d.get("format_version")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{where}: unknown format_version {version!r} (this ckpt_engine reads {FORMAT_VERSION}); "
            "upgrade ckpt-suite to read it"
        )
    return d


class _Validator:
    """Field checks that name the file and field in their errors."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, msg: str) -> FormatError:
        return FormatError(f"{self.where}: {msg}")

    def int(self, d: dict, key: str, minimum: int = 0) -> int:
        x = d.get(key)
        if type(x) is not int or x < minimum:
            raise self.fail(f"field {key!r} must be an integer >= {minimum}, got {x!r}")
        return x

    def list(self, d: dict, key: str) -> list:
        x = d.get(key)
        if not isinstance(x, list):
            raise self.fail(f"field {key!r} must be a list")
        return x

    def tensor(self, t: object, name: str) -> TensorEntry:
        ok = isinstance(t, list) and len(t) == 4 and isinstance(t[1], list) and isinstance(t[3], str)
        ok = ok and all(type(s) is int and s >= 0 for s in t[1]) and type(t[2]) is int and t[2] >= -1
        if not ok:
            raise self.fail(f"{name} is malformed: {str(t)[:80]}")
        parse_dtype(t[0])
        entry = TensorEntry(t[0], tuple(t[1]), t[2], t[3])
        if entry.nbytes > MAX_TENSOR_BYTES:
            raise self.fail(f"{name} claims {entry.nbytes} bytes, more than the {MAX_TENSOR_BYTES} limit")
        return entry

    def entry(self, e: object, i: int, data_bytes: int) -> IndexEntry:
        ok = isinstance(e, list) and len(e) == 7 and all(type(x) is int and x >= 0 for x in e[:6])
        ok = ok and e[0] in (0, 1) and isinstance(e[6], str) and _HASH.fullmatch(e[6]) is not None
        if not ok:
            raise self.fail(f"entries[{i}] is malformed: {str(e)[:80]}")
        entry = IndexEntry(bool(e[0]), *e[1:])
        if entry.stop < entry.start or entry.offset + entry.nbytes > data_bytes:
            raise self.fail(f"entries[{i}] range {entry.start}:{entry.stop} at offset {entry.offset} "
                            f"(+{entry.nbytes}) is outside the {data_bytes}-byte data file")
        return entry

    def rank_record(self, r: object, i: int) -> RankRecord:
        if not isinstance(r, dict):
            raise self.fail(f"ranks[{i}] is not an object")
        if r.get("data_file") != data_file(i) or r.get("index_file") != index_file(i) or r.get("rank") != i:
            raise self.fail(f"ranks[{i}] names files {r.get('data_file')!r}/{r.get('index_file')!r}; "
                            f"expected {data_file(i)!r}/{index_file(i)!r}")
        digest = r.get("index_xxh3")
        if not isinstance(digest, str) or not _HASH.fullmatch(digest):
            raise self.fail(f"ranks[{i}].index_xxh3 is malformed")
        return RankRecord(i, self.int(r, "data_bytes"), self.int(r, "index_bytes"), digest)


def check_coverage(manifest: Manifest, indexes: Sequence[RankIndex], where: Callable[[int], str]) -> None:
    """Every element of every tensor is stored exactly once, with the byte count its dtype implies.

    Raises :class:`FormatError` naming the tensor otherwise (a tampered or mismatched index).
    """
    ranges: list[list[tuple[int, int]]] = [[] for _ in manifest.tensors]
    for idx in indexes:
        for e in idx.entries:
            if e.local:
                continue
            if e.tensor >= len(manifest.tensors):
                raise FormatError(f"{where(idx.rank)}: entry names tensor {e.tensor}, the table has "
                                  f"{len(manifest.tensors)}")
            t = manifest.tensors[e.tensor]
            if e.nbytes != (e.stop - e.start) * _ITEMSIZE[t.dtype]:
                raise FormatError(f"{where(idx.rank)}: range {e.start}:{e.stop} of tensor {e.tensor} "
                                  f"has {e.nbytes} bytes, its dtype {t.dtype} implies otherwise")
            ranges[e.tensor].append((e.start, e.stop))
    for i, t in enumerate(manifest.tensors):
        end = 0
        for start, stop in sorted(ranges[i]):
            if start != end:
                break
            end = stop
        else:
            if end == math.prod(t.shape):
                continue
        raise FormatError(f"tensor {i} ({t.dtype}{list(t.shape)}): the index files do not cover its "
                          f"elements exactly once (ranges {sorted(ranges[i])[:4]}...)")
