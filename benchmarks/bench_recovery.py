"""Recovery after every process of a job died: restore from node memory against restore from local disk.

A 2-rank job (gloo, CPU; two simulated nodes, ``CKPT_NODE``) saves into ``levels=[memory, disk]``, waits
until both hold it and dies by SIGKILL; then new jobs restore, in alternating rounds. The method and its
target: ``benchmarks/README.md``, section bench_recovery.

Usage::

    .venv/bin/python benchmarks/bench_recovery.py --mib 512 --rounds 4   # about a minute
    .venv/bin/python benchmarks/bench_recovery.py --mib 64 --rounds 1    # quick
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
sys.path[:0] = [os.path.dirname(HERE), HERE]


def worker(mode: str, mib: int, mem: str, disk: str) -> None:
    """One rank: ``save`` (checkpoint, wait for both levels, print, sleep until killed) or a restore
    (``memory`` or ``disk_cold``); nothing of the harness is imported, as its imports are part of its timed start."""
    import torch
    import torch.distributed as dist

    from ckpt_engine import Checkpointer, TorchDistComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}": torch.randn(mib * (1 << 20) // 32, generator=g) for i in range(8)}
    levels = [{"kind": "memory", "path": mem, "job": "bench-recovery"}, disk]
    if mode == "save":
        ck = Checkpointer(levels=levels, comm=TorchDistComm(), keep_last=1)
        ck.save(state, 1)
        ck.wait(flush=True)  # committed in memory, replicated, and on the disk
        dist.barrier()
        print("saved", flush=True)
        time.sleep(3600)
    target = {k: torch.zeros_like(v) for k, v in state.items()}  # initialized, as a model's parameters are
    where = {"levels": levels} if mode == "memory" else {"path": disk}
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
    if dist.get_rank() == 0:
        print(json.dumps({"restore_s": restore_s, "first_step_s": time.perf_counter() - START, "level": r.level}),
              flush=True)
    os._exit(0)  # leave the memory as it is for the next round (no close(): a job that dies keeps it)


def job(args: argparse.Namespace, mode: str) -> list[subprocess.Popen] | dict:
    """A 2-rank job: ``save`` (returns its processes once both saved) or a restore (returns rank 0's figures)."""
    from _common import free_port  # not at the top: a worker's imports are part of its timed start

    port, procs = str(free_port()), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   CKPT_NODE=str(rank), LOCAL_WORLD_SIZE="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", mode, str(args.mib), args.mem,
                                       args.disk], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True))
    if mode == "save":
        for p in procs:
            assert p.stdout.readline().strip() == "saved", "the saving job failed"
        return procs
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    from _common import drop_page_cache, parser, table, write_report

    labels = {"memory": "node memory (each node holds both parts: its own and the other's replica)",
              "disk_cold": "local disk, page cache dropped"}
    p = parser(__doc__)
    p.add_argument("--mib", type=int, default=512, help="replicated state, MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mem", default=None, help="memory level root (default: a fresh directory in /dev/shm)")
    p.add_argument("--disk", default=None, help="disk level (default: a temporary directory)")
    args = p.parse_args()
    scratch = tempfile.mkdtemp(prefix="bench-recovery-", dir=os.path.dirname(HERE))
    args.mem = args.mem or tempfile.mkdtemp(prefix="bench-recovery-", dir="/dev/shm")
    args.disk = args.disk or os.path.join(scratch, "disk")
    try:
        for proc in job(args, "save"):  # every process of the job dies at once
            os.killpg(proc.pid, 9)
            proc.wait()
        rows: dict[str, list[dict]] = {mode: [] for mode in labels}
        for i in range(args.rounds):
            for mode in (("memory", "disk_cold") if i % 2 == 0 else ("disk_cold", "memory")):
                if mode == "disk_cold":
                    drop_page_cache([args.disk])
                rows[mode].append(job(args, mode))
    finally:
        shutil.rmtree(args.mem, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("restore_s", "first_step_s")} for m, rs in rows.items()}
    assert all(r["level"] == 0 for r in rows["memory"]), "a memory restore did not come from memory"
    ratio = med["memory"]["restore_s"] / med["disk_cold"]["restore_s"]
    doc = {"mib": args.mib, "rounds": args.rounds, "machine": f"{platform.node()} ({os.cpu_count()} cores)",
           "date": time.strftime("%Y-%m-%d"), "median": med, "rows": rows, "restore_ratio": ratio}
    lines = [f"# Recovery: restore from node memory vs local disk (cold), {args.mib} MiB, 2 ranks on 2 simulated "
             f"nodes, {args.rounds} rounds", "", f"{doc['machine']}, {doc['date']}", "",
             *table(["restore from", "restore (call to state in place)", "job start to first step"],
                    [[label, f"{med[m]['restore_s'] * 1e3:.0f} ms", f"{med[m]['first_step_s']:.2f} s"]
                     for m, label in labels.items()]),
             "", f"memory / disk cold, restore: **{ratio:.2f} x** (target <= 0.3)"]
    write_report(args.out, "bench_recovery", "\n".join(lines) + "\n", doc)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
    else:
        main()
