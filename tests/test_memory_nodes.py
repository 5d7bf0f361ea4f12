"""The memory level on 4 simulated nodes x 2 ranks when nodes do not come back, with real processes.

One 8-rank job (4 nodes x 2 ranks, one replica, a checkpoint at every step up to 6, the disk taking
them up to step 4 only) trains a tiny model to step 10 and is SIGKILLed, nothing closed: it is the
uninterrupted run, and its memory, copied, is where each restart starts from:

(i)   node 2's memory lost, the node replaced by an empty one (8 ranks): step 6 from the replicas,
      ending at step 10 bit-identical to the uninterrupted run, every rank on the same samples;
(ii)  node 2 lost, the job restarted on nodes 0, 1 and 3 (6 ranks): step 6 from the replicas,
      resharded; the same global batches, each sample of the epoch once;
(iii) nodes 1 and 2 lost (one replica: ranks 2 and 3 had their parts on those two only), restarted
      on nodes 0 and 3 (4 ranks): steps 5 and 6 skipped with a warning naming them and ranks 2 and 3,
      step 4 from the disk; it checkpoints steps 5 and 6 in memory and is SIGKILLed;
(iv)  that job restarted on 3 nodes (6 ranks), node 4 new and empty: step 6 from memory.

Each restore is compared bit for bit with what was saved, and the sample ids each rank trained on
with the uninterrupted run's. The bytes each node sent and received per checkpoint, and those each
rank moved at the restores, are those ckpt_engine/levels/scale.py predicts for these layouts.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ckpt_engine.levels.scale import Network, checkpoint_traffic, grid, restore_plan

sys.path.insert(0, os.path.dirname(__file__))
from helpers import assert_same  # noqa: E402
from memory_worker import EPOCH_STEPS, SAMPLES  # noqa: E402
from ranks import kill_job, lines_of, start_ranks  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
WORKER = os.path.join(os.path.dirname(__file__), "memory_worker.py")
LOOPBACK = Network(bandwidth=1e9, latency=50e-6, memory_rate=1e9)
"""What the restore times of these jobs are set beside (docs/memory.md, "At scale"): loopback TCP
between processes on the test machine's 2 cores, order of magnitude."""


@dataclass(frozen=True)
class Job:
    """A finished (or killed) job: its memory and disk as it left them, its outputs, its nodes."""

    mem: Path
    disk: Path
    out: Path
    nodes: tuple[str, ...]
    results: list

    def pt(self, name: str, rank: int) -> dict:
        return torch.load(self.out / f"{name}-rank-{rank}.pt", weights_only=True)


def _run(base: Path, name: str, nodes: list[str], env: dict, start: Job | None = None, lost: tuple[str, ...] = (),
         kill: bool = False) -> Job:
    """A job of 2 ranks on each of ``nodes`` (``CKPT_NODE``) on a copy of ``start``'s memory and disk,
    the memory of the nodes ``lost`` deleted; ``kill``: SIGKILL every rank once each printed ``done``
    (nothing closed), else each must exit 0."""
    job = Job(base / name / "mem", base / name / "disk", base / name / "out", tuple(nodes), [])
    job.out.mkdir(parents=True)
    if start is not None:
        shutil.copytree(start.mem, job.mem, symlinks=True)
        shutil.copytree(start.disk, job.disk, symlinks=True)
        for node in lost:
            shutil.rmtree(job.mem / "test" / f"node-{node}")
    world = 2 * len(nodes)
    rank_env = [{"CKPT_NODE": nodes[r // 2], "LOCAL_WORLD_SIZE": "2"} for r in range(world)]
    procs = start_ranks(world, ["train", str(job.mem), str(job.disk), str(job.out)], {**env, "KILL": str(int(kill))},
                        worker=WORKER, rank_env=rank_env)
    try:
        if kill:
            ends, tails = [], []
            for q in [lines_of(p) for p in procs]:  # every rank's end, so that a failure shows the rank that failed first
                seen = []
                while (line := q.get(timeout=300)) not in ("done", "<eof>"):
                    seen.append(line)
                ends.append(line)
                tails.append("\n".join(seen[-40:]))
            assert ends == ["done"] * world, "\n".join(f"--- rank {r}: {end}\n{tail}"
                                                      for r, (end, tail) in enumerate(zip(ends, tails)))
        else:
            for p in procs:
                output, _ = p.communicate(timeout=300)
                assert p.returncode == 0, output[-6000:]
    finally:
        kill_job(procs)
    job.results.extend(json.loads((job.out / f"rank-{r}.json").read_text()) for r in range(world))
    return job


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Job:
    """The uninterrupted 4 x 2 job (see the module docstring), SIGKILLed at its end."""
    return _run(tmp_path_factory.mktemp("nodes"), "written", ["0", "1", "2", "3"],
                {"STEPS": "10", "SAVE_UNTIL": "6", "DISK_UNTIL": "4"}, kill=True)


def _restored_as_saved(job: Job, saved: Job, step: int) -> None:
    """Every rank restored ``step`` as ``saved`` saved it, bit for bit: the replicated state (model,
    optimizer, data position, ballast) on every rank, its own writer's ``local``, writer 0's as ``first``
    (a rank with no writer: ``local`` is ``None``)."""
    writers = len(saved.results)
    for rank in range(len(job.results)):
        got = job.pt("restored", rank)
        assert_same(got["state"], saved.pt(f"saved-{step}", 0)["state"], f"rank {rank} state")
        if rank < writers:
            assert_same(got["local"], saved.pt(f"saved-{step}", rank)["local"], f"rank {rank} local")
        else:
            assert got["local"] is None
        assert_same(got["first"], saved.pt(f"saved-{step}", 0)["local"], f"rank {rank} first")


def _batches(job: Job, steps) -> dict[int, list[int]]:
    """Per step, the sample ids every rank of ``job`` trained on, rank after rank."""
    return {s: [i for r in job.results for i in r["ids"][str(s)]] for s in steps}


def _same_samples(job: Job, reference: Job, steps, epoch_from: dict[int, list[int]] | None = None) -> None:
    """At each of ``steps`` the ranks of ``job`` trained on the reference's global batch, each sample
    on one rank; with ``epoch_from`` (steps of the epoch before ``steps``), the epoch saw every sample once."""
    mine, theirs = _batches(job, steps), _batches(reference, steps)
    for s in steps:
        assert sorted(mine[s]) == sorted(theirs[s]), f"step {s}"
        assert len(mine[s]) == len(set(mine[s])), f"step {s}"
    if epoch_from is None:
        return
    epoch = (steps[-1] - 1) // EPOCH_STEPS
    seen = [i for s, ids in {**epoch_from, **mine}.items() if (s - 1) // EPOCH_STEPS == epoch for i in ids]
    assert sorted(seen) == list(range(SAMPLES))


def _assembled_as_planned(job: Job, plan) -> None:
    """What each rank moved to assemble the checkpoint is what the scale model plans for that loss."""
    for rank, r in enumerate(job.results):
        a = r["assembly"]
        assert (a["whole"], a["read"], a["sent"], a["received"], a["wire"], a["rounds"]) == (
            plan.whole, plan.read[rank], plan.sent[rank], plan.received[rank], plan.wire, len(plan.rounds)), rank


def _report(what: str, job: Job, plan) -> None:
    """The restore's times beside the model's (shown with ``-s``; docs/memory.md, "At scale")."""
    print(f"\n{what}: restore() {max(r['restored']['seconds'] for r in job.results):.3f} s, assembly "
          f"{max(r['assembly']['seconds'] for r in job.results):.3f} s, model {plan.seconds:.4f} s; "
          f"wire {plan.wire} bytes a rank")


def _data_bytes(job: Job, step: int) -> list[int]:
    return [next(c["data"] for c in r["replication"] if c["step"] == step) for r in job.results]


def test_every_nodes_replication_bytes_per_checkpoint_are_what_the_scale_model_says(written):
    table = grid(4, 2)
    for step in range(1, 7):
        parts = [next(c for c in r["replication"] if c["step"] == step) for r in written.results]
        model = checkpoint_traffic(table, 1, [c["part"] for c in parts])
        measured = [(sum(c["sent"] for c in parts[2 * n:2 * n + 2]), sum(c["received"] for c in parts[2 * n:2 * n + 2]))
                    for n in range(4)]
        assert measured == model, step
    print(f"\nper checkpoint, node (sent, received): {measured}")


def test_a_node_replaced_by_an_empty_one_resumes_from_the_replicas_bit_identical_to_the_uninterrupted_run(
        written, tmp_path):
    """(i): 8 ranks again, node 2 empty: its ranks' parts come from node 3's memory (their replicas)."""
    run = _run(tmp_path, "replaced", ["0", "1", "2", "3"], {"STEPS": "10"}, start=written, lost=("2",))
    for r in run.results:
        assert r["restored"] == {**r["restored"], "step": 6, "level": 0, "writers": 8, "warnings": []}
    _restored_as_saved(run, written, 6)
    for rank in range(8):  # the end of training, bit for bit, and every rank on the same samples
        assert_same(run.pt("final", rank), written.pt("final", rank), f"rank {rank} at step 10")
        assert {s: run.results[rank]["ids"][s] for s in run.results[rank]["ids"]} == \
            {s: written.results[rank]["ids"][s] for s in map(str, range(7, 11))}
    plan = restore_plan(grid(4, 2), 1, _data_bytes(written, 6), {2}, shrink=False, network=LOOPBACK)
    _assembled_as_planned(run, plan)
    _report("(i) node 2 replaced", run, plan)


def test_a_job_restarted_on_the_remaining_nodes_reshards_the_replicas(written, tmp_path):
    """(ii): node 2 lost, 6 ranks on nodes 0, 1, 3: the 8 writers' parts from the 3 nodes' memory."""
    run = _run(tmp_path, "shrunk", ["0", "1", "3"], {"STEPS": "8"}, start=written, lost=("2",))
    for r in run.results:
        assert r["restored"] == {**r["restored"], "step": 6, "level": 0, "writers": 8, "warnings": []}
    _restored_as_saved(run, written, 6)
    _same_samples(run, written, [7, 8], _batches(written, [5, 6]))
    plan = restore_plan(grid(4, 2), 1, _data_bytes(written, 6), {2}, shrink=True, network=LOOPBACK)
    _assembled_as_planned(run, plan)
    _report("(ii) node 2 removed", run, plan)


def test_two_adjacent_nodes_lost_fall_back_to_the_disk_then_a_job_on_more_nodes_resumes_from_memory(written,
                                                                                                     tmp_path):
    """(iii) then (iv): with one replica, ranks 2 and 3 (node 1) had their parts on nodes 1 and 2 only."""
    fell = _run(tmp_path, "fell-back", ["0", "3"], {"STEPS": "6", "SAVE_UNTIL": "6", "HOLD_DISK": "1"},
                start=written, lost=("1", "2"), kill=True)
    for r in fell.results:
        assert (r["restored"]["step"], r["restored"]["level"], r["restored"]["writers"]) == (4, 1, 8)
        [said] = r["restored"]["warnings"]
        assert "steps 5, 6 skipped" in said and "restored step 4 from level 2" in said, said
        assert "step 5: ranks 2, 3 of the 8 that wrote it; step 6: ranks 2, 3 of the 8 that wrote it" in said, said
    _restored_as_saved(fell, written, 4)
    _same_samples(fell, written, [5, 6])
    # (iv) the same job on one node more: its checkpoint of step 6 is in nodes 0 and 3's memory only
    grown = _run(tmp_path, "grown", ["0", "3", "4"], {"STEPS": "8"}, start=fell)
    for r in grown.results:
        assert (r["restored"]["step"], r["restored"]["level"], r["restored"]["writers"]) == (6, 0, 4)
        assert r["restored"]["warnings"] == []
    _restored_as_saved(grown, fell, 6)
    _same_samples(grown, written, [7, 8], _batches(fell, [5, 6]))
    plan = restore_plan(grid(2, 2), 1, _data_bytes(fell, 6), (), shrink=False, network=LOOPBACK, added=(2,))
    _assembled_as_planned(grown, plan)
    _report("(iv) 2 nodes -> 3", grown, plan)
