"""The snapshot copy on several threads (``copy_threads``): runs of consecutive pieces of about equal
bytes, every byte copied once, the same buffer as one thread makes, CPU seconds of every thread counted."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckpt_engine import Checkpointer
from ckpt_engine.snapshot import SPLIT_MIN, HostBuffer, Snapshots, copy_into, runs
from ckpt_engine.values import encode


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 1 << 22), min_size=1, max_size=60), st.integers(1, 8))
def test_runs_cover_every_piece_once_in_order_and_balance_the_bytes(sizes, parts):
    cut = runs(sizes, parts)
    assert len(cut) == min(parts, len(sizes))
    assert cut[0][0] == 0 and cut[-1][1] == len(sizes)
    assert all(a < b for a, b in cut)  # no empty run
    assert all(cut[i][1] == cut[i + 1][0] for i in range(len(cut) - 1))  # consecutive
    # the slowest thread copies at most its share and one piece more
    assert max(sum(sizes[a:b]) for a, b in cut) <= sum(sizes) / len(cut) + max(sizes)


def _state():
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(3_000_000, generator=g), "b": torch.randint(0, 100, (700, 900), generator=g).t(),
            "c": torch.randn(1_234_567, generator=g).to(torch.bfloat16), "d": torch.zeros(0), "e": 3}


def test_several_threads_make_the_same_buffer_as_one(tmp_path):
    state = _state()
    snaps = Snapshots(rank=0, world_size=1, max_inflight=1)
    enc, lenc = encode(state), encode(None, "local", sharded=False)
    lay, plan = snaps.plan(enc, lenc)
    assert plan.host_bytes >= SPLIT_MIN
    one, many = HostBuffer(plan.nbytes, pinned=False), HostBuffer(plan.nbytes, pinned=False)
    copy_into(one, plan, None)
    with ThreadPoolExecutor(3) as helpers:
        event, helper_cpu = copy_into(many, plan, None, helpers, threads=4)
    assert event is None and helper_cpu > 0
    assert bytes(one.view(lay.nbytes)) == bytes(many.view(lay.nbytes))


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_a_save_copies_on_copy_threads_and_loads_back_exactly(tmp_path, copy_threads):
    state = _state()
    with Checkpointer(str(tmp_path), copy_threads=copy_threads) as ck:
        before = {t.name for t in threading.enumerate()}
        ck.save(state, 1)
        copiers = {t.name for t in threading.enumerate()} - before
        assert any(n.startswith("ckpt-copy") for n in copiers) == (copy_threads > 1)
        ck.wait()
        rec = ck.records[-1]
        assert rec.snapshot_cpu_s > 0
        loaded = ck.load()
    for k in ("a", "b", "c", "d"):
        assert torch.equal(loaded[k], state[k]) and loaded[k].dtype == state[k].dtype
    assert loaded["e"] == 3


def test_a_deferred_copy_stays_on_one_thread(tmp_path):
    with Checkpointer(str(tmp_path), copy_threads=4) as ck:
        ck.save(_state(), 1, defer=True).wait_snapshot()
        assert not any(t.name.startswith("ckpt-copy") for t in threading.enumerate())
        ck.wait()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_copy_threads_must_be_a_positive_integer(tmp_path, bad):
    with pytest.raises(ValueError, match=f"copy_threads must be a positive integer or None, got {bad!r}"):
        Checkpointer(str(tmp_path), copy_threads=bad)
