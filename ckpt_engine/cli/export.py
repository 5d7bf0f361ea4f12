"""``ckpt export``: a checkpoint in a format other tools read without ckpt-suite.

The command line of :func:`ckpt_engine.export`: the formats are written by ``ckpt_engine.interop``
(one file: :mod:`ckpt_engine.interop.files`; a Hugging Face folder: :mod:`ckpt_engine.interop.hf`;
DCP: :mod:`ckpt_engine.interop.dcp`); this module parses the options and prints what was written.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from ..interop.files import FORMATS, export
from ..load.open import open_newest
from .common import OK, Parents, UsageError, open_root, print_json, storage_options, wants_bar
from .table import human


def cmd_export(args: argparse.Namespace) -> int:
    """Write one checkpoint as a plain ``torch.save`` or safetensors file; print what was written."""
    fmt = args.format or ("safetensors" if args.out.endswith(".safetensors") else "torch")
    if fmt == "hf":
        return cmd_hf(args)
    storage = open_root(args)
    opened = open_newest(storage, args.step)
    local_rank = args.local_rank if args.local_rank is not None else (0 if args.include_local else None)
    result = export(storage, opened, args.out, fmt=fmt, flat=args.flat, local_rank=local_rank,
                    out_options=storage_options(args.out_option, "--out-option"), progress=wants_bar(args))
    if args.json:
        print_json(asdict(result))
    elif not args.quiet:
        size = "" if result.file_bytes is None else f", {human(result.file_bytes)}"
        print(f"exported step {result.step} to {result.out} ({result.format}{size}): {result.tensors} tensors "
              f"({human(result.tensor_bytes)}), {result.values} other values")
    return OK


def add_parser(sub: Any, parents: Parents) -> None:
    """Register ``ckpt export`` on the sub-parsers ``sub``."""
    p = sub.add_parser("export", parents=[parents.path, parents.step, parents.common, parents.json],
                       help="write a torch.save, safetensors, Lightning .ckpt, Hugging Face or DCP checkpoint")
    p.add_argument("out", help="output file, or folder for hf and dcp (local path or fsspec URL)")
    p.add_argument("--format", choices=FORMATS, help="default: safetensors if OUT ends in .safetensors, else torch")
    p.add_argument("--flat", action="store_true",
                   help="torch format: a flat {'a.b.c': value} dict instead of the nested state")
    p.add_argument("--include-local", action="store_true", help="add rank 0's local values (see --local-rank)")
    p.add_argument("--local-rank", type=int, help="add this writer rank's local values")
    p.add_argument("--out-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option for OUT (repeatable)")
    p.add_argument("--prefix", help="hf: key prefix of the model's weights in the state, stripped (e.g. model.)")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="hf: largest safetensors shard (default 5GB; e.g. 500MB, 2GiB)")
    p.add_argument("--config", metavar="CONFIG_JSON", help="hf: model config file copied in as config.json")
    p.set_defaults(fn=cmd_export)


def cmd_hf(args: argparse.Namespace) -> int:
    """``ckpt export ROOT OUT_DIR --format hf``: write the folder, print what was written."""
    if args.flat or args.include_local or args.local_rank is not None:
        raise UsageError("--format hf writes the tensors under --prefix only: --flat, --include-local and "
                         "--local-rank are for the torch and safetensors formats")
    if args.prefix is None:
        raise UsageError("--format hf needs --prefix: the key prefix of the model's weights in the state "
                              "(model. for {'model': model.state_dict(), ...}; '' when the state is the state_dict)")
    from ..interop.hf import DEFAULT_MAX_SHARD_SIZE, export_hf  # safetensors' writer, only for this format

    storage = open_root(args)
    opened = open_newest(storage, args.step)
    result = export_hf(storage, opened, args.out, prefix=args.prefix,
                       max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE, config=args.config,
                       out_options=storage_options(args.out_option, "--out-option"), progress=wants_bar(args))
    if args.json:
        print_json(asdict(result))
    elif not args.quiet:
        tied = f"; tied, written once: {', '.join(f'{a} = {b}' for a, b in result.tied.items())}" if result.tied else ""
        skipped = f"; plain values left out: {', '.join(result.skipped)}" if result.skipped else ""
        print(f"exported step {result.step} ({result.prefix or 'every tensor'}) to {result.out} (hf): "
              f"{result.tensors} tensors ({human(result.total_size)}) in {', '.join(result.files)}{tied}{skipped}")
    return OK
