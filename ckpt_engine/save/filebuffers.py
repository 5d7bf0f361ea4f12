"""Snapshot buffers that are the memory checkpoint: files in the memory level's tmpfs, mapped.

On a memory level, a CPU snapshot is copied into a :class:`FileBuffer`: a file below the rank's own
directory (``.buffers/buf-N``) mapped shared into the process. Persist then checksums it in place
and commits it by a hard link as the checkpoint's data file (:func:`link_data`) instead of writing
the bytes a second time, so a memory checkpoint costs the snapshot copy and the checksums: no write,
no fresh tmpfs pages. The buffer is reused once no checkpoint links it any more (retention removed
them all: its link count is 1 again), so the pool holds as many as the memory level keeps plus the
ones in flight. A buffer whose size differs from the snapshot's (a CUDA snapshot's staging areas,
a state that changed shape) is written the ordinary way.

When the state lives on a GPU, the buffer's pages are page-locked for CUDA (``cudaHostRegister``,
host/pinning.py), so the device-to-host copy lands in the memory checkpoint itself and is committed by
the same link. Where CUDA refuses to lock them, the snapshot goes to torch's pinned memory
(:class:`~ckpt_engine.save.buffers.HostBuffer`) and is written to the memory level as a file.
"""

from __future__ import annotations

import itertools
import os
import shutil

import torch

from ..host import hugepages, pinning
from ..storage import Storage
from ..storage.local import share_mapping
from .buffers import HostBuffer

BUFFERS = ".buffers"
"""Below a rank's own directory of a memory level: its snapshot buffers."""


class FileBuffer(HostBuffer):
    """A snapshot buffer that is the file ``path`` (``nbytes`` long, zero-filled), mapped shared;
    ``pinned``: page-locked for CUDA copies, or ``OSError`` where CUDA refuses."""

    def __init__(self, path: str, nbytes: int, pinned: bool = False) -> None:
        size = max(nbytes, 1)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # Every page allocated now: a tmpfs that fills up later must not turn the snapshot copy's
            # first touch of a page into SIGBUS. A full one raises OSError (ENOSPC) here instead.
            os.posix_fallocate(fd, 0, size)
            # ...and mapped now, every page: the first write to each page of a fresh shared mapping is
            # a page fault, 176 MiB ~70 ms against ~19 ms for the copy itself, which would otherwise land
            # in the first snapshot into each buffer (tests/test_memory_level.py). Off the GIL: this runs
            # beside training (hugepages.map_file).
            self._map = hugepages.map_file(fd, size, writable=True)
            share_mapping(fd, self._map)  # a flush of a checkpoint linking it reads these pages (storage/local.py)
        except OSError:
            os.close(fd)
            os.remove(path)
            raise
        os.close(fd)
        self.path = path
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        self.pinned = pinned
        if pinned and not pinning.register(self.address, size):
            del self.tensor
            self._map.close()
            os.remove(path)
            raise OSError(f"CUDA could not page-lock the memory level's buffer {path} ({size} bytes)")
        self.event = None
        self._views: dict[tuple, torch.Tensor] = {}

    def linked(self) -> bool:
        """Whether a checkpoint's data file is this file (a hard link to it exists)."""
        try:
            return os.stat(self.path).st_nlink > 1
        except OSError:
            return False

    def reusable(self, nbytes: int) -> bool:
        return self.capacity == max(nbytes, 1) and not self.linked()

    def kept(self) -> bool:
        return self.linked()

    def drop(self) -> None:
        if self.pinned:  # only the lock goes: a flush may still read the pages of a checkpoint linking it
            pinning.unregister(self.address)
            self.pinned = False
        try:
            os.remove(self.path)
        except OSError:
            pass


class FileBuffers:
    """Makes the :class:`FileBuffer` s of one rank in ``directory`` (the pool's ``make``); where one
    cannot be made (the tmpfs is full, CUDA refuses to page-lock it), an ordinary host buffer."""

    def __init__(self, directory: str) -> None:
        shutil.rmtree(directory, ignore_errors=True)  # an earlier incarnation's: its checkpoints keep their links
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._seq = itertools.count()

    def remove(self) -> None:
        """At ``close``: every buffer's name goes, so the memory of those no checkpoint links is
        freed (a job that kept its checkpoints in memory left its unused buffers behind before)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def __call__(self, nbytes: int, pinned: bool) -> HostBuffer:
        try:
            return FileBuffer(os.path.join(self.directory, f"buf-{next(self._seq)}"), nbytes, pinned)
        except OSError:  # the tmpfs is full (writing it reports the full level), or CUDA refused
            return HostBuffer(nbytes, pinned)


def link_data(storage: Storage, rel: str, buffer: HostBuffer, nbytes: int) -> bool:
    """Commit ``buffer``'s bytes as the file ``rel`` of ``storage`` by a hard link, when it is a
    :class:`FileBuffer` of exactly ``nbytes`` on the same filesystem; ``False`` otherwise (the
    caller writes them)."""
    if not isinstance(buffer, FileBuffer) or buffer.capacity != max(nbytes, 1) or nbytes == 0:
        return False
    target = storage.path(rel)
    try:
        os.link(buffer.path, target)
    except OSError:
        return False
    return True
