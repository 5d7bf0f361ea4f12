"""The one restore search (ckpt_engine/load/search.py), used by a load or restore on one level and on
several: its rule property-tested over ranks as threads with every mix of failures, then the cases
where the two searches it replaced disagreed, through ``Checkpointer`` (an error that is not a
``CheckpointError`` on a multi-level restore; ``restore_route`` on several levels)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine import Checkpointer
from ckpt_engine.errors import (CorruptionError, FormatError, InsufficientMemoryError, MismatchError,
                                NoCheckpointError, StorageError)
from ckpt_engine.format.entries import data_file
from ckpt_engine.load import exchange
from ckpt_engine.load.search import Read, ends_search, may_try, search
from ckpt_engine.storage import StorageWrapper
from ckpt_engine.testing import run_ranks
from helpers import assert_same
from thread_ranks import TensorComm


# ---- the rule -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("error, ends", [
    (CorruptionError("checksum mismatch"), False), (FormatError("malformed"), False),
    (StorageError("read failed"), False), (InsufficientMemoryError("needs 9 GiB"), False),
    (MismatchError("no key 'w'"), True), (NoCheckpointError("gone"), True),
    (RuntimeError("a bug"), True), (TypeError("into is a list"), True), (MemoryError(), True)])
def test_which_errors_end_the_search(error, ends):
    assert ends_search(error) is ends


@dataclass(frozen=True)
class Cand:
    step: int
    dirname: str
    collective: bool = False


def test_without_fallback_only_copies_of_the_newest_are_tried():
    first = Cand(5, "step-5-b")
    assert may_try(Cand(5, "step-5-b"), first, fallback=False)  # the same checkpoint on a slower level
    assert not may_try(Cand(5, "step-5-a"), first, fallback=False)  # another attempt of the same step
    assert not may_try(Cand(4, "step-4-a"), first, fallback=False)
    assert may_try(Cand(4, "step-4-a"), first, fallback=True)


# ---- the search on ranks as threads, every mix of failures ------------------------------------------
FAILS = {"corrupt": lambda r: CorruptionError(f"checksum mismatch on rank {r}"),
         "mismatch": lambda r: MismatchError(f"no key 'w' on rank {r}"),
         "bug": lambda r: RuntimeError(f"a bug on rank {r}")}


class _Collective:
    """A reading whose finish is collective (an exchange) and fails on the ranks told."""

    collective = True

    def __init__(self, i: int, fail: bool, rank: int) -> None:
        self.i, self.fail, self.rank, self.report = i, fail, rank, {"i": i}

    def finish(self, reports):
        if self.fail:
            raise CorruptionError(f"exchange of candidate {self.i} failed on rank {self.rank}")
        return self.i


def _expected(cands, reads, finishes, fallback) -> tuple[int | None, int]:
    """The model: the index chosen (``None`` when the search ends with an error on every rank), and
    how many candidates every rank read."""
    for i, c in enumerate(cands):
        if not may_try(c, cands[0], fallback):
            return None, i
        failed = [f for f in reads[i] if f is not None]
        if any(f in ("mismatch", "bug") for f in failed):
            return None, i + 1
        if not failed and not (c.collective and any(finishes[i])):
            return i, i + 1
    return None, len(cands)


@st.composite
def cases(draw):
    world = draw(st.integers(1, 4))
    n = draw(st.integers(1, 4))
    # copies of the newest (the same directory on slower levels), another attempt, an older step
    cands = [Cand(9, "step-9-b", draw(st.booleans()))]
    cands += [draw(st.sampled_from([Cand(9, "step-9-b"), Cand(9, "step-9-a"), Cand(8, "step-8-a")]))
              for _ in range(n - 1)]
    cands = [Cand(c.step, c.dirname, draw(st.booleans())) for c in cands]
    reads = [[draw(st.sampled_from([None, None, None, "corrupt", "mismatch", "bug"])) for _ in range(world)]
             for _ in range(n)]
    finishes = [[draw(st.integers(0, 3)) == 0 for _ in range(world)] for _ in range(n)]
    return world, cands, reads, finishes, draw(st.booleans())


@settings(max_examples=80, deadline=None)
@given(cases())
def test_every_rank_ends_at_the_same_candidate_or_raises_and_reads_nothing_after(case):
    world, cands, reads, finishes, fallback = case
    index = {id(c): i for i, c in enumerate(cands)}
    tried: list[list[int]] = [[] for _ in range(world)]

    def job(comm):
        def read(c):
            i = index[id(c)]
            tried[comm.rank].append(i)
            if reads[i][comm.rank] is not None:
                raise FAILS[reads[i][comm.rank]](comm.rank)
            return _Collective(i, finishes[i][comm.rank], comm.rank) if c.collective else Read(i, {"i": i})

        failures: list[str] = []
        try:
            _, got = search(cands, read, comm, rank=comm.rank, fallback=fallback, failures=failures,
                            where=lambda c: c.dirname, scope="here")
        except Exception as e:  # noqa: BLE001 - compared below
            return e, failures
        return got, failures

    results = run_ranks(world, job, timeout=20)
    want, reads_made = _expected(cands, reads, finishes, fallback)
    assert all(not isinstance(r, BaseException) for r in results), results  # no rank left in a collective
    assert all(r[1] == results[0][1] for r in results), "every rank reports the same failures"
    assert tried == [list(range(reads_made))] * world  # in order, together, nothing read after the end
    outcomes = [r[0] for r in results]
    if want is not None:
        assert outcomes == [want] * world
        return
    for rank, o in enumerate(outcomes):
        assert isinstance(o, Exception), outcomes
        # its own error where it failed; elsewhere a CorruptionError naming the ranks that did
        assert f"on rank {rank}" in str(o) or (isinstance(o, CorruptionError) and "rank " in str(o)), (rank, o)


# ---- where the two searches disagreed ----------------------------------------------------------------
def state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": step}


class BuggyStorage(StorageWrapper):
    """The real storage whose reading of a data file fails with an error that is not a
    ``CheckpointError`` (a backend's bug), as a fast level's storage might."""

    def reader(self, rel):
        if rel.endswith(data_file(0)):
            raise RuntimeError(f"backend bug reading {rel} (injected)")
        return super().reader(rel)


def test_an_error_that_is_not_a_checkpoint_error_ends_a_multi_level_restore_as_it_ends_one_level(tmp_path):
    """The multi-level search fell back to the slower level on any exception and the one-level search
    ended on it; both end now (falling back would hide a bug behind an older or slower copy)."""
    l1, l2 = str(tmp_path / "l1"), str(tmp_path / "l2")
    with Checkpointer(levels=[l1, l2]) as ck:
        ck.save(state(1), 1)
        ck.wait(flush=True)
    with Checkpointer(levels=[BuggyStorage(l1), l2]) as ck:
        with pytest.raises(RuntimeError, match="backend bug reading"):
            ck.load(fallback=True)
        assert len(ck.load_failures) == 1 and "level 1" in ck.load_failures[0] and "rank 0" in ck.load_failures[0]
    with Checkpointer(BuggyStorage(l1)) as ck:
        with pytest.raises(RuntimeError, match="backend bug reading"):
            ck.load(fallback=True)
    with Checkpointer(levels=[l1, l2]) as ck:  # nothing wrong with the checkpoint itself
        assert_same(ck.load(), state(1))


def test_restore_route_is_honoured_on_several_levels(tmp_path, monkeypatch):
    """A shared level of a multi-level restore goes the way ``restore_route`` says, as one level does:
    each of 3 ranks reads a share of the state and receives the rest (the multi-level restore read
    everything on every rank whatever the route)."""
    monkeypatch.setattr(exchange, "MIN_PIECE", 4096)
    monkeypatch.setattr("ckpt_engine.load.agreed.node_name", lambda: __import__("threading").current_thread().name)
    l1, l2 = str(tmp_path / "l1"), str(tmp_path / "l2")
    big = {f"w{i}": torch.full((4096,), float(i)) for i in range(6)}

    def save(comm):
        with Checkpointer(levels=[l1, l2], comm=comm) as ck:
            ck.save(big, 1)
            ck.wait(flush=True)

    def restore(comm):
        with Checkpointer(levels=[l1, l2], comm=TensorComm(comm), restore_route="exchange") as ck:
            restored = ck.restore()
            figures = ck.restore_figures
            return restored.step, restored.state, ck.loaded_level, figures and dict(figures.__dict__)

    assert not [r for r in run_ranks(3, save) if isinstance(r, BaseException)]
    results = run_ranks(3, restore)
    for r in results:
        assert not isinstance(r, BaseException), r
        step, got, level, figures = r
        assert step == 1 and level == 0
        assert_same(got, big)
        assert figures is not None and figures["route"] == "exchange" and figures["received_bytes"] > 0, figures
