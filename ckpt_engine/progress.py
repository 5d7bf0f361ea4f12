"""Progress bars for long command-line work (verify, export, diff), on stderr only.

A bar is shown only when stderr is a terminal and the user did not ask for quiet or JSON output,
so piped, logged and machine-readable output never carries bar fragments. Updates may come from
the reader threads of :mod:`ckpt_engine.load.read`, hence the lock.
"""

from __future__ import annotations

import sys
import threading
from typing import IO, Any


def wanted(quiet: bool = False, machine: bool = False, stream: IO[str] | None = None) -> bool:
    """Whether to draw bars: not ``quiet``, not machine-readable output, and ``stream`` a TTY."""
    stream = sys.stderr if stream is None else stream
    if quiet or machine:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real file
        return False


class Bar:
    """A byte counter drawn with tqdm when enabled, a no-op otherwise; use as a context manager.

    ``update(n)`` is thread-safe, so it can be passed as the ``progress`` callback of
    :func:`ckpt_engine.load.read.read_state` and friends.
    """

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._lock = threading.Lock()
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                             file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(self, n: int) -> None:
        """Count ``n`` more bytes done."""
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        """Remove the bar from the terminal."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
