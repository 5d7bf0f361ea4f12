"""Recovery after every process of a job died: restore from node memory against restore from local disk.

A 2-rank job (gloo, CPU; two simulated nodes of one rank each, ``CKPT_NODE``, so each rank's part
is also replicated to the other) checkpoints a synthetic state (``--mib`` of float32 tensors,
replicated) into ``levels=[memory, disk]``, waits until both levels hold it, and dies by SIGKILL.
Then, per round, in alternating order:

* **memory**: a new job opens the same levels and ``restore(into=state)``s: the newest checkpoint,
  from the nodes' memory (each node holds both parts, its rank's and the other's replica, so each
  rank reads it all from its node's tmpfs);
* **disk, cold**: a new job opens the disk level alone, after every file of it was dropped from the
  page cache (``fsync`` + ``posix_fadvise(DONTNEED)``, as ``bench_save``'s cold restores), and
  ``restore(into=state)``s.

Figures per contender (rank 0; medians over ``--rounds``): the restore from the call to the state in
place (every byte verified; the state's tensors exist and were written before, as a model's
initialized parameters are), and the whole time from the new job's first line of Python to its
first training step (imports, process group, ``Checkpointer``, restore, one optimizer step on the
restored state). The ratio memory / disk of the restore is the issue's target (<= 0.3).

Usage::

    .venv/bin/python benchmarks/bench_recovery.py --mib 512 --rounds 5

Output: ``benchmarks/out/bench_recovery.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

START = time.perf_counter()  # the job's first line: before torch is imported

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _state(mib: int):
    import torch

    g = torch.Generator().manual_seed(0)
    n = mib * (1 << 20) // 4 // 8
    return {f"layer{i}": torch.randn(n, generator=g) for i in range(8)}


def _levels(args: argparse.Namespace) -> list:
    return [{"kind": "memory", "path": args.mem, "job": "bench-recovery"}, args.disk]


def worker(args: argparse.Namespace) -> None:
    """One rank: ``save`` (checkpoint, wait for both levels, print, sleep until killed) or a restore."""
    import torch
    import torch.distributed as dist

    from ckpt_engine import Checkpointer, TorchDistComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = _state(args.mib)
    if args.mode == "save":
        ck = Checkpointer(levels=_levels(args), comm=TorchDistComm(), keep_last=1)
        ck.save(state, 1)
        ck.wait(flush=True)  # committed in memory, replicated, and on the disk
        dist.barrier()
        print("saved", flush=True)
        time.sleep(3600)
    target = {k: torch.zeros_like(v) for k, v in state.items()}  # initialized, as a model's parameters are
    where = {"levels": _levels(args)} if args.mode == "memory" else {"path": args.disk}
    ck = Checkpointer(**where, comm=TorchDistComm(), keep_last=1)
    dist.barrier()
    t0 = time.perf_counter()
    r = ck.restore(into=target)
    restore_s = time.perf_counter() - t0
    assert r.step == 1 and all(torch.equal(target[k], state[k]) for k in state), "restored state differs"
    params = [torch.nn.Parameter(target["layer0"])]
    opt = torch.optim.SGD(params, lr=0.1)
    params[0].sum().backward()
    opt.step()
    first_step_s = time.perf_counter() - START
    if rank == 0:
        print(json.dumps({"restore_s": restore_s, "first_step_s": first_step_s, "level": r.level}), flush=True)
    os._exit(0)  # leave the memory as it is for the next round (no close(): a job that dies keeps it)


def _run(args: argparse.Namespace, mode: str, wait_for: str | None = None) -> list[subprocess.Popen] | dict:
    from _common import free_port  # not at the top: a worker's imports are part of its timed start

    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   CKPT_NODE=str(rank), LOCAL_WORLD_SIZE="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", mode, "--mib", str(args.mib),
                                       "--mem", args.mem, "--disk", args.disk], env=env, stdout=subprocess.PIPE,
                                      text=True, start_new_session=True))
    if wait_for is not None:
        for p in procs:
            assert p.stdout.readline().strip() == wait_for, f"{mode} job failed"
        return procs
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    from _common import drop_page_cache

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mib", type=int, default=512, help="replicated state, MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mem", default=None, help="memory level root (default: a fresh directory in /dev/shm)")
    p.add_argument("--disk", default=None, help="disk level (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    args = p.parse_args()
    if args.worker:
        args.mode = args.worker
        worker(args)
        return
    scratch = tempfile.mkdtemp(prefix="bench-recovery-", dir=os.path.dirname(HERE))
    args.mem = args.mem or tempfile.mkdtemp(prefix="bench-recovery-", dir="/dev/shm")
    args.disk = args.disk or os.path.join(scratch, "disk")
    try:
        saver = _run(args, "save", wait_for="saved")
        for proc in saver:  # every process of the job dies at once
            os.killpg(proc.pid, 9)
            proc.wait()
        rows: dict[str, list[dict]] = {"memory": [], "disk_cold": []}
        for i in range(args.rounds):
            for mode in (("memory", "disk_cold") if i % 2 == 0 else ("disk_cold", "memory")):
                if mode == "disk_cold":
                    drop_page_cache([args.disk])
                rows[mode].append(_run(args, "memory" if mode == "memory" else "disk"))
        report(args, rows)
    finally:
        shutil.rmtree(args.mem, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def report(args: argparse.Namespace, rows: dict[str, list[dict]]) -> None:
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("restore_s", "first_step_s")} for m, rs in rows.items()}
    assert all(r["level"] == 0 for r in rows["memory"]), "a memory restore did not come from memory"
    ratio = med["memory"]["restore_s"] / med["disk_cold"]["restore_s"]
    doc = {"mib": args.mib, "rounds": args.rounds, "machine": f"{platform.node()} ({os.cpu_count()} cores)",
           "date": time.strftime("%Y-%m-%d"), "median": med, "rows": rows, "restore_ratio": ratio}
    lines = [f"# Recovery: restore from node memory vs local disk (cold), {args.mib} MiB, 2 ranks on 2 simulated "
             f"nodes, {args.rounds} rounds", "", f"{doc['machine']}, {doc['date']}", "",
             "| restore from | restore (call to state in place) | job start to first step |", "|---|---|---|"]
    for mode, label in (("memory", "node memory (each node holds both parts: its own and the other's replica)"),
                        ("disk_cold", "local disk, page cache dropped")):
        lines.append(f"| {label} | {med[mode]['restore_s'] * 1e3:.0f} ms | {med[mode]['first_step_s']:.2f} s |")
    lines += ["", f"memory / disk cold, restore: **{ratio:.2f} x** (target <= 0.3)"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_recovery.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "bench_recovery.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
