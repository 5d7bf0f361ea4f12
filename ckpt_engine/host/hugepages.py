"""Transparent huge pages for the large host memory the engine allocates and fills at once.

A first save (or ``reserve()``) allocates its snapshot buffer and zero-fills it at once, and with
4 KiB pages that first touch (a page fault per page, the kernel zeroing it) is most of the cost:
on the VMs this was measured on, 1 GiB allocated and filled in 0.264 s through 4 KiB faults against
0.074 s with 2 MiB pages (median of 10 alternated). Restored tensors are filled the same way:
1 GiB read from the page cache into huge pages took 0.31 s against 0.61 s into 4 KiB pages, from
the device 0.75 against 0.81 s (median of 6 alternated, 2 threads; an earlier kernel on these VMs
had made the cold case 2.9 x slower, which no longer shows). Linux
backs an anonymous mapping with huge pages where it is advised to (``madvise(MADV_HUGEPAGE)``, the
``madvise`` mode of ``/sys/kernel/mm/transparent_hugepage/enabled``, the common default), so
:func:`empty` puts each large allocation on a 2 MiB boundary of a mapping of its own and advises
it before anything touches it, as torch's own ``THP_MEM_ALLOC_ENABLE=1`` does for every allocation
(:func:`advise` does what it can for a tensor allocated elsewhere: its whole 2 MiB pages). The
kernel falls back to small pages when it has no huge page to give; elsewhere (other systems, pinned memory) this does
nothing. ``CKPT_HUGEPAGES=0`` in the environment turns it off.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from math import prod
from typing import Sequence

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 8 << 20
"""Smaller allocations are left alone (at most a few huge pages, and glibc may reuse their memory)."""
_MADV_HUGEPAGE = 14


def _libc_madvise() -> "ctypes._CFuncPtr | None":
    """libc's ``madvise`` (Linux only); a CDLL call releases the GIL."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_POPULATE = _libc_madvise()
_MADVISE = None if os.environ.get("CKPT_HUGEPAGES", "1") == "0" else _POPULATE


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under the not yet touched CPU tensor ``t`` (its whole 2 MiB pages);
    whether the kernel took the advice. Never raises: huge pages only make it faster."""
    nbytes = t.numel() * t.element_size()
    if _MADVISE is None or t.device.type != "cpu" or t.is_pinned() or nbytes < MIN_BYTES:
        return False
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    stop = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    return stop > start and _MADVISE(start, stop - start, _MADV_HUGEPAGE) == 0


def advised_bytes(nbytes: int) -> int:
    """How much of a large tensor of ``nbytes`` bytes :func:`empty` puts on huge pages, from its
    first byte: its whole 2 MiB pages, and the last, partial one too when the tensor fills at least
    half of it (so that it costs at most 1 MiB more than the tensor, and less than what it holds).

    Why the tail: a size that is not a multiple of 2 MiB otherwise ends in 4 KiB pages, a fault each,
    and on these VMs a fault costs ~2.7 us: restoring the benchmark's 1 GiB (64 tensors of 15.8 MiB)
    faulted ~30,700 times, ~30,000 of them in those tails, and filling its tensors took 0.165 s
    against 0.088 s with the tails on huge pages too (514 faults; median of 8 alternated, primed
    memory; ``load()`` 0.221 s against 0.170 s). Why not always: a tail of a few KiB would then take
    up to 2 MiB, to save a handful of faults.
    """
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    return whole + HUGE_PAGE if 2 * (nbytes - whole) >= HUGE_PAGE else whole


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, on huge pages from its first byte when large.

    A large tensor gets an anonymous mapping of its own and starts on a 2 MiB boundary of it, and
    :func:`advised_bytes` of it are advised. Why not torch's allocator: it aligns to 64 bytes, so
    advising a tensor from it left the partial 2 MiB at each end in 4 KiB pages: 1/8 of a 16 MiB
    tensor (filling one faults 8 times now). The tensor's storage is exactly its bytes, as
    ``torch.empty``'s, and is freed with it; unlike that, it cannot be resized larger in place (as
    ``torch.from_numpy``'s cannot). Elsewhere, or when the mapping is refused, ``torch.empty`` with
    :func:`advise`.
    """
    shape = tuple(shape)
    nbytes = prod(shape) * dtype.itemsize
    if _MADVISE is None or nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    try:
        span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room for a 2 MiB boundary and the advised tail
        area = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        t = torch.empty(shape, dtype=dtype)
        advise(t)
        return t
    anchor = ctypes.c_char.from_buffer(area)
    base = ctypes.addressof(anchor)
    del anchor  # a live export would keep the mapping from ever being released
    offset = -base % HUGE_PAGE
    _MADVISE(base + offset, advised_bytes(nbytes), _MADV_HUGEPAGE)  # before any byte is touched
    return torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)


# ---- page tables filled off the GIL --------------------------------------------------------------------
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14
POPULATE_CHUNK = 32 << 20
""":func:`map_file` fills the page tables this much at a time."""


def map_file(fd: int, nbytes: int, writable: bool) -> mmap.mmap:
    """``mmap.mmap`` of the file ``fd`` (``MAP_SHARED``) with every page mapped at once, like
    ``MAP_POPULATE``, while the other threads of the process run on.

    Python's ``mmap.mmap`` keeps the GIL through the system call, and with ``MAP_POPULATE`` that call
    faults in the whole file: 176 MiB of tmpfs held every other thread for 76-95 ms (2026-11-28), so
    a memory level's buffers reserved in the background stopped the training thread for that long
    each. Here the mapping is made bare (microseconds) and its page tables are filled by
    ``madvise(MADV_POPULATE_WRITE/READ)`` through ctypes, which releases the GIL, :data:`POPULATE_CHUNK`
    at a time: the kernel holds the process's memory-map lock while it fills, and a thread that maps
    or unmaps memory meanwhile (an allocator growing) waits for it, 80 ms for 256 MiB in one call
    against under 5 ms a chunk. Where the kernel lacks it (before 5.14), the pages fault in as they
    are first touched."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    area = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
    if _POPULATE is not None and nbytes:
        base = _address(area, writable)
        advice = _MADV_POPULATE_WRITE if writable else _MADV_POPULATE_READ
        for offset in range(0, nbytes, POPULATE_CHUNK):
            if _POPULATE(base + offset, min(POPULATE_CHUNK, nbytes - offset), advice) != 0:
                break  # an older kernel: first touches fault the rest in
    return area


def _address(area: mmap.mmap, writable: bool) -> int:
    """Where ``area`` is mapped (holding no export of it afterwards, so that it can be closed)."""
    if writable:
        anchor = ctypes.c_char.from_buffer(area)
        try:
            return ctypes.addressof(anchor)
        finally:
            del anchor
    import numpy as np  # ctypes' from_buffer needs a writable buffer

    view = memoryview(area)
    try:
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    finally:
        view.release()
