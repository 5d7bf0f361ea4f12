"""The Horovod front end: the in-place resumable sampler (in process), then real ``horovodrun``
jobs (gloo, CPU ranks on this machine).

The example script (``examples/horovod_train.py``) is the job: 128 samples, 2 ranks x 8 per batch,
so 8 steps per epoch and 32 steps in 4 epochs. Each rank logs the sample ids of every step.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckpt_engine import Checkpointer
from ckpt_engine.config import ConfigError
from ckpt_engine.training.resumable import InPlaceResumable, make_resumable
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
from helpers import assert_same, assert_same_samples_once_per_epoch
from ranks import descendants, kill_tree

try:
    importlib.import_module("horovod.torch")  # installed and built against this torch

    HAVE_HOROVOD = True
except ImportError:
    HAVE_HOROVOD = False

needs_horovod = pytest.mark.skipif(not HAVE_HOROVOD,
                                   reason="horovod is not installed (bash scripts/install_horovod.sh)")


def job(test):
    """A test that runs real ``horovodrun`` jobs: integration, and slow (leave out with ``-m "not slow"``)."""
    return pytest.mark.slow(pytest.mark.integration(test))


ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "horovod_train.py"
WORKER = ROOT / "tests" / "horovod_worker.py"
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
STEPS_PER_EPOCH, EPOCHS, SAMPLES = 8, 4, 128


# ---- launching and killing jobs -------------------------------------------------------------------

def launch(np: int, script: Path, *args: str, elastic_dir: Path | None = None) -> subprocess.Popen:
    """``horovodrun -np N`` in a new session; its output goes to a file next to nothing else."""
    cmd = [str(HOROVODRUN), "-np", str(np)]
    if elastic_dir is not None:
        discover = elastic_dir / "discover.sh"
        discover.write_text(f"#!/bin/sh\necho localhost:{np}\n")
        discover.chmod(0o755)
        # one host: without --network-interface, elastic waits for a second host to compare NICs
        cmd += ["--min-np", "1", "--max-np", str(np), "--host-discovery-script", str(discover),
                "--network-interface", "lo"]
    else:
        cmd += ["-H", f"localhost:{np}", "--gloo"]
    cmd += [sys.executable, str(script), *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 150, expect_rc: int | None = 0) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"job did not finish in {timeout} s:\n{out[-4000:]}")
    if expect_rc is not None:
        assert proc.returncode == expect_rc, out[-4000:]
    return out


def run(np: int, script: Path, *args: str, **kw) -> str:
    return finish(launch(np, script, *args, elastic_dir=kw.pop("elastic_dir", None)), **kw)


def rank_pid(proc: subprocess.Popen, rank: int) -> int:
    for pid in descendants(proc.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if f"HOROVOD_RANK={rank}".encode() in env and b"python" in cmd and b"/bin/sh" not in cmd:
            return pid
    raise AssertionError(f"no process of rank {rank}")


def wait_until(cond, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"job ended before the condition held:\n{proc.communicate()[0][-4000:]}")
        if time.monotonic() > deadline:
            kill_tree(proc)
            pytest.fail("condition not reached in time")
        time.sleep(0.05)


# ---- reading what the jobs left ---------------------------------------------------------------------

def steps_logged(log_dir: Path, rank: int = 0) -> dict[int, dict]:
    """step -> {epoch, ids} of one rank; a later line for the same step (a resumed run redoing
    a step the killed run had done) replaces the earlier one; a torn last line is ignored."""
    out: dict[int, dict] = {}
    path = log_dir / f"rank-{rank}.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[row["step"]] = row
    return out


def committed_steps(ck_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in ck_dir.glob("step-*/manifest.json"))


def read_checkpoint(ck_dir: Path, step: int | None = None) -> tuple[dict, object]:
    """The replicated state and the manifest, read in this (single) process."""
    with Checkpointer(str(ck_dir)) as ck:
        return ck.load(step), ck.loaded_manifest


def load_final(out_dir: Path, rank: int) -> dict:
    return torch.load(out_dir / f"final-rank{rank}.pt", weights_only=False)


# ---- the sampler, resumable in place ------------------------------------------------------------

def _epoch(sampler, steps: int | None = None, bs: int = 4, workers: int = 0) -> list[int]:
    """Iterate a DataLoader over the sampler as a training loop does, noting each step."""
    seen: list[int] = []
    loader = DataLoader(list(range(1000)), batch_size=bs, sampler=sampler, drop_last=True, num_workers=workers)
    for i, batch in enumerate(loader):
        if steps is not None and i == steps:
            break  # the loader has already taken the next batch's indices: they are not consumed
        seen += batch.tolist()
        sampler.note_step()
    return seen


def test_make_resumable_changes_the_samplers_behaviour_not_its_identity():
    data = list(range(96))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    assert make_resumable(sampler) is sampler and make_resumable(sampler) is sampler
    assert loader.sampler is sampler and isinstance(sampler, (DistributedSampler, InPlaceResumable))
    assert type(sampler).__name__ == "ResumableDistributedSampler" and len(sampler) == 48
    plain = DistributedSampler(data, num_replicas=2, rank=1, seed=3)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        plain.set_epoch(epoch)
        assert [int(i) for b in loader for i in b] == list(plain)
    copied = pickle.loads(pickle.dumps(sampler))  # the swapped class is rebuilt, not imported
    assert type(copied) is type(sampler) and list(copied) == list(sampler)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_rest_of_an_interrupted_epoch_is_re_split_across_any_number_of_ranks(world, workers):
    data = list(range(96))
    seen, positions = [], []
    for rank in (0, 1):  # 2 ranks, 5 steps of 4 into epoch 1
        s = make_resumable(DistributedSampler(data, num_replicas=2, rank=rank, seed=7))
        s.set_epoch(1)
        seen += _epoch(s, steps=5, workers=workers)
        positions.append(s.data_position())
    assert positions[0] == positions[1] and positions[0]["done"] == 40 and positions[0]["batch_size"] == 4
    rest = []
    for rank in range(world):
        s = make_resumable(DistributedSampler(data, num_replicas=world, rank=rank, seed=7))
        assert s.resume_at(positions[0]) == (1, 40)
        s.set_epoch(1)
        mine = list(s)
        if world == 2:  # the same ranks: exactly the uninterrupted order
            plain = DistributedSampler(data, num_replicas=2, rank=rank, seed=7)
            plain.set_epoch(1)
            assert mine == list(plain)[20:]
        rest += mine
    # each unseen sample once, plus the padding a DistributedSampler adds to make the shares equal
    pad = -(96 - 40) % world
    assert set(seen + rest) == set(data) and len(seen) + len(rest) == 96 + pad


def test_an_epoch_that_ended_resumes_at_the_next_one():
    data = list(range(96))
    s = make_resumable(DistributedSampler(data, num_replicas=2, rank=0, seed=7))
    s.set_epoch(2)
    _epoch(s)
    pos = s.data_position()
    assert pos["complete"] and pos["done"] == 96
    fresh = make_resumable(DistributedSampler(data, num_replicas=2, rank=0, seed=7))
    assert fresh.resume_at(pos) == (3, 0) and fresh.epoch == 3


def test_any_other_sampler_skips_what_this_rank_consumed_and_replays_its_seed_draw():
    data = list(range(60))
    torch.manual_seed(11)
    uninterrupted = _epoch(make_resumable(RandomSampler(data)))  # draws its seed from the global RNG
    torch.manual_seed(11)
    s = make_resumable(RandomSampler(data))
    assert _epoch(s, steps=4) == uninterrupted[:16]
    pos = s.data_position()
    assert (pos["mode"], pos["done"], pos["complete"]) == ("rank", 16, False)
    torch.manual_seed(999)  # another process, another RNG state
    r = make_resumable(RandomSampler(data))
    started = []
    assert r.resume_at(pos, on_start=lambda: started.append(True)) == (0, 16)
    before = torch.get_rng_state()
    assert list(r) == uninterrupted[16:] and started == [True]
    assert torch.equal(torch.get_rng_state(), before)  # the replayed draw left the caller's RNG alone


# ---- jobs under horovodrun ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The example, 2 ranks, 4 epochs, a checkpoint every 5 steps, never interrupted."""
    d = tmp_path_factory.mktemp("hvd-ref")
    (d / "log").mkdir()
    out = run(2, EXAMPLE, "--ckpt-dir", str(d / "ck"), "--every", "5", "--sample-log", str(d / "log"),
              "--out", str(d / "out"))
    assert "fresh start" in out and f"done at step {STEPS_PER_EPOCH * EPOCHS}" in out, out
    return d


@needs_horovod
@job
def test_both_ranks_write_their_slices_and_the_manifest_records_them(uninterrupted):
    ck_dir = uninterrupted / "ck"
    assert committed_steps(ck_dir) == [25, 30, 32]  # keep_last=3 (the default); 32: close()'s final one
    state, manifest = read_checkpoint(ck_dir)
    assert manifest.world_size == 2 and manifest.step == 32
    assert [r.rank for r in manifest.ranks] == [0, 1]
    step_dir = next(ck_dir.glob("step-000000000032-*"))
    for r in manifest.ranks:
        assert (step_dir / f"rank-{r.rank:05d}.bin").stat().st_size == r.data_bytes > 0
        index = json.loads((step_dir / f"rank-{r.rank:05d}.index.json").read_text())
        assert index["rank"] == r.rank and index["entries"]
        assert any(e[0] == 0 for e in index["entries"]), f"rank {r.rank} holds slices of the replicated state"
    assert any(t.owner == -1 for t in manifest.tensors), "large tensors are split across both ranks"
    final = load_final(uninterrupted / "out", 0)
    params = {k: v for k, v in final["model"].items() if "running" not in k and "num_batches" not in k}
    assert_same(state["objects"]["model"], params)
    figures = [json.loads(line) for line in (ck_dir / "figures.jsonl").read_text().splitlines()]
    assert [f["step"] for f in figures] == [5, 10, 15, 20, 25, 30, 32]
    assert all(f["committed"] and f["stall_ms"] > 0 for f in figures)


@needs_horovod
@job
def test_sigkill_of_the_whole_job_then_horovodrun_again_is_bitwise_exact(uninterrupted, tmp_path):
    (tmp_path / "log").mkdir()
    args = ["--ckpt-dir", str(tmp_path / "ck"), "--every", "5", "--sample-log", str(tmp_path / "log"),
            "--out", str(tmp_path / "out")]
    job = launch(2, EXAMPLE, *args, "--step-delay", "0.1")
    # Mid-epoch 2 (steps 17..24), after the checkpoints of steps 15 and 20 had the time to commit.
    wait_until(lambda: max(steps_logged(tmp_path / "log"), default=0) >= 21 and 20 in committed_steps(tmp_path / "ck"),
               job)
    kill_tree(job)
    killed_at = max(steps_logged(tmp_path / "log"))
    assert killed_at < STEPS_PER_EPOCH * EPOCHS and not (tmp_path / "out").exists()
    resumed_from = max(committed_steps(tmp_path / "ck"))
    assert resumed_from % STEPS_PER_EPOCH != 0, "the test wants a mid-epoch resume"

    out = run(2, EXAMPLE, *args)
    assert f"resumed from step {resumed_from}, epoch {resumed_from // STEPS_PER_EPOCH}" in out, out
    for rank in (0, 1):
        assert_same(load_final(tmp_path / "out", rank), load_final(uninterrupted / "out", rank))
    assert_same_samples_once_per_epoch([steps_logged(tmp_path / "log", r) for r in (0, 1)],
                                       [steps_logged(uninterrupted / "log", r) for r in (0, 1)],
                                       STEPS_PER_EPOCH * EPOCHS, list(range(EPOCHS)), SAMPLES)


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    """10 steps on 2 ranks (epoch 1, 2 of its 8 batches done), flags from a YAML file."""
    d = tmp_path_factory.mktemp("hvd-10")
    (d / "log").mkdir()
    config = d / "ckpt.yaml"
    config.write_text(f"dirpath: {d / 'ck'}\nevery_n_train_steps: 5\nkeep_last: 2\n")
    out = run(2, EXAMPLE, "--ckpt-config", str(config), "--max-steps", "10", "--sample-log", str(d / "log"),
              "--out", str(d / "out"))
    assert "done at step 10" in out
    return d


@needs_horovod
@job
def test_valid_yaml_config_drives_the_hook(two_rank_checkpoint):
    assert committed_steps(two_rank_checkpoint / "ck") == [5, 10]


@pytest.fixture(scope="module")
def restored(two_rank_checkpoint, tmp_path_factory):
    """The 2-rank checkpoint restored by 1 rank, then by 3 ranks in one ``horovodrun`` three times:
    by the auto route, by the exchange route, and from a copy whose rank 1 section of step 10 is
    damaged. Returns the directory of what each rank dumped, ``NAME-rank{r}-of{n}.pt``."""
    from helpers import flip_local

    out = tmp_path_factory.mktemp("hvd-restored")
    intact = two_rank_checkpoint / "ck"
    damaged = shutil.copytree(intact, out / "damaged")
    flip_local(str(damaged), sorted(p for p in os.listdir(damaged) if p.startswith("step-000000000010"))[-1], 1)
    run(1, WORKER, "restore", "--case", f"auto:auto:{intact}", "--out", str(out))
    run(3, WORKER, "restore", "--case", f"auto:auto:{intact}", "--case", f"exchange:exchange:{intact}",
        "--case", f"damaged:auto:{damaged}", "--out", str(out))
    return out


def restored_state(out: Path, name: str, rank: int, np: int) -> dict:
    got = torch.load(out / f"{name}-rank{rank}-of{np}.pt", weights_only=False)
    assert "error" not in got, f"rank {rank} of {np}, case {name}: {got.get('error')}"
    return got


@needs_horovod
@job
@pytest.mark.parametrize("np, route", [(1, "auto"), (3, "auto"), (3, "exchange")])
def test_restore_a_two_rank_checkpoint_on_another_number_of_ranks(two_rank_checkpoint, restored, np, route):
    """``exchange``: each rank reads a share, Horovod's broadcast brings the rest (load/exchange.py)."""
    d = two_rank_checkpoint
    written = [load_final(d / "out", r) for r in (0, 1)]
    seen = {i for r in (0, 1) for row in steps_logged(d / "log", r).values() if row["epoch"] == 1 for i in row["ids"]}
    assert len(seen) == 2 * 2 * 8  # 2 steps of epoch 1 on 2 ranks
    rest: list[int] = []
    for rank in range(np):
        got = restored_state(restored, route, rank, np)
        assert (got["step"], got["epoch"], got["samples_in_epoch"], got["world"]) == (10, 1, 32, np)
        assert (got["received"] > 0) == (route == "exchange")
        writer = written[rank] if rank < 2 else written[0]  # per-rank buffers: own writer's, else rank 0's
        assert_same(got["model"], writer["model"])
        assert_same(got["optimizer"], written[0]["optimizer"])
        assert_same(got["scheduler"], written[0]["scheduler"])
        rest += got["rest"]
    # The unseen rest of the interrupted epoch, re-split across the new ranks: each sample once.
    assert sorted(rest) == sorted(set(range(SAMPLES)) - seen)


def test_invalid_yaml_config_fails_naming_the_key(tmp_path):
    from horovod_ckpt import HorovodCheckpointer

    model = torch.nn.Linear(2, 2)
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"dirpath: {tmp_path}\nevery_n_step: 5\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'every_n_step'.*known keys: .*every_n_train_steps"):
        HorovodCheckpointer(model=model, config=str(bad))
    bad.write_text(f"dirpath: {tmp_path}\nevery_n_train_steps: -3\n")
    with pytest.raises(ConfigError, match=r"every_n_train_steps=-3 is invalid"):
        HorovodCheckpointer(model=model, config=str(bad))
    bad.write_text(f"dirpath: {tmp_path}\nevery_n_train_steps: 5\noverhead_budget: 0.03\n")
    with pytest.raises(ConfigError, match="mutually exclusive"):
        HorovodCheckpointer(model=model, config=str(bad))


@needs_horovod
@job
@pytest.mark.parametrize("target", ["one-rank", "launcher"])
def test_sigterm_takes_a_final_checkpoint_at_the_same_step_on_every_rank(tmp_path, target):
    (tmp_path / "log").mkdir()
    job = launch(2, EXAMPLE, "--ckpt-dir", str(tmp_path / "ck"), "--every", "1000", "--step-delay", "0.1",
                 "--sample-log", str(tmp_path / "log"))
    wait_until(lambda: max(steps_logged(tmp_path / "log", 1), default=0) >= 6, job)
    # A scheduler may signal a single rank; horovodrun passes its own SIGTERM on to every rank.
    os.kill(rank_pid(job, 1) if target == "one-rank" else job.pid, signal.SIGTERM)
    out = finish(job, timeout=60, expect_rc=None)
    # A signalled rank ends the job with an error; horovodrun itself, once it has passed its SIGTERM on,
    # exits 0 or not depending on which of its children it sees end first (racy: 0 seen once under
    # load), so the launcher's own status is not the job's: only the checkpoint below is.
    assert job.returncode != 0 or target == "launcher", out
    steps = committed_steps(tmp_path / "ck")
    assert len(steps) == 1 and 6 <= steps[0] < STEPS_PER_EPOCH * EPOCHS, out
    state, manifest = read_checkpoint(tmp_path / "ck")
    assert state["step"] == steps[0] and manifest.world_size == 2
    for rank in (0, 1):  # each rank stopped right at the checkpoint's step
        assert max(steps_logged(tmp_path / "log", rank)) in (steps[0] - 1, steps[0])


@pytest.fixture(scope="module")
def elastic_reference(tmp_path_factory):
    """The elastic job of both tests below, 3 epochs of 4 batches on 2 ranks, never interrupted: its
    final weights are where an interrupted job must end, whichever levels it checkpoints to."""
    ref = tmp_path_factory.mktemp("hvd-elastic-ref")
    run(2, WORKER, "elastic", "--ckpt-dir", str(ref / "ck"), "--epochs", "3", "--batches", "4", "--out", str(ref),
        elastic_dir=ref)
    return ref


@needs_horovod
@job
def test_elastic_job_with_a_memory_level_resumes_from_memory_when_the_disk_is_lost(elastic_reference, tmp_path):
    """``DurableTorchState(levels=[memory, disk])`` under ``hvd.elastic.run``: every process SIGKILLed,
    the disk level deleted; the restarted job finds its checkpoints in the node's memory, resumes from
    the newest, and ends where the uninterrupted job ended, bit for bit; its clean end frees the memory."""
    mem = tmp_path / "mem"
    args = ["elastic", "--ckpt-dir", str(tmp_path / "ck"), "--epochs", "3", "--batches", "4", "--memory", str(mem)]
    ref = elastic_reference

    def in_memory() -> list[int]:  # steps both ranks committed in memory
        steps = [{int(p.parent.name.split("-")[1]) for p in mem.glob(f"elastic/node-*/rank-0000{r}/step-*/rank-commit.json")}
                 for r in (0, 1)]
        return sorted(steps[0] & steps[1])

    job = launch(2, WORKER, *args, "--out", str(tmp_path / "a"), "--step-delay", "0.2", elastic_dir=tmp_path)
    wait_until(lambda: in_memory() and max(in_memory()) >= 6, job)
    kill_tree(job)
    newest = max(in_memory())
    shutil.rmtree(tmp_path / "ck")  # only the node's memory holds checkpoints now

    out = run(2, WORKER, *args, "--out", str(tmp_path / "b"), elastic_dir=tmp_path)
    starts = [json.loads(line.split(":", 1)[1]) for line in out.splitlines() if '{"start"' in line]
    assert starts and all(s["start"] >= newest for s in starts), out  # the newest any rank committed, or later
    for rank in (0, 1):
        assert_same(torch.load(tmp_path / "b" / f"final-rank{rank}.pt", weights_only=False),
                    torch.load(ref / f"final-rank{rank}.pt", weights_only=False))
    assert not list(mem.glob("elastic/node-*/rank-*/step-*"))  # released at the clean end


@needs_horovod
@job
def test_elastic_job_commits_durably_and_resumes_after_a_restart(elastic_reference, tmp_path):
    args = ["elastic", "--ckpt-dir", str(tmp_path / "ck"), "--epochs", "3", "--batches", "4"]
    ref = elastic_reference

    job = launch(2, WORKER, *args, "--out", str(tmp_path / "a"), "--step-delay", "0.2", elastic_dir=tmp_path)
    wait_until(lambda: committed_steps(tmp_path / "ck") and max(committed_steps(tmp_path / "ck")) >= 6, job)
    kill_tree(job)
    latest = max(committed_steps(tmp_path / "ck"))
    durable, _ = read_checkpoint(tmp_path / "ck", latest)

    out = run(2, WORKER, *args, "--out", str(tmp_path / "b"), elastic_dir=tmp_path)
    starts = [json.loads(line.split(":", 1)[1]) for line in out.splitlines() if '{"start"' in line]
    assert starts and all(s["start"] == latest for s in starts), out
    assert all((s["epoch"], s["batch"]) == (durable["attrs"]["epoch"], durable["attrs"]["batch"]) for s in starts)
    start = torch.load(tmp_path / "b" / "start-rank0.pt", weights_only=False)
    assert_same(start["model"], durable["objects"]["model"])
    for rank in (0, 1):  # continuing from the durable commit ends where the uninterrupted job ended
        assert_same(torch.load(tmp_path / "b" / f"final-rank{rank}.pt", weights_only=False),
                    torch.load(ref / f"final-rank{rank}.pt", weights_only=False))


# ---- issue #13: where real users' scripts break ------------------------------------------------------

def rank_output(out: str, rank: int) -> str:
    """What rank ``rank`` printed (horovodrun prefixes each line with ``[rank]<stdout|stderr>:``)."""
    prefixes = (f"[{rank}]<stdout>:", f"[{rank}]<stderr>:")
    return "\n".join(line for line in out.splitlines() if line.startswith(prefixes))


@needs_horovod
@job
def test_another_np_warns_of_the_restored_learning_rate_or_keeps_the_scripts(tmp_path):
    """Item 7: the lr is scaled by hvd.size(); -np 2 -> 3 restores the 2-rank rate with a warning naming
    both, or keeps the script's with optimizer_hparams="script"; the optimizer state is restored either way.
    #44: resumed on 3 ranks with Horovod's tensor fusion on, rank 0 alone warns that the run will not be
    bit-identical, naming the key that makes it so."""
    args = ["hparams", "--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path)]
    run(2, WORKER, *args, "--phase", "save")
    restored = launch(3, WORKER, *args, "--phase", "restore", "--modes", "checkpoint,script")
    out = finish(restored, expect_rc=None)
    said = "lr: restored 0.02 (saved by 2 ranks), script 0.03 (3 ranks)"
    assert said in rank_output(out, 0) and out.count(said) == 1, out[-4000:]
    inexact = "resumed on 3 ranks with Horovod's tensor fusion on"
    assert inexact in rank_output(out, 0) and out.count(inexact) == 1, out[-4000:]
    assert "`deterministic_reduction: true`" in rank_output(out, 0), out[-4000:]
    assert "optimizer_hparams='script'" in out and restored.returncode == 0, out[-4000:]
    saved = torch.load(tmp_path / "saved-rank0.pt", weights_only=False)
    assert saved["param_groups"][0]["lr"] == 0.02 and "exp_avg" in saved["state"][0]
    for rank in range(3):
        kept = torch.load(tmp_path / f"checkpoint-rank{rank}-of3.pt", weights_only=False)
        script = torch.load(tmp_path / f"script-rank{rank}-of3.pt", weights_only=False)
        assert kept["lr"] == [0.02] and script["lr"] == [0.03]
        assert_same(kept["state"], saved["state"])
        assert_same(script["state"], saved["state"])  # exp_avg, exp_avg_sq, step: the checkpoint's


def _sgd_job(lr: float, weight_decay: float):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    return model, optimizer, torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=10)


def _steps(model, optimizer, scheduler, n: int, ck=None) -> None:
    for _ in range(n):
        optimizer.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        if ck is not None:
            ck.after_step()


def test_optimizer_hparams_script_keeps_the_scripts_values_and_the_schedules_position(tmp_path):
    """Item 7, with a warm-up scheduler: "script" puts back the script's hyper-parameters and base
    lrs, and the lr continues the restored schedule on the script's base; "checkpoint" keeps all."""
    from ckpt_engine.comm import LocalComm
    from horovod_ckpt import HorovodCheckpointer

    def hook(model, optimizer, scheduler, **kw):
        return HorovodCheckpointer(str(tmp_path), model=model, optimizer=optimizer, scheduler=scheduler,
                                   _comm=LocalComm(), save_on_sigterm=False, **kw)

    model, optimizer, scheduler = _sgd_job(0.02, 1e-4)
    ck = hook(model, optimizer, scheduler)
    _steps(model, optimizer, scheduler, 4, ck)
    ck.close()
    saved_lr, saved_state = optimizer.param_groups[0]["lr"], optimizer.state_dict()["state"]

    model, optimizer, scheduler = _sgd_job(0.03, 5e-4)
    assert hook(model, optimizer, scheduler, optimizer_hparams="script").restore().step == 4
    group = optimizer.param_groups[0]
    assert scheduler.base_lrs == [0.03] and group["initial_lr"] == 0.03 and scheduler.last_epoch == 4
    assert group["weight_decay"] == 5e-4 and group["lr"] == pytest.approx(saved_lr * 1.5)
    assert scheduler.get_last_lr() == [group["lr"]]
    assert_same(optimizer.state_dict()["state"], saved_state)
    _steps(model, optimizer, scheduler, 1)
    ref_model, ref_optimizer, ref_scheduler = _sgd_job(0.03, 5e-4)  # the schedule on the script's base
    _steps(ref_model, ref_optimizer, ref_scheduler, 5)
    assert group["lr"] == pytest.approx(ref_optimizer.param_groups[0]["lr"])

    model, optimizer, scheduler = _sgd_job(0.03, 5e-4)
    hook(model, optimizer, scheduler).restore()
    group = optimizer.param_groups[0]
    assert (scheduler.base_lrs, group["weight_decay"], group["lr"]) == ([0.02], 1e-4, saved_lr)
    with pytest.raises(ValueError, match=r"optimizer_hparams='scirpt' is invalid.*'checkpoint'.*'script'"):
        hook(model, optimizer, scheduler, optimizer_hparams="scirpt")


@needs_horovod
@job
def test_epochs_counted_from_one_resume_at_the_same_epoch_number_bitwise_exact(tmp_path):
    """Item 8: Horovod's examples count epochs from 1. With ``ck.epochs(1, epochs + 1)`` a job killed
    mid-epoch and run again trains epochs 1..3 (no extra epoch 0), the same samples at every step,
    each sample once per epoch, and ends with the weights of an uninterrupted run."""
    flags = ["--first-epoch", "1", "--epochs", "3", "--every", "5"]
    ref, got = tmp_path / "ref", tmp_path / "got"
    for d in (ref, got):
        (d / "log").mkdir(parents=True)
    run(2, EXAMPLE, *flags, "--ckpt-dir", str(ref / "ck"), "--sample-log", str(ref / "log"), "--out", str(ref / "out"))
    assert {row["epoch"] for row in steps_logged(ref / "log").values()} == {1, 2, 3}
    args = [*flags, "--ckpt-dir", str(got / "ck"), "--sample-log", str(got / "log"), "--out", str(got / "out")]
    killed = launch(2, EXAMPLE, *args, "--step-delay", "0.1")
    # Mid epoch 2 (steps 9..16), after the checkpoint of step 10 committed.
    wait_until(lambda: max(steps_logged(got / "log"), default=0) >= 12 and 10 in committed_steps(got / "ck"), killed)
    kill_tree(killed)
    resumed_from = max(committed_steps(got / "ck"))
    assert resumed_from % STEPS_PER_EPOCH != 0, "the test wants a mid-epoch resume"

    out = run(2, EXAMPLE, *args)
    assert f"resumed from step {resumed_from}, epoch {1 + resumed_from // STEPS_PER_EPOCH}" in out, out
    for rank in (0, 1):
        assert_same(load_final(got / "out", rank), load_final(ref / "out", rank))
    assert_same_samples_once_per_epoch([steps_logged(got / "log", r) for r in (0, 1)],
                                       [steps_logged(ref / "log", r) for r in (0, 1)],
                                       3 * STEPS_PER_EPOCH, [1, 2, 3], SAMPLES)


def test_epochs_without_set_epoch_or_sampler_continue_in_the_scripts_numbering(tmp_path):
    """Item 8 in one process: a sampler without ``set_epoch`` counts its own iterations from 0, the
    script from 1; a checkpoint at the last step of epoch 1 resumes at epoch 2 with the sampler's
    next permutation. Without a sampler the interrupted epoch runs again from its start."""
    from ckpt_engine.comm import LocalComm
    from horovod_ckpt import HorovodCheckpointer

    data = list(range(12))

    def hook(name: str, sampler) -> HorovodCheckpointer:
        return HorovodCheckpointer(str(tmp_path / name), model=torch.nn.Linear(1, 1), sampler=sampler,
                                   _comm=LocalComm(), save_on_sigterm=False)

    def train(ck: HorovodCheckpointer, sampler, stop_after: int | None = None) -> dict[int, list[int]]:
        seen: dict[int, list[int]] = {}
        for epoch in ck.epochs(1, 4):
            seen[epoch] = []
            for batch in DataLoader(data, batch_size=4, sampler=sampler):
                seen[epoch] += batch.tolist()
                ck.after_step()
            if epoch == stop_after:
                ck.save()
                break
        return seen

    torch.manual_seed(3)
    ref = train(hook("ref", sampler := RandomSampler(data)), sampler)
    assert sorted(ref) == [1, 2, 3]
    torch.manual_seed(3)
    ck = hook("cut", sampler := RandomSampler(data))
    assert train(ck, sampler, stop_after=1) == {1: ref[1]}
    ck.close(final=False)
    torch.manual_seed(999)  # another process
    ck = hook("cut", sampler := RandomSampler(data))
    assert (ck.restore().step, ck.epoch) == (3, 2)
    assert train(ck, sampler) == {2: ref[2], 3: ref[3]}
    ck.close()

    ck = hook("none", None)
    ran = []
    for epoch in ck.epochs(1, 4):
        ran.append(epoch)
        ck.after_step()
        if epoch == 2:
            ck.save()
            break
    ck.close(final=False)
    ck = hook("none", None)
    ck.restore()
    assert ran == [1, 2] and list(ck.epochs(1, 4)) == [2, 3]
    ck.after_step()
    ck.close()  # after the loop ended: the final checkpoint says so
    ck = hook("none", None)
    ck.restore()
    assert list(ck.epochs(1, 4)) == []


@needs_horovod
@job
def test_a_checkpoint_path_that_is_a_file_fails_with_the_cause_on_every_rank(tmp_path):
    """Item 9: rank 0 opens the storage; its error reaches every rank (not "Horovod has been shut down")."""
    path = tmp_path / "ck"
    path.write_text("a file, not a directory\n")
    failed = launch(2, EXAMPLE, "--ckpt-dir", str(path))
    out = finish(failed, timeout=90, expect_rc=None)
    assert failed.returncode != 0, out[-4000:]
    for rank in (0, 1):
        said = rank_output(out, rank)
        cause = f"the checkpoint root {path} exists and is not a directory"
        assert f"StorageError: {cause}" in said or f"StorageError: rank 0: {cause}" in said, out[-4000:]
        assert "Horovod has been shut down" not in said, out[-4000:]


@needs_horovod
@job
@pytest.mark.parametrize("fail", ["latest", "load"])
def test_a_restore_failure_on_one_rank_is_raised_on_every_rank(two_rank_checkpoint, tmp_path, fail):
    """Item 9: rank 0's listing of the checkpoints, or one rank's read, fails during restore():
    every rank raises that error (and the job exits non-zero) instead of one rank waiting for a
    collective the failed rank never makes."""
    failed = launch(2, WORKER, "fault", "--fail", fail, "--ckpt-dir", str(two_rank_checkpoint / "ck"),
                    "--out", str(tmp_path))
    out = finish(failed, timeout=90, expect_rc=None)
    assert failed.returncode != 0, out[-4000:]
    where = {"latest": "the listing on rank 0", "load": "the read on rank 1"}[fail]
    for rank in (0, 1):
        said = rank_output(out, rank)
        assert f"injected into {where}" in said and "CorruptionError" in said, out[-4000:]
        assert "Horovod has been shut down" not in said, out[-4000:]


@needs_horovod
@job
def test_restore_falls_back_past_a_checkpoint_whose_per_rank_section_is_damaged(restored):
    """#14 item 3 in the front end: rank 1's per-rank section of step 10 of a 2-rank checkpoint is
    damaged; the 3 ranks restoring it resume from step 5, the newest checkpoint that verifies on every
    rank (the third restore of the ``restored`` job, after two of the intact checkpoint)."""
    for rank in range(3):
        assert restored_state(restored, "damaged", rank, 3)["step"] == 5
