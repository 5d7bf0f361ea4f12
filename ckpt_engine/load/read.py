"""Reading a committed checkpoint back, verifying every byte on the way.

Every rank reads what it needs directly from storage (the whole replicated state, which it
reassembles from all writers' slices, whatever the writers' world size); a collective restore
on several ranks may instead read a share per rank and exchange the rest (load/exchange.py,
measured in ``benchmarks/bench_save.py``). Each piece is read straight into the destination tensor's memory
(``preadv`` on local files) when its elements are one run there, then hashed in place; otherwise
(a chunk of another sharding, a CUDA target) into a temporary of the piece's size, hashed, and
copied box by box into every target it meets (:class:`Places`). Files are read in parallel
threads (both ``preadv`` and xxhash release the GIL), each with a share of the bytes, and then
the others' until nothing is left (load/shares.py).

What is read is a list of :class:`Target`: the whole of every tensor (``load()``), or the
regions of the tensors of a state given with ``load(into=...)`` (load/into.py): then only the
pieces that meet a target are read, each verified whole. New tensors are allocated for what the
manifest claims, so their bytes are checked against this process's memory first (headroom.py:
:func:`whole_targets`, :func:`check_room`): a claim beyond it is refused before allocating.
"""


from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from math import prod
from typing import Any, Callable, Mapping, Sequence

import torch
import xxhash

from ..errors import CorruptionError, FormatError
from ..format.entries import MANIFEST_NAME, IndexEntry, data_file, index_file
from ..format.validate import extents
from ..state.decode import decode
from ..storage import Reader, Storage
from .into import fill
from .open import Opened, Progress, tensor_name
from .places import Places, Target, whole_targets
from .shares import Shares

def read_state(storage: Storage, ck: Opened, threads: int = 4, progress: Progress | None = None,
               into: Any = None) -> object:
    """The full replicated state of ``ck`` as CPU tensors and plain values; with ``into``, that
    state filled in place (load/into.py: only the pieces its tensors need are read)."""
    where = storage.describe(f"{ck.dirname}/{MANIFEST_NAME}")
    if into is not None:
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
        if e.tensor >= len(metas) or (e.start, e.stop) != (0, prod(metas[e.tensor].shape)) or covered[e.tensor]:
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
    with a share of about equal bytes and going on with the others' (load/shares.py), into its
    place (``places``); ``keep`` receives the verified temporary of each piece that was not read in
    place (load/exchange.py sends it on)."""
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
