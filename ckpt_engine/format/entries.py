"""The records of the on-storage metadata (docs/FORMAT.md): a tensor of the table, a piece of a
rank's data file, a rank's record in the manifest, and the format's names, versions and caps. The
manifest and index files themselves, written and parsed: manifest.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..sharding.boxes import Box
from ..sharding.dtensors import Sharding
from ..state.values import TORCH_DTYPES
from ..storage.guard import MAX_METADATA_BYTES

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
HASH = re.compile(r"[0-9a-f]{16}")
ITEMSIZE = {name: dt.itemsize for name, dt in TORCH_DTYPES.items()}
PLACEMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\([A-Za-z0-9_=, .-]*\))?")


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
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


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
class RankRecord:
    """The manifest's record of one rank: sizes and the checksum of its index file."""

    rank: int
    data_bytes: int
    index_bytes: int
    index_xxh3: str
