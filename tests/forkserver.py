"""Test jobs forked from a server that imported torch, NumPy, Lightning and the project once.

A rank of a test job (``tests/ranks.py``) or a Lightning job (``tests/lightning_jobs.py``) used to be
a fresh ``python tests/WORKER.py ...``: each paid about 1.5 CPU-seconds importing torch, and a
Lightning job about 5 more for Lightning, before a few hundred milliseconds of work. Here each pytest
process (each pytest-xdist worker) starts one server, ``python tests/forkserver.py ADDRESS``, the first
time it launches such a job; the server imports those modules once (``forkserver_server.PRELOAD``) and forks every
job from itself. A forked job is still a real process, as the old one was:

* its own session and process group (``pgid == pid``: ``os.killpg(pid, SIGKILL)`` kills it and what
  it started), its own address space, the server as its parent (which reports its exit status:
  ``-9`` when SIGKILLed, as ``subprocess.Popen`` says);
* the environment, working directory and ``sys.argv`` it was given, ``sys.path`` as Python makes it
  for a script, the script run as ``__main__`` (its own module, compiled from the file), signal
  handlers as a fresh interpreter has them, ``faulthandler`` on when ``PYTHONFAULTHANDLER`` is set,
  fresh random seeds (torch, NumPy; ``random`` reseeds itself after a fork), stdin ``/dev/null``,
  stdout and stderr on pipes the caller reads (their file descriptors pass over the server's Unix
  socket), and at its end what an interpreter does: non-daemon threads joined, ``atexit`` run.

What a fork cannot give is a fresh interpreter's start-up: the preloaded modules keep the settings
they read from the environment at import. A job whose environment differs from the server's in a
variable read at start-up (``PYTHON*`` other than ``PYTHONFAULTHANDLER``, ``LD_*``, locale, thread
pools other than a numeric ``OMP_NUM_THREADS``, ``TORCH_*``, :data:`STARTUP_ENV`) therefore runs as a
plain subprocess, and so does any command that is not ``[sys.executable, SCRIPT.py, ...]``. Variables
the imports set (Lightning's ``PYTORCH_NVML_BASED_CUDA_CHECK``) are set in every job. The server never
runs a torch operation: its thread pools are first made in the jobs, after the fork.

``CKPT_TEST_FORKSERVER=0`` in the environment of pytest turns the server off: every job is a plain
``subprocess.Popen`` again (for debugging a job as a fresh process). The server stops when its pytest
process exits (``atexit``, or the end of its stdin if pytest dies); a job still running then goes on,
as a subprocess would.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

SWITCH = "CKPT_TEST_FORKSERVER"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver_server.py")
STARTUP_ENV = ("PYTHON", "LD_", "LC_", "LANG", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "MALLOC_", "TORCH_",
               "CKPT_HUGEPAGES")
"""Prefixes of variables read when the interpreter or a preloaded module starts: a job whose value
differs from the server's runs as a plain subprocess (except :data:`REPLAYED`)."""
REPLAYED = ("PYTHONFAULTHANDLER", "OMP_NUM_THREADS")
"""Start-up variables a forked job applies itself (``faulthandler``; ``torch.set_num_threads``)."""
READY_TIMEOUT = 300.0
"""Seconds the first job waits for the server's imports (generous: the 2-core machine is shared)."""


def enabled() -> bool:
    """Whether jobs are forked from the server (``CKPT_TEST_FORKSERVER`` is not ``0``)."""
    return os.environ.get(SWITCH, "1") != "0"


def launch(cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
           merge_stderr: bool = True) -> "Job | subprocess.Popen":
    """Start ``cmd`` as ``subprocess.Popen(cmd, env=env, cwd=cwd, stdout=PIPE, stderr=STDOUT (or PIPE
    when not ``merge_stderr``), text=True, start_new_session=True)`` would: forked from the server when
    it can be (see the module's docstring), else as that very ``Popen``."""
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(cwd or os.getcwd())
    if enabled() and _forkable(cmd, env):
        return _server().launch(cmd, env, cwd, merge_stderr)
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True)``
    through :func:`launch`: on timeout the job is killed and ``subprocess.TimeoutExpired`` raised."""
    proc = launch(cmd, env, cwd, merge_stderr=False)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _forkable(cmd: list[str], env: dict[str, str]) -> bool:
    """A Python script run by this interpreter, in an environment the server's start-up matches."""
    if len(cmd) < 2 or cmd[0] != sys.executable or not cmd[1].endswith(".py"):
        return False
    started = _SERVER_ENV or os.environ
    for name in set(env) | set(started):
        if name.startswith(STARTUP_ENV) and env.get(name) != started.get(name):
            value = env.get(name, "")
            if name not in REPLAYED or (name == "OMP_NUM_THREADS" and not (value.isdigit() and int(value) > 0)):
                return False
    return True


class Job:
    """A job forked by the server, with the parts of ``subprocess.Popen`` the tests use: ``pid``,
    ``args``, ``stdout`` (and ``stderr`` unless merged into ``stdout``) as text streams, ``returncode``
    (negative signal number when a signal killed it), ``poll``, ``wait``, ``communicate``,
    ``send_signal``, ``terminate``, ``kill``. The job stays a zombie, its pid taken, until its status
    was read here (as a ``Popen``'s child until it is waited for)."""

    def __init__(self, args: list[str], pid: int, server: "_Client", conn: socket.socket,
                 stdout: io.TextIOWrapper, stderr: io.TextIOWrapper | None) -> None:
        self.args, self.pid, self.stdout, self.stderr, self.stdin = args, pid, stdout, stderr, None
        self.returncode: int | None = None
        self._server, self._conn, self._lock = server, conn, threading.Lock()
        self._output: list[_Reader | None] | None = None

    def poll(self) -> int | None:
        """The exit status if the job has ended, else ``None`` (also while another thread waits)."""
        if not self._lock.acquire(blocking=False):
            return self.returncode
        try:
            return self._status(0)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end of the job; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        with self._lock:
            return self._status(timeout)

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Read the job's output to its end and wait for it: ``(stdout, stderr)``, ``stderr`` ``None``
        when merged. On ``subprocess.TimeoutExpired`` the job goes on and a later call continues."""
        assert input is None, "forked jobs read /dev/null"
        if self._output is None:
            self._output = [_Reader(s) if s is not None else None for s in (self.stdout, self.stderr)]
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in filter(None, self._output):
            if not reader.join(deadline):
                raise subprocess.TimeoutExpired(self.args, timeout, output=reader.text())
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return tuple(r.text() if r is not None else None for r in self._output)  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the job's process (nothing once its status was read, as ``Popen`` does)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()

    def __del__(self) -> None:
        self._conn.close()  # the server then reaps the job (now, or when it ends)

    def _status(self, timeout: float | None) -> int:
        """The server's report of the job's end, waiting up to ``timeout`` seconds for it (``_lock`` held)."""
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                msg = self._conn.recv(4096)
            except (BlockingIOError, socket.timeout):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not msg:
                raise RuntimeError(f"the test forkserver ended before job {self.pid} ({self.args}) did; "
                                   f"its log: {self._server.log_tail()}")
            self.returncode = json.loads(msg)["returncode"]
            self._conn.close()  # the server reaps the job now
        return self.returncode


class _Reader:
    """A stream read to its end by a daemon thread (what ``communicate`` collects)."""

    def __init__(self, stream: io.TextIOWrapper) -> None:
        self._chunks: list[str] = []
        self._stream = stream
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._stream:
            self._chunks.append(line)
        self._stream.close()

    def join(self, deadline: float | None) -> bool:
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def text(self) -> str:
        return "".join(self._chunks)


class _Client:
    """This process's server: started on first use, stopped at exit."""

    def __init__(self) -> None:
        self.name = f"ckpt-forkserver-{os.getpid()}-{uuid.uuid4().hex}"  # abstract: nothing on disk
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, SERVER, self.name], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT)
        if not ready or self.proc.stdout.readline() != b"ready\n":
            self.proc.kill()
            raise RuntimeError(f"the test forkserver did not start in {READY_TIMEOUT:.0f} s "
                               f"(status {self.proc.poll()}): {self.log_tail()}")

    def launch(self, cmd: list[str], env: dict[str, str], cwd: str, merge_stderr: bool) -> Job:
        pipes = [os.pipe() for _ in range(1 if merge_stderr else 2)]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect("\0" + self.name)
            request = json.dumps({"argv": cmd, "env": env, "cwd": cwd}).encode()
            socket.send_fds(conn, [request], [w for _, w in pipes])
            reply = json.loads(conn.recv(1 << 16) or b'{"error": "no reply"}')
        except BaseException:
            conn.close()
            for r, _ in pipes:
                os.close(r)
            raise
        finally:
            for _, w in pipes:
                os.close(w)
        if "pid" not in reply:
            conn.close()
            raise RuntimeError(f"the test forkserver could not start {cmd}: {reply.get('error')}; "
                               f"its log: {self.log_tail()}")
        streams = [io.TextIOWrapper(io.open(r, "rb")) for r, _ in pipes]
        return Job(cmd, reply["pid"], self, conn, streams[0], streams[1] if len(streams) > 1 else None)

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:].decode(errors="replace")

    def stop(self) -> None:
        self.proc.stdin.close()  # the server's signal to stop
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


_SERVER: _Client | None = None
_SERVER_ENV: dict[str, str] | None = None
_SERVER_LOCK = threading.Lock()


def _server() -> _Client:
    """The running server of this process (started, or restarted after it died)."""
    global _SERVER, _SERVER_ENV
    with _SERVER_LOCK:
        if _SERVER is None or _SERVER.proc.poll() is not None:
            if _SERVER is None:
                atexit.register(_stop)
            _SERVER_ENV = dict(os.environ)
            _SERVER = _Client()
        return _SERVER


def _stop() -> None:
    if _SERVER is not None and _SERVER.proc.poll() is None:
        _SERVER.stop()


