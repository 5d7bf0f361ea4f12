"""How the gloo test workers end once their work is done and written: without interpreter finalization.

A worker that finished (its results written, ``destroy_process_group()`` called) still sometimes died
with SIGABRT and only ``terminate called without an active exception`` on its output: seen twice in
full suite runs (once in CI), both in 2-rank FSDP2 restores (``test_fsdp1``, ``test_sharded``), never
in 46 reruns of those tests alone (34 with two jobs at once on the 2 cores). That is torch's gloo/C++
threads meeting Python's finalization (pytorch/pytorch#179291, #190489), after the checks this suite
makes, so the workers leave with ``os._exit`` once their output is flushed: the exit status then says
whether the work succeeded.
``faulthandler`` (``PYTHONFAULTHANDLER=1`` from ``ranks.start_ranks``) prints every thread's stack if
a worker still aborts earlier.
"""

from __future__ import annotations

import os
import sys


def leave(status: int = 0) -> None:
    """Flush stdout/stderr and end the process now with ``status`` (no atexit handlers, no finalization)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
