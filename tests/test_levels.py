"""Multi-level persistence: commit on a fast level, flush in the background, restore from the fastest copy.

Unit tests of the pure parts, single-process tests against real directories (with storages that
stall, block or fail on purpose), and real 2-rank jobs (gloo) with level 2 on moto's S3 server,
a node-local level 1, a level 2 held back at a gate, and SIGKILLs in the middle of a flush.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time

import pytest
import torch

from ckpt_engine import Checkpointer, CheckpointError, CheckpointWarning, CorruptionError
from ckpt_engine.config import CheckpointConfig
from ckpt_engine.format.catalog import attempt_dirs, manifest_dirs
from ckpt_engine.format.entries import MANIFEST_NAME, data_file, index_file
from ckpt_engine.levels.destination import Destination
from ckpt_engine.levels.multilevel import MultiLevel
from ckpt_engine.levels.open import complete_everywhere
from ckpt_engine.levels.restore import Candidate, candidates
from ckpt_engine.levels.single import SingleLevel
from ckpt_engine.levels.transfer import copy_rank
from ckpt_engine.load.open import open_checkpoint
from ckpt_engine.load.read import verify
from ckpt_engine.storage import open_storage
from ckpt_engine.testing import FailingStorage, GatedStorage
from dist_worker import digest, make_local, make_state
from helpers import assert_same
import forkserver
from ranks import free_port, kill_job, lines_of, next_line


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 200, generator=g), "b": torch.randn(7, generator=g).bfloat16(), "step": step}


def flip(path, pos: int = 100) -> None:
    raw = bytearray(open(path, "rb").read())
    raw[pos] ^= 0x01
    open(path, "wb").write(bytes(raw))


def newest_dir(root: str) -> str:
    return manifest_dirs(open_storage(root))[-1][1]


# ---- pure parts ----------------------------------------------------------------------------------
def test_candidates_newest_step_first_then_the_fastest_level():
    shared = {0: [(3, "step-000000000003-a1"), (4, "step-000000000004-a1")],
              1: [(4, "step-000000000004-a1"), (5, "step-000000000005-a1"), (5, "step-000000000005-a0")]}
    found = candidates(shared, None, world_size=2)
    assert [(c.level, c.step, c.dirname[-2:]) for c in found] == [
        (1, 5, "a1"), (1, 5, "a0"), (0, 4, "a1"), (1, 4, "a1"), (0, 3, "a1")]
    assert [c.level for c in candidates(shared, None, 2, step=4)] == [0, 1]


def test_a_node_local_copy_counts_only_when_every_rank_has_it_from_as_many_writers():
    local = [[(7, "step-000000000007-x", 2), (8, "step-000000000008-x", 2), (9, "step-000000000009-x", 3)],
             [(7, "step-000000000007-x", 2), (9, "step-000000000009-x", 3)]]
    held = [{str(rank): cat} for rank, cat in enumerate(local)]  # each rank holds its own part
    found = candidates({1: [(7, "step-000000000007-x")]}, held, world_size=2)
    assert found == [Candidate(0, 7, "step-000000000007-x", True, (0, 1)), Candidate(1, 7, "step-000000000007-x")]
    assert complete_everywhere(local, 2) == [(7, "step-000000000007-x")]


def test_copy_streams_checks_and_writes_the_index_last(tmp_path):
    with Checkpointer(str(tmp_path / "src")) as ck:
        ck.save(state(1), 1, {"rng": torch.arange(9)})
    src, dst = open_storage(str(tmp_path / "src")), open_storage(str(tmp_path / "dst"))
    name = newest_dir(str(tmp_path / "src"))
    assert copy_rank(src, dst, name, 0, chunk=1000) > 240_000  # many chunks, each checked on the way
    for f in (data_file(0), index_file(0)):
        assert (tmp_path / "dst" / name / f).read_bytes() == (tmp_path / "src" / name / f).read_bytes()
    flip(tmp_path / "src" / name / data_file(0), 150_000)
    with pytest.raises(CheckpointError, match=r"rank-00000\.bin: checksum mismatch in tensor #0"):
        copy_rank(src, open_storage(str(tmp_path / "dst2")), name, 0, chunk=4096)
    assert not (tmp_path / "dst2" / name / index_file(0)).exists()  # so never part of a commit


# ---- one process, real directories ---------------------------------------------------------------
def test_checkpoints_reach_both_levels_and_restore_from_either(tmp_path):
    l1, l2 = str(tmp_path / "l1"), str(tmp_path / "l2")
    with Checkpointer(levels=[l1, {"path": l2, "keep_last": 5}], keep_last=2) as ck:
        for step in range(1, 5):
            ck.save(state(step), step, {"pos": step})
            ck.wait(flush=True)  # level 2 has it too (without this, older ones may be skipped)
        assert ck.steps() == [1, 2, 3, 4] and ck.counters["flushed"] == 4
        rec = ck.flush_records[-1]
        assert rec.committed and rec.step == 4 and rec.bytes > 0 and rec.lag_s >= 0 and rec.durable_s >= rec.lag_s
        assert rec.row()["level"] == 2 and rec.row()["bytes"] == rec.bytes
        assert_same(ck.load(), state(4))
        assert ck.loaded_level == 0 and ck.load_local() == {"pos": 4}
    name = newest_dir(l1)
    manifests = [(tmp_path / level / name / MANIFEST_NAME).read_bytes() for level in ("l1", "l2")]
    assert manifests[0] == manifests[1]  # the same commit on both levels, byte for byte
    assert [s for s, _ in manifest_dirs(open_storage(l1))] == [3, 4]  # keep_last 2 on level 1, once flushed
    shutil.rmtree(l1)  # a new node: the fast level is gone
    with Checkpointer(levels=[l1, l2]) as ck:
        assert_same(ck.load(), state(4))
        assert ck.loaded_level == 1 and ck.load_local() == {"pos": 4}
        assert_same(ck.load(step=2), state(2))


def test_one_level_is_exactly_a_path(tmp_path):
    with Checkpointer(levels=[{"path": str(tmp_path), "keep_last": 1}]) as ck:
        assert isinstance(ck._dest, SingleLevel) and ck.keep_last == 1
        ck.save(state(1), 1)
        ck.save(state(2), 2)
        ck.wait(flush=True, retention=True)
        assert ck.steps() == [2] and ck.loaded_level is None
    assert sorted(os.listdir(tmp_path)) == ["latest", newest_dir(str(tmp_path))]


def test_one_path_and_several_levels_are_one_interface(tmp_path):
    """The Checkpointer delegates where checkpoints go to a Destination; both kinds implement all of it."""
    members = {n for n in vars(Destination) if not n.startswith("_")} | set(Destination.__annotations__)
    with Checkpointer(str(tmp_path / "one")) as one, Checkpointer(levels=[str(tmp_path / n) for n in "ab"]) as two:
        assert type(one._dest) is SingleLevel and type(two._dest) is MultiLevel
        for dest in (one._dest, two._dest):
            assert [m for m in sorted(members) if not hasattr(dest, m)] == []
        assert one.levels == (one.storage,) and two.levels[0] is two.storage and len(two.levels) == 2


def test_from_config_builds_one_or_several_levels(tmp_path):
    cfg = CheckpointConfig(levels=[str(tmp_path / "a"), {"path": str(tmp_path / "b"), "keep_last": 1}], keep_last=3)
    with Checkpointer.from_config(cfg, max_inflight=2) as ck:
        assert [lv.keep_last for lv in ck._dest.levels] == [3, 1] and ck._pool.max_inflight == 2
        ck.save(state(1), 1)
        ck.wait(flush=True)
    assert manifest_dirs(open_storage(str(tmp_path / "b")))
    with Checkpointer.from_config(CheckpointConfig(dirpath=str(tmp_path / "c"), keep_last=1)) as ck:
        assert isinstance(ck._dest, SingleLevel) and ck.keep_last == 1


def test_a_stuck_level2_skips_older_checkpoints_and_never_stalls_training(tmp_path):
    gated = GatedStorage(str(tmp_path / "l2"))
    with Checkpointer(levels=[str(tmp_path / "l1"), {"path": gated, "keep_last": 2}], keep_last=2) as ck:
        for step in range(1, 11):
            ck.save(state(step), step)
            ck.wait()  # committed on level 1: does not wait for level 2
            if step == 1:  # the flusher holds step 1 at the gate before step 2 exists (no race with it)
                assert gated.blocked.wait(60)
        # all ten committed while level 2 could not finish a single write: training never waited for it
        assert ck.counters["committed"] == 10 and not manifest_dirs(gated)
        gated.gate.set()
        ck.wait(flush=True)
        counters, flushes = dict(ck.counters), list(ck.flush_records)
    assert counters["flushed"] == 2 and counters["flush_skipped"] == 8  # step 1 (held), then the newest
    assert [(f.step, f.lag_steps) for f in flushes if f.committed] == [(1, 9), (10, 0)]
    assert [s for s, _ in manifest_dirs(gated)] == [1, 10]
    assert [s for s, _ in manifest_dirs(open_storage(str(tmp_path / "l1")))] == [9, 10]


def test_level1_retention_keeps_the_checkpoint_level2_still_lacks(tmp_path):
    gated = GatedStorage(str(tmp_path / "l2"))
    ck = Checkpointer(levels=[str(tmp_path / "l1"), gated], keep_last=1)
    for step in range(1, 5):
        ck.save(state(step), step)
        ck.wait(retention=True)
        if step == 1:  # the flusher holds step 1 at the gate before step 2 exists (no race with it)
            assert gated.blocked.wait(60)
    l1 = open_storage(str(tmp_path / "l1"))
    assert [s for s, _ in manifest_dirs(l1)] == [1, 4]  # 1: being copied; 4: the newest
    gated.gate.set()
    ck.close()
    assert [s for s, _ in manifest_dirs(gated)] == [4] and [s for s, _ in manifest_dirs(l1)] == [4]
    assert ck.counters["flush_skipped"] == 2  # steps 2 and 3: superseded while step 1 was copied


def test_level2_failure_is_retried_counted_raised_once_and_recovers(tmp_path):
    failing = FailingStorage(str(tmp_path / "l2"))
    failing.fail_on = ".bin"
    ck = Checkpointer(levels=[str(tmp_path / "l1"), failing], flush_retries=2)
    ck.save(state(1), 1)
    with pytest.raises(CheckpointError, match=r"flush to level 2 \(.*l2\) failed: .*No space left on device"):
        ck.wait(flush=True)
    assert ck.counters["flush_failed"] == 2 and ck.flush_records[-1].attempts == 2
    assert ck.steps() == [1] and not manifest_dirs(failing)  # level 1 has it; level 2 shows nothing partial
    ck.wait()  # raised once
    failing.fail_on = None
    ck.save(state(2), 2)
    ck.close()
    assert [s for s, _ in manifest_dirs(failing)] == [2]


def test_close_waits_for_flushes_up_to_a_timeout(tmp_path):
    gated = GatedStorage(str(tmp_path / "l2"))
    ck = Checkpointer(levels=[str(tmp_path / "l1"), gated])
    ck.save(state(1), 1)
    assert gated.blocked.wait(60)
    watchdog = threading.Timer(60, gated.gate.set)  # a close() that ignored its timeout returns late, not raising
    watchdog.start()
    with pytest.raises(CheckpointError, match=r"level 2 .*flush of steps \[1\] not finished within 0.3 s"):
        ck.close(timeout=0.3)
    assert not gated.gate.is_set()  # it gave up while the flush was still held
    watchdog.cancel()
    gated.gate.set()
    warned = Checkpointer(levels=[str(tmp_path / "l3"), GatedStorage(str(tmp_path / "l4"))], on_error="warn")
    warned.save(state(1), 1)
    with pytest.warns(CheckpointWarning, match="not finished within"):
        warned.close(timeout=0.2)
    warned.levels[1].gate.set()


def test_a_restart_flushes_the_newest_level1_checkpoint_again(tmp_path):
    l1, l2 = str(tmp_path / "l1"), str(tmp_path / "l2")
    with Checkpointer(l1) as ck:  # as if the job died before its flushes
        for step in (1, 2, 3):
            ck.save(state(step), step)
    os.makedirs(os.path.join(l2, "step-000000000003-deadbeef000000000001"))  # a flush a SIGKILL cut short
    open(os.path.join(l2, "step-000000000003-deadbeef000000000001", "rank-00000.bin"), "wb").write(b"partial")
    with Checkpointer(levels=[l1, l2]) as ck:
        ck.wait(flush=True)
    assert attempt_dirs(open_storage(l2)) == [newest_dir(l1)]  # the partial one swept, step 3 flushed anew
    assert_same(Checkpointer(l2).load(), state(3))


def test_a_damaged_copy_falls_back_to_the_same_step_on_the_next_level(tmp_path):
    l1, l2 = str(tmp_path / "l1"), str(tmp_path / "l2")
    with Checkpointer(levels=[l1, l2]) as ck:
        ck.save(state(1), 1)
        ck.save(state(2), 2)
        ck.wait(flush=True)
    flip(os.path.join(l1, newest_dir(l1), data_file(0)))
    ck = Checkpointer(levels=[l1, l2])
    assert_same(ck.load(), state(2))
    assert ck.loaded_level == 1 and "level 1" in ck.load_failures[0] and "checksum mismatch" in ck.load_failures[0]
    flip(os.path.join(l2, newest_dir(l2), data_file(0)))
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        ck.load()
    assert_same(ck.load(fallback=True), state(1))
    ck.close()


def test_damage_on_level1_is_never_flushed(tmp_path):
    gated = GatedStorage(str(tmp_path / "l2"))
    ck = Checkpointer(levels=[str(tmp_path / "l1"), gated], flush_retries=1)
    ck.save(state(1), 1)
    ck.wait()
    flip(tmp_path / "l1" / newest_dir(str(tmp_path / "l1")) / data_file(0), 5000)
    gated.gate.set()
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ck.wait(flush=True)
    assert not manifest_dirs(gated)
    ck.close()


# ---- real jobs: 2 ranks -------------------------------------------------------------------------
WORKER = os.path.join(os.path.dirname(__file__), "levels_worker.py")


def start_job(mode: str, l1: str, l2: str, out, *extra: str, env: dict | None = None) -> list[forkserver.Job]:
    """Two ranks of ``levels_worker.py`` (gloo on loopback), each in its own session (for SIGKILL),
    forked from the test forkserver."""
    port = free_port()
    return [forkserver.launch([sys.executable, WORKER, mode, l1, l2, str(out), *extra],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), **(env or {})))
            for r in range(2)]


def run_job(mode: str, l1: str, l2: str, out, *extra: str, env: dict | None = None) -> list[dict]:
    """Run two ranks to the end; each rank's JSON result."""
    out.mkdir(exist_ok=True)
    procs = start_job(mode, l1, l2, out, *extra, env=env)
    for p in procs:
        output, _ = p.communicate(timeout=240)
        assert p.returncode == 0, output
    return [json.load(open(out / f"rank-{r}.json")) for r in range(2)]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("node_local", [False, True], ids=["shared-l1", "node-local-l1"])
def test_two_ranks_local_level_then_s3(node_local, tmp_path, s3_url):
    l1 = str(tmp_path / ("node{rank}" if node_local else "l1"))
    saved = run_job("save", l1, s3_url, tmp_path / "save", "6", env={"HOLD_L2": "saves", "KEEP_L2": "10"})
    assert all(r["node_local"] == node_local for r in saved)
    seen = saved[0]["seen"]
    assert all(l2 is None for _, l2 in seen), seen  # level 2 lags (held until the last save) ...
    assert Checkpointer(s3_url).latest_step() == 6  # ... and catches up by close()
    expected = digest(make_state(6))
    for wipe in (False, True):
        if wipe:  # a new node: level 1 is gone (node-local: one rank's part is enough)
            shutil.rmtree(tmp_path / ("node1" if node_local else "l1"))
        loaded = run_job("load", l1, s3_url, tmp_path / f"load{wipe}")
        for r in loaded:  # restore(): the ranks together assemble a node-local level 1 from their parts
            assert (r["step"], r["level"]) == (6, 1 if wipe else 0)
            assert r["state"] == expected and r["local"] == digest(make_local(6, r["rank"]))
            assert r["local0"] == digest(make_local(6, 0))
            alone = r["alone"]  # load(): each rank alone, which holds a node-local level 1 only in part
            assert (alone["step"], alone["level"]) == (6, 1 if wipe or node_local else 0)
            assert alone["state"] == expected and alone["local"] == digest(make_local(6, r["rank"]))


@pytest.mark.slow
@pytest.mark.integration
def test_two_ranks_stuck_level2_never_stalls_skips_counted_retention_right(tmp_path):
    # Level 2 held at its gate from step 1 to the last save on both ranks: every save committed on level 1
    # regardless (the training side never waits for level 2; stall figures: bench_save's multi-level section).
    two = run_job("save", str(tmp_path / "l1"), str(tmp_path / "l2"), tmp_path / "out2", "12",
                  env={"HOLD_L2": "saves", "KEEP_L1": "2", "KEEP_L2": "2"})
    assert [l2 for _, l2 in two[0]["seen"]] == [None] * 12
    counters = two[0]["counters"]
    assert counters["committed"] == 12 and (counters["flushed"], counters["flush_skipped"]) == (2, 10), counters
    assert [s for s, _ in manifest_dirs(open_storage(str(tmp_path / "l1")))] == [11, 12]
    l2 = open_storage(str(tmp_path / "l2"))
    assert [s for s, _ in manifest_dirs(l2)] == [1, 12]
    assert set(attempt_dirs(l2)) == {d for _, d in manifest_dirs(l2)}  # skipped flushes left nothing behind


@pytest.mark.slow
@pytest.mark.integration
def test_sigkill_during_a_flush_never_shows_a_partial_checkpoint(tmp_path):
    l1, l2 = str(tmp_path / "l1"), str(tmp_path / "l2")
    storage = open_storage(l2)

    def partial() -> list[str]:
        done = {d for _, d in manifest_dirs(storage)}
        return [d for d in attempt_dirs(storage) if d not in done and os.listdir(os.path.join(l2, d))]

    kills = 0
    for trial in range(4):
        procs = start_job("crashloop", l1, l2, tmp_path, env={"HOLD_L2": "rank1", "KEEP_L1": "2", "KEEP_L2": "2"})
        q = lines_of(procs[0])
        try:
            deadline = time.monotonic() + 120
            recovered = next_line(q, "recovered", deadline).split()
            if trial > 0:  # the flush the kill cut short was redone: level 2 has level 1's newest
                assert recovered[1] == recovered[2], recovered
                assert not partial()
            if trial == 3:
                break
            next_line(q, "committed", deadline)
            while not partial() and time.monotonic() < deadline:
                time.sleep(0.01)
            kill_job(procs)  # mid-flush: rank 0's files are on level 2, rank 1's held back, no manifest
            kills += 1
            assert partial()
            for _, name in manifest_dirs(storage):  # whatever level 2 shows as committed is whole
                verify(storage, open_checkpoint(storage, name))
        finally:
            kill_job(procs)
    assert kills == 3
    ck = Checkpointer(levels=[l1, l2])
    step = ck.latest_step()
    assert digest(ck.load()) == digest(make_state(step)) and ck.loaded_level == 0
    ck.close()


def test_load_is_never_a_collective_on_several_levels_as_on_one(tmp_path):
    """``load()`` of several levels on several ranks was a collective (one level's never was): a rank that
    loaded alone waited for the others. Now each process reads alone on any levels; ``restore()`` is the
    collective. Here the communicator refuses any call after the saves, and each of 3 ranks loads alone,
    its own ``local`` included."""
    from ckpt_engine.testing import run_ranks

    def rank(comm, levels):
        ck = Checkpointer(levels=levels, comm=comm)
        ck.save(state(2), 2, local={"rank": comm.rank})
        ck.wait(flush=True)
        gather, broadcast = comm.all_gather, comm.broadcast

        def refuse(*args, **kwargs):
            raise AssertionError("load() communicated")

        comm.all_gather = comm.broadcast = refuse
        try:
            loaded = ck.load()
            seen = (ck.loaded_manifest.step, ck.loaded_level, ck.load_local())
        finally:
            comm.all_gather, comm.broadcast = gather, broadcast
        ck.close()
        return loaded, seen

    levels = [str(tmp_path / "a"), str(tmp_path / "b")]
    for r, got in enumerate(run_ranks(3, lambda comm: rank(comm, levels))):
        assert not isinstance(got, BaseException), got
        loaded, seen = got
        assert_same(loaded, state(2))
        assert seen == (2, 0, {"rank": r})
