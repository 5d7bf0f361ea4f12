"""Planner: a pure function of (tensor metadata, world size), tested for 1..1024 ranks in one process."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.format.entries import RankRecord, TensorEntry
from ckpt_engine.format.manifest import Manifest
from ckpt_engine.state.plan import SPLIT, TensorMeta, make_plan
from model_shapes import gpt2_small, metas, resnet50

ITEMSIZE = {"float32": 4, "bfloat16": 2, "int64": 8, "bool": 1}

tensor_metas = st.lists(
    st.builds(lambda dtype, shape: TensorMeta(dtype, tuple(shape), ITEMSIZE[dtype]),
              st.sampled_from(sorted(ITEMSIZE)), st.lists(st.integers(0, 300), max_size=3)),
    max_size=40,
)


def covered_once(plan, ms) -> bool:
    """Every element of every tensor is owned by exactly one rank."""
    seen = [[] for _ in ms]
    for rank in range(plan.world_size):
        for s in plan.slices_for(rank, ms):
            assert 0 <= s.start < s.stop <= ms[s.tensor].numel
            seen[s.tensor].append((s.start, s.stop))
    for i, m in enumerate(ms):
        end = 0
        for start, stop in sorted(seen[i]):
            if start != end:
                return False
            end = stop
        if end != m.numel:
            return False
    return True


@settings(max_examples=150, deadline=None)
@given(tensor_metas, st.integers(1, 1024))
def test_every_byte_planned_exactly_once(ms, world):
    plan = make_plan(ms, world)
    assert covered_once(plan, ms)
    assert sum(plan.rank_bytes(ms)) == sum(m.nbytes for m in ms)


@settings(max_examples=100, deadline=None)
@given(tensor_metas, st.integers(1, 1024))
def test_plan_is_deterministic_and_order_sensitive_only_by_input(ms, world):
    assert make_plan(ms, world) == make_plan(list(ms), world)
    assert make_plan(ms, world) == make_plan(tuple(TensorMeta(m.dtype, m.shape, m.itemsize) for m in ms), world)


@pytest.mark.parametrize("model", [resnet50, gpt2_small])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 16, 32, 64, 100, 128, 256, 512, 1000, 1024])
def test_balance_within_two_percent_on_real_models(model, world):
    ms = metas(model())
    loads = make_plan(ms, world).rank_bytes(ms)
    mean = sum(loads) / world
    assert max(abs(x - mean) for x in loads) <= 0.02 * mean, (min(loads), max(loads), mean)


def test_large_tensors_are_split_across_every_rank_and_small_ones_whole():
    ms = metas(resnet50())
    plan = make_plan(ms, 8)
    big = max(range(len(ms)), key=lambda i: ms[i].nbytes)
    assert plan.owner[big] == SPLIT
    assert all(any(s.tensor == big for s in plan.slices_for(r, ms)) for r in range(8))
    small = [i for i, m in enumerate(ms) if m.nbytes < plan.split_threshold]
    assert small and all(plan.owner[i] != SPLIT for i in small)


def test_single_rank_owns_everything_whole():
    ms = metas(gpt2_small(layers=2))
    plan = make_plan(ms, 1)
    assert set(plan.owner) == {0}
    assert [s.stop for s in plan.slices_for(0, ms)] == [m.numel for m in ms if m.numel]


def test_ten_thousand_tensors_on_1024_ranks_plan_and_manifest_bounded():
    # Sizes, not wall time (that is benchmarks/bench_plan.py): the plan holds one owner per tensor,
    # nothing per (tensor, rank), and a rank's slices are at most one per tensor.
    shapes = [(1024, 256) if i % 10 == 0 else (256,) if i % 2 else (64, 64) for i in range(10_000)]
    ms = metas(shapes)
    plan = make_plan(ms, 1024)
    assert len(plan.owner) == 10_000
    mine = plan.slices_for(517, ms)
    split = [i for i, o in enumerate(plan.owner) if o == SPLIT]
    assert len(mine) <= 10_000 and {s.tensor for s in mine} >= set(split) and split
    tensors = tuple(TensorEntry(m.dtype, m.shape, o, f"state['model']['layer{i}.weight']")
                    for i, (m, o) in enumerate(zip(ms, plan.owner)))
    manifest = Manifest(7, 1024, 0.0, plan.split_threshold, tensors,
                        {"$dict": [[f"t{i}", {"$tensor": i}] for i in range(10_000)]},
                        tuple(RankRecord(r, 10**9, 10**6, "0" * 16) for r in range(1024)), {})
    size = len(manifest.to_json())
    assert size < 10 * 2**20, size


def test_invalid_world_size():
    with pytest.raises(ValueError, match="world_size"):
        make_plan([], 0)


def test_empty_and_zero_size_tensors():
    ms = [TensorMeta("float32", (0, 5), 4), TensorMeta("float32", (), 4)]
    plan = make_plan(ms, 4)
    assert covered_once(plan, ms)
    assert math.fsum(plan.rank_bytes(ms)) == 4
