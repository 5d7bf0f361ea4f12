"""Plain-text tables and byte counts for the command line (no colours, no terminal width guessing)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Sequence


def human(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``; bytes below 1 KiB as integers."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def iso(ts: float) -> str:
    """Unix seconds as an ISO 8601 UTC time, to the second."""
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


def duration(seconds: float) -> str:
    """``5400`` → ``"1.5 h"``: ages in messages."""
    for limit, unit, div in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / div:.0f} {unit}" if unit != "h" else f"{seconds / div:.1f} {unit}"
    return f"{seconds / 86400:.1f} d"


def render(headers: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[int] = (),
           indent: str = "") -> list[str]:
    """Rows under headers, columns padded to their widest cell; columns in ``right`` right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append((indent + "  ".join(parts)).rstrip())
    return lines
