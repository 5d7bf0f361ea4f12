"""ckpt-suite demo: checkpoint a Lightning training job, crash it, resume it, prove the resume exact.

Runs ``examples/lightning_train.py`` (a tiny character-level transformer LM, trained with
LightningCLI from ``examples/lightning_cli.yaml``: 2 CPU ranks under ``ddp_spawn``, checkpointed
by ``lightning_ckpt.AsyncShardedCheckpoint(dirpath=checkpoints/tiny-lm, every_n_train_steps=10,
resume=auto)``) three times, each time with the same command line:

  (a) uninterrupted, ``--steps`` steps, in its own working directory;
  (b) the same job in a second working directory, SIGKILLed (its whole process group: the
      launcher and both ranks) right after step ``--kill-at``, in the middle of an epoch;
  (c) the same command again in (b)'s directory: ``resume=auto`` finds the newest committed
      checkpoint, continues mid-epoch at the next unseen batch and finishes.

Then it prints the step (c) resumed from, the per-checkpoint figures that the callback appends
to ``checkpoints/tiny-lm/figures.jsonl``, an overhead estimate, the proof that the final weights
and optimizer state of (a) and (c) are bitwise identical (exit status 1 if not), and
``python -m ckpt_engine ls`` / ``verify`` of the checkpoint directories. The kill and the final
state come from a small callback in ``lightning_train.py`` switched on by ``CKPT_DEMO_KILL_AT``
and ``CKPT_DEMO_WEIGHTS``. Needs nothing but the project's virtualenv; about 1 minute on 2 cores.

    .venv/bin/python examples/demo.py [--steps 60 --kill-at 37] [--keep]
    .venv/bin/python examples/demo.py --plain [...]   # the same demo with plain PyTorch DDP
                                                      # (examples/plain_train.py; --help there)

The plain-PyTorch demo (``--plain``) runs ``examples/plain_train.py`` (the same kind of model in a
hand-written DDP loop, 2 gloo ranks on CPU, ``ckpt_engine.Checkpointer`` called directly) three times:

  (a) uninterrupted: ``--steps`` steps, a checkpoint every ``--every`` steps;
  (b) the same job into a second directory, SIGKILLed right after step ``--kill-at``
      (both rank processes; the demo then SIGKILLs the job's whole process group);
  (c) a restart of (b): resumes from the newest committed checkpoint and finishes.

Then it prints the checkpoint figures of (a), checks that the final weights of (a) and (c) are
bitwise identical (exit status 1 if not), and lists both checkpoint directories with
``python -m ckpt_engine ls``. Needs nothing but the project's virtualenv; about 40 s on 2 cores.

    .venv/bin/python examples/demo.py --plain [--steps 120 --every 10 --kill-at 73] [--keep]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
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
from typing import Any

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


def show_cli(ls: tuple[str, ...], verify: tuple[str, ...]) -> None:
    """Print ``python -m ckpt_engine ls`` of ``ls`` and ``verify`` of ``verify``."""
    banner("python -m ckpt_engine ls / verify")
    for command, dirs in (("ls", ls), ("verify", verify)):
        for d in dirs:
            print(f"$ python -m ckpt_engine {command} {d}")
            print(indent(ckpt_cli(command, d)))


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


def plain_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="demo.py --plain",
                                description="ckpt-suite end-to-end demo with plain PyTorch DDP (kill and exact resume)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=73)
    p.add_argument("--workdir", default=None, help="where to put checkpoints and logs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory afterwards")
    args = p.parse_args(argv)
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

        show_cli(ls=(dir_a, dir_b), verify=(dir_b,))

        banner(f"RESULT: {'PASS' if same else 'FAIL'}: killed-and-resumed training "
               f"{'matches' if same else 'DOES NOT match'} the uninterrupted run bit for bit "
               f"(demo took {time.perf_counter() - t0:.1f} s)")
        return 0 if same else 1
    finally:
        if args.keep or args.workdir:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

# ---- the Lightning demo (the default) ---------------------------------------------------------
LIGHTNING = os.path.join(HERE, "lightning_train.py")
CONFIG = os.path.join(HERE, "lightning_cli.yaml")
CKPT_DIR = os.path.join("checkpoints", "tiny-lm")  # the callback's dirpath in lightning_cli.yaml

# Lightning's chatter on every start (tips, a deprecation warning from inside Lightning, the
# model summary table...): left out of the streamed output, kept in each run's full log.
NOISE = re.compile("|".join([
    r"Tip: ", r"_pytree\.py", r"isinstance\(treespec", r"tensorboardX", r"log_every_n_steps",
    r"^(GPU|TPU|HPU) available", r"^-{20,}$", r"^distributed_backend=", r"^All distributed processes",
    r"^\s*$", r"^\s+\| Name\s+\| Type", r"^-{10,}", r"^\d+\s+\| \w+\s+\|", r"^\s+\| other params",
    r"^[\d.]+\s+[KMG]?\s*(Trainable|Non-trainable|Total) ", r"^\d+\s+Modules in ", r"^\d+\s+Total Flops",
]))
# Lightning warnings that do not apply here: replaced by one line saying why (once per run).
NOTES = {
    re.compile(r"your dataloader is not resumable"):
        "(Lightning warns that the dataloader is not resumable mid-epoch: it does not know that "
        "AsyncShardedCheckpoint wrapped the sampler, which continues the epoch at the next unseen sample)",
    re.compile(r"The dirpath has changed from .*lightning_logs"):
        "(Lightning's own default ModelCheckpoint notes that its lightning_logs/version_N directory changed: "
        "not the checkpoints of this demo)",
}


@dataclass
class LightningRun:
    returncode: int
    wall_s: float
    log: str
    survivors: int  # processes of the job's group still alive after it ended


def run_lightning(cwd: str, name: str, steps: int, env: dict[str, str], expect_kill: bool = False) -> LightningRun:
    """Run ``lightning_train.py fit`` in ``cwd`` as the leader of a new session (so one killpg
    reaches the launcher and the two ``ddp_spawn`` ranks); stream its output, filtered."""
    os.makedirs(cwd, exist_ok=True)
    cmd = [sys.executable, LIGHTNING, "fit", "--config", CONFIG, "--trainer.max_steps", str(steps)]
    shown = " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd[1:])
    extra = " ".join(f"{k}={v}" for k, v in env.items())
    print(f"$ cd {cwd}\n$ {extra + ' ' if extra else ''}python {shown}", flush=True)
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **env)
    log_path = os.path.join(os.path.dirname(cwd), f"{name}.log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        reader = threading.Thread(target=_stream_filtered, args=(proc, log), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            raise SystemExit(f"demo: job {name} did not finish within {JOB_TIMEOUT_S} s; killed it")
        except BaseException:
            _killpg(proc.pid)
            raise
        wall = time.perf_counter() - start
        deadline = time.monotonic() + 10  # SIGKILL is delivered to the group at once; exits take a moment
        while (survivors := _group_alive(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        _killpg(proc.pid)  # nothing of a finished or crashed job may linger
        reader.join(timeout=10)
    with open(log_path) as f:
        return LightningRun(proc.returncode, wall, f.read(), survivors)


def _stream_filtered(proc: subprocess.Popen, log: Any) -> None:
    assert proc.stdout is not None
    noted: set[str] = set()
    for line in proc.stdout:
        log.write(line)
        log.flush()
        note = next((text for pattern, text in NOTES.items() if pattern.search(line)), None)
        if note is not None:
            if note not in noted:
                noted.add(note)
                print(f"  | {note}", flush=True)
        elif not NOISE.search(line.rstrip("\n")):
            print(f"  | {line.rstrip()}", flush=True)


def _group_alive(pgid: int) -> int:
    """How many live (not zombie) processes are left in process group ``pgid`` (Linux /proc)."""
    alive = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive += 1
    return alive


def lightning_failed(run: LightningRun, name: str) -> None:
    print(f"demo: job {name} failed (exit {run.returncode}); last lines of its full log:")
    print(indent("\n".join(run.log.splitlines()[-40:])))
    raise SystemExit(2)


def read_figures(ckpt_dir: str) -> list[dict]:
    with open(os.path.join(ckpt_dir, "figures.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def figures_table(rows: list[dict], runs: list[str] | None = None, hooks: dict[int, float] | None = None) -> None:
    """The per-checkpoint rows of figures.jsonl (rank 0's own slice: it is what rank 0 records);
    ``hooks``: step -> seconds in the callback's hooks that took that checkpoint (run (a), the demo's timing)."""
    print(f"{'run ' if runs else ''}{'step':>5} {'stall ms':>9} {'snapshot ms':>12} {'persist ms':>11} "
          f"{'commit ms':>10} {'bytes (rank 0)':>15} {'GB/s':>6}  committed" + (" in hooks ms" if hooks else ""))
    for i, r in enumerate(rows):
        hook = ""
        if hooks is not None:
            hook = f"{hooks[r['step']] * 1e3:>12.2f}" if r["step"] in hooks else f"{'(at the end)':>12}"
        print(f"{runs[i] + '   ' if runs else ''}{r['step']:>5} {r['stall_ms']:>9.2f} {r['snapshot_ms']:>12.2f} "
              f"{r['persist_ms']:>11.2f} {r['commit_ms']:>10.2f} {r['bytes']:>15,} {r['gb_per_s']:>6.2f}  "
              f"{'yes' if r['committed'] else 'SKIPPED' if r['skipped'] else 'NO':<9}{hook}".rstrip())


def checkpoint_hooks(final: dict) -> dict[int, float]:
    """Run (a): step -> seconds in the callback's hooks at the steps whose checkpoint those hooks
    took (``on_train_batch_end``; at an epoch's last step also the next ``on_train_epoch_start``,
    where that checkpoint is taken once the epoch's end has run)."""
    hook, between = final["ckpt_hook_s"], final["ckpt_epoch_start_s"]
    return {s: hook.get(s, 0.0) + between.get(s, 0.0) for s in final["ckpt_taken"]}


def overhead(rows: list[dict], final: dict) -> None:
    """What checkpointing cost run (a)'s training loop: the figures.jsonl stalls and the demo
    callback's timings of the checkpoint callback's hooks, over the same checkpoints."""
    steps = final["step_times"]  # step -> batch start..end (includes the callback's on_train_batch_end)
    hook = final["ckpt_hook_s"]  # step -> time inside AsyncShardedCheckpoint.on_train_batch_end
    between = final["ckpt_epoch_start_s"]  # step -> its on_train_epoch_start (between two steps)
    taken = checkpoint_hooks(final)
    train = {s: t - hook.get(s, 0.0) for s, t in steps.items()}
    plain = [train[s] for s in train if s > 1]  # step 1 carries one-time warm-up
    mean_step = statistics.mean(plain)
    print(f"rank 0: mean training step {mean_step * 1e3:.1f} ms (forward + backward + allreduce + AdamW, "
          f"{len(plain)} steps, the checkpoint callback's time taken out)")
    stalls = [r["stall_ms"] / 1e3 for r in rows if r["step"] in taken]
    if taken and stalls:
        print(f"the {len(taken)} checkpoints taken during training (steps {', '.join(map(str, sorted(taken)))}):")
        print(f"  mean stall (Checkpointer.save() on the training thread: encoding, layout, copy into the "
              f"staging buffer; figures.jsonl): {statistics.mean(stalls) * 1e3:.2f} ms")
        others = [t for s, t in hook.items() if s not in taken]
        print(f"  mean time in the callback's hooks that took them (Lightning's checkpoint dictionary, that "
              f"save(), agreeing on the next checkpoint step with rank 1, figures): "
              f"{statistics.mean(taken.values()) * 1e3:.2f} ms; at the other steps (is one due?): "
              f"{statistics.mean(others) * 1e3:.3f} ms")
        saved = sorted(taken)
        every = statistics.median(b - a for a, b in zip(saved, saved[1:])) if len(saved) > 1 else 0
        if every:
            per = statistics.mean(taken.values())
            print(f"one checkpoint every {every:g} steps -> overhead = {per * 1e3:.2f} / ({every:g} x "
                  f"{mean_step * 1e3:.1f}) = {100 * per / (every * mean_step):.2f} % of training time")
    final_rows = [r for r in rows if r["step"] not in taken]
    if final_rows:
        print(f"the final checkpoint (step {final_rows[-1]['step']}, stall {final_rows[-1]['stall_ms']:.2f} ms) is "
              f"taken at the end of training (on_train_end), which then waits for the last commits")
    total_hook = sum(hook.values()) + sum(between.values())
    total = sum(steps.values()) + sum(between.values())
    print(f"measured over the whole run: {total_hook * 1e3:.1f} ms in the callback's hooks out of "
          f"{total:.2f} s of training steps = {100 * total_hook / total:.2f} %")
    print("only the time in those hooks blocks the training loop; persist and commit run on a background "
          "thread while training continues.")


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = obj
    return out


def compare_state(path_a: str, path_c: str) -> bool:
    """Model weights (and buffers) and the optimizer state of (a) and (c): tensors with torch.equal
    (same dtype, shape and bits), everything else (step counts, lr, betas...) with ==."""
    import torch

    a, c = torch.load(path_a, weights_only=True), torch.load(path_c, weights_only=True)
    ok = True
    for part in ("model", "optimizer", "scheduler"):
        fa, fc = _flatten(a[part], "", {}), _flatten(c[part], "", {})
        differing = []
        for k in sorted(fa.keys() | fc.keys(), key=str):
            va, vc = fa.get(k, "<missing>"), fc.get(k, "<missing>")
            if isinstance(va, torch.Tensor) and isinstance(vc, torch.Tensor):
                same = va.dtype == vc.dtype and va.shape == vc.shape and torch.equal(va, vc)
            else:
                same = type(va) is type(vc) and (va == vc or (va != va and vc != vc))  # nan == nan here
            if not same:
                differing.append(k)
        for k in differing[:5]:
            va, vc = fa.get(k), fc.get(k)
            if isinstance(va, torch.Tensor) and isinstance(vc, torch.Tensor) and va.shape == vc.shape:
                detail = f"max |diff| {(va.double() - vc.double()).abs().max():.3e}"
            else:
                detail = f"{va!r} vs {vc!r}"
            print(f"  DIFFERS: {part}: {k}: {detail}")
        if len(differing) > 5:
            print(f"  ... and {len(differing) - 5} more entries of the {part} state differ")
        tensors = [k for k, v in fa.items() if isinstance(v, torch.Tensor)]
        n = sum(fa[k].numel() for k in tensors)
        digest = hashlib.sha256()
        for k in sorted(tensors):
            digest.update(k.encode())
            digest.update(fa[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        print(f"{part + ' state:':<17}{len(tensors):>4} tensors, {n:>9,} values, {len(fa) - len(tensors):>3} other "
              f"entries: {'BITWISE IDENTICAL' if not differing else f'MISMATCH in {len(differing)} entries'}"
              + (f"   sha256 of (a)'s tensors {digest.hexdigest()[:16]}..." if tensors else ""))
        ok = ok and not differing
    return ok


def lightning_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="ckpt-suite end-to-end demo with Lightning (kill and exact resume); "
                                "--plain runs the plain-PyTorch one")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (--trainer.max_steps)")
    # 37: mid-epoch (the epoch is 20 batches), 7 steps after the step-30 checkpoint, so that one has
    # committed even on a busy machine.
    p.add_argument("--kill-at", type=int, default=37, help="SIGKILL the job right after this step in run (b)")
    p.add_argument("--workdir", default=None, help="where to put the runs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory afterwards")
    p.add_argument("--plain", action="store_true", help="run the plain-PyTorch DDP demo instead "
                   "(examples/plain_train.py; see --plain --help)")
    args = p.parse_args(argv)
    if not 0 < args.kill_at < args.steps:
        p.error(f"--kill-at must be between 1 and --steps - 1, got {args.kill_at}")
    work = args.workdir or tempfile.mkdtemp(prefix="ckpt-demo-")
    os.makedirs(work, exist_ok=True)
    dir_a, dir_b = os.path.join(work, "a"), os.path.join(work, "b")
    for d in (dir_a, dir_b):
        shutil.rmtree(d, ignore_errors=True)
    ck_a, ck_b = os.path.join(dir_a, CKPT_DIR), os.path.join(dir_b, CKPT_DIR)
    final_a, final_c = os.path.join(work, "final-a.pt"), os.path.join(work, "final-c.pt")
    t0 = time.perf_counter()
    try:
        banner(f"(a) uninterrupted run: LightningCLI, {args.steps} steps, 2 ranks (ddp_spawn, gloo, CPU), "
               f"AsyncShardedCheckpoint from {os.path.relpath(CONFIG, ROOT)}\n    -> {ck_a}")
        res = run_lightning(dir_a, "a", args.steps, {"CKPT_DEMO_WEIGHTS": final_a})
        if res.returncode:
            lightning_failed(res, "a")
        print(f"(a) finished in {res.wall_s:.1f} s wall (including process start-up)")

        banner(f"(b) the same command in a fresh directory, SIGKILLed (whole process group) right after step "
               f"{args.kill_at}\n    -> {ck_b}")
        res = run_lightning(dir_b, "b", args.steps, {"CKPT_DEMO_KILL_AT": str(args.kill_at)}, expect_kill=True)
        if res.returncode != -signal.SIGKILL:
            print(f"demo: expected the job to die of SIGKILL, got {describe_codes([res.returncode])}")
            if res.returncode > 0:
                lightning_failed(res, "b")
            return 2
        print(f"(b) crashed as intended after {res.wall_s:.1f} s: the launcher and both ranks SIGKILLed together "
              f"({res.survivors or 'no'} process{'es' if res.survivors > 1 else ''} of its group left alive)")
        print(f"what survived on disk (python -m ckpt_engine ls {ck_b}):")
        print(indent(ckpt_cli("ls", ck_b)))
        rows_b = read_figures(ck_b)

        banner("(c) the same command again in (b)'s directory: resume=auto continues from the newest committed "
               "checkpoint")
        res = run_lightning(dir_b, "c", args.steps, {"CKPT_DEMO_WEIGHTS": final_c})
        if res.returncode:
            lightning_failed(res, "c")
        import torch

        fa, fc = torch.load(final_a, weights_only=True), torch.load(final_c, weights_only=True)
        if fc["resumed_from"] is None:
            print("demo: run (c) did not resume from a checkpoint")
            return 2
        if fa["resumed_from"] is not None:
            print(f"demo: run (a) resumed from step {fa['resumed_from']}, not a fresh start (stale directory?)")
            return 2
        redone = args.kill_at - fc["resumed_from"]
        print(f"(c) RESUMED FROM STEP {fc['resumed_from']} (crash was right after step {args.kill_at}: "
              f"{redone} step(s) redone), finished at step {fc['global_step']} in {res.wall_s:.1f} s wall")
        per_epoch = fc.get("batches_per_epoch") or 0
        if per_epoch and fc["resumed_from"] % per_epoch == 0:
            print(f"(step {fc['resumed_from']} ends an epoch: that checkpoint was taken after the epoch's end had run, "
                  f"at the next epoch's start, so the resume neither skips nor repeats it)")

        banner(f"figures: {os.path.join('<a>', CKPT_DIR, 'figures.jsonl')} of run (a) (each rank writes its own "
               f"slice of every tensor;\n         rank 0 records its own figures)")
        rows_a = read_figures(ck_a)
        figures_table(rows_a, hooks=checkpoint_hooks(fa))
        print()
        overhead(rows_a, fa)
        print(f"\n{os.path.join('<b>', CKPT_DIR, 'figures.jsonl')} (runs b, then c, appended to the same file):")
        rows_bc = read_figures(ck_b)
        figures_table(rows_bc, runs=["b" if i < len(rows_b) else "c" for i in range(len(rows_bc))])

        banner("proof: final model and optimizer state of (a) uninterrupted vs (c) killed-and-resumed")
        print(f"both at step {fa['global_step']} / {fc['global_step']}; (c) resumed from step {fc['resumed_from']}")
        same = fa["global_step"] == fc["global_step"] and compare_state(final_a, final_c)

        show_cli(ls=(ck_a, ck_b), verify=(ck_a, ck_b))

        banner(f"RESULT: {'PASS' if same else 'FAIL'}: Lightning training killed after step {args.kill_at} and "
               f"resumed from step {fc['resumed_from']} {'matches' if same else 'DOES NOT match'} the uninterrupted "
               f"run bit for bit (weights and optimizer state; demo took {time.perf_counter() - t0:.1f} s)")
        return 0 if same else 1
    finally:
        if args.keep or args.workdir:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--plain" in argv:
        return plain_main([a for a in argv if a != "--plain"])
    return lightning_main(argv)


if __name__ == "__main__":
    sys.exit(main())
