"""Copying one rank's files of a checkpoint between storages, streamed and checked on the way.

The flushers (flush.py) copy with :func:`copy_rank`: the data file passes in chunks of ``CHUNK``
bytes through one reused buffer, and every byte is checked against the rank's index while it
passes (the entries' extents tile the file), so a copy damaged at its source is never propagated.
A restore from a node-local level checks its one read with the same :class:`StreamCheck`.
"""

from __future__ import annotations

import mmap
from typing import Iterator

import xxhash

from ..errors import CorruptionError
from ..format.entries import data_file, index_file
from ..format.manifest import RankIndex
from ..format.validate import extents
from ..storage import Storage

CHUNK = 8 << 20
"""Bytes per read while copying: the most a copy holds in memory (plus the object store's part buffer)."""


class StreamCheck:
    """Checks a data file read front to back against its index: each entry's bytes and padding.

    The entries' extents tile the file (checked when the index is parsed), so feeding every byte
    in order and then calling :meth:`finish` verifies all of them without holding the file.
    """

    def __init__(self, idx: RankIndex, where: str) -> None:
        ends = extents(idx.entries, idx.data_bytes)
        self._extents = sorted(zip(idx.entries, ends), key=lambda pair: pair[0].offset)
        self._where, self._pos, self._i = where, 0, 0
        self._hash = xxhash.xxh3_64()

    def feed(self, chunk: memoryview) -> None:
        """The next bytes of the file; raises :class:`CorruptionError` at the first bad extent."""
        done = 0
        while done < len(chunk):
            entry, end = self._extents[self._i]
            take = min(len(chunk) - done, end - self._pos)
            self._hash.update(chunk[done:done + take])
            done, self._pos = done + take, self._pos + take
            if self._pos == end:
                self._close_extent()

    def finish(self) -> None:
        """Every extent was fed and matched (an empty file has none)."""
        if self._i != len(self._extents):
            raise CorruptionError(f"{self._where}: ends at byte {self._pos}, the index expects more")

    def _close_extent(self) -> None:
        entry, _ = self._extents[self._i]
        if self._hash.hexdigest() != entry.xxh3:
            what = "local tensor" if entry.local else "tensor"
            raise CorruptionError(f"{self._where}: checksum mismatch in {what} #{entry.tensor} "
                                  f"(elements {entry.start}:{entry.stop} at byte {entry.offset})")
        self._hash.reset()
        self._i += 1


def copy_rank(source: Storage, target: Storage, dirname: str, rank: int, chunk: int = CHUNK) -> int:
    """Copy ``rank``'s data file, then its index file, of ``dirname``; returns the bytes copied.

    The data is streamed (one ``chunk`` in memory) and checked against the index on the way, so a
    level-1 copy damaged after its commit is never propagated; the index goes last, atomically.
    """
    index_rel, data_rel = f"{dirname}/{index_file(rank)}", f"{dirname}/{data_file(rank)}"
    raw = source.read_bytes(index_rel)
    idx = RankIndex.from_json(raw, source.describe(index_rel))
    target.makedirs(dirname)
    target.write_stream(data_rel, _Chunks(source, data_rel, idx, chunk), sync_dir=False)
    target.write_atomic(index_rel, raw)
    return idx.data_bytes + len(raw)


class _Chunks:
    """A data file read in chunks, checked as it passes; every ``iter()`` is a fresh pass (a retry).

    Each chunk is a view of one reused buffer, or of the mapped file on a memory level
    (``Reader.mapped``), valid until the next is asked for: the writer consumes it first (a local
    write, or the object store client's copy into its part buffer).
    """

    def __init__(self, source: Storage, rel: str, idx: RankIndex, chunk: int) -> None:
        self.source, self.rel, self.idx, self.chunk = source, rel, idx, chunk

    def __iter__(self) -> Iterator[memoryview]:
        size = self.idx.data_bytes
        check = StreamCheck(self.idx, self.source.describe(self.rel))
        with self.source.reader(self.rel) as reader:
            whole = reader.mapped()
            if whole is not None and whole.nbytes >= size:  # a memory level: its pages, no copy out
                with whole:
                    for offset in range(0, size, self.chunk):
                        with whole[offset:min(offset + self.chunk, size)] as view:
                            check.feed(view)
                            yield view
            else:
                buf = memoryview(mmap.mmap(-1, max(1, min(self.chunk, size))))  # page-aligned: written with O_DIRECT
                for offset in range(0, size, len(buf)):
                    view = buf[:min(len(buf), size - offset)]
                    reader.read_into(offset, view)
                    check.feed(view)
                    yield view
        check.finish()
