"""``ckpt import SRC ROOT``: another tool's checkpoint written as a checkpoint of ours at ``ROOT``.

Source formats are a small registry, :data:`SOURCES`: each has a ``detect(src, options)`` that
``--format auto`` asks in order and a ``run(args, options)`` that writes the checkpoint and returns
what it wrote (an object with ``root``, ``step``, ``tensors``, ``tensor_bytes`` and ``values``).
A format is added with :func:`register`. The converters live in :mod:`ckpt_engine.interop` and are
imported only when their format is used.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .common import OK, Parents, UsageError, print_json, storage_options
from .table import human


@dataclass(frozen=True)
class Source:
    """A source format of ``ckpt import``."""

    detect: Callable[[str, dict[str, Any]], bool]
    """Whether ``src`` (with its fsspec options) is a checkpoint of this format."""
    run: Callable[[argparse.Namespace, dict[str, Any]], Any]
    """Write ``args.src`` as a checkpoint of ours at ``args.path`` (``args.step``: the step or ``None``)."""
    help: str


SOURCES: dict[str, Source] = {}
"""The formats ``ckpt import`` reads, in the order ``--format auto`` tries them."""


def register(name: str, source: Source) -> None:
    """Add (or replace) source format ``name`` of ``ckpt import``."""
    SOURCES[name] = source


def _dcp_detect(src: str, options: dict[str, Any]) -> bool:
    from ..interop.dcp_import import is_dcp

    return is_dcp(src, options)


def _dcp_run(args: argparse.Namespace, options: dict[str, Any]) -> Any:
    from ..interop.dcp_import import import_dcp

    return import_dcp(args.src, args.path, step=args.step, options=options,
                      storage_options=storage_options(args.storage_option), trust=args.trust)


register("dcp", Source(_dcp_detect, _dcp_run, "a torch.distributed.checkpoint directory (its .metadata)"))


def _lightning_detect(src: str, options: dict[str, Any]) -> bool:
    return src.rstrip("/").endswith(".ckpt")


def _lightning_run(args: argparse.Namespace, options: dict[str, Any]) -> Any:
    from ..interop.lightning import import_lightning

    return import_lightning(args.src, args.path, step=args.step, storage_options=storage_options(args.storage_option),
                            source_options=options, trust=args.trust)


register("lightning", Source(_lightning_detect, _lightning_run, "a Lightning .ckpt file (Trainer.save_checkpoint)"))


def detect(src: str, options: dict[str, Any]) -> str:
    """The first registered format whose ``detect`` accepts ``src``; :class:`UsageError` naming them all otherwise."""
    for name, source in SOURCES.items():
        if source.detect(src, options):
            return name
    looked = "; ".join(f"{name}: {s.help}" for name, s in SOURCES.items())
    raise UsageError(f"{src} is no checkpoint ckpt import reads (looked for {looked}); name one with --format")


def cmd_import(args: argparse.Namespace) -> int:
    """Write the checkpoint at ``args.src`` as one of ours at ``args.path``; print what was written."""
    options = storage_options(args.src_option, "--src-option")
    fmt = detect(args.src, options) if args.format == "auto" else args.format
    result = SOURCES[fmt].run(args, options)
    if args.json:
        print_json({"format": fmt, "src": args.src, **asdict(result)})
    elif not args.quiet:
        print(f"imported {args.src} ({fmt}) to {result.root} as step {result.step}: {result.tensors} tensors "
              f"({human(result.tensor_bytes)}), {result.values} other values")
    return OK


def add_parser(sub: Any, parents: Parents) -> None:
    """Register ``ckpt import`` on the sub-parsers ``sub``."""
    p = sub.add_parser("import", parents=[parents.common, parents.json],
                       help="write another tool's checkpoint (DCP, ...) as a checkpoint of ours")
    p.add_argument("src", help="the checkpoint to import (a directory or file, local path or fsspec URL)")
    p.add_argument("path", help="checkpoint root to write to (local path or fsspec URL); no job may be writing there")
    p.add_argument("--format", default="auto", choices=("auto", *SOURCES),
                   help="source format (default auto: " + ", ".join(f"{n}: {s.help}" for n, s in SOURCES.items())
                   + ")")
    p.add_argument("--step", type=int,
                   help="step of the new checkpoint (default: the source's own, e.g. its 'step', else 0)")
    p.add_argument("--trust", action="store_true",
                   help="the source may run code while it is read (pickled classes); only for checkpoints you trust")
    p.add_argument("--src-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option for SRC (repeatable)")
    p.set_defaults(fn=cmd_import)
