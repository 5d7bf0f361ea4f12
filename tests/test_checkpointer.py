"""Checkpointer in one process: two-phase semantics, buffers, back-pressure, retention, replace."""

from __future__ import annotations

import os
import re
import threading
import time

import numpy as np
import pytest
import torch

from ckpt_engine import Checkpointer, CheckpointError, LocalComm, NoCheckpointError
from ckpt_engine.format.catalog import attempt_dirs
from ckpt_engine.storage import open_storage
from ckpt_engine.testing import GatedStorage
from helpers import assert_same


def model_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64, generator=g))
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(3, 64)).sum().backward()
    opt.step()
    return {"model": lin.state_dict(), "optimizer": opt.state_dict(), "step": 1,
            "big": torch.randn(256, 1024, generator=g), "half": torch.randn(7, generator=g).bfloat16()}


@pytest.mark.parametrize("where", ["memory", "local"])
def test_roundtrip_state_and_local(where, memory_url, tmp_path):
    url = memory_url if where == "memory" else str(tmp_path)
    state = model_state()
    local = {"rng": torch.get_rng_state(), "np": np.random.get_state(), "pos": 5}
    with Checkpointer(url) as ck:
        ck.save(state, 10, local)
        ck.wait()
        assert ck.steps() == [10]
        assert_same(ck.load(), state)
        out = ck.load_local()
        assert torch.equal(out["rng"], local["rng"]) and out["pos"] == 5
        assert np.array_equal(out["np"][1], local["np"][1])


def test_file_url_and_plain_path_are_the_same_root(tmp_path):
    with Checkpointer(f"file://{tmp_path}") as ck:
        ck.save({"x": torch.arange(5)}, 1)
    with Checkpointer(str(tmp_path)) as ck:
        assert torch.equal(ck.load()["x"], torch.arange(5))


def test_mutating_right_after_save_keeps_saved_values(memory_url):
    w = torch.zeros(1000, 100)
    with Checkpointer(memory_url, max_inflight=2) as ck:
        for step in range(3):
            ck.save({"w": w}, step)
            w.add_(1)  # the optimizer step right after save()
        ck.wait()
        for step in range(3):
            assert torch.equal(ck.load(step=step)["w"], torch.full((1000, 100), float(step)))


def test_deferred_snapshot_keeps_values_after_wait_snapshot(memory_url):
    w = torch.zeros(2000, 500)
    with Checkpointer(memory_url) as ck:
        h = ck.save({"w": w}, 1, defer=True)
        h.wait_snapshot()
        assert h.snapshot_done()
        w.add_(1)
        ck.wait()
        assert torch.equal(ck.load()["w"], torch.zeros(2000, 500))


def test_buffers_are_reused_after_the_first_save(memory_url):
    state = model_state()
    with Checkpointer(memory_url, max_inflight=2) as ck:
        for step in range(6):
            ck.save(state, step)
        ck.wait()
        assert ck._pool.allocations <= 2
        ck.save({"other": torch.zeros(10**6)}, 7)  # a larger state: each slot grows once
        ck.save({"other": torch.zeros(10**6)}, 8)
        ck.wait()
        for step in range(9, 20):
            ck.save({"other": torch.zeros(10**6)}, step)
        ck.wait()
        assert ck._pool.allocations <= 4  # two slots, each allocated at most once per size


def test_back_pressure_waits_and_never_exceeds_max_inflight(tmp_path):
    storage = GatedStorage(str(tmp_path))
    with Checkpointer(storage, max_inflight=2) as ck:
        ck.save({"w": torch.randn(1000)}, 0)
        ck.save({"w": torch.randn(1000)}, 1)  # both buffers taken: step 0's write is held at the gate
        assert storage.blocked.wait(60)
        third = threading.Thread(target=ck.save, args=({"w": torch.randn(1000)}, 2))
        third.start()
        deadline = time.monotonic() + 60  # a guard: the save waits for a buffer, then the gate opens
        while ck._pool.waiting == 0 and third.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ck._pool.waiting == 1 and ck.counters["waited_s"] == 0
        storage.gate.set()
        third.join(60)
        for step in range(3, 6):
            ck.save({"w": torch.randn(1000)}, step)
        ck.wait()
        assert ck.counters["skipped"] == 0 and ck.counters["waited_s"] > 0
        assert ck._pool.allocations == 2
        assert ck.steps() == list(range(6))


def test_back_pressure_skip_is_counted_and_the_rest_commit(tmp_path):
    storage = GatedStorage(str(tmp_path))
    with Checkpointer(storage, max_inflight=1, on_busy="skip") as ck:
        handles = [ck.save({"w": torch.randn(1000)}, 0)]
        assert storage.blocked.wait(60)  # step 0's write is held: its buffer stays taken
        handles += [ck.save({"w": torch.randn(1000)}, step) for step in range(1, 4)]
        storage.gate.set()
        ck.wait()
        assert handles[0] is not None and handles[1:] == [None] * 3
        assert ck.counters["skipped"] == 3 and ck.steps() == [0]
        handles.append(ck.save({"w": torch.randn(1000)}, 4))  # free again: the rest commit
        ck.wait()
        assert handles[4] is not None and ck.steps() == [0, 4]


def test_keep_last_deletes_older_only_after_a_newer_commit(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=2) as ck:
        for step in (1, 2, 3, 4):
            ck.save({"s": torch.tensor(step)}, step)
            ck.wait(retention=True)
            assert ck.steps() == [max(1, step - 1), step][-min(step, 2):]
        assert len(attempt_dirs(ck.storage)) == 2


@pytest.mark.parametrize("keep_last, left", [(2, [1, 11]), (1, [1]), (3, [1, 10, 11])])
def test_keep_last_counts_a_restart_s_commit_below_the_earlier_steps(keep_last, left, tmp_path):
    """A job started afresh (or resumed from an older checkpoint) commits step 1 beside steps 10 and
    11 of its earlier incarnation: its commit counts in ``keep_last`` with the highest others (it
    kept ``keep_last`` of them beside it: 3 checkpoints for 2)."""
    with Checkpointer(str(tmp_path)) as ck:
        for step in (9, 10, 11):
            ck.save({"s": torch.tensor(step)}, step)
    with Checkpointer(str(tmp_path), keep_last=keep_last) as ck:
        ck.save({"s": torch.tensor(1)}, 1)
        ck.wait(retention=True)
        assert ck.steps() == left and len(attempt_dirs(ck.storage)) == len(left)


def test_saving_an_existing_step_replaces_it(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save({"v": torch.tensor(1)}, 5)
    with Checkpointer(str(tmp_path)) as ck:  # a resumed job reaches step 5 again
        ck.save({"v": torch.tensor(2)}, 5)
        ck.wait(retention=True)
        assert ck.steps() == [5] and ck.load()["v"].item() == 2
        assert len(attempt_dirs(ck.storage)) == 1


def test_load_step_and_missing_checkpoints(memory_url):
    with Checkpointer(memory_url) as ck:
        with pytest.raises(NoCheckpointError, match="no committed checkpoint"):
            ck.load()
        assert ck.latest_step() is None
        ck.save({"v": 1}, 3)
        ck.save({"v": 2}, 4)
        ck.wait()
        assert ck.load(step=3) == {"v": 1} and ck.load() == {"v": 2} and ck.latest_step() == 4
        with pytest.raises(NoCheckpointError, match=r"step 9 .*committed steps: \[3, 4\]"):
            ck.load(step=9)


def test_memory_is_refused_for_multi_rank_jobs(memory_url):
    class TwoRanks(LocalComm):
        world_size = 2

    with pytest.raises(CheckpointError, match="memory:// lives in one process"):
        Checkpointer(memory_url, comm=TwoRanks())


@pytest.mark.parametrize("kwargs, message", [
    ({"keep_last": 0}, "keep_last"), ({"on_busy": "drop"}, "on_busy"), ({"max_inflight": 0}, "max_inflight"),
    ({"commit_timeout": 0}, "commit_timeout"),
])
def test_bad_configuration_names_the_value(kwargs, message, memory_url):
    with pytest.raises(ValueError, match=message):
        Checkpointer(memory_url, **kwargs)


def test_closed_checkpointer_refuses_work(memory_url):
    ck = Checkpointer(memory_url)
    ck.close()
    ck.close()
    with pytest.raises(CheckpointError, match="closed"):
        ck.save({}, 1)


def test_library_leaves_global_state_alone(memory_url):
    state = model_state()  # builds a model, which draws from the RNG: before the snapshot of it
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    np_rng = np.random.get_state()
    with Checkpointer(memory_url) as ck:
        ck.save(state, 1)
        ck.wait()
        ck.load()
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng)
    assert np.array_equal(np.random.get_state()[1], np_rng[1])


def test_leftovers_of_a_crashed_run_are_swept_at_start(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save({"v": torch.tensor(1)}, 1)
    committed = sorted(os.listdir(tmp_path))  # the checkpoint of step 1 and `latest`, before the crash's leftovers
    os.makedirs(tmp_path / "step-000000000002-deadbeef000100000001")
    (tmp_path / "step-000000000002-deadbeef000100000001" / "rank-00000.bin").write_bytes(b"partial")
    (tmp_path / ".tmp-123-latest").write_bytes(b"x")
    with Checkpointer(str(tmp_path)) as ck:
        assert sorted(os.listdir(tmp_path)) == committed
        assert ck.steps() == [1]


def test_figures_are_recorded(memory_url):
    with Checkpointer(memory_url) as ck:
        ck.save(model_state(), 1)
        ck.wait()
        rec = ck.records[-1]
        assert rec.committed and rec.bytes > 0 and rec.stall_s > 0 and rec.persist_s > 0 and rec.snapshot_s > 0
        # CPU time of each phase, measured on the thread that ran it (what benchmarks read instead of patching)
        assert rec.encode_cpu_s > 0 and rec.snapshot_cpu_s > 0 and rec.persist_cpu_s > 0 and rec.commit_cpu_s > 0
        assert not rec.deferred and 0 < rec.encode_s <= rec.stall_s
        h = ck.save(model_state(), 2, defer=True)
        h.wait_snapshot()
        ck.wait()
        assert ck.records[-1].deferred and ck.records[-1].snapshot_cpu_s > 0


def test_unsupported_state_fails_on_the_training_side_naming_the_key(memory_url):
    with Checkpointer(memory_url) as ck:
        with pytest.raises(CheckpointError, match=r"state\['opt'\]\['hook'\]"):
            ck.save({"opt": {"hook": print}}, 1)
        ck.save({"ok": 1}, 2)
        ck.wait()
        assert ck.steps() == [2]


def test_storage_instance_can_be_passed(memory_url):
    with Checkpointer(open_storage(memory_url)) as ck:
        ck.save({"a": torch.ones(2)}, 1)
        ck.wait()
        assert ck.steps() == [1]


def test_a_readonly_reader_never_sweeps_a_running_jobs_attempt(tmp_path):
    """A second, read-only Checkpointer on a live job's path leaves its checkpoint in progress alone."""
    from ckpt_engine import CheckpointError

    writer = Checkpointer(str(tmp_path))
    writer.save({"w": torch.ones(4)}, 1)
    writer.wait()
    in_progress = tmp_path / "step-000000000002-ffffffffffff00000001"
    in_progress.mkdir()  # as a save of the running job looks before its manifest exists
    reader = Checkpointer(str(tmp_path), readonly=True)
    assert in_progress.exists() and reader.steps() == [1]
    assert torch.equal(reader.load()["w"], torch.ones(4))
    with pytest.raises(CheckpointError, match="readonly=True"):
        reader.save({"w": torch.ones(4)}, 3)
    Checkpointer(str(tmp_path))  # a writable one is the job's next incarnation: it sweeps
    assert not in_progress.exists()
    writer.close()


def test_the_manifest_names_each_save_s_own_keys_when_shapes_repeat(tmp_path):
    """The save layout is cached by dtypes and shapes; a state with the same shapes under other keys
    must still be recorded (and named in errors) under its own keys."""
    w = torch.ones(3, 4)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save({"encoder": w}, 1)
        ck.save({"decoder": w}, 2)
        ck.wait()
        for step, key in ((1, "encoder"), (2, "decoder")):
            ck.load(step)
            assert [t.name for t in ck._loaded.opened.manifest.tensors] == [f"state['{key}']"]


@pytest.mark.parametrize("how", ["load", "load_into", "restore"])
def test_loaded_tensors_are_freed_as_soon_as_the_caller_drops_them(tmp_path, how):
    """No reference cycle keeps a restored state alive until the garbage collector runs: a job
    that copies a loaded state into its model and drops it gets the memory back at once (with
    the collector off, as between two collections). Before: the decoder's recursive closures
    held every loaded tensor until a collection, and a later load paid for freeing them. (The
    small ``local`` sections stay, by design: ``load_local()`` returns them.)"""
    import gc
    import weakref

    state = {"w": torch.randn(1000), "nested": {"b": [torch.randn(10), (torch.ones(3), 7)]}}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(state, 1, local={"rng": torch.arange(4)})
        ck.wait()
        gc.collect()
        gc.disable()
        try:
            if how == "load":
                got = ck.load()
                refs = [weakref.ref(got["w"]), weakref.ref(got["nested"]["b"][1][0])]
            elif how == "load_into":
                got = ck.load(into={"w": torch.zeros(1000), "nested": {"b": [torch.zeros(10), (torch.zeros(3), 0)]}})
                refs = [weakref.ref(got["w"]), weakref.ref(got["nested"]["b"][0])]
            else:
                got = ck.restore()
                refs = [weakref.ref(got.state["w"]), weakref.ref(got.state["nested"]["b"][1][0])]
            del got
            alive = [r() is not None for r in refs]
        finally:
            gc.enable()
    assert not any(alive), alive


@pytest.mark.parametrize("rank", [-1, 2, 7, 1.0, "0", True, None])
def test_load_local_of_a_rank_the_checkpoint_lacks_is_a_bad_argument(rank, tmp_path):
    """``load_local(rank=...)`` names a writer: anything but an int in 0..world_size-1 of the
    checkpoint is a ValueError naming the value and that range (it was a StorageError about
    ``rank--0001.bin`` for -1, and ``None`` for a rank beyond the writers)."""
    from ckpt_engine.testing import SequentialComm

    cks = [Checkpointer(str(tmp_path), comm=comm) for comm in SequentialComm.group(2)]
    for r, ck in enumerate(cks):
        ck.save({"w": torch.ones(4)}, 1, {"rank": r})
    for ck in cks:
        ck.wait()
    for ck in reversed(cks):
        ck.close()
    reader = Checkpointer(str(tmp_path), readonly=True)
    if rank is None:  # this process's own rank (0)
        assert reader.load_local(rank) == {"rank": 0}
        return
    with pytest.raises(ValueError, match=rf"rank must be an int in 0\.\.1, .*{str(tmp_path)}.* \(saved by 2 ranks\), "
                                         rf"got {re.escape(repr(rank))}$"):
        reader.load_local(rank=rank)
    reader.load()
    with pytest.raises(ValueError, match=r"0\.\.1"):
        reader.load_local(rank=rank)
    assert [reader.load_local(rank=r) for r in (0, 1)] == [{"rank": 0}, {"rank": 1}]
