"""Several ranks: every rank writes its slice; restore on any world size is bit-identical; every rank
takes the same decision at the same step. The protocol runs with ranks as threads of this process
(tests/thread_ranks.py: real collectives, in the same order, values through JSON);
real gloo jobs (``torch.distributed``, CPU) for what only processes show: a save and a load through
``torch.distributed`` end to end, and a SIGKILL of the whole job leaving its newest commit loadable."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import committed, manifest_dirs
from ckpt_engine.storage import open_storage
from dist_worker import digest, make_local, make_state
from ranks import run_ranks, start_ranks
import thread_ranks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Checkpoints written by 2 and by 3 ranks as threads (steps 1..3, keep_last 3)."""
    roots = {}
    for world in (2, 3):
        roots[world] = str(tmp_path_factory.mktemp(f"w{world}"))
        thread_ranks.save(f"file://{roots[world]}", world)
    return roots


def check_shares(root: str, world: int) -> None:
    storage = open_storage(root)
    name = manifest_dirs(storage)[-1][1]
    files = sorted(f for f in os.listdir(os.path.join(root, name)) if f.endswith(".bin"))
    assert files == [f"rank-{r:05d}.bin" for r in range(world)]
    manifest = committed(storage)[-1].manifest
    assert manifest.world_size == world and manifest.step == 3
    shares = [r.data_bytes for r in manifest.ranks]
    assert max(shares) <= 1.05 * sum(shares) / world, shares  # ~1/N each, no rank-0 bottleneck
    assert sum(t.owner == -1 for t in manifest.tensors) >= 2  # big tensors split across all ranks


def check_restored(results: list[dict], writers: int) -> None:
    expected = digest(make_state(3))
    for res in results:
        assert res["state"] == expected
        assert res["step"] == 3 and res["writers"] == writers
        rank = res["rank"]
        assert res["local"] == (digest(make_local(3, rank)) if rank < writers else digest(None))


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_writes_its_own_share(written, world):
    check_shares(written[world], world)


@pytest.mark.parametrize("writers, readers", [(2, 1), (2, 2), (2, 3), (3, 1), (3, 2), (3, 3)])
def test_restore_on_any_world_size_is_bit_identical(written, writers, readers):
    if readers == 1:  # a single process with no communicator at all
        ck = Checkpointer(written[writers])
        results = [{"state": digest(ck.load()), "step": 3, "rank": 0,
                    "local": digest(ck.load_local()), "writers": writers}]
    else:
        results = thread_ranks.load(written[writers], readers)
    check_restored(results, writers)


def test_tied_weights_come_back_tied(written):
    assert all(r["tied"] for r in thread_ranks.load(written[3], 2))


def test_every_rank_takes_the_same_decision_at_the_same_step(tmp_path):
    """Each rank's iterations take a different time (dist_worker.py's ``schedule`` mode): the
    adaptive decision must still be identical."""
    from ckpt_engine.training.policy import Adaptive
    from ckpt_engine.training.schedule import Schedule

    def schedule(comm) -> list[int]:
        saved = []
        with Checkpointer(str(tmp_path / "ck"), comm=comm, keep_last=3) as ck:
            sched = Schedule(Adaptive(0.2, profile_steps=5), ck)
            for step in range(1, 61):
                time.sleep(0.002 * (1 + comm.rank))
                if sched.should_save(step):
                    ck.save(make_state(step), step, make_local(step, comm.rank))
                    sched.saved(step)
                    saved.append(step)
            ck.wait()
        return saved

    results = thread_ranks.on_threads(2, schedule)
    assert results[0] == results[1] and len(results[0]) >= 2
    assert Checkpointer(str(tmp_path / "ck")).latest_step() == results[0][-1]


@pytest.mark.slow
def test_gloo_ranks_save_and_load_through_torch_distributed(tmp_path):
    """The same save and load as above, end to end as a job runs them: 3 gloo ranks write, 2 read
    (tied weights tied, each rank its own writer's ``local``)."""
    root = tmp_path / "ck"
    run_ranks(3, "save", f"file://{root}", tmp_path / "save", "3")
    check_shares(str(root), 3)
    results = run_ranks(2, "load", str(root), tmp_path / "load")
    check_restored(results, 3)
    assert all(r["tied"] for r in results)


@pytest.mark.slow
def test_sigkill_of_the_whole_job_leaves_the_newest_commit_loadable(tmp_path):
    root = str(tmp_path / "ck")
    procs = start_ranks(2, ["loop", root, str(tmp_path)])
    committed = 0
    deadline = time.monotonic() + 120
    while committed < 3 and time.monotonic() < deadline:
        line = procs[0].stdout.readline()
        committed += line.startswith("committed")
    time.sleep(0.05)  # land somewhere inside the next save
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert committed >= 3
    ck = Checkpointer(root)  # restart: sweeps leftovers, loads the newest committed
    step = ck.latest_step()
    assert step is not None and step >= 3
    assert digest(ck.load()) == digest(make_state(step))
    assert all(manifest_dirs(ck.storage, s) for s in ck.steps())
    names = os.listdir(root)
    assert all(n == "latest" or any(n == d for _, d in manifest_dirs(ck.storage)) for n in names), names
