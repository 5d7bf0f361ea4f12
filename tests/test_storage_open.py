"""Opening a root (``open_storage``), the deprecated ``Storage(url)``, and ``StorageWrapper``: the
conformance suite over a plain wrapper, a wrapper that behaves as what it wraps, the doubles' children
and pickling."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import ckpt_engine
from ckpt_engine import Checkpointer, StorageError
from ckpt_engine.storage import FsspecStorage, LocalStorage, Storage, StorageWrapper, open_storage
from ckpt_engine.testing import CountingStorage, CrashStorage, FailingStorage, GatedStorage, SlowStorage
from ckpt_engine.testing.storage_contract import StorageContract


class TestStorageWrapperContract(StorageContract):
    """A plain ``StorageWrapper`` passes the whole contract on every backend: it is the storage it wraps."""

    @pytest.fixture
    def url(self, any_url):
        return any_url

    def open(self, url):
        return StorageWrapper(open_storage(url, dict(self.storage_options)))


@pytest.mark.parametrize("url, implementation", [
    ("{tmp}/ck", LocalStorage), ("file://{tmp}/ck", LocalStorage), ("local://{tmp}/ck", LocalStorage),
    ("memory://open-{name}", FsspecStorage), ("dir::file://{tmp}", FsspecStorage)])
def test_open_storage_picks_the_implementation_by_the_filesystem_of_the_url(tmp_path, url, implementation):
    url = url.format(tmp=tmp_path, name=tmp_path.name)
    st = open_storage(url, retry_deadline=3)
    assert type(st) is implementation and st.url == url and st.retry_deadline == 3
    assert ckpt_engine.open_storage is open_storage and repr(st) == f"{implementation.__name__}({url!r})"
    st.makedirs("")
    st.write_atomic("f", b"1")
    assert open_storage(url).read_bytes("f") == b"1"
    assert type(open_storage(tmp_path / "p")) is LocalStorage  # a path object too


def test_open_storage_names_the_url_it_cannot_open():
    with pytest.raises(StorageError, match="cannot open checkpoint path 'nosuchprotocol://x'"):
        open_storage("nosuchprotocol://x")


def test_storage_of_a_url_still_opens_it_with_a_deprecation_warning(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"Storage\(url\) is deprecated; use ckpt_engine.open_storage") as w:
        st = Storage(str(tmp_path), None, retry_deadline=2)
    assert w[0].filename == __file__  # the warning points at the caller's line
    assert type(st) is LocalStorage and st.url == str(tmp_path) and st.retry_deadline == 2
    with pytest.warns(DeprecationWarning):
        mem = Storage(f"memory://deprecated-{tmp_path.name}", storage_options={})
    assert type(mem) is FsspecStorage and mem.protocol == "memory"
    with Checkpointer(st) as ck:
        ck.save({"w": torch.arange(4)}, 1)
        ck.wait()
        assert torch.equal(ck.load()["w"], torch.arange(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither open_storage nor an implementation's own constructor warns
        assert type(open_storage(str(tmp_path))) is type(LocalStorage(str(tmp_path))) is LocalStorage


def test_a_storage_subclass_that_implements_nothing_is_told_to_wrap():
    class OldStyleFault(Storage):  # the way a fault was injected before StorageWrapper
        def write_stream(self, rel, chunks, **kw):
            return super().write_stream(rel, chunks, **kw)

    with pytest.raises(TypeError, match=r"OldStyleFault subclasses Storage without implementing .*'listdir'.*"
                                        r"subclass ckpt_engine.StorageWrapper .*OldStyleFault\(open_storage\(url\)\)"):
        OldStyleFault("/tmp/x")


def test_a_wrapper_behaves_as_the_storage_it_wraps(tmp_path):
    inner = open_storage(str(tmp_path))
    wrapped = StorageWrapper(StorageWrapper(inner))
    assert (wrapped.url, wrapped.protocol, wrapped.polling, wrapped.can_append) == (
        inner.url, "file", inner.polling, True)
    assert repr(wrapped) == f"StorageWrapper(StorageWrapper(LocalStorage({str(tmp_path)!r})))"
    wrapped.in_memory = True  # set by a memory level: the inner storage's readers are the ones that map
    assert inner.in_memory and wrapped.in_memory
    wrapped.write_stream("f.bin", [b"abc"])
    with wrapped.reader("f.bin") as r:
        assert bytes(r.mapped()) == b"abc"
    assert StorageWrapper(str(tmp_path), retry_deadline=4).retry_deadline == 4  # a URL is opened for it
    with pytest.raises(TypeError, match="open a URL; .* is open already"):
        StorageWrapper(inner, {"anon": True})
    with pytest.raises(TypeError, match="wraps a Storage or opens a URL, not int"):
        StorageWrapper(3)


def test_a_doubles_child_is_the_same_double_sharing_its_state(tmp_path):
    """A rank's subtree of a node-local level is a child: the double's gate, counts and fault go with it."""
    root = open_storage(str(tmp_path))
    root.makedirs("rank-00001")
    root.write_stream("rank-00001/x.bin", [b"0123456789"])
    counting = CountingStorage(root)
    child = counting.child("rank-00001")
    assert type(child) is CountingStorage and child.path("x.bin") == root.path("rank-00001/x.bin")
    with child.reader("x.bin") as r:
        r.read_into(2, memoryview(bytearray(5)))
    assert counting.data_read == child.data_read == 5
    slow = SlowStorage(root, delay=0.001)
    slow.child("rank-00001").write_stream("y.bin", [b"y"])
    assert slow.max_active == 1 and slow.active == 0 and root.read_bytes("rank-00001/y.bin") == b"y"
    gated = GatedStorage(root)
    assert gated.child("rank-00001").gate is gated.gate
    failing = FailingStorage(root, fail_on=".bin")
    with pytest.raises(StorageError, match="No space left on device"):
        pickle.loads(pickle.dumps(failing.child("rank-00001"))).write_stream("z.bin", [b"z" * 10])


def test_crash_instants_inside_an_atomic_write_need_a_storage_that_renames_below_its_wrappers(tmp_path):
    assert CrashStorage(GatedStorage(str(tmp_path)), instant="torn-latest", step=1).instant == "torn-latest"
    with pytest.raises(ValueError, match="writes a file in one request"):
        CrashStorage(GatedStorage(f"memory://crash-{tmp_path.name}"), instant="torn-latest", step=1)
