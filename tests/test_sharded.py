"""Sharded state end to end: real gloo ranks with FSDP2, HSDP, FSDP2 + tensor parallel and DDP.

Each layout trains a small model (uneven shards) with AdamW, saves its sharded state with the core,
and loads it back into a fresh model of the same or another layout and world size
(``restore(into=...)`` + ``set_state_dict``), or into one process without torch.distributed. The
whole state (weights and ``exp_avg``, ``exp_avg_sq``, ``step``) must come back bit for bit, and on the
same layout two more training steps must give the same bits as the uninterrupted run.

At 4 and 8 ranks (FSDP2, HSDP 2 x 2 and 2 x 4, tensor parallel + FSDP2 2 x 2) a job that trains as a
user's does (sampler, dropout, clipping, schedule) is SIGKILLed mid-training and resumed: every
rank ends with the uninterrupted job's chunks, bit for bit, having seen the same samples.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from ckpt_engine import Checkpointer
from ckpt_engine.errors import CorruptionError
from helpers import assert_same, assert_same_samples_once_per_epoch
import forkserver
from ranks import lines_of, next_line, start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                 reason="torch.distributed with gloo is not available")]

WORKER = os.path.join(os.path.dirname(__file__), "sharded_worker.py")
WORLD = {"fsdp": 2, "hsdp": 4, "fsdp_tp": 4, "ddp": 2}
ENV = {"OMP_NUM_THREADS": "1"}


def run(world: int, *args: str) -> None:
    if world == 1 and args[1] == "single":
        procs = [forkserver.launch([sys.executable, WORKER, *args])]
    else:
        procs = start_ranks(world, list(args), ENV, worker=WORKER)
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-4000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per layout, its checkpoint and the whole state at the step saved and two steps later."""
    cache: dict[str, tuple[str, str]] = {}

    def get(layout: str) -> tuple[str, str]:
        if layout not in cache:
            base = tmp_path_factory.mktemp(layout)
            (base / "out").mkdir()
            run(WORLD[layout], "save", layout, str(base / "ck"), str(base / "out"), "3")
            cache[layout] = (str(base / "ck"), str(base / "out"))
        return cache[layout]

    return get


def full(path: str):
    return torch.load(path, weights_only=True)


def load_into(tmp_path, ck: str, layout: str, world: int) -> str:
    out = tmp_path / f"load-{layout}-{world}"
    out.mkdir()
    run(world, "load", layout, ck, str(out))
    return str(out)


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "fsdp_tp"])
def test_same_layout_resumes_bit_identically(saved, tmp_path, layout):
    ck, ref = saved(layout)
    out = load_into(tmp_path, ck, layout, WORLD[layout])
    assert_same(full(f"{out}/loaded.pt"), full(f"{ref}/full.pt"))
    assert_same(full(f"{out}/loaded_after.pt"), full(f"{ref}/after.pt"))


@pytest.mark.parametrize("source, layout, world", [
    ("fsdp", "fsdp", 4),      # x2
    ("fsdp", "fsdp", 1),      # x1/2, still under torch.distributed
    ("fsdp", "single", 1),    # one process, no torch.distributed
    ("hsdp", "fsdp", 2),
    ("hsdp", "single", 1),
    ("fsdp_tp", "fsdp", 2),
    ("fsdp_tp", "single", 1),
    ("ddp", "fsdp", 2),       # DDP -> FSDP2
    ("fsdp", "ddp", 2),       # FSDP2 -> DDP
    pytest.param("ddp", "fsdp_tp", 4, marks=pytest.mark.slow),
    pytest.param("hsdp", "fsdp_tp", 4, marks=pytest.mark.slow),
    pytest.param("fsdp", "fsdp", 3, marks=pytest.mark.slow),
])
def test_state_is_identical_on_any_layout_and_world_size(saved, tmp_path, source, layout, world):
    ck, ref = saved(source)
    out = load_into(tmp_path, ck, layout, world)
    assert_same(full(f"{out}/loaded.pt"), full(f"{ref}/full.pt"))


def test_one_process_load_returns_whole_plain_tensors(saved):
    ck, ref = saved("fsdp_tp")
    state = Checkpointer(ck, readonly=True).load()
    assert_same(state, full(f"{ref}/full.pt"))
    assert all(type(t) is torch.Tensor for t in state["model"].values())


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_replicated_chunks_are_written_once_split_among_their_replicas(saved, layout):
    """HSDP's replicate dimension and what tensor parallel keeps whole hold the same chunk on several
    ranks: it is stored once, its bytes split among them, so every rank writes about a quarter."""
    ck, _ = saved(layout)
    reader = Checkpointer(ck, readonly=True)
    state = reader.load()
    m, indexes = reader._loaded.manifest, reader._loaded.opened.indexes
    stored = sum(e.nbytes for idx in indexes for e in idx.entries if not e.local)
    assert stored == sum(t.nbytes for t in m.tensors)  # each element once
    sharded = [i for i, t in enumerate(m.tensors) if t.sharding is not None]
    assert sharded and all(m.tensors[i].sharding.mesh in ((2, 2), (2,)) for i in sharded)
    per_rank = [sum(e.nbytes for e in idx.entries if not e.local and e.box is not None) for idx in indexes]
    total = sum(per_rank)
    assert all(0.15 * total <= b <= 0.35 * total for b in per_rank), per_rank
    assert state["model"]["3.weight"].shape == (6,)


def test_a_flipped_byte_in_a_shard_is_named_on_load(saved, tmp_path):
    ck, _ = saved("fsdp")
    copy = tmp_path / "ck"
    shutil.copytree(ck, copy)
    reader = Checkpointer(str(copy), readonly=True)
    reader.load()
    opened = reader._loaded.opened
    idx = opened.indexes[1]
    victim = next(e for e in idx.entries if e.box is not None and e.nbytes >= 4)
    name = opened.manifest.tensors[victim.tensor].name
    path = copy / opened.dirname / "rank-00001.bin"
    with open(path, "r+b") as f:
        f.seek(victim.offset + 1)
        byte = f.read(1)
        f.seek(victim.offset + 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptionError) as err:
        Checkpointer(str(copy), readonly=True).load()
    msg = str(err.value)
    assert "rank-00001.bin" in msg and name in msg and "of chunk" in msg, msg


def test_a_crash_at_any_instant_of_a_sharded_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    """SIGKILL the whole FSDP2 job at random instants while it saves every step: the newest
    committed checkpoint always loads and verifies, and the job resumes from it."""
    root = str(tmp_path / "ck")
    rng = random.Random(16)
    newest = 0
    for round_ in range(3):
        procs = start_ranks(2, ["loop", "fsdp", root, str(tmp_path)], ENV, worker=WORKER)
        try:
            q = lines_of(procs[0])
            if newest:
                assert next_line(q, "resumed", time.monotonic() + 120) == f"resumed {newest}"
            next_line(q, f"saved {newest + 2}", time.monotonic() + 120)
            # ``saved N`` is printed when save() returns, before the commit (asynchronous): wait until a
            # newer checkpoint is committed, then kill at a random instant of the saves that go on
            # (under the whole suite's load, 0.4 s after "saved 2" had once seen nothing committed yet)
            deadline = time.monotonic() + 120
            while not [s for s in Checkpointer(root, readonly=True).steps() if s >= max(newest, 1)]:
                assert time.monotonic() < deadline, f"round {round_}: nothing newer than {newest} committed"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.4))
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            for p in procs:
                p.wait()
        reader = Checkpointer(root, readonly=True)
        steps = reader.steps()
        assert steps and steps[-1] >= max(newest, 1), f"round {round_}: {steps}"
        state = reader.load()  # every byte verified
        assert set(state) == {"model", "optim"} and state["model"]["0.weight"].shape == (8, 13)
        newest = steps[-1]


def ckpt(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "ckpt_engine", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_cli_shows_placements_and_chunks_exports_whole_and_diffs_with_unsharded(saved, tmp_path):
    import json

    ck, ref = saved("hsdp")
    text = ckpt("inspect", ck, "--chunks", "-q")
    assert "sharded R, S(0) on mesh [2, 2] (replicate, shard): 2 chunks" in text
    assert "model.0.weight" in text and "0:4, 0:13  0,2" in text and "4:8, 0:13  1,3" in text
    doc = json.loads(ckpt("inspect", ck, "--json"))
    row = next(t for t in doc["state"]["tensors"] if t["key"] == "model.0.weight")
    assert row["chunks"] == [{"box": [[0, 4], [0, 13]], "ranks": [0, 2]}, {"box": [[4, 8], [0, 13]], "ranks": [1, 3]}]
    # export: one whole plain file, as torch.load reads it
    ckpt("export", ck, str(tmp_path / "whole.pt"), "-q")
    exported = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert_same({"model": exported["model"], "optim": exported["optim"]}, full(f"{ref}/full.pt"))
    # diff: the sharded checkpoint against the same state saved unsharded by one process
    plain = Checkpointer(str(tmp_path / "plain"))
    plain.save(full(f"{ref}/full.pt"), 3)
    plain.close()
    out = ckpt("diff", ck, str(tmp_path / "plain"))
    assert out.strip().endswith("identical"), out


def test_sharded_state_through_a_node_local_level_and_its_flush(tmp_path):
    """Level 1 node-local (each rank's own directory, restored by exchanging bytes between ranks),
    level 2 shared: the sharded state comes back identical from either."""
    root, out = tmp_path / "levels", tmp_path / "out"
    out.mkdir()
    levels = dict(ENV, SHARDED_LEVELS="1")
    for p in start_ranks(2, ["save", "fsdp", str(root), str(out)], levels, worker=WORKER):
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-4000:]
    ref = full(f"{out}/full.pt")
    for level in (0, 1):
        if level == 1:  # level 1 is gone (a new node): level 2 serves
            shutil.rmtree(root / "node0")
            shutil.rmtree(root / "node1")
        loaded = tmp_path / f"from-{level}"
        loaded.mkdir()
        for p in start_ranks(2, ["load", "fsdp", str(root), str(loaded)], levels, worker=WORKER):
            output, _ = p.communicate(timeout=300)
            assert p.returncode == 0, output[-4000:]
        assert (loaded / "level.txt").read_text() == str(level)
        assert_same(full(f"{loaded}/loaded.pt"), ref)
    assert_same(Checkpointer(str(root / "shared"), readonly=True).load(), ref)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_sharded_state_of_a_lost_node_comes_back_from_the_other_nodes_memory(tmp_path, layout):
    """2 simulated nodes x 2 ranks, a memory level: node 1's memory and the shared level deleted, the
    shards node 1's ranks wrote come back from node 0's replicas, bit for bit, and two more steps
    give the same bits as the uninterrupted run."""
    root, out = tmp_path / "levels", tmp_path / "out"
    out.mkdir()
    env = dict(ENV, SHARDED_LEVELS="memory")
    nodes = [{"CKPT_NODE": str(r // 2), "LOCAL_WORLD_SIZE": "2"} for r in range(4)]
    for p in start_ranks(4, ["save", layout, str(root), str(out)], env, worker=WORKER, rank_env=nodes):
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-4000:]
    shutil.rmtree(root / "mem" / "sharded" / "node-1")
    shutil.rmtree(root / "shared")
    loaded = tmp_path / "loaded"
    loaded.mkdir()
    for p in start_ranks(4, ["load", layout, str(root), str(loaded)], env, worker=WORKER, rank_env=nodes):
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-4000:]
    assert (loaded / "level.txt").read_text() == "0"
    assert_same(full(f"{loaded}/loaded.pt"), full(f"{out}/full.pt"))
    assert_same(full(f"{loaded}/loaded_after.pt"), full(f"{out}/after.pt"))


def test_each_rank_reads_only_the_pieces_its_chunks_need(saved, tmp_path):
    """Same layout: every rank reads exactly the extents of its own chunks' pieces and of the plain
    tensors. Twice the ranks: the first and last new chunks lie in one old rank's chunks, and are
    read from that rank's pieces alone; no rank reads the whole checkpoint."""
    import json

    from ckpt_engine.format.validate import extents

    ck, _ = saved("fsdp")
    reader = Checkpointer(ck, readonly=True)
    reader.load()
    indexes = reader._loaded.opened.indexes
    sizes = [dict(zip(idx.entries, extents(idx.entries, idx.data_bytes))) for idx in indexes]
    plain = sum(end - e.offset for idx, ends in zip(indexes, sizes) for e, end in ends.items()
                if not e.local and e.box is None)
    own = [plain + sum(end - e.offset for e, end in sizes[r].items() if e.box is not None) for r in range(2)]
    total = sum(idx.data_bytes for idx in indexes)
    for world in (2, 4):
        out = tmp_path / f"count-{world}"
        out.mkdir()
        for p in start_ranks(world, ["load", "fsdp", ck, str(out)], dict(ENV, SHARDED_COUNT="1"), worker=WORKER):
            output, _ = p.communicate(timeout=300)
            assert p.returncode == 0, output[-4000:]
        read = [json.loads((out / f"read-{r}.json").read_text())["read"] for r in range(world)]
        if world == 2:
            assert read == own, (read, own)
        else:
            assert read[0] <= own[0] and read[3] <= own[1] and max(read) < total, (read, own, total)


TRAINED = {4: ("fsdp", "hsdp:2x2", "fsdp_tp:2x2"), 8: ("hsdp:2x4",)}
"""The layouts trained side by side in one job of each world size (one start-up for all)."""
STEPS, EVERY, KILL_AT, SAMPLES = 16, 5, 8, 64  # 2 to 8 steps per epoch: the restored step 5 is mid-epoch


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per world size: the directories of its layouts' uninterrupted job and of the job SIGKILLed on
    every rank right after step 8 (checkpoints at 5: committed; 10: not reached) and then resumed by
    the same command."""
    cache: dict[int, tuple] = {}

    def get(world: int):
        if world not in cache:
            base = tmp_path_factory.mktemp(f"trained-{world}")
            layouts, every = ",".join(TRAINED[world]), (str(STEPS), str(EVERY))
            for out in (base / "ref", base / "run"):
                out.mkdir()
            run(world, "train", layouts, str(base / "ref" / "ck"), str(base / "ref"), *every)
            killed = start_ranks(world, ["train", layouts, str(base / "run" / "ck"), str(base / "run"), *every,
                                         str(KILL_AT)], ENV, worker=WORKER)
            for p in killed:
                output, _ = p.communicate(timeout=300)
                assert p.returncode == -signal.SIGKILL, output[-4000:]
            run(world, "train", layouts, str(base / "run" / "ck"), str(base / "run"), *every)
            cache[world] = base / "ref", base / "run"
        return cache[world]

    return get


def seen_rows(out, layout: str, rank: int) -> list[dict]:
    import json

    with open(out / f"seen-{layout.replace(':', '-')}-rank{rank}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("world, layout", [(4, "fsdp"), (4, "hsdp:2x2"), (4, "fsdp_tp:2x2"), (8, "hsdp:2x4")])
def test_killed_mid_training_then_resumed_ends_bit_identical_on_every_rank(trained, world, layout):
    """Every rank's chunks of the weights and of AdamW's state, the schedule, its torch RNG (dropout) and
    the samples it trained on at each step are the uninterrupted job's; each epoch saw every sample
    once."""
    ref, got = trained(world)
    name = layout.replace(":", "-")
    by_step: list[tuple[dict, dict]] = []
    for rank in range(world):
        a = torch.load(ref / f"final-{name}-rank{rank}.pt", weights_only=True)
        b = torch.load(got / f"final-{name}-rank{rank}.pt", weights_only=True)
        assert (a["resumed_from"], b["resumed_from"], b["step"]) == (None, 5, STEPS)
        assert_same((b["state"], b["rng"]), (a["state"], a["rng"]), f"rank {rank}")
        rows = seen_rows(got, layout, rank)  # the killed job's steps 1..8, then the resumed job's 6..16
        assert [r["step"] for r in rows[:KILL_AT]] == list(range(1, KILL_AT + 1))
        resumed = rows[:5] + rows[KILL_AT:]
        by_step.append(({r["step"]: r for r in resumed}, {r["step"]: r for r in seen_rows(ref, layout, rank)}))
    tp = 2 if layout.startswith("fsdp_tp") else 1  # tensor parallel ranks of one data-parallel index
    for rank in range(world):
        assert by_step[rank][1] == by_step[rank - rank % tp][1], rank
    data_ranks = by_step[::tp]
    epochs = sorted({r["epoch"] for mine, _ in data_ranks for r in mine.values()})
    assert_same_samples_once_per_epoch([m for m, _ in data_ranks], [t for _, t in data_ranks], STEPS, epochs, SAMPLES)
