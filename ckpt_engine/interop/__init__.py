"""Other tools' checkpoint formats, in and out: one module per format (issue #38).

Each module converts between a checkpoint of ours and one format another tool reads or writes,
streaming tensor by tensor where the format allows and verifying every byte read from ours.
Nothing here is imported by the core: the ``ckpt`` CLI and the front ends import a module when a
command or option asks for its format.
"""

from __future__ import annotations

from typing import Any


def export(root: str, out: str, *, format: str = "torch", step: int | None = None,
           storage_options: dict[str, Any] | None = None, out_options: dict[str, Any] | None = None,
           prefix: str | None = None, max_shard_size: int | str = "5GB", config: str | None = None,
           flat: bool = False, local_rank: int | None = None) -> Any:
    """What ``ckpt export ROOT OUT --format FORMAT`` does, from Python (``ckpt_engine.export``).

    Writes the newest committed checkpoint at ``root`` (or that of ``step``) to ``out`` as ``format``:
    ``torch`` or ``safetensors`` (one file; ``flat``, ``local_rank`` as ``--flat``, ``--local-rank``),
    ``lightning`` (a Lightning ``.ckpt``), ``hf`` (a ``save_pretrained`` folder of the tensors under
    ``prefix``; ``max_shard_size``, ``config``) or ``dcp`` (a ``torch.distributed.checkpoint``
    directory). Every byte read is verified. Returns what was written (the format's result record).
    Raises :class:`~ckpt_engine.errors.NoCheckpointError` when there is no such checkpoint and
    :class:`ValueError` for an unknown format or a missing ``prefix`` with ``hf``.
    """
    from ..load.open import open_newest
    from ..storage import open_storage
    from .files import FORMATS
    from .files import export as export_one

    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if (prefix is None) == (format == "hf"):
        raise ValueError("prefix is for format='hf' and required there (the weights' key prefix, e.g. 'model.')"
                         if format == "hf" else f"prefix is for format='hf' only, not {format!r}")
    storage = open_storage(root, storage_options or {})
    opened = open_newest(storage, step)
    if format == "hf":
        from .hf import export_hf

        return export_hf(storage, opened, out, prefix=prefix or "", max_shard_size=max_shard_size, config=config,
                         out_options=out_options)
    return export_one(storage, opened, out, fmt=format, flat=flat, local_rank=local_rank, out_options=out_options)
