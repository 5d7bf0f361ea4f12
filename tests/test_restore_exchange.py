"""A collective restore where each rank reads a share and the communicator brings the rest
(load/exchange.py): the pure split and probe logic property-tested; every route, the agreement on a
corrupted share and ``auto``'s choice with ranks as threads of this process (tests/thread_ranks.py, each
rank a node of its own where the test says so); then real gloo jobs for what only processes show: bytes
read counted by the kernel for each rank (``/proc/self/io``), a node per process by torchrun's
``GROUP_RANK``, a column-sharded (tensor-parallel) weight written by ``torch.distributed``."""

from __future__ import annotations

import shutil
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpt_engine import Checkpointer
from ckpt_engine.comm import LocalComm
from ckpt_engine.config import CheckpointConfig, ConfigError
from ckpt_engine.format.catalog import manifest_dirs
from ckpt_engine.format.entries import data_file
from ckpt_engine.load import agreed, exchange
from ckpt_engine.load.exchange import Exchange, _probe_length
from ckpt_engine.load.open import open_checkpoint
from ckpt_engine.load.read import split_by_bytes
from ckpt_engine.storage import open_storage
from dist_worker import columns_sharded, digest, make_local, make_state
from ranks import run_ranks
import thread_ranks

SMALL = {"MIN_PIECE": "4096"}  # the test state's pieces are small: exchange all but the tiniest
ROUTE_CASES = [(2, 2), (3, 2), (2, 3)]
ROUTES = ["exchange", "read", "auto"]


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
        CheckpointConfig(dirpath="/tmp/x", restore_route="fast")
    assert not Exchange(LocalComm(), "exchange").applies(None)  # one process: nothing to exchange


@pytest.fixture(scope="module")
def on_threads(tmp_path_factory):
    """Steps 1..3 written by 2 and by 3 ranks as threads."""
    roots = {}
    for world in (2, 3):
        roots[world] = str(tmp_path_factory.mktemp(f"t{world}"))
        thread_ranks.save(roots[world], world)
    return roots


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(exchange, "MIN_PIECE", int(SMALL["MIN_PIECE"]))


@pytest.fixture
def node_each(monkeypatch):
    """Each rank a node of its own: the node name answers by thread (``rank-N``, run_ranks's names),
    as ``GROUP_RANK`` does for each process of a gloo job."""
    monkeypatch.setattr(agreed, "node_name", lambda: threading.current_thread().name)


def expected_state(step: int, sharded: bool = False) -> dict:
    state = make_state(step)
    if sharded:
        state["model"]["tp"] = columns_sharded(step)
    return digest(state)


def state_bytes(root: str) -> tuple[int, int]:
    """Bytes of the newest checkpoint's replicated state, and of its largest piece."""
    storage = open_storage(root)
    ck = open_checkpoint(storage, manifest_dirs(storage)[-1][1])
    sizes = [e.nbytes for idx in ck.indexes for e in idx.entries if not e.local]
    return sum(sizes), max(sizes)


def check_routes(results: list[dict], root: str, route: str, writers: int, readers: int, sharded: bool) -> None:
    """Every route restores the same bits, and exchange reads a share (by the figures; by the kernel
    too where each rank is a process, ``rchar`` in its results)."""
    total, biggest = state_bytes(root)
    share = total / readers + biggest  # pieces are verified whole, so a share ends on a piece's end
    for res in results:
        rank = res["rank"]
        for i, r in enumerate(res["restores"]):
            assert r["step"] == 3 and r["failures"] == []
            assert r["state"] == expected_state(3, sharded)
            assert r["local"] == (digest(make_local(3, rank)) if rank < writers else digest(None))
            figures = r["figures"]
            if route == "read" or (i == 1 and res["restores"][0]["figures"]["route"] == "auto→read"):
                assert figures is None and r.get("rchar", total) >= total  # every rank read everything
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
                assert r.get("rchar", 0) <= share + (256 << 10), (r.get("rchar"), share)  # the kernel agrees (+ metadata)
    if route == "auto":
        measured = [res["restores"][0]["figures"]["measured"] for res in results]
        assert all(m == measured[0] for m in measured)  # one decision, from gathered figures
        assert set(measured[0]) == {"read_GBps", "exchange_GBps", "rest_read_s", "rest_exchange_s"}


def check_one_node(results: list[dict], total: int, sharded: bool) -> None:
    """One node has one page cache: the storage serves the state once either way, so ``auto`` reads
    without measuring (an exchange would only add the loopback transfer)."""
    for res in results:
        first, second = res["restores"]
        assert first["figures"]["route"] == "auto→read" and first["figures"]["measured"] == {"nodes": 1.0}
        assert second["figures"] is None and second.get("rchar", total) >= total  # read directly, as chosen
        assert first["state"] == second["state"] == expected_state(3, sharded) and first.get("rchar", total) >= total


@pytest.mark.parametrize("writers, readers", ROUTE_CASES)
@pytest.mark.parametrize("route", ROUTES)
def test_every_route_restores_the_same_bits_and_exchange_reads_a_share(on_threads, writers, readers, route,
                                                                        small_pieces, node_each):
    results = thread_ranks.restore(on_threads[writers], readers, route)
    check_routes(results, on_threads[writers], route, writers, readers, sharded=False)


def test_auto_reads_when_every_rank_is_on_one_node(on_threads, small_pieces):
    check_one_node(thread_ranks.restore(on_threads[2], 2, "auto"), state_bytes(on_threads[2])[0], sharded=False)


@pytest.mark.parametrize("route", ["exchange", "auto"])
def test_a_corrupted_share_moves_every_rank_to_the_older_checkpoint(on_threads, route, tmp_path, small_pieces,
                                                                    node_each):
    """Only the rank that reads a piece verifies it: it tells the others before any exchange, and
    all ranks fall back together."""
    root = tmp_path / "root"
    shutil.copytree(on_threads[2], root)
    storage = open_storage(str(root))
    name = manifest_dirs(storage)[-1][1]
    ck = open_checkpoint(storage, name)
    last = max((e for e in ck.indexes[1].entries if not e.local), key=lambda e: e.offset)  # read by the last rank
    with open(root / name / data_file(1), "r+b") as f:
        f.seek(last.offset + 5)
        byte = f.read(1)
        f.seek(last.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    for res in thread_ranks.restore(str(root), 2, route):
        first = res["restores"][0]
        assert first["step"] == 2 and first["state"] == expected_state(2)
        assert len(first["failures"]) == 1 and "checksum mismatch" in first["failures"][0]
        assert data_file(1) in first["failures"][0] and "rank 1" in first["failures"][0]


# ---- real gloo jobs ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Steps 1..3 written by 2 and by 3 gloo ranks, with a column-sharded (tensor-parallel) weight."""
    roots = {}
    for world in (2, 3):
        root = tmp_path_factory.mktemp(f"x{world}")
        run_ranks(world, "save", f"file://{root}", root / "out", "3", env={"COLUMNS_SHARDED": "1"})
        roots[world] = str(root)
    return roots


def one_node_each(world: int) -> list[dict]:
    """Environment making each rank a node of its own (torchrun's node rank), as across a cluster."""
    return [{"GROUP_RANK": str(r)} for r in range(world)]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("route, writers, readers", [("exchange", 2, 3), ("auto", 3, 2)])
def test_gloo_ranks_on_nodes_of_their_own_read_a_share_by_the_kernels_count(written, route, writers, readers,
                                                                             tmp_path):
    results = run_ranks(readers, "restore", written[writers], tmp_path / "out", env={**SMALL, "ROUTE": route},
                        rank_env=one_node_each(readers))
    check_routes(results, written[writers], route, writers, readers, sharded=True)


@pytest.mark.slow
@pytest.mark.integration
def test_gloo_ranks_on_one_node_read_directly_by_the_kernels_count(written, tmp_path):
    results = run_ranks(2, "restore", written[2], tmp_path / "out", env={**SMALL, "ROUTE": "auto"})
    check_one_node(results, state_bytes(written[2])[0], sharded=True)


@pytest.mark.slow
def test_load_in_one_process_ignores_the_route(written):
    ck = Checkpointer(written[2], restore_route="exchange", readonly=True)
    assert digest(ck.load()) == expected_state(3, sharded=True)
    assert digest(ck.restore().state) == expected_state(3, sharded=True) and ck.restore_figures is None
