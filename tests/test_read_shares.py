"""Restore threads read a share each and then take runs from the back of the others' (load/shares.py):
every piece is read once, in runs of neighbouring pieces of one file, and a thread that does not
get to run holds nothing up."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckpt_engine import Checkpointer
from ckpt_engine.format.entries import IndexEntry
from ckpt_engine.load.read import shares_of
from ckpt_engine.load.shares import Shares
from ckpt_engine.storage.local import LocalReader, LocalStorage

PAGE = 4096


def _layout(files: list[list[tuple[int, bool]]]) -> tuple[list[tuple[int, IndexEntry]], dict[int, dict[IndexEntry, int]]]:
    """Pieces of each file (rank): (pages, whether a gap of one page precedes it), back to back."""
    jobs, ends = [], {}
    for rank, pieces in enumerate(files):
        at, ends[rank] = 0, {}
        for i, (pages, gap) in enumerate(pieces):
            at += PAGE if gap else 0
            e = IndexEntry(False, rank * 1000 + i, 0, pages, at, pages * PAGE - 1, f"{rank:08x}{i:08x}")
            ends[rank][e] = at + pages * PAGE  # its padding to the next page included
            jobs.append((rank, e))
            at += pages * PAGE
    return jobs, ends


files = st.lists(st.lists(st.tuples(st.integers(1, 6), st.booleans()), min_size=1, max_size=25), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(files, st.integers(1, 4), st.integers(1, 12), st.lists(st.integers(0, 3), max_size=200))
def test_every_piece_is_claimed_once_in_runs_of_neighbours_within_the_span(files, threads, span_pages, turns):
    jobs, ends = _layout(files)
    groups = shares_of(jobs, threads)
    shares, run_max = Shares(groups, ends), span_pages * PAGE
    claimed: list[tuple[int, int, list[IndexEntry]]] = []  # (thread, rank, run)
    order = [t % len(groups) for t in turns] + [k for k in range(len(groups)) for _ in range(len(jobs) + 1)]
    for k in order:  # threads claiming in any interleaving, then each until nothing is left
        got = shares.claim(k, run_max)
        if got is not None:
            claimed.append((k, *got))
    assert all(shares.claim(k, run_max) is None for k in range(len(groups)))
    flat = sorted(((rank, e.offset) for _, rank, run in claimed for e in run))
    assert flat == sorted((rank, e.offset) for rank, e in jobs)  # every piece exactly once
    for _, rank, run in claimed:
        assert all((rank, e) in jobs for e in run)  # of the file it names
        assert all(ends[rank][a] == b.offset for a, b in zip(run, run[1:]))  # neighbours, in file order
        assert len(run) == 1 or ends[rank][run[-1]] - run[0].offset <= run_max
    for k, group in enumerate(groups):  # a thread reads its own share from the front, in order
        mine = {e for _, e in group}
        own = [e for t, _, run in claimed if t == k for e in run if e in mine]
        assert own == [e for _, e in group][:len(own)]


def test_a_thread_done_with_its_share_takes_the_others_from_their_back():
    jobs, ends = _layout([[(1, False)] * 8])
    shares = Shares(shares_of(jobs, 2), ends)  # 4 pieces each
    offsets = [e.offset // PAGE for e in [run for _ in range(2) for run in shares.claim(0, PAGE)[1]]]
    assert offsets == [0, 1]  # its own, from the front
    assert [shares.claim(1, PAGE)[1][0].offset // PAGE] == [4]  # the other starts on its own
    rest = [shares.claim(0, PAGE)[1][0].offset // PAGE for _ in range(5)]
    assert rest == [2, 3, 7, 6, 5]  # its own first, then the other's from the back
    assert shares.claim(0, PAGE) is None and shares.claim(1, PAGE) is None


def test_after_stop_no_run_is_handed_out():
    jobs, ends = _layout([[(1, False)] * 4])
    shares = Shares(shares_of(jobs, 2), ends)
    assert shares.claim(0, PAGE) is not None
    shares.stop()
    assert shares.claim(0, PAGE) is None and shares.claim(1, PAGE) is None


def test_a_read_thread_that_does_not_get_to_run_holds_the_load_up_for_nothing(tmp_path, monkeypatch):
    """With fixed shares the other thread read its half and waited: the load took as long as the
    late thread (here it waits, up to 20 s, until every byte was read). Now the other thread reads it all."""
    state = {f"w{i}": torch.randn(1 << 18) for i in range(16)}  # 16 MiB: 16 pieces of 1 MiB
    ck = Checkpointer(str(tmp_path / "ck"), read_threads=2)
    ck.save(state, 1)
    ck.wait()
    total = sum(t.numel() * t.element_size() for t in state.values())
    read: dict[str, int] = {}
    opened, lock, everything, timed_out = [], threading.Lock(), threading.Event(), []
    open_reader, read_steps = LocalStorage.reader, LocalReader.read_steps

    def reader(self, rel):
        with lock:
            opened.append(threading.current_thread().name)
            late = len(opened) == 2  # the second thread to open the data file
        if late and not everything.wait(20):
            timed_out.append(True)
        return open_reader(self, rel)

    def steps(self, offset, requests, landed):
        read_steps(self, offset, requests, landed)
        with lock:
            me = threading.current_thread().name
            read[me] = read.get(me, 0) + sum(len(v) for r in requests for v in r)
            if sum(read.values()) >= total:
                everything.set()

    monkeypatch.setattr(LocalStorage, "reader", reader)
    monkeypatch.setattr(LocalReader, "read_steps", steps)
    loaded = ck.load()
    assert len(opened) == 2 and not timed_out  # every byte was read while the late thread waited
    assert read.get(opened[1], 0) == 0 and read[opened[0]] >= total  # the first thread read it all
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    ck.close()


@pytest.mark.parametrize("threads", [2, 3])
def test_a_failed_read_stops_the_other_threads_at_their_current_run(tmp_path, monkeypatch, threads):
    """One thread's read fails (a storage error): the others read no further run, and load() raises it."""
    state = {f"w{i}": torch.randn(1 << 18) for i in range(24)}
    ck = Checkpointer(str(tmp_path / "ck"), read_threads=threads)
    ck.save(state, 1)
    ck.wait()
    calls, lock, stopped = [0], threading.Lock(), threading.Event()
    read_steps, stop = LocalReader.read_steps, Shares.stop

    def stopping(self):
        stop(self)
        stopped.set()

    def steps(self, offset, requests, landed):
        with lock:
            calls[0] += 1
            first = calls[0] == 1
        if first:
            raise OSError("disk went away")
        assert stopped.wait(60), "the failed thread never stopped the claims"
        read_steps(self, offset, requests, landed)

    monkeypatch.setattr(Shares, "stop", stopping)
    monkeypatch.setattr(LocalReader, "read_steps", steps)
    monkeypatch.setattr(LocalReader, "run_max", 1 << 20)  # a run per piece: a share is many runs
    with pytest.raises(OSError, match="disk went away"):
        ck.load()
    assert calls[0] <= threads  # the failing run, and at most the one each other thread had begun
    ck.close()
