"""The memory level on paper (ckpt_engine/levels/scale.py): which losses of nodes it survives, the
bytes it moves, a restore's rounds, checked against brute force over every pattern of lost nodes
with the restore's own choice, against closed forms at 128 nodes x 8 ranks, and (in
tests/test_memory_nodes.py) against what real 4 x 2 jobs moved."""

from __future__ import annotations

from itertools import combinations
from math import comb

import pytest

from ckpt_engine.levels.assemble import EXCHANGE, round_sizes
from ckpt_engine.levels.memory import NodeTable
from ckpt_engine.levels.open import assemblable
from ckpt_engine.levels.scale import (Network, checkpoint_traffic, fatal_counts, grid, node_parts, restore_plan,
                                      survival, survives)

NET = Network(bandwidth=25e9, latency=20e-6, memory_rate=5e9)


def _assembles_after(table: NodeTable, replicas: int, lost: set[int]) -> bool:
    """What a restart on the surviving nodes finds, by the restore's own rule: every writer's part
    held by some rank (:func:`assemblable` over the views of the surviving ranks)."""
    holding = node_parts(table, replicas)
    views = [{str(w): [(1, "s", len(table.nodes))] for w in holding[n]} for n in table.nodes if n not in lost]
    return bool(assemblable(views))


@pytest.mark.parametrize("keys", ["0 0 1 1 2 2 3 3 4 4 5 5 6 6", "0 0 0 1 2 2 3 3 3 3 4 5 5"])
@pytest.mark.parametrize("replicas", [0, 1, 2])
def test_the_count_of_survivable_losses_is_what_every_pattern_says(keys, replicas):
    """Inclusion-exclusion over the holder sets equals brute force over every set of lost nodes,
    each judged by the restore's own choice, on even and uneven nodes."""
    table = NodeTable.of(keys.split())
    fatal = fatal_counts(table, replicas, 4)
    for k in range(5):
        patterns = list(combinations(range(table.count), k))
        assert sum(not _assembles_after(table, replicas, set(p)) for p in patterns) == fatal[k], k
        assert all(survives(table, replicas, p) == _assembles_after(table, replicas, set(p)) for p in patterns)


def _cycle_count(n: int, k: int, run: int) -> int:
    """Sets of ``k`` of ``n`` nodes in a ring with no ``run`` consecutive ones (a transfer-matrix count
    over binary necklaces: position 0 fixed to each of its run lengths)."""
    total = 0
    for lead in range(run):  # ones at the start of the ring, then a zero
        for tail in range(run - lead):  # ones at the end, after a zero
            m = n - lead - tail  # the middle: starts and ends with a zero
            if m < 1:
                continue
            # linear strings of length m, first and last zero (the same one when m == 1), no run >= run
            ways = [[0] * (k + 1) for _ in range(run)]  # [current run][ones]
            ways[0][0] = 1
            for _ in range(m - 1):
                nxt = [[0] * (k + 1) for _ in range(run)]
                for r in range(run):
                    for j in range(k + 1):
                        if ways[r][j]:
                            nxt[0][j] += ways[r][j]
                            if r + 1 < run and j + 1 <= k:
                                nxt[r + 1][j + 1] += ways[r][j]
                ways = nxt
            ones = k - lead - tail
            if ones >= 0:
                total += ways[0][ones]
    return total


@pytest.mark.parametrize("replicas", [1, 2])
def test_at_128_nodes_a_loss_is_survivable_unless_it_takes_replicas_plus_one_nodes_in_a_row(replicas):
    """Each rank's part is on its node and the next ``replicas`` nodes: a set of lost nodes is fatal
    exactly when it holds ``replicas + 1`` consecutive nodes of the ring."""
    table = grid(128, 8)
    rows = survival(table, replicas, 4)
    assert [r.survivable for r in rows] == [_cycle_count(128, k, replicas + 1) for k in range(1, 5)]
    assert [r.patterns for r in rows] == [comb(128, k) for k in range(1, 5)]
    if replicas == 1:  # no two neighbours: n / (n - k) * comb(n - k, k)
        assert [r.survivable for r in rows] == [128 * comb(128 - k, k) // (128 - k) for k in range(1, 5)]
        assert [round(r.probability, 4) for r in rows] == [1.0, 0.9843, 0.9531, 0.9077]
    else:
        assert [r.survivable for r in rows[:2]] == [128, comb(128, 2)] and rows[2].survivable == comb(128, 3) - 128


def test_each_node_sends_and_receives_its_ranks_parts_times_the_replicas():
    table = grid(128, 8)
    for replicas in (1, 2):
        assert set(checkpoint_traffic(table, replicas, [1000] * 1024)) == {(8 * 1000 * replicas,) * 2}
    uneven = NodeTable.of("a a a b c c".split())
    parts = [10, 20, 30, 40, 50, 60]
    traffic = checkpoint_traffic(uneven, 1, parts)
    assert sum(s for s, _ in traffic) == sum(r for _, r in traffic) == sum(parts)
    assert traffic == [(60, 50 + 60), (40, 10 + 20 + 30), (110, 40)]  # b's one rank receives a's three parts


def test_the_exchange_runs_as_many_rounds_as_the_longest_stream_needs_padded_to_the_longest():
    assert round_sizes([]) == [] and round_sizes([0, 0]) == []
    assert round_sizes([5, 12, 0], chunk=4) == [4, 4, 4]
    assert round_sizes([5, 9, 0], chunk=4) == [4, 4, 1]
    assert round_sizes([EXCHANGE + 1]) == [EXCHANGE, 1]


def test_a_restore_at_128_nodes_after_a_node_is_lost():
    table, part = grid(128, 8), 24 << 20
    whole = restore_plan(table, 1, [part] * 1024, (), shrink=False, network=NET)
    assert (whole.whole, max(whole.sent), whole.rounds, whole.link) == (False, part, (part,), 1023 * part)
    for shrink in (False, True):  # some rank reads two parts (its own and one of the lost node's)
        plan = restore_plan(table, 1, [part] * 1024, {5}, shrink=shrink, network=NET)
        assert (plan.ranks, plan.nodes) == ((1016, 127) if shrink else (1024, 128))
        empty = [] if shrink else [0]  # the replaced node's ranks hold nothing to read
        assert sorted(set(plan.sent)) == empty + [part, 2 * part] and plan.rounds == (2 * part,)
        assert plan.link == plan.wire == (plan.ranks - 1) * 2 * part
        assert plan.seconds == pytest.approx(2 * part / NET.memory_rate
                                             + (plan.ranks - 1) * (NET.latency + 2 * part / NET.bandwidth))
    with pytest.raises(ValueError, match=r"losing nodes \[5, 6\]"):
        restore_plan(table, 1, [part] * 1024, {5, 6}, shrink=True, network=NET)
    assert restore_plan(table, 2, [part] * 1024, {5, 6}, shrink=True, network=NET).ranks == 1008


def test_a_node_that_holds_every_part_restores_without_an_exchange():
    plan = restore_plan(grid(2, 2), 1, [100, 200, 300, 400], {1}, shrink=True, network=NET)
    assert (plan.whole, plan.ranks, plan.read, plan.link, plan.rounds) == (True, 2, (1000, 1000), 0, ())
    grown = restore_plan(grid(2, 2), 1, [100, 200, 300, 400], (), shrink=False, network=NET, added=(2,))
    assert (grown.whole, grown.ranks, grown.nodes, grown.sent) == (False, 6, 3, (100, 200, 300, 400, 0, 0))
