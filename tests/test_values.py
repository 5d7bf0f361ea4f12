"""Typed-JSON encoding of nested training state: exact round trips, clear refusals, no pickle."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.errors import FormatError, UnsupportedValueError
from ckpt_engine.state.decode import decode
from ckpt_engine.state.values import encode


def roundtrip(value):
    enc = encode(value)
    tree = json.loads(json.dumps(enc.tree, allow_nan=False))  # must be strict JSON
    return decode(tree, enc.tensors.__getitem__)


def test_tricky_nested_state_roundtrips_exactly():
    rng = np.random.RandomState(3)
    state = {
        "ints": {0: 1, -5: 2**70, 3: True},
        "floats": [1.0, 0.1, float("nan"), float("inf"), float("-inf"), -0.0, 1e308],
        "tuple": (1, (2, [3, (4,)])), "list": [1, [2]], "none": None, "str": "é\u2603",
        "bytes": b"\x00\xff", "np_rng": rng.get_state(), "np_scalars": [np.int64(3), np.float32(1.5), np.bool_(True)],
        "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "device": torch.device("cpu"),
        (1, "a"): "tuple key", 2.5: "float key", None: "none key",
    }
    out = roundtrip(state)
    assert list(out) == list(state)
    assert out["ints"] == {0: 1, -5: 2**70, 3: True} and type(out["ints"][3]) is bool
    f = out["floats"]
    assert f[:2] == [1.0, 0.1] and math.isnan(f[2]) and f[3:5] == [math.inf, -math.inf]
    assert math.copysign(1, f[5]) == -1 and all(type(x) is float for x in f)
    assert out["tuple"] == (1, (2, [3, (4,)])) and type(out["tuple"][1][1]) is list
    assert out["bytes"] == b"\x00\xff" and out["str"] == "é\u2603" and out[(1, "a")] == "tuple key"
    name, keys, pos, has_gauss, gauss = out["np_rng"]
    assert name == "MT19937" and keys.dtype == np.uint32 and np.array_equal(keys, state["np_rng"][1])
    assert (pos, has_gauss, gauss) == state["np_rng"][2:]
    assert [type(x) for x in out["np_scalars"]] == [np.int64, np.float32, np.bool_]
    assert out["dtype"] is torch.bfloat16 and out["size"] == torch.Size([2, 3]) and out["device"] == torch.device("cpu")


def test_tensors_are_referenced_and_tied_ones_stored_once():
    w = torch.randn(4, 4)
    enc = encode({"a": w, "b": w, "c": w.t(), "d": torch.zeros(0), "e": torch.zeros(0)})
    assert len(enc.tensors) == 4  # a/b tied; the transpose is another view; empty tensors never alias
    assert enc.names[0] == "state['a']"
    out = decode(enc.tree, enc.tensors.__getitem__)
    assert out["a"] is out["b"] and out["c"] is not out["a"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int8,
                                   torch.uint8, torch.int64, torch.complex64, torch.float64])
def test_numpy_arrays_of_common_dtypes_travel_as_tensors(dtype):
    a = torch.ones(3, dtype=dtype)
    if dtype not in (torch.bfloat16,):
        arr = a.numpy()
        enc = encode({"x": arr})
        assert len(enc.tensors) == 1
        assert isinstance(decode(enc.tree, enc.tensors.__getitem__)["x"], np.ndarray)


@pytest.mark.parametrize("bad, where", [
    ({"model": {"fn": lambda x: x}}, "state['model']['fn']"),
    ({"obj": object()}, "state['obj']"),
    ({"x": [1, {2}]}, "state['x'][1]"),
    ({"s": torch.zeros(3).to_sparse()}, "state['s']"),
    ({"a": np.array(["x"], dtype=object)}, "state['a']"),
])
def test_unsupported_values_name_their_key(bad, where):
    with pytest.raises(UnsupportedValueError) as err:
        encode(bad)
    assert where in str(err.value)


def test_no_pickle_payload_is_ever_executed():
    payload = pickle.dumps(print)
    node = {"$bytes": __import__("base64").b64encode(payload).decode()}
    assert decode(node, lambda i: None) == payload  # returned as data, never unpickled


@pytest.mark.parametrize("node", [
    {"$pickle": "gASV"}, {"$f": "1e5"}, {"$tensor": "0"}, {"$tensor": True}, {"$dict": [[1]]},
    {"$ndarray": {"dtype": "object", "shape": [1], "data": ""}},
    {"$ndarray": {"dtype": "uint32", "shape": [10**12], "data": ""}},
    {"$np": ["object", 1]}, {"$bytes": "x"}, {"$ndarray": {"dtype": "uint32", "shape": [1], "data": "!!"}}, {"$dtype": "__class__"}, {"$size": ["1"]}, {"a": 1, "b": 2, "c": 3},
])
def test_malformed_nodes_are_rejected(node):
    with pytest.raises(FormatError):
        decode(node, lambda i: torch.zeros(1))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.tuples(children, children)
    | st.dictionaries(st.integers() | st.text(max_size=3), children, max_size=3),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_plain_values_roundtrip_with_their_types(value):
    out = roundtrip(value)
    assert out == value and repr(out) == repr(value)
