"""Headroom: how many more bytes of memory this process can have, checked before a read allocates.

Why: a manifest says how large each tensor is, and a reader allocates that much before the first
byte is read, let alone verified. A checkpoint that claims a terabyte (hostile, damaged, or just
too large for this machine) then ends in the allocator's ``RuntimeError`` (outside the
:class:`CheckpointError` family), or, below the machine's size, in gigabytes allocated and filled
before the checksum fails. :func:`refuse_beyond` turns that into an
:class:`~ckpt_engine.errors.InsufficientMemoryError` raised before anything is allocated.

What "can have" means here (:func:`available`): the tightest of

* ``MemAvailable`` of ``/proc/meminfo`` (the kernel's estimate of what can be allocated without
  swapping: free memory plus reclaimable caches);
* the memory cgroup's limit less its usage, at this process's cgroup and every ancestor that sets
  one (v2: ``memory.max`` - ``memory.current``; v1: ``memory.limit_in_bytes`` -
  ``memory.usage_in_bytes``), where the container's allowance is what counts, not the host's;
* ``RLIMIT_AS`` less the address space already mapped (``VmSize``), where it is set.

Each bound that cannot be read (another OS, no cgroup) is left out; with none known, nothing is
refused here (the allocator still is the last word). The parsing is pure (unit-tested on text);
:func:`available` only reads the files: up to about ten small reads, 0.2-0.5 ms on this VM.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import InsufficientMemoryError

CHECK_FROM = 64 << 20
"""Reads that allocate less are not checked: :func:`available` costs 0.2-0.5 ms, against a few
milliseconds for such a read, and a refusal below this size would only preempt the allocator's own
(which the readers turn into the same error)."""

UNLIMITED = 1 << 62
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything from here on is no limit."""


@dataclass(frozen=True)
class Headroom:
    """Bytes this process can still allocate, and which bound says so (for messages)."""

    bytes: int
    source: str


# ---- pure parts -------------------------------------------------------------------------------------
def meminfo_available(text: str) -> int | None:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes (``None`` when absent or malformed)."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) * (1024 if fields[2:3] == ["kB"] else 1)
    return None


def cgroup_room(limit_text: str, usage_text: str) -> int | None:
    """A memory cgroup's limit less its usage (v2 ``memory.max`` / ``memory.current`` or v1
    ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``); ``None`` when there is no limit
    (``max``, or v1's near-2**63) or a text is malformed. Never below 0."""
    limit, usage = limit_text.strip(), usage_text.strip()
    if not limit.isdigit() or not usage.isdigit() or int(limit) >= UNLIMITED:
        return None
    return max(0, int(limit) - int(usage))


def cgroup_paths(text: str) -> tuple[str | None, str | None]:
    """``(v2 path, v1 memory path)`` of a ``/proc/self/cgroup`` text (each ``None`` when absent)."""
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def rlimit_room(soft: int, mapped: int) -> int | None:
    """``RLIMIT_AS`` (soft) less the address space mapped; ``None`` when unlimited."""
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    return max(0, soft - mapped)


def tightest(bounds: Iterable[tuple[str, int | None]]) -> Headroom | None:
    """The smallest of the known bounds ``(source, bytes)``; ``None`` when none is known."""
    known = [Headroom(n, source) for source, n in bounds if n is not None]
    return min(known, key=lambda h: h.bytes) if known else None


def ancestors(root: str, rel: str) -> list[str]:
    """``root/rel`` and each directory above it up to ``root`` itself, deepest first (pure)."""
    parts = [p for p in rel.strip("/").split("/") if p and p not in (".", "..")]
    return [os.path.join(root, *parts[:k]) for k in range(len(parts), -1, -1)]


# ---- reading the system -----------------------------------------------------------------------------
def available(proc: str = "/proc", cgroups: str = "/sys/fs/cgroup") -> Headroom | None:
    """The bytes this process can still allocate: the tightest bound of the module docstring's
    three (``None`` when none can be read). ``proc`` and ``cgroups``: where those file systems
    are (tests point them at a directory of their own)."""
    bounds: list[tuple[str, int | None]] = [("MemAvailable in /proc/meminfo",
                                             meminfo_available(_read(f"{proc}/meminfo") or ""))]
    v2, v1 = cgroup_paths(_read(f"{proc}/self/cgroup") or "")
    if v2 is not None:
        for base in (cgroups, f"{cgroups}/unified"):  # unified alone, or beside v1 (hybrid)
            bounds += _cgroup_bounds(base, v2, "memory.max", "memory.current")
    if v1 is not None:
        bounds += _cgroup_bounds(f"{cgroups}/memory", v1, "memory.limit_in_bytes", "memory.usage_in_bytes")
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        statm = (_read(f"{proc}/self/statm") or "").split()
        mapped = int(statm[0]) * os.sysconf("SC_PAGE_SIZE") if statm and statm[0].isdigit() else 0
        bounds.append((f"RLIMIT_AS of {soft} bytes less {mapped} mapped", rlimit_room(soft, mapped)))
    return tightest(bounds)


def _cgroup_bounds(base: str, rel: str, limit: str, usage: str) -> list[tuple[str, int | None]]:
    """The room of the cgroup at ``rel`` and of each ancestor with a limit. In a container whose
    cgroup namespace hides the path, the path is not there: its root (``base``) is the cgroup."""
    dirs = ancestors(base, rel)
    if not os.path.isdir(dirs[0]):
        dirs = [base]
    out: list[tuple[str, int | None]] = []
    for d in dirs:
        lim = _read(f"{d}/{limit}")
        if lim is None or cgroup_room(lim, "0") is None:
            continue  # no limit there: its usage is not worth a read
        use = _read(f"{d}/{usage}") or ""
        out.append((f"cgroup {d}: {limit} {lim.strip()} less {usage} {use.strip()}", cgroup_room(lim, use)))
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read(1 << 16)
    except (OSError, UnicodeDecodeError):
        return None


# ---- the check --------------------------------------------------------------------------------------
def refuse_beyond(claims: Sequence[tuple[str, int]], where: str, what: str) -> None:
    """Raise :class:`InsufficientMemoryError` when the tensors one call is about to allocate, by
    ``(name, bytes)`` in ``claims``, add up to more than :func:`available`; before any allocation.

    ``where``: the file that claims them (its description); ``what``: the call, for the message
    (e.g. ``"reading step 7"``). Does nothing below :data:`CHECK_FROM` bytes, or when no bound can
    be read.
    """
    needed = sum(n for _, n in claims)
    if needed < CHECK_FROM:
        return
    room = available()
    if room is None or needed <= room.bytes:
        return
    raise too_large(claims, where, what, room)


def too_large(claims: Sequence[tuple[str, int]], where: str, what: str,
              room: Headroom | None) -> InsufficientMemoryError:
    """The error of :func:`refuse_beyond`: the file, the largest tensor, bytes needed and available,
    and the way out (``room`` ``None``: the allocator refused, the bytes available are unknown)."""
    needed = sum(n for _, n in claims)
    name, largest = max(claims, key=lambda c: c[1])
    what_for = (f"tensor {name}" if len(claims) == 1
                else f"{len(claims)} tensors, the largest tensor {name} of {largest} bytes")
    have = ("the allocator refused them" if room is None
            else f"this process can have {room.bytes} more bytes ({room.source}); refused before allocating")
    return InsufficientMemoryError(
        f"{where}: {what} needs {needed} bytes of memory for {what_for}, but {have}. If the checkpoint is genuine, "
        "fill tensors you already hold in place with Checkpointer.load(into=state) (nothing is allocated for "
        "them), or read it on a machine with more memory; if no tensor that large was saved, the manifest is "
        "damaged or hostile")
