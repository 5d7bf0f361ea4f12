"""What the storage servers the tests start (moto, azurite) share: a free loopback port, waiting
until the server answers HTTP, and stopping it."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, url: str, name: str, timeout: float) -> None:
    """Return once ``url`` gets any HTTP answer (an error status counts: the server is up); kill
    ``proc`` and raise when it exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}")
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{name} did not start within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc``, killing it after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
