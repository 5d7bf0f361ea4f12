"""Opening a committed checkpoint: its manifest and every index file read and checked against each
other and against the data files' sizes (small reads only, nothing allocated for what the files
claim), and the memory a read of it would claim checked against this process's (headroom.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import xxhash

from ..errors import CorruptionError, FormatError, NoCheckpointError, StorageError
from ..format.catalog import committed, manifest_dirs, parse_dir
from ..format.entries import MANIFEST_NAME, MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, TensorEntry, data_file, index_file
from ..format.manifest import Manifest, RankIndex, check_coverage
from ..host import headroom
from ..storage import Storage

Progress = Callable[[int], None]
"""Called with the payload bytes of each piece once it is read and verified (from reader threads)."""


@dataclass(frozen=True)
class Opened:
    """A committed checkpoint whose manifest and index files were read and verified."""

    dirname: str
    manifest: Manifest
    indexes: tuple[RankIndex, ...]


def open_checkpoint(storage: Storage, dirname: str) -> Opened:
    """Read and check the manifest and every index file of ``dirname`` (small reads only).

    Regular files only, no symbolic link below the root, metadata within the format's caps
    (see :mod:`guard`). Checks index files against the manifest's checksums and data files
    against their recorded sizes, so that nothing is allocated for bytes that are not there.
    """
    mwhere = storage.describe(f"{dirname}/{MANIFEST_NAME}")
    manifest = Manifest.from_json(storage.read_bytes(f"{dirname}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES), mwhere)
    named = parse_dir(dirname.rsplit("/", 1)[-1])
    if named is not None and named[0] != manifest.step:
        raise FormatError(f"{mwhere}: step {manifest.step} is not the step {named[0]} of its directory")
    indexes = []
    for rec in manifest.ranks:
        where = storage.describe(f"{dirname}/{index_file(rec.rank)}")
        try:
            raw = storage.read_bytes(f"{dirname}/{index_file(rec.rank)}", MAX_INDEX_BYTES)
        except StorageError as e:
            raise CorruptionError(f"{where}: index file unreadable or missing ({e})") from e
        if len(raw) != rec.index_bytes or xxhash.xxh3_64_hexdigest(raw) != rec.index_xxh3:
            raise CorruptionError(f"{where}: checksum mismatch (the index file was modified or replaced)")
        idx = RankIndex.from_json(raw, where)
        _check_belongs(idx, manifest, rec.rank, rec.data_bytes, where)
        size = storage.regular_size(f"{dirname}/{data_file(rec.rank)}")
        if size != rec.data_bytes:
            raise CorruptionError(f"{storage.describe(f'{dirname}/{data_file(rec.rank)}')}: "
                                  f"{'missing' if size is None else f'{size} bytes'}, "
                                  f"{rec.data_bytes} expected (truncated or replaced)")
        indexes.append(idx)
    check_coverage(manifest, indexes, lambda r: storage.describe(f"{dirname}/{index_file(r)}"))
    return Opened(dirname, manifest, tuple(indexes))


def open_newest(storage: Storage, step: int | None = None) -> Opened:
    """The newest committed checkpoint at ``storage`` (or of ``step``), opened: its manifest and
    indexes checked, no data read.

    Raises :class:`NoCheckpointError` listing the committed steps when there is none.
    """
    found = manifest_dirs(storage, step)
    if not found:
        which = "" if step is None else f" of step {step}"
        where = storage.describe("").rstrip("/") or "/"
        steps = [e.step for e in committed(storage)]
        raise NoCheckpointError(f"no committed checkpoint{which} at {where} "
                                f"(committed steps: {steps or 'none'}); see `ckpt ls {where}`")
    return open_checkpoint(storage, found[-1][1])


def _check_belongs(idx: RankIndex, manifest: Manifest, rank: int, data_bytes: int, where: str) -> None:
    """The index file is rank ``rank``'s of this very checkpoint (docs/FORMAT.md: every field matches)."""
    attempt = manifest.meta.get("attempt")
    for field, got, want in (("rank", idx.rank, rank), ("step", idx.step, manifest.step),
                             ("world_size", idx.world_size, manifest.world_size), ("attempt", idx.attempt, attempt),
                             ("data_bytes", idx.data_bytes, data_bytes)):
        if got != want:
            raise FormatError(f"{where}: field {field!r} is {str(got)[:40]!r}, the manifest says {str(want)[:40]!r} "
                              f"(an index file of another checkpoint or rank)")


def tensor_name(t: TensorEntry, i: int) -> str:
    """How errors name table entry ``i``."""
    return f"'{t.name}'" if t.name else f"#{i}"


def check_room(storage: Storage, ck: Opened, *, state: bool = True, local_ranks: Sequence[int] = ()) -> None:
    """Refuse (:class:`InsufficientMemoryError`) before anything is allocated when what one call
    reads whole, the replicated state (``state``) and the ``local`` tensors of the writers
    ``local_ranks`` together, is more than this process can have (headroom.py).

    Called first by the calls that read several of them (``load()``: the state and two writers'
    locals; ``ckpt export``: the state and one local), since each :func:`whole_targets` checks only
    its own tensors.
    """
    m = ck.manifest
    claims = [(tensor_name(t, i), t.nbytes) for i, t in enumerate(m.tensors)] if state else []
    for r in local_ranks:
        claims += [(f"local {tensor_name(t, i)} of writer {r}", t.nbytes)
                   for i, t in enumerate(ck.indexes[r].local_tensors)]
    headroom.refuse_beyond(claims, storage.describe(f"{ck.dirname}/{MANIFEST_NAME}"), f"reading step {m.step}")
