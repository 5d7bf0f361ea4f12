"""Tensors without plain storage are refused by key before any byte is copied; plain ones still work.

The snapshot copies straight from ``data_ptr()``: a meta tensor, a FakeTensor or a ``DTensor`` used
to reach that copy with a null or foreign pointer and kill the process (SIGSEGV). The crash tests
therefore run the save in a child process and look at how it ended. A ``DTensor`` is now stored
(its chunk: tests/test_sharded*.py); one with a ``Partial`` placement, or one in the per-rank
``local`` state, is refused by key.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from ckpt_engine.checkpointer import Checkpointer
from ckpt_engine.errors import CheckpointError, UnsupportedValueError
from ckpt_engine.state.values import encode, tensor_refusal
from helpers import assert_same

KEY = "state['model']['w']"

_DIST = torch.distributed.is_available() and torch.distributed.is_gloo_available()
needs_gloo = pytest.mark.skipif(not _DIST, reason="torch.distributed with gloo is not available")


# ---- the process must survive -------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import sys, torch
    from ckpt_engine.checkpointer import Checkpointer
    from ckpt_engine.errors import UnsupportedValueError
    kind, root = sys.argv[1], sys.argv[2]
    if kind == "meta":
        t = torch.empty(4, device="meta")
    else:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Shard, distribute_tensor
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{root}/store")
        t = distribute_tensor(torch.arange(8.0), DeviceMesh("cpu", [0]), [Shard(0)])
    ck = Checkpointer(f"{root}/ck")
    try:
        ck.save({"model": {"w": t}}, 1)
        ck.wait()
        back = ck.load()["model"]["w"]
        print("SAVED", type(back).__name__, back.tolist())
    except UnsupportedValueError as e:
        print("REFUSED", e)
    ck.close()
    if kind != "meta":
        dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["meta", pytest.param("dtensor", marks=needs_gloo)])
def test_saving_a_tensor_without_storage_does_not_kill_the_process(kind, tmp_path):
    proc = subprocess.run([sys.executable, "-c", _CHILD, kind, str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode >= 0, f"child died of signal {-proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.returncode == 0, proc.stderr[-2000:]
    if kind == "meta":
        assert proc.stdout.startswith("REFUSED") and KEY in proc.stdout, proc.stdout
    else:  # a DTensor is stored as its chunk and comes back whole, as a plain tensor
        assert proc.stdout.split() == ["SAVED", "Tensor", "[0.0,", "1.0,", "2.0,", "3.0,", "4.0,", "5.0,", "6.0,",
                                       "7.0]"], proc.stdout


# ---- every kind is refused by key, saying what it is and what to do ----------------------------
class Wrapper(torch.Tensor):
    """A minimal wrapper subclass: its values live in ``elem``, not in its own storage."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = [a.elem if isinstance(a, Wrapper) else a for a in args]
        return func(*unwrap, **(kwargs or {}))


def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(4)


def _mkldnn():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no mkldnn")
    return torch.ones(3).to_mkldnn()


REFUSED = {
    "meta": (lambda: torch.empty(4, device="meta"), ["a meta tensor", "device meta", "to_empty"]),
    "meta parameter": (lambda: torch.nn.Parameter(torch.empty(2, 2, device="meta")), ["a meta tensor"]),
    "fake": (_fake, ["a FakeTensor", "no data"]),
    "wrapper subclass": (lambda: Wrapper(torch.arange(4.0)),
                         [f"{__name__}.Wrapper", "__torch_dispatch__", "plain dense tensor"]),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
               ["a nested tensor", "unbind()"]),
    "nested jagged": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
                      ["a nested tensor (layout torch.jagged", "unbind()"]),
    "quantized": (lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
                  ["a quantized tensor (dtype torch.qint8", "dequantize()"]),
    "sparse coo": (lambda: torch.zeros(3).to_sparse(), ["sparse tensor (layout torch.sparse_coo", "to_dense()"]),
    "sparse csr": (lambda: torch.eye(3).to_sparse_csr(), ["sparse tensor (layout torch.sparse_csr", "to_dense()"]),
    "mkldnn": (_mkldnn, ["layout torch._mkldnn", "to_dense()"]),
    "functional": (lambda: torch._to_functional_tensor(torch.ones(3)), ["a functional tensor"]),
    "unsupported dtype": (lambda: torch.ones(3, dtype=torch.uint16), ["dtype torch.uint16", "float32"]),
}


def _misleading(msg: str) -> bool:
    return "only dense tensors" in msg  # the old message, wrong for nested and quantized tensors


@pytest.mark.parametrize("kind", list(REFUSED))
def test_tensors_without_plain_storage_are_refused_by_key(kind):
    make, phrases = REFUSED[kind]
    t = make()
    reason = tensor_refusal(t)
    assert reason is not None
    with pytest.raises(UnsupportedValueError) as err:
        encode({"model": {"w": t}})
    msg = str(err.value)
    assert msg.startswith(f"{KEY}: cannot store ") and reason in msg
    for phrase in phrases:
        assert phrase in msg, msg
    assert not _misleading(msg)
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, TypeError)


@pytest.fixture
def gloo_group(tmp_path):
    """A single-process gloo group (DTensor needs one), destroyed after the test."""
    if not _DIST:
        pytest.skip("torch.distributed with gloo is not available")
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("placement", ["shard", "replicate", "parameter"])
def test_dtensor_is_encoded_as_its_chunk(gloo_group, placement):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    t = distribute_tensor(torch.arange(8.0), gloo_group, [Replicate() if placement == "replicate" else Shard(0)])
    if placement == "parameter":
        t = torch.nn.Parameter(t)  # what FSDP2 puts in a module
    enc = encode({"model": {"w": t}})
    chunk = enc.shards[0]
    assert chunk is not None and chunk.box == ((0, 8),) and chunk.shape == (8,)
    assert (chunk.replica, chunk.replicas) == (0, 1) and chunk.sharding.mesh == (1,)
    assert enc.tensors[0].data_ptr() == t.to_local().data_ptr()  # the chunk itself, no copy


def test_partial_dtensor_and_dtensor_in_local_are_refused_by_key(gloo_group):
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    from torch.distributed.tensor import DTensor

    partial = DTensor.from_local(torch.arange(8.0), gloo_group, [Partial()])  # e.g. a gradient before its reduce
    with pytest.raises(UnsupportedValueError, match=r"state\['model'\]\['w'\]: cannot store a DTensor with a "
                                                    r"Partial placement .*redistribute"):
        encode({"model": {"w": partial}})
    sharded = distribute_tensor(torch.arange(8.0), gloo_group, [Shard(0)])
    with pytest.raises(UnsupportedValueError, match=r"local\['w'\]: cannot store a DTensor in the per-rank"):
        encode({"w": sharded}, "local", sharded=False)


def test_refusal_happens_before_anything_is_written(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"))
    good = {"w": torch.arange(6.0)}
    with pytest.raises(UnsupportedValueError, match=r"local\['rng'\]: cannot store a meta tensor"):
        ck.save(good, 1, {"rng": torch.empty(3, device="meta")})
    with pytest.raises(UnsupportedValueError, match=r"state\['q'\]: cannot store a quantized tensor"):
        ck.save({**good, "q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)}, 2)
    assert ck.counters["saves"] == 0 and ck.steps() == []
    ck.save(good, 3)  # the checkpointer is still usable
    ck.wait()
    assert ck.steps() == [3]
    assert_same(ck.load(), good)
    ck.close()


# ---- plain tensors still work -------------------------------------------------------------------
class PlainSub(torch.Tensor):
    """A subclass without ``__torch_dispatch__``: its own storage holds its values."""


class FunctionSub(torch.Tensor):
    """Overrides only ``__torch_function__``, which does not change where the values live."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs)


class MyParameter(torch.nn.Parameter):
    """A Parameter subclass, as some libraries define."""


def _plain_state() -> dict:
    base = torch.arange(24.0).reshape(4, 6)
    state = {
        "view": base[1:3, 2:5], "transpose": base.t(), "strided": base[:, ::2],
        "expanded": torch.ones(3, 1).expand(3, 4), "zero": torch.zeros(0, 5), "scalar": torch.tensor(3.5),
        "bf16": torch.randn(5).to(torch.bfloat16), "param": torch.nn.Parameter(torch.randn(3, 3)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "grad": torch.randn(4, requires_grad=True) * 2, "my_param": MyParameter(torch.randn(2, 2)),
        "plain_sub": torch.randn(3).as_subclass(PlainSub), "function_sub": torch.randn(3).as_subclass(FunctionSub),
        "numpy": np.arange(5, dtype=np.float32), "from_numpy": torch.from_numpy(np.arange(4.0)),
    }
    with torch.inference_mode():
        state["inference"] = torch.randn(3)
    if hasattr(torch.nn, "Buffer"):
        state["buffer"] = torch.nn.Buffer(torch.randn(2, 3))
    return state


def test_plain_tensors_are_accepted_by_the_check():
    for key, value in _plain_state().items():
        if isinstance(value, torch.Tensor):
            assert tensor_refusal(value) is None, key


def test_plain_tensors_of_every_kind_roundtrip(tmp_path):
    state = _plain_state()
    with Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save(state, 1, {"rng": torch.get_rng_state()})
        ck.wait()
        out = ck.load()
    expected = {k: (v.detach().as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else v)
                for k, v in state.items()}
    assert_same(out, expected)
