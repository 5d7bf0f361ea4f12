"""Strict validation of parsed metadata (a checkpoint may come from an untrusted place): every
field typed and bounded, every byte of a data file under a checksum, file names that cannot leave
the checkpoint directory. Each failure is a :class:`FormatError` naming the file and the field.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..errors import FormatError, UnsupportedValueError
from ..sharding.boxes import Box
from ..sharding.dtensors import Sharding
from ..state.values import MAX_DEPTH, MAX_NDIM, TORCH_DTYPES
from .entries import (ALIGN, HASH, ITEMSIZE, MAX_INDEX_BYTES, MAX_INT, MAX_TENSOR_BYTES, PLACEMENT, READ_VERSIONS,
                      SHARDED, IndexEntry, RankRecord, TensorEntry, data_file, index_file)
from .strict_json import parse_json

def extents(entries: Sequence[IndexEntry], data_bytes: int) -> list[int]:
    """End offset of each entry's checksummed extent (its bytes plus padding up to the next)."""
    order = sorted(range(len(entries)), key=lambda i: entries[i].offset)
    ends = [0] * len(entries)
    for pos, i in enumerate(order):
        ends[i] = entries[order[pos + 1]].offset if pos + 1 < len(order) else data_bytes
    return ends


def check_tiling(entries: Sequence[IndexEntry], data_bytes: int, where: str) -> None:
    """The entries' extents tile the data file exactly, so every byte of it is under a checksum."""
    position = 0
    for e in sorted(entries, key=lambda e: e.offset):
        if e.offset != position:
            raise FormatError(f"{where}: entries leave bytes {position}:{e.offset} of the data file uncovered "
                              "or overlap")
        position = e.offset + -(-e.nbytes // ALIGN) * ALIGN
    if position != data_bytes and not (not entries and data_bytes == 0):
        raise FormatError(f"{where}: entries cover {position} bytes of a {data_bytes}-byte data file")


def capped(raw: bytes, limit: int, what: str) -> bytes:
    """A writer never writes what readers refuse: ``raw`` if within ``limit``."""
    if len(raw) > limit:
        raise UnsupportedValueError(f"{what} would be {len(raw)} bytes, more than the {limit} readers accept; "
                                    "keep large data in tensors, not in plain values (lists, strings, bytes)")
    return raw


def load_json(raw: bytes, where: str) -> dict:
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


class Validator:
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
        span = math.prod(max(s, 1) for s in entry.shape) * ITEMSIZE[entry.dtype]  # what strides address
        if span > MAX_TENSOR_BYTES:
            raise self.fail(f"{name} claims {span} bytes, more than the {MAX_TENSOR_BYTES} limit")
        return entry

    def sharding(self, s: object, name: str) -> Sharding:
        ok = isinstance(s, dict) and set(s) == {"mesh", "placements", "mesh_dims"}
        ok = ok and all(isinstance(s[k], list) and len(s[k]) <= MAX_NDIM for k in ("mesh", "placements", "mesh_dims"))
        ok = ok and all(type(n) is int and 1 <= n <= MAX_INT for n in s["mesh"])
        ok = ok and len(s["placements"]) == len(s["mesh"])
        ok = ok and all(isinstance(p, str) and len(p) <= 80 and PLACEMENT.fullmatch(p) for p in s["placements"])
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
        ok = ok and e[0] in (0, 1) and isinstance(e[6], str) and HASH.fullmatch(e[6]) is not None
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
        if not isinstance(digest, str) or not HASH.fullmatch(digest):
            raise self.fail(f"ranks[{i}].index_xxh3 is malformed")
        return RankRecord(i, self.int(r, "data_bytes"), self.int(r, "index_bytes", maximum=MAX_INDEX_BYTES), digest)


def _short(x: object) -> str:
    """A hostile value cut short for a message, without rendering it whole (it may be huge or deep)."""
    if isinstance(x, list):
        return "[" + ", ".join(_short(c) if not isinstance(c, (list, dict)) else "..." for c in x[:8]) + "]"
    return repr(x)[:40] if not isinstance(x, int) or x.bit_length() < 128 else f"<{x.bit_length()}-bit integer>"


def check_locals(entries: Sequence[IndexEntry], local_tensors: Sequence[TensorEntry], where: str) -> None:
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
