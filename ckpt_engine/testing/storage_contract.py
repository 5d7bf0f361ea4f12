"""The storage conformance suite: every public method of :class:`~ckpt_engine.storage.Storage` on one
backend, errors included, as pytest tests. The project runs it on every backend it ships (local
disk, ``memory://``, fsspec's local filesystem through ``dir::``, S3 on a moto server, Azure on
azurite); a backend of your own runs it the same way (``pytest`` needed)::

    import uuid
    import pytest
    from ckpt_engine.testing.storage_contract import StorageContract

    class TestMyStore(StorageContract):
        @pytest.fixture
        def url(self):
            return f"mystore://bucket/run-{uuid.uuid4().hex}"   # a fresh, empty root per test

        storage_options = {"endpoint_url": "http://127.0.0.1:9000"}   # optional

Each test opens the root the ``url`` fixture gives with :meth:`StorageContract.open`:
``open_storage(url, storage_options)``, the implementation the engine would pick. A storage class of
your own (a ``Storage`` subclass, or a :class:`~ckpt_engine.storage.StorageWrapper` that must behave as
what it wraps) overrides ``open``::

    class TestMyWrapper(StorageContract):
        def open(self, url):
            return MyWrapper(open_storage(url))

What differs by backend is asked of the storage itself (``can_append``, ``free_bytes()``), never of its
name.

The tests, by what they check: the URL, ``path``, ``describe`` and the settings (``protocol``,
``polling``, ``can_append``, ``retry_deadline``, ``in_memory``); ``child`` and pickling; ``makedirs``;
``write_stream`` (sequences, iterators, fresh-pass iterables, a failing one); ``write_atomic``;
``append`` or its refusal; ``remove``; ``abort_uploads``; ``read_bytes``, ``size``, ``regular_size``,
``exists``; a directory refused where a file is read; ``read_bytes``'s limit; a missing file; the
:class:`~ckpt_engine.storage.Reader` (``read_into``, ``read_many``, ``read_steps``, ``mapped``,
``run_max``, ``verify_step``, ``close``, a short file); ``listdir``, ``entries``, ``usage``;
``free_bytes``; ``stale_temp_files``; ``run``.
"""

from __future__ import annotations

import pickle
from typing import Any, ClassVar, Iterator

import pytest

from ..errors import CheckpointError, FormatError, StorageError
from ..storage import Reader, Storage, open_storage
from ..storage.base import TMP_PREFIX
from ..storage.poll import Polling


def _fail_io() -> None:
    raise OSError(5, "Input/output error (injected)")


class _Again:
    """An iterable whose every ``iter()`` is a fresh pass: ``write_stream`` consumes it lazily."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks, self.passes = chunks, 0

    def __iter__(self) -> Iterator[bytes]:
        self.passes += 1
        return iter(self.chunks)


class StorageContract:
    """Subclass it with a ``url`` fixture (a fresh root per test) and, if needed, ``storage_options``."""

    storage_options: ClassVar[dict[str, Any]] = {}

    def open(self, url: str) -> Storage:
        """The storage under test at ``url`` (override it for a class ``open_storage`` does not return)."""
        return open_storage(url, dict(self.storage_options))

    # ---- naming and settings --------------------------------------------------------------------
    def test_paths_describe_and_settings(self, url: str) -> None:
        st = self.open(url)
        assert st.url == url and isinstance(st.protocol, str) and st.protocol
        assert st.path("a", "b") == st.path("a/b") and st.path("a/b").endswith("a/b")
        assert st.path().rstrip("/") == st.path("").rstrip("/")  # the root
        assert st.describe("a/b").endswith("a/b") and st.describe("a/b") != st.describe("a")
        assert isinstance(st.polling, Polling) and isinstance(st.can_append, bool)
        assert isinstance(st.retry_deadline, (int, float)) and st.retry_deadline >= 0
        assert st.in_memory is False  # only a memory level sets it (levels/open.py)

    def test_a_child_is_rooted_below_shares_the_files_and_pickles(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("d/sub")
        st.write_stream("d/sub/a.bin", [b"x" * 10])
        child = st.child("d")
        assert type(child) is type(st) and child.url == f"{url.rstrip('/')}/d"
        assert child.read_bytes("sub/a.bin") == b"x" * 10 and child.describe("sub") == st.describe("d/sub")
        assert child.describe("").rstrip("/") == st.describe("d").rstrip("/")
        child.write_atomic("sub/b.json", b"{}")  # the child writes where its parent reads
        assert st.read_bytes("d/sub/b.json") == b"{}" and st.listdir("d/sub") == ["a.bin", "b.json"]
        grandchild = child.child("sub")
        assert grandchild.read_bytes("a.bin") == b"x" * 10 and grandchild.url == f"{url.rstrip('/')}/d/sub"
        for one in (st, child):  # a storage travels to a process or thread as it is
            again = pickle.loads(pickle.dumps(one))
            assert type(again) is type(one) and again.describe("") == one.describe("") and again.url == one.url
        assert pickle.loads(pickle.dumps(child)).read_bytes("sub/a.bin") == b"x" * 10

    # ---- writing --------------------------------------------------------------------------------
    def test_makedirs_is_idempotent_and_creates_the_root(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("")
        st.makedirs("a/b/c")
        st.makedirs("a/b/c")
        st.write_atomic("a/b/c/f", b"1")
        assert st.listdir("a") == ["b"] and st.read_bytes("a/b/c/f") == b"1"

    def test_write_stream_takes_bytes_memoryviews_iterators_and_fresh_pass_iterables(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("d")
        assert st.write_stream("d/a.bin", [memoryview(b"hello "), b"world"]) == 11
        assert st.write_stream("d/b.bin", iter([b"ab", b"cd"]), sync_dir=False) == 4
        lazy = _Again([b"x" * 1000, b"y" * 24])
        assert st.write_stream("d/c.bin", lazy) == 1024 and lazy.passes >= 1
        assert st.write_stream("d/empty.bin", []) == 0
        assert (st.read_bytes("d/a.bin"), st.read_bytes("d/b.bin")) == (b"hello world", b"abcd")
        assert st.read_bytes("d/c.bin") == b"x" * 1000 + b"y" * 24 and st.size("d/empty.bin") == 0
        assert st.write_stream("d/a.bin", [b"new"]) == 3 and st.read_bytes("d/a.bin") == b"new"  # replaced

    def test_a_failed_stream_is_a_storage_error_naming_the_file_and_can_be_removed(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("d")

        def broken() -> Iterator[bytes]:
            yield b"a" * 100
            raise OSError(28, "No space left on device (injected)")

        with pytest.raises(StorageError, match=r"d/f\.bin.*No space left on device"):
            st.write_stream("d/f.bin", broken())
        st.remove("d/f.bin")  # what a failed save does with what the write left (save/failure.py)
        assert not st.exists("d/f.bin") and st.size("d/f.bin") is None

    def test_write_atomic_replaces_durable_or_not_and_leaves_no_temporary(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("d")
        st.write_atomic("d/m.json", b"1")
        st.write_atomic("d/m.json", b"22")
        st.write_atomic("d/hint", b"7", durable=False)
        assert st.read_bytes("d/m.json") == b"22" and st.read_bytes("d/hint") == b"7"
        assert st.listdir("d") == ["hint", "m.json"] and list(st.stale_temp_files("d")) == []

    def test_append_where_the_storage_can_and_a_clear_refusal_elsewhere(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("")
        if st.can_append:
            st.append("f.jsonl", b"1\n")
            st.append("f.jsonl", b"2\n")
            assert st.read_bytes("f.jsonl") == b"1\n2\n"
        else:
            with pytest.raises(StorageError, match="has no append"):
                st.append("f.jsonl", b"1\n")

    def test_remove_files_and_trees_and_a_missing_one_quietly(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("d/sub")
        st.write_stream("d/sub/a.bin", [b"a"])
        st.write_atomic("d/m.json", b"{}")
        st.write_atomic("keep", b"1")
        st.remove("d/m.json")
        assert not st.exists("d/m.json") and st.exists("d/sub/a.bin")
        st.remove("d")
        st.remove("d")
        st.remove("never/was")
        assert not st.exists("d/sub/a.bin") and st.listdir("d") == [] and st.listdir() == ["keep"]

    def test_abort_uploads_lists_what_it_aborted(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("")
        st.write_stream("a.bin", [b"a" * 10])
        aborted = st.abort_uploads()
        assert isinstance(aborted, list) and all(isinstance(k, str) for k in aborted)
        assert st.read_bytes("a.bin") == b"a" * 10  # a finished file is not an upload

    # ---- reading --------------------------------------------------------------------------------
    def test_read_bytes_sizes_and_existence(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("d")
        st.write_stream("d/f.bin", [b"0123456789"])
        assert st.read_bytes("d/f.bin") == b"0123456789"
        assert st.size("d/f.bin") == st.regular_size("d/f.bin") == 10
        assert st.exists("d/f.bin") and st.exists("d") and not st.exists("d/nope")
        assert st.size("d/nope") is None and st.regular_size("d/nope") is None

    def test_a_directory_is_refused_where_a_file_is_read(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("d/sub")
        st.write_stream("d/sub/a.bin", [b"x"])
        with pytest.raises(FormatError, match=r"d/sub.*directory"):
            st.regular_size("d/sub")
        with pytest.raises(FormatError, match=r"d/sub.*directory"):
            st.read_bytes("d/sub")
        with pytest.raises(CheckpointError, match="d/sub"):  # refused (local) or failing to read (object stores)
            with st.reader("d/sub") as r:
                r.read_into(0, memoryview(bytearray(1)))

    def test_read_bytes_refuses_more_than_its_limit_naming_the_file(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("")
        st.write_stream("big.json", [b"x" * 2048])
        with pytest.raises(FormatError, match="big.json"):
            st.read_bytes("big.json", limit=1024)

    def test_a_missing_file_is_a_storage_error_naming_it(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("")
        with pytest.raises(StorageError, match="could not read .*missing.bin"):
            st.read_bytes("missing.bin")
        with pytest.raises(StorageError, match="missing.bin"):
            with st.reader("missing.bin") as r:
                r.read_into(0, memoryview(bytearray(1)))

    def test_reader_ranges_scatter_reads_steps_and_a_short_file(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("")
        data = bytes(range(256)) * 64  # 16 KiB
        st.write_stream("f.bin", [data])
        with st.reader("f.bin") as r:
            one = bytearray(100)
            r.read_into(1000, memoryview(one))
            assert one == data[1000:1100]
            parts = [bytearray(10), bytearray(0), bytearray(4000)]
            r.read_many(5, [memoryview(p) for p in parts])
            assert b"".join(parts) == data[5:4015]
            landed: list[int] = []
            steps = [[memoryview(bytearray(3))], [memoryview(bytearray(7)), memoryview(bytearray(5))]]
            r.read_steps(16000, steps, landed.append)
            assert landed == [0, 1] and b"".join(bytes(m) for req in steps for m in req) == data[16000:16015]
            assert isinstance(r, Reader) and r.mapped() is None  # mapped only where the files are in memory
            assert isinstance(r.run_max, int) and r.run_max > 0
            assert r.verify_step is None or (isinstance(r.verify_step, int) and r.verify_step > 0)
            with pytest.raises(StorageError, match=r"f.bin.*file ends after 16384 bytes"):
                r.read_into(16380, memoryview(bytearray(10)))
        r.close()  # closing again is fine
        st.in_memory = True  # what a memory level sets: a reader may map the file instead of reading it
        with st.reader("f.bin") as r:
            mapped = r.mapped()
            assert mapped is None or bytes(mapped) == data
            del mapped
            whole = bytearray(len(data))
            r.read_into(0, memoryview(whole))
            assert whole == data

    def test_listing_entries_and_usage_are_fresh_and_sorted(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("d/sub")
        st.write_stream("d/sub/a.bin", [b"x" * 10])
        st.write_atomic("d/b.json", b"{}")
        st.write_atomic("top", b"1")
        assert st.listdir() == ["d", "top"] and st.listdir("d") == ["b.json", "sub"] and st.listdir("nope") == []
        assert st.entries() == [("d", "a directory"), ("top", "a file")]
        size, mtime = st.usage("d")
        assert size == 12 and mtime is not None and st.usage("nope") == (0, None)
        assert st.usage("top")[0] == 1
        st.write_atomic("d/c.json", b"[]")  # a second listing sees it: no stale cache
        assert st.listdir("d") == ["b.json", "c.json", "sub"] and st.usage("d")[0] == 14
        assert st.entries("nope") == [] and st.entries("d/sub") == [("a.bin", "a file")]

    def test_free_bytes_is_a_count_or_unknown(self, url: str) -> None:
        free = self.open(url).free_bytes()
        assert free is None or (isinstance(free, int) and free >= 0)

    def test_stale_temporary_files_are_listed(self, url: str) -> None:
        st = self.open(url)
        st.makedirs("d")
        st.write_stream(f"d/{TMP_PREFIX}m.json.1234", [b"half"])  # what a crashed write_atomic leaves
        st.write_atomic("d/m.json", b"{}")
        assert list(st.stale_temp_files("d")) == [f"d/{TMP_PREFIX}m.json.1234"]
        st.write_stream(f"{TMP_PREFIX}latest.1", [b"7"])
        assert list(st.stale_temp_files()) == [f"{TMP_PREFIX}latest.1"] and list(st.stale_temp_files("nope")) == []

    # ---- the hook every operation goes through --------------------------------------------------
    def test_run_turns_backend_errors_into_storage_errors_naming_action_and_path(self, url: str) -> None:
        st = self.open(url)
        assert st.run("read", "a.bin", lambda: 7) == 7
        with pytest.raises(StorageError, match=r"could not write .*a\.bin: OSError: \[Errno 5\]") as caught:
            st.run("write", "a.bin", _fail_io)
        assert isinstance(caught.value, CheckpointError) and isinstance(caught.value, OSError)
