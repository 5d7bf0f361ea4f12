"""Real Lightning jobs for the tests: ``tests/lightning_worker.py`` runs, their outputs, and the
fixtures that choose the Lightning distribution of the jobs (shared by the test_lightning_*.py
modules: no test module imports another)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

import forkserver
import pytest
import torch

WORKER = os.path.join(os.path.dirname(__file__), "lightning_worker.py")
TORCHRUN = (None, "fsdp2", "fsdp2_tp")
"""The worker's ``--strategy`` values (``None``: not given) whose jobs :func:`run` launches as torchrun does."""
FLAVOURS = ("lightning", "pytorch_lightning")


@contextlib.contextmanager
def distribution(name: str):
    """The jobs started in the block use the Lightning distribution ``name`` (they read ``LIGHTNING_PACKAGE``)."""
    before = os.environ.get("LIGHTNING_PACKAGE")
    os.environ["LIGHTNING_PACKAGE"] = name
    try:
        yield name
    finally:
        if before is None:
            os.environ.pop("LIGHTNING_PACKAGE", None)
        else:
            os.environ["LIGHTNING_PACKAGE"] = before


@pytest.fixture(scope="module", autouse=True)
def flavour():
    """The jobs use the unified ``lightning`` distribution. What differs between the two distributions
    (which classes the callback resolves, whose loop calls its hooks, LightningCLI's class checks) is
    checked for both in this process by tests/test_lightning_distributions.py, and in jobs by the tests
    that take :func:`each_distribution`, where a process shows more (SIGTERM through the distribution's
    own exception, the CLI's configuration errors, a Lightning ``.ckpt`` of ours in each)."""
    with distribution("lightning") as name:
        yield name


@pytest.fixture(params=FLAVOURS)
def each_distribution(request):
    """This test runs under both Lightning distributions."""
    with distribution(request.param) as name:
        yield name


class References:
    """Uninterrupted reference runs (40 steps, no interruption), one per DataLoader worker count,
    each run the first time a test asks for it and then shared by every test module of the session,
    also across pytest-xdist workers (a lock file serializes the first run; see ``shared_dir``)."""

    def __init__(self, tmp_path_factory) -> None:
        self._root = shared_dir(tmp_path_factory, "lightning-references")

    def __getitem__(self, workers: int):
        out = self._root / f"ref{workers}"
        with _locked(self._root / f"ref{workers}.lock"):
            if not (out / "done").exists():
                shutil.rmtree(out, ignore_errors=True)  # a run that failed part-way, in another module
                run(out, out / "ck", "--workers", str(workers), "--tag", "ref")
                (out / "done").touch()
        return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference runs: ``uninterrupted[workers]`` is the directory of the 40-step run with that
    many DataLoader workers (run once per test session, whichever module asks first)."""
    return References(tmp_path_factory)


def shared_dir(tmp_path_factory, name: str):
    """A directory every process of this test session sees: under pytest-xdist, beside the workers'
    own base directories (pytest-xdist's documented way to share a fixture's result); otherwise in
    pytest's base temporary directory of this run (never in its parent, which other runs share)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    root.mkdir(exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(path):
    """An exclusive ``flock`` on ``path`` for the block (released by the kernel if the process dies)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def lightning_module(flavour):
    """The trainer package of ``flavour``."""
    import importlib

    return importlib.import_module("lightning.pytorch" if flavour == "lightning" else "pytorch_lightning")


def _value(args: tuple, flag: str, default: str) -> str:
    """The value of ``flag`` in a worker's arguments (the last one given), else ``default``."""
    found = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return found[-1] if found else default


def run(out, ckpt, *args, expect_rc=0) -> subprocess.CompletedProcess:
    """Run the job ``lightning_worker.py OUT CKPT ARGS`` to its end, its exit status ``expect_rc`` unless that
    is ``None``.

    A job of several devices that names no ``--strategy`` (it runs under ``strategy="ddp"``), or names
    ``fsdp2`` or ``fsdp2_tp``, runs as users launch those with ``torchrun``: one process per rank, each
    leading a session of its own, with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``,
    ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``...), so that Lightning starts no process itself; the
    ranks are forked from the test forkserver (Lightning imported once per test process, not once per
    rank). A job that names another strategy (``ddp_spawn``: Lightning's spawn, which pickles the module
    and the callback into fresh interpreters; ``ddp``, ``fsdp1``: Lightning's script launcher) or runs on one
    device is one process forked from the forkserver, which starts the other ranks as Lightning does. The
    result's ``stdout`` holds every rank's output and ``returncode`` the first non-zero exit status in rank
    order."""
    out.mkdir(exist_ok=True)
    devices, nodes = int(_value(args, "--devices", "2")), int(_value(args, "--nodes", "1"))
    strategy = _value(args, "--strategy", "") if "--strategy" in args else None
    cmd = [sys.executable, WORKER, str(out), str(ckpt), *args]
    if devices > 1 and nodes == 1 and strategy in TORCHRUN:
        proc = _torchrun_like(cmd + (["--strategy", "ddp"] if strategy is None else []), devices)
    else:
        proc = forkserver.run(cmd, timeout=300)
    if expect_rc is not None:
        assert proc.returncode == expect_rc, proc.stdout[-8000:] + proc.stderr[-5000:]
    return proc


def _torchrun_like(cmd: list[str], world: int) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node WORLD`` of ``cmd``'s script, as far as its ranks see it (one node)."""
    from ranks import kill_job, start_ranks, torchrun_env

    procs = start_ranks(world, cmd[2:], worker=cmd[1], rank_env=torchrun_env(1, world))
    try:
        outputs = _outputs(procs, timeout=300, grace=60)
    finally:
        kill_job(procs)  # DataLoader workers left behind, or this test failed
    codes = [p.returncode for p in procs]
    return subprocess.CompletedProcess(cmd, next((c for c in codes if c), 0),
                                       "".join(f"[rank {r}]\n{out}" for r, out in enumerate(outputs)), "")


def _outputs(procs: list, timeout: float, grace: float) -> list[str]:
    """Each rank's output once every rank has ended. Once one rank failed, the others get ``grace``
    seconds to end of it (as torchrun's agent stops them), and the job ``timeout`` seconds in all; then
    the ranks still running are SIGKILLed."""
    from ranks import kill_job

    outputs: dict[int, str] = {}
    stop_at = time.monotonic() + timeout
    while len(outputs) < len(procs):
        for r, p in enumerate(procs):
            if r not in outputs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    outputs[r] = p.communicate(timeout=0.1)[0]
        if any(procs[r].returncode for r in outputs):
            stop_at = min(stop_at, time.monotonic() + grace)
        if time.monotonic() > stop_at:
            kill_job([p for r, p in enumerate(procs) if r not in outputs])
    return [outputs[r] for r in range(len(procs))]


def seen(out, tag, rank) -> list[dict]:
    with open(out / f"seen-{tag}-rank{rank}.jsonl") as f:
        return [json.loads(line) for line in f]


def final(out, tag) -> dict:
    return torch.load(out / f"final-{tag}.pt", weights_only=True)


def assert_bitwise(a, b):
    for key in ("model",):
        assert list(a[key]) == list(b[key])
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for p in sa:
        for k in sa[p]:
            assert torch.equal(torch.as_tensor(sa[p][k]), torch.as_tensor(sb[p][k])), (p, k)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


def killed_and_resumed(tmp_path, flags, kill_at: int, restorable, ref=None):
    """Run the job of ``flags`` uninterrupted (into ``tmp_path/ref``, unless ``ref`` holds that run),
    then SIGKILLed at step ``kill_at`` and resumed with the same command: the step restored is one
    of ``restorable`` and the resumed run ends bitwise where the uninterrupted one did.
    Returns ``(ref, restored step)``."""
    from ckpt_engine import Checkpointer

    if ref is None:
        ref = tmp_path / "ref"
        run(ref, ref / "ck", *flags, "--tag", "ref")
    ck = tmp_path / "ck"
    run(tmp_path, ck, *flags, "--kill-at", str(kill_at), "--tag", "killed", expect_rc=None)
    restored = Checkpointer(str(ck)).latest_step()
    assert restored in restorable
    run(tmp_path, ck, *flags, "--tag", "resumed")
    assert json.load(open(tmp_path / "resumed-resumed.json"))["resumed_from"] == restored
    assert_bitwise(final(ref, "ref"), final(tmp_path, "resumed"))
    return ref, restored


def assert_epoch_resplit(out, first: str, before: int, after: int, restored: int, epoch: int, left: int,
                         per_epoch: int, first_out=None, next_batches: int = 2) -> None:
    """The interrupted ``epoch`` saw each of its 256 samples once: the run tagged ``first`` on ``before``
    devices up to step ``restored`` (its files in ``first_out``, default ``out``), the rest re-split among
    ``after`` devices (tag ``resumed``), each of which ran the last ``left`` of the epoch's ``per_epoch``
    batches, then ``next_batches`` of the next epoch."""
    ids = [i for rank in range(before) for row in seen(first_out or out, first, rank)
           if row["epoch"] == epoch and row["step"] <= restored for i in row["ids"]]
    ids += [i for rank in range(after) for row in seen(out, "resumed", rank) if row["epoch"] == epoch
            for i in row["ids"]]
    assert sorted(ids) == list(range(256))
    for rank in range(after):
        assert [(row["epoch"], row["batch"]) for row in seen(out, "resumed", rank)] == (
            [(epoch, b) for b in range(per_epoch - left, per_epoch)] + [(epoch + 1, b) for b in range(next_batches)])
