"""Command line ``ckpt`` (same as ``python -m ckpt_engine``): ls, verify, inspect, diff, export, import, gc.

Every command takes a checkpoint root (a local path or an fsspec URL such as ``s3://bucket/run``)
and ``--storage-option key=value``. Exit codes: 0 success, 1 a verification failure or (``diff``)
a difference, 2 a usage, storage or I/O error. Results go to stdout (``--json``: one JSON
document), errors and progress bars to stderr; bars only on a terminal, never with ``--json`` or
``--quiet``. Each command is one module named after it (its work, ``cmd_<name>`` and its
sub-parser); :mod:`.common` holds what they share; this module assembles the parser and maps
errors to exit codes. See docs/CLI.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .. import __version__
from ..errors import CheckpointError, CorruptionError, FormatError, NoCheckpointError, StorageError
from . import diff, export, gc, import_, inspect, ls, verify
from .common import DIFFERENT, ERROR, Parents, UsageError

COMMANDS = (ls, verify, inspect, diff, export, import_, gc)
"""The command modules, in the order ``ckpt --help`` lists them; each has ``add_parser(sub, parents)``."""


def _parents() -> Parents:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option for the checkpoint root (repeatable; JSON values are parsed)")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars, no summary lines")
    js = argparse.ArgumentParser(add_help=False)
    js.add_argument("--json", action="store_true", help="one machine-readable JSON document on stdout")
    path = argparse.ArgumentParser(add_help=False)
    path.add_argument("path", help="checkpoint root (local path or fsspec URL such as s3://bucket/run)")
    step = argparse.ArgumentParser(add_help=False)
    step.add_argument("--step", type=int, help="step (default: the newest committed checkpoint)")
    return Parents(common=common, json=js, path=path, step=step)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ckpt`` / ``python -m ckpt_engine``: one sub-parser per module of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="ckpt", description="List, check, inspect, compare, export and clean up ckpt-suite checkpoints.",
        epilog="Exit codes: 0 success, 1 verification failure or difference, 2 usage or I/O error.")
    parser.add_argument("--version", action="version", version=f"ckpt-suite {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parents = _parents()
    for command in COMMANDS:
        command.add_parser(sub, parents)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (errors are printed to stderr)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except UsageError as e:
        print(f"ckpt {args.command}: error: {e}", file=sys.stderr)
        return ERROR
    except (CorruptionError, FormatError) as e:
        print(f"ckpt {args.command}: verification failed: {e}", file=sys.stderr)
        return DIFFERENT
    except (NoCheckpointError, StorageError, CheckpointError) as e:
        print(f"ckpt {args.command}: error: {e}", file=sys.stderr)
        return ERROR
    except KeyboardInterrupt:
        print(f"ckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ckpt ls | head`: the reader left; no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
