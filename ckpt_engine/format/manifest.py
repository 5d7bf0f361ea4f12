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
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import xxhash

from ..errors import CorruptionError, FormatError, UnsupportedValueError
from .guard import MAX_METADATA_BYTES
from .strict_json import parse_json
from ..sharding.boxes import Box, numel, tiling_error, within
from ..sharding.dtensors import Sharding
from ..values import MAX_DEPTH, MAX_NDIM, TORCH_DTYPES, check_tree

FORMAT_VERSION = 2
"""Written when a checkpoint holds sharded tensors (chunk boxes, sharding records); one without is
written as version 1, which readers of earlier releases read."""
READ_VERSIONS = (1, 2)
SHARDED = -2
"""Owner of a sharded tensor in the table (plan.SHARDED)."""
ALIGN = 64
"""Pieces start at multiples of this; a piece's checksum covers its bytes and its zero padding."""
MANIFEST_NAME = "manifest.json"
MAX_TENSOR_BYTES = 1 << 44  # 16 TiB: anything larger is a hostile or corrupt manifest
MAX_MANIFEST_BYTES = MAX_METADATA_BYTES
"""Largest manifest a reader accepts and a writer writes (128 MiB). A manifest holds about 300
bytes per tensor (its table entry with its key path, its reference in the state tree, the
optimizer's bookkeeping of it) and 150 per rank: 128 MiB is over 400,000 tensors with 16,000
ranks, several times the largest models trained today (10^4 to 10^5 tensors with their optimizer
state). Parsing JSON costs about ten times the text in memory, so the cap is what bounds the
memory a hostile or damaged file can make a reader take (a 3 GiB manifest was read whole)."""
MAX_INDEX_BYTES = MAX_METADATA_BYTES
"""Largest rank index file (128 MiB), checked against the manifest's record before it is read: an
entry is under 100 bytes (seven integers and a checksum), so over a million slices and local
tensors, plus the rank's own ``local`` tree (RNG states, data position: kilobytes)."""
MAX_INT = (1 << 63) - 1
"""Integers of the format (steps, sizes, offsets) fit a signed 64-bit integer, as in any reader."""
MAX_CREATED_AT = 253402300799.0
"""``created_at`` (Unix seconds) is at most 9999-12-31T23:59:59Z, the last time tools can print."""
_RANK_FILE = re.compile(r"rank-(\d{5})\.(bin|index\.json)")
_HASH = re.compile(r"[0-9a-f]{16}")
_ITEMSIZE = {name: dt.itemsize for name, dt in TORCH_DTYPES.items()}
_PLACEMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\([A-Za-z0-9_=, .-]*\))?")


def data_file(rank: int) -> str:
    """Name of the file holding ``rank``'s bytes."""
    return f"rank-{rank:05d}.bin"


def index_file(rank: int) -> str:
    """Name of ``rank``'s index file."""
    return f"rank-{rank:05d}.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the table: dtype name, (global) shape, owner (a rank, -1 when split, -2 when
    sharded), key path, and for a sharded tensor how it was laid out."""

    dtype: str
    shape: tuple[int, ...]
    owner: int
    name: str = ""
    sharding: Sharding | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of tensor ``tensor`` (of the rank's ``local`` tensors when ``local``)
    at ``offset`` in the rank's data file (and its snapshot buffer), ``nbytes`` long. For a sharded
    tensor the range is of the row-major order of the chunk ``box``, else of the whole tensor."""

    local: bool
    tensor: int
    start: int
    stop: int
    offset: int
    nbytes: int
    box: Box | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class IndexEntry(Piece):
    """A piece as the rank's index file records it: with the xxh3-64 of its bytes and padding."""

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
            "format_version": _version(any(e.box is not None for e in self.entries)), "step": self.step,
            "rank": self.rank, "world_size": self.world_size, "attempt": self.attempt,
            "data_file": data_file(self.rank), "data_bytes": self.data_bytes,
            "entries": [[int(e.local), e.tensor, e.start, e.stop, e.offset, e.nbytes, e.xxh3]
                        + ([[list(r) for r in e.box]] if e.box is not None else []) for e in self.entries],
            "local_tensors": [_tensor_json(t) for t in self.local_tensors],
            "local": self.local, "stats": self.stats,
        }
        return _capped(json.dumps(body, separators=(",", ":"), allow_nan=False).encode(), MAX_INDEX_BYTES,
                       f"rank {self.rank}'s index file (its local state)")

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
        _check_locals(entries, local_tensors, where)
        if not isinstance(d.get("stats"), dict) or not isinstance(d.get("attempt"), str):
            raise FormatError(f"{where}: missing 'stats' or 'attempt'")
        v.shallow(d["stats"], "stats")
        check_tree(d.get("local"), [t.dtype for t in local_tensors], where)
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
            "format_version": _version(any(t.sharding is not None for t in self.tensors)), "step": self.step,
            "world_size": self.world_size,
            "created_at": self.created_at, "split_threshold": self.split_threshold,
            "tensors": [_tensor_json(t) for t in self.tensors], "state": self.state,
            "ranks": [asdict(r) | {"data_file": data_file(r.rank), "index_file": index_file(r.rank)}
                      for r in self.ranks],
            "meta": self.meta,
        }
        return seal(_capped(json.dumps(body, separators=(",", ":"), allow_nan=False).encode(), MAX_MANIFEST_BYTES - 64,
                            "the manifest (the state's plain values and tensor table)"))

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


def _version(sharded: bool) -> int:
    """The format version a file is written as: 2 only when it uses what version 1 lacks."""
    return FORMAT_VERSION if sharded else 1


def _tensor_json(t: TensorEntry) -> list:
    out: list = [t.dtype, list(t.shape), t.owner, t.name]
    if t.sharding is not None:
        out.append({"mesh": list(t.sharding.mesh), "placements": list(t.sharding.placements),
                    "mesh_dims": list(t.sharding.mesh_dims)})
    return out


def _capped(raw: bytes, limit: int, what: str) -> bytes:
    """A writer never writes what readers refuse: ``raw`` if within ``limit``."""
    if len(raw) > limit:
        raise UnsupportedValueError(f"{what} would be {len(raw)} bytes, more than the {limit} readers accept; "
                                    "keep large data in tensors, not in plain values (lists, strings, bytes)")
    return raw


def _load(raw: bytes, where: str) -> dict:
    d = parse_json(raw, where)
    if not isinstance(d, dict):
        raise FormatError(f"{where}: top level is not an object")
    version = d.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise FormatError(
            f"{where}: unknown format_version {_short(version)} (this ckpt_engine reads "
            f"{', '.join(map(str, READ_VERSIONS))}); upgrade ckpt-suite to read it"
        )
    return d


class _Validator:
    """Field checks that name the file and field in their errors."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, msg: str) -> FormatError:
        return FormatError(f"{self.where}: {msg}")

    def int(self, d: dict, key: str, minimum: int = 0, maximum: int = MAX_INT) -> int:
        x = d.get(key)
        if type(x) is not int or not minimum <= x <= maximum:
            raise self.fail(f"field {key!r} must be an integer from {minimum} to {maximum}, got {str(x)[:40]}")
        return x

    def shallow(self, x: object, key: str) -> None:
        """Free-form field ``key`` nests at most ``MAX_DEPTH`` levels (tools walk it recursively)."""
        stack = [(x, 0)]
        while stack:
            node, depth = stack.pop()
            if isinstance(node, (dict, list)):
                if depth >= MAX_DEPTH:
                    raise self.fail(f"field {key!r} is nested deeper than {MAX_DEPTH} levels")
                stack.extend((c, depth + 1) for c in (node.values() if isinstance(node, dict) else node))

    def list(self, d: dict, key: str) -> list:
        x = d.get(key)
        if not isinstance(x, list):
            raise self.fail(f"field {key!r} must be a list")
        return x

    def tensor(self, t: object, name: str) -> TensorEntry:
        ok = isinstance(t, list) and len(t) in (4, 5) and isinstance(t[1], list) and isinstance(t[3], str)
        ok = ok and len(t[1]) <= MAX_NDIM and type(t[2]) is int and SHARDED <= t[2] <= MAX_INT
        ok = ok and all(type(s) is int and 0 <= s <= MAX_TENSOR_BYTES for s in t[1])
        if not ok:
            raise self.fail(f"{name} is malformed (shape of at most {MAX_NDIM} sizes >= 0, owner >= -2): "
                            f"{_short(t)}")
        if not isinstance(t[0], str) or t[0] not in TORCH_DTYPES:
            raise self.fail(f"{name} has unknown tensor dtype {str(t[0])[:40]!r} (known: {', '.join(TORCH_DTYPES)})")
        entry = TensorEntry(t[0], tuple(t[1]), t[2], t[3], self.sharding(t[4], name) if len(t) == 5 else None)
        span = math.prod(max(s, 1) for s in entry.shape) * _ITEMSIZE[entry.dtype]  # what strides address
        if span > MAX_TENSOR_BYTES:
            raise self.fail(f"{name} claims {span} bytes, more than the {MAX_TENSOR_BYTES} limit")
        return entry

    def sharding(self, s: object, name: str) -> Sharding:
        ok = isinstance(s, dict) and set(s) == {"mesh", "placements", "mesh_dims"}
        ok = ok and all(isinstance(s[k], list) and len(s[k]) <= MAX_NDIM for k in ("mesh", "placements", "mesh_dims"))
        ok = ok and all(type(n) is int and 1 <= n <= MAX_INT for n in s["mesh"]) and len(s["placements"]) == len(s["mesh"])
        ok = ok and all(isinstance(p, str) and len(p) <= 80 and _PLACEMENT.fullmatch(p) for p in s["placements"])
        ok = ok and all(isinstance(n, str) and len(n) <= 80 for n in s["mesh_dims"])
        if not ok:
            raise self.fail(f"{name}: malformed sharding record (mesh sizes, one placement each, mesh_dims): "
                            f"{str(s)[:120]}")
        return Sharding(tuple(s["mesh"]), tuple(s["placements"]), tuple(s["mesh_dims"]))

    def box(self, b: object, i: int) -> Box:
        ok = isinstance(b, list) and len(b) <= MAX_NDIM and all(
            isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) and 0 <= r[0] <= r[1] <= MAX_INT
            for r in b)
        if not ok:
            raise self.fail(f"entries[{i}] has a malformed chunk (one [start, stop) per dimension): {_short(b)}")
        return tuple((r[0], r[1]) for r in b)

    def entry(self, e: object, i: int, data_bytes: int) -> IndexEntry:
        ok = isinstance(e, list) and len(e) in (7, 8) and all(type(x) is int and 0 <= x <= MAX_INT for x in e[:6])
        ok = ok and e[0] in (0, 1) and isinstance(e[6], str) and _HASH.fullmatch(e[6]) is not None
        if not ok:
            raise self.fail(f"entries[{i}] is malformed: {_short(e)}")
        box = self.box(e[7], i) if len(e) == 8 else None
        if box is not None and e[0]:
            raise self.fail(f"entries[{i}]: a local tensor's entry has a chunk")
        entry = IndexEntry(bool(e[0]), *e[1:7], box=box)
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
        return RankRecord(i, self.int(r, "data_bytes"), self.int(r, "index_bytes", maximum=MAX_INDEX_BYTES), digest)


def _short(x: object) -> str:
    """A hostile value cut short for a message, without rendering it whole (it may be huge or deep)."""
    if isinstance(x, list):
        return "[" + ", ".join(_short(c) if not isinstance(c, (list, dict)) else "..." for c in x[:8]) + "]"
    return repr(x)[:40] if not isinstance(x, int) or x.bit_length() < 128 else f"<{x.bit_length()}-bit integer>"


def _check_locals(entries: Sequence[IndexEntry], local_tensors: Sequence[TensorEntry], where: str) -> None:
    """Each local tensor has exactly one entry, whole, of exactly its byte size.

    Checked when the index is parsed, so no reader allocates a local tensor larger than the
    bytes its entry (inside the data file, by the tiling) really holds.
    """
    seen: set[int] = set()
    for i, e in enumerate(entries):
        if not e.local:
            continue
        if e.tensor >= len(local_tensors) or e.tensor in seen:
            raise FormatError(f"{where}: entries[{i}] names local tensor {e.tensor}, which is not in the rank's "
                              f"table of {len(local_tensors)} or has another entry")
        t = local_tensors[e.tensor]
        if (e.start, e.stop, e.nbytes) != (0, math.prod(t.shape), t.nbytes):
            raise FormatError(f"{where}: local tensor {e.tensor} ({t.dtype}{list(t.shape)}, {t.nbytes} bytes) does "
                              f"not match its entry (elements {e.start}:{e.stop}, {e.nbytes} bytes)")
        seen.add(e.tensor)
    if len(seen) != len(local_tensors):
        missing = sorted(set(range(len(local_tensors))) - seen)[:4]
        raise FormatError(f"{where}: local tensors {missing} have no entry in the data file")


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
            if e.nbytes != (e.stop - e.start) * _ITEMSIZE[t.dtype]:
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
