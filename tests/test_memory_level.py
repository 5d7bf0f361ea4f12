"""The node-memory level: configuration, node table, ownership and sweeping, budget, and real jobs
of 2 simulated nodes x 2 ranks that lose a node and resume from the memory the other node holds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckpt_engine import Checkpointer, CheckpointWarning
from ckpt_engine.config import ConfigError, LevelSpec, parse_levels
from ckpt_engine.errors import CheckpointError
from ckpt_engine.levels.memory import (NodeTable, alive_owners, check_room, claim, job_tag, node_footprint, node_key,
                                       sweep_dead_jobs)
from ckpt_engine.levels.open import Partial, assemblable, partial

sys.path.insert(0, os.path.dirname(__file__))
from dist_worker import digest, make_local, make_state  # noqa: E402
from helpers import mounted_tmpfs  # noqa: E402
from ranks import kill_job, lines_of, start_ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "memory_worker.py")


# ---- configuration ----------------------------------------------------------------------------------
def test_a_memory_level_is_configured_first_with_replicas_budget_and_job():
    mem, disk = parse_levels([{"kind": "memory", "budget": "2GiB", "replicas": 2, "job": "run-7"}, "/data/run"],
                             keep_last=3)
    assert (mem.memory, mem.path, mem.budget, mem.replicas, mem.job, mem.keep_last) == \
        (True, "/dev/shm/ckpt-suite", 2 << 30, 2, "run-7", 3)
    assert not disk.memory
    assert parse_levels([mem, disk]) == (mem, disk)  # a LevelSpec passes through unchanged


@pytest.mark.parametrize("levels, words", [
    (["/data/run", {"kind": "memory"}], "must be the first"),
    ([{"kind": "memory", "budget": "lots"}, "/d"], "levels[0].budget='lots'"),
    ([{"kind": "memory", "replicas": -1}, "/d"], "levels[0].replicas=-1"),
    ([{"kind": "memory", "path": "s3://bucket/x"}, "/d"], "a local directory"),
    ([{"kind": "memory", "job": "a/b"}, "/d"], "levels[0].job='a/b'"),
    ([{"path": "/fast", "replicas": 1}, "/d"], "apply to a memory level only"),
    ([{"kind": "ram"}, "/d"], "levels[0].kind='ram'"),
])
def test_bad_memory_level_settings_are_refused_naming_the_key(levels, words):
    with pytest.raises(ConfigError, match=None) as e:
        parse_levels(levels)
    assert words in str(e.value)


def test_the_job_that_owns_memory_is_derived_from_the_other_levels_so_a_restart_finds_it():
    mem = LevelSpec("/dev/shm/x", kind="memory")
    assert job_tag(mem, [LevelSpec("/data/run")]) == job_tag(mem, [LevelSpec("/data/run/")])
    assert job_tag(mem, [LevelSpec("/data/run")]) != job_tag(mem, [LevelSpec("/data/other")])
    assert job_tag(LevelSpec("/dev/shm/x", kind="memory", job="mine"), []) == "mine"


def test_the_node_is_what_the_launcher_says_overridable():
    assert node_key({"CKPT_NODE": "sim/1", "GROUP_RANK": "4"}) == "sim_1"
    assert node_key({"GROUP_RANK": "4"}) == "4"
    assert node_key({"HOROVOD_CROSS_RANK": "2"}) == "2"
    assert node_key({}) != ""


# ---- who sends to whom ------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=24), st.integers(0, 3))
def test_every_part_goes_to_peers_on_other_nodes_and_each_receiver_knows_its_senders(keys, replicas):
    table = NodeTable.of([str(k) for k in keys])
    rounds = min(replicas, table.count - 1)
    for rank in range(len(keys)):
        peers = table.peers(rank, replicas)
        assert len(peers) == rounds
        assert len({table.nodes[p] for p in peers}) == len(peers)  # a different node each
        assert table.nodes[rank] not in {table.nodes[p] for p in peers}
        for k, peer in enumerate(peers):
            assert rank in table.sources(peer, replicas)[k]
    sent = sum(len(table.peers(r, replicas)) for r in range(len(keys)))
    assert sent == sum(len(s) for r in range(len(keys)) for s in table.sources(r, replicas))


def test_a_checkpoint_is_assembled_from_whichever_rank_holds_each_part():
    ck = [(5, "step-5-a", 4)]
    # node 1 (ranks 2, 3) lost its memory: ranks 0 and 1 hold their own parts and node 1's replicas
    held = [{"0": ck, "1": ck, "2": ck, "3": ck}, {"0": ck, "1": ck, "2": ck, "3": ck}, {}, {}]
    assert assemblable(held) == [(5, "step-5-a", (0, 1, 0, 1))]
    whole = [{str(w): ck for w in range(4)} for _ in range(4)]
    assert assemblable(whole) == [(5, "step-5-a", (0, 1, 2, 3))]  # each its own
    assert assemblable([{"0": ck}, {"0": ck}, {}, {}]) == []  # writers 1-3 nowhere
    assert partial([{"0": ck}, {"0": ck}, {}, {}]) == [Partial(5, "step-5-a", 4, (1, 2, 3))]
    assert partial(held) == partial(whole) == []


def test_a_job_restarted_on_fewer_or_more_ranks_assembles_what_the_nodes_it_has_hold():
    """4 writers; the job restarted on node 0 alone (2 ranks), or on 3 nodes (6 ranks, 2 of them on a
    new empty node): every writer's part is read by a rank that holds it, the state is resharded."""
    from ckpt_engine.levels.restore import candidates

    ck = [(5, "step-5-a", 4)]
    node0 = {str(w): ck for w in range(4)}  # its own parts (0, 1) and node 1's replicas (2, 3)
    assert assemblable([node0, node0]) == [(5, "step-5-a", (0, 1, 0, 1))]
    assert [(c.step, c.whole) for c in candidates({}, [node0, node0], 2)] == [(5, True)]  # no exchange
    node1 = {"2": ck, "3": ck, "0": ck, "1": ck}
    assert assemblable([node0, node0, node1, node1, {}, {}]) == [(5, "step-5-a", (0, 1, 2, 3))]
    assert [c.whole for c in candidates({}, [node0, node0, node1, node1, {}, {}], 6)] == [False]
    # node 0 lost its memory too: writers 0 and 1 were only there and on node 1, which holds them
    assert assemblable([{}, {}, node1, node1]) == [(5, "step-5-a", (2, 3, 2, 3))]
    assert partial([{"0": ck, "1": ck}, {}]) == [Partial(5, "step-5-a", 4, (2, 3))]


def test_a_rank_whose_node_holds_every_part_reads_it_all_itself_else_the_ranks_exchange():
    from ckpt_engine.levels.restore import candidates

    ck = [(5, "step-5-a", 2)]
    both = {"0": ck, "1": ck}  # 2 nodes x 1 rank, one replica each: each node holds both parts
    assert [c.whole for c in candidates({}, [both, both], 2)] == [True]
    lost = [both, {}]  # node 1 replaced by an empty one: rank 1 needs rank 0's bytes
    assert [(c.whole, c.readers) for c in candidates({}, lost, 2)] == [(False, (0, 0))]


# ---- ownership, sweeping, room ----------------------------------------------------------------------
def test_memory_of_a_dead_job_is_swept_and_a_live_or_own_job_is_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for job in ("gone", "alive", "mine"):
        (tmp_path / job / "node-0" / "owners").mkdir(parents=True)
    (tmp_path / "gone" / "node-0" / "owners" / f"pid-{dead.pid}.json").write_text(
        json.dumps({"pid": dead.pid, "start": "1", "boot": ""}))
    claim(str(tmp_path / "alive" / "node-0"), 0)
    assert alive_owners(str(tmp_path / "alive" / "node-0")) == [os.getpid()]
    removed = sweep_dead_jobs(str(tmp_path), "mine", "0")
    assert removed == [str(tmp_path / "gone" / "node-0")]
    assert sorted(os.listdir(tmp_path)) == ["alive", "mine"]


def test_ckpt_gc_memory_lists_then_removes_only_the_memory_of_dead_jobs(tmp_path, capsys):
    from ckpt_engine.cli import main

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "gone" / "node-a" / "owners").mkdir(parents=True)
    (tmp_path / "gone" / "node-a" / "owners" / f"pid-{dead.pid}.json").write_text(json.dumps({"pid": dead.pid}))
    (tmp_path / "gone" / "node-a" / "rank-00000").mkdir()
    (tmp_path / "gone" / "node-a" / "rank-00000" / "part.bin").write_bytes(b"x" * 1000)
    claim(str(tmp_path / "running" / "node-a"), 0)
    assert main(["gc", "--memory", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "would remove 1 node memory directory" in out and "gone/node-a" in out and "running" not in out
    assert (tmp_path / "gone").exists()
    assert main(["gc", "--memory", str(tmp_path), "--yes", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in doc["remove"]] == [str(tmp_path / "gone" / "node-a")] and doc["bytes"] >= 1000
    assert sorted(os.listdir(tmp_path)) == ["running"]


def test_a_budget_that_cannot_hold_a_checkpoint_is_refused_with_the_numbers(tmp_path):
    assert node_footprint(100, 2, 1) == 400
    assert check_room(str(tmp_path), 100, 2, 1, 4000) == 9
    with pytest.raises(CheckpointError) as e:
        check_room(str(tmp_path), 100, 2, 1, 700)
    assert all(words in str(e.value) for words in ("400 bytes", "2 rank(s) x 100 bytes", "budget is 700 bytes"))


def test_the_first_save_into_a_too_small_budget_is_refused_before_anything_is_written(tmp_path):
    ck = Checkpointer(levels=[{"kind": "memory", "path": str(tmp_path / "mem"), "budget": 1000},
                              str(tmp_path / "disk")])
    with pytest.raises(CheckpointError, match="budget is 1000 bytes"):
        ck.save({"w": torch.zeros(1000)}, 1)
    ck.close()


def test_memory_then_disk_in_one_process_and_close_releases_the_memory(tmp_path):
    mem = tmp_path / "mem"
    ck = Checkpointer(levels=[{"kind": "memory", "path": str(mem), "job": "j"}, str(tmp_path / "disk")], keep_last=2)
    for step in (1, 2, 3):
        ck.save(make_state(step), step, make_local(step, 0))
    ck.wait(flush=True)
    assert ck.load(step=3) is not None and ck.loaded_level == 0
    assert digest(ck.load()) == digest(make_state(3))
    assert os.listdir(mem / "j") == [f"node-{node_key()}"]
    ck.close()
    assert not (mem / "j").exists()  # the disk holds the newest: nothing left in memory
    again = Checkpointer(str(tmp_path / "disk"), readonly=True)
    assert digest(again.load()) == digest(make_state(3))


# ---- real jobs: 2 simulated nodes x 2 ranks ------------------------------------------------------------
NODES = [{"CKPT_NODE": str(r // 2), "LOCAL_WORLD_SIZE": "2"} for r in range(4)]


def _save_then_kill(mem, disk, out, steps: int, env: dict) -> list[dict]:
    procs = start_ranks(4, ["save", str(mem), disk, str(out), str(steps)], env, worker=WORKER, rank_env=NODES)
    try:
        for p, q in zip(procs, [lines_of(p) for p in procs]):
            seen = []
            while (line := q.get(timeout=240)) not in ("saved", "<eof>"):
                seen.append(line)
            assert line == "saved", "\n".join(seen)
    finally:
        kill_job(procs)
    return [json.load(open(out / f"rank-{r}.json")) for r in range(4)]


def _restore(mem, disk, out, env: dict, world: int = 4) -> list[dict]:
    """A job of ``world`` ranks, ``NODES[:world]`` (the first ``world // 2`` nodes), restoring."""
    procs = start_ranks(world, ["restore", str(mem), disk, str(out)], env, worker=WORKER, rank_env=NODES[:world])
    for p in procs:
        output, _ = p.communicate(timeout=240)
        assert p.returncode == 0, output
    return [json.load(open(out / f"rank-{r}.json")) for r in range(world)]


@pytest.mark.slow
def test_a_lost_node_resumes_from_the_newest_step_in_the_other_nodes_memory(tmp_path, capsys):
    """Every rank SIGKILLed; node 1's memory deleted (a replaced node); the disk never got a checkpoint."""
    mem, out = tmp_path / "mem", tmp_path / "out"
    out.mkdir()
    env = {"HOLD_DISK": "1"}
    saved = _save_then_kill(mem, str(tmp_path / "disk"), out, 3, env)
    assert all(r["counters"]["replicated"] == 3 and r["counters"]["replica_failed"] == 0 for r in saved)
    from ckpt_engine.cli import main

    assert main(["ls", str(mem / "test"), "--json"]) == 0
    rows = {r["step"]: r["levels"][0]["status"] for r in json.loads(capsys.readouterr().out)}
    assert rows[3] == "whole (node-0: 4/4 parts, node-1: 4/4 parts)", rows
    shutil.rmtree(mem / "test" / "node-1")
    shutil.copytree(mem, tmp_path / "mem-node-0")  # for the jobs restarted on node 0 alone, below
    shutil.copytree(mem, tmp_path / "mem-half", ignore=shutil.ignore_patterns("rank-00002", "rank-00003"))
    assert main(["ls", str(tmp_path / "mem-half" / "test"), "--json"]) == 0  # writers 2 and 3 lost: not assemblable
    half = {r["step"]: r["levels"][0]["status"] for r in json.loads(capsys.readouterr().out)}
    assert half[3] == "partial (node-0: 2/4 parts)", half
    assert main(["ls", str(mem / "test"), str(tmp_path / "disk")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["step", "level", "1:", str(mem / "test"), "level", "2:", str(tmp_path / "disk")]
    assert table[-1].split() == ["3", "whole", "(node-0:", "4/4", "parts)", "-"]  # the disk never got it
    restored = _restore(mem, str(tmp_path / "disk"), out, env)
    for rank, r in enumerate(restored):
        assert (r["step"], r["level"], r["failures"]) == (3, 0, [])
        assert r["state"] == digest(make_state(3))
        assert r["local"] == digest(make_local(3, rank))  # node 1's per-rank parts came from node 0
    # The job restarted on node 0 alone (2 ranks, as `torchrun --nnodes 1` would): node 0 holds every
    # part of step 3 (its own and node 1's replicas), so it resumes from there, the state resharded.
    alone = _restore(tmp_path / "mem-node-0", str(tmp_path / "disk"), out, env, world=2)
    for rank, r in enumerate(alone):
        assert (r["latest"], r["step"], r["level"], r["failures"], r["warnings"]) == (3, 3, 0, [], [])
        assert r["state"] == digest(make_state(3)) and r["local"] == digest(make_local(3, rank))
    # Node 0 without node 1's replicas either (the held disk never took step 1: memory keeps it for the flush):
    # nothing to restore (restore() returns None), and the job is told why in a warning
    half = _restore(tmp_path / "mem-half", str(tmp_path / "disk"), out, env, world=2)
    for r in half:
        assert (r["latest"], r["step"]) == (None, None)
        [said] = r["warnings"]
        assert "steps 1, 2, 3 skipped" in said and "step 3: ranks 2, 3 of the 4 that wrote it" in said, said
        assert said.endswith("no other checkpoint to restore")


@pytest.mark.slow
def test_without_replicas_a_lost_node_falls_back_to_the_disk(tmp_path):
    mem, out = tmp_path / "mem", tmp_path / "out"
    out.mkdir()
    env = {"REPLICAS": "0"}
    _save_then_kill(mem, str(tmp_path / "disk"), out, 3, env)
    shutil.rmtree(mem / "test" / "node-1")
    restored = _restore(mem, str(tmp_path / "disk"), out, env)
    for rank, r in enumerate(restored):
        assert (r["step"], r["level"]) == (3, 1)  # memory cannot assemble it: the disk has it
        assert r["state"] == digest(make_state(3)) and r["local"] == digest(make_local(3, rank))


# ---- a full tmpfs -------------------------------------------------------------------------------------
@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 8 MiB tmpfs (needs root in this sandbox; skipped where mounting is not permitted)."""
    with mounted_tmpfs(tmp_path / "shm", "8m") as where:
        yield where


def test_a_full_tmpfs_is_a_counted_failure_training_goes_on_and_the_disk_keeps_its_checkpoints(tiny_tmpfs, tmp_path):
    mem = {"kind": "memory", "path": str(tiny_tmpfs), "job": "j"}
    ck = Checkpointer(levels=[mem, str(tmp_path / "disk")], keep_last=2)  # on_error="raise", as the front ends
    big = lambda v: {"w": torch.full((256, 1024), float(v))}  # noqa: E731 - 1 MiB
    ck.save(big(1), 1)
    ck.wait(flush=True)
    tenant = tiny_tmpfs / "another-tenant"
    with open(tenant, "wb") as f:  # someone else fills the node's memory
        try:
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()
        except OSError:
            pass
    with pytest.warns(CheckpointWarning, match="No space left on device: the storage is full.*training goes on"):
        ck.save(big(2), 2)  # the buffer for it cannot be in the tmpfs: ordinary memory, whose write fails
        ck.wait()
    assert ck.counters["failed"] == 1 and ck.counters["disk_full"] == 1
    tenant.unlink()  # room again: the next checkpoint commits in memory and reaches the disk
    ck.save(big(3), 3)
    ck.wait(flush=True)
    assert ck.steps() == [1, 3] and ck.counters["committed"] == 2
    ck.close()
    disk = Checkpointer(str(tmp_path / "disk"), readonly=True)
    assert disk.steps() == [1, 3] and torch.equal(disk.load()["w"], big(3)["w"])
    assert not (tiny_tmpfs / "j").exists()  # released at close: nothing left in the tmpfs


# ---- faults: SIGKILL at any moment, a peer dying mid-run ---------------------------------------------
def _lines_until(queues, done, timeout: float = 240) -> list[list[str]]:
    """Read every rank's lines until ``done(rank, lines)`` holds for each; the lines read, by rank."""
    got: list[list[str]] = [[] for _ in queues]
    for rank, q in enumerate(queues):
        while not done(rank, got[rank]):
            line = q.get(timeout=timeout)
            assert line != "<eof>", "\n".join(got[rank][-30:])
            got[rank].append(line)
    return got


def _committed(lines: list[str]) -> int:
    return max((int(x.split()[1]) for x in lines if x.startswith("committed ")), default=0)


def _restored(lines: list[str]) -> tuple[int, int, bool] | None:
    for x in lines:
        if x.startswith("restored ") and x != "restored none":
            _, step, level, ok = x.split()
            return int(step), int(level), ok == "True"
    return None


@pytest.mark.slow
def test_sigkill_at_any_moment_of_commit_replication_or_flush_loses_nothing_committed(tmp_path):
    """Three incarnations of a 2 x 2 job saving every step (memory commit, replication and the
    disk's flush all in flight), each SIGKILLed whole a few steps in: each restart resumes at or
    after the newest step every rank had committed, with that step's state and per-rank parts; a
    last clean incarnation leaves no memory behind."""
    import random

    mem, disk, out = tmp_path / "mem", str(tmp_path / "disk"), tmp_path / "out"
    out.mkdir()
    rng = random.Random(36)
    floor = 0
    for _ in range(3):
        procs = start_ranks(4, ["loop", str(mem), disk, str(out)], {"LOCKSTEP": "1"}, worker=WORKER, rank_env=NODES)
        try:
            queues = [lines_of(p) for p in procs]
            extra = rng.randint(2, 6)
            first = _lines_until(queues, lambda r, ls: any(x.startswith("restored") for x in ls))
            restored = [_restored(ls) for ls in first]
            if floor:
                assert len(set(restored)) == 1 and restored[0][2] and restored[0][0] >= floor, (restored, floor)
            base = restored[0][0] if restored[0] else 0
            got = _lines_until(queues, lambda r, ls: _committed(ls) >= base + extra)
        finally:
            kill_job(procs)
        floor = min(_committed(ls) for ls in got)  # every rank's part of it is in its node's memory
    restored = _restore(mem, disk, out, {})
    assert {r["step"] for r in restored} == {restored[0]["step"]} and restored[0]["step"] >= floor
    for rank, r in enumerate(restored):
        assert r["state"] == digest(make_state(r["step"])) and r["local"] == digest(make_local(r["step"], rank))
    assert not (mem / "test").exists()  # the clean end released every node's memory


@pytest.mark.slow
def test_a_peer_dying_mid_run_is_a_counted_replication_failure_and_the_others_go_on(tmp_path):
    mem, disk, out = tmp_path / "mem", str(tmp_path / "disk"), tmp_path / "out"
    out.mkdir()
    env = {"KEEP_MEM": "100"}  # no lockstep here: nothing retained away while the ranks drift apart
    procs = start_ranks(4, ["loop", str(mem), disk, str(out)], env, worker=WORKER, rank_env=NODES)
    try:
        queues = [lines_of(p) for p in procs]
        _lines_until(queues, lambda r, ls: _committed(ls) >= 3)
        os.killpg(procs[3].pid, signal.SIGKILL)  # node 1's second rank dies; rank 1 replicates to it
        procs[3].wait()
        got = _lines_until(queues[:3], lambda r, ls: _committed(ls) >= 6 and (r != 1 or any(
            x.startswith("replica_failed") for x in ls)))
        assert _committed(got[1]) >= 6  # rank 1 went on saving after its peer died
    finally:
        kill_job(procs)
    restored = _restore(mem, disk, out, env)  # every node's memory is still there, rank 3's part stopped early
    for rank, r in enumerate(restored):
        assert r["step"] >= 3 and r["failures"] == []
        assert r["state"] == digest(make_state(r["step"])) and r["local"] == digest(make_local(r["step"], rank))


_ONE_JOB = """
import sys, time, torch
from ckpt_engine import Checkpointer
ck = Checkpointer(levels=[{"kind": "memory", "path": sys.argv[1], "job": sys.argv[2]}, sys.argv[3]])
ck.save({"w": torch.ones(1000)}, 1)
ck.wait()
print("saved", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_two_jobs_on_one_node_keep_their_own_memory_until_one_is_gone(tmp_path):
    mem = tmp_path / "mem"
    ours = [sys.executable, "-c", _ONE_JOB, str(mem)]
    a = subprocess.Popen(ours + ["a", str(tmp_path / "disk-a")], stdout=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert a.stdout.readline().strip() == "saved"
        b = Checkpointer(levels=[{"kind": "memory", "path": str(mem), "job": "b"}, str(tmp_path / "disk-b")])
        b.save({"w": torch.zeros(1000)}, 1)
        b.wait()
        assert sorted(os.listdir(mem)) == ["a", "b"]  # job a runs: its memory is not b's to sweep
        assert b.load()["w"].sum() == 0
    finally:
        a.kill()
        a.wait()
    c = Checkpointer(levels=[{"kind": "memory", "path": str(mem), "job": "c"}, str(tmp_path / "disk-c")])
    assert sorted(os.listdir(mem)) == ["b", "c"]  # a died: its memory went at the next start on the node
    b.close()
    c.close()
    assert os.listdir(mem) == []  # released at close: each job's disk level holds its newest


# ---- the snapshot buffer is the memory checkpoint ------------------------------------------------------
def test_the_snapshot_buffer_is_the_memory_checkpoints_data_file_and_is_reused_only_once_unlinked(tmp_path):
    """A CPU snapshot is copied into a file of the memory level, committed by a hard link (no second
    write); the pool reuses a buffer only after retention removed every checkpoint that links it,
    so older checkpoints stay intact, and steady state allocates nothing new."""
    mem = tmp_path / "mem"
    ck = Checkpointer(levels=[{"kind": "memory", "path": str(mem), "job": "j"}], keep_last=3)
    state = lambda v: {"w": torch.full((1 << 16,), float(v)), "b": torch.arange(7) * v}  # noqa: E731
    for step in range(1, 13):
        ck.save(state(step), step)
        ck.wait(retention=True)
        if step == 4:
            early = ck._pool.allocations
    own = ck.levels[0]
    newest = max(own.listdir(""))
    data = os.stat(own.path(f"{newest}/rank-00000.bin"))
    buffers = [os.stat(os.path.join(own.path(".buffers"), b)) for b in os.listdir(own.path(".buffers"))]
    assert any(b.st_ino == data.st_ino for b in buffers) and data.st_nlink == 2  # the same file, linked
    assert ck._pool.allocations == early <= 4  # keep_last + the one in flight, then nothing new
    assert ck.steps() == [10, 11, 12]
    for step in (10, 11, 12):  # each still holds its own bytes: no buffer reused while linked
        assert digest(ck.load(step=step)) == digest(state(step))
    ck.close()
    reserved = Checkpointer(levels=[{"kind": "memory", "path": str(tmp_path / "mem2"), "job": "j"}], keep_last=3)
    reserved.reserve(state(0))  # at set-up: the buffers the checkpoints will hold, and the one in flight
    assert reserved._pool.allocations == 3 + 1
    for step in range(1, 9):
        reserved.save(state(step), step)
        reserved.wait(retention=True)
    assert reserved._pool.allocations == 4  # none during training
    reserved.close()


def test_a_memory_buffers_pages_are_mapped_when_it_is_made_not_in_the_snapshot_copy():
    """The first write to each page of a fresh shared tmpfs mapping is a page fault (176 MiB: ~70 ms
    against ~19 ms for the copy itself); a buffer is mapped with its pages populated, so that cost
    falls in ``reserve()`` at set-up and never in a snapshot training waits for."""
    import ctypes
    import resource
    import tempfile

    from ckpt_engine.save.filebuffers import FileBuffer

    nbytes = 8 << 20
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        buf = FileBuffer(os.path.join(d, "buf-0"), nbytes)
        src = torch.ones(nbytes, dtype=torch.uint8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ctypes.memmove(buf.address, src.data_ptr(), nbytes)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < nbytes // 4096 // 8, f"{faults} page faults copying into a fresh {nbytes}-byte buffer"
        assert bytes(buf.view(16)) == b"\x01" * 16
        del buf


def test_a_flush_from_memory_reads_the_snapshot_buffers_own_pages_and_never_passes_damage_on(tmp_path):
    """On tmpfs, a flush checks and writes a memory checkpoint's bytes where this process has them mapped
    already (the snapshot buffer its data file links), with no read copy and no second mapping (a flush of
    176 MiB: 62 -> 21 ms of CPU, 2026-11-28); a byte damaged there is still caught, and the disk gets nothing."""
    import tempfile

    import numpy as np

    from ckpt_engine.format.catalog import manifest_dirs
    from ckpt_engine.levels.memory import in_memory_fs
    from ckpt_engine.testing import GatedStorage

    assert not in_memory_fs(str(tmp_path)) and in_memory_fs("/dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as mem:
        disk = GatedStorage(str(tmp_path / "disk"))
        ck = Checkpointer(levels=[{"kind": "memory", "path": mem, "job": "j"}, disk], keep_last=2, flush_retries=1)
        ck.save({"w": torch.arange(1 << 21, dtype=torch.float32)}, 1)
        ck.wait()
        own = ck.levels[0]
        assert own.in_memory
        rel = f"{max(own.listdir(''))}/rank-00000.bin"
        with own.reader(rel) as reader:
            view = reader.mapped()
            assert view is not None and view.readonly and view.nbytes == 8 << 20
            assert np.frombuffer(view, np.uint8).ctypes.data in {b.address for b in ck._pool._free}
            del view
        with open(own.path(rel), "r+b") as f:  # the same pages: the buffer's file
            f.seek(12345)
            byte = f.read(1)
            f.seek(12345)
            f.write(bytes([byte[0] ^ 0xFF]))
        disk.gate.set()
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            ck.wait(flush=True)
        assert not manifest_dirs(disk)
        ck.close(timeout=10)


def test_a_background_reservation_lets_training_go_on_and_saves_never_allocate_a_second_set(tmp_path):
    """The front ends reserve in the background: the first buffer now, the others on ``ckpt-reserve``
    while training goes on (six 176 MiB tmpfs files held the first step for 0.66 s); a save that needs
    a buffer meanwhile waits for it instead of allocating another, and ``close()`` stops the thread."""
    import threading

    state = lambda v: {"w": torch.full((1 << 16,), float(v))}  # noqa: E731
    ck = Checkpointer(levels=[{"kind": "memory", "path": str(tmp_path / "mem"), "job": "j"}], keep_last=3)
    ck.reserve(state(0), background=True)  # returns at once: every buffer is made on ckpt-reserve
    for step in range(1, 9):  # the first saves may come before the reservation ended
        ck.save(state(step), step)
        ck.wait(retention=True)
    ck._pool.stop_reserving()
    assert ck._pool.allocations == 3 + 1  # the reserved set, none more
    assert digest(ck.load(step=8)) == digest(state(8))
    ck.close()
    assert not list((tmp_path / "mem").rglob("buf-*"))  # the buffers no checkpoint links are freed at close...
    again = Checkpointer(levels=[{"kind": "memory", "path": str(tmp_path / "mem"), "job": "j"}], keep_last=3)
    assert digest(again.load(step=8)) == digest(state(8))  # ...and the checkpoints kept in memory stay whole
    again.close()

    quick = Checkpointer(levels=[{"kind": "memory", "path": str(tmp_path / "mem2"), "job": "j"}], keep_last=3)
    quick.reserve({"w": torch.zeros(1 << 22)}, background=True)
    quick.close()  # at once: the reservation stops, nothing is left behind
    assert not any(t.name == "ckpt-reserve" for t in threading.enumerate())
    assert not (tmp_path / "mem2" / "j").exists() or not list((tmp_path / "mem2" / "j").rglob("buf-*"))


def test_a_second_background_reservation_does_not_make_the_buffers_the_first_is_still_making():
    """``reserve(background=True)`` twice (a state that changed, a second set-up): the buffers the first
    reservation's thread has yet to make count as coming, so none is made twice."""
    import threading

    from ckpt_engine.save.buffers import BufferPool, HostBuffer

    pool, gate, made = BufferPool(1), threading.Event(), []

    def make(nbytes, pinned):
        if made:  # the first buffer comes at once; the thread's wait at the gate
            gate.wait(2)
        made.append(nbytes)
        return HostBuffer(nbytes, pinned)

    pool.make = make
    pool.reserve(4096, False, kept=3, background=True)
    pool.reserve(4096, False, kept=3, background=True)  # the thread is still at its first buffer
    gate.set()
    pool._reserver.join(10)  # the thread makes the rest and ends
    assert pool.allocations == len(made) == 4
    pool.stop_reserving()


def test_a_buffer_cuda_cannot_page_lock_leaves_no_file_and_the_save_goes_to_ordinary_memory(tmp_path):
    """A memory level's buffer for CUDA state is page-locked for CUDA; where that is refused (here: no
    CUDA at all; on a GPU, a kernel or sandbox that cannot lock file pages), the file is removed at
    once and the pool falls back to an ordinary host buffer, which is written to the level as a file."""
    from ckpt_engine.host import pinning
    from ckpt_engine.save.filebuffers import FileBuffer, FileBuffers

    if torch.cuda.is_available():
        pytest.skip("CUDA locks the pages here: tests/test_gpu.py covers it")
    assert not pinning.register(0x1000, 4096)
    path = tmp_path / "buf-0"
    with pytest.raises(OSError, match="could not page-lock.*buf-0"):
        FileBuffer(str(path), 1 << 16, pinned=True)
    assert not path.exists()
    made = FileBuffers(str(tmp_path / "bufs"))(1 << 16, False)
    assert isinstance(made, FileBuffer) and not made.pinned and os.listdir(tmp_path / "bufs") == ["buf-0"]


def test_a_flush_that_lags_never_makes_a_save_allocate_a_buffer(tmp_path):
    """A memory level's flushers may hold two checkpoints beyond ``keep_last`` (the one being copied,
    the newest not yet copied); their buffers are reserved in the background with the others, so a save
    never makes one on the training thread while a flush lags (on an H200 one such 1.5 GB page-locked
    buffer held a GPT-2's step for 0.84 s). Within the level's room: a budget for ``keep_last`` + 1
    checkpoints gets no spare."""
    import threading

    from ckpt_engine.testing import GatedStorage

    state = lambda v: {"w": torch.full((1 << 16,), float(v))}  # noqa: E731
    disk = GatedStorage(str(tmp_path / "disk"))
    ck = Checkpointer(levels=[{"kind": "memory", "path": str(tmp_path / "mem"), "job": "j"}, disk], keep_last=2)
    makers, make = [], ck._pool.make
    ck._pool.make = lambda nbytes, pinned: (makers.append(threading.current_thread().name), make(nbytes, pinned))[1]
    ck.reserve(state(0), background=True)
    for step in range(1, 9):  # the disk takes nothing: the flusher holds the first checkpoint throughout
        ck.save(state(step), step)
        ck.wait(retention=True)
    assert ck._pool.allocations == len(makers) == 2 + 2 + 1, makers
    assert set(makers) == {"ckpt-reserve"}, makers  # none on the training thread
    disk.gate.set()
    ck.close(timeout=30)
    with Checkpointer(str(tmp_path / "disk"), readonly=True) as flushed:
        assert digest(flushed.load()) == digest(state(8))

    footprint = (1 << 16) * 4 + 4096  # one part with its page padding: room for 3 checkpoints, not 5
    tight = Checkpointer(levels=[{"kind": "memory", "path": str(tmp_path / "mem2"), "job": "j", "budget": 3 * footprint},
                                 str(tmp_path / "disk2")], keep_last=2)
    tight.reserve(state(0))
    assert tight._pool.allocations == 3
    tight.close()


@pytest.mark.parametrize("writable", [True, False])
def test_mapping_a_memory_levels_file_lets_the_training_thread_run(tmp_path, writable):
    """A memory level's buffer (reserved in the background beside training) and a flush's read-only map
    fill their page tables at once, and off the GIL: Python's own ``mmap.mmap(..., MAP_POPULATE)`` held
    every other thread for the whole call (176 MiB of tmpfs: 76-95 ms per buffer). The training thread
    keeps running meanwhile, and the pages are there (a first write faults no more)."""
    import threading
    import time

    from ckpt_engine.host.hugepages import map_file

    path, nbytes = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path), 256 << 20
    fd = os.open(os.path.join(path, f"ckpt-gil-{os.getpid()}-{writable}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.unlink(os.path.join(path, f"ckpt-gil-{os.getpid()}-{writable}"))
    window, ticks, maps = [], [], []
    try:
        os.posix_fallocate(fd, 0, nbytes)

        def make():
            window.append(time.perf_counter())
            maps.append(map_file(fd, nbytes, writable))
            window.append(time.perf_counter())

        thread = threading.Thread(target=make)
        thread.start()
        while thread.is_alive():
            ticks.append(time.perf_counter())
        thread.join()
        inside = [t for t in ticks if window[0] < t < window[1]]
        gaps = [b - a for a, b in zip([window[0], *inside], [*inside, window[1]])]
        # held, the main thread stands still for nearly the whole call; free, only for scheduling slices
        assert max(gaps) < 0.5 * (window[1] - window[0]), \
            f"the main thread stood still {1e3 * max(gaps):.1f} ms of {1e3 * (window[1] - window[0]):.1f} ms of mapping"
        assert len(maps[0]) == nbytes and maps[0][nbytes - 1] == 0
        if writable:
            maps[0][:4] = b"abcd"
            assert os.pread(fd, 4, 0) == b"abcd"  # shared with the file
    finally:
        for m in maps:
            m.close()
        os.close(fd)
