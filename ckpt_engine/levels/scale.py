"""The memory level on paper: which losses of nodes it survives, the bytes it moves per checkpoint and
at a restore, and how long the restore takes, for any number of nodes and ranks.

Pure and in one process, from the rules the level itself runs on: where each rank's part goes
(:meth:`~ckpt_engine.levels.memory.NodeTable.peers`), which checkpoint a restore can assemble and
who reads each part (:func:`~ckpt_engine.levels.open.assemblable`,
:func:`~ckpt_engine.levels.restore.candidates`), and the rounds of the exchange
(:func:`~ckpt_engine.levels.assemble.round_sizes`). docs/memory.md ("At scale") has the tables for
128 nodes x 8 ranks, and the 4 x 2 jobs of tests/test_memory_nodes.py check the byte counts.

**Network model** (:class:`Network`): every node has one link of ``bandwidth`` bytes/s in each
direction, every message costs ``latency`` seconds, the ranks of one node talk without the link;
a rank reads and checks its node's memory at ``memory_rate`` bytes/s. A checkpoint's replication
sends each part once to each peer. A restore that exchanges runs, per round, one all-gather whose
contributions are padded to the longest (what ``all_gather_tensor`` does), as a ring in rank order
(gloo's algorithm): ``ranks - 1`` steps, each a message of the longest contribution over every
node's link at once, so each node's link carries ``(ranks - 1) x longest`` bytes each way per
round, whatever its number of ranks. Left out: the few small collectives that agree on the
choice, opening the index files, decoding, and any contention beyond one link per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Collection, Sequence

from .assemble import EXCHANGE, round_sizes
from .memory import NodeTable
from .restore import candidates


@dataclass(frozen=True)
class Network:
    """The network model (see the module docstring); rates in bytes per second."""

    bandwidth: float
    latency: float
    memory_rate: float


def grid(nodes: int, per_node: int) -> NodeTable:
    """``nodes`` nodes of ``per_node`` ranks each, ranks numbered node by node (as torchrun does)."""
    return NodeTable(tuple(r // per_node for r in range(nodes * per_node)))


def peer_map(table: NodeTable, replicas: int) -> list[list[int]]:
    """Per rank, the ranks its part is sent to (:meth:`NodeTable.peers`, computed once per rank)."""
    return [table.peers(r, replicas) for r in range(len(table.nodes))]


def holders(table: NodeTable, replicas: int) -> list[frozenset[int]]:
    """Per rank, the nodes whose memory holds its part: its own and its peers'."""
    return [frozenset([table.nodes[r], *(table.nodes[p] for p in peers)])
            for r, peers in enumerate(peer_map(table, replicas))]


def node_parts(table: NodeTable, replicas: int) -> list[set[int]]:
    """Per node, the writers whose part its memory holds (its ranks' own and the replicas they received)."""
    out: list[set[int]] = [set() for _ in range(table.count)]
    for r, peers in enumerate(peer_map(table, replicas)):
        for node in {table.nodes[r], *(table.nodes[p] for p in peers)}:
            out[node].add(r)
    return out


def survives(table: NodeTable, replicas: int, lost: Collection[int]) -> bool:
    """Whether every rank's part is still on some node when the nodes ``lost`` are gone."""
    gone = set(lost)
    return all(not h <= gone for h in holders(table, replicas))


def fatal_counts(table: NodeTable, replicas: int, most: int) -> list[int]:
    """Per ``k`` in ``0..most``, how many of the ``comb(nodes, k)`` sets of ``k`` lost nodes take
    every copy of some rank's part: inclusion-exclusion over the distinct holder sets ``H``,
    ``sum over T (-1)^(|T|+1) comb(nodes - |U|, k - |U|)`` for the families ``T`` whose union ``U`` has
    at most ``most`` nodes (exact, and quick while ``most`` is small)."""
    sets = sorted({h for h in holders(table, replicas)}, key=sorted)
    by_size = [0] * (most + 1)  # sum of (-1)^(|T|+1) over the families whose union has that many nodes

    def extend(start: int, union: frozenset[int], sign: int) -> None:
        for j in range(start, len(sets)):
            joined = union | sets[j]
            if len(joined) <= most:
                by_size[len(joined)] += sign
                extend(j + 1, joined, -sign)

    extend(0, frozenset(), 1)
    n = table.count
    return [sum(c * comb(n - u, k - u) for u, c in enumerate(by_size) if u <= k) for k in range(most + 1)]


@dataclass(frozen=True)
class Survival:
    """How a memory level fares when ``lost`` random nodes are lost at once."""

    lost: int
    survivable: int
    """Sets of ``lost`` nodes whose loss leaves every rank's part on some node."""
    patterns: int
    """All sets of ``lost`` nodes: ``comb(nodes, lost)``."""

    @property
    def probability(self) -> float:
        """That a loss of ``lost`` nodes drawn at random is survivable."""
        return self.survivable / self.patterns


def survival(table: NodeTable, replicas: int, most: int) -> list[Survival]:
    """:class:`Survival` for 1 to ``most`` lost nodes."""
    fatal = fatal_counts(table, replicas, most)
    return [Survival(k, comb(table.count, k) - fatal[k], comb(table.count, k)) for k in range(1, most + 1)]


def checkpoint_traffic(table: NodeTable, replicas: int, part_bytes: Sequence[int]) -> list[tuple[int, int]]:
    """Per node, the bytes its ranks send and receive to replicate one checkpoint, ``(sent, received)``:
    each rank's part (``part_bytes[r]``: its data, index and commit) once to each of its peers."""
    sent, received = [0] * table.count, [0] * table.count
    for r, peers in enumerate(peer_map(table, replicas)):
        for p in peers:
            sent[table.nodes[r]] += part_bytes[r]
            received[table.nodes[p]] += part_bytes[r]
    return list(zip(sent, received))


@dataclass(frozen=True)
class RestorePlan:
    """A restore from node memory after a loss, as the level would run it (per rank of the restarted job)."""

    ranks: int
    nodes: int
    whole: bool
    """Every rank's node holds every part: no exchange."""
    read: tuple[int, ...]
    """Bytes each rank reads from its node's memory."""
    sent: tuple[int, ...]
    """Bytes of each rank's stream (its contribution to the exchange)."""
    received: tuple[int, ...]
    """Bytes of the other ranks' streams each rank receives."""
    rounds: tuple[int, ...]
    """The longest contribution of each round."""
    link: int
    """Bytes through each node's link, each way (the ring all-gather, padding included); 0 on one node."""
    seconds: float

    @property
    def wire(self) -> int:
        """Bytes the ring all-gather moves into each rank (``Assembly.wire``), padding included."""
        return sum((self.ranks - 1) * longest for longest in self.rounds)


def restore_plan(table: NodeTable, replicas: int, data_bytes: Sequence[int], lost: Collection[int], *,
                 shrink: bool, network: Network, added: Sequence[int] = (), chunk: int = EXCHANGE) -> RestorePlan:
    """The restore of a checkpoint written by every rank of ``table`` (``data_bytes[w]``: writer ``w``'s
    data file) after the nodes ``lost`` lost their memory: restarted on as many nodes, the lost ones
    empty (``shrink=False``), or on the others only (``shrink=True``, ranks numbered node by node);
    ``added``: the ranks of each empty node that joins the restarted job (numbered after the others).
    Raises :class:`ValueError` when the loss is not survivable."""
    writers = len(table.nodes)
    holding = node_parts(table, replicas)
    gone = set(lost)
    survivors = [r for r in range(writers) if not (shrink and table.nodes[r] in gone)]
    on = [table.nodes[r] for r in survivors]  # the node of each rank of the restarted job (old node numbers)
    views = [{} if node in gone else {str(w): [(1, "step", writers)] for w in holding[node]} for node in on]
    for n, ranks in enumerate(added):
        on += [table.count + n] * ranks
        views += [{} for _ in range(ranks)]
    found = candidates({}, views, len(views))
    if not found:
        raise ValueError(f"losing nodes {sorted(gone)} takes every copy of some rank's part (replicas={replicas})")
    c = found[0]
    ranks, nodes = len(views), len(set(on))
    if c.whole:
        read = sum(data_bytes)
        return RestorePlan(ranks, nodes, True, (read,) * ranks, (0,) * ranks, (0,) * ranks, (), 0,
                           read / network.memory_rate)
    streams = [0] * ranks
    for w, reader in enumerate(c.readers):
        streams[reader] += data_bytes[w]
    rounds = round_sizes(streams, chunk)
    per_round = [[min(chunk, max(0, s - k * chunk)) for s in streams] for k in range(len(rounds))]
    received = tuple(sum(sum(row) - row[r] for row in per_round) for r in range(ranks))
    link = sum((ranks - 1) * longest for longest in rounds) if nodes > 1 else 0
    exchange = sum((ranks - 1) * (network.latency + longest / network.bandwidth) for longest in rounds)
    seconds = max(streams) / network.memory_rate + exchange
    return RestorePlan(ranks, nodes, False, tuple(streams), tuple(streams), received, tuple(rounds), link, seconds)
