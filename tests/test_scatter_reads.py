"""Scatter reads (``Reader.read_many``): a piece and its padding, or a run of small pieces, in one
request: ``preadv`` on local files, one ranged request through a temporary elsewhere. Bytes land
where they belong, short files fail naming the file, and a restore of many small tensors makes a
few requests instead of two per tensor."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine import Checkpointer, StorageError
from ckpt_engine.restore import _runs
from ckpt_engine.format.manifest import IndexEntry
from ckpt_engine.storage import Storage
from ckpt_engine.storage import local as local_storage


def _write(storage: Storage, data: bytes) -> None:
    storage.makedirs("d")
    storage.write_stream("d/f.bin", [data])


@pytest.mark.parametrize("url", ["local", "memory"])
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=40), start=st.integers(0, 300))
@settings(max_examples=40, deadline=None)
def test_read_many_fills_consecutive_buffers(tmp_path_factory, url, sizes, start):
    root = str(tmp_path_factory.mktemp("r")) if url == "local" else f"memory://scatter-{os.getpid()}"
    storage = Storage(root)
    data = os.urandom(start + sum(sizes))
    _write(storage, data)
    bufs = [memoryview(bytearray(n)) for n in sizes]
    with storage.reader("d/f.bin") as r:
        r.read_many(start, bufs)
    assert b"".join(bytes(b) for b in bufs) == data[start:]


def test_more_buffers_than_one_preadv_takes(tmp_path, monkeypatch):
    monkeypatch.setattr(local_storage, "_IOV_MAX", 7)
    storage = Storage(str(tmp_path))
    data = os.urandom(100 * 33)
    _write(storage, data)
    bufs = [memoryview(bytearray(33)) for _ in range(100)]
    with storage.reader("d/f.bin") as r:
        r.read_many(0, bufs)
    assert b"".join(bytes(b) for b in bufs) == data


@pytest.mark.parametrize("url", ["local", "memory"])
def test_a_short_file_is_an_error_naming_it(tmp_path, url):
    storage = Storage(str(tmp_path) if url == "local" else f"memory://short-{os.getpid()}")
    _write(storage, b"x" * 100)
    with storage.reader("d/f.bin") as r, pytest.raises(StorageError, match=r"f\.bin.*ends after 100 bytes, 120"):
        r.read_many(60, [memoryview(bytearray(30)), memoryview(bytearray(30))])


def test_runs_join_neighbours_up_to_the_readers_span():
    def e(offset: int, nbytes: int) -> IndexEntry:
        return IndexEntry(False, 0, 0, nbytes // 4, offset, nbytes, "0" * 16)

    def end(x: IndexEntry) -> int:
        return x.offset + -(-x.nbytes // 4096) * 4096

    small = [e(i * 4096, 1000) for i in range(5)]
    big = e(5 * 4096, 1 << 20)
    gap = e(end(big) + 4096, 1000)  # not where the previous one ends: a new run
    pieces = [*small, big, gap]
    ends = {x: end(x) for x in pieces}
    assert _runs(pieces, ends, 64 << 20) == [[*small, big], [gap]]
    assert _runs(pieces, ends, 5 * 4096) == [small, [big], [gap]]  # a piece over the span is a run of its own
    many = [e(i * 4096, 1000) for i in range(30)]
    assert [len(r) for r in _runs(many, {x: end(x) for x in many}, 8 * 4096)] == [8, 8, 8, 6]


def test_a_restore_of_many_small_tensors_makes_few_requests(monkeypatch):
    from ckpt_engine.storage.fsspec_storage import FsspecReader

    requests = []
    real = FsspecReader._read
    monkeypatch.setattr(FsspecReader, "_read", lambda self, offset, dest: requests.append(len(dest))
                        or real(self, offset, dest))
    state = {f"bias{i}": torch.randn(64) for i in range(400)}
    state["weight"] = torch.randn(1 << 20)
    root = f"memory://few-requests-{os.getpid()}"
    with Checkpointer(root) as ck:
        ck.save(state, 1)
        ck.wait()
        requests.clear()
        back = ck.load()
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert len(requests) < 40, len(requests)  # before scatter reads: 401, one per tensor
