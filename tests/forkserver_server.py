"""The server side of ``tests/forkserver.py``: ``python tests/forkserver_server.py NAME``.

It imports :data:`PRELOAD`, listens on the Unix ``SOCK_SEQPACKET`` socket ``NAME`` (in the abstract
namespace: nothing on disk), writes ``ready`` on stdout and then serves, in one thread (a fork copies only the thread
that calls it), each connection once: a request ``{"argv", "env", "cwd"}`` with the job's stdout (and
stderr) file descriptors alongside, one fork, the reply ``{"pid"}``; ``{"returncode"}`` when the job
ends (seen through a pidfd, without reaping it); the job is reaped when the client closes the
connection, so its pid stays taken until the client knows its status. The server stops at the end of
its stdin (its pytest process closed it, or died). It never runs a torch operation.
"""

from __future__ import annotations

import atexit
import builtins
import faulthandler
import importlib
import io
import json
import os
import selectors
import signal
import socket
import sys
import threading
import traceback
import types
from dataclasses import dataclass, field
from importlib.machinery import SourceFileLoader
from typing import Any, NoReturn

PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor", "torch.multiprocessing", "torch.nn.parallel", "torch.utils.data", "xxhash",
           "fsspec", "ckpt_engine", "ckpt_engine.testing", "lightning.pytorch", "pytorch_lightning", "lightning_ckpt")
"""What the server imports once (a module that fails to import is left to the job that needs it)."""


@dataclass(frozen=True)
class Startup:
    """What a fresh interpreter of this server's command line and environment starts with, taken
    before the imports: a forked job is set back to it (with its own environment and arguments)."""

    path: tuple[str, ...]
    """``sys.path`` after the script's directory."""
    handlers: dict[int, Any]
    """Signal handlers."""
    environ: dict[str, str]
    """The server's environment."""
    set_by_imports: dict[str, str] = field(default_factory=dict)
    """Variables the preloaded modules set at import (a job that imports them sets them too)."""


@dataclass(eq=False)
class _Slot:
    """One connection: its job's pid (once forked), pidfd (until it ends) and exit status."""

    conn: socket.socket
    pid: int | None = None
    pidfd: int | None = None
    returncode: int | None = None
    client_gone: bool = False


def serve(name: str) -> None:
    """Preload, listen on the abstract socket ``name``, say ``ready`` and serve until stdin ends (see the module's docstring)."""
    startup = Startup(tuple(sys.path[1:]), _handlers(), dict(os.environ))
    sys.path[:] = startup.path  # the tests' directory is the job's, not the preload's
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except Exception as e:  # the job that needs it fails as it would have without the server
            print(f"forkserver: not preloaded: {module}: {e!r}", file=sys.stderr, flush=True)
    set_by_imports = {k: v for k, v in os.environ.items() if startup.environ.get(k) != v}
    startup = Startup(startup.path, startup.handlers, startup.environ, set_by_imports)
    Server("\0" + name, startup).loop()


def _handlers() -> dict[int, Any]:
    """The current Python-visible signal handlers (those C code set are not restorable, and left)."""
    found = {}
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if handler is not None and sig not in (signal.SIGKILL, signal.SIGSTOP):
            found[sig] = handler
    return found


class Server:
    """The accept / fork / report loop."""

    def __init__(self, address: str, startup: Startup) -> None:
        self.startup = startup
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(address)
        self.listener.listen(128)
        self.sel = selectors.EpollSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, ("accept", None))
        self.sel.register(0, selectors.EVENT_READ, ("control", None))
        self.slots: list[_Slot] = []

    def loop(self) -> None:
        print("ready", flush=True)
        while True:
            for key, _ in self.sel.select():
                what, slot = key.data
                if what == "control" and not os.read(0, 4096):
                    return
                try:
                    if what == "accept":
                        conn, _ = self.listener.accept()
                        self.slots.append(_Slot(conn))
                        self.sel.register(conn, selectors.EVENT_READ, ("conn", self.slots[-1]))
                    elif what == "exit":
                        self._ended(slot)
                    elif what == "conn" and slot.pid is None:
                        self._request(slot)
                    elif what == "conn":
                        self._client_closed(slot)
                except Exception:  # one connection's trouble must not stop the others' jobs
                    traceback.print_exc()

    def _request(self, slot: _Slot) -> None:
        """Fork the job of the connection's request and reply with its pid (or the error)."""
        try:
            msg, fds, _, _ = socket.recv_fds(slot.conn, 1 << 22, 2)
        except OSError:
            msg, fds = b"", []
        try:
            if not msg:
                return self._drop(slot)
            try:
                slot.pid = self._fork(json.loads(msg), fds)
            except Exception:
                slot.conn.send(json.dumps({"error": traceback.format_exc()}).encode())
                return self._drop(slot)
        finally:
            for fd in fds:
                os.close(fd)  # the job has them: its end of output is the client's end of file
        slot.pidfd = os.pidfd_open(slot.pid)
        self.sel.register(slot.pidfd, selectors.EVENT_READ, ("exit", slot))
        try:
            slot.conn.send(json.dumps({"pid": slot.pid}).encode())
        except OSError:
            self._client_closed(slot)  # the job runs on, reaped when it ends

    def _ended(self, slot: _Slot) -> None:
        """The job ended: report its status (``-N`` for signal N), leaving it unreaped."""
        found = os.waitid(os.P_PID, slot.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        if found is None:
            return
        self.sel.unregister(slot.pidfd)
        os.close(slot.pidfd)
        slot.pidfd = None
        slot.returncode = found.si_status if found.si_code == os.CLD_EXITED else -found.si_status
        if not slot.client_gone:
            try:
                slot.conn.send(json.dumps({"returncode": slot.returncode}).encode())
                return
            except OSError:
                pass
        self._client_closed(slot)

    def _client_closed(self, slot: _Slot) -> None:
        """The client is done with the job (it read the status, or let the job go)."""
        if not slot.client_gone:
            slot.client_gone = True
            self.sel.unregister(slot.conn)
            slot.conn.close()
        if slot.returncode is not None:
            self._drop(slot)

    def _drop(self, slot: _Slot) -> None:
        """Forget the connection, reaping its job if it ended."""
        if slot.pid is not None and slot.returncode is not None:
            os.waitpid(slot.pid, 0)
        if not slot.client_gone:
            slot.client_gone = True
            self.sel.unregister(slot.conn)
            slot.conn.close()
        self.slots.remove(slot)

    def _fork(self, request: dict, fds: list[int]) -> int:
        """Fork the job; returns once it leads its own session (so the client may kill its group)."""
        led_r, led_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:
            os.close(led_r)
            os.close(led_w)
            raise
        if pid == 0:
            status = 70
            try:
                os.setsid()
                for fd in self._own_fds() + [led_r, led_w]:
                    os.close(fd)  # closing led_w tells the server the session is made
                become_job(request, fds, self.startup)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(status)
        os.close(led_w)
        os.read(led_r, 1)  # end of file: the job called setsid (or died)
        os.close(led_r)
        return pid

    def _own_fds(self) -> list[int]:
        own = [self.listener.fileno(), self.sel.fileno()]
        for slot in self.slots:
            own += [fd for fd in (slot.conn.fileno(), slot.pidfd) if fd is not None and fd >= 0]
        return own


def become_job(request: dict, fds: list[int], startup: Startup) -> NoReturn:
    """In the forked child: take the job's output, directory, environment, signals, seeds and
    arguments, run its script as ``__main__`` and leave as an interpreter does."""
    null = os.open(os.devnull, os.O_RDONLY)
    for target, fd in ((0, null), (1, fds[0]), (2, fds[-1])):
        os.dup2(fd, target)
    for fd in {null, *fds}:
        os.close(fd)
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    for k, v in startup.set_by_imports.items():
        os.environ.setdefault(k, v)
    for sig, handler in startup.handlers.items():
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError, TypeError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    else:
        faulthandler.disable()
    if torch := sys.modules.get("torch"):
        torch.seed()  # a fresh interpreter's default generator starts from a random seed
        threads = env.get("OMP_NUM_THREADS", "")
        if threads != startup.environ.get("OMP_NUM_THREADS") and threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))  # what the OpenMP runtime reads when it loads
    if numpy := sys.modules.get("numpy"):
        numpy.random.seed()
    script = request["argv"][1]
    sys.argv, sys.orig_argv = list(request["argv"][1:]), list(request["argv"])
    sys.path[:] = [os.path.dirname(os.path.realpath(script)), *startup.path]
    importlib.invalidate_caches()
    finish(*run_main(script))


def run_main(script: str) -> tuple[int, bool]:
    """Run ``script`` as ``__main__`` in a module of its own; returns ``(exit status, interrupted)``
    as ``python SCRIPT`` would end (``SystemExit``'s code, 1 with the traceback printed on an error)."""
    path = os.path.join(os.getcwd(), script)
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = path, builtins
    main.__loader__ = SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    try:
        with io.open_code(path) as f:
            source = f.read()
    except OSError as e:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}", file=sys.stderr)
        return 2, False
    try:
        exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)
    except SystemExit as e:
        return _exit_status(e.code), False
    except BaseException as e:
        e.with_traceback(e.__traceback__.tb_next if e.__traceback__ else None)  # from the script's frame on
        sys.excepthook(type(e), e, e.__traceback__)
        return 1, isinstance(e, KeyboardInterrupt)
    return 0, False


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def finish(status: int, interrupted: bool) -> NoReturn:
    """End as an interpreter does: join non-daemon threads, run ``atexit``, flush the standard
    streams (120 if that fails), and die of SIGINT after an uncaught ``KeyboardInterrupt``."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


if __name__ == "__main__":
    serve(sys.argv[1])
