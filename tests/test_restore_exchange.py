"""A collective restore where each rank reads a share and the communicator brings the rest
(load/exchange.py): real gloo ranks, every route, bytes read counted by the kernel
(``/proc/self/io``), a corrupted share, a column-sharded (tensor-parallel) weight; the pure split
and probe logic property-tested."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpt_engine import Checkpointer
from ckpt_engine.comm import LocalComm
from ckpt_engine.config import CheckpointConfig, ConfigError
from ckpt_engine.format.catalog import manifest_dirs
from ckpt_engine.format.entries import data_file
from ckpt_engine.load.exchange import Exchange, _probe_length
from ckpt_engine.load.open import open_checkpoint
from ckpt_engine.load.read import split_by_bytes
from ckpt_engine.storage import Storage
from dist_worker import columns_sharded, digest, make_local, make_state
from ranks import run_ranks

SMALL = {"MIN_PIECE": "4096"}  # the test state's pieces are small: exchange all but the tiniest


@given(st.lists(st.integers(0, 1 << 30), max_size=60), st.integers(1, 9))
def test_split_by_bytes_gives_consecutive_runs_of_about_equal_bytes(sizes, parts):
    got = split_by_bytes(sizes, parts)
    assert len(got) == len(sizes) and all(0 <= p < parts for p in got)
    assert got == sorted(got)  # each part is one run of consecutive items
    total, biggest = sum(sizes), max(sizes, default=0)
    for p in range(parts):
        assert sum(n for n, q in zip(sizes, got) if q == p) <= total / parts + biggest


@given(st.lists(st.integers(1, 1 << 30), min_size=1, max_size=60))
def test_the_probe_is_the_first_eighth_of_the_bytes_and_at_least_one_piece(sizes):
    k = _probe_length(sizes)
    assert 1 <= k <= len(sizes)
    assert sum(sizes[:k]) >= sum(sizes) / 8 and (k == 1 or sum(sizes[:k - 1]) < sum(sizes) / 8)


def test_routes_are_validated_everywhere():
    with pytest.raises(ValueError, match="restore_route must be one of 'auto', 'read', 'exchange', got 'fast'"):
        Exchange(LocalComm(), "fast")
    with pytest.raises(ConfigError, match="restore_route"):
        CheckpointConfig(path="/tmp/x", restore_route="fast")
    assert not Exchange(LocalComm(), "exchange").applies(None)  # one process: nothing to exchange


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Steps 1..3 written by 2 and by 3 ranks, with a column-sharded (tensor-parallel) weight."""
    roots = {}
    for world in (2, 3):
        root = tmp_path_factory.mktemp(f"x{world}")
        run_ranks(world, "save", f"file://{root}", root / "out", "3", env={"COLUMNS_SHARDED": "1"})
        roots[world] = str(root)
    return roots


def expected_state(step: int) -> dict:
    state = make_state(step)
    state["model"]["tp"] = columns_sharded(step)
    return digest(state)


def state_bytes(root: str) -> tuple[int, int]:
    """Bytes of the newest checkpoint's replicated state, and of its largest piece."""
    storage = Storage(root)
    ck = open_checkpoint(storage, manifest_dirs(storage)[-1][1])
    sizes = [e.nbytes for idx in ck.indexes for e in idx.entries if not e.local]
    return sum(sizes), max(sizes)


def one_node_each(world: int) -> list[dict]:
    """Environment making each rank a node of its own (torchrun's node rank), as across a cluster."""
    return [{"GROUP_RANK": str(r)} for r in range(world)]


@pytest.mark.integration
@pytest.mark.parametrize("writers, readers", [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("route", ["exchange", "read", "auto"])
def test_every_route_restores_the_same_bits_and_exchange_reads_a_share(written, writers, readers, route,
                                                                        tmp_path):
    """Each rank a node of its own (``auto`` measures both ways then)."""
    total, biggest = state_bytes(written[writers])
    share = total / readers + biggest  # pieces are verified whole, so a share ends on a piece's end
    results = run_ranks(readers, "restore", written[writers], tmp_path / "out", env={**SMALL, "ROUTE": route},
                        rank_env=one_node_each(readers))
    for res in results:
        rank = res["rank"]
        for i, r in enumerate(res["restores"]):
            assert r["step"] == 3 and r["failures"] == []
            assert r["state"] == expected_state(3)
            assert r["local"] == (digest(make_local(3, rank)) if rank < writers else digest(None))
            figures = r["figures"]
            if route == "read" or (i == 1 and res["restores"][0]["figures"]["route"] == "auto→read"):
                assert figures is None and r["rchar"] >= total  # every rank read everything
                continue
            taken = figures["route"]
            if route == "exchange":
                assert taken == "exchange"
            elif i == 0:
                assert taken in ("auto→read", "auto→exchange")
            else:  # the second restore goes the way the first chose, unmeasured
                assert taken == "exchange"
            if taken.endswith("exchange"):
                assert figures["read_bytes"] + figures["received_bytes"] == total
                assert figures["read_bytes"] <= share, figures  # a share, not the whole
                assert r["rchar"] <= share + (256 << 10), (r["rchar"], share)  # the kernel agrees (+ metadata)
    if route == "auto":
        measured = [res["restores"][0]["figures"]["measured"] for res in results]
        assert all(m == measured[0] for m in measured)  # one decision, from gathered figures
        assert set(measured[0]) == {"read_GBps", "exchange_GBps", "rest_read_s", "rest_exchange_s"}


@pytest.mark.integration
def test_auto_reads_when_every_rank_is_on_one_node(written, tmp_path):
    """One node has one page cache: the storage serves the state once either way, so ``auto`` reads
    without measuring (an exchange would only add the loopback transfer)."""
    total, _ = state_bytes(written[2])
    for res in run_ranks(2, "restore", written[2], tmp_path / "out", env={**SMALL, "ROUTE": "auto"}):
        first, second = res["restores"]
        assert first["figures"]["route"] == "auto→read" and first["figures"]["measured"] == {"nodes": 1.0}
        assert second["figures"] is None and second["rchar"] >= total  # read directly, as chosen
        assert first["state"] == second["state"] == expected_state(3) and first["rchar"] >= total


@pytest.mark.integration
@pytest.mark.parametrize("route", ["exchange", "auto"])
def test_a_corrupted_share_moves_every_rank_to_the_older_checkpoint(written, route, tmp_path):
    """Only the rank that reads a piece verifies it: it tells the others before any exchange, and
    all ranks fall back together."""
    root = tmp_path / "root"
    os.system(f"cp -r {written[2]} {root}")
    storage = Storage(str(root))
    name = manifest_dirs(storage)[-1][1]
    ck = open_checkpoint(storage, name)
    last = max((e for e in ck.indexes[1].entries if not e.local), key=lambda e: e.offset)  # read by the last rank
    with open(root / name / data_file(1), "r+b") as f:
        f.seek(last.offset + 5)
        byte = f.read(1)
        f.seek(last.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    results = run_ranks(2, "restore", str(root), tmp_path / "out", env={**SMALL, "ROUTE": route},
                        rank_env=one_node_each(2))
    for res in results:
        first = res["restores"][0]
        assert first["step"] == 2 and first["state"] == expected_state(2)
        assert len(first["failures"]) == 1 and "checksum mismatch" in first["failures"][0]
        assert data_file(1) in first["failures"][0] and "rank 1" in first["failures"][0]


def test_load_in_one_process_ignores_the_route(written):
    ck = Checkpointer(written[2], restore_route="exchange", readonly=True)
    assert digest(ck.load()) == expected_state(3)
    assert digest(ck.restore().state) == expected_state(3) and ck.restore_figures is None
