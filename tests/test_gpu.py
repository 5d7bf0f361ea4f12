"""The CUDA path (snapshot.py, cuda_copy.py: side stream, pinned host buffers, events), checked on a GPU.

The tests marked ``cuda`` are skipped without it. The others run everywhere: the parts of the CUDA
path that need no device (the plan of what is copied, the strided gather done on CPU tensors, the
deferred-save contract on CPU) and ``benchmarks/bench_gpu.py --tiny`` end to end (on CPU without
CUDA), so that the benchmark does not rot. Invariant numbers refer to docs/DESIGN (1: ``save()``
returns only when the state may be mutated; 2: buffers reused, no fresh allocation per checkpoint
after the first).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

import ckpt_engine.save.buffers as buffers_module
import ckpt_engine.save.snapshot as snapshot_module
from ckpt_engine import Checkpointer
from ckpt_engine.format.entries import Piece
from ckpt_engine.save.buffers import HostBuffer
from ckpt_engine.save.copy import copy_into, plan_copy
from ckpt_engine.save.cuda_copy import Gather, capture
from ckpt_engine.save.layout import layout
from ckpt_engine.sharding.boxes import index_boxes
from ckpt_engine.state.plan import Slice
from helpers import assert_same

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

SPIN = 200_000_000
"""GPU clock cycles of ``torch.cuda._sleep``: ~0.1 s on an H100, far longer than any copy here."""


def settle() -> None:
    """Before measuring device memory: earlier tests' tensors freed and their copies done.

    ``values.encode`` leaves a reference cycle (recursive closures) holding the tensors of each
    save until the cyclic GC runs; collected in the middle of a measurement it looks like memory
    freed by the code under test (found on the H100: an earlier test's 32 MiB)."""
    gc.collect()
    torch.cuda.synchronize()


def to_cpu(value):
    """A CPU copy (never the same memory: the originals are mutated afterwards)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value


def cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "w": torch.randn(300, 257, generator=g, device="cuda"),
        "half": torch.randn(1001, generator=g, device="cuda").bfloat16(),
        "t": torch.randn(64, 48, generator=g, device="cuda").t(),  # non-contiguous (transposed)
        "strided": torch.randn(40, 60, generator=g, device="cuda")[:, ::3],  # non-contiguous (step)
        "empty": torch.empty(0, 5, device="cuda"),
        "step": torch.tensor(7, device="cuda"),
        "meta": {"lr": 0.1, "name": "gpt"},
    }


@cuda
def test_cuda_state_roundtrips_bitwise_and_loads_on_cpu(tmp_path):
    state = cuda_state()
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1)
        ck.wait()
        out = ck.load()
    assert_same(out, to_cpu(state))
    assert all(t.device.type == "cpu" for t in (out["w"], out["half"], out["t"], out["empty"]))


@cuda
def test_mutating_cuda_tensors_right_after_save_keeps_saved_values(tmp_path):
    """Invariant 1: in-place updates queued right after ``save()`` returns (no synchronize)."""
    w = torch.zeros(16 << 20, device="cuda")  # 64 MiB: the copy takes far longer than the add_
    base = torch.zeros(512, 1024, device="cuda")
    with Checkpointer(str(tmp_path), max_inflight=2) as ck:
        for step in range(3):
            ck.save({"w": w, "t": base.t(), "s": w[::7]}, step)
            w.add_(1)  # the optimizer step right after save()
            base.add_(1)
        ck.wait()
        for step in range(3):
            out = ck.load(step=step)
            assert torch.equal(out["w"], torch.full((16 << 20,), float(step)))
            assert torch.equal(out["t"], torch.full((1024, 512), float(step)))
            assert torch.equal(out["s"], torch.full((len(range(0, 16 << 20, 7)),), float(step)))


@cuda
def test_save_captures_writes_still_in_flight_on_the_training_stream(tmp_path):
    """The copy must see kernels queued before ``save()`` even when they have not run yet."""
    w = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with Checkpointer(str(tmp_path)) as ck:
        torch.cuda._sleep(SPIN)
        w.fill_(5)
        ck.save({"w": w}, 1)
        w.fill_(6)
        ck.wait()
        assert torch.equal(ck.load()["w"], torch.full((1 << 20,), 5.0))


@cuda
def test_deferred_save_mutate_after_wait_snapshot(tmp_path):
    w = torch.arange(4 << 20, device="cuda", dtype=torch.float32)
    expect = w.cpu()
    with Checkpointer(str(tmp_path)) as ck:
        h = ck.save({"w": w, "t": w.view(2048, -1).t()}, 1, defer=True)
        h.wait_snapshot()
        assert h.snapshot_done()
        w.mul_(-1)
        ck.wait()
        out = ck.load()
    assert torch.equal(out["w"], expect)
    assert torch.equal(out["t"], expect.view(2048, -1).t())


@cuda
@pytest.mark.parametrize("defer", [False, True])
def test_save_from_a_non_default_training_stream(tmp_path, defer):
    """A training loop on its own stream: the snapshot is the values in that stream's order.

    First GPU run: a deferred copy ran on the snapshot thread against that thread's current stream
    (the default one), so it missed the caller's pending write; save() now captures the caller's."""
    s = torch.cuda.Stream()
    w = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with Checkpointer(str(tmp_path)) as ck:
        with torch.cuda.stream(s):
            torch.cuda._sleep(SPIN)
            w.fill_(1)  # queued before save(), runs ~0.1 s later
            h = ck.save({"w": w}, 1, defer=defer)
            h.wait_snapshot()
            w.fill_(2)  # allowed once save() / wait_snapshot() returned
        ck.wait()
        got = ck.load()["w"]
    assert torch.equal(got, torch.ones(1 << 20)), f"checkpoint holds {got.unique().tolist()}, expected [1.0]"


@cuda
def test_freed_tensor_memory_is_not_reused_while_the_copy_reads_it(tmp_path):
    n = 8 << 20
    with Checkpointer(str(tmp_path)) as ck:
        torch.cuda._sleep(SPIN)  # the copy starts late
        state = {"x": torch.full((n,), 3.0, device="cuda")}
        ck.save(state, 1)
        del state  # the last reference: the caching allocator may hand the block out again
        y = torch.full((n,), 9.0, device="cuda")
        ck.wait()
        assert torch.equal(ck.load()["x"], torch.full((n,), 3.0))
        del y


@cuda
def test_pinned_buffers_are_reused_across_saves(tmp_path):
    """Invariant 2: after ``reserve()`` no save allocates a host buffer or device memory."""
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(33, device="cuda").bfloat16()}
    with Checkpointer(str(tmp_path), max_inflight=1, keep_last=1) as ck:
        ck.reserve(state)
        assert ck._pool.allocations == 1
        buf = ck._pool._free[0]
        assert buf.pinned and buf.tensor.is_pinned()
        settle()
        device_before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for step in range(5):
            saved = state["w"].cpu()  # host memory: the device figures below stay exact
            ck.save(state, step)
            state["w"].add_(1)
            ck.wait()
        torch.cuda.synchronize()
        assert ck._pool.allocations == 1
        assert ck._pool._free == [buf]  # the same object, not a new one of the same size
        assert torch.cuda.memory_allocated() == device_before
        assert torch.cuda.max_memory_allocated() == device_before
        assert torch.equal(ck.load()["w"], saved.cpu())


@cuda
def test_non_contiguous_tensor_needs_no_device_allocation(tmp_path):
    state = {"t": torch.randn(1024, 1024, device="cuda").t()}
    with Checkpointer(str(tmp_path)) as ck:
        ck.reserve(state)
        ck.save(state, 0)
        ck.wait()
        settle()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ck.save(state, 1)
        ck.wait()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() == before


def _host_allocations() -> dict:
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {k: v for k, v in stats.items() if k in ("num_host_alloc", "allocations.allocated",
                                                    "active_requests.allocated")}


@cuda
def test_reserve_allocates_pinned_buffers_and_the_first_save_none(tmp_path):
    """Invariant 2 from the first save on: ``reserve()`` sized the buffer with the staging areas
    of the non-contiguous tensors, so the first save allocates no pinned or device memory."""
    state = cuda_state()
    expect = to_cpu(state)
    with Checkpointer(str(tmp_path), max_inflight=2) as ck:
        ck.reserve(state)
        assert ck._pool.allocations == 2
        bufs = list(ck._pool._free)
        assert all(b.pinned and b.tensor.is_pinned() for b in bufs)
        settle()
        host, device_before = _host_allocations(), torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ck.save(state, 0)
        ck.save(state, 1, defer=True).wait_snapshot()
        ck.wait()
        torch.cuda.synchronize()
        assert _host_allocations() == host
        assert torch.cuda.max_memory_allocated() == device_before
        assert ck._pool.allocations == 2 and sorted(map(id, ck._pool._free)) == sorted(map(id, bufs))
        assert_same(ck.load(), expect)


@cuda
def test_deferred_copy_overlaps_the_training_stream_until_wait_snapshot(tmp_path):
    """CheckFreq's order: with ``defer=True`` the training stream does not wait for the copy
    (the next forward/backward overlap it) until ``wait_snapshot()``, which orders it after the
    copy without a host sync. Without ``defer`` the stream waits at once."""
    n = 256 << 20  # 1 GiB: a D2H copy of ~20 ms, far longer than recording and waiting for an event
    w = torch.ones(n, device="cuda")
    mark = torch.cuda.Event()
    with Checkpointer(str(tmp_path)) as ck:
        ck.reserve({"w": w})
        [buf] = ck._pool._free
        torch.cuda.synchronize()
        h = ck.save({"w": w}, 1, defer=True)
        copy = h._snapshot.result()  # queued by the snapshot thread; the training stream not ordered yet
        mark.record()
        mark.synchronize()
        assert not copy.query(), "the training stream waited for the deferred copy"
        h.wait_snapshot()
        mark.record()
        mark.synchronize()
        assert copy.query()
        ck.wait()
        ck.save({"w": w}, 2)
        mark.record()
        mark.synchronize()
        assert buf.event is not None and buf.event is not copy and buf.event.query()
        ck.wait()
        assert torch.equal(ck.load()["w"], torch.ones(n))


@cuda
def test_state_mixing_cpu_and_cuda_tensors(tmp_path):
    state = {"gpu": torch.randn(1000, 100, device="cuda"), "cpu": torch.randn(500, 20),
             "cpu_t": torch.randn(30, 40).t(), "gpu_half": torch.randn(77, device="cuda").half(), "n": 3}
    expect = to_cpu(state)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1)
        state["gpu"].add_(1)
        state["cpu"].add_(1)
        state["cpu_t"].add_(1)
        ck.wait()
        assert ck._pool._free[0].pinned
        assert_same(ck.load(), expect)


@cuda
def test_local_cuda_tensors_per_rank(tmp_path):
    state = {"w": torch.randn(256, device="cuda")}
    local = {"bn_mean": torch.randn(128, device="cuda"), "bn_var": torch.rand(128, device="cuda").double(),
             "cuda_rng": torch.cuda.get_rng_state(), "pos": 41}
    expect_state, expect_local = to_cpu(state), to_cpu(local)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 3, local)
        local["bn_mean"].zero_()
        state["w"].zero_()
        ck.wait()
        assert_same(ck.load(), expect_state)
        assert_same(ck.load_local(), expect_local)


@cuda
def test_large_transposed_tensor_is_staged_once_and_restored_bitwise(tmp_path):
    """A 64 MiB transpose (16 pieces of 4 MiB): the pinned buffer holds the file and one staging
    area of its storage, not one per piece (which was 16 x its storage)."""
    state = {"t": torch.randn(2048, 8192, device="cuda").t(), "w": torch.randn(5 << 20, device="cuda")}
    expect = to_cpu(state)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with Checkpointer(str(tmp_path), max_inflight=1) as ck:
        ck.save(state, 1)
        state["t"].add_(1)
        ck.wait()
        (buf,) = ck._pool._free
        assert buf.capacity <= nbytes + state["t"].numel() * 4 + (1 << 20), (buf.capacity, nbytes)
        assert_same(ck.load(), expect)


@cuda
def test_load_into_cuda_tensors_fills_them_in_place(tmp_path):
    """``load(into=)`` a state on the GPU (as FSDP2 users restore): every tensor, contiguous or not,
    is filled in its own device memory, bit for bit."""
    state = cuda_state()
    expect = to_cpu(state)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1)
        ck.wait()
        into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        into["t"] = torch.zeros(64, 48, device="cuda").t()  # non-contiguous targets
        into["strided"] = torch.zeros(40, 60, device="cuda")[:, ::3]
        into["meta"] = {"lr": 0.0, "name": ""}
        where = {k: v.data_ptr() for k, v in into.items() if isinstance(v, torch.Tensor)}
        out = ck.load(into=into)
        torch.cuda.synchronize()
    assert all(out[k].device.type == "cuda" and out[k].data_ptr() == p for k, p in where.items())
    assert_same(to_cpu(out), expect)


@pytest.mark.slow
@cuda
@pytest.mark.parametrize("pipeline", [False, True])
def test_lightning_job_on_the_gpu_killed_and_resumed_is_bitwise_identical(tmp_path, pipeline):
    """The callback on one GPU (the snapshot of CUDA parameters and Adam moments, the CUDA RNG that
    dropout draws from), with the copy before the next step or beside it (``pipeline=True``, the
    setting the README advises on GPUs): SIGKILLed mid-epoch after step 23, resumed from step 20,
    the job ends with the weights of an uninterrupted one, bit for bit."""
    from lightning_jobs import killed_and_resumed

    flags = ["--devices", "1", "--accelerator", "gpu"] + (["--pipeline"] if pipeline else [])
    killed_and_resumed(tmp_path, flags, 23, (20,))

@cuda
def test_a_memory_level_takes_the_device_copy_in_its_own_page_locked_pages_and_links_them(tmp_path):
    """With a memory level, the snapshot of CUDA state lands in the level's tmpfs buffer, page-locked
    for CUDA (``cudaHostRegister``), and persist commits that buffer by a hard link: no second copy of
    the state into tmpfs per save. Bit for bit on load; ``close()`` unlocks and removes the buffers."""
    import tempfile

    from ckpt_engine.save.filebuffers import FileBuffer

    state = {"w": torch.randn(1 << 20, device="cuda"), "h": torch.randn(4097, device="cuda").bfloat16()}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as mem:
        ck = Checkpointer(levels=[{"kind": "memory", "path": mem, "job": "gpu"}, str(tmp_path / "disk")],
                          keep_last=2)
        ck.reserve(state)
        buffers = list(ck._pool._free)
        assert buffers and all(isinstance(b, FileBuffer) and b.pinned for b in buffers), buffers
        assert all(b.tensor.is_pinned() for b in buffers)  # torch sees the lock: copies run asynchronously
        expect = []
        for step in range(1, 4):
            expect.append(to_cpu(state))
            ck.save(state, step)
            state["w"].add_(1)  # the snapshot is taken: the state may change
            ck.wait()
            own = ck.levels[0]
            data = own.path(f"{max(own.listdir(''))}/rank-00000.bin")
            assert os.stat(data).st_nlink == 2  # the buffer's file and the checkpoint's: one inode
        assert_same(ck.load(), expect[-1])
        assert_same(ck.load(step=2), expect[1])
        ck.close(timeout=60)
        assert not any(b.pinned for b in buffers)  # unlocked: freed with their last link
    with Checkpointer(str(tmp_path / "disk"), readonly=True) as disk:
        assert_same(disk.load(), expect[-1])  # flushed from those same pages


_CPU_LOADER = """
import sys, torch
from ckpt_engine import Checkpointer
from helpers import assert_same
assert not torch.cuda.is_available()
ck = Checkpointer(sys.argv[1], readonly=True)
expect = torch.load(sys.argv[2], weights_only=True)
assert_same(ck.load(), expect["state"])
assert_same(ck.load_local(), expect["local"])
print("ok", ck.latest_step())
"""


@pytest.mark.slow
@cuda
def test_cpu_only_process_loads_a_checkpoint_saved_from_cuda(tmp_path):
    state, local = cuda_state(), {"bn": torch.randn(9, device="cuda"), "pos": 5}
    root = str(tmp_path / "ck")
    with Checkpointer(root) as ck:
        ck.save(state, 12, local)
    torch.save({"state": to_cpu(state), "local": to_cpu(local)}, tmp_path / "expect.pt")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _CPU_LOADER, root, str(tmp_path / "expect.pt")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", "12"]


@pytest.mark.slow
def test_bench_gpu_tiny_runs_end_to_end(tmp_path):
    """bench_gpu.py --tiny (CPU without CUDA): every figure is there and positive."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--tiny", "--reps", "2",
                           "--out", str(out), "--workdir", str(tmp_path / "work")],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((out / "bench_gpu.json").read_text())
    assert (out / "bench_gpu.md").read_text().startswith("Device: ")
    assert {"device", "torch", "date", "workdir"} <= set(res["meta"])
    [size] = res["sizes"].values()
    assert size["bytes"] > 1 << 20 and size["encode_s"] > 0
    assert size["limits"]["d2h_s"] > 0 and size["limits"]["raw_write_gbps"] > 0
    expected = {"ours", "ours_defer", "dcp_async", "lightning_async"}
    expected |= {"dcp_async_pinned", "dcp_async_pinned_cached"} if CUDA else set()
    assert set(size["contenders"]) == expected
    assert "control (no save) ms" in (out / "bench_gpu.md").read_text()
    for name, r in size["contenders"].items():
        assert "error" not in r and r["reps"] == 2, (name, r)
        # every repetition carries its own control (the probe's sequence without a save), and the
        # net delay is taken against it, repetition by repetition
        assert {"gpu_delay_control_s", "gpu_delay_net_s"} <= set(r) and {"gpu_delay_control_s"} <= set(r["first"])
        for key in ("stall_s", "mutable_s", "durable_s", "persist_gbps"):
            assert r[key] > 0, (name, key, r)
        assert r["durable_s"] >= r["mutable_s"] >= r["stall_s"] * 0.999
        if CUDA:
            assert r["gpu_delay_s"] == r["gpu_delay_s"]  # a number, not NaN
            assert r["gpu_delay_net_s"] == r["gpu_delay_s"] - r["gpu_delay_control_s"]  # one repetition after the first
    assert size["contenders"]["ours"]["allocations"] == 1
    train = res["train"]
    assert train["params"] > 0 and train["baseline_step_s"] > 0
    # What is saved includes AdamW's two moments (the state after the warm-up, not before the first step);
    # the tied embedding counts once, as it is stored
    assert train["state_bytes"] >= 3 * 4 * train["params"], train["state_bytes"]
    assert train["raw_write_s"] > 0 and train["disk_interval_steps"] >= 1
    assert "steps at least" in (out / "bench_gpu.md").read_text()
    runs = ["baseline", "ours_every_1", "ours_every_10", "ours_defer_every_10", "ours_budget_3.5%", "dcp_async_every_10",
            "baseline_end"]
    for name in runs + (["dcp_async_pinned_every_10", "dcp_async_pinned_cached_every_10"] if CUDA else []):
        r = train["runs"][name]
        assert "error" not in r and r["step_s"] > 0 and "overhead" in r, (name, r)
        assert r["checkpoints"] >= (0 if name.startswith("baseline") else 1), (name, r)


@pytest.mark.slow
def test_bench_gpu_lightning_tiny_runs_end_to_end(tmp_path):
    """bench_gpu_lightning.py --tiny (a 2-layer GPT-2 on the CPU): every contender fits, ours checkpoint
    through the levels they name (the memory level's buffers are its tmpfs files) and the table has them."""
    out, shm = tmp_path / "out", f"/dev/shm/ckpt-bgl-{os.getpid()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), CUDA_VISIBLE_DEVICES="")
    try:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu_lightning.py"), "--tiny",
                               "--out", str(out), "--work", str(tmp_path / "work"), "--shm", shm],
                              env=env, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert not os.path.exists(shm) or not os.listdir(shm)  # each fit's memory released at its end
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    res = json.loads((out / "bench_gpu_lightning.json").read_text())
    rows = {r["contender"]: r for r in res["rows"]}
    assert set(rows) == {"none", "disk", "memory", "memory_pipeline"}
    for name, r in rows.items():
        assert r["steps"] == res["meta"]["steps"] and r["train_s"] > 0 and r["fit_s"] >= r["train_s"], r
        if name != "none":
            assert r["counters"]["committed"] == r["counters"]["saves"] == 3 and r["checkpoint_bytes"] > 0, r
    assert rows["disk"]["buffers"] == ["HostBuffer"] and rows["memory"]["buffers"] == ["FileBuffer"]
    assert rows["memory"]["counters"]["flushed"] >= 1
    table = (out / "bench_gpu_lightning.md").read_text()
    assert all(f"| {name} |" in table for name in rows)


# ---- without a device: the plan, the strided gather, the deferred contract ------------------------------
def test_index_boxes_cover_any_range_in_order():
    for shape in [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), (4, 0, 2)]:
        n = torch.Size(shape).numel()
        idx = torch.arange(n).view(shape)
        for start in range(n + 1):
            for stop in range(start, n + 1):
                boxes = index_boxes(shape, start, stop)
                assert len(boxes) <= max(1, 2 * len(shape) - 1)
                got = [idx[tuple(slice(a, b) for a, b in box)].reshape(-1) for box in boxes]
                assert torch.equal(torch.cat(got) if got else torch.arange(0), torch.arange(start, stop))


def _strided_tensors() -> dict:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(24, 30, generator=g)
    return {
        "t": base.t(),
        "step": base[:, ::3],
        "rows": base[2:20:2],
        "narrow": base[:, 5:17],
        "expand": torch.randn(30, generator=g).expand(6, 30),
        "channels_last": torch.randn(3, 4, 5, 6, generator=g).to(memory_format=torch.channels_last),
        "bf16_t": base.bfloat16().t()[3:],
        "permuted": torch.randn(4, 5, 6, generator=g, dtype=torch.float64).permute(2, 0, 1),
    }


def test_gather_places_any_slice_of_a_strided_tensor():
    """The non-contiguous path, run on CPU tensors: the storage span is copied as one block to the
    staging area (on CUDA: one D2H copy, no device temporary), then gathered on the host."""
    for name, src in _strided_tensors().items():
        assert not src.is_contiguous(), name
        n = src.numel()
        flat = src.reshape(-1)
        for start, stop in [(0, n), (0, 1), (n - 1, n), (n // 3, 2 * n // 3 + 1), (7, n - 5)]:
            nbytes = (stop - start) * src.element_size()
            g = Gather.plan(64, start, stop, src, 64 + -(-nbytes // 64) * 64)
            assert g.span_bytes <= src.untyped_storage().nbytes()
            buf = torch.zeros(g.staging + g.span_bytes, dtype=torch.uint8)
            g.stage(buf, src)
            g.finish(buf)
            got = buf[64:64 + nbytes].view(src.dtype)
            assert torch.equal(got, flat[start:stop]), (name, start, stop)


def test_gather_span_is_tight_for_the_outer_rows():
    """A rank's slice of a channels_last weight (whole outer rows) copies only its rows' storage."""
    src = torch.randn(8, 4, 5, 6).to(memory_format=torch.channels_last)
    row = 4 * 5 * 6
    g = Gather.plan(0, 2 * row, 5 * row, src, 0)
    assert g.span_bytes == 3 * row * 4


def test_plan_on_cpu_copies_on_the_host_and_captures_no_stream():
    state = [torch.randn(10, 3), torch.randn(4, 6).t(), torch.empty(0)]
    pieces, nbytes = layout([], [], state)
    pieces = tuple(Piece(False, p.tensor, p.start, p.stop, p.offset, p.nbytes) for p in pieces)
    plan = plan_copy(pieces, nbytes, state, [])
    assert (plan.devices, plan.direct, plan.gathers, plan.nbytes) == ((), (), (), nbytes)
    assert len(plan.host) == 3
    assert capture(plan.devices) is None  # no CUDA tensor: no stream, no event
    buf = HostBuffer(plan.nbytes, pinned=False)
    assert copy_into(buf, plan, None) == (None, 0.0) and buf.event is None
    for p, t in zip(pieces, state):
        assert torch.equal(buf.tensor[p.offset:p.offset + p.nbytes].view(t.dtype), t.reshape(-1))


class _OnDevice(torch.Tensor):
    """A CPU tensor that the copy planner takes for a CUDA one (``is_cuda``): planning needs no device."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_device_plan_stages_a_non_contiguous_tensor_once_and_copies_a_slice_in_one_call():
    """A tensor of many pieces (4 MiB each) is copied per span, not per piece: one device-to-host
    copy for a contiguous slice, and one staging area, of its storage span, for a strided one. Found
    by arithmetic: a 256 MiB transposed tensor saved in 64 pieces staged 64 x its storage (16 GiB of
    pinned memory, copied over PCIe), because each piece of a transpose touches nearly all of it."""
    big = (1 << 22) + 3  # 16 MiB of float32 and a bit: 5 pieces, the last short
    state = [torch.randn(big).as_subclass(_OnDevice),
             torch.randn(1024, (big + 1023) // 1024).t().as_subclass(_OnDevice),
             torch.randn(3, 5).t()]  # a CPU tensor beside them
    pieces, nbytes = layout([Slice(i, 0, t.numel()) for i, t in enumerate(state)], [4, 4, 4], [])
    assert sum(p.tensor == 1 for p in pieces) == 5
    plan = plan_copy(pieces, nbytes, state, [])
    assert [(s.tensor, s.start_byte, s.nbytes) for s, _ in plan.direct] == [(0, 0, big * 4)]
    assert len(plan.gathers) == 1
    g, src = plan.gathers[0]
    assert g.span_bytes == src.untyped_storage().nbytes() and g.nbytes == src.numel() * 4
    assert plan.nbytes <= nbytes + g.span_bytes + 64
    assert [s.tensor for s, _ in plan.host] == [2]
    buf = HostBuffer(plan.nbytes, pinned=False)  # the host half of the gather, run on CPU
    g.stage(buf.tensor, src)
    g.finish(buf.tensor)
    assert torch.equal(buf.tensor[g.offset:g.offset + g.nbytes].view(torch.float32), src.reshape(-1))


def test_copy_destinations_are_views_of_the_buffer_made_once_per_layout(monkeypatch):
    """The destination of a CUDA span's copy (cuda_copy._pair), run on CPU tensors: a whole tensor
    goes as it is into a view of its shape, a rank's slice of one as a flat range; the views are
    the buffer's own memory, kept across saves, and forgotten past ``VIEWS_KEPT``."""
    from ckpt_engine.save.cuda_copy import _copy_all, _pair
    from ckpt_engine.save.layout import Span

    w, b = torch.randn(6, 5), torch.arange(7, dtype=torch.int16)
    buf = HostBuffer(4096, pinned=False)
    whole, part = Span(False, 0, 0, 0, 120), Span(False, 1, 4, 512, 6)
    pairs = [_pair(buf, whole, w), _pair(buf, part, b)]
    assert pairs[0][1] is w and pairs[0][0].shape == (6, 5) and pairs[1][1].tolist() == [2, 3, 4]
    assert all(dst.untyped_storage().data_ptr() == buf.tensor.untyped_storage().data_ptr() for dst, _ in pairs)
    _copy_all(*zip(*pairs))
    assert torch.equal(buf.tensor[:120].view(torch.float32).view(6, 5), w)
    assert buf.tensor[512:518].view(torch.int16).tolist() == [2, 3, 4]
    assert _pair(buf, whole, w)[0] is pairs[0][0]  # kept: the next save makes no view
    monkeypatch.setattr(buffers_module, "VIEWS_KEPT", 2)
    buf.view_of(1024, torch.uint8, (8,))
    assert len(buf._views) == 1  # two kept: all forgotten before the third


def test_deferred_save_on_cpu_waits_for_the_copy_before_the_next_step(tmp_path, monkeypatch):
    """``save(defer=True)`` returns before the copy; ``wait_snapshot()`` returns after it."""
    gate, real = threading.Event(), snapshot_module.copy_into

    def slow_copy(*args):
        gate.wait(10)
        time.sleep(0.05)
        return real(*args)

    monkeypatch.setattr(snapshot_module, "copy_into", slow_copy)
    w = torch.zeros(1000, 100)
    with Checkpointer(str(tmp_path)) as ck:
        h = ck.save({"w": w, "t": w.t()}, 1, defer=True)
        assert not h.snapshot_done()
        gate.set()
        h.wait_snapshot()
        assert h.snapshot_done()
        w.add_(1)  # the optimizer step
        ck.wait()
        out = ck.load()
    assert torch.equal(out["w"], torch.zeros(1000, 100)) and torch.equal(out["t"], torch.zeros(100, 1000))
