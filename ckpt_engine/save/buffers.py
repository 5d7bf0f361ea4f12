"""The reusable host buffers a snapshot is copied into (page-aligned, zero-filled once, pinned
when the state lives on a GPU) and the pool that hands them out: at most ``max_inflight`` taken at
once, so steady-state checkpointing allocates nothing.
"""

from __future__ import annotations

import threading
from math import prod
from typing import Callable, Protocol

import torch

from ..host import hugepages

PAGE = 4096
"""Host buffers start at a multiple of this (the block alignment direct I/O needs)."""
VIEWS_KEPT = 1 << 16
"""At most this many destination views per buffer (:meth:`HostBuffer.view_of`): a few MiB."""

class PendingCopy(Protocol):
    """A queued device-to-host copy into a buffer (``cuda_copy.CudaCopy``): persist waits for it."""

    def synchronize(self) -> None:
        """Block until the copy is done."""


class HostBuffer:
    """A reusable host byte buffer (pinned when the state lives on a GPU), zero-filled once."""

    checksums: "tuple[str, ...] | None" = None
    """The xxh3-64 of each piece of the snapshot in it, computed by the copy (all pieces on the CPU:
    save/copy.py), for persist to use; ``None`` when persist computes them."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        # zeros: the padding between pieces is written and checksummed, and must not leak old memory.
        # Page-aligned start, so persist can write it with O_DIRECT (see storage.write_stream).
        if pinned:
            raw = torch.zeros(max(nbytes, 1) + PAGE, dtype=torch.uint8, pin_memory=True)
        else:  # zero-filled through huge pages where the kernel has them (hugepages.py)
            raw = hugepages.empty((max(nbytes, 1) + PAGE,), torch.uint8).zero_()
        skip = -raw.data_ptr() % PAGE
        self.tensor = raw[skip:skip + max(nbytes, 1)]
        self.pinned = pinned
        self.address = self.tensor.data_ptr()
        self.event: PendingCopy | None = None
        """The CUDA copy into this buffer of the snapshot in it (persist calls ``synchronize()``)."""
        self._views: dict[tuple, torch.Tensor] = {}

    def view_of(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes at ``offset`` as a tensor of ``dtype`` and ``shape``, made once and kept (the
        destination of a CUDA copy: the same each save of a layout, and making it costs as much as
        queuing the copy). Forgets all when it holds too many (layouts that keep changing)."""
        key = (offset, dtype, shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            n = prod(shape) * dtype.itemsize
            view = self._views[key] = self.tensor[offset:offset + n].view(dtype).view(shape)
        return view

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    def view(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` as a memoryview (what persist writes and hashes)."""
        return memoryview(self.tensor.numpy()[:nbytes])

    def reusable(self, nbytes: int) -> bool:
        """Whether a snapshot of ``nbytes`` may be copied into it now (given back, large enough)."""
        return True

    def kept(self) -> bool:
        """Whether something else still holds it (a committed memory checkpoint), so the pool keeps it."""
        return False

    def drop(self) -> None:
        """Let it go (the pool replaces it): nothing to do for host memory."""


class BufferPool:
    """At most ``max_inflight`` buffers taken at once; a snapshot takes one, persist gives it back.

    Buffers are allocated on first use and reused while they are large enough, so steady-state
    checkpointing allocates nothing. ``make(nbytes, pinned)`` allocates one (default
    :class:`HostBuffer`; a memory level makes buffers that are files in its tmpfs, save/filebuffers.py,
    which a committed checkpoint keeps until retention removes it: such a buffer given back is
    reused only once :meth:`HostBuffer.reusable` says so). ``allocations`` counts the allocations
    made, ``waiting`` the callers blocked in :meth:`acquire`.
    """

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self.make: Callable[[int, bool], HostBuffer] = HostBuffer
        self._free: list[HostBuffer] = []
        self._taken = 0
        self._cond = threading.Condition()
        self._reserving = 0  # buffers a background reservation is still to make
        self._reserver: threading.Thread | None = None
        self.allocations = 0
        self.waiting = 0

    def acquire(self, nbytes: int, pinned: bool, block: bool) -> HostBuffer | None:
        """A buffer of at least ``nbytes``; waits for one (``block``) or returns ``None``."""
        with self._cond:
            while self._taken >= self.max_inflight:
                if not block:
                    return None
                self.waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self.waiting -= 1
            self._taken += 1
            while True:
                for buf in self._free:
                    if buf.capacity >= nbytes and buf.pinned == pinned and buf.reusable(nbytes):
                        self._free.remove(buf)
                        return buf
                if not self._reserving:
                    break
                self._cond.wait()  # a background reservation is making one: not a second allocation
            for buf in [b for b in self._free if not b.kept()]:  # too small: replaced below
                self._free.remove(buf)
                buf.drop()
        self.allocations += 1
        return self.make(nbytes, pinned)

    def reserve(self, nbytes: int, pinned: bool, kept: int = 0, background: bool = False) -> None:
        """Allocate every slot now (at set-up), so the first snapshots do not pay for it; ``kept``
        more for buffers that committed checkpoints hold (a memory level's). ``background``: all of
        them on a background thread, so that training goes on meanwhile (a memory level's six 176 MiB
        files took 0.66 s of the first step, 2026-11-28; the first one alone 0.14 s, and a 1.5 GB
        page-locked one on a GPU about 0.8 s); a snapshot that needs one before it is made waits for
        the one being made, never allocates a second."""
        with self._cond:
            usable = [b for b in self._free if b.capacity >= nbytes and b.pinned == pinned and b.reusable(nbytes)]
            missing = max(0, self.max_inflight + kept - self._taken - len(usable) - self._reserving)
            later = background and (self._reserver is None or not self._reserver.is_alive())
            now = 0 if later else missing
            for _ in range(now):
                self._free.append(self.make(nbytes, pinned))
                self.allocations += 1
            if missing > now:
                self._reserving = missing - now
                self._reserver = threading.Thread(target=self._reserve_rest, args=(nbytes, pinned),
                                                  name="ckpt-reserve", daemon=True)
                self._reserver.start()

    def _reserve_rest(self, nbytes: int, pinned: bool) -> None:
        """The background part of :meth:`reserve`: one buffer at a time, each usable once made."""
        try:
            while True:
                with self._cond:
                    if self._reserving <= 0:
                        return
                buf = self.make(nbytes, pinned)
                with self._cond:
                    self._free.append(buf)
                    self.allocations += 1
                    self._reserving -= 1
                    self._cond.notify_all()
        finally:  # stopped, or an allocation failed: a snapshot that needs a buffer makes its own
            with self._cond:
                self._reserving = 0
                self._cond.notify_all()

    def stop_reserving(self) -> None:
        """Make no more buffers in the background; wait for the one being made (at ``close``)."""
        with self._cond:
            self._reserving = 0
            thread, self._reserver = self._reserver, None
        if thread is not None:
            thread.join()

    def drop_all(self) -> None:
        """Let every buffer given back go (at ``close``): a page-locked file buffer is unlocked, so
        its memory is freed with its last link rather than at the end of the process."""
        with self._cond:
            free, self._free = self._free, []
        for buf in free:
            buf.drop()

    def release(self, buf: HostBuffer) -> None:
        """Give ``buf`` back for reuse."""
        with self._cond:
            self._taken -= 1
            self._free.append(buf)
            self._cond.notify()

    def idle(self) -> bool:
        """Whether no buffer is taken (nothing in flight)."""
        with self._cond:
            return self._taken == 0
