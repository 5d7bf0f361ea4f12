"""Test helpers shared by unit and integration tests."""

from __future__ import annotations

import contextlib

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


def claim_bytes(root: str, dirname: str, tensor: int, nbytes: int) -> str:
    """Make checkpoint ``dirname`` (written by one rank) claim ``nbytes`` for replicated tensor
    ``tensor`` (now 1-D), as a hostile writer can: its piece grows to ``nbytes`` in a data file
    rebuilt sparse (the other pieces copied to their new offsets, the rest a hole: no disk used),
    its index file and manifest rewritten with the new sizes and re-sealed. Only the grown piece's
    checksum is wrong. Returns the tensor's name as errors give it."""
    import json
    import os

    import xxhash

    from ckpt_engine.format.entries import ALIGN
    from ckpt_engine.format.manifest import seal, unseal

    folder = os.path.join(root, dirname)
    mpath, ipath, dpath = (os.path.join(folder, n)
                           for n in ("manifest.json", "rank-00000.index.json", "rank-00000.bin"))
    manifest = json.loads(unseal(open(mpath, "rb").read(), mpath))
    index = json.loads(open(ipath, "rb").read())
    old = open(dpath, "rb").read()
    meta = manifest["tensors"][tensor]
    itemsize = torch.empty(0, dtype=getattr(torch, meta[0])).element_size()
    (mine,) = [e for e in index["entries"] if e[0] == 0 and e[1] == tensor]
    meta[1] = [nbytes // itemsize]
    moved = []
    position = 0
    for e in sorted(index["entries"], key=lambda e: e[4]):
        extent = -(-e[5] // ALIGN) * ALIGN
        moved.append((position, old[e[4]:e[4] + extent]))
        if e is mine:
            e[3], e[5], extent = nbytes // itemsize, nbytes, -(-nbytes // ALIGN) * ALIGN
        e[4] = position
        position += extent
    index["data_bytes"] = position
    with open(dpath, "wb") as f:
        f.truncate(position)
        for at, raw in moved:
            f.seek(at)
            f.write(raw)
    raw_index = json.dumps(index).encode()
    open(ipath, "wb").write(raw_index)
    manifest["ranks"][0].update(data_bytes=position, index_bytes=len(raw_index),
                                index_xxh3=xxhash.xxh3_64_hexdigest(raw_index))
    open(mpath, "wb").write(seal(json.dumps(manifest).encode()))
    return f"'{meta[3]}'"


@contextlib.contextmanager
def mounted_tmpfs(where, size: str):
    """A real tmpfs of ``size`` (``"4m"``) mounted at the new directory ``where`` for the block
    (needs root in this sandbox: the test is skipped where mounting is not permitted)."""
    import subprocess

    import pytest

    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
