"""Real multi-process jobs for the tests: gloo ranks of ``tests/dist_worker.py`` and their output.

Shared by the integration and fault-injection tests (no test module imports another). The ranks are
forked from the test forkserver (``tests/forkserver.py``: torch and the project imported once);
``torchrun`` agents are started as users start them.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import forkserver
from helpers import proc_stat

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(world: int, args: list[str], env_extra: dict | None = None,
                worker: str = WORKER, rank_env: list[dict] | None = None) -> list[forkserver.Job | subprocess.Popen]:
    """Start ``world`` ranks of ``worker`` (dist_worker.py) with ``args``, each a process in its own
    session (killable as a group), forked from the test forkserver (``subprocess.Popen``'s interface,
    stdout and stderr merged), with ``faulthandler`` on (a crash prints every thread's stack);
    ``rank_env[r]``: more environment for rank ``r`` alone."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONFAULTHANDLER="1", RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), **(env_extra or {}), **(rank_env[rank] if rank_env else {}))
        procs.append(forkserver.launch([sys.executable, worker, *args], env=env))
    return procs


def torchrun_env(nodes: int, per_node: int) -> list[dict]:
    """What ``torchrun --nnodes NODES --nproc-per-node PER_NODE`` adds to each rank's environment beside
    ``RANK``, ``WORLD_SIZE`` and ``MASTER_*`` (which :func:`start_ranks` sets), by rank: rank ``r`` on
    node ``r // per_node``. With it, Lightning takes the ranks as launched outside
    (``TorchElasticEnvironment``) and the memory level finds each rank's node (``GROUP_RANK``)."""
    world = nodes * per_node
    return [{"LOCAL_RANK": str(r % per_node), "GROUP_RANK": str(r // per_node), "ROLE_RANK": str(r),
             "LOCAL_WORLD_SIZE": str(per_node), "ROLE_WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": str(nodes),
             "TORCHELASTIC_RUN_ID": "test"} for r in range(world)]


def run_ranks(world: int, mode: str, root: str, out, *extra: str, env: dict | None = None,
              rank_env: list[dict] | None = None) -> list[dict]:
    """Run a job to its end (each rank must exit 0) and return every rank's ``rank-N.json`` from ``out``
    (``env``: more environment variables for every rank; ``rank_env[r]``: for rank ``r``)."""
    out.mkdir(exist_ok=True)
    procs = start_ranks(world, [mode, root, str(out), *extra], env, rank_env=rank_env)
    for p in procs:
        output, _ = p.communicate(timeout=240)
        assert p.returncode == 0, output
    return [json.load(open(out / f"rank-{r}.json")) for r in range(world)]


def write_two_ranks(root: str, steps: int = 3) -> None:
    """Save ``make_state(1..steps)`` from 2 real gloo ranks at ``root``."""
    out = tempfile.mkdtemp(prefix="ckpt-two-ranks-")
    try:
        for p in start_ranks(2, ["save", root, out, str(steps)]):
            output, _ = p.communicate(timeout=240)
            assert p.returncode == 0, output
    finally:
        shutil.rmtree(out, ignore_errors=True)


def lines_of(proc) -> "queue.Queue[str]":
    """The process's output lines, read by a daemon thread into a queue (``<eof>`` last)."""
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line.rstrip("\n"))
        q.put("<eof>")

    threading.Thread(target=pump, daemon=True).start()
    return q


def next_line(q, prefix: str, deadline: float) -> str:
    """The next line starting with ``prefix``; fails on end of output or a traceback."""
    while True:
        line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        if line.startswith(prefix):
            return line
        if line == "<eof>":
            raise AssertionError(f"rank 0 exited while waiting for {prefix!r}")
        if "Error" in line or "Traceback" in line:
            raise AssertionError(line)


def kill_job(procs) -> None:
    """SIGKILL every rank's process group and reap them."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (horovodrun puts each rank in its own session, so its process
    group does not reach them): walk /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if fields := proc_stat(entry):
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: forkserver.Job | subprocess.Popen) -> None:
    """SIGKILL the launcher and every descendant, each by pid (collected before any dies, so
    reparenting cannot hide one), and the process groups they lead."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    for pid in pids:  # nothing of the job may survive to write a late file
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and _state(pid) not in ("Z", "X") and time.monotonic() < deadline:
            time.sleep(0.05)


def _state(pid: int) -> str:
    fields = proc_stat(pid)
    return fields[0] if fields else "X"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def torchrun_nodes(nodes: int, per_node: int, script: str, *args: str, expect_ok: bool = True,
                   timeout: float = 300) -> list[str]:
    """``script`` (a path under the repository) on ``nodes`` simulated nodes of ``per_node`` ranks, as
    users launch it: one ``torchrun --nnodes N --node-rank n`` agent per node on this machine (static
    rendezvous on 127.0.0.1, ``GROUP_RANK`` n). Returns each agent's output; with ``expect_ok`` every
    agent must exit 0."""
    port = str(free_port())
    agents = [subprocess.Popen([TORCHRUN, "--nnodes", str(nodes), "--node-rank", str(n), "--nproc-per-node",
                                str(per_node), "--master-addr", "127.0.0.1", "--master-port", port,
                                os.path.join(ROOT, script), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                               env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
              for n in range(nodes)]
    outs = [a.communicate(timeout=timeout)[0] for a in agents]
    if expect_ok:
        assert all(a.returncode == 0 for a in agents), "\n".join(out[-3000:] for out in outs)
    return outs
