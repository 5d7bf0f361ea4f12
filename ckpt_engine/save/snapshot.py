"""Snapshot (phase 1): copy this rank's slices into a reused host buffer.

This is the only part training waits for, so it does as little as possible: on CPU one ``memmove``
per run of adjacent pieces (a slice's pieces are adjacent in the buffer and in the tensor), outside
the GIL, or an asynchronous copy into pinned memory on a side CUDA stream,
ordered by events (cuda_copy.py). The buffer's first bytes are the rank's data file layout, so
persist writes them unchanged.

While training waits for a CPU copy, the copy may use the cores the rank has: ``copy_threads``
threads (the checkpointer's default: the cores this process may run on divided among the ranks
sharing them, as for reads: a rank with a spare core copies with a helper, ``comm.cores_per_rank``), taking about 4 MiB of
the bytes at a time in turn (whole pieces when each is checksummed as it is copied, else a call
crossing a chunk's end is cut). One thread copies at
most about 20 GB/s on a server core and about 6 here, so a second one pays off on any copy of more
than a few MiB. Never more threads than that: ranks sharing the cores would fight over them, and
the library never touches ``torch.set_num_threads``. A deferred copy (``save(defer=True)``) runs
beside training, so it stays on one thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from ..state.values import Encoded
from .buffers import BufferPool, HostBuffer
from .copy import CopyCalls, CopyPlan, copy_into, plan_copy
from .cuda_copy import CudaCopy, Origin, capture
from .layout import SaveLayout, save_layout
from .tally import SaveRecord

class Snapshots:
    """The snapshot phase of one ``Checkpointer``, called from its training thread: the layout of
    each state signature (cached), at most ``max_inflight`` host buffers (:attr:`pool`), and the
    copies into them: on the calling thread, or deferred to one background thread."""

    def __init__(self, rank: int, world_size: int, max_inflight: int, copy_threads: int = 1) -> None:
        self.rank, self.world_size = rank, world_size
        self.copy_threads = copy_threads
        self.pool = BufferPool(max_inflight)
        self._layouts: dict[tuple, SaveLayout] = {}
        self._thread: ThreadPoolExecutor | None = None
        self._helpers: ThreadPoolExecutor | None = None
        self._calls = CopyCalls()  # one copy at a time: a save waits for the deferred copy before it

    def plan(self, enc: Encoded, lenc: Encoded) -> tuple[SaveLayout, CopyPlan]:
        """The layout of this state signature and how this state's pieces are copied."""
        key = (tuple((t.dtype, t.shape, c and (c.shape, c.box, c.replica, c.replicas, c.sharding))
                     for t, c in zip(enc.tensors, enc.shards)),
               tuple((t.dtype, t.shape) for t in lenc.tensors),
               tuple(enc.names), tuple(lenc.names))  # the manifest's tensor table names the keys
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = save_layout(enc, lenc, self.rank, self.world_size)
        return lay, plan_copy(lay.pieces, lay.nbytes, enc.tensors, lenc.tensors, lay.spans, lay)

    def take(self, buf: HostBuffer, plan: CopyPlan, record: SaveRecord,
             defer: bool) -> "Future[CudaCopy | None] | None":
        """Copy into ``buf`` now (CUDA: the caller's streams ordered after the copy), or, with
        ``defer``, on the background thread: its future is returned (see :class:`SaveHandle`)."""
        origin = capture(plan.devices)  # here, on the caller's thread: its current streams
        if defer:  # beside training: one thread
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-snapshot")
            return self._thread.submit(_timed_copy, buf, plan, origin, record, reuse=self._calls)
        if self.copy_threads > 1 and self._helpers is None:
            self._helpers = ThreadPoolExecutor(self.copy_threads - 1, thread_name_prefix="ckpt-copy")
        copy = _timed_copy(buf, plan, origin, record, self._helpers, self.copy_threads, self._calls)
        if copy is not None:
            copy.order()
        return None

    def close(self) -> None:
        """After the last ``take``: end the background threads."""
        for pool in (self._thread, self._helpers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._thread = self._helpers = None


def _timed_copy(buf: HostBuffer, plan: CopyPlan, origin: Origin | None, record: SaveRecord,
                helpers: ThreadPoolExecutor | None = None, threads: int = 1,
                reuse: CopyCalls | None = None) -> CudaCopy | None:
    start, cpu = time.perf_counter(), time.thread_time()
    copy, helper_cpu = copy_into(buf, plan, origin, helpers, threads, reuse)
    record.snapshot_s = time.perf_counter() - start
    record.snapshot_cpu_s = time.thread_time() - cpu + helper_cpu
    return copy


class SaveHandle:
    """Returned by :meth:`Checkpointer.save`; ``wait_snapshot()`` before mutating the state."""

    def __init__(self, record: SaveRecord, snapshot: "Future[CudaCopy | None] | None") -> None:
        self.record = record
        self._snapshot = snapshot

    @property
    def step(self) -> int:
        return self.record.step

    def snapshot_done(self) -> bool:
        """Whether ``wait_snapshot()`` would not block (always true for a non-deferred save): the
        CPU copies are done and the CUDA copies queued (they may still run on the device)."""
        return self._snapshot is None or self._snapshot.done()

    def wait_snapshot(self) -> None:
        """Return when the state may be mutated again (re-raises a failed copy).

        CPU tensors: their copy is done. CUDA tensors: a CUDA tensor is only ever mutated by work
        queued on a stream, so no host sync is needed: the caller's stream of the ``save()`` call
        (and the current stream, if another) is made to wait on the copy-done event, and work
        queued on it afterwards (the optimizer step) cannot overtake the copy. Work on any other
        stream must be ordered after that one (``wait_stream``) before it writes the state.
        """
        if self._snapshot is not None:
            copy = self._snapshot.result()
            if copy is not None:
                copy.order()
