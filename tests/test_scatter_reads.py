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

from ckpt_engine import Checkpointer, CorruptionError, StorageError
from ckpt_engine.format.entries import IndexEntry
from ckpt_engine.load.read import steps
from ckpt_engine.load.shares import Shares
from ckpt_engine.storage import Storage, local as local_storage, open_storage


def _write(storage: Storage, data: bytes) -> None:
    storage.makedirs("d")
    storage.write_stream("d/f.bin", [data])


@pytest.mark.parametrize("url", ["local", "memory"])
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=40), start=st.integers(0, 300))
@settings(max_examples=40, deadline=None)
def test_read_many_fills_consecutive_buffers(tmp_path_factory, url, sizes, start):
    root = str(tmp_path_factory.mktemp("r")) if url == "local" else f"memory://scatter-{os.getpid()}"
    storage = open_storage(root)
    data = os.urandom(start + sum(sizes))
    _write(storage, data)
    bufs = [memoryview(bytearray(n)) for n in sizes]
    with storage.reader("d/f.bin") as r:
        r.read_many(start, bufs)
    assert b"".join(bytes(b) for b in bufs) == data[start:]


def test_more_buffers_than_one_preadv_takes(tmp_path, monkeypatch):
    monkeypatch.setattr(local_storage, "_IOV_MAX", 7)
    storage = open_storage(str(tmp_path))
    data = os.urandom(100 * 33)
    _write(storage, data)
    bufs = [memoryview(bytearray(33)) for _ in range(100)]
    with storage.reader("d/f.bin") as r:
        r.read_many(0, bufs)
    assert b"".join(bytes(b) for b in bufs) == data


@pytest.mark.parametrize("url", ["local", "memory"])
def test_a_short_file_is_an_error_naming_it(tmp_path, url):
    storage = open_storage(str(tmp_path) if url == "local" else f"memory://short-{os.getpid()}")
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
    def runs(pieces: list[IndexEntry], run_max: int) -> list[list[IndexEntry]]:  # one thread's share, in order
        shares = Shares([[(0, x) for x in pieces]], {0: {x: end(x) for x in pieces}})
        return [run for _, run in iter(lambda: shares.claim(0, run_max), None)]

    pieces = [*small, big, gap]
    assert runs(pieces, 64 << 20) == [[*small, big], [gap]]
    assert runs(pieces, 5 * 4096) == [small, [big], [gap]]  # a piece over the span is a run of its own
    many = [e(i * 4096, 1000) for i in range(30)]
    assert [len(r) for r in runs(many, 8 * 4096)] == [8, 8, 8, 6]


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


@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=30), step=st.one_of(st.none(), st.integers(1, 4000)))
@settings(max_examples=200, deadline=None)
def test_steps_cut_the_buffers_into_requests_of_at_most_step_bytes_in_order(sizes, step):
    requests = steps(sizes, step)
    cut = [(i, lo, hi) for request in requests for i, lo, hi in request]
    # every byte of every buffer once, in order, no empty cuts and no empty requests
    assert all(lo < hi for _, lo, hi in cut) and all(requests)
    assert [(i, lo, hi) for i, lo, hi in cut] == sorted(cut)
    for i, n in enumerate(sizes):
        mine = [(lo, hi) for j, lo, hi in cut if j == i]
        assert [lo for lo, _ in mine] == [0] + [hi for _, hi in mine[:-1]] if mine else n == 0
        assert not mine or mine[-1][1] == n
    if step is None:
        assert len(requests) == (1 if sum(sizes) else 0)
    else:
        assert all(sum(hi - lo for _, lo, hi in r) <= step for r in requests)
        assert len(requests) == -(-sum(sizes) // step)  # full requests: no more than the bytes need


def test_a_local_restore_reads_and_verifies_in_cache_sized_steps(tmp_path, monkeypatch):
    """Each request of a local restore is at most ``verify_step`` bytes and its checksum is
    updated right after it, while the bytes are in the core's cache: hashing a whole 64 MiB run
    after reading it cost 1.5 x the read itself here (bench_save, 2026-11-26, f436282)."""
    requests = []
    real = local_storage.LocalReader._read_many
    monkeypatch.setattr(local_storage.LocalReader, "_read_many", lambda self, offset, dests: requests.append(
        sum(len(d) for d in dests)) or real(self, offset, dests))
    real_one = local_storage.LocalReader._read
    monkeypatch.setattr(local_storage.LocalReader, "_read", lambda self, offset, dest: requests.append(
        len(dest)) or real_one(self, offset, dest))
    state = {"weight": torch.randn(3 << 20), "bias": torch.randn(100)}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1)
        ck.wait()
        requests.clear()
        back = ck.load()
    assert all(torch.equal(back[k], v) for k, v in state.items())
    step = local_storage.LocalReader.verify_step
    assert step is not None and max(requests) <= step
    assert sum(requests) >= 12 << 20 and len(requests) >= (12 << 20) // step


def test_a_flipped_byte_in_a_later_step_is_named(tmp_path):
    state = {"weight": torch.randn(3 << 20)}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1)
        ck.wait()
    data = next(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size >= 12 << 20)
    with open(data, "r+b") as f:
        f.seek(10 << 20)
        b = f.read(1)
        f.seek(10 << 20)
        f.write(bytes([b[0] ^ 1]))
    named = r"rank-00000\.bin: checksum mismatch in tensor 'state\['weight'\]' \(elements 2097152:3145728"
    with Checkpointer(str(tmp_path)) as ck, pytest.raises(CorruptionError, match=named):
        ck.load(fallback=False)


def test_read_steps_resumes_a_retried_read_at_the_first_request_not_landed(monkeypatch):
    """A remote storage retries a whole operation after a transient error; a restore's checksums are
    updated as each request lands, so a retry that began again at the first request would hash its
    bytes twice (and fail a good checkpoint)."""
    from ckpt_engine.storage.fsspec_storage import FsspecReader

    storage = open_storage(f"memory://steps-retry-{os.getpid()}")
    data = os.urandom(5 * 1000)
    _write(storage, data)
    real, calls = FsspecReader._read, []

    def flaky(self, offset, dest):
        calls.append(offset)
        if len(calls) == 3:
            raise ConnectionError("connection reset by peer (injected)")
        return real(self, offset, dest)

    monkeypatch.setattr(FsspecReader, "_read", flaky)
    requests = [[memoryview(bytearray(1000))] for _ in range(5)]
    landed: list[int] = []
    with storage.reader("d/f.bin") as r:
        r.read_steps(0, requests, landed.append)
    assert landed == [0, 1, 2, 3, 4]
    assert calls == [0, 1000, 2000, 2000, 3000, 4000]  # the third request again, not the first
    assert b"".join(bytes(q[0]) for q in requests) == data


def test_a_local_restore_is_one_storage_operation_per_run_not_per_request(tmp_path, monkeypatch):
    """Each storage operation costs an error-handling frame, a path description and a closure: at one
    per 1 MiB request they cost a 1 GiB restore about as much as hashing it (single thread: 0.148 s
    against 0.132 s for the same reads and checksums in a bare loop)."""
    state = {"weight": torch.randn(3 << 20), "bias": torch.randn(100)}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1)
        ck.wait()
        reads = []
        real = local_storage.LocalStorage.run
        monkeypatch.setattr(local_storage.LocalStorage, "run", lambda self, action, rel, fn: (
            reads.append(rel) if action == "read" and rel.endswith(".bin") else None) or real(self, action, rel, fn))
        back = ck.load()
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert 1 <= len(reads) <= 4, reads  # 12 MiB in 1 MiB requests: 13 operations before
