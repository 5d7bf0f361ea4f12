"""The snapshot copy on several threads (``copy_threads``): chunks of the bytes taken in turn, adjacent pieces
in one call, every byte copied once, the same buffer as one thread makes, CPU seconds of every thread counted."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckpt_engine import Checkpointer, LocalComm
from ckpt_engine.save.buffers import HostBuffer
from ckpt_engine.save.copy import SPLIT_MIN, CopyCalls, copy_into, group, moves, piece_moves, plan_copy, split
from ckpt_engine.save.snapshot import Snapshots
from ckpt_engine.state.values import encode


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 1 << 22), min_size=1, max_size=60), st.integers(1, 8))
def test_split_copies_every_byte_once_in_order_in_equal_shares(sizes, parts):
    calls, at = [], 0
    for i, n in enumerate(sizes):  # sources far apart, destinations back to back
        calls.append((at, (i + 1) << 40, n))
        at += n
    cut = split(calls, parts)
    total = sum(sizes)
    assert len(cut) == max(1, min(parts, total))
    flat = [c for run in cut for c in run]
    assert all(n > 0 for _, _, n in flat)  # no empty call
    # in order, back to back in the destination: every byte exactly once
    assert [d for d, _, _ in flat] == list(itertools.accumulate([n for _, _, n in flat], initial=0))[:len(flat)]
    assert sum(n for _, _, n in flat) == total
    for d, s, n in flat:  # each lies inside one original call, at its displacement (same source bytes)
        assert any(cd <= d and d + n <= cd + cn and s - d == cs - cd for cd, cs, cn in calls)
    shares = [sum(n for _, _, n in run) for run in cut]
    assert max(shares) - min(shares) <= 1


def test_moves_merge_the_pieces_of_one_slice_and_resolve_a_view_once():
    t = torch.arange(3 * 1024 * 1024, dtype=torch.float32)  # 12 MiB: 3 pieces of 4 MiB
    tt = torch.arange(64 * 32, dtype=torch.int64).reshape(64, 32).t()  # not contiguous
    snaps = Snapshots(rank=0, world_size=1, max_inflight=1)
    lay, plan = snaps.plan(encode({"t": t, "tt": tt}), encode(None, "local", sharded=False))
    assert [s.nbytes for s, _ in plan.host] == [t.numel() * 4, tt.numel() * 8]  # 3 pieces, 1 span
    buf = HostBuffer(plan.nbytes, pinned=False)
    calls, sources = moves(buf, plan.host)
    assert len(sources) == 2 and sources[1].is_contiguous()
    del sources
    assert [n for _, _, n in calls] == [t.numel() * 4, tt.numel() * 8]
    copy_into(buf, plan, None)
    assert torch.equal(buf.tensor[:t.numel() * 4].view(torch.float32), t)
    at = plan.host[-1][0].offset
    assert torch.equal(buf.tensor[at:at + tt.numel() * 8].view(torch.int64), tt.reshape(-1))


def _state():
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(3_000_000, generator=g), "b": torch.randint(0, 100, (700, 900), generator=g).t(),
            "c": torch.randn(1_234_567, generator=g).to(torch.bfloat16), "d": torch.zeros(0), "e": 3}


def _planned(hashed: bool = True):
    """The layout and copy plan of ``_state()`` on one rank: each piece checksummed as it is copied
    (every piece on the CPU), or, ``hashed`` false, spans copied in chunks (a plan with CUDA pieces)."""
    snaps = Snapshots(rank=0, world_size=1, max_inflight=1)
    lay, plan = snaps.plan(encode(_state()), encode(None, "local", sharded=False))
    assert plan.pieces
    return lay, plan if hashed else dataclasses.replace(plan, pieces=())


def _patch_run(monkeypatch, hashed: bool, wrap) -> None:
    """Replace what copies one run of calls (on any thread) with ``wrap(real)``."""
    from ckpt_engine.save import copy as snapshot

    if hashed:
        real = snapshot._HashedRun.__call__
        wrapped = wrap(lambda run, self=None: real(self, run))
        monkeypatch.setattr(snapshot._HashedRun, "__call__", lambda self, run: wrapped(run, self))
    else:
        real = snapshot._copy_run
        wrapped = wrap(lambda run, self=None: real(run))
        monkeypatch.setattr(snapshot, "_copy_run", lambda run: wrapped(run, None))


def test_several_threads_make_the_same_buffer_as_one(tmp_path):
    lay, plan = _planned()
    assert plan.host_bytes >= SPLIT_MIN
    one, many = HostBuffer(plan.nbytes, pinned=False), HostBuffer(plan.nbytes, pinned=False)
    copy_into(one, plan, None)
    with ThreadPoolExecutor(3) as helpers:
        event, helper_cpu = copy_into(many, plan, None, helpers, threads=4)
    assert event is None and helper_cpu >= 0  # the helpers' chunks' CPU (none if they came too late)
    assert bytes(one.view(lay.nbytes)) == bytes(many.view(lay.nbytes))


def test_a_busy_helper_does_not_hold_the_copy_up():
    """Each thread used to copy a fixed share, so the caller (training) waited for a helper thread
    however late it started; now the caller takes the chunks nobody has taken, and a helper that
    comes later finds none left and writes nothing into the buffer."""
    lay, plan = _planned()
    one, many = HostBuffer(plan.nbytes, pinned=False), HostBuffer(plan.nbytes, pinned=False)
    copy_into(one, plan, None)
    release = threading.Event()
    with ThreadPoolExecutor(1) as helpers:
        helpers.submit(release.wait, 60)  # the only helper is busy elsewhere
        done: list[float] = []
        copier = threading.Thread(target=lambda: done.append(copy_into(many, plan, None, helpers, threads=2)[1]))
        copier.start()
        copier.join(30)
        finished = not copier.is_alive()
        copied = bytes(many.view(lay.nbytes))
        many.tensor.zero_()  # a late helper must not write the old copy over the buffer's next use
        release.set()
        copier.join()
    assert finished, "the copy waited for a busy helper thread"
    assert done == [0.0] and copied == bytes(one.view(lay.nbytes))
    assert not any(many.view(lay.nbytes))


@pytest.mark.parametrize("hashed", [True, False])
def test_an_interrupted_copy_stops_its_helpers_before_the_buffer_is_reused(monkeypatch, hashed):
    """An exception on the calling thread (KeyboardInterrupt mid-copy) leaves no helper copying
    into the buffer after ``copy_into`` has raised: chunks not yet taken are given up."""
    lay, plan = _planned(hashed)
    buf = HostBuffer(plan.nbytes, pinned=False)
    calls = []

    def wrap(real):
        def interrupted(run, self):
            calls.append(threading.current_thread().name)
            if threading.current_thread() is threading.main_thread() and len(calls) >= 2:
                raise KeyboardInterrupt
            real(run, self)
        return interrupted

    _patch_run(monkeypatch, hashed, wrap)
    release = threading.Event()
    with ThreadPoolExecutor(1) as helpers:
        helpers.submit(release.wait, 60)  # the helper comes only after the caller has raised
        with pytest.raises(KeyboardInterrupt):
            copy_into(buf, plan, None, helpers, threads=2)
        taken = len(calls)
        release.set()
    assert len(calls) == taken  # the late helper found every chunk given up
    assert buf.checksums is None  # an interrupted copy leaves no checksums for persist


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_a_save_copies_on_copy_threads_and_loads_back_exactly(tmp_path, copy_threads):
    state = _state()
    with Checkpointer(str(tmp_path), copy_threads=copy_threads) as ck:
        before = {t.name for t in threading.enumerate()}
        ck.save(state, 1)
        copiers = {t.name for t in threading.enumerate()} - before
        assert any(n.startswith("ckpt-copy") for n in copiers) == (copy_threads > 1)
        ck.wait()
        rec = ck.records[-1]
        assert rec.snapshot_cpu_s > 0
        loaded = ck.load()
    for k in ("a", "b", "c", "d"):
        assert torch.equal(loaded[k], state[k]) and loaded[k].dtype == state[k].dtype
    assert loaded["e"] == 3


def test_a_deferred_copy_stays_on_one_thread(tmp_path):
    with Checkpointer(str(tmp_path), copy_threads=4) as ck:
        ck.save(_state(), 1, defer=True).wait_snapshot()
        assert not any(t.name.startswith("ckpt-copy") for t in threading.enumerate())
        ck.wait()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_copy_threads_must_be_a_positive_integer(tmp_path, bad):
    with pytest.raises(ValueError, match=f"copy_threads must be a positive integer or None, got {bad!r}"):
        Checkpointer(str(tmp_path), copy_threads=bad)


@pytest.mark.parametrize("hashed", [True, False])
def test_a_helper_that_fails_fails_the_copy(monkeypatch, hashed):
    """A chunk a helper took and could not copy is not in the buffer: the copy must raise, as it did
    when each helper's share was a future whose result the caller read."""
    lay, plan = _planned(hashed)
    buf = HostBuffer(plan.nbytes, pinned=False)
    helper_started = threading.Event()

    def wrap(real):
        def failing(run, self):
            if threading.current_thread() is not threading.main_thread():
                helper_started.set()
                raise MemoryError("injected")
            helper_started.wait(10)  # the caller lets the helper take a chunk first
            real(run, self)
        return failing

    _patch_run(monkeypatch, hashed, wrap)
    with ThreadPoolExecutor(1) as helpers:
        with pytest.raises(MemoryError, match="injected"):
            copy_into(buf, plan, None, helpers, threads=2)
    assert buf.checksums is None


def test_the_last_copy_s_calls_are_reused_only_while_the_layout_buffer_chunks_and_addresses_hold():
    """``CopyCalls``: a training loop saves the same tensors, updated in place, every time; the calls
    are made once and reused, and made again when any input of them changed."""
    state = {"a": torch.randn(1 << 20), "b": torch.randn(300), "c": torch.randn(5000)}
    snaps = Snapshots(rank=0, world_size=1, max_inflight=1)
    local = encode(None, "local", sharded=False)
    _, plan = snaps.plan(encode(state), local)
    plan = dataclasses.replace(plan, pieces=())  # spans in chunks (a plan with CUDA pieces)
    buf, other = HostBuffer(plan.nbytes, pinned=False), HostBuffer(plan.nbytes, pinned=False)
    reuse = CopyCalls()
    calls, runs, _ = reuse.of(buf, plan, 2)
    assert calls == moves(buf, plan.host)[0] and runs == split(calls, 2)
    state["a"].add_(1)  # updated in place: the same addresses
    again = dataclasses.replace(snaps.plan(encode(state), local)[1], pieces=())
    assert reuse.of(buf, again, 2)[0] is calls  # reused
    assert reuse.of(other, again, 2)[0] == moves(other, again.host)[0] != calls  # another buffer
    assert reuse.of(buf, again, 3)[1] == split(calls, 3)  # other chunks
    state["b"] = torch.randn(300)  # a new tensor where the old one was: another address
    moved = dataclasses.replace(snaps.plan(encode(state), local)[1], pieces=())
    fresh = reuse.of(buf, moved, 3)[0]
    assert fresh == moves(buf, moved.host)[0] and fresh != calls
    state["c"] = torch.randn(50, 100).t()  # not contiguous: a temporary per copy, never reused
    strided = dataclasses.replace(snaps.plan(encode(state), local)[1], pieces=())
    first, _, held = reuse.of(buf, strided, 0)
    second, _, held_again = reuse.of(buf, strided, 0)
    assert first is not second and any(not any(h is t for t in state.values()) for h in held)
    assert first[-1][1] == held[-1].data_ptr() and second[-1][1] == held_again[-1].data_ptr()
    state["c"] = torch.randn(5000)
    enc = encode(state)
    lay, _ = snaps.plan(enc, local)
    unnamed = dataclasses.replace(plan_copy(lay.pieces, lay.nbytes, enc.tensors, [], lay.spans), pieces=())  # no layout
    assert reuse.of(buf, unnamed, 0)[0] is not reuse.of(buf, unnamed, 0)[0] == moves(buf, unnamed.host)[0]


def test_a_tensor_replaced_between_saves_is_saved_with_its_new_bytes(tmp_path):
    """Reused calls must never copy from where a tensor was: a parameter replaced by a new tensor of the
    same shape (``module.weight = Parameter(...)``, a reloaded optimizer state) is saved from its new memory."""
    state = {"w": torch.randn(3_000_000), "b": torch.randn(1000), "step": 1}
    with Checkpointer(str(tmp_path / "ck"), copy_threads=2, keep_last=3) as ck:
        ck.save(state, 1)
        state["w"].mul_(2)  # in place
        ck.save(state, 2)
        state["w"], state["b"] = torch.randn(3_000_000), torch.randn(1000)  # replaced
        ck.save(state, 3)
        ck.wait()
        assert torch.equal(ck.load(3)["w"], state["w"]) and torch.equal(ck.load(3)["b"], state["b"])
        assert not torch.equal(ck.load(2)["w"], state["w"])


# ---- each piece checksummed right after its copy ------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3 << 20), min_size=1, max_size=40), st.integers(1, 1 << 23))
def test_group_keeps_every_piece_whole_in_order_in_runs_of_at_least_size(sizes, size):
    calls = [(i << 30, i << 40, n, i, 0, n) for i, n in enumerate(sizes)]
    runs = group(calls, size)
    assert [c for run in runs for c in run] == calls
    assert all(run for run in runs)
    assert all(sum(c[2] for c in run) >= size for run in runs[:-1])
    assert all(sum(c[2] for c in run[:-1]) < size for run in runs)  # a run closes once it holds enough


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1_500_000), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
                          st.booleans()), min_size=1, max_size=6),
       st.lists(st.integers(0, 300_000), max_size=2), st.sampled_from([1, 3]))
def test_the_copy_s_checksums_are_those_persist_would_compute_of_the_buffer(tensors, local_sizes, threads):
    """Every piece's checksum, made by whichever thread copied it, equals the xxh3 of its bytes and
    padding in the finished buffer (what persist hashed before), and the buffer is the one spans make."""
    import xxhash

    g = torch.Generator().manual_seed(len(tensors))
    state = {}
    for i, (n, dtype, transposed) in enumerate(tensors):
        t = torch.randint(-1000, 1000, (n,), generator=g).to(dtype)
        state[f"t{i}"] = t.reshape(-1, 2).t() if transposed and n % 2 == 0 and n else t
    local = {f"l{i}": torch.randn(n, generator=g) for i, n in enumerate(local_sizes)}
    snaps = Snapshots(rank=0, world_size=1, max_inflight=1)
    lay, plan = snaps.plan(encode(state), encode(local or None, "local", sharded=False))
    assert len(plan.pieces) == len(lay.pieces)
    hashed, plain = HostBuffer(plan.nbytes, pinned=False), HostBuffer(plan.nbytes, pinned=False)
    with ThreadPoolExecutor(threads - 1 or 1) as helpers:
        copy_into(hashed, plan, None, helpers, threads=threads)
        copy_into(plain, dataclasses.replace(plan, pieces=()), None, helpers, threads=threads)
    assert plain.checksums is None
    view = hashed.view(lay.nbytes)
    assert bytes(view) == bytes(plain.view(lay.nbytes))
    ends = [p.offset for p in lay.pieces[1:]] + [lay.nbytes]
    expected = tuple(xxhash.xxh3_64_hexdigest(view[p.offset:end]) for p, end in zip(lay.pieces, ends))
    assert hashed.checksums == (expected or None)  # no piece at all: persist has nothing to hash either
    calls, _ = piece_moves(hashed, plan.pieces, plan.nbytes)
    assert [c[2] for c in calls] == [p.nbytes for p in lay.pieces] and all(c[2] <= 4 << 20 for c in calls[:len(
        [p for p in lay.pieces if not p.local])])


def test_a_cpu_save_is_checksummed_by_its_copy_and_persist_does_not_hash_it_again(tmp_path, monkeypatch):
    """Persist takes the copy's checksums: no second pass over the buffer (12.8 ms of 176 MiB beside
    training, 2026-11-28), and the checkpoint verifies byte for byte."""
    from ckpt_engine.load.open import open_checkpoint
    from ckpt_engine.load.read import verify
    from ckpt_engine.save import persist

    newest = lambda ck: [n for n in ck.storage.listdir("") if n.startswith("step-")][-1]  # noqa: E731
    hashed = []
    real = persist.xxhash.xxh3_64_hexdigest

    def counted(b):  # the copy's threads hash too: count persist's own threads only
        if threading.current_thread().name.startswith(("ckpt-persist", "ckpt-hash")):
            hashed.append(len(b))
        return real(b)

    monkeypatch.setattr(persist.xxhash, "xxh3_64_hexdigest", counted)
    state = _state()
    with Checkpointer(str(tmp_path), copy_threads=2) as ck:
        ck.save(state, 1)
        ck.wait()
        copied_by_persist = list(hashed)
        monkeypatch.undo()
        verify(ck.storage, open_checkpoint(ck.storage, newest(ck)))
        loaded = ck.load()
    assert sum(copied_by_persist) < 16 << 10, copied_by_persist  # its index file only, never the data (34 MB)
    for k in ("a", "b", "c", "d"):
        assert torch.equal(loaded[k], state[k])


@pytest.mark.parametrize("cores, local_ranks, threads", [
    (2, 1, 2),    # 1 rank on 2 cores: a spare core, a helper on it
    (2, 2, 1),    # 2 ranks on 2 cores: one core each, the copy alone
    (4, 2, 2),    # 2 ranks on 4 cores
    (3, 2, 1),    # 2 ranks on 3 cores: no whole spare core each
    (16, 8, 2),
    (64, 1, 4),   # past 4 a copy is limited by memory, not by a core
    (1, 1, 1),
])
def test_the_copy_takes_a_helper_exactly_when_the_rank_has_a_spare_core(monkeypatch, cores, local_ranks, threads):
    """``copy_threads``' default follows the cores a rank has (#47): those this process may run on, shared among the
    ranks of its node (``LOCAL_WORLD_SIZE``, else the world size); no timing."""
    from ckpt_engine import comm

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert comm.cores_per_rank(8, cores) == threads
    monkeypatch.setattr(comm, "cores_available", lambda: cores)
    assert comm.cores_per_rank(8) == threads
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert comm.cores_per_rank(local_ranks) == threads  # without torchrun's variable: the world size
    with Checkpointer("memory://spare-core", comm=LocalComm()) as ck:
        assert ck.copy_threads == comm.cores_per_rank(1)


def test_the_cores_available_are_this_process_affinity(monkeypatch):
    """``taskset -c 0 python train.py`` is a one-core rank whatever the machine has (checked on a thread bound to one
    core: on Linux the affinity is a thread's, and ``sched_getaffinity(0)`` reads the calling one's)."""
    import os

    from ckpt_engine.comm import cores_available, cores_per_rank

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cores_available() == len(os.sched_getaffinity(0))
    seen: list[tuple[int, int]] = []

    def bound() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        seen.append((cores_available(), cores_per_rank(1)))

    t = threading.Thread(target=bound)
    t.start()
    t.join()
    assert seen == [(1, 1)]
