"""Huge pages under the engine's large fresh allocations (hugepages.py): advised where it pays,
never where it cannot, and nothing changes but speed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, strategies as st

from ckpt_engine import Checkpointer
from ckpt_engine.host import hugepages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_large_fresh_cpu_tensors_are_advised_and_small_ones_are_not():
    big = torch.empty(hugepages.MIN_BYTES // 4, dtype=torch.float32)
    assert hugepages.advise(big)
    assert not hugepages.advise(torch.empty(1024))  # below MIN_BYTES
    t = hugepages.empty((3, hugepages.MIN_BYTES), torch.uint8)
    assert t.shape == (3, hugepages.MIN_BYTES) and t.dtype == torch.uint8
    t.fill_(7)
    assert int(t.sum()) == 7 * t.numel()


@pytest.mark.slow
def test_turned_off_by_the_environment():
    code = ("import torch; from ckpt_engine.host import hugepages; "
            "print(hugepages.advise(torch.empty(hugepages.MIN_BYTES)))")
    out = subprocess.run([sys.executable, "-c", code], env={"CKPT_HUGEPAGES": "0", "PATH": ""},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_save_from_a_huge_page_buffer_restores_bit_identical(tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(3, hugepages.MIN_BYTES // 4 + 17, generator=g), "small": torch.arange(5)}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1)
        ck.wait()
        back = ck.load()
    assert torch.equal(back["big"], state["big"]) and torch.equal(back["small"], state["small"])


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_a_load_returns_large_tensors_advised_to_huge_pages(tmp_path):
    """Restored tensors are filled once, at once, like a snapshot buffer: a page fault per 2 MiB
    instead of per 4 KiB (from the page cache 1 GiB read in 0.31 s instead of 0.61 s here)."""
    state = {"big": torch.randn(4 * hugepages.MIN_BYTES // 4), "small": torch.randn(100)}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1)
        ck.wait()
        back = ck.load()
    assert torch.equal(back["big"], state["big"]) and torch.equal(back["small"], state["small"])
    middle = back["big"].data_ptr() + back["big"].numel() * 4 // 2
    assert "hg" in _vm_flags(middle), _vm_flags(middle)


def _thp_advisable() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _thp_advisable(),
                    reason="needs Linux transparent huge pages (madvise or always)")
def test_a_large_tensor_is_huge_pages_from_its_first_byte_to_its_last(tmp_path):
    """torch's allocator aligns to 64 bytes, so advising a tensor from it left its first and last
    partial 2 MiB in 4 KiB pages: 1/8 of a restored 16 MiB tensor (about 4,000 minor faults for 8 of
    them, where huge pages take 64). A large ``empty`` starts on a 2 MiB boundary of a mapping
    of its own (its storage exactly its bytes), and a restore of 16 MiB tensors faults a few times per
    tensor, not 512."""
    import resource

    t = hugepages.empty((hugepages.MIN_BYTES * 2 // 4,), torch.float32)
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert t.untyped_storage().nbytes() == t.numel() * 4 and t.storage_offset() == 0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(1.0)
    # 8 huge pages, and a few faults of the interpreter and torch's threads (11 under xdist); the
    # partial 2 MiB at the ends of a 64-byte-aligned tensor alone would be ~512, 4 KiB pages 4096
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults <= 64
    assert float(t.sum()) == t.numel()

    state = {f"w{i}": torch.randn(4 << 20) for i in range(8)}  # 8 x 16 MiB
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1)
        ck.wait()
        ck.load()  # once, so the second load's faults are its own
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        back = ck.load()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert all(v.data_ptr() % hugepages.HUGE_PAGE == 0 for v in back.values())
    assert faults < 8 * 64, faults  # 4 KiB head and tail pages alone would be ~8 x 512


@given(st.integers(min_value=hugepages.MIN_BYTES, max_value=1 << 40))
def test_the_last_partial_huge_page_is_taken_when_the_tensor_fills_half_of_it(nbytes):
    """A tail in 4 KiB pages costs a fault per 4 KiB (~30,000 of a 1 GiB restore of 15.8 MiB
    tensors); a huge page for it costs memory the tensor does not use: at most 1 MiB, and less than
    the tail holds."""
    n = hugepages.advised_bytes(nbytes)
    assert n % hugepages.HUGE_PAGE == 0
    assert nbytes - hugepages.HUGE_PAGE < n
    if n > nbytes:
        assert n - nbytes <= hugepages.HUGE_PAGE // 2 and n - nbytes <= nbytes - (n - hugepages.HUGE_PAGE)
    else:
        assert nbytes - n < hugepages.HUGE_PAGE // 2  # a tail under half a huge page stays in 4 KiB pages


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _thp_advisable(),
                    reason="needs Linux transparent huge pages (madvise or always)")
def test_a_tensor_whose_size_is_not_a_multiple_of_2_mib_ends_on_a_huge_page_too():
    """The benchmark's tensors are 15.8 MiB: their last 1.8 MiB in 4 KiB pages were ~460 faults each
    (~2.7 us each on these VMs: 0.08 s of a 1 GiB restore's 0.22 s)."""
    import resource

    nbytes = 8 * hugepages.HUGE_PAGE - (hugepages.HUGE_PAGE // 8)  # 15.75 MiB: a tail of 1.75 MiB
    t = hugepages.empty((nbytes // 4,), torch.float32)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(1.0)
    # 8 huge pages and a few faults of the interpreter (11 under xdist); the tail alone in 4 KiB
    # pages would be 448
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults <= 64
    assert float(t.sum()) == t.numel()
