"""Memory on the way back in: a checkpoint that claims more memory than this process can have is
refused before anything is allocated, as an :class:`InsufficientMemoryError` (a
:class:`CheckpointError`) naming the file, the tensor, the bytes needed and the bytes available,
and ``load(into=...)`` as the way out; by ``load()``, ``restore()``, ``ckpt verify`` and ``ckpt
export`` alike. The bounds (``MemAvailable``, cgroup v1/v2, ``RLIMIT_AS``) are parsed by pure
functions tested on text, and read from a fake ``/proc`` and cgroup tree.

The hostile checkpoints are real ones whose index and manifest are rewritten and re-sealed, with a
sparse data file (``helpers.claim_bytes``): no disk used, and a spy on the allocator shows that
nothing large is allocated.
"""

from __future__ import annotations

import os
import resource

import pytest
import torch
from helpers import claim_bytes

from ckpt_engine import Checkpointer, CheckpointError, InsufficientMemoryError
from ckpt_engine.cli import main
from ckpt_engine.format.catalog import manifest_dirs
from ckpt_engine.host import headroom, hugepages
from ckpt_engine.host.headroom import Headroom
from ckpt_engine.storage import open_storage

TIB = 1 << 40


# ---- pure parts -------------------------------------------------------------------------------------
def test_meminfo_available_is_read_in_bytes():
    text = "MemTotal:       24684084 kB\nMemFree:  1 kB\nMemAvailable:   20382276 kB\nBuffers: 5 kB\n"
    assert headroom.meminfo_available(text) == 20382276 * 1024
    assert headroom.meminfo_available("MemTotal: 5 kB\n") is None  # kernels before 3.14
    assert headroom.meminfo_available("MemAvailable: lots kB\n") is None


@pytest.mark.parametrize("limit, usage, room", [
    ("1073741824\n", "1000\n", 1073741824 - 1000),
    ("max\n", "1000\n", None),                          # v2: no limit
    ("9223372036854771712\n", "5099470848\n", None),     # v1: no limit
    ("1000\n", "5000\n", 0),                            # over the limit (reclaim pending): no room
    ("", "5", None), ("12", "x", None),
])
def test_cgroup_room(limit, usage, room):
    assert headroom.cgroup_room(limit, usage) == room


def test_cgroup_paths_of_v2_v1_and_hybrid():
    assert headroom.cgroup_paths("0::/user.slice/job.scope\n") == ("/user.slice/job.scope", None)
    hybrid = "9:name=systemd:/\n4:memory:/process_api/e0\n3:cpu,cpuacct:/\n0::/\n"
    assert headroom.cgroup_paths(hybrid) == ("/", "/process_api/e0")
    assert headroom.cgroup_paths("5:cpu,memory:/pod/c1\n") == (None, "/pod/c1")
    assert headroom.cgroup_paths("") == (None, None)


def test_rlimit_room_and_the_tightest_bound():
    assert headroom.rlimit_room(resource.RLIM_INFINITY, 5 << 30) is None
    assert headroom.rlimit_room(3 << 30, 1 << 30) == 2 << 30
    assert headroom.rlimit_room(1 << 30, 3 << 30) == 0
    assert headroom.tightest([("a", None), ("b", 7), ("c", 5)]) == Headroom(5, "c")
    assert headroom.tightest([("a", None)]) is None


def test_ancestors_stay_below_the_root():
    assert headroom.ancestors("/cg", "/a/b") == ["/cg/a/b", "/cg/a", "/cg"]
    assert headroom.ancestors("/cg", "/") == ["/cg"]
    assert headroom.ancestors("/cg", "/../a") == ["/cg/a", "/cg"]


# ---- reading the system (a fake /proc and cgroup tree) -----------------------------------------------
def _files(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)


@pytest.fixture
def unlimited_as(monkeypatch):
    monkeypatch.setattr(headroom.resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)


def test_available_takes_the_tightest_cgroup_v2_level(tmp_path, unlimited_as):
    _files(tmp_path, {"proc/meminfo": "MemAvailable: 8000000 kB\n", "proc/self/cgroup": "0::/kubepods/pod1/c1\n",
                      "cg/kubepods/pod1/c1/memory.max": "max\n", "cg/kubepods/pod1/c1/memory.current": "10\n",
                      "cg/kubepods/pod1/memory.max": "3000000000\n", "cg/kubepods/pod1/memory.current": "1000000000\n"})
    room = headroom.available(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert room is not None and room.bytes == 2_000_000_000 and "kubepods/pod1: memory.max" in room.source


def test_available_reads_cgroup_v1_in_a_hybrid_layout_and_a_namespaced_path(tmp_path, unlimited_as):
    _files(tmp_path, {"proc/meminfo": "MemAvailable: 8000000 kB\n",
                      "proc/self/cgroup": "4:memory:/host/path/hidden\n0::/\n",
                      "cg/unified/cgroup.procs": "",
                      "cg/memory/memory.limit_in_bytes": "1500000000\n",
                      "cg/memory/memory.usage_in_bytes": "500000000\n"})
    room = headroom.available(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert room is not None and room.bytes == 1_000_000_000 and "memory.limit_in_bytes" in room.source


def test_available_is_memavailable_without_a_limit_and_none_without_anything(tmp_path, unlimited_as):
    _files(tmp_path, {"proc/meminfo": "MemAvailable: 1000 kB\n", "proc/self/cgroup": "0::/\n",
                      "cg/memory.max": "max\n", "cg/memory.current": "5\n"})
    assert headroom.available(str(tmp_path / "proc"), str(tmp_path / "cg")) == Headroom(
        1024000, "MemAvailable in /proc/meminfo")
    assert headroom.available(str(tmp_path / "nothing"), str(tmp_path / "nothing")) is None


def test_available_counts_rlimit_as_less_what_is_mapped(tmp_path, monkeypatch):
    _files(tmp_path, {"proc/meminfo": "MemAvailable: 8000000 kB\n", "proc/self/statm": "1000 10 0 0 0 0 0\n"})
    monkeypatch.setattr(headroom.resource, "getrlimit", lambda which: (3 << 30, resource.RLIM_INFINITY))
    room = headroom.available(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert room is not None and room.bytes == (3 << 30) - 1000 * os.sysconf("SC_PAGE_SIZE")
    assert room.source.startswith("RLIMIT_AS")


def test_this_machine_has_a_bound():
    room = headroom.available()
    assert room is not None and 0 < room.bytes < TIB


# ---- hostile checkpoints ----------------------------------------------------------------------------
def write(root: str) -> str:
    ck = Checkpointer(root)
    for s in (1, 2):
        ck.save({"model": {"w": torch.full((64, 8), float(s)), "b": torch.full((3,), float(s))}, "step": s}, s,
                {"bn": torch.full((5,), float(s))})
    ck.close()
    return root


@pytest.fixture
def root(tmp_path) -> str:
    return write(str(tmp_path / "ck"))


@pytest.fixture
def allocations(monkeypatch) -> list[int]:
    """Bytes of every tensor the restore allocates (restore._empty goes through hugepages.empty)."""
    seen: list[int] = []
    real = hugepages.empty

    def spy(shape, dtype):
        seen.append(int(torch.Size(shape).numel()) * dtype.itemsize)
        return real(shape, dtype)

    monkeypatch.setattr(hugepages, "empty", spy)
    return seen


def _newest(root: str) -> str:
    return manifest_dirs(open_storage(root))[-1][1]


def _names_everything(message: str, root: str, dirname: str, tensor: str, needed: int, room: int | None = None) -> None:
    assert os.path.join(root, dirname, "manifest.json") in message, message
    assert f"tensor {tensor}" in message and f"needs {needed} bytes" in message, message
    assert (f"can have {room} more bytes" if room is not None else "more bytes (") in message, message
    assert "load(into=" in message, message


def test_a_terabyte_claim_is_refused_by_load_restore_verify_and_export_before_allocating(
        root, tmp_path, allocations, capsys):
    newest = _newest(root)
    tensor = claim_bytes(root, newest, 0, TIB)
    needed = TIB + 12 + 20  # the claim, the other replicated tensor, writer 0's local tensor

    with pytest.raises(InsufficientMemoryError) as err:
        Checkpointer(root, readonly=True).load()
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, MemoryError)
    _names_everything(str(err.value), root, newest, tensor, needed)

    ck = Checkpointer(root, readonly=True)  # the fallback skips it, recorded, for the older checkpoint
    assert ck.load(fallback=True)["step"] == 1 and "needs" in ck.load_failures[0]
    assert ck.restore().step == 1

    assert main(["verify", root]) == 1
    _names_everything(capsys.readouterr().err, root, newest, tensor, TIB + 12)  # the state, then each local
    out = tmp_path / "out.pt"
    assert main(["export", root, str(out), "--include-local"]) == 2
    _names_everything(capsys.readouterr().err, root, newest, tensor, needed)
    assert not out.exists()
    assert max(allocations, default=0) < 1 << 20, allocations


def test_a_claim_beyond_what_is_available_is_refused_without_the_read(root, allocations, monkeypatch):
    """The 1.5 GiB case: it would fit this machine, so the bound is made 1 GiB to keep the test light;
    before, it allocated the claim and read it whole before the checksum failed."""
    newest = _newest(root)
    tensor = claim_bytes(root, newest, 0, 1536 << 20)
    monkeypatch.setattr(headroom, "available", lambda: Headroom(1 << 30, "a test's bound"))
    with pytest.raises(InsufficientMemoryError) as err:
        Checkpointer(root, readonly=True).load()
    _names_everything(str(err.value), root, newest, tensor, (1536 << 20) + 12 + 20, 1 << 30)
    assert "a test's bound" in str(err.value)
    assert max(allocations, default=0) < 1 << 20, allocations


def test_the_check_sums_every_tensor_one_call_allocates(root, allocations, monkeypatch):
    """The state fits, writer 0's local fits, both together do not: refused before either is allocated."""
    state_bytes, local_bytes = 64 * 8 * 4 + 3 * 4, 5 * 4
    monkeypatch.setattr(headroom, "CHECK_FROM", 0)
    monkeypatch.setattr(headroom, "available", lambda: Headroom(state_bytes + local_bytes - 1, "a test's bound"))
    with pytest.raises(InsufficientMemoryError, match=f"needs {state_bytes + local_bytes} bytes .* 3 tensors, "
                                                      r"the largest tensor 'state\['model'\]\['w'\]' of 2048 bytes"):
        Checkpointer(root, readonly=True).load()
    with pytest.raises(InsufficientMemoryError, match=f"needs {state_bytes + local_bytes} bytes"):
        Checkpointer(root, readonly=True).restore(fallback=False)
    assert allocations == []
    monkeypatch.setattr(headroom, "available", lambda: Headroom(state_bytes + local_bytes, "a test's bound"))
    assert Checkpointer(root, readonly=True).load()["step"] == 2


def test_an_allocation_the_allocator_refuses_is_the_same_error(root, monkeypatch):
    """Where no bound can be read (another OS), torch's RuntimeError still comes out as the family's error."""
    newest = _newest(root)
    tensor = claim_bytes(root, newest, 0, TIB)
    monkeypatch.setattr(headroom, "available", lambda: None)

    def refuse(shape, dtype):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(hugepages, "empty", refuse)
    with pytest.raises(InsufficientMemoryError, match="the allocator refused") as err:
        Checkpointer(root, readonly=True).load()
    assert tensor in str(err.value) and os.path.join(root, newest, "manifest.json") in str(err.value)
    assert isinstance(err.value.__cause__, RuntimeError)


def test_load_into_the_callers_tensors_allocates_nothing_for_them(root, allocations, monkeypatch):
    """The way out the error names: a state already held is filled in place, so a bound below the
    checkpoint's size does not refuse it."""
    monkeypatch.setattr(headroom, "CHECK_FROM", 0)
    monkeypatch.setattr(headroom, "available", lambda: Headroom(100, "a test's bound"))
    into = {"model": {"w": torch.zeros(64, 8), "b": torch.zeros(3)}, "step": 0}
    assert Checkpointer(root, readonly=True).load(into=into) is into
    assert into["step"] == 2 and torch.equal(into["model"]["w"], torch.full((64, 8), 2.0))


# ---- verified as the bytes land ---------------------------------------------------------------------
def test_a_run_stops_at_the_first_piece_whose_checksum_fails(tmp_path, monkeypatch):
    """Reads of several pieces in one run are hashed request by request, and each piece is checked
    as soon as its last byte lands: a damaged first piece ends the read there, not after the run."""
    from ckpt_engine import CorruptionError
    from ckpt_engine.storage import local

    root = str(tmp_path / "ck")
    ck = Checkpointer(root)
    ck.save({f"t{i}": torch.full((16 << 10,), float(i)) for i in range(6)}, 1)  # 6 pieces of 64 KiB
    ck.close()
    dirname = _newest(root)
    data = os.path.join(root, dirname, "rank-00000.bin")
    raw = bytearray(open(data, "rb").read())
    raw[10] ^= 1  # the first piece
    open(data, "wb").write(bytes(raw))
    monkeypatch.setattr(local.LocalReader, "verify_step", 16 << 10)
    read: list[int] = []
    real = local.LocalReader._read_many

    def counting(self, offset, dests):
        got = real(self, offset, dests)
        read.append(got)
        return got

    monkeypatch.setattr(local.LocalReader, "_read_many", counting)
    monkeypatch.setattr(local.LocalReader, "_read", lambda self, offset, dest: counting(self, offset, [dest]))
    with pytest.raises(CorruptionError, match=r"rank-00000\.bin: checksum mismatch in tensor 'state\['t0'\]'"):
        Checkpointer(root, readonly=True, read_threads=1).load()
    assert sum(read) == 64 << 10, read  # the first piece's four requests, none of the next five pieces
