"""Naming and listing of checkpoint directories below a root.

Each save attempt gets its own directory ``step-<step:012d>-<attempt>``: the attempt tag is the
job incarnation (agreed once at start) plus a save counter, so all ranks name it alike without
talking, and a step saved again (a resumed job reaching it a second time) goes to a fresh
directory. That is what makes the replacement atomic: readers see the old complete checkpoint
or the new one, chosen by the manifest's ``created_at``, never a mix of files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import CheckpointError
from ..storage import Storage
from .entries import MANIFEST_NAME, MAX_MANIFEST_BYTES
from .manifest import Manifest

_DIR = re.compile(r"step-(\d{12,})-([0-9a-z]{1,64})")
LATEST = "latest"


def dir_name(step: int, attempt: str) -> str:
    """Directory of one save attempt."""
    return f"step-{step:012d}-{attempt}"


def parse_dir(name: str) -> tuple[int, str] | None:
    """``(step, attempt)`` of a checkpoint directory name, or ``None`` for anything else."""
    m = _DIR.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def split_dir(name: str) -> tuple[int, str]:
    """``(step, attempt)`` of a name known to be a checkpoint directory (listed as one, or made by
    :func:`dir_name`); ``ValueError`` naming it otherwise."""
    parsed = parse_dir(name)
    if parsed is None:
        raise ValueError(f"{name!r} is not a checkpoint directory name (step-<step>-<attempt>)")
    return parsed


@dataclass(frozen=True)
class Entry:
    """A committed checkpoint found at the root."""

    step: int
    dirname: str
    manifest: Manifest


def attempt_dirs(storage: Storage) -> list[str]:
    """Every checkpoint directory at the root, committed or not, sorted by name.

    Only real directories count: a file (an object, on object stores) or a symbolic link named
    like one is not a checkpoint (a link could lead out of the root), so listings, ``gc``,
    retention and the start-up sweep leave it alone; :func:`stray_entries` names them for
    ``ckpt ls --all``.
    """
    return [n for n, kind in _named_entries(storage) if kind == _DIRECTORY]


def stray_entries(storage: Storage) -> list[tuple[str, str]]:
    """``(name, what it is)`` of entries named like a checkpoint directory that are not real
    directories (files, links, special files; on object stores, objects)."""
    return [(n, kind) for n, kind in _named_entries(storage) if kind != _DIRECTORY]


_DIRECTORY = "a directory"


def _named_entries(storage: Storage) -> list[tuple[str, str]]:
    """Root entries named like checkpoint directories with what they are, sorted by name."""
    return [(n, kind) for n, kind in storage.entries() if parse_dir(n) is not None]


def readable(storage: Storage) -> list[Entry]:
    """Every committed attempt whose manifest parses and names the directory's step, in
    directory order. A directory whose manifest cannot be parsed is skipped (``verify`` reports it)."""
    found = []
    for name in attempt_dirs(storage):
        step = parse_dir(name)[0]  # type: ignore[index]
        if not storage.exists(f"{name}/{MANIFEST_NAME}"):
            continue
        try:
            manifest = Manifest.from_json(storage.read_bytes(f"{name}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES),
                                          storage.describe(f"{name}/{MANIFEST_NAME}"))
        except CheckpointError:  # unreadable or removed meanwhile: not a checkpoint to list
            continue
        if manifest.step == step:
            found.append(Entry(step, name, manifest))
    return found


def committed(storage: Storage) -> list[Entry]:
    """Committed checkpoints, oldest first; for one step, only the newest committed attempt.

    A directory whose manifest cannot be parsed is skipped here (``verify`` reports it).
    """
    newest: dict[int, Entry] = {}
    for entry in readable(storage):
        old = newest.get(entry.step)
        if old is None or entry.manifest.created_at > old.manifest.created_at:
            newest[entry.step] = entry
    return [newest[s] for s in sorted(newest)]


def manifest_dirs(storage: Storage, step: int | None = None, marker: str = MANIFEST_NAME) -> list[tuple[int, str]]:
    """``(step, dirname)`` of every directory holding a manifest file, parseable or not, sorted.

    Loading and verifying start from the last of these, so a damaged newest manifest raises
    instead of being skipped silently in favour of an older checkpoint. ``marker``: the file that
    commits a directory (a rank's own marker on a node-local level). A symbolic link named like a
    checkpoint directory is listed too, so that reading it raises (the reader refuses links)
    rather than an older checkpoint being loaded without a word.
    """
    found = []
    for name, kind in _named_entries(storage):
        if kind not in (_DIRECTORY, "a symbolic link"):
            continue
        dir_step = parse_dir(name)[0]  # type: ignore[index]
        if (step is None or dir_step == step) and storage.exists(f"{name}/{marker}"):
            found.append((dir_step, name))
    return sorted(found)
