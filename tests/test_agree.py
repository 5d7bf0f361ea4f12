"""``ckpt_engine.agree``: a failure on one rank is raised on every rank (ranks as threads)."""

from __future__ import annotations

from ckpt_engine.agree import on_every_rank, on_rank0
from ckpt_engine.errors import CheckpointError, CorruptionError, StorageError
from ckpt_engine.testing import run_ranks


def test_on_rank0_runs_once_and_every_rank_gets_the_value():
    calls = []

    def fn():
        calls.append(1)
        return {"step": 7}

    assert run_ranks(3, lambda comm: on_rank0(comm, fn)) == [{"step": 7}] * 3
    assert calls == [1]


def test_on_rank0_failure_is_raised_on_every_rank_with_its_class_and_cause():
    def fn():
        raise StorageError("/x/ck exists and is not a directory")

    got = run_ranks(3, lambda comm: on_rank0(comm, fn))
    assert all(isinstance(e, StorageError) for e in got), got
    assert "is not a directory" in str(got[0]) and all("rank 0: " in str(e) and "is not a directory" in str(e)
                                                        for e in got[1:])


def test_on_every_rank_raises_everywhere_when_one_rank_fails():
    def fn(comm):
        if comm.rank == 1:
            raise CorruptionError("rank-00001.bin: checksum mismatch")
        return comm.rank

    got = run_ranks(3, lambda comm: on_every_rank(comm, lambda: fn(comm)))
    assert all(isinstance(e, CorruptionError) for e in got), got
    assert all("rank-00001.bin" in str(e) for e in got)


def test_on_every_rank_returns_each_ranks_own_value_when_all_succeed():
    assert run_ranks(2, lambda comm: on_every_rank(comm, lambda: comm.rank * 10)) == [0, 10]


def test_a_foreign_exception_class_arrives_as_a_checkpoint_error():
    class Mine(Exception):
        pass

    def fn():
        raise Mine("custom")

    got = run_ranks(2, lambda comm: on_rank0(comm, fn))
    assert isinstance(got[0], Mine)
    assert isinstance(got[1], CheckpointError) and "custom" in str(got[1])


def test_one_rank_needs_no_communication():
    class NoComm:
        rank, world_size = 0, 1

        def broadcast(self, value, src=0):
            raise AssertionError("no collective on one rank")

        all_gather = broadcast

    assert on_rank0(NoComm(), lambda: 5) == 5 and on_every_rank(NoComm(), lambda: 6) == 6
