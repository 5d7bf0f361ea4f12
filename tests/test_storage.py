"""The storage conformance suite (ckpt_engine.testing.storage_contract) run on every backend (local,
memory://, fsspec's local filesystem through dir::, s3:// on a real moto HTTP endpoint, Azure on
azurite), plus object-store specifics: multipart, retries, credentials."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine import Checkpointer, CheckpointError, CheckpointWarning, CorruptionError, StorageError
from ckpt_engine.format.catalog import manifest_dirs
from ckpt_engine.storage.retry import is_transient, retrying
from ckpt_engine.storage import Storage, open_storage
from ckpt_engine.testing.storage_contract import StorageContract
from helpers import assert_same


def _fail_io():
    raise OSError(5, "injected")


class TestStorageContract(StorageContract):
    """ckpt_engine.testing.storage_contract on every backend this project ships, plus what the engine
    does on top of each (a test double wrapping it, a checkpoint written and verified)."""

    @pytest.fixture
    def url(self, any_url):
        return any_url

    def test_a_double_wraps_the_storage_for_its_url(self, any_url):
        """A double (a ``StorageWrapper`` subclass) overrides an operation and calls ``super()``: that
        reaches the real one of the storage it wraps; ``run`` is the hook a fault goes through to fail
        like a backend error, with the wrapped storage's retries."""
        import pickle

        from ckpt_engine.testing import FailingStorage, GatedStorage

        class Refusing(GatedStorage):
            def write_atomic(self, rel, data, **kw):
                if rel == "latest":
                    return self.run("write", rel, _fail_io)
                return super().write_atomic(rel, data, **kw)

        st = Refusing(open_storage(any_url, retry_deadline=0.5))
        assert isinstance(st, Storage) and st.url == any_url and st.retry_deadline == 0.5
        st.makedirs("")
        st.gate.set()
        st.write_stream("a.bin", [b"abc"])
        assert st.blocked.is_set() and st.read_bytes("a.bin") == b"abc"
        with pytest.raises(StorageError, match=r"could not write .*latest: OSError: \[Errno 5\] injected"):
            st.write_atomic("latest", b"1")
        child = st.child("sub")
        assert type(child) is Refusing and child.gate is st.gate and child.url == f"{any_url.rstrip('/')}/sub"
        failing = FailingStorage(any_url, fail_on=".bin").child("x")
        again = pickle.loads(pickle.dumps(failing))
        assert type(again) is FailingStorage and again.fail_on == ".bin" and again.describe("") == failing.describe("")

    def test_checkpoint_roundtrip_and_corruption(self, any_url):
        state = {"w": torch.randn(300, 300), "b": torch.arange(10), "v": "x"}
        with Checkpointer(any_url, keep_last=2) as ck:
            for step in (1, 2, 3):
                ck.save(state, step, {"rank": 0})
            ck.wait(retention=True)
            assert ck.steps() == [2, 3]
            assert_same(ck.load(), state)
            dirname = manifest_dirs(ck.storage)[-1][1]
            raw = bytearray(ck.storage.read_bytes(f"{dirname}/rank-00000.bin"))
            raw[100] ^= 0xFF
            ck.storage.write_atomic(f"{dirname}/rank-00000.bin", bytes(raw))
            with pytest.raises(CorruptionError, match=r"rank-00000.bin: checksum mismatch in tensor 'state\['w'\]'"):
                ck.load()


def test_large_shards_go_up_as_multipart_and_stale_uploads_are_aborted(s3_url, s3_server):
    st = open_storage(s3_url)
    big = torch.randn(20 * 2**20 // 4)  # 20 MiB > the 5 MiB multipart minimum
    with Checkpointer(st) as ck:
        ck.save({"big": big}, 1)
        ck.wait()
        assert torch.equal(ck.load()["big"], big)
    import fsspec
    s3, root = fsspec.core.url_to_fs(s3_url)  # the client itself: a crashed writer's upload, not ours
    bucket, _, prefix = root.partition("/")
    key = f"{prefix}/step-000000000002-0000000000000000000a/rank-00000.bin"
    up = s3.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    assert any(u["Key"] == key for u in s3.list_multipart_uploads(bucket))
    Checkpointer(s3_url).close()  # start-up sweep
    assert not any(u["UploadId"] == up["UploadId"] for u in s3.list_multipart_uploads(bucket))


def test_storage_options_work_as_well_as_the_environment(s3_server, monkeypatch):
    for k in s3_server.env:
        monkeypatch.delenv(k, raising=False)
    url = "s3://ckpt/by-options"
    with Checkpointer(url, storage_options=s3_server.storage_options()) as ck:
        ck.save({"a": torch.ones(3)}, 1)
        ck.wait()
        assert ck.steps() == [1]


def test_credentials_never_appear_in_errors(s3_server, monkeypatch):
    secret = "SUPER-SECRET-VALUE-123"
    opts = s3_server.storage_options() | {"secret": secret}
    for k in s3_server.env:
        monkeypatch.delenv(k, raising=False)
    st = open_storage("s3://no-such-bucket-here/run", opts, retry_deadline=1)
    with pytest.raises(CheckpointError) as err:
        st.read_bytes("manifest.json")
    assert secret not in str(err.value) and secret not in repr(err.value.__cause__)


def test_retry_classification_and_bounded_backoff():
    assert is_transient(ConnectionResetError()) and is_transient(TimeoutError())
    assert not is_transient(FileNotFoundError()) and not is_transient(PermissionError())
    wrapped = OSError("s3 said")
    wrapped.__cause__ = type("ClientError", (Exception,), {"response": {
        "Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}})()
    assert is_transient(wrapped)
    calls, sleeps, now = [], [], [0.0]

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionResetError("dropped")
        return "ok"

    assert retrying(flaky, 10, sleep=sleeps.append, clock=lambda: now[0]) == "ok" and len(calls) == 4

    def always():
        now[0] += 1
        raise ConnectionResetError("down")

    with pytest.raises(ConnectionResetError) as err:
        retrying(always, 5, sleep=lambda s: None, clock=lambda: now[0])
    assert 2 <= err.value.ckpt_attempts <= 6


@pytest.fixture
def proxy(s3_server):
    from urllib.parse import urlparse

    from faultproxy import FaultProxy

    target = urlparse(s3_server.endpoint)
    p = FaultProxy((target.hostname, target.port))
    yield p
    p.close()


def proxied(s3_server, proxy, retry_deadline=30.0, prefix=None):
    import uuid
    opts = s3_server.storage_options()
    opts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=proxy.endpoint)
    opts["skip_instance_cache"] = True
    # botocore's own retries are cut short so that ours are what is tested.
    opts["config_kwargs"] = {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2,
                             "read_timeout": 5}
    return open_storage(prefix or f"s3://ckpt/flaky-{uuid.uuid4().hex[:8]}", opts, retry_deadline=retry_deadline)


@pytest.mark.parametrize("how", ["503", "drop"])
def test_transient_http_failures_are_retried(s3_server, proxy, how):
    st = proxied(s3_server, proxy)
    state = {"w": torch.randn(1000, 100)}
    with Checkpointer(st) as ck:
        proxy.fail(6, how)
        ck.save(state, 1)
        ck.wait()
        assert proxy.injected == 6
        assert_same(ck.load(), state)


def test_persistent_failure_surfaces_keeps_previous_and_training_goes_on(s3_server, proxy):
    st = proxied(s3_server, proxy, retry_deadline=1.5)
    with Checkpointer(st, on_error="warn", commit_timeout=5) as ck:
        ck.save({"v": torch.tensor(1)}, 1)
        ck.wait(retention=True)
        proxy.fail(-1, "503")
        ck.save({"v": torch.tensor(2)}, 2)
        with pytest.warns(CheckpointWarning, match="could not .*step-000000000002"):
            ck.wait()
        assert ck.counters["failed"] == 1
        proxy.heal()
        assert ck.steps() == [1] and ck.load()["v"].item() == 1  # the failed one never became visible
        ck.save({"v": torch.tensor(3)}, 3)  # training went on
        ck.wait()
        assert ck.steps() == [1, 3]
    strict = Checkpointer(proxied(s3_server, proxy, retry_deadline=1.0, prefix=st.url), commit_timeout=5)
    proxy.fail(-1, "drop")
    strict.save({"v": torch.tensor(4)}, 4)
    with pytest.raises(StorageError, match="could not write .*step-000000000004"):
        strict.wait()
    proxy.heal()
    strict.close()
    assert Checkpointer(st).latest_step() == 3


# s3rver's answer to ListMultipartUploads (GET /<bucket>?uploads), an optional API.
_LIST_UPLOADS = r"^GET /[^ ?]*\?(\S*&)?uploads[&= ]"


def test_a_store_without_multipart_listing_skips_that_cleanup_with_one_warning(s3_server, proxy):
    """501 Not Implemented is not transient: the start-up sweep skips it at once, warned once."""
    import warnings

    proxy.reply(_LIST_UPLOADS, 501, "NotImplemented", "A header you provided implies functionality "
                "that is not implemented")
    st = proxied(s3_server, proxy, retry_deadline=60.0)  # the library's default deadline
    state = {"w": torch.randn(1000, 100)}
    with pytest.warns(CheckpointWarning, match=r"ListMultipartUploads.*501"):
        ck = Checkpointer(st)
    assert proxy.replied == 1  # asked once: the 501 was not retried
    with ck:
        ck.save(state, 1)
        ck.wait()
        assert_same(ck.load(), state)
    assert proxy.replied == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the same store is not asked (nor warned about) again
        with Checkpointer(st) as again:
            assert_same(again.load(), state)
    assert proxy.replied == 1


@pytest.mark.parametrize("tail", [0, 1, 4095])
def test_direct_io_write_of_an_aligned_buffer_is_exact_and_bypasses_the_page_cache(tmp_path, tail):
    """Large page-aligned buffers go out with O_DIRECT (the unaligned tail buffered); bytes exact."""
    import mmap
    import os

    from ckpt_engine.storage import local as storage_mod
    n = (2 << 20) + tail
    buf = mmap.mmap(-1, n)  # mmap memory is page-aligned, like the snapshot's host buffers
    buf.write(os.urandom(n))
    st = open_storage(str(tmp_path))
    assert st.direct_io, "this test machine's ext4 supports O_DIRECT"
    calls = []
    real = storage_mod._write_direct
    storage_mod._write_direct = lambda path, view: calls.append(path) or real(path, view)
    try:
        assert st.write_stream("f.bin", [memoryview(buf)]) == n
        assert st.write_stream("small.bin", [b"x" * 100]) == 100            # small: buffered
        assert st.write_stream("odd.bin", [memoryview(buf)[1:]]) == n - 1   # unaligned start: buffered
    finally:
        storage_mod._write_direct = real
    assert calls == [st.path("f.bin")]
    assert (tmp_path / "f.bin").read_bytes() == bytes(buf)
    assert (tmp_path / "odd.bin").read_bytes() == bytes(buf)[1:]
    assert st.direct_io


class _Stream:
    """A lazy stream (not a sequence): ``write_stream`` takes it one chunk at a time, as a flush's copy."""

    def __init__(self, *chunks) -> None:
        self.chunks = chunks

    def __iter__(self):
        return iter(self.chunks)


def test_a_streamed_write_goes_direct_while_its_chunks_are_aligned_then_buffered_bytes_exact(tmp_path, monkeypatch):
    """A flush streams views of one page-aligned buffer: those chunks go out with O_DIRECT, an
    unaligned or short chunk and everything after it through the page cache; the bytes are exact."""
    import mmap
    import os

    from ckpt_engine.storage import local as storage_mod
    direct_writes = []
    real_write = os.write

    def spying_write(fd, data):
        if storage_mod.fcntl.fcntl(fd, storage_mod.fcntl.F_GETFL) & storage_mod._DIRECT_FLAG:
            direct_writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(storage_mod.os, "write", spying_write)
    block = mmap.mmap(-1, 2 << 20)
    block.write(os.urandom(2 << 20))
    aligned, tail = memoryview(block), memoryview(bytearray(os.urandom(12345)))
    st = open_storage(str(tmp_path))
    assert st.write_stream("f.bin", _Stream(aligned, aligned, tail, aligned)) == 3 * (2 << 20) + 12345
    assert direct_writes == [2 << 20, 2 << 20]  # the chunks after the tail were buffered too
    assert (tmp_path / "f.bin").read_bytes() == bytes(block) * 2 + bytes(tail) + bytes(block)


def test_direct_io_refused_falls_back_to_buffered_writes(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT (tmpfs says EINVAL) gets ordinary writes, once decided."""
    import errno
    import mmap
    import os

    from ckpt_engine.storage import local as storage_mod
    real_open = os.open

    def refusing_open(path, flags, *a):
        if flags & storage_mod._DIRECT_FLAG:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(storage_mod.os, "open", refusing_open)
    buf = mmap.mmap(-1, 3 << 20)
    buf.write(os.urandom(3 << 20))
    st = open_storage(str(tmp_path))
    st.write_stream("a.bin", [memoryview(buf)])
    assert not st.direct_io
    assert (tmp_path / "a.bin").read_bytes() == bytes(buf)
    streamed = open_storage(str(tmp_path))
    streamed.write_stream("s.bin", _Stream(memoryview(buf)))  # a stream too: refused before a chunk is taken
    assert not streamed.direct_io and (tmp_path / "s.bin").read_bytes() == bytes(buf)


def test_direct_io_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_DIRECT_IO", "0")
    assert not open_storage(str(tmp_path)).direct_io


def test_not_implemented_is_not_transient():
    """A 501 is a 5xx but permanent: the server lacks the API (s3fs raises it as ENOSYS)."""
    import errno

    from ckpt_engine.storage.retry import is_not_implemented

    answer = type("ClientError", (Exception,), {"response": {
        "Error": {"Code": "NotImplemented"}, "ResponseMetadata": {"HTTPStatusCode": 501}}})()
    wrapped = OSError(errno.ENOSYS, "not implemented")
    wrapped.__cause__ = answer
    for e in (answer, wrapped):
        assert is_not_implemented(e) and not is_transient(e)
    assert not is_not_implemented(ConnectionResetError()) and is_transient(ConnectionResetError())


class _FailingChunks:
    """Chunks that end in ENOSPC after ``nbytes``, anew on every pass (like a streamed copy)."""

    def __init__(self, nbytes: int, chunk: int = 1 << 20) -> None:
        self.nbytes, self.chunk = nbytes, chunk

    def __iter__(self):
        for _ in range(self.nbytes // self.chunk):
            yield b"x" * self.chunk
        raise OSError(28, "No space left on device (injected)")


@pytest.mark.parametrize("url", [pytest.param("s3_url", marks=pytest.mark.s3),
                                 pytest.param("az_url", marks=pytest.mark.azure)])
def test_a_failed_upload_leaves_no_partial_object(url, request, monkeypatch):
    """fsspec's close() completes an upload even after an error: the bytes so far must not become the object."""
    from ckpt_engine.storage import fsspec_storage as storage_mod
    monkeypatch.setattr(storage_mod, "_OBJECT_BLOCK", 5 << 20)  # parts / staged blocks before the failure
    st = open_storage(request.getfixturevalue(url), retry_deadline=1)
    with pytest.raises(StorageError, match=r"could not write .*d/f\.bin: .*No space left"):
        st.write_stream("d/f.bin", _FailingChunks(12 << 20))
    assert not st.exists("d/f.bin") and st.listdir("d") == []
    assert st.abort_uploads() == []  # s3: the multipart upload was aborted, not left behind


@pytest.mark.parametrize("url", [pytest.param("s3_url", marks=pytest.mark.s3),
                                 pytest.param("az_url", marks=pytest.mark.azure)])
def test_one_filesystem_object_per_store(url, request):
    """fsspec caches filesystems by URL options: a backend's one-time probes (credentials, gcsfs's
    bucket layout) are paid once per process, not once per Storage, let alone per call."""
    from ckpt_engine.storage import FsspecStorage
    where = request.getfixturevalue(url)
    one, other = open_storage(where), open_storage(f"{where}/other")
    assert isinstance(one, FsspecStorage) and one.fs is other.fs


def test_checkpointer_end_to_end_on_azurite(az_url, azurite_server, monkeypatch):
    """Azure through adlfs: large files go up as staged blocks committed at close; the start-up sweep
    (no multipart listing there) removes a crashed run's attempt and keeps the checkpoint."""
    import azurite
    from ckpt_engine.storage import fsspec_storage as storage_mod
    from ckpt_engine.format.catalog import attempt_dirs

    monkeypatch.setattr(storage_mod, "_OBJECT_BLOCK", 4 << 20)  # 20 MiB: six staged blocks
    state = {"big": torch.randn(5 << 20), "small": torch.arange(10), "v": "x"}
    with Checkpointer(az_url, keep_last=1) as ck:
        ck.save(state, 1, {"rank": 0})
        ck.wait(retention=True)
        dirname = ck.records[-1].dirname
    prefix, size = az_url.removeprefix("abfs://ckpt/"), open_storage(az_url).size(f"{dirname}/rank-00000.bin")
    blocks = azurite.committed_blocks(azurite_server, "ckpt", f"{prefix}/{dirname}/rank-00000.bin")
    assert size > 20 << 20 and blocks == -(-size // (4 << 20)), (size, blocks)
    crashed = "step-000000000002-" + "0" * 35
    open_storage(az_url).write_stream(f"{crashed}/rank-00000.bin", [b"a crashed run's bytes"])
    with Checkpointer(az_url) as ck:  # a writable start sweeps
        assert attempt_dirs(ck.storage) == [dirname]
        assert_same(ck.load(), state)
        assert ck.load_local() == {"rank": 0}


def test_polling_pauses_double_up_to_the_cap_of_the_storage_kind(tmp_path, memory_url):
    """Local listings are system calls, object-store ones billed requests: each kind has its caps."""
    from itertools import islice

    from ckpt_engine.storage import poll

    local, remote = open_storage(str(tmp_path)).polling, open_storage(memory_url).polling
    assert (local, remote) == (poll.LOCAL, poll.OBJECT_STORE)
    assert list(islice(local.commit.pauses(), 5)) == [0.002, 0.004, 0.008, 0.01, 0.01]
    assert list(islice(remote.flush.pauses(), 9))[-2:] == [0.5, 0.5]
    for p in (local, remote):
        assert p.commit.cap <= p.flush.cap  # a save's commit waits no longer than a background flush
