"""Replication of each rank's memory-level part to peer ranks on other nodes, in the background.

After a rank commits its part of a checkpoint in its node's memory (levels/memory.py), its
:class:`Replicator` sends the three files (index, ``rank-commit.json``, data) to each of its
:meth:`~ckpt_engine.levels.memory.NodeTable.peers` and receives the parts of the ranks that send
to it, which it writes below the sender's ``rank-NNNNN/`` in its own node's directory, checked on
the way (the index against the sender's commit, every data byte against the index) and committed
the same way: data, index, ``rank-commit.json`` last.

The bytes travel over a private gloo process group (:func:`open_group`, built once at open on
the training thread), never over the training's communicator from this thread (invariant 7), in
chunks of :data:`CHUNK` bytes. Every rank replicates in *rounds*, one per ``save()`` call in save
order, whether its own part was committed or not (a header says so), so that all ranks stay in
step without talking about it. A peer that dies mid-transfer fails the round (gloo's timeout or a
closed connection): counted in ``replica_failed``, reported once as a warning, and the replicator
stops (training and the other levels go on; the next start builds a new group).
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import socket
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..comm import Comm
from ..errors import CheckpointError, CheckpointWarning, CorruptionError
from ..format.entries import data_file, index_file
from ..format.manifest import RankIndex
from ..save.commit import retain
from ..save.filebuffers import BUFFERS
from ..save.tally import Tally
from ..storage import Storage
from .memory import NodeTable
from .open import RANK_COMMIT, RankCommit, rank_dir
from .transfer import StreamCheck

log = logging.getLogger("ckpt_engine.levels.replicate")

CHUNK = 16 << 20
"""Bytes per message of a part's data (what a receiver holds in memory at once)."""
COUNTERS = ("replicated", "replica_failed", "replica_bytes", "replica_sent_bytes")
"""Keys this module adds to ``Checkpointer.counters``: parts received and committed here, rounds
that failed, bytes received (and kept), bytes sent to peers (index, commit and data of each part)."""
_HEADER, _META, _DATA = 0, 1, 2


@dataclass(frozen=True)
class PeerGroup:
    """The private process group and the store it met through (rank 0's serves it: kept alive with it)."""

    group: Any
    store: Any


def open_group(comm: Comm, generation: str, timeout: float) -> PeerGroup:
    """A private gloo process group of every rank (a collective on the training thread).

    Rank 0 serves a ``TCPStore`` on a free port and broadcasts where (``CKPT_REPLICA_ADDR``, else
    ``MASTER_ADDR``, else its host's address); every rank then joins one ``ProcessGroupGloo``.
    Works whatever the job's own communicator is (torch.distributed, Horovod).
    """
    import torch.distributed as dist

    store = None
    if comm.rank == 0:
        host = os.environ.get("CKPT_REPLICA_ADDR") or os.environ.get("MASTER_ADDR") or _host_address()
        store = dist.TCPStore(host, 0, comm.world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        where = comm.broadcast([host, store.port])
    else:
        where = comm.broadcast(None)
        store = dist.TCPStore(where[0], int(where[1]), comm.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
    prefixed = dist.PrefixStore(f"ckpt-replica-{generation}", store)
    group = dist.ProcessGroupGloo(prefixed, comm.rank, comm.world_size, datetime.timedelta(seconds=timeout))
    return PeerGroup(group, store)


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Replicator:
    """This rank's replication thread (see the module docstring).

    Order of calls: :meth:`expect` at every ``save()`` in save order (training thread), then
    :meth:`settle` once that attempt's own part is committed or not (persist or training thread);
    :meth:`drain`, :meth:`take_warning` and :meth:`stop` from the training thread.
    """

    def __init__(self, peers: PeerGroup, node: Storage, table: NodeTable, rank: int, replicas: int, *,
                 keep_last: int | None, generation: str, tally: Tally) -> None:
        self._peer_group = peers
        self.group, self.node, self.rank = peers.group, node, rank
        self.peers = table.peers(rank, replicas)
        self.sources = table.sources(rank, replicas)
        self.keep_last, self.generation, self.tally = keep_last, generation, tally
        self.tally.declare(COUNTERS)
        self._cond = threading.Condition()
        self._order: deque[str] = deque()
        self._settled: dict[str, bool] = {}
        self._busy = False
        self._stopping = False
        self.broken: BaseException | None = None
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="ckpt-replicate", daemon=True)
        self._thread.start()

    # ---- training / persist side ----------------------------------------------------------------
    def expect(self, dirname: str) -> None:
        """A ``save()`` made attempt ``dirname``: its round comes after the earlier ones'."""
        with self._cond:
            self._order.append(dirname)

    def settle(self, dirname: str, ok: bool) -> None:
        """This rank's own part of ``dirname`` is committed in memory (``ok``) or will not be."""
        with self._cond:
            self._settled[dirname] = ok
            self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Until every expected round is done (or the replicator broke); whether it got there in time."""
        with self._cond:
            return self._cond.wait_for(lambda: (not self._order and not self._busy) or self.broken is not None,
                                       timeout)

    def take_warning(self) -> CheckpointWarning | None:
        """Why replication stopped, once."""
        with self._cond:
            if self.broken is None or self._warned:
                return None
            self._warned = True
        return CheckpointWarning(f"replication of rank {self.rank}'s memory checkpoints to other nodes stopped: "
                                 f"{type(self.broken).__name__}: {self.broken}; the memory level keeps committing "
                                 "on this node and the slower levels keep receiving checkpoints")

    def stop(self) -> None:
        """End the thread once the rounds expected so far are done (callers drain first)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or (self._order and self._order[0] in self._settled))
                if not self._order or self._order[0] not in self._settled:
                    return
                dirname = self._order[0]
                ok = self._settled.pop(dirname)
                self._busy = True
            try:
                if self.broken is None:
                    self._round(dirname, ok)
            except Exception as e:  # noqa: BLE001 - a dead peer or a broken group: stop replicating, say so once
                log.warning("replication of %s failed on rank %d: %s", dirname, self.rank, e)
                self.tally.count("replica_failed")
                self.broken = e
            finally:
                with self._cond:
                    self._order.popleft()
                    self._busy = False
                    self._cond.notify_all()

    def _round(self, dirname: str, ok: bool) -> None:
        """Send this rank's part of ``dirname`` to every peer and take the parts sent to it."""
        for k, peer in enumerate(self.peers):
            sending = self._outgoing(dirname) if ok else None
            try:
                works = self._send(peer, k, sending)
                errors = []
                for source in self.sources[k]:
                    try:
                        self._receive(source, k, dirname)
                    except CheckpointError as e:  # this part is not kept; the protocol stayed in step
                        errors.append(e)
                for work in works:
                    work.wait()
                if sending is not None:
                    self.tally.count("replica_sent_bytes", sending.nbytes)
            finally:
                if sending is not None:
                    sending.close()
            if errors:
                self.tally.count("replica_failed", len(errors))
                log.warning("replica of %s not kept on rank %d: %s", dirname, self.rank, errors[0])

    def _outgoing(self, dirname: str) -> "_Outgoing | None":
        """This rank's part of ``dirname``, or ``None`` when retention removed it meanwhile (the
        replicator is behind the saves): the round then says "nothing" and the protocol stays in step."""
        try:
            return _Outgoing(self.node.child(rank_dir(self.rank)), dirname, self.rank)
        except (CheckpointError, OSError) as e:
            log.info("rank %d: %s no longer in memory, not replicated (%s)", self.rank, dirname, e)
            return None

    def _send(self, peer: int, k: int, part: "_Outgoing | None") -> list[Any]:
        tag = 3 * k
        header = torch.tensor(part.header() if part is not None else [0, 0, 0, 0], dtype=torch.int64)
        works = [self.group.send([header], peer, tag + _HEADER)]
        if part is not None:
            works.append(self.group.send([part.meta], peer, tag + _META))
            works += [self.group.send([chunk], peer, tag + _DATA) for chunk in part.chunks()]
        return works

    def _receive(self, source: int, k: int, dirname: str) -> None:
        tag = 3 * k
        header = torch.zeros(4, dtype=torch.int64)
        self.group.recv([header], source, tag + _HEADER).wait()
        ok, index_len, commit_len, data_len = (int(x) for x in header.tolist())
        if not ok:
            return
        meta = torch.empty(index_len + commit_len, dtype=torch.uint8)
        self.group.recv([meta], source, tag + _META).wait()
        incoming = _Incoming(self.group, source, tag + _DATA, data_len)
        target = self.node.child(rank_dir(source))
        try:
            raw = meta.numpy().tobytes()
            index_raw, commit_raw = raw[:index_len], raw[index_len:]
            where = target.describe(f"{dirname}/{index_file(source)}")
            rc = RankCommit.from_json(commit_raw, target.describe(f"{dirname}/{RANK_COMMIT}"))
            idx = RankIndex.from_json(index_raw, where)
            if (rc.rank, rc.record.index_bytes, idx.data_bytes) != (source, index_len, data_len):
                raise CorruptionError(f"{where}: the replica sent by rank {source} does not match its commit")
            incoming.check = StreamCheck(idx, target.describe(f"{dirname}/{data_file(source)}"))
            target.makedirs(dirname)
            target.write_stream(f"{dirname}/{data_file(source)}", incoming, sync_dir=False)
            target.write_atomic(f"{dirname}/{index_file(source)}", index_raw, durable=False)
            target.write_atomic(f"{dirname}/{RANK_COMMIT}", commit_raw, durable=False)
        except CheckpointError:
            incoming.rest()  # keep in step with the sender whatever happened here
            target.remove(dirname)
            raise
        self.tally.count("replicated")
        self.tally.count("replica_bytes", data_len + index_len + commit_len)
        retain(target, dirname, self.keep_last, self.generation, marker=RANK_COMMIT)


class _Outgoing:
    """This rank's committed part of one checkpoint, mapped from the memory level (no copy)."""

    def __init__(self, own: Storage, dirname: str, rank: int) -> None:
        index_raw = own.read_bytes(f"{dirname}/{index_file(rank)}")
        commit_raw = own.read_bytes(f"{dirname}/{RANK_COMMIT}")
        self.meta = torch.frombuffer(bytearray(index_raw + commit_raw), dtype=torch.uint8)
        self.lengths = (len(index_raw), len(commit_raw))
        path = own.path(f"{dirname}/{data_file(rank)}")
        self.size = os.path.getsize(path)
        self._map: mmap.mmap | None = None
        self._pin: str | None = own.path(f"{BUFFERS}/sending-{dirname}")
        try:  # a link of its own: a snapshot buffer that is this file is not reused while it is sent
            os.link(path, self._pin)
        except OSError:
            self._pin = None
        if self.size:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_COPY)

    def header(self) -> list[int]:
        return [1, self.lengths[0], self.lengths[1], self.size]

    @property
    def nbytes(self) -> int:
        """What a peer receives: the index, the commit and the data."""
        return sum(self.lengths) + self.size

    def chunks(self) -> list[torch.Tensor]:
        if self._map is None:
            return []
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        return [whole[lo:lo + CHUNK] for lo in range(0, self.size, CHUNK)]

    def close(self) -> None:
        if self._pin is not None:
            try:
                os.remove(self._pin)
            except OSError:
                pass
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still refers to it: the garbage collector closes it
                pass


class _Incoming:
    """The chunks of a part's data as they arrive, checked (an iterable for ``write_stream``).

    A check that fails does not stop the receiving: the rest is received (and dropped) so that the
    sender's sends complete, and the error is raised after the last chunk.
    """

    def __init__(self, group: Any, source: int, tag: int, size: int) -> None:
        self.group, self.source, self.tag, self.size = group, source, tag, size
        self.check: StreamCheck | None = None
        self.received = 0
        self._buf = torch.empty(min(CHUNK, max(size, 1)), dtype=torch.uint8)

    def _next(self) -> memoryview:
        n = min(CHUNK, self.size - self.received)
        view = self._buf[:n]
        self.group.recv([view], self.source, self.tag).wait()
        self.received += n
        return memoryview(view.numpy())

    def __iter__(self) -> Iterator[memoryview]:
        error: CheckpointError | None = None
        while self.received < self.size:
            chunk = self._next()
            if error is None and self.check is not None:
                try:
                    self.check.feed(chunk)
                except CheckpointError as e:
                    error = e
            yield chunk
        if error is None and self.check is not None:
            self.check.finish()
        if error is not None:
            raise error

    def rest(self) -> None:
        """Receive (and drop) what the sender still sends."""
        while self.received < self.size:
            self._next()
