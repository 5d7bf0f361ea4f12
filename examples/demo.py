"""ckpt-suite demo: checkpoint a real DDP training job, crash it, resume it, prove the resume exact.

Runs ``examples/plain_train.py`` (a tiny character-level transformer LM, 2 gloo ranks on CPU)
three times:

  (a) uninterrupted: ``--steps`` steps, a checkpoint every ``--every`` steps;
  (b) the same job into a second directory, SIGKILLed right after step ``--kill-at``
      (both rank processes; the demo then SIGKILLs the job's whole process group);
  (c) a restart of (b): resumes from the newest committed checkpoint and finishes.

Then it prints the checkpoint figures of (a), checks that the final weights of (a) and (c) are
bitwise identical (exit status 1 if not), and lists both checkpoint directories with
``python -m ckpt_engine ls``. Needs nothing but the project's virtualenv; about 40 s on 2 cores.

    .venv/bin/python examples/demo.py [--steps 120 --every 10 --kill-at 73] [--keep]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAIN = os.path.join(HERE, "plain_train.py")
WORLD = 2
JOB_TIMEOUT_S = 300


def banner(text: str) -> None:
    print(f"\n{'=' * 100}\n{text}\n{'=' * 100}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class JobResult:
    returncodes: list[int]
    rank1_log: str
    wall_s: float


def run_job(train_args: list[str], log_dir: str, name: str, expect_kill: bool = False) -> JobResult:
    """Start the 2 ranks in one new process group; stream rank 0's output; wait for both.

    With ``expect_kill`` the ranks SIGKILL themselves; once rank 0 is gone the demo SIGKILLs
    the whole process group too, so no rank survives the "crash" (a real node failure).
    """
    port = free_port()
    procs: list[subprocess.Popen] = []
    rank1_log = os.path.join(log_dir, f"{name}-rank1.log")
    base_env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, TRAIN, *train_args]
    shown = " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd[1:])
    print(f"$ RANK={{0,1}} WORLD_SIZE={WORLD} MASTER_ADDR=127.0.0.1 MASTER_PORT={port} python {shown}", flush=True)
    start = time.perf_counter()
    with open(rank1_log, "w") as r1:
        for rank in range(WORLD):
            env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
            pgid = 0 if rank == 0 else procs[0].pid  # rank 0 leads a new group; rank 1 joins it
            out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if rank == 0 else \
                dict(stdout=r1, stderr=subprocess.STDOUT)
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, process_group=pgid, **out))
        pgid = procs[0].pid
        reader = threading.Thread(target=_stream, args=(procs[0],), daemon=True)
        reader.start()
        try:
            procs[0].wait(timeout=JOB_TIMEOUT_S)
            if expect_kill:
                _killpg(pgid)
            for p in procs[1:]:
                p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _killpg(pgid)
            raise SystemExit(f"demo: job {name} did not finish within {JOB_TIMEOUT_S} s; killed it")
        except BaseException:
            _killpg(pgid)
            raise
        reader.join(timeout=10)
    codes = [p.returncode for p in procs]
    with open(rank1_log) as f:
        return JobResult(codes, f.read(), time.perf_counter() - start)


def _stream(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"  | {line.rstrip()}", flush=True)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # every member is gone already


def check_ok(res: JobResult, name: str) -> None:
    if any(res.returncodes):
        print(f"demo: job {name} failed, exit codes {res.returncodes}; rank 1's output:\n{res.rank1_log}")
        raise SystemExit(2)


def describe_codes(codes: list[int]) -> str:
    return ", ".join(f"rank {r}: " + (f"killed by {signal.Signals(-c).name}" if c < 0 else f"exit {c}")
                     for r, c in enumerate(codes))


def ckpt_cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "ckpt_engine", *args], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    return (out.stdout + out.stderr).rstrip()


def indent(text: str) -> str:
    return "\n".join(f"  | {line}" for line in text.splitlines())


def figures(metrics: dict, every: int) -> None:
    """Per-checkpoint table of run (a), and the stall overhead relative to training time."""
    per_rank = metrics["records"]
    print(f"{'step':>5} {'stall ms':>17} {'snapshot ms':>17} {'persist ms':>17} {'commit ms':>10} "
          f"{'bytes (all ranks)':>18} {'write GB/s':>11}")
    print(f"{'':>5} {'r0 / r1':>17} {'r0 / r1':>17} {'r0 / r1':>17} {'(rank 0)':>10} {'':>18} {'(aggregate)':>11}")
    for recs in zip(*per_rank):
        total = sum(r["bytes"] for r in recs)
        slowest = max(r["persist_s"] for r in recs)
        pair = lambda key: " / ".join(f"{r[key] * 1e3:7.2f}" for r in recs)  # noqa: E731
        print(f"{recs[0]['step']:>5} {pair('stall_s'):>17} {pair('snapshot_s'):>17} {pair('persist_s'):>17} "
              f"{recs[0]['commit_s'] * 1e3:>10.2f} {total:>18,} {total / slowest / 1e9:>11.2f}")
    stalls = [r["stall_s"] for r in per_rank[0]]
    steps = metrics["step_times"]
    mean_stall, mean_step = statistics.mean(stalls), statistics.mean(steps)
    print(f"\nrank 0: mean training step {mean_step * 1e3:.1f} ms (forward + backward + allreduce + AdamW), "
          f"mean checkpoint stall {mean_stall * 1e3:.2f} ms")
    print(f"one checkpoint every {every} steps -> stall overhead = {mean_stall * 1e3:.2f} / ({every} x "
          f"{mean_step * 1e3:.1f}) = {100 * mean_stall / (every * mean_step):.2f} % of training time "
          f"(total: {sum(stalls) * 1e3:.1f} ms stalled in {sum(steps):.2f} s of steps)")
    print("persist and commit run on a background thread while training continues; "
          "only the stall blocks the training loop.")


def compare(path_a: str, path_c: str) -> bool:
    import torch

    a, c = torch.load(path_a, weights_only=True), torch.load(path_c, weights_only=True)
    same = a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    differing = [k for k in a if k not in c or not torch.equal(a[k], c[k])]
    for k in differing[:5]:
        diff = "missing" if k not in c else f"max |diff| {(a[k].double() - c[k].double()).abs().max():.3e}"
        print(f"  DIFFERS: {k}: {diff}")
    if len(differing) > 5:
        print(f"  ... and {len(differing) - 5} more tensors differ")
    digest = hashlib.sha256()
    for k in sorted(a):
        digest.update(k.encode())
        digest.update(a[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    n = sum(t.numel() for t in a.values())
    print(f"{len(a)} tensors, {n:,} values compared with torch.equal: "
          f"{'ALL BITWISE IDENTICAL' if same else 'MISMATCH'}")
    print(f"sha256 of run (a)'s final weights: {digest.hexdigest()}")
    return same


def main() -> int:
    p = argparse.ArgumentParser(description="ckpt-suite end-to-end demo (kill and exact resume)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=73)
    p.add_argument("--workdir", default=None, help="where to put checkpoints and logs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory afterwards")
    args = p.parse_args()
    if not 0 < args.kill_at < args.steps:
        p.error(f"--kill-at must be between 1 and --steps - 1, got {args.kill_at}")
    work = args.workdir or tempfile.mkdtemp(prefix="ckpt-demo-")
    os.makedirs(work, exist_ok=True)
    dir_a, dir_b = os.path.join(work, "ckpt-uninterrupted"), os.path.join(work, "ckpt-crashed")
    for d in (dir_a, dir_b):
        shutil.rmtree(d, ignore_errors=True)
    weights_a, weights_c = os.path.join(work, "final-a.pt"), os.path.join(work, "final-c.pt")
    metrics_a, metrics_c = os.path.join(work, "metrics-a.json"), os.path.join(work, "metrics-c.json")
    common = ["--steps", str(args.steps), "--every", str(args.every)]
    t0 = time.perf_counter()
    try:
        banner(f"(a) uninterrupted run: {args.steps} steps, 2 DDP ranks (gloo, CPU), "
               f"checkpoint every {args.every} steps\n    -> {dir_a}")
        res = run_job([*common, "--dir", dir_a, "--out-weights", weights_a, "--metrics", metrics_a], work, "a")
        check_ok(res, "a")
        print(f"(a) finished in {res.wall_s:.1f} s wall (including process start-up)")

        banner(f"(b) the same run into a fresh directory, crashed with SIGKILL right after step {args.kill_at}\n"
               f"    -> {dir_b}")
        res = run_job([*common, "--dir", dir_b, "--kill-at-step", str(args.kill_at)], work, "b", expect_kill=True)
        if res.returncodes[0] != -signal.SIGKILL:
            print(f"demo: expected rank 0 to die of SIGKILL, got {describe_codes(res.returncodes)}")
            return 2
        print(f"(b) crashed as intended after {res.wall_s:.1f} s ({describe_codes(res.returncodes)}); "
              f"process group SIGKILLed")
        print(f"what survived on disk (python -m ckpt_engine ls {dir_b}):")
        print(indent(ckpt_cli("ls", dir_b)))

        banner("(c) restart of (b): resume from the newest committed checkpoint and finish the run")
        res = run_job([*common, "--dir", dir_b, "--out-weights", weights_c, "--metrics", metrics_c], work, "c")
        check_ok(res, "c")
        with open(metrics_c) as f:
            mc = json.load(f)
        if mc["resumed_from"] is None:
            print("demo: run (c) did not resume from a checkpoint")
            return 2
        print(f"(c) resumed from step {mc['resumed_from']} (crash was after step {args.kill_at}: "
              f"{args.kill_at - mc['resumed_from']} step(s) redone), restore took {mc['restore_s'] * 1e3:.1f} ms, "
              f"finished in {res.wall_s:.1f} s wall")

        banner("figures: checkpoints of run (a) (2 ranks, each writes its own slice of every tensor)")
        with open(metrics_a) as f:
            figures(json.load(f), args.every)

        banner("proof: final weights of (a) uninterrupted and (c) killed-and-resumed")
        same = compare(weights_a, weights_c)

        banner("python -m ckpt_engine ls / verify")
        for d in (dir_a, dir_b):
            print(f"$ python -m ckpt_engine ls {d}")
            print(indent(ckpt_cli("ls", d)))
        print(f"$ python -m ckpt_engine verify {dir_b}")
        print(indent(ckpt_cli("verify", dir_b)))

        banner(f"RESULT: {'PASS' if same else 'FAIL'}: killed-and-resumed training "
               f"{'matches' if same else 'DOES NOT match'} the uninterrupted run bit for bit "
               f"(demo took {time.perf_counter() - t0:.1f} s)")
        return 0 if same else 1
    finally:
        if args.keep or args.workdir:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
