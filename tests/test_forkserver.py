"""The test forkserver (tests/forkserver.py): a job forked from it behaves as the fresh
``python SCRIPT`` it replaces (compared with one), is a real process SIGKILL ends with its group, and
runs gloo ranks, DataLoader workers and torch.multiprocessing's spawn."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import forkserver
import pytest
from helpers import proc_stat
from ranks import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a server, real processes

PROBE = r'''
import atexit, faulthandler, json, os, signal, sys, threading, time
import torch

def _annotated(x: int) -> None:  # no ``from __future__ import annotations`` inherited from the server
    pass

sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGXFSZ)
print(json.dumps({
    "argv": sys.argv, "file": __file__, "name": __name__, "spec": repr(__spec__), "package": __package__,
    "loader": type(__loader__).__name__, "main": sys.modules["__main__"].__dict__ is globals(),
    "path0": sys.path[0], "cwd": os.getcwd(), "env": os.environ.get("PROBE"), "home": "HOME" in os.environ,
    "faulthandler": faulthandler.is_enabled(), "signals": {s.name: repr(signal.getsignal(s)) for s in sigs},
    "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])), "stdin": os.readlink("/proc/self/fd/0"),
    "leader": os.getpgid(0) == os.getpid() == os.getsid(0), "threads": torch.get_num_threads(),
    "main_thread": threading.current_thread() is threading.main_thread(), "line_buffered": sys.stdout.line_buffering,
    "annotations": _annotated.__annotations__["x"] is int,
}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
atexit.register(print, "atexit ran")
if sys.argv[1] == "raise":
    raise ValueError("from the probe")
sys.exit(sys.argv[1] if not sys.argv[1].isdigit() else int(sys.argv[1]))
'''


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return str(path)


def test_a_forked_job_sees_and_ends_as_a_fresh_interpreter_does(probe, tmp_path):
    env = dict(os.environ, PROBE="x", PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, probe, "3"]
    forked = forkserver.launch(cmd, env=env, cwd=str(tmp_path))
    assert isinstance(forked, forkserver.Job)
    fresh = subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out, _ = forked.communicate(timeout=120)
    expected, _ = fresh.communicate(timeout=120)
    assert (forked.returncode, out) == (fresh.returncode, expected) == (3, expected)
    assert out.splitlines()[1:] == ["to stderr", "thread joined", "atexit ran"]  # threads joined before atexit
    seen = json.loads(out.splitlines()[0])
    assert seen["leader"] and seen["threads"] == 1 and seen["faulthandler"] and seen["stdin"] == os.devnull
    assert proc_stat(forked.pid) is None  # reaped once its status was read (the server is its parent)


def test_exit_statuses_tracebacks_and_separate_stderr_as_python_reports_them(probe):
    raised = forkserver.run([sys.executable, probe, "raise"], timeout=120)
    assert raised.returncode == 1 and raised.stdout.splitlines()[-1] == "atexit ran"
    assert raised.stderr.startswith("to stderr\nTraceback (most recent call last):\n")
    line = PROBE.splitlines().index('    raise ValueError("from the probe")') + 1
    assert f'File "{probe}", line {line}, in <module>' in raised.stderr and "forkserver" not in raised.stderr
    assert raised.stderr.endswith("ValueError: from the probe\n")
    message = forkserver.run([sys.executable, probe, "stopped: no data"], timeout=120)
    assert (message.returncode, message.stderr) == (1, "to stderr\nstopped: no data\n")
    missing = forkserver.run([sys.executable, probe + ".missing.py"], timeout=120)
    assert missing.returncode == 2 and "can't open file" in missing.stderr


def test_every_job_draws_fresh_random_seeds(probe, tmp_path):
    script = tmp_path / "seeds.py"
    script.write_text("import random, numpy, torch\nprint(torch.rand(1).item(), numpy.random.rand(), random.random())\n")
    draws = [forkserver.run([sys.executable, str(script)], timeout=120).stdout.split() for _ in range(3)]
    for source in zip(*draws):  # torch, NumPy, random: each differs between the jobs
        assert len(set(source)) == 3, draws


def test_sigkill_of_the_group_ends_the_job_and_what_it_started(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      "print(child.pid, flush=True)\n"
                      "time.sleep(600)\n")
    at_once = forkserver.launch([sys.executable, str(script)])
    os.killpg(at_once.pid, signal.SIGKILL)  # launch returns once the job leads its process group
    assert at_once.wait(timeout=60) == -signal.SIGKILL
    job = forkserver.launch([sys.executable, str(script)])
    child = int(job.stdout.readline())
    assert proc_stat(child)[2] == str(job.pid) and job.poll() is None  # the grandchild is in the job's group
    os.killpg(job.pid, signal.SIGKILL)
    assert job.wait(timeout=60) == -signal.SIGKILL and job.poll() == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while (proc_stat(child) or ["X"])[0] not in ("Z", "X") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (proc_stat(child) or ["X"])[0] in ("Z", "X")
    term = forkserver.launch([sys.executable, str(script)])
    term.stdout.readline()
    term.terminate()  # SIGTERM's default action: the server's handlers are not the job's
    assert term.wait(timeout=60) == -signal.SIGTERM
    os.killpg(term.pid, signal.SIGKILL)


def test_a_timed_out_communicate_leaves_the_job_running_and_a_later_one_gets_everything(tmp_path):
    gate = tmp_path / "gate"
    script = tmp_path / "gated.py"
    script.write_text("import os, sys, time\nprint('before', flush=True)\n"
                      f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\nprint('after')\n")
    job = forkserver.launch([sys.executable, str(script)])
    with pytest.raises(subprocess.TimeoutExpired) as waited:
        job.communicate(timeout=1)
    assert job.poll() is None and waited.value.output in ("", "before\n")
    gate.touch()
    assert job.communicate(timeout=120) == ("before\nafter\n", None) and job.returncode == 0


def test_gloo_ranks_dataloader_workers_and_spawn_run_in_forked_jobs(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(r'''
import os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

def square(i, out):
    torch.save(torch.tensor(i * i), os.path.join(out, f"spawned-{i}.pt"))

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    batches = [b.tolist() for b in DataLoader(list(range(8)), batch_size=4, num_workers=2)]
    if dist.get_rank() == 0:
        mp.spawn(square, args=(sys.argv[1],), nprocs=2)  # fresh interpreters that import this script
    dist.destroy_process_group()
    print(t.item(), batches, os.getpid() != os.getpgid(0) or "leader", flush=True)
''')
    port = str(free_port())
    jobs = [forkserver.launch([sys.executable, str(script), str(tmp_path)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port))
            for r in range(2)]
    outs = [job.communicate(timeout=240)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outs
    assert [out.splitlines()[-1] for out in outs] == ["3.0 [[0, 1, 2, 3], [4, 5, 6, 7]] leader"] * 2
    import torch

    assert [torch.load(tmp_path / f"spawned-{i}.pt").item() for i in range(2)] == [0, 1]


def test_the_switch_and_a_start_up_the_server_cannot_give_fall_back_to_a_subprocess(tmp_path, monkeypatch):
    script = tmp_path / "plain.py"
    script.write_text("import os, sys\nprint(sys.argv[1], os.environ.get('PYTHONHASHSEED'))\n")
    cmd = [sys.executable, str(script), "ok"]
    assert isinstance(forkserver.launch(cmd, env=dict(os.environ, OMP_NUM_THREADS="2")), forkserver.Job)
    fallbacks = [forkserver.launch(cmd, env=dict(os.environ, PYTHONHASHSEED="7")),  # read at start-up only
                 forkserver.launch([sys.executable, "-c", "print('ok None')", "x"])]  # not a script
    monkeypatch.setenv(forkserver.SWITCH, "0")
    fallbacks.append(forkserver.launch(cmd))
    outs = [p.communicate(timeout=120)[0] for p in fallbacks]
    assert [type(p) for p in fallbacks] == [subprocess.Popen] * 3
    assert outs == ["ok 7\n", "ok None\n", "ok None\n"] and [p.returncode for p in fallbacks] == [0, 0, 0]
