"""One rank of a real multi-process job (torch.distributed, gloo, CPU), driven by the tests.

Usage: ``python dist_worker.py MODE ROOT OUT [ARGS]`` with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
in the environment. Modes:

* ``save ROOT OUT STEPS``: save ``make_state(s)`` for s in 1..STEPS, then wait and close;
* ``load ROOT OUT``: load the newest checkpoint, write digests of what came back to OUT;
* ``restore ROOT OUT``: the collective restore twice, by ``$ROUTE``, with its figures and bytes read;
* ``loop ROOT OUT``: save every step forever (the test SIGKILLs it), printing committed steps;
* ``schedule ROOT OUT``: an adaptive schedule with rank-dependent iteration times;
* ``crashloop ROOT OUT``: a restart of a job killed at any instant (tests/test_crash.py): rank 0
  prints what the start-up sweep left (``swept {json}``), every rank checks what it restored
  (``restored STEP ok``), then the job saves every step; with ``CRASH_AT=INSTANT:STEP`` one save at a
  time (each committed, retention done, before the next) until :class:`CrashStorage` kills every rank
  at that instant (``crash INSTANT STEP RANK FILE DETAIL`` first); with ``SAVES=N`` N saves, one at a
  time, then it ends; with neither, saves overlap until the test kills the job.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from worker_exit import leave  # noqa: E402
from ckpt_engine import Checkpointer, TorchDistComm  # noqa: E402
from ckpt_engine.testing import CrashStorage  # noqa: E402


def make_state(step: int) -> dict:
    """The replicated state at ``step``: identical on every rank, different for every step."""
    g = torch.Generator().manual_seed(1000 + step)
    emb = torch.randn(300, 64, generator=g)
    return {
        "model": {"emb.weight": emb, "head.weight": emb,  # tied
                  "big": torch.randn(512, 1024, generator=g), "mid": torch.randn(40, 33, generator=g),
                  "bias": torch.randn(33, generator=g), "bf16": torch.randn(1000, generator=g).bfloat16(),
                  "mask": torch.rand(77, generator=g) > 0.5, "count": torch.tensor(step, dtype=torch.int64)},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(4096, generator=g)}},
                      "param_groups": [{"lr": 0.001 * step, "betas": (0.9, 0.999), "params": [0]}]},
        "step": step,
    }


def columns_sharded(step: int) -> torch.Tensor:
    """The whole of the column-sharded weight saved with ``COLUMNS_SHARDED=1`` at ``step``."""
    return torch.randn(48, 6000, generator=torch.Generator().manual_seed(2000 + step))


def make_local(step: int, rank: int) -> dict:
    """Per-rank state: differs across ranks (as BatchNorm statistics and RNG streams do)."""
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {"rank": rank, "bn.running_mean": torch.randn(64, generator=g), "rng": g.get_state(), "pos": step * 10 + rank}


def write_result(out: str, rank: int, result: dict) -> None:
    """What a rank of a test job reports: ``OUT/rank-RANK.json``, which ``ranks.run_ranks`` reads back."""
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)


def digest(value, path: str = "") -> dict:
    """Flat {key path: xxh3 of tensor bytes / repr of value}, with tensor object identities."""
    out = {}
    if isinstance(value, torch.Tensor):
        raw = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[path] = f"{value.dtype}{list(value.shape)}:{xxhash.xxh3_64_hexdigest(raw)}"
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(digest(v, f"{path}[{k!r}]"))
    elif isinstance(value, (list, tuple)):
        out[path] = type(value).__name__
        for i, v in enumerate(value):
            out.update(digest(v, f"{path}[{i}]"))
    else:
        out[path] = repr(value)
    return out


def _rchar() -> int:
    """Bytes this process has read through system calls so far (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


class KillJob(CrashStorage):
    """Kills the whole job at the instant: every rank runs in a session of its own (tests/ranks.py),
    so the rank that gets there kills the others (``pids``), then its own process group."""

    pids: tuple[int, ...] = ()

    def crash(self, rel: str, detail: str = "") -> None:
        print(f"crash {self.instant} {self.step} {dist.get_rank()} {rel} {detail}".rstrip(), flush=True)
        for pid in self.pids:
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
        super().crash(rel, detail)


def crashloop(root: str, rank: int) -> None:
    """The ``crashloop`` mode (module docstring); returns only with ``SAVES``."""
    from ckpt_engine.format.catalog import attempt_dirs, manifest_dirs

    crash_at, saves = os.environ.get("CRASH_AT"), os.environ.get("SAVES")
    storage: str | KillJob = root
    if crash_at:
        instant, at = crash_at.split(":")
        pids: list = [None] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        KillJob.pids = tuple(pids)
        storage = KillJob(root, instant=instant, step=int(at))
    ck = Checkpointer(storage, comm=TorchDistComm(), keep_last=int(os.environ.get("KEEP_LAST", "3")))
    if rank == 0:  # the sweep is done (rank 0, in the constructor); nothing is written before the barrier
        left = {"dirs": attempt_dirs(ck.storage), "committed": [d for _, d in manifest_dirs(ck.storage)],
                "tmp": list(ck.storage.stale_temp_files())}
        print(f"swept {json.dumps(left)}", flush=True)
    dist.barrier()
    step = ck.latest_step() or 0
    if step:
        ok = digest(ck.load()) == digest(make_state(step)) and digest(ck.load_local()) == digest(make_local(step, rank))
        for other in ck.steps():  # every committed checkpoint is whole and verifies
            ok = ok and digest(ck.load(step=other)) == digest(make_state(other))
        print(f"restored {step} {'ok' if ok else 'MISMATCH'}", flush=True)
    last = int(at) if crash_at else step + int(saves) if saves else None  # None: until the test kills the job
    reported = None
    while last is None or step < last:
        step += 1
        ck.save(make_state(step), step, make_local(step, rank))
        if last is not None:  # one at a time: committed, `latest` written, retention done before the next save
            ck.wait(retention=True)
            dist.barrier()
        done = [r.step for r in ck.records if r.committed]
        if done and done[-1] != reported:
            reported = done[-1]
            print(f"committed {reported}", flush=True)
    if crash_at:  # every instant of the save of `at` comes before the end of its wait, on any rank
        print(f"CRASH_AT={crash_at}: the save of step {at} ended without reaching the instant", flush=True)
        leave(1)
    ck.close()


def main() -> None:
    mode, root, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)  # several ranks share 2 cores in tests
    if mode == "crashloop":
        crashloop(root, rank)
        dist.destroy_process_group()
        return
    ck = Checkpointer(root, comm=TorchDistComm(), keep_last=int(os.environ.get("KEEP_LAST", "3")))
    result: dict = {"rank": rank}
    if mode == "save":
        for step in range(1, int(sys.argv[4]) + 1):
            state = make_state(step)
            if os.environ.get("COLUMNS_SHARDED"):  # a tensor-parallel weight: each rank a block of columns
                from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
                mesh = init_device_mesh("cpu", (dist.get_world_size(),))
                state["model"]["tp"] = distribute_tensor(columns_sharded(step), mesh, [Shard(1)])
            ck.save(state, step, make_local(step, rank))
        ck.wait()
        result["records"] = [r.__dict__ for r in ck.records]
    elif mode == "load":
        state = ck.load()
        result["state"] = digest(state)
        result["tied"] = state["model"]["emb.weight"] is state["model"]["head.weight"]
        result["step"] = ck.loaded_manifest.step
        result["local"] = digest(ck.load_local())
        result["writers"] = ck.loaded_manifest.world_size
    elif mode == "restore":
        # The collective restore (ROUTE: auto / read / exchange), twice: the second uses what auto chose.
        import ckpt_engine.load.exchange as exchange
        exchange.MIN_PIECE = int(os.environ.get("MIN_PIECE", exchange.MIN_PIECE))  # the test state is small
        ck.close()
        ck = Checkpointer(root, comm=TorchDistComm(), restore_route=os.environ["ROUTE"], readonly=True)
        result["restores"] = []
        for _ in range(2):
            before = _rchar()
            restored = ck.restore()
            figures = ck.restore_figures
            result["restores"].append({
                "step": restored.step, "state": digest(restored.state), "local": digest(restored.local),
                "rchar": _rchar() - before, "failures": ck.load_failures,
                "figures": None if figures is None else dict(figures.__dict__)})
    elif mode == "schedule":
        # Each rank's iterations take a different time: the decision must still be identical.
        import time

        from ckpt_engine.training.policy import Adaptive
        from ckpt_engine.training.schedule import Schedule
        policy = Adaptive(0.2, profile_steps=5)
        sched = Schedule(policy, ck)
        saved = []
        for step in range(1, 61):
            time.sleep(0.002 * (1 + rank))
            if sched.should_save(step):
                ck.save(make_state(step), step, make_local(step, rank))
                sched.saved(step)
                saved.append(step)
        ck.wait()
        result["saved"] = saved
    elif mode == "soak":
        # Thousands of checkpoints against a deliberately slow storage: memory, threads and file
        # descriptors must stay flat; back-pressure skips or waits, never queues.
        import threading
        import time

        from ckpt_engine.testing import SlowStorage

        class Slow(SlowStorage):
            delay = 0.003

        ck.close()
        ck = Checkpointer(Slow(root), comm=TorchDistComm(), keep_last=2, on_busy=os.environ.get("ON_BUSY", "skip"))
        state = make_state(1)
        total = int(sys.argv[4])

        def probe() -> dict:  # RSS for the report; the counts decide (test_soak.py)
            rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            return {"rss": rss, "threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
                    "buffers": ck._pool.allocations}

        for step in range(1, total + 1):
            state["model"]["count"].fill_(step)
            ck.save(state, step, {"rank": rank})
            if step == total // 5:
                ck.wait(retention=True)
                result["warm"] = probe()
        ck.wait(retention=True)
        result["end"] = probe()
        result["counters"] = dict(ck.counters)
        result["latest"] = ck.latest_step()
    elif mode == "loop":
        step = int(os.environ.get("START_STEP", "1"))
        while True:
            ck.save(make_state(step), step, make_local(step, rank))
            ck.wait()
            print(f"committed {step}", flush=True)
            step += 1
    ck.close()
    write_result(out, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()  # worker_exit.py: no interpreter finalization once the work is done
