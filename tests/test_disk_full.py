"""A full disk: a failed save cleans up after itself, retention makes room, the next save commits.

The storage is the real local one on real files; what makes the "disk" full is either an injected
``ENOSPC`` in the middle of a real write (``FailingStorage``, ``QuotaStorage``: the bytes that fit
are on disk, as a full device leaves them) or, where this sandbox lets us mount one, a real
size-limited tmpfs. No timing decides an outcome: every wait is on the checkpointer's own calls.
"""

from __future__ import annotations

import errno
import os
import uuid

import pytest
import torch

from ckpt_engine import Checkpointer, CheckpointWarning, DiskFullError
from ckpt_engine.storage import StorageWrapper, open_storage
from ckpt_engine.testing import SequentialComm
from ckpt_engine.testing import FailingStorage
from helpers import mounted_tmpfs


def state(v: float, rows: int = 300) -> dict:
    return {"model": {"w": torch.full((rows, 200), v), "b": torch.full((7,), v)}, "step": int(v)}


def dirs_of(root, step: int) -> list[str]:
    return [d for d in os.listdir(root) if d.startswith(f"step-{step:012d}-")]


def files_below(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def used_bytes(root) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


class QuotaStorage(StorageWrapper):
    """The real local storage on a "disk" of ``quota`` bytes (every file below the root counts):
    a write that does not fit writes what does, then fails with ENOSPC, as a full device does."""

    quota: int = 1 << 60

    def write_stream(self, rel, chunks, **kw):
        data = b"".join(bytes(c) for c in chunks)
        room = self.quota - used_bytes(self.path(""))
        if len(data) <= room:
            return super().write_stream(rel, [data], **kw)
        return super().write_stream(rel, _fill_then_fail(data, max(0, room)), **kw)

    def write_atomic(self, rel, data, **kw):
        if len(data) > self.quota - used_bytes(self.path("")):
            return self.run("write", rel, _enospc)
        return super().write_atomic(rel, data, **kw)


def _fill_then_fail(data: bytes, room: int):
    yield data[:room]
    _enospc()


def _enospc():
    raise OSError(errno.ENOSPC, "No space left on device (quota)")


def test_a_failed_save_removes_its_partial_files_and_the_next_save_commits(tmp_path):
    storage = FailingStorage(str(tmp_path))
    ck = Checkpointer(storage, on_error="warn")
    ck.save(state(1.0), 1)
    ck.wait()
    storage.fail_on = "step-000000000002"  # ENOSPC halfway through the data file
    ck.save(state(2.0), 2)
    with pytest.warns(CheckpointWarning) as caught:
        ck.wait()
    assert dirs_of(tmp_path, 2) == [], files_below(tmp_path)  # no partial file of the failed attempt
    message = str(caught[0].message)
    needed = ck.records[-1].bytes
    assert "rank-00000.bin" in message and "full" in message and f"needs {needed} bytes" in message
    assert "bytes free" in message and "keep_last" in message
    assert ck.counters["failed"] == 1 and ck.counters["disk_full"] == 1
    assert not ck.records[-1].committed and "full" in ck.records[-1].error
    storage.fail_on = None
    ck.save(state(3.0), 3)
    ck.close()
    assert ck.steps() == [1, 3] and Checkpointer(str(tmp_path), readonly=True).load()["step"] == 3


def test_a_brief_disk_full_does_not_stop_checkpointing_for_good(tmp_path):
    """The issue's case: another process fills the disk for a moment, one save fails; once that
    space is free again the next save must fit (the failed save's partial file must not stay)."""
    storage = QuotaStorage(str(tmp_path))
    ck = Checkpointer(storage, on_error="warn")
    for s in (1, 2):
        ck.save(state(float(s)), s)
        ck.wait()
    one = used_bytes(tmp_path) // 2  # about one checkpoint
    storage.quota = used_bytes(tmp_path) + one * 3 // 2
    hog = tmp_path / "other-process.dat"
    hog.write_bytes(b"\0" * (one * 8 // 10))  # 0.8 checkpoint: the next save does not fit
    ck.save(state(3.0), 3)
    with pytest.warns(CheckpointWarning, match="full"):
        ck.wait()
    hog.unlink()  # the transient condition clears
    ck.save(state(4.0), 4)
    ck.wait()
    assert ck.steps() == [1, 2, 4] and ck.counters["failed"] == 1
    ck.close()


def test_retention_makes_room_for_a_save_that_cannot_fit(tmp_path):
    """keep_last=2 on a disk that holds two checkpoints and a half: the commit of step 3 would
    delete step 1 anyway, so under ENOSPC step 1 goes first and the write is retried once."""
    storage = QuotaStorage(str(tmp_path))
    ck = Checkpointer(storage, keep_last=2)
    for s in (1, 2):
        ck.save(state(float(s)), s)
        ck.wait(retention=True)
    oldest = dirs_of(tmp_path, 1)[0]
    storage.quota = used_bytes(tmp_path) + used_bytes(tmp_path) // 4
    ck.save(state(3.0), 3)
    with pytest.warns(CheckpointWarning, match=f"removed .*{oldest}.* to make room"):
        ck.wait(retention=True)
    assert ck.steps() == [2, 3] and ck.counters["failed"] == 0 and ck.counters["disk_full"] == 1
    assert ck.records[-1].committed
    ck.close()


def test_without_keep_last_nothing_committed_is_deleted_to_make_room(tmp_path):
    storage = QuotaStorage(str(tmp_path))
    ck = Checkpointer(storage)  # on_error="raise"
    ck.save(state(1.0), 1)
    ck.wait()
    storage.quota = used_bytes(tmp_path) * 3 // 2
    ck.save(state(2.0), 2)
    with pytest.raises(DiskFullError, match="set keep_last"):
        ck.wait()
    assert ck.steps() == [1] and dirs_of(tmp_path, 2) == [] and ck.counters["disk_full"] == 1
    ck.close()


def test_two_ranks_one_disk_full_nothing_committed_every_rank_file_removed(tmp_path):
    """Rank 1 hits ENOSPC in its data file: rank 0 must not commit the attempt, rank 1 removes its
    partial file, rank 0 removes every rank's data and index files (abort markers stay until the
    next commit's retention), and the next save of both ranks commits."""
    comm0, comm1 = SequentialComm.group(2)
    r0 = Checkpointer(open_storage(str(tmp_path)), comm=comm0, on_error="warn")
    failing = FailingStorage(str(tmp_path))
    r1 = Checkpointer(failing, comm=comm1, on_error="warn")
    for ck in (r0, r1):
        ck.save(state(1.0), 1)
    r0.wait()
    r1.wait()
    failing.fail_on = "step-000000000002"
    for ck in (r0, r1):
        ck.save(state(2.0), 2)
    with pytest.warns(CheckpointWarning, match="rank 1 failed"):
        r0.wait()
    with pytest.warns(CheckpointWarning, match="full"):
        r1.wait()
    (attempt,) = dirs_of(tmp_path, 2)
    assert sorted(os.listdir(tmp_path / attempt)) == ["rank-00000.abort.json", "rank-00001.abort.json"]
    assert r0.counters["failed"] == 1 and r1.counters["failed"] == 1 and r1.counters["disk_full"] == 1
    failing.fail_on = None
    for ck in (r0, r1):
        ck.save(state(3.0), 3)
    r0.wait(retention=True)
    r1.wait()
    assert r0.steps() == [1, 3] and dirs_of(tmp_path, 2) == []
    r1.close()
    r0.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 4 MiB tmpfs (needs root in this sandbox; skipped where mounting is not permitted)."""
    with mounted_tmpfs(tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}", "4m") as where:
        yield where


def test_real_full_tmpfs_a_failed_save_frees_its_space(small_tmpfs):
    root = small_tmpfs / "ck"
    ck = Checkpointer(str(root), on_error="warn")
    for s in (1, 2):
        ck.save(state(float(s), rows=1600), s)  # 1.25 MiB each
        ck.wait()
    one = used_bytes(root) // 2
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    assert 0.8 * one < free < 1.6 * one, (one, free)
    hog = small_tmpfs / "other-process.dat"
    hog.write_bytes(b"\0" * (free - one * 7 // 10))  # the next save does not fit; less than one checkpoint
    ck.save(state(3.0, rows=1600), 3)
    with pytest.warns(CheckpointWarning) as caught:
        ck.wait()
    assert dirs_of(root, 3) == [], files_below(root)
    assert "No space left on device" in str(caught[0].message) and "bytes free" in str(caught[0].message)
    hog.unlink()
    ck.save(state(4.0, rows=1600), 4)
    ck.wait()
    assert ck.steps() == [1, 2, 4]
    ck.close()
