"""A collective restore's replicated state: each rank reads a share, the communicator brings the rest.

Every rank of a restarted job needs the whole replicated state. Read directly (``route="read"``),
each of N ranks reads all of it: N times the bytes from shared storage, which is what limits
recovery on a cluster (the storage's bandwidth divided among N readers). Exchanged
(``"exchange"``), the state's large pieces are split into N runs of about equal bytes in one
order every rank computes alike (:func:`~ckpt_engine.load.read.split_by_bytes`); each rank reads
and verifies its run only, then every piece is broadcast from the rank that read it straight
into the others' destination tensors (no staging copy). Pieces under :data:`MIN_PIECE` are read
by every rank (a collective per piece costs more than the read). ``"auto"`` (the default) decides
at the first restore and keeps the choice for later restores of the same ``Checkpointer``: when
every rank runs on one node it reads (co-located ranks share one page cache, so the storage serves
the state once either way, and an exchange would only add the loopback transfer: measured in
``bench_save.py``, 0.55 s read against 1.02 s exchanged for 1 GiB on 2 ranks); across nodes it
measures both, the own-share read giving the storage's rate with every rank reading and the first
eighth of the exchange the communicator's, and sends the rest the faster way. A node is a host
name and, where torchrun sets it, ``GROUP_RANK``.

Verification does not weaken: every byte is checked against its checksum by the rank that read
it. Each rank reads its share alone (:meth:`Exchange.start`, no communication), the ranks agree
on the verdicts (the restore search's all-gather, load/search.py), and only then exchange
(:meth:`Exchange.finish`, collectives first, any further reads last, followed by a second
agreement): a rank that fails anywhere never leaves the others waiting in a collective, and the
agreed fallback moves every rank to the same older checkpoint. The communicator must offer ``broadcast_tensor`` (the
core's :class:`~ckpt_engine.comm.TorchDistComm` and Horovod's do); otherwise, and for
``restore(into=...)`` (each rank reads only what its own shards need), reads are direct.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..comm import Comm
from ..format.entries import MANIFEST_NAME, IndexEntry
from ..state.decode import decode
from ..storage import Storage
from .open import Opened, Progress, tensor_name
from .places import Places, Target, whole_targets
from .read import read_entries, split_by_bytes

log = logging.getLogger("ckpt_engine.restore")

Route = Literal["auto", "read", "exchange"]
ROUTES: tuple[str, ...] = Route.__args__  # type: ignore[attr-defined]
MIN_PIECE = 1 << 20
"""Pieces smaller than this are read by every rank instead of exchanged."""
PROBE_SHARE = 8
"""``auto`` times the first 1/``PROBE_SHARE`` of the exchanged bytes (at least one piece)."""

Job = tuple[int, IndexEntry]


@dataclass
class RestoreFigures:
    """What the last collective restore did on this rank (bytes and wall seconds)."""

    route: str
    """How the large pieces came: ``"read"`` (all from storage), ``"exchange"``, or ``"auto→read"`` /
    ``"auto→exchange"`` (measured at this restore, the rest sent the faster way)."""
    read_bytes: int = 0
    received_bytes: int = 0
    read_s: float = 0.0
    exchange_s: float = 0.0
    measured: dict[str, float] = field(default_factory=dict)
    """``auto``'s measurement: ``nodes: 1`` when every rank runs on one node (no measurement), else ``read_GBps`` (slowest rank's storage rate with every rank
    reading), ``exchange_GBps`` (bytes broadcast per second), and the predicted seconds of the rest
    each way (``rest_read_s``, ``rest_exchange_s``)."""


@dataclass
class Pending:
    """A restore between :meth:`Exchange.start` (this rank's share, read) and :meth:`Exchange.finish`."""

    storage: Storage
    ck: Opened
    threads: int
    targets: list[Target]
    places: Places
    names: list[str]
    sent: list[tuple[Job, int]]
    """Every large piece and the rank that reads it, in the order all ranks exchange them."""
    figures: RestoreFigures
    kept: dict[Job, torch.Tensor] = field(default_factory=dict)
    """This rank's verified temporaries of pieces not read in place (sent from there)."""


class Exchange:
    """The route of a ``Checkpointer``'s collective restores (the same on every rank), and what
    ``auto`` chose at the first one."""

    def __init__(self, comm: Comm, route: str = "auto") -> None:
        if route not in ROUTES:
            raise ValueError(f"restore_route must be one of {', '.join(map(repr, ROUTES))}, got {route!r}")
        self.comm, self.route = comm, route
        self.chosen: str | None = None
        """``auto``'s choice, once measured."""
        self.figures: RestoreFigures | None = None

    def applies(self, into: Any) -> bool:
        """Whether this restore exchanges at all: several ranks, a communicator that can, a new
        state (not ``into``), and a route other than ``read`` (nor ``auto`` having chosen to read).
        The same answer on every rank: it depends on settings and on earlier agreed choices only."""
        return (self.route != "read" and not (self.route == "auto" and self.chosen == "read") and into is None
                and self.comm.world_size > 1 and callable(getattr(self.comm, "broadcast_tensor", None)))

    def start(self, storage: Storage, ck: Opened, threads: int, progress: Progress | None = None) -> Pending:
        """This rank's part, alone (no communication, so that a failure here cannot leave the
        other ranks in a collective): the small pieces and its own share of the large ones, read
        and verified into new tensors. :meth:`finish` follows once every rank reported success."""
        targets = whole_targets(ck.manifest.tensors, where=storage.describe(f"{ck.dirname}/{MANIFEST_NAME}"),
                                what=f"reading step {ck.manifest.step}")
        jobs = sorted(((idx.rank, e) for idx in ck.indexes for e in idx.entries if not e.local),
                      key=lambda j: (j[0], j[1].offset))
        large = [j for j in jobs if j[1].nbytes >= MIN_PIECE]
        owners = split_by_bytes([e.nbytes for _, e in large], self.comm.world_size)
        mine = [j for j, o in zip(large, owners) if o == self.comm.rank]
        done = Pending(storage, ck, threads, targets, Places(ck.manifest.tensors, targets),
                       [tensor_name(t, i) for i, t in enumerate(ck.manifest.tensors)], list(zip(large, owners)),
                       figures=RestoreFigures(self.chosen or self.route))
        begin = time.perf_counter()
        read_entries(storage, ck, [j for j in jobs if j[1].nbytes < MIN_PIECE] + mine, done.places, done.names,
                     threads, progress, keep=done.kept)
        done.figures.read_s = time.perf_counter() - begin
        done.figures.read_bytes = sum(e.nbytes for _, e in jobs if e.nbytes < MIN_PIECE) + sum(e.nbytes for _, e in mine)
        return done

    def finish(self, done: Pending, nodes: list[str]) -> object:
        """Every rank together, once every rank's :meth:`start` succeeded (``nodes``: each rank's
        :func:`node_name`, from that agreement): the rest of the large pieces, then the state.
        Collectives come first; reads from storage (which may fail on one rank) only last, so a
        failure here is agreed on afterwards like one in :meth:`start`."""
        sent, figures = done.sent, done.figures
        if self.route == "auto" and self.chosen is None and sent:
            if len(set(nodes)) == 1:  # one node, one page cache: see the module docstring
                self.chosen, figures.measured = "read", {"nodes": 1.0}
            else:
                probe = _probe_length([e.nbytes for (_, e), _ in sent])
                probe_s = self._send(sent[:probe], done)
                self.chosen = self._decide(figures, sum(e.nbytes for (_, e), _ in sent[:probe]), probe_s,
                                           sent[probe:])
                sent = sent[probe:]
            figures.route = f"auto→{self.chosen}"
            log.info("restore of %s: %s (%s)", done.ck.dirname, figures.route, figures.measured)
        if self.route == "auto" and self.chosen == "read":
            begin = time.perf_counter()
            rest = [j for j, o in sent if o != self.comm.rank]
            read_entries(done.storage, done.ck, rest, done.places, done.names, done.threads)
            figures.read_s += time.perf_counter() - begin
            figures.read_bytes += sum(e.nbytes for _, e in rest)
        else:
            self._send(sent, done)
        self.figures = figures
        targets = done.targets
        return decode(done.ck.manifest.state, lambda i: targets[i].out, count=len(targets),
                      where=done.storage.describe(done.ck.dirname))

    def _send(self, sent: list[tuple[Job, int]], done: Pending) -> float:
        """Broadcast each piece from the rank that read it into the others' places; the seconds taken."""
        start = time.perf_counter()
        broadcast = self.comm.broadcast_tensor  # type: ignore[attr-defined]
        places = done.places
        for (writer, e), owner in sent:
            if owner == self.comm.rank:
                view = places.in_place(e)
                broadcast(done.kept[(writer, e)].view(torch.uint8) if view is None
                          else torch.frombuffer(view, dtype=torch.uint8), owner)
                continue
            dest, temp = places.destination(e)
            broadcast(torch.frombuffer(dest, dtype=torch.uint8), owner)
            if temp is not None:
                places.scatter(e, temp)
            done.figures.received_bytes += e.nbytes
        seconds = time.perf_counter() - start
        done.figures.exchange_s += seconds
        return seconds

    def _decide(self, figures: RestoreFigures, probe_bytes: int, probe_s: float,
                rest: list[tuple[Job, int]]) -> str:
        """Whether the ``rest`` of the pieces is faster exchanged or read: the same answer on every
        rank, computed from gathered figures and the pieces' owners, which every rank knows."""
        gathered = self.comm.all_gather([figures.read_bytes, figures.read_s, probe_s])
        read_rate = min(b / max(s, 1e-9) for b, s, _ in gathered)
        exchange_rate = probe_bytes / max(max(p for _, _, p in gathered), 1e-9)
        slowest_read = max(sum(e.nbytes for (_, e), o in rest if o != r) for r in range(self.comm.world_size))
        rest_exchange = sum(e.nbytes for (_, e), _ in rest) / max(exchange_rate, 1e-9)
        rest_read = slowest_read / max(read_rate, 1e-9)
        figures.measured = {"read_GBps": read_rate / 1e9, "exchange_GBps": exchange_rate / 1e9,
                            "rest_read_s": rest_read, "rest_exchange_s": rest_exchange}
        return "exchange" if rest_exchange <= rest_read else "read"


def node_name() -> str:
    """This process's node: the host name, and torchrun's node rank (``GROUP_RANK``) where set."""
    group = os.environ.get("GROUP_RANK")
    return socket.gethostname() + ("" if group is None else f"/{group}")


def _probe_length(sizes: list[int]) -> int:
    """How many leading pieces make up the first 1/:data:`PROBE_SHARE` of the bytes (at least one)."""
    goal, done = sum(sizes) / PROBE_SHARE, 0
    for i, n in enumerate(sizes):
        done += n
        if done >= goal:
            return i + 1
    return len(sizes)

