"""Sharded state, pure parts: chunk geometry, where stored pieces go, the manifest's sharded records.

No process group here: the planner's and reader's rules are pure functions of shapes, chunks and
ranges, tested against brute force over many shapes (hypothesis), the way the planner is.
"""

from __future__ import annotations

import gc
import itertools
import json
import sys
import weakref
from math import prod

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.errors import FormatError
from ckpt_engine.format.entries import SHARDED, IndexEntry, RankRecord, TensorEntry
from ckpt_engine.format.manifest import Manifest, RankIndex, check_coverage
from ckpt_engine.load.places import Places, Target, bytes_of
from ckpt_engine.save.layout import PIECE_BYTES, layout
from ckpt_engine.sharding.boxes import (box_of, contiguous_start, full_box, index_boxes, intersect, numel, range_boxes,
                                        relative, tiling_error)
from ckpt_engine.sharding.dtensors import Sharding
from ckpt_engine.state.plan import TensorMeta, chunk_slice, make_plan

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)


def _cells(box):
    return set(itertools.product(*(range(a, b) for a, b in box)))


def _chunks(shape, cuts):
    """The chunks of a grid with cut points ``cuts[d]`` (sorted, inside the dimension)."""
    edges = [[0, *c, n] for c, n in zip(cuts, shape)]
    return [tuple(zip(lo, hi)) for lo, hi in
            ((tuple(e[i] for e, i in zip(edges, idx)), tuple(e[i + 1] for e, i in zip(edges, idx)))
             for idx in itertools.product(*(range(len(e) - 1) for e in edges)))]


@st.composite
def grids(draw):
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple))
    cuts = [sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else [] for n in shape]
    return shape, _chunks(shape, cuts)


# ---- geometry -------------------------------------------------------------------------------------
@settings(max_examples=200)
@given(shapes, st.data())
def test_range_boxes_are_the_range_in_order(shape, data):
    chunk_sizes = tuple(data.draw(st.integers(1, n)) for n in shape)
    offsets = tuple(data.draw(st.integers(0, n - c)) for n, c in zip(shape, chunk_sizes))
    chunk = box_of(offsets, chunk_sizes)
    n = numel(chunk)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    order = list(itertools.product(*(range(a, b) for a, b in chunk)))  # row-major
    got = []
    for at, box in range_boxes(chunk, start, stop):
        assert at == len(got) and intersect(box, chunk) == box
        got += list(itertools.product(*(range(a, b) for a, b in box)))
    assert got == order[start:stop]
    assert len(index_boxes(chunk_sizes, start, stop)) <= max(1, 2 * len(shape) - 1)


@settings(max_examples=200)
@given(shapes, st.data())
def test_contiguous_start_agrees_with_brute_force(shape, data):
    inner = tuple((a, data.draw(st.integers(a + 1, n))) for n in shape for a in [data.draw(st.integers(0, n - 1))])
    outer = full_box(shape)
    order = list(itertools.product(*(range(n) for n in shape)))
    positions = sorted(order.index(c) for c in itertools.product(*(range(a, b) for a, b in inner)))
    one_run = positions == list(range(positions[0], positions[0] + len(positions)))
    assert contiguous_start(inner, outer) == (positions[0] if one_run else None)


@settings(max_examples=150)
@given(grids(), st.data())
def test_tiling_accepts_a_grid_and_names_a_gap_or_an_overlap(grid, data):
    shape, chunks = grid
    assert tiling_error(chunks, shape) is None
    if len(chunks) > 1:
        victim = data.draw(st.integers(0, len(chunks) - 1))
        assert "uncovered" in tiling_error(chunks[:victim] + chunks[victim + 1:], shape)
        assert "overlaps" in tiling_error(chunks + [chunks[victim]], shape)
    assert "outside" in tiling_error(chunks + [tuple((0, n + 1) for n in shape)], shape)


def test_tiling_of_overlap_and_gap_of_equal_size_is_refused():
    # [0:2) and [1:3) of 4 elements: the same total as a tiling, but it overlaps and leaves 3 uncovered
    assert tiling_error([((0, 2),), ((1, 3),)], (3,)) is not None
    assert tiling_error([((0, 2),), ((1, 3),)], (4,)) is not None


# ---- planning ----------------------------------------------------------------------------------------
def test_sharded_tensors_are_left_to_their_holders_and_the_rest_planned_as_before():
    metas = [TensorMeta("float32", (1000, 100), 4), TensorMeta("float32", (300,), 4), TensorMeta("float32", (50,), 4)]
    plain = make_plan([metas[1], metas[2]], 2)
    plan = make_plan(metas, 2, sharded=[True, False, False])
    assert plan.owner[0] == SHARDED and plan.owner[1:] == plain.owner
    assert plan.split_threshold == plain.split_threshold  # sharded bytes do not move the threshold
    assert all(s.tensor != 0 for r in range(2) for s in plan.slices_for(r, metas))
    assert sum(plan.rank_bytes(metas)) == 350 * 4


@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
def test_the_replicas_of_a_chunk_write_it_once_between_them(replicas):
    chunk = ((4, 10), (0, 7))
    slices = [chunk_slice(3, chunk, r, replicas) for r in range(replicas)]
    got = sorted((s.start, s.stop) for s in slices if s is not None)
    assert got[0][0] == 0 and got[-1][1] == 42 and all(a[1] == b[0] for a, b in zip(got, got[1:]))
    assert all(s is None or (s.box == chunk and s.tensor == 3) for s in slices)


def test_long_slices_are_stored_as_pieces_of_at_most_piece_bytes():
    from ckpt_engine.state.plan import Slice

    per = PIECE_BYTES // 4  # float32 elements in a piece
    n = 2 * per + 10
    pieces, nbytes = layout([Slice(0, 5, n), Slice(1, 0, 6, box=((0, 2), (0, 3)))], [4, 2], [])
    assert [(p.start, p.stop) for p in pieces[:3]] == [(5, 5 + per), (5 + per, 5 + 2 * per), (5 + 2 * per, n)]
    assert all(p.nbytes <= PIECE_BYTES for p in pieces) and pieces[3].box == ((0, 2), (0, 3))
    assert nbytes >= sum(p.nbytes for p in pieces)


# ---- placing stored pieces into any chunks ---------------------------------------------------------
def _stored(table, tensor, chunks, replicas, piece):
    """Index entries of ``tensor`` stored as ``chunks`` (or whole), each split among ``replicas``, in pieces."""
    out = []
    for chunk in chunks:
        n = numel(chunk)
        for r in range(replicas):
            lo, hi = n * r // replicas, n * (r + 1) // replicas
            for a in range(lo, hi, piece):
                b = min(hi, a + piece)
                out.append(IndexEntry(False, tensor, a, b, 0, (b - a) * 4, "0" * 16,
                                      box=chunk if table[tensor].owner == SHARDED else None))
    return out


def _bytes_of(entry, whole, table):
    """The elements an entry holds, cut from the whole tensor (what its file would hold)."""
    chunk = entry.box if entry.box is not None else full_box(table[entry.tensor].shape)
    return whole[tuple(slice(a, b) for a, b in chunk)].reshape(-1)[entry.start:entry.stop].clone()


@settings(max_examples=120)
@given(grids(), grids(), st.integers(1, 3), st.integers(1, 7), st.booleans())
def test_any_stored_chunks_fill_any_target_chunks(saved, wanted, replicas, piece, sharded):
    shape, chunks = saved
    _, targets_boxes = wanted
    if len(wanted[0]) != len(shape):
        return
    targets_boxes = _chunks(shape, [sorted({min(max(1, c), n - 1) for b in targets_boxes for c in (b[d][0],)
                                            if 0 < c < n}) for d, n in enumerate(shape)])
    table = (TensorEntry("float32", shape, SHARDED if sharded else -1, "w", Sharding((2,), ("Shard(dim=0)",))
                         if sharded else None),)
    whole = torch.arange(prod(shape), dtype=torch.float32).reshape(shape)
    entries = _stored(table, 0, chunks if sharded else [full_box(shape)], replicas, piece)
    targets = [Target(0, box, torch.full(tuple(b - a for a, b in box), -1.0)) for box in targets_boxes]
    for target in targets:  # each rank alone: only its own target
        places = Places(table, [target])
        needed = [e for e in entries if places.needed(e)]
        for e in needed:
            view = places.in_place(e)
            data = _bytes_of(e, whole, table)
            if view is None:
                places.scatter(e, data)
            else:
                view[:] = memoryview(data.view(torch.uint8).numpy())
        assert torch.equal(target.out, whole[relative(target.box, full_box(shape))])
        # what was read is what meets the target: no piece that lies wholly outside it
        for e in needed:
            chunk = e.box if e.box is not None else full_box(shape)
            assert any(intersect(b, target.box) for _, b in range_boxes(chunk, e.start, e.stop))


def test_same_chunks_and_row_chunks_are_read_in_place():
    table = (TensorEntry("float32", (6, 4), SHARDED, "w", Sharding((2,), ("Shard(dim=0)",))),
             TensorEntry("float32", (6, 4), -1, "v"))
    mine = Target(0, ((3, 6), (0, 4)), torch.empty(3, 4))
    whole_rows = Target(1, ((2, 5), (0, 4)), torch.empty(3, 4))
    places = Places(table, [mine, whole_rows])
    same = IndexEntry(False, 0, 2, 9, 0, 28, "0" * 16, box=((3, 6), (0, 4)))
    assert places.in_place(same) is not None and len(places.in_place(same)) == 28
    inside = IndexEntry(False, 1, 9, 17, 0, 32, "0" * 16)  # elements 9:17 of the whole: rows 2-4
    assert places.in_place(inside) is not None
    across = IndexEntry(False, 1, 4, 12, 0, 32, "0" * 16)  # starts in row 1, outside the target
    assert places.needed(across) and places.in_place(across) is None
    columns = Target(0, ((0, 6), (0, 2)), torch.empty(6, 2))
    assert Places(table, [columns]).in_place(same) is None


def test_bytes_of_is_the_tensors_own_memory_and_keeps_it_alive():
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    view = bytes_of(t)
    assert (view.nbytes, view.format, view.readonly) == (24, "B", False)
    view[4:8] = (7).to_bytes(4, sys.byteorder)  # what a read writes lands in the tensor
    assert t.tolist() == [[0, 7, 2], [3, 4, 5]]
    alive = weakref.ref(t)
    del t
    gc.collect()
    assert alive() is not None and bytes(view[4:8]) == (7).to_bytes(4, sys.byteorder)
    del view
    gc.collect()
    assert alive() is None
    assert bytes_of(torch.empty(0, 3)).nbytes == 0


# ---- the manifest's records ------------------------------------------------------------------------
SHARDING = Sharding((2, 2), ("Replicate()", "Shard(dim=0)"), ("replicate", "shard"))


def _sharded_manifest(tensors=None) -> Manifest:
    tensors = tensors or (TensorEntry("float32", (3, 2), SHARDED, "state['w']", SHARDING),
                          TensorEntry("int64", (), 0, "state['n']"))
    return Manifest(7, 2, 1.0, 1024, tensors, {"$dict": [["w", {"$tensor": 0}], ["n", {"$tensor": 1}]]},
                    (RankRecord(0, 128, 10, "0" * 16), RankRecord(1, 64, 10, "0" * 16)), {"attempt": "a"})


def _sharded_indexes(rows=((0, 2), (2, 3)), extra=()):
    def idx(rank, entries):
        return RankIndex(7, rank, 2, "a", 64 * len(entries), tuple(entries), (), None, {})
    e0 = [IndexEntry(False, 0, 0, 4, 0, 16, "0" * 16, box=(rows[0], (0, 2))),
          IndexEntry(False, 1, 0, 1, 64, 8, "0" * 16)]
    e1 = [IndexEntry(False, 0, 0, 2, 0, 8, "0" * 16, box=(rows[1], (0, 2))), *extra]
    return [idx(0, e0), idx(1, e1)]


def test_sharded_records_round_trip_and_only_they_use_version_2():
    m = _sharded_manifest()
    assert Manifest.from_json(m.to_json(), "m") == m
    assert json.loads(m.to_json())["body"]["format_version"] == 2
    plain = _sharded_manifest((TensorEntry("float32", (3, 2), -1, "state['w']"), TensorEntry("int64", (), 0, "n")))
    assert json.loads(plain.to_json())["body"]["format_version"] == 1
    idx = _sharded_indexes()[0]
    raw = idx.to_json()
    assert RankIndex.from_json(raw, "i") == idx and json.loads(raw)["format_version"] == 2
    assert json.loads(raw)["entries"][0][7] == [[0, 2], [0, 2]]


def test_sharded_coverage_is_checked_chunk_by_chunk():
    m = _sharded_manifest()
    check_coverage(m, _sharded_indexes(), str)
    with pytest.raises(FormatError, match=r"tensor 0 .*overlaps"):
        check_coverage(m, _sharded_indexes(rows=((0, 2), (1, 2))), str)
    with pytest.raises(FormatError, match=r"tensor 0 .*uncovered"):
        check_coverage(m, _sharded_indexes(rows=((0, 2), (2, 2))), str)
    short = _sharded_indexes()
    short[1] = RankIndex(7, 1, 2, "a", 64, (IndexEntry(False, 0, 0, 1, 0, 4, "0" * 16, box=((2, 3), (0, 2))),),
                         (), None, {})
    with pytest.raises(FormatError, match=r"elements of chunk \[\(2, 3\), \(0, 2\)\] exactly once"):
        check_coverage(m, short, str)
    with pytest.raises(FormatError, match="is not in the tensor"):
        check_coverage(m, _sharded_indexes(rows=((0, 2), (2, 4))), str)
    unboxed = _sharded_indexes(extra=[IndexEntry(False, 0, 0, 2, 64, 8, "0" * 16)])
    with pytest.raises(FormatError, match="a sharded tensor needs"):
        check_coverage(m, unboxed, str)


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b["tensors"][0].__setitem__(4, {"mesh": [2], "placements": []}), "malformed sharding record"),
    (lambda b: b["tensors"][0][4].__setitem__("placements", ["Shard(dim=0)", "os.system('x')"]),
     "malformed sharding record"),
    (lambda b: b["tensors"][0][4].__setitem__("mesh", [0, 2]), "malformed sharding record"),
    (lambda b: b["tensors"][0].pop(4), "without a sharding record"),
    (lambda b: b["tensors"][1].append(b["tensors"][0][4]), "with a sharding record"),
    (lambda b: b["tensors"][0].__setitem__(2, -3), "owner >= -2"),
])
def test_hostile_sharded_manifests_are_rejected(mutate, message):
    from ckpt_engine.format.manifest import seal, unseal

    body = json.loads(unseal(_sharded_manifest().to_json(), "m"))
    mutate(body)
    with pytest.raises(FormatError, match=message):
        Manifest.from_json(seal(json.dumps(body).encode()), "m")


@pytest.mark.parametrize("box, message", [
    ([[0, 2]], None), ([[2, 1], [0, 2]], "malformed chunk"), ([[0, "2"], [0, 2]], "malformed chunk"),
    ([[0, 2, 3]], "malformed chunk"), ("x", "malformed chunk"),
])
def test_hostile_chunk_boxes_are_rejected(box, message):
    body = json.loads(_sharded_indexes()[0].to_json())
    body["entries"][0][7] = box
    raw = json.dumps(body).encode()
    if message is None:
        RankIndex.from_json(raw, "i")  # well-formed; coverage decides whether it fits the tensor
    else:
        with pytest.raises(FormatError, match=message):
            RankIndex.from_json(raw, "i")
    body["entries"][1].append([[0, 1]])
    body["entries"][1][0] = 1
    with pytest.raises(FormatError):
        RankIndex.from_json(json.dumps(body).encode(), "i")


# ---- load(into=...) in one process ----------------------------------------------------------------
def test_load_into_plain_state_fills_tensors_in_place_and_replaces_values(tmp_path):
    import numpy as np

    from ckpt_engine import Checkpointer

    ck = Checkpointer(str(tmp_path / "ck"))
    saved = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)},
             "opt": {"step": 7, "lr": 0.5, "betas": (0.9, 0.99), "extra": [torch.tensor(3), "x"]},
             "arr": np.arange(3), "only_in_checkpoint": torch.zeros(2)}
    ck.save(saved, 1)
    ck.wait()
    w, b = torch.zeros(3, 4), torch.zeros(3, dtype=torch.bfloat16)
    into = {"model": {"w": w, "b": b}, "opt": {"step": 0, "lr": None, "betas": (0.0, 0.0), "extra": [None, None]},
            "arr": None}
    out = ck.load(into=into)
    assert out is into and into["model"]["w"] is w and into["model"]["b"] is b  # filled in place
    assert torch.equal(w, saved["model"]["w"]) and torch.equal(b, saved["model"]["b"])
    assert into["opt"]["step"] == 7 and into["opt"]["lr"] == 0.5 and into["opt"]["betas"] == (0.9, 0.99)
    assert torch.equal(into["opt"]["extra"][0], torch.tensor(3)) and into["opt"]["extra"][1] == "x"
    assert isinstance(into["arr"], np.ndarray) and list(into["arr"]) == [0, 1, 2]
    assert "only_in_checkpoint" not in into  # the state to load into says what is loaded
    ck.close()


def test_load_into_names_the_key_of_a_mismatch_and_changes_nothing(tmp_path):
    from ckpt_engine import Checkpointer, MismatchError

    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save({"model": {"w": torch.arange(6.0), "n": 3}}, 0)
    ck.save({"model": {"w": torch.arange(6.0), "n": 3}}, 1)
    ck.wait()
    w = torch.zeros(6)
    for bad, message in [({"model": {"w": w, "n": 0, "v": torch.zeros(1)}}, r"state\['model'\]: keys \['v'\] are not in"),
                         ({"model": {"n": 0, "w": torch.zeros(5)}}, r"state\['model'\]\['w'\]: the checkpoint holds "
                                                                    r"float32\[6\], the state to load into float32\[5\]"),
                         ({"model": {"n": 0, "w": torch.zeros(6, dtype=torch.float64)}}, r"float64\[6\]"),
                         ({"model": {"n": torch.zeros(1)}}, r"\['n'\]: the state to load into holds a tensor, the "
                                                           r"checkpoint a int")]:
        with pytest.raises(MismatchError, match=message):
            ck.load(into=bad)
        assert bad["model"].get("n", 0) == 0 or isinstance(bad["model"]["n"], torch.Tensor)  # nothing replaced
        with pytest.raises(MismatchError, match=message):  # the caller's state: no older checkpoint is tried
            ck.restore(into=bad)
        assert ck.load_failures and all("step-000000000001" in f for f in ck.load_failures), ck.load_failures
    assert torch.equal(w, torch.zeros(6))
    ck.close()
