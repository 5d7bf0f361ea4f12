"""S3: large files go up as multipart uploads with several parts in flight, and large reads come
back as concurrent ranged GETs, ``max_concurrency`` at most (moto's server over real HTTP, with a
counting proxy in between: tests/inflightproxy.py)."""

from __future__ import annotations

import hashlib
import os
import uuid
from urllib.parse import urlparse

import fsspec
import pytest
import torch

from ckpt_engine import Checkpointer, StorageError
from ckpt_engine.config import CheckpointConfig, ConfigError
from ckpt_engine.storage import open_storage
from ckpt_engine.storage import fsspec_storage as storage_mod

pytestmark = pytest.mark.s3

PART = 5 << 20  # S3's (and moto's) smallest part but the last
RANGE = 1 << 20  # a GET has no minimum
SIZE = 6 * PART + 12345  # seven parts, the last one short


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(storage_mod, "_OBJECT_BLOCK", PART)
    monkeypatch.setattr(storage_mod, "_READ_BLOCK", RANGE)


@pytest.fixture
def inflight(s3_server):
    from inflightproxy import InflightProxy

    target = urlparse(s3_server.endpoint)
    p = InflightProxy((target.hostname, target.port))
    yield p
    p.close()


def _through(proxy, s3_server, max_concurrency=None, retry_deadline=30.0, **extra):
    """A fresh prefix in the test bucket, reached through ``proxy``, with its own s3fs client."""
    opts = s3_server.storage_options() | extra
    opts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=proxy.endpoint)
    opts["skip_instance_cache"] = True
    if max_concurrency is not None:
        opts["max_concurrency"] = max_concurrency
    return open_storage(f"s3://ckpt/conc-{uuid.uuid4().hex[:8]}", opts, retry_deadline=retry_deadline)


def _direct(st):
    """``(s3fs client straight to moto, bucket, key of st's root)``: to look without the proxy."""
    fs, _ = fsspec.core.url_to_fs("s3://ckpt")
    bucket, _, prefix = st.root.partition("/")
    return fs, bucket, prefix


class _Streamed:
    """A file streamed through one reused buffer, as a flush copies one (levels/transfer.py)."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data, self.chunk = data, chunk

    def __iter__(self):
        buf = memoryview(bytearray(self.chunk))
        for i in range(0, len(self.data), self.chunk):
            n = len(self.data[i:i + self.chunk])
            buf[:n] = self.data[i:i + n]
            yield buf[:n]


def _layout(name, data):
    view = memoryview(data)
    if name == "one buffer":  # a save: the snapshot buffer
        return [view]
    if name == "uneven chunks":  # parts straddle chunks
        cuts = [0, 3 << 20, (3 << 20) + 1, 17 << 20, len(data)]
        return [view[a:b] for a, b in zip(cuts, cuts[1:])]
    return _Streamed(data, 3 << 20)  # each chunk valid until the next: copied


@pytest.mark.parametrize("layout", ["one buffer", "uneven chunks", "streamed through one buffer"])
def test_a_large_file_goes_up_as_parts_in_flight_together_and_comes_back_exact(s3_server, inflight, small_parts,
                                                                               layout):
    data = os.urandom(SIZE)
    st = _through(inflight, s3_server, max_concurrency=4)
    assert st.parts_in_flight == 4
    assert st.write_stream("d/f.bin", _layout(layout, data)) == SIZE
    assert inflight.total["part"] == 7 and 2 <= inflight.peak["part"] <= 4, dict(inflight.peak)
    fs, bucket, prefix = _direct(st)
    head = fs.call_s3("head_object", Bucket=bucket, Key=f"{prefix}/d/f.bin")
    assert head["ContentLength"] == SIZE and head["ETag"].strip('"').endswith("-7")  # one object of 7 parts
    assert hashlib.sha256(fs.cat_file(f"{bucket}/{prefix}/d/f.bin")).digest() == hashlib.sha256(data).digest()

    inflight.reset()
    dest = bytearray(SIZE - 100)
    with st.reader("d/f.bin") as r:
        r.read_into(100, memoryview(dest))
    assert dest == data[100:]
    assert inflight.total["range"] == -(-len(dest) // RANGE) and 2 <= inflight.peak["range"] <= 4


def test_one_in_flight_sends_and_reads_one_part_at_a_time(s3_server, inflight, small_parts):
    data = os.urandom(SIZE)
    st = _through(inflight, s3_server, max_concurrency=1)
    st.write_stream("f.bin", [memoryview(data)])
    assert (inflight.total["part"], inflight.peak["part"]) == (7, 1)
    dest = bytearray(SIZE)
    with st.reader("f.bin") as r:
        r.read_into(0, memoryview(dest))
    assert dest == data and inflight.peak["range"] == 1


def test_a_read_past_the_end_is_short_and_names_the_file(s3_server, inflight, small_parts):
    """Ranges that start past the object's end (S3 answers 416) count as empty, the others as read."""
    data = os.urandom(3 * RANGE)
    st = _through(inflight, s3_server, max_concurrency=4)
    st.write_stream("f.bin", [data])
    dest = bytearray(4 * RANGE)
    with pytest.raises(StorageError, match=rf"f\.bin: .*file ends after {len(data)} bytes, {5 * RANGE} expected"):
        with st.reader("f.bin") as r:
            r.read_into(RANGE, memoryview(dest))
    assert dest[:2 * RANGE] == data[RANGE:]


def test_a_part_failing_midway_leaves_no_object_and_no_upload(s3_server, small_parts):
    """Part 3 is refused (every time): the parts in flight finish, the upload is aborted, nothing shows."""
    from faultproxy import FaultProxy

    target = urlparse(s3_server.endpoint)
    proxy = FaultProxy((target.hostname, target.port))
    try:
        proxy.reply(r"^PUT \S*[?&]partNumber=3[& ]", 500, "InternalError")
        # botocore's own retries are cut short: the refusal reaches the upload at once.
        st = _through(proxy, s3_server, max_concurrency=4, retry_deadline=0.5,
                      config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}})
        with pytest.raises(StorageError, match=r"could not write s3://ckpt/conc-\w+/d/f\.bin: .*by faultproxy"):
            st.write_stream("d/f.bin", [memoryview(os.urandom(SIZE))])
        assert proxy.replied >= 1
    finally:
        proxy.close()
    fs, bucket, prefix = _direct(st)
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/{prefix}/d/f.bin")
    assert [u for u in fs.list_multipart_uploads(bucket) if u["Key"].startswith(prefix)] == []


def test_a_checkpoint_saves_and_loads_with_parts_in_flight(s3_server, inflight, small_parts):
    """The engine's own path: a save sends the snapshot buffer as concurrent parts, a load reads
    each large tensor with concurrent ranged GETs, bit for bit (one read thread: each of the
    load's threads has its own reads in flight)."""
    state = {"big": torch.randn(6 * PART // 4), "small": torch.arange(10)}
    st = _through(inflight, s3_server, max_concurrency=3)
    with Checkpointer(st, read_threads=1) as ck:
        ck.save(state, 1)
        ck.wait()
        assert inflight.total["part"] >= 6 and 2 <= inflight.peak["part"] <= 3
        loaded = ck.load()
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["small"], state["small"])
    assert inflight.total["range"] >= 6 * PART // RANGE and 2 <= inflight.peak["range"] <= 3


def test_a_load_reads_neighbouring_tensors_together(s3_server, inflight):
    """40 tensors of 256 KiB (10 MiB) come back in one scatter read per file, not a GET per tensor:
    on an object store a GET is a round trip (and on moto a copy of the whole object)."""
    state = {f"layer{i}": torch.randn(64 << 10) for i in range(40)}
    st = _through(inflight, s3_server)
    with Checkpointer(st, read_threads=1) as ck:
        ck.save(state, 1)
        ck.wait()
        inflight.reset()
        loaded = ck.load()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert inflight.total["range"] <= 3, dict(inflight.total)  # the data (one GET), manifest and index


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "8"])
def test_max_concurrency_is_validated_naming_it_and_the_value(bad, s3_server):
    with pytest.raises(ConfigError, match=rf"^storage_options\.max_concurrency={bad!r} is invalid: expected a pos"):
        CheckpointConfig(dirpath="s3://ckpt/x", storage_options={"max_concurrency": bad})
    with pytest.raises(ConfigError, match=rf"^levels\[1\]\.storage_options\.max_concurrency={bad!r} is invalid"):
        CheckpointConfig(levels=["/tmp/a", {"path": "s3://ckpt/x", "storage_options": {"max_concurrency": bad}}])
    if not isinstance(bad, str):  # given to the storage directly (s3fs itself refuses a string with a TypeError)
        with pytest.raises(StorageError, match=r"max_concurrency"):
            open_storage("s3://ckpt/x", {"max_concurrency": bad, "skip_instance_cache": True})


def test_max_concurrency_reaches_the_storage_from_the_configuration(s3_url, s3_server):
    cfg = CheckpointConfig(dirpath=s3_url, storage_options={"max_concurrency": 3})
    with Checkpointer.from_config(cfg) as ck:
        assert ck.storage.parts_in_flight == 3
    assert open_storage(s3_url).parts_in_flight == 10  # s3fs's default


def test_memory_a_save_copies_no_part_and_a_streamed_copy_one_per_part_in_flight(s3_url, small_parts):
    """Memory (Python allocations while writing 7 parts, 4 in flight): a list of views (a save's
    snapshot buffer) is sent from its own memory, no part-sized copy at all; a streamed source (a
    flush) is copied into at most one part buffer per part in flight."""
    import tracemalloc

    data = os.urandom(SIZE)
    st = open_storage(s3_url, {"max_concurrency": 4, "skip_instance_cache": True})
    st.write_stream("warm-up.bin", [b"x"])  # the client's session and connections
    peaks = {}
    for name, chunks in (("view", [memoryview(data)]), ("streamed", _Streamed(data, 1 << 20))):
        tracemalloc.start()
        try:
            st.write_stream(f"{name}.bin", chunks)
            peaks[name] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    # tracemalloc also counts the HTTP stack's own send buffers (asyncio copies what the socket did
    # not take into a bytearray of its own): ~2.3 MB in the "view" case, up to most of a part when
    # moto reads slowly, so a streamed upload with 4 parts in flight peaks between 4 and 6 parts
    # (measured up to 5.07): the bound that matters is far below the file's 7 parts.
    assert peaks["view"] < PART and 4 * PART < peaks["streamed"] < 6 * PART, peaks
    assert open_storage(s3_url).read_bytes("streamed.bin", limit=SIZE) == data
