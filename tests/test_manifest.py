"""Manifest and index files: exact round trip; hostile or damaged inputs rejected with clear errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.errors import CheckpointError, CorruptionError, FormatError
from ckpt_engine.format.entries import IndexEntry, RankRecord, TensorEntry
from ckpt_engine.format.manifest import Manifest, RankIndex, check_coverage, seal, unseal


def make_manifest(**over) -> Manifest:
    fields = dict(step=12, world_size=2, created_at=1.5, split_threshold=1024,
                  tensors=(TensorEntry("float32", (4, 2), -1, "state['w']"), TensorEntry("bool", (), 1, "state['m']")),
                  state={"$dict": [["w", {"$tensor": 0}], ["m", {"$tensor": 1}]]},
                  ranks=(RankRecord(0, 64, 100, "0123456789abcdef"), RankRecord(1, 128, 90, "fedcba9876543210")),
                  meta={"attempt": "x"})
    return Manifest(**(fields | over))


def make_index(rank: int = 1) -> RankIndex:
    entries = (IndexEntry(False, 0, 4, 8, 0, 16, "00000000000000aa"), IndexEntry(False, 1, 0, 1, 64, 1, "0" * 16),
               IndexEntry(True, 0, 0, 3, 128, 12, "1" * 16))
    return RankIndex(12, rank, 2, "x", 192, entries, (TensorEntry("int32", (3,), rank, "local['pos']"),),
                     {"$tensor": 0}, {"persist_s": 0.5})


def test_manifest_roundtrip():
    m = make_manifest()
    assert Manifest.from_json(m.to_json(), "m") == m
    assert m.total_bytes == 192


def test_index_roundtrip():
    idx = make_index()
    assert RankIndex.from_json(idx.to_json(), "i") == idx


def test_manifest_is_one_json_document_with_a_seal():
    raw = make_manifest().to_json()
    doc = json.loads(raw)
    assert set(doc) == {"xxh3", "body"} and doc["body"]["format_version"] == 1


@pytest.mark.parametrize("pos", [0, 5, 30, 100, -2, -1])
def test_any_flipped_byte_of_a_manifest_is_detected(pos):
    raw = bytearray(make_manifest().to_json())
    raw[pos] ^= 0x01
    with pytest.raises(CheckpointError):
        Manifest.from_json(bytes(raw), "step-1/manifest.json")


def test_truncated_manifest_names_the_file():
    with pytest.raises(CorruptionError, match="step-1/manifest.json"):
        Manifest.from_json(make_manifest().to_json()[:-10], "step-1/manifest.json")


def body_of(m: Manifest) -> dict:
    return json.loads(unseal(m.to_json(), "m"))


def reseal(body: dict) -> bytes:
    return seal(json.dumps(body).encode())


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b.update(format_version=99), "unknown format_version 99"),
    (lambda b: b.update(format_version="1"), "format_version"),
    (lambda b: b["ranks"][0].update(data_file="../../etc/passwd"), "ranks\\[0\\] names files"),
    (lambda b: b["ranks"][1].update(data_file="/abs/rank-00001.bin"), "ranks\\[1\\] names files"),
    (lambda b: b["ranks"][1].update(index_file="s3://other/rank-00001.index.json"), "ranks\\[1\\] names files"),
    (lambda b: b["ranks"].pop(), "1 rank records for world_size 2"),
    (lambda b: b["ranks"][0].update(data_bytes=-1), "data_bytes"),
    (lambda b: b["ranks"][0].update(index_xxh3="zz"), "index_xxh3"),
    (lambda b: b.update(step=-3), "step"),
    (lambda b: b["tensors"][0].__setitem__(1, [-1, 2]), "tensors\\[0\\] is malformed"),
    (lambda b: b["tensors"][0].__setitem__(1, [2**40, 2**40]), "more than the"),
    (lambda b: b["tensors"][0].__setitem__(0, "object"), "unknown tensor dtype"),
    (lambda b: b["tensors"][1].__setitem__(2, 5), "owner 5 is not a rank of 2"),
    (lambda b: b.update(world_size=0), "world_size"),
    (lambda b: b.pop("meta"), "meta"),
])
def test_hostile_manifests_are_rejected(mutate, message):
    body = body_of(make_manifest())
    mutate(body)
    with pytest.raises(FormatError, match=message):
        Manifest.from_json(reseal(body), "bad/manifest.json")


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b.update(data_file="../rank-00001.bin"), "data_file"),
    (lambda b: b["entries"][0].__setitem__(4, 10**9), "outside the 192-byte data file"),
    (lambda b: b["entries"][1].__setitem__(4, 72), "uncovered or overlap"),
    (lambda b: b.update(data_bytes=256), "cover 192 bytes of a 256-byte data file"),
    (lambda b: b["entries"][0].__setitem__(2, -1), "malformed"),
    (lambda b: b["entries"][0].__setitem__(6, "not-a-hash"), "malformed"),
    (lambda b: b["entries"][0].__setitem__(3, 2), "outside|malformed"),
    (lambda b: b.update(format_version=3), "format_version 3"),
])
def test_hostile_index_files_are_rejected(mutate, message):
    body = json.loads(make_index().to_json())
    mutate(body)
    with pytest.raises(FormatError, match=message):
        RankIndex.from_json(json.dumps(body).encode(), "bad/rank-00001.index.json")


def test_coverage_check_rejects_gaps_overlaps_and_wrong_sizes():
    m = make_manifest(world_size=1, ranks=(RankRecord(0, 1000, 1, "0" * 16),))
    good = (IndexEntry(False, 0, 0, 8, 0, 32, "0" * 16), IndexEntry(False, 1, 0, 1, 64, 1, "0" * 16))
    idx = RankIndex(12, 0, 1, "x", 1000, good, (), None, {})
    check_coverage(m, [idx], str)
    for entries in [good[:1],
                    (IndexEntry(False, 0, 0, 5, 0, 20, "0" * 16), IndexEntry(False, 0, 4, 8, 64, 16, "0" * 16), good[1]),
                    (IndexEntry(False, 0, 0, 8, 0, 31, "0" * 16), good[1]),
                    good + (IndexEntry(False, 7, 0, 1, 128, 4, "0" * 16),)]:
        with pytest.raises(FormatError):
            check_coverage(m, [RankIndex(12, 0, 1, "x", 1000, entries, (), None, {})], str)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400) | st.builds(lambda b: seal(b), st.binary(max_size=200))
       | st.builds(lambda d: reseal(d), st.dictionaries(st.sampled_from(
           ["format_version", "step", "world_size", "tensors", "ranks", "state", "meta", "created_at"]),
           st.integers(-2, 3) | st.lists(st.integers(-1, 3), max_size=3) | st.text(max_size=3), max_size=8)))
def test_fuzz_manifest_parser_only_raises_checkpoint_errors(raw):
    try:
        Manifest.from_json(raw, "fuzz/manifest.json")
    except CheckpointError:
        pass
    try:
        RankIndex.from_json(raw, "fuzz/rank-00000.index.json")
    except CheckpointError:
        pass
