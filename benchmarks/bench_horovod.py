"""Training overhead of checkpointing in a Horovod job: ours on the disk and through the memory level,
against rank 0's ``torch.save`` (the Horovod examples' way), in paired, alternating rounds; CPU.

Each fit is one ``horovodrun -np <ranks> --gloo`` job of this file (``--job``): ``_plain_job``'s GPT-2-shaped
model on synthetic tokens, Adam under ``hvd.DistributedOptimizer``, one torch thread per rank, a checkpoint
every ``--every`` steps. Per fit: the job's CPU (every rank's ``getrusage``, summed), its wall time (the
slowest rank: training, then the drain of ``close()``), and the CPU of the checkpoint work on the threads that
do it. Overheads paired by round against the fit without checkpoints (``_fit_figures``): median, mean ±
standard error, and whether inside the noise. The method: ``benchmarks/README.md``, section bench_horovod.

Usage::

    .venv/bin/python benchmarks/bench_horovod.py                    # 8 rounds, ~25 min on 2 cores
    .venv/bin/python benchmarks/bench_horovod.py --rounds 1 --steps 20 --width 128   # smoke run
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _common import parser, write_report  # noqa: E402
from _fit_figures import PAIRED, Paired, paired_row, paired_table, run_line, versus  # noqa: E402
from _lightning_job import FitResult, _count_thread_cpu, _rusage_cpu, _threads_cpu, remove_memory  # noqa: E402
from _plain_job import rotated  # noqa: E402

CONTENDERS = {"none": "no checkpointing", "torch_save": "rank 0 torch.save (Horovod's examples)",
              "ours": "ours, disk", "ours_memory": "ours, memory + disk"}
TARGET_VS_PEER = 1 / 3
"""Target: our paired overhead at most a third of the peer's."""


def rank_job(a: argparse.Namespace) -> None:
    """One rank of one fit: train, checkpoint as ``a.contender`` does, write ``rank-<r>.json`` in ``a.out``."""
    _count_thread_cpu()
    import torch

    torch.set_num_threads(1)
    import horovod.torch as hvd

    from _plain_job import GPT, train

    hvd.init()
    torch.manual_seed(0)
    model = GPT(a.vocab, a.seq, a.width, a.layers, heads=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(hvd.rank())
    tokens = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g) for _ in range(8)]
    data = [(t[:, :-1], t[:, 1:]) for t in tokens]
    ck, saves = None, []
    if a.contender.startswith("ours"):
        from horovod_ckpt import HorovodCheckpointer

        disk = os.path.join(a.dir, "ckpt")
        where = {"levels": [{"kind": "memory", "path": a.shm, "job": a.mem_job}, disk]} \
            if a.contender == "ours_memory" else {"dirpath": disk}
        ck = HorovodCheckpointer(**where, model=model, optimizer=opt, every_n_train_steps=a.every, keep_last=3,
                                 save_on_train_end=False, save_on_sigterm=False)

    def after(step: int) -> None:
        cpu = time.thread_time()
        if ck is not None and ck.after_step():
            saves.append((time.thread_time() - cpu) * 1e3)
        elif a.contender == "torch_save" and step % a.every == 0:
            if hvd.rank() == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                           os.path.join(a.dir, f"step-{step % (3 * a.every)}.pt"))  # three newest kept
            saves.append((time.thread_time() - cpu) * 1e3)

    cpu0, wall0 = _rusage_cpu(), time.perf_counter()
    train(lambda b: model(*b), opt, data, a.steps, after=after)
    end_wall = time.perf_counter() - wall0
    if ck is not None:
        ck.close()
    result = {"process_cpu_s": _rusage_cpu(), "fit_cpu_s": _rusage_cpu() - cpu0, "end_wall_s": end_wall,
              "fit_wall_s": time.perf_counter() - wall0, "main_cpu_s": time.thread_time(),
              "threads_cpu_s": _threads_cpu(), "train_cpu_ms": saves,
              "params": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(a.out, f"rank-{hvd.rank()}.json"), "w") as f:
        json.dump(result, f)


def launch(a: argparse.Namespace, contender: str, rnd: int, workdir: str) -> FitResult:
    """One ``horovodrun`` job of ``contender``; the job's figures (CPU summed over ranks, the slowest wall)."""
    out = tempfile.mkdtemp(dir=workdir)
    mem_job = f"hvd-{os.getpid()}-{contender}-{rnd}"
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(a.ranks), "-H",
           f"localhost:{a.ranks}", "--gloo", sys.executable, os.path.abspath(__file__), "--job", "--contender",
           contender, "--out", out, "--dir", out, "--mem-job", mem_job, "--shm", a.shm,
           *(x for k in ("steps", "every", "width", "layers", "vocab", "seq", "batch") for x in (f"--{k}",
                                                                                               str(getattr(a, k))))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        ranks = []
        for path in sorted(glob.glob(os.path.join(out, "rank-*.json"))):
            with open(path) as f:
                ranks.append(json.load(f))
    finally:
        remove_memory(a.shm, mem_job)
        shutil.rmtree(out, ignore_errors=True)
    if done.returncode != 0 or len(ranks) != a.ranks:
        raise RuntimeError(f"{contender} job failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    threads: dict[str, float] = {}
    for r in ranks:
        for k, v in r["threads_cpu_s"].items():
            threads[k] = threads.get(k, 0.0) + v
    fit = FitResult(contender=contender, rep=rnd, process_wall_s=0.0, threads_cpu_s=threads, params=ranks[0]["params"],
                    n_ckpt=len(ranks[0]["train_cpu_ms"]), train_cpu_ms=[x for r in ranks for x in r["train_cpu_ms"]],
                    **{k: sum(r[k] for r in ranks) for k in ("process_cpu_s", "fit_cpu_s", "main_cpu_s")},
                    **{k: max(r[k] for r in ranks) for k in ("end_wall_s", "fit_wall_s")})
    print(f"  {contender:12s} round {rnd}: job CPU {fit.process_cpu_s:6.2f} s, wall {fit.fit_wall_s:6.2f} s, "
          f"{fit.n_ckpt} checkpoints, own CPU {fit.own_cpu_s:5.2f} s", flush=True)
    return fit


def markdown(fits: list[FitResult], a: argparse.Namespace, run: str) -> tuple[str, dict[str, Any]]:
    """The report (the paired table and the verdicts against the peer) and its summary."""
    rows = {n: {"label": label, **paired_row(fits, n)} for n, label in CONTENDERS.items()}
    mb = fits[0].params * 12 / 1e6
    lines = [run, "", f"# bench_horovod: {a.ranks} ranks, GPT-2-shaped model ({fits[0].params / 1e6:.1f} M parameters "
             f"+ Adam: {mb:.0f} MB of state on every rank), {a.steps} steps, a checkpoint every {a.every}, "
             f"{a.rounds} rounds", "", "Overheads of the job (CPU of every rank, wall of the slowest) paired by round "
             "(median / mean ± standard error; `(noise)`: within two standard errors of zero):", "",
             *paired_table({"rows": rows}), ""]
    peer = {k: Paired.of(rows["torch_save"]["paired"][k]) for k in PAIRED}
    for o in ("ours", "ours_memory"):
        for k, (what, _) in PAIRED.items():
            mine = Paired.of(rows[o]["paired"][k])
            lines.append(f"- {what}, {CONTENDERS[o]}: {mine.text()} vs {peer[k].text()}: "
                         f"{versus(mine, peer[k], TARGET_VS_PEER)}")
    return "\n".join(lines) + "\n", rows


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, scratch=None)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--width", type=int, default=256, help="model width (GPT-2 blocks, 4 heads)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--shm", default="/dev/shm/ckpt-suite-bench", help="the memory level's root")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", choices=list(CONTENDERS), default="none", help=argparse.SUPPRESS)
    p.add_argument("--mem-job", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.job:
        rank_job(a)
        return
    workdir, fits = a.dir or tempfile.mkdtemp(prefix="bench_horovod-"), []
    names = list(CONTENDERS)
    try:
        launch(a, "ours", -1, workdir)  # warm-up: imports compiled, page cache
        for rnd in range(a.rounds):
            fits += [launch(a, c, rnd, workdir) for c in rotated(names, rnd + 1)]
    finally:
        if a.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    run = run_line(f"`bench_horovod.py {' '.join(sys.argv[1:])}`")
    text, rows = markdown(fits, a, run)
    write_report(a.out, "bench_horovod", text, {"run": run, "args": vars(a), "rows": rows,
                                                "fits": [r.as_json() for r in fits]})


if __name__ == "__main__":
    main()
