"""docs/FORMAT.md is enough to read a checkpoint: a reader written from that page alone (JSON,
xxhash and NumPy; nothing imported from ckpt_engine) gets back what ``Checkpointer.load()`` does,
on a checkpoint written by 2 real ranks with split tensors, tied tensors and per-rank values, and
on one written by 2 FSDP2 ranks (sharded tensors with chunks, format version 2)."""

from __future__ import annotations

import base64
import json
import os
import re

import numpy as np
import pytest
import torch
import xxhash

from ranks import write_two_ranks

pytestmark = pytest.mark.integration
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16, "int64": 8,
            "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
DIR = re.compile(r"step-(\d{12,})-([0-9a-z]{1,64})")


# ---- the independent reader (from docs/FORMAT.md only) -----------------------------------------
def unseal(raw: bytes) -> dict:
    assert raw[:9] == b'{"xxh3":"' and raw[25:34] == b'","body":' and raw[-1:] == b"}"
    body = raw[34:-1]
    assert xxhash.xxh3_64_hexdigest(body) == raw[9:25].decode()
    return json.loads(body)


def newest(root: str) -> tuple[str, dict]:
    found = {}
    for name in os.listdir(root):
        m = DIR.fullmatch(name)
        if m and os.path.exists(f"{root}/{name}/manifest.json"):
            manifest = unseal(open(f"{root}/{name}/manifest.json", "rb").read())
            assert manifest["format_version"] in (1, 2) and manifest["step"] == int(m.group(1))
            old = found.get(manifest["step"])
            if old is None or manifest["created_at"] > old[1]["created_at"]:
                found[manifest["step"]] = (name, manifest)
    return found[max(found)]


def read_indexes(directory: str, manifest: dict) -> list[dict]:
    out = []
    for r, rec in enumerate(manifest["ranks"]):
        assert rec["rank"] == r and rec["index_file"] == f"rank-{r:05d}.index.json"
        raw = open(f"{directory}/{rec['index_file']}", "rb").read()
        assert len(raw) == rec["index_bytes"] and xxhash.xxh3_64_hexdigest(raw) == rec["index_xxh3"]
        index = json.loads(raw)
        assert os.path.getsize(f"{directory}/{rec['data_file']}") == rec["data_bytes"] == index["data_bytes"]
        out.append(index)
    return out


def read_tensors(directory: str, index_list: list[dict], tables: list[list], local: int) -> list[bytearray]:
    """Bytes of every tensor of ``tables`` (one table per index when ``local``), checksums checked."""
    bufs = {}
    for r, index in enumerate(index_list):
        data = open(f"{directory}/{index['data_file']}", "rb").read()
        entries = sorted(index["entries"], key=lambda e: e[4])
        ends = [e[4] for e in entries[1:]] + [len(data)]
        for e, end in zip(entries, ends):
            is_local, i, start, stop, offset, nbytes, digest = e[:7]
            extent = data[offset:end]
            assert xxhash.xxh3_64_hexdigest(extent) == digest and offset % 64 == 0
            if is_local != local:
                continue
            dtype, shape = tables[r if local else 0][i][:2]
            size = ITEMSIZE[dtype]
            buf = bufs.setdefault((r if local else 0, i), bytearray(int(np.prod(shape, dtype=np.int64)) * size))
            if len(e) == 7:
                buf[start * size:stop * size] = extent[:nbytes]
                continue
            chunk = e[7]  # elements start:stop of the chunk, row-major: each to its index in the whole tensor
            sizes = [b - a for a, b in chunk]
            for k in range(stop - start):
                at = [a + x for (a, _), x in zip(chunk, np.unravel_index(start + k, sizes))] if sizes else []
                flat = int(np.ravel_multi_index(at, shape)) if shape else 0
                buf[flat * size:(flat + 1) * size] = extent[k * size:(k + 1) * size]
    return bufs


def decode(node, tensor):
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if isinstance(node, list):
        return [decode(x, tensor) for x in node]
    tag, body = next(iter(node.items()))
    if tag == "$f":
        return float(body)
    if tag == "$tuple":
        return tuple(decode(x, tensor) for x in body)
    if tag == "$dict":
        return {decode(k, tensor): decode(v, tensor) for k, v in body}
    if tag == "$tensor":
        return tensor(body)
    if tag == "$bytes":
        return base64.b64decode(body)
    raise AssertionError(f"node {tag} not in this checkpoint")


# ---- the comparison ---------------------------------------------------------------------------
def as_bytes(value):
    """The library's values with tensors as (dtype, shape, raw bytes), to compare with the reader's."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype).removeprefix("torch."), list(value.shape),
                bytes(value.contiguous().reshape(-1).view(torch.uint8).numpy()))
    if isinstance(value, dict):
        return {k: as_bytes(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_bytes(v) for v in value]
    if isinstance(value, tuple):
        return tuple(as_bytes(v) for v in value)
    return value


@pytest.mark.slow
def test_a_reader_written_from_the_format_page_matches_load(tmp_path):
    from ckpt_engine import Checkpointer

    root = str(tmp_path / "ck")
    write_two_ranks(root, steps=2)
    name, manifest = newest(root)
    directory = f"{root}/{name}"
    indexes = read_indexes(directory, manifest)
    assert any(t[2] == -1 for t in manifest["tensors"])  # split tensors are exercised
    shared = read_tensors(directory, indexes, [manifest["tensors"]], 0)
    state = decode(manifest["state"], lambda i: (manifest["tensors"][i][0], manifest["tensors"][i][1],
                                                 bytes(shared[(0, i)])))
    tables = [index["local_tensors"] for index in indexes]
    locals_ = read_tensors(directory, indexes, tables, 1)
    with Checkpointer(root) as ck:
        assert state == as_bytes(ck.load())
        for r, index in enumerate(indexes):
            local = decode(index["local"], lambda i: (tables[r][i][0], tables[r][i][1], bytes(locals_[(r, i)])))
            assert local == as_bytes(ck.load_local(rank=r))


@pytest.mark.slow
def test_the_reader_places_the_chunks_of_a_sharded_checkpoint(tmp_path):
    from ckpt_engine import Checkpointer
    from ranks import start_ranks

    root = str(tmp_path / "ck")
    worker = os.path.join(os.path.dirname(__file__), "sharded_worker.py")
    (tmp_path / "out").mkdir()
    for p in start_ranks(2, ["save", "fsdp", root, str(tmp_path / "out"), "2"], {"OMP_NUM_THREADS": "1"},
                         worker=worker):
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-3000:]
    name, manifest = newest(root)
    assert manifest["format_version"] == 2 and any(t[2] == -2 for t in manifest["tensors"])
    indexes = read_indexes(f"{root}/{name}", manifest)
    assert all(index["format_version"] == 2 for index in indexes)
    assert any(len(e) == 8 for index in indexes for e in index["entries"])
    shared = read_tensors(f"{root}/{name}", indexes, [manifest["tensors"]], 0)
    state = decode(manifest["state"], lambda i: (manifest["tensors"][i][0], manifest["tensors"][i][1],
                                                 bytes(shared[(0, i)])))
    assert state == as_bytes(Checkpointer(root, readonly=True).load())
