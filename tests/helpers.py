"""Test helpers shared by unit and integration tests."""

from __future__ import annotations

import numpy as np
import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (so NaNs and -0.0 compare bit for bit)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b, path: str = "state") -> None:
    """``a`` and ``b`` are the same nested value, tensors bit for bit, container types included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert torch.equal(bits(a), bits(b)), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and (a == b or (a != a and b != b)), path


def assert_same_samples_once_per_epoch(got: list[dict], ref: list[dict], steps: int, epochs: list[int],
                                       samples: int) -> None:
    """A resumed job saw what an uninterrupted one saw: per rank, its log (step -> ``{"epoch", "ids"}``)
    has every step 1..``steps`` with the reference's rows (the same samples at every step), and over
    all ranks each of ``epochs`` holds every one of ``samples`` exactly once."""
    per_epoch: dict[int, list[int]] = {}
    for rank, (mine, theirs) in enumerate(zip(got, ref, strict=True)):
        assert sorted(mine) == list(range(1, steps + 1)), f"rank {rank}"
        assert mine == theirs, f"rank {rank}"
        for row in mine.values():
            per_epoch.setdefault(row["epoch"], []).extend(row["ids"])
    assert sorted(per_epoch) == sorted(epochs)
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(samples)), f"epoch {epoch}"


def proc_stat(pid: "int | str") -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, session, ...),
    or ``None`` when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def flip_local(root: str, dirname: str, rank: int) -> None:
    """Flip one byte of ``rank``'s first local (per-rank) tensor in its data file of ``dirname``."""
    import json
    import os

    idx = json.loads(open(os.path.join(root, dirname, f"rank-{rank:05d}.index.json"), "rb").read())
    offset = next(e[4] for e in idx["entries"] if e[0] == 1)
    path = os.path.join(root, dirname, f"rank-{rank:05d}.bin")
    raw = bytearray(open(path, "rb").read())
    raw[offset] ^= 0x40
    open(path, "wb").write(bytes(raw))
