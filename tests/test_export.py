"""Units behind ``ckpt export``/``diff``/``inspect``/``gc``: flat keys, plain values, tensor
differences, safetensors parts, durations (single process, no subprocesses)."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch

from ckpt_engine import Checkpointer
from ckpt_engine.cli.diff import tensor_difference
from ckpt_engine.interop.files import build, export, jsonable, plain, safetensors_parts
from ckpt_engine.cli.gc import parse_duration
from ckpt_engine.state.tree import TensorRef, flatten, refs_tree, short_repr
from ckpt_engine.errors import CheckpointError
from ckpt_engine.format.catalog import manifest_dirs
from ckpt_engine.load.open import open_checkpoint
from ckpt_engine.load.read import read_state, tensor_reader
from ckpt_engine.state.values import encode
from ckpt_engine.storage import open_storage
from helpers import assert_same, bits


def test_flat_keys_stop_at_containers_without_tensors():
    t = torch.ones(2)
    state = {"model": {"emb.weight": t}, "opt": {"state": {0: {"m": t}}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
             "empty": {}, "seq": [t, 3]}
    assert flatten(state) == {"model.emb.weight": t, "opt.state.0.m": t,
                              "opt.groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "empty": {}, "seq.0": t, "seq.1": 3}
    assert list(flatten(t)) == ["state"] and flatten({"a": [1], "b": 2}) == {"a": [1], "b": 2}
    with pytest.raises(CheckpointError, match="'a.b' names two values"):
        flatten({"a.b": t, "a": {"b": t}})


def test_refs_tree_matches_the_decoded_tree_without_reading():
    a = np.arange(4, dtype=np.int32)
    enc = encode({"w": torch.zeros(3), "n": a, "key": np.arange(3, dtype=np.uint32)})
    refs = refs_tree(enc.tree)
    assert refs["w"] == TensorRef(0) and refs["n"] == TensorRef(1, True)
    assert refs["key"].dtype == np.uint32  # inline $ndarray: decoded in place


def test_plain_values_load_with_weights_only():
    state = {"np": np.arange(3, dtype=np.float64), "scalar": np.float32(1.5), "u32": np.arange(2, dtype=np.uint32),
             "b": b"\x00\x01", "dt": torch.bfloat16, "size": torch.Size([2]), "dev": torch.device("cpu"),
             "nan": float("nan"), "t": (1, [2, {3: "x"}])}
    obj = plain(state)
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert torch.equal(back["np"], torch.arange(3, dtype=torch.float64)) and back["u32"].dtype == torch.uint32
    assert back["scalar"] == 1.5 and type(back["scalar"]) is float
    assert back["b"] == b"\x00\x01" and back["dt"] is torch.bfloat16 and back["t"] == (1, [2, {3: "x"}])
    assert math.isnan(back["nan"])
    assert json.loads(json.dumps(jsonable(state["t"]))) == [1, [2, {"3": "x"}]]
    assert jsonable(b"\x00\x01") == "AAE=" and jsonable(torch.float16) == "torch.float16"


def test_build_nested_flat_and_with_local():
    t = torch.ones(1)
    assert build({"a": {"b": t}}, None, flat=False) == {"a": {"b": t}}
    assert build({"a": {"b": t}}, {"r": 1}, flat=False) == {"state": {"a": {"b": t}}, "local": {"r": 1}}
    assert build({"a": {"b": t}}, {"r": 1}, flat=True) == {"state.a.b": t, "local.r": 1}


def test_safetensors_parts_clone_shared_memory_and_keep_values_as_json():
    t = torch.arange(4.0)
    view = torch.from_numpy(t.numpy())  # a NumPy leaf after plain(): same memory as t
    tensors, meta = safetensors_parts({"a": t, "b": t, "c": view, "lr": 0.5, "betas": (0.9, 0.99)})
    assert tensors["a"] is t and tensors["b"] is not t and tensors["c"] is not view
    assert meta == {"lr": "0.5", "betas": "[0.9, 0.99]", "format": "pt"}
    from safetensors.torch import load, save

    back = load(save(tensors, meta))
    assert all(torch.equal(back[k], t) for k in "abc")


def test_export_complex128_to_safetensors_fails_with_advice(tmp_path):
    with Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save({"z": torch.zeros(2, dtype=torch.complex128)}, 1)
    st = open_storage(str(tmp_path / "ck"))
    opened = open_checkpoint(st, manifest_dirs(st)[-1][1])
    with pytest.raises(CheckpointError, match="--format torch"):
        export(st, opened, str(tmp_path / "z.safetensors"), fmt="safetensors")
    assert not (tmp_path / "z.safetensors").exists()
    export(st, opened, str(tmp_path / "z.pt"))
    assert torch.load(tmp_path / "z.pt", weights_only=True)["z"].dtype == torch.complex128
    with pytest.raises(CheckpointError, match="unknown export format"):
        export(st, opened, str(tmp_path / "z.x"), fmt="npz")


def test_tensor_reader_streams_the_same_tensors_as_read_state(tmp_path):
    state = {"a": torch.randn(1000), "b": torch.arange(10), "c": torch.rand(3, 3) > 0.5}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1)
    st = open_storage(str(tmp_path))
    opened = open_checkpoint(st, manifest_dirs(st)[-1][1])
    seen = []
    read = tensor_reader(st, opened, progress=seen.append)
    for i, key in enumerate("abc"):
        assert torch.equal(bits(read(i)), bits(state[key]))
    assert sum(seen) == sum(t.nbytes for t in opened.manifest.tensors)
    counted = []
    assert_same(state, read_state(st, opened, progress=counted.append))
    assert sum(counted) == sum(seen)


def test_tensor_difference_counts_bits_and_measures_in_float64():
    a = torch.tensor([1.0, float("nan"), -0.0, 2.0**100, 5.0])
    b = torch.tensor([1.0, float("nan"), 0.0, -(2.0**100), float("nan")])
    n, worst = tensor_difference(a, b, chunk=2)
    assert n == 3 and worst == 2.0**101  # NaN vs NaN (same bits) equal; -0.0 vs 0.0 differs; NaN diffs skipped
    assert tensor_difference(torch.ones(3), torch.ones(3)) == (0, 0.0)
    assert tensor_difference(torch.tensor([True, False]), torch.tensor([True, True])) == (1, None)
    assert tensor_difference(torch.tensor([2**40, 3]), torch.tensor([0, 3])) == (1, float(2**40))
    z = torch.tensor([1 + 1j, 2 + 0j], dtype=torch.complex64)
    assert tensor_difference(z, torch.tensor([1 + 1j, 2 + 3j], dtype=torch.complex64)) == (1, 3.0)
    h = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert tensor_difference(h, torch.tensor([1.0, 2.5], dtype=torch.bfloat16)) == (1, 0.5)


def test_parse_duration_and_short_repr():
    assert [parse_duration(x) for x in ("3600", "90s", "30m", "1.5h", "2d", "10 min")] == \
        [3600, 90, 1800, 5400, 172800, 600]
    with pytest.raises(ValueError, match="'soon'"):
        parse_duration("soon")
    assert short_repr(list(range(100)), 20) == "[0, 1, 2, 3, 4, 5..."
    assert short_repr({"b": 1, "a": 2}) == "{'b': 1, 'a': 2}"  # insertion order kept
    assert len(short_repr(b"x" * 10_000, 30)) <= 30


def test_ckpt_engine_export_writes_every_format_from_python(tmp_path):
    """``ckpt_engine.export`` is ``ckpt export`` from Python: the torch file loads with torch alone, the
    hf folder holds the tensors under the prefix, stripped, and a bad format or prefix is a ValueError."""
    import safetensors.torch

    import ckpt_engine

    root = str(tmp_path / "ck")
    state = {"model": {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}, "step": 7}
    with Checkpointer(root) as ck:
        ck.save(state, 7)
    torch_file = str(tmp_path / "out.pt")
    assert ckpt_engine.export(root, torch_file).step == 7
    got = torch.load(torch_file, weights_only=True)
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["step"] == 7
    ckpt_engine.export(root, str(tmp_path / "hf"), format="hf", prefix="model.")
    weights = safetensors.torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(weights) == ["b", "w"] and torch.equal(weights["w"], state["model"]["w"])
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()
    with pytest.raises(ValueError, match="format must be one of"):
        ckpt_engine.export(root, str(tmp_path / "x"), format="onnx")
    with pytest.raises(ValueError, match="required there"):
        ckpt_engine.export(root, str(tmp_path / "x"), format="hf")
    assert "export" in ckpt_engine.__all__


def test_lazily_exported_names_resolve_and_an_unknown_one_is_an_attribute_error():
    from ckpt_engine.interop import dcp_import

    import ckpt_engine

    assert ckpt_engine.import_dcp is dcp_import.import_dcp and ckpt_engine.read_dcp is dcp_import.read_dcp
    with pytest.raises(AttributeError, match="module 'ckpt_engine' has no attribute 'import_dcpp'"):
        ckpt_engine.import_dcpp  # noqa: B018
