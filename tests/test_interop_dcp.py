"""torch.distributed.checkpoint (DCP) both ways, with DCP itself on the other side.

Out: a checkpoint of ours exported with ``ckpt export --format dcp`` loads with ``dcp.load`` (DCP's
keys, values and planner data: ``dcp_to_torch_save`` rebuilds it), and a 2-rank FSDP2 checkpoint
loads on 1 rank (a plain model) and 3 ranks (FSDP2) bit for bit; the export's peak memory is
bounded by the largest tensor plus one data file, not the state. In: a DCP checkpoint written by
``dcp.save`` on 2 FSDP2 ranks, imported with ``ckpt import``, resumes through ``restore(into=...)``
bit-identically to ``dcp.load`` of the same directory. Errors name what is missing or mismatched.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckpt_engine import Checkpointer
from ckpt_engine.cli import main
from ckpt_engine.errors import CheckpointError, MismatchError
from ckpt_engine import export
from ckpt_engine.interop.dcp import buckets
from ckpt_engine.interop.dcp_import import import_dcp, read_dcp
from helpers import assert_same
import forkserver
from ranks import start_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"OMP_NUM_THREADS": "1"}


def user_state() -> dict:
    """A model's and a plain optimizer's state with the plain values a training loop adds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": opt.state_dict(), "step": 7,
            "scale": np.float64(1.5), "ids": np.arange(4, dtype=np.int64), "pair": (1, "a"), "tokens": 123456789}


@pytest.fixture
def ours(tmp_path):
    """A committed checkpoint of :func:`user_state` at step 7, and the state."""
    state = user_state()
    with Checkpointer(str(tmp_path / "ours")) as ck:
        ck.save(state, 7)
        ck.wait()
    return str(tmp_path / "ours"), state


def test_export_has_dcps_keys_values_and_planner_data(ours, tmp_path):
    root, state = ours
    out = str(tmp_path / "dcp")
    assert main(["export", root, out, "--format", "dcp", "-q"]) == 0
    md = dcp.FileSystemReader(out).read_metadata()
    assert {"model.0.weight", "model.2.bias", "optim.state.0.exp_avg", "optim.state.0.step", "optim.param_groups.0.lr",
            "step", "pair"} <= set(md.state_dict_metadata)
    fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0, "tokens": 0}
    dcp.load(fresh, checkpoint_id=out)  # a subset, as a user loads one: the model and two counters
    assert_same(fresh["model"], state["model"])
    assert (fresh["step"], fresh["tokens"]) == (7, 123456789)
    dcp_to_torch_save(out, str(tmp_path / "whole.pt"))  # the planner data nests it again
    whole = torch.load(str(tmp_path / "whole.pt"), weights_only=True)
    optim = {"state": {str(k): v for k, v in state["optim"]["state"].items()},  # DCP's keys are strings
             "param_groups": state["optim"]["param_groups"]}
    expected = {**state, "scale": 1.5, "ids": torch.arange(4), "optim": optim}
    assert_same(whole, expected)
    assert_same(read_dcp(out), expected)


def test_export_errors_name_the_dcp_key(ours, tmp_path):
    root, state = ours
    out = str(tmp_path / "dcp")
    export(root, out, format="dcp")
    absent = {"model": {**{k: torch.zeros_like(v) for k, v in state["model"].items()}, "4.weight": torch.zeros(2)}}
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: model\.4\.weight"):
        dcp.load(absent, checkpoint_id=out)
    other = {"model": {"0.weight": torch.zeros(4, 6)}}
    with pytest.raises(CheckpointException, match=r"Size mismatch.*model\.0\.weight"):
        dcp.load(other, checkpoint_id=out)
    with pytest.raises(CheckpointError, match=r"already holds a DCP checkpoint \(\.metadata\)"):
        export(root, out, format="dcp")


def test_corrupt_byte_fails_the_export_and_leaves_no_metadata(ours, tmp_path, capsys):
    root, _ = ours
    (step_dir,) = [d for d in os.listdir(root) if d.startswith("step")]
    data = os.path.join(root, step_dir, "rank-00000.bin")
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "dcp"
    assert main(["export", root, str(out), "--format", "dcp", "-q"]) == 1
    assert "checksum mismatch in tensor" in capsys.readouterr().err
    assert not (out / ".metadata").exists()


def test_buckets_bound_each_file():
    class Item:  # what buckets() reads of a WriteItem
        def __init__(self, n: int | None):
            from torch.distributed.checkpoint.planner import WriteItemType
            self.type = WriteItemType.BYTE_IO if n is None else WriteItemType.TENSOR
            self.tensor_data = None if n is None else type("D", (), {"size": torch.Size([n]), "properties": type(
                "P", (), {"dtype": torch.uint8})()})()

    items = [Item(None), Item(40), Item(30), Item(200), Item(10), Item(None), Item(50)]
    files = [[i.tensor_data.size[0] if i.tensor_data else None for i in b] for b in buckets(items, 100)]
    assert files == [[None, None, 40, 30], [200], [10, 50]]


def test_import_takes_the_dcp_step_and_resumes_with_restore(tmp_path, capsys):
    state = user_state()
    src = str(tmp_path / "dcp")
    dcp.save({"model": state["model"], "step": 5, "note": "x"}, checkpoint_id=src, no_dist=True)
    assert main(["import", src, str(tmp_path / "a"), "-q"]) == 0
    assert main(["import", src, str(tmp_path / "b"), "--format", "dcp", "--step", "9", "--json"]) == 0
    assert '"step": 9' in capsys.readouterr().out
    with Checkpointer(str(tmp_path / "a"), readonly=True) as ck:
        into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        r = ck.restore(into=into)
        assert r.step == 5 and r.state is into
        assert_same(into["model"], state["model"])
        with pytest.raises(MismatchError, match=r"'0\.weight'\]: the checkpoint holds float32\[4, 5\]"):
            ck.restore(into={"model": {"0.weight": torch.zeros(3, 3)}})
        with pytest.raises(MismatchError, match=r"\['9\.weight'\] are not in the checkpoint"):
            ck.restore(into={"model": {"9.weight": torch.zeros(1)}})
    with Checkpointer(str(tmp_path / "b"), readonly=True) as ck:
        assert ck.steps() == [9]
    with pytest.raises(CheckpointError, match="already has a checkpoint of step 5"):
        import_dcp(src, str(tmp_path / "a"))


def test_import_refuses_what_is_not_dcp_or_would_run_code(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["import", str(tmp_path / "empty"), str(tmp_path / "r")]) == 2
    assert ".metadata" in capsys.readouterr().err
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(src), no_dist=True)
    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(src / ".metadata", "wb") as f:
        pickle.dump(Boom(), f)
    with pytest.raises(CheckpointError, match=r"refers to posix\.system|refers to os\.system"):
        read_dcp(str(src))
    assert not marker.exists()
    values = tmp_path / "values"
    dcp.save({"w": torch.ones(2), "when": np.datetime64("2026-11-28")}, checkpoint_id=str(values), no_dist=True)
    with pytest.raises(CheckpointError, match=r"DCP value 'when' needs code to unpickle.*--trust"):
        read_dcp(str(values))
    assert read_dcp(str(values), trust=True)["when"] == np.datetime64("2026-11-28")


@pytest.mark.slow
def test_export_peak_memory_is_the_largest_tensor_plus_one_file(tmp_path):
    big, small, count = 96 << 20, 64 << 10, 1600  # 96 MiB + 1600 x 64 KiB (100 MiB): 196 MiB of state
    root = str(tmp_path / "ours")
    with Checkpointer(root) as ck:
        ck.save({"big": torch.ones(big // 4), **{f"s{i}": torch.full((small // 4,), float(i)) for i in range(count)}},
                1)
        ck.wait()
    # VmHWM, reset before the export (ru_maxrss would carry the pytest process's peak across fork and exec)
    probe = ("import sys, torch, torch.distributed.checkpoint, ckpt_engine.interop.dcp\n"
             "from ckpt_engine.cli import main\n"
             "kib = lambda k: next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(k))\n"
             "open('/proc/self/clear_refs', 'w').write('5')\n"
             "base = kib('VmRSS')\n"
             "code = main(['export', sys.argv[1], sys.argv[2], '--format', 'dcp', '-q'])\n"
             "print(code, base, kib('VmHWM'))\n")
    out = subprocess.run([sys.executable, "-c", probe, root, str(tmp_path / "dcp")], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, **ENV))
    code, base, peak = map(int, out.stdout.split())
    assert code == 0, out.stderr
    grew = (peak - base) * 1024
    print(f"export of 196 MiB (largest 96 MiB, {count} x 64 KiB): peak RSS grew {grew / 2**20:.1f} MiB")
    assert big <= grew <= big + (64 << 20) + (24 << 20)  # the largest + one file's tensors + the rest of DCP's bookkeeping
    back = read_dcp(str(tmp_path / "dcp"))
    assert torch.equal(back["big"], torch.ones(big // 4))
    assert torch.equal(back["s1599"], torch.full((small // 4,), 1599.0))


def run(world: int, worker: str, *args: str) -> None:
    """A job of ``world`` ranks of ``worker`` (``single`` layouts run alone, without torch.distributed)."""
    if args[1] == "single":
        procs = [forkserver.launch([sys.executable, worker, *args], env=dict(os.environ, **ENV))]
    else:
        procs = start_ranks(world, list(args), ENV, worker=worker)
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-4000:]


def loaded(out) -> tuple[object, object]:
    return (torch.load(out / "loaded.pt", weights_only=True), torch.load(out / "loaded_after.pt", weights_only=True))


def saved(out) -> tuple[object, object]:
    return torch.load(out / "full.pt", weights_only=True), torch.load(out / "after.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.integration
def test_fsdp2_checkpoint_exported_loads_with_dcp_on_1_2_and_3_ranks(tmp_path):
    sharded, dcp_worker = os.path.join(HERE, "sharded_worker.py"), os.path.join(HERE, "dcp_worker.py")
    ref = tmp_path / "ref"
    ref.mkdir()
    run(2, sharded, "save", "fsdp", str(tmp_path / "ours"), str(ref), "3")
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "dcp"), "--format", "dcp", "-q"]) == 0
    full, after = saved(ref)
    for world, layout in ((2, "fsdp"), (1, "single"), (3, "fsdp")):
        out = tmp_path / f"{layout}-{world}"
        out.mkdir()
        run(world, dcp_worker, "load", layout, str(tmp_path / "dcp"), str(out), "3")
        got, got_after = loaded(out)
        assert_same(got, full)
        if world == 2:  # the same job shape: two more steps are the uninterrupted run's too
            assert_same(got_after, after)


@pytest.mark.slow
@pytest.mark.integration
def test_dcp_checkpoint_imported_resumes_like_dcp_load(tmp_path):
    sharded, dcp_worker = os.path.join(HERE, "sharded_worker.py"), os.path.join(HERE, "dcp_worker.py")
    ref, via_dcp, via_ours = tmp_path / "ref", tmp_path / "via-dcp", tmp_path / "via-ours"
    for d in (ref, via_dcp, via_ours):
        d.mkdir()
    run(2, dcp_worker, "save", "fsdp", str(tmp_path / "dcp"), str(ref), "3")
    assert main(["import", str(tmp_path / "dcp"), str(tmp_path / "ours"), "-q"]) == 0
    with Checkpointer(str(tmp_path / "ours"), readonly=True) as ck:
        assert ck.steps() == [3]  # the DCP's own "step"
    run(2, dcp_worker, "load", "fsdp", str(tmp_path / "dcp"), str(via_dcp), "3")
    run(2, sharded, "load", "fsdp", str(tmp_path / "ours"), str(via_ours))
    full, after = saved(ref)
    got_dcp, got_dcp_after = loaded(via_dcp)
    got_ours, got_ours_after = loaded(via_ours)
    assert_same(got_ours, got_dcp)
    assert_same(got_ours_after, got_dcp_after)
    assert_same(got_ours, full)
    assert_same(got_ours_after, after)
