"""Restore: read a committed checkpoint back, verifying every byte on the way.

Every rank reads what it needs directly from storage (the whole replicated state, which it
reassembles from all writers' slices, whatever the writers' world size); a collective restore
on several ranks may instead read a share per rank and exchange the rest (restore_exchange.py,
measured in ``benchmarks/bench_save.py``). Each piece is read straight into the destination tensor's memory
(``preadv`` on local files) when its elements are one run there, then hashed in place; otherwise
(a chunk of another sharding, a CUDA target) into a temporary of the piece's size, hashed, and
copied box by box into every target it meets (:class:`Places`). Files are read in parallel
threads (both ``preadv`` and xxhash release the GIL), each with a share of the bytes, and then
the others' until nothing is left (read_shares.py).

What is read is a list of :class:`Target`: the whole of every tensor (``load()``), or the
regions of the tensors of a state given with ``load(into=...)`` (restore_into.py): then only the
pieces that meet a target are read, each verified whole. New tensors are allocated for what the
manifest claims, so their bytes are checked against this process's memory first (headroom.py:
:func:`whole_targets`, :func:`check_room`): a claim beyond it is refused before allocating.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import xxhash

from . import headroom, hugepages
from .format.catalog import parse_dir
from .read_shares import Shares
from .errors import CorruptionError, FormatError, StorageError
from .format.manifest import (MANIFEST_NAME, MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, IndexEntry, Manifest, RankIndex,
                       TensorEntry, check_coverage, data_file, extents, index_file)
from .sharding.boxes import Box, contiguous_start, full_box, intersect, numel, range_boxes, relative
from .storage import Reader, Storage
from .values import decode, parse_dtype


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


@dataclass(frozen=True)
class Target:
    """Region ``box`` of table tensor ``tensor``, to be filled into ``out`` (shaped as the box; on
    any device)."""

    tensor: int
    box: Box
    out: torch.Tensor


class Places:
    """Where each stored piece goes: the targets it meets, and whether it can be read in place.

    Thread-safe after construction (reader threads only read it; targets are disjoint per tensor
    or receive identical bytes).
    """

    def __init__(self, table: Sequence[TensorEntry], targets: Sequence[Target]) -> None:
        self.table = table
        self.targets: dict[int, list[Target]] = {}
        for t in targets:
            self.targets.setdefault(t.tensor, []).append(t)
        # Tensors a target covers whole (every piece of them is needed), and the bytes of each
        # tensor's target where pieces can be read in place (one contiguous CPU target) with its
        # element size: decided once per target, not once per piece. This and ``needed`` run on
        # the calling thread before the reader threads start, so they add to the restore's wall
        # time: for the benchmark's 364 tensors and 556 pieces 1.42 + 0.52 ms with a NumPy view
        # of each target and the boxes compared per piece, 0.87 + 0.07 ms now (medians of 50).
        self._whole = {i for i, ts in self.targets.items() if any(t.box == full_box(table[i].shape) for t in ts)}
        self._flat: dict[int, tuple[memoryview, int]] = {
            i: (bytes_of(ts[0].out), ts[0].out.element_size())
            for i, ts in self.targets.items()
            if len(ts) == 1 and ts[0].out.is_cpu and ts[0].out.is_contiguous()}

    def chunk(self, e: IndexEntry) -> Box:
        """The box ``e``'s element range is of: its chunk, or the whole tensor."""
        return e.box if e.box is not None else full_box(self.table[e.tensor].shape)

    def needed(self, e: IndexEntry) -> bool:
        """Whether any target meets the piece ``e``."""
        if e.tensor in self._whole:
            return True  # a whole tensor needs every piece
        return any(intersect(b, t.box) is not None for _, b in range_boxes(self.chunk(e), e.start, e.stop)
                   for t in self.targets.get(e.tensor, ()))

    def in_place(self, e: IndexEntry) -> memoryview | None:
        """The bytes of the one target where ``e``'s elements are one run, or ``None`` (use a temporary)."""
        flat = self._flat.get(e.tensor)
        if flat is None:
            return None
        (t,), chunk = self.targets[e.tensor], self.chunk(e)
        at = e.start if chunk == t.box else None
        if at is None:
            whole = full_box(self.table[e.tensor].shape)
            c0, t0 = contiguous_start(chunk, whole), contiguous_start(t.box, whole)
            if c0 is None or t0 is None or not t0 <= c0 + e.start <= c0 + e.stop <= t0 + numel(t.box):
                return None
            at = c0 + e.start - t0
        data, item = flat
        return data[at * item:(at + e.stop - e.start) * item]

    def destination(self, e: IndexEntry) -> tuple[memoryview, torch.Tensor | None]:
        """Where to read ``e``'s bytes: the target's own memory (``temp`` ``None``), or a new
        temporary of the piece's size, to :meth:`scatter` from once verified."""
        view = self.in_place(e)
        if view is not None:
            return view, None
        temp = torch.empty(e.stop - e.start, dtype=parse_dtype(self.table[e.tensor].dtype))
        return bytes_of(temp), temp

    def scatter(self, e: IndexEntry, piece: torch.Tensor) -> None:
        """Copy the verified elements of ``e`` (``piece``, flat) into every target they meet."""
        for at, b in range_boxes(self.chunk(e), e.start, e.stop):
            src = piece[at:at + numel(b)].view(tuple(hi - lo for lo, hi in b))
            for t in self.targets.get(e.tensor, ()):
                common = intersect(b, t.box)
                if common is not None:
                    t.out[relative(common, t.box)].copy_(src[relative(common, b)])


def whole_targets(table: Sequence[TensorEntry], which: Sequence[int] | None = None, *,
                  where: str = "the checkpoint", what: str = "reading it", prefix: str = "") -> list[Target]:
    """A new CPU tensor for every tensor of ``table`` (or those ``which`` names), whole.

    Refused before any is allocated, as :class:`InsufficientMemoryError` naming ``where`` (the file
    that claims them), the largest tensor (``prefix`` before its name), the bytes needed and the
    bytes available, when together they are more than this process can have (headroom.py): a
    table is what the manifest claims, not what the data file holds. An allocation the allocator
    refuses anyway is the same error.
    """
    chosen = range(len(table)) if which is None else which
    claims = [(f"{prefix}{tensor_name(table[i], i)}", table[i].nbytes) for i in chosen]
    headroom.refuse_beyond(claims, where, what)
    try:
        return [Target(i, full_box(table[i].shape), _empty(table[i])) for i in chosen]
    except (RuntimeError, MemoryError) as e:  # torch's allocation failure is a RuntimeError
        raise headroom.too_large(claims, where, what, None) from e


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


def read_state(storage: Storage, ck: Opened, threads: int = 4, progress: Progress | None = None,
               into: Any = None) -> object:
    """The full replicated state of ``ck`` as CPU tensors and plain values; with ``into``, that
    state filled in place (restore_into.py: only the pieces its tensors need are read)."""
    where = storage.describe(f"{ck.dirname}/{MANIFEST_NAME}")
    if into is not None:
        from .restore_into import fill
        return fill(into, ck.manifest, where, lambda targets: read_targets(storage, ck, targets, threads, progress))
    targets = whole_targets(ck.manifest.tensors, where=where, what=f"reading step {ck.manifest.step}")
    read_targets(storage, ck, targets, threads, progress)
    return decode(ck.manifest.state, lambda i: targets[i].out, count=len(targets), where=where)


def read_targets(storage: Storage, ck: Opened, targets: Sequence[Target], threads: int = 4,
                 progress: Progress | None = None) -> None:
    """Fill ``targets`` (regions of the table's tensors) from every stored piece that meets them."""
    places = Places(ck.manifest.tensors, targets)
    jobs = [(idx.rank, e) for idx in ck.indexes for e in idx.entries if not e.local and places.needed(e)]
    names = [tensor_name(t, i) for i, t in enumerate(ck.manifest.tensors)]
    read_entries(storage, ck, jobs, places, names, threads, progress)


def read_local(storage: Storage, ck: Opened, rank: int, progress: Progress | None = None) -> object:
    """What writer ``rank`` saved as its ``local`` state."""
    idx = ck.indexes[rank]
    metas = idx.local_tensors
    jobs = [(rank, e) for e in idx.entries if e.local]
    covered = [0] * len(metas)
    for _, e in jobs:
        if e.tensor >= len(metas) or (e.start, e.stop) != (0, _numel(metas[e.tensor])) or covered[e.tensor]:
            raise FormatError(f"{storage.describe(f'{ck.dirname}/{index_file(rank)}')}: bad local entry {e}")
        covered[e.tensor] = 1
    if sum(covered) != len(metas):
        raise FormatError(f"{storage.describe(f'{ck.dirname}/{index_file(rank)}')}: local tensors missing")
    targets = whole_targets(metas, where=storage.describe(f"{ck.dirname}/{index_file(rank)}"), prefix="local ",
                            what=f"reading writer {rank}'s local state of step {ck.manifest.step}")
    names = [f"local {tensor_name(t, i)}" for i, t in enumerate(metas)]
    read_entries(storage, ck, jobs, Places(metas, targets), names, 2, progress)
    return decode(idx.local, lambda i: targets[i].out, count=len(targets),
                  where=storage.describe(f"{ck.dirname}/{index_file(rank)}"))


def verify(storage: Storage, ck: Opened, threads: int = 4, progress: Progress | None = None) -> None:
    """Read every byte of ``ck`` (state and every rank's local) and check every checksum."""
    read_state(storage, ck, threads, progress)
    for rank in range(ck.manifest.world_size):
        read_local(storage, ck, rank, progress)


def tensor_reader(storage: Storage, ck: Opened, threads: int = 4,
                  progress: Progress | None = None) -> Callable[[int], torch.Tensor]:
    """A function that reads replicated tensor ``i`` of the table alone, verified.

    For tools that go tensor by tensor (``ckpt diff``): memory stays bounded by the largest
    tensor instead of the whole state. Entries are grouped once, so reading every tensor this
    way costs about what :func:`read_state` does.
    """
    jobs: list[list[tuple[int, IndexEntry]]] = [[] for _ in ck.manifest.tensors]
    for idx in ck.indexes:
        for e in idx.entries:
            if not e.local:
                jobs[e.tensor].append((idx.rank, e))
    ends = _extents_by_rank(ck)
    where = storage.describe(f"{ck.dirname}/{MANIFEST_NAME}")

    def read(i: int) -> torch.Tensor:
        meta = ck.manifest.tensors[i]
        (target,) = whole_targets(ck.manifest.tensors, [i], where=where, what=f"reading step {ck.manifest.step}")
        read_entries(storage, ck, jobs[i], Places(ck.manifest.tensors, [target]), {i: tensor_name(meta, i)},
                      threads, progress, ends)
        return target.out

    return read


def _elements(e: IndexEntry) -> str:
    return f"elements {e.start}:{e.stop}" + (f" of chunk {[list(r) for r in e.box]}" if e.box is not None else "")


def _numel(t: TensorEntry) -> int:
    n = 1
    for s in t.shape:
        n *= s
    return n


def _empty(t: TensorEntry) -> torch.Tensor:
    # Huge pages where large: a page fault per 2 MiB, not per 4 KiB (figures in hugepages.py).
    return hugepages.empty(t.shape, parse_dtype(t.dtype))


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t``, writable, as one flat memoryview that keeps
    ``t`` alive. Through ctypes: 0.7 us a tensor against 2.8 us for ``t.view(torch.uint8).numpy()``
    (the restore makes one per target before its reader threads start)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    area = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    area.tensor = t  # type: ignore[attr-defined]  # the view must not outlive the memory
    return memoryview(area).cast("B")


def _extents_by_rank(ck: Opened) -> dict[int, dict[IndexEntry, int]]:
    return {idx.rank: dict(zip(idx.entries, extents(idx.entries, idx.data_bytes))) for idx in ck.indexes}


def split_by_bytes(sizes: Sequence[int], parts: int) -> list[int]:
    """The part (``0 <= p < parts``) of each item, in order: consecutive runs of about equal bytes.

    Non-decreasing, so every part is one run of consecutive items; an item goes to the part its
    first byte falls in, so no part ends more than one item beyond its equal share.
    """
    total = sum(sizes) or 1
    out, done = [], 0
    for n in sizes:
        out.append(min(parts - 1, done * parts // total))
        done += n
    return out


def shares_of(jobs: Sequence[tuple[int, IndexEntry]], parts: int) -> list[list[tuple[int, IndexEntry]]]:
    """``jobs`` (in read order) cut into at most ``parts`` non-empty shares of consecutive jobs of
    about equal bytes (:func:`split_by_bytes`): each reader thread's own share. Pure."""
    groups: list[list[tuple[int, IndexEntry]]] = [[] for _ in range(parts)]
    for job, group in zip(jobs, split_by_bytes([e.nbytes for _, e in jobs], parts)):
        groups[group].append(job)
    return [g for g in groups if g]


def steps(sizes: Sequence[int], step: int | None) -> list[list[tuple[int, int, int]]]:
    """Consecutive buffers of ``sizes`` bytes cut into requests of at most ``step`` bytes (all
    in one request when ``step`` is ``None``): each request a list of ``(buffer, start, stop)``,
    every byte once and in order, every request full but the last."""
    if step is None:
        whole = [(i, 0, n) for i, n in enumerate(sizes) if n]
        return [whole] if whole else []
    requests: list[list[tuple[int, int, int]]] = []
    room = 0
    for i, n in enumerate(sizes):
        lo = 0
        while lo < n:
            if room == 0:
                requests.append([])
                room = step
            hi = min(n, lo + room)
            requests[-1].append((i, lo, hi))
            room -= hi - lo
            lo = hi
    return requests


def read_entries(storage: Storage, ck: Opened, jobs: Sequence[tuple[int, IndexEntry]], places: Places,
                  names: Sequence[str] | Mapping[int, str], threads: int, progress: Progress | None = None,
                  ends: dict[int, dict[IndexEntry, int]] | None = None,
                  keep: dict[tuple[int, IndexEntry], torch.Tensor] | None = None) -> None:
    """Read and verify every entry (and its padding) on up to ``threads`` threads, each starting
    with a share of about equal bytes and going on with the others' (read_shares.py), into its
    place (``places``); ``keep`` receives the verified temporary of each piece that was not read in
    place (restore_exchange.py sends it on)."""
    dirname = ck.dirname
    ends = _extents_by_rank(ck) if ends is None else ends
    ordered = sorted(jobs, key=lambda j: (j[0], j[1].offset))
    groups = shares_of(ordered, max(1, min(threads, len(ordered), os.cpu_count() or 1)))
    shares = Shares(groups, ends)

    def read_share(mine: int) -> None:
        """Runs of share ``mine``, then of the others, each file opened once by this thread."""
        readers: dict[int, Reader] = {}
        try:
            first = groups[mine][0][0]  # its reader's run_max cuts every run this thread claims
            readers[first] = storage.reader(f"{dirname}/{data_file(first)}")
            run_max = readers[first].run_max
            while (claimed := shares.claim(mine, run_max)) is not None:
                rank, run = claimed
                if rank not in readers:
                    readers[rank] = storage.reader(f"{dirname}/{data_file(rank)}")
                read_run(rank, readers[rank], run)
        except BaseException:
            shares.stop()  # the others finish the run they read, and claim no other
            raise
        finally:
            for reader in readers.values():
                reader.close()

    def read_run(rank: int, reader: Reader, run: list[IndexEntry]) -> None:
        """``run`` (each piece into its place, its padding aside) in requests of the reader's
        :attr:`~ckpt_engine.storage.Reader.verify_step`, each piece's checksum updated after every
        request (verified while reading) and checked as soon as the request with its last byte
        lands: a mismatch stops the run there, not after its other pieces (one checksum per piece,
        so a piece is known bad only once it is read whole)."""
        placed = [(e, *places.destination(e), memoryview(bytearray(ends[rank][e] - e.offset - e.nbytes)))
                  for e in run]
        bufs = [(k, b) for k, (_, dest, _, pad) in enumerate(placed) for b in (dest, pad) if len(b)]
        digests = [xxhash.xxh3_64() for _ in placed]
        plan = steps([len(b) for _, b in bufs], reader.verify_step)
        requests = [[(digests[bufs[j][0]].update, bufs[j][1][lo:hi]) for j, lo, hi in request] for request in plan]
        last = {bufs[j][0]: i for i, request in enumerate(plan) for j, _, _ in request}  # piece -> its last request
        complete: list[list[int]] = [[] for _ in plan]
        for k, i in last.items():
            complete[i].append(k)

        def check(k: int) -> None:
            e = placed[k][0]
            if digests[k].hexdigest() != e.xxh3:
                raise CorruptionError(
                    f"{storage.describe(f'{dirname}/{data_file(rank)}')}: checksum mismatch in tensor "
                    f"{names[e.tensor]} ({_elements(e)} at byte {e.offset})")

        def landed(i: int) -> None:
            for update, view in requests[i]:
                update(view)
            for k in complete[i]:
                check(k)

        reader.read_steps(run[0].offset, [[v for _, v in r] for r in requests], landed)
        for k, (e, _, temp, _) in enumerate(placed):
            if k not in last:
                check(k)  # no bytes at all: never in a request
            if temp is not None:
                places.scatter(e, temp)
                if keep is not None:
                    keep[(rank, e)] = temp
            if progress is not None:
                progress(e.nbytes)

    if not groups:
        return
    # The calling thread reads share 0 itself: one thread fewer to start and join (the restore
    # waits for both), and share 0 starts at once.
    with ThreadPoolExecutor(max(1, len(groups) - 1), thread_name_prefix="ckpt-read") as pool:
        others = [pool.submit(read_share, k) for k in range(1, len(groups))]
        read_share(0)  # on failure the others stop at their current run; leaving the block waits for them
        for f in others:
            f.result()
