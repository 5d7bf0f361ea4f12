"""What every ``ckpt`` command shares: exit codes, the shared options, opening a root, printing JSON.

Each command module (``ls``, ``verify``, ``inspect``, ``diff``, ``export``, ``gc``) registers its
sub-parser with :class:`Parents` (the option groups built once by :func:`ckpt_engine.cli.build_parser`)
and runs as ``args.fn(args) -> exit code``; :func:`ckpt_engine.cli.main` maps the errors.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Sequence

from .. import progress
from ..storage import Storage, open_storage

OK, DIFFERENT, ERROR = 0, 1, 2
"""Exit codes: success; a verification failure or (``diff``) a difference; a usage, storage or I/O error."""


class UsageError(Exception):
    """A bad argument value (exit code 2)."""


@dataclass(frozen=True)
class Parents:
    """Option groups a command's sub-parser takes as ``parents``.

    ``common``: ``--storage-option`` and ``--quiet`` (every command); ``json``: ``--json``;
    ``path``: the positional checkpoint root; ``step``: ``--step N``.
    """

    common: argparse.ArgumentParser
    json: argparse.ArgumentParser
    path: argparse.ArgumentParser
    step: argparse.ArgumentParser


def storage_options(pairs: Sequence[str], flag: str = "--storage-option") -> dict[str, object]:
    """``["key=value", ...]`` → options; values that parse as JSON are used parsed (numbers, booleans, objects).

    Raises :class:`UsageError` naming ``flag`` for an item without ``=`` or with an empty key.
    """
    opts: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} expects key=value, got {pair!r}")
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return opts


def open_root(args: argparse.Namespace, path: str | None = None) -> Storage:
    """The checkpoint root ``path`` (default ``args.path``) with the ``--storage-option`` values."""
    return open_storage(path or args.path, storage_options(args.storage_option))


def root(storage: Storage) -> str:
    """The root as shown in messages (no trailing slash)."""
    return storage.describe("").rstrip("/") or "/"


def wants_bar(args: argparse.Namespace) -> bool:
    """Whether to draw progress bars: stderr is a terminal and neither ``--quiet`` nor ``--json`` was given."""
    return progress.wanted(args.quiet, getattr(args, "json", False))


def print_json(doc: Any) -> None:
    """``doc`` as one indented JSON document on stdout (NaN and infinities refused)."""
    print(json.dumps(doc, indent=2, allow_nan=False))
