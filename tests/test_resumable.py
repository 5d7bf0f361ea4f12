"""The resumable sampler (both mounts) and its one data-position format, in process.

The re-split is checked as a property over numbers of ranks before and after, dataset lengths,
``drop_last``, batch sizes and how far the epoch got; the position's format round-trips through
the checkpoint's typed JSON, and every older format the front ends wrote still resumes.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from ckpt_engine.state.decode import decode
from ckpt_engine.state.values import encode
from ckpt_engine.training.position import VERSION, read_position
from ckpt_engine.training.resumable import ResumableSampler, make_resumable
from helpers import assert_same

MOUNTS = {"wrapped": lambda s, bs=None: ResumableSampler(s, batch_size=bs),
          "in place": lambda s, bs=None: make_resumable(s, bs)}


def roundtrip(value):
    """Through the checkpoint's typed JSON and back (as a restore reads it)."""
    enc = encode(value)
    return decode(json.loads(json.dumps(enc.tree, allow_nan=False)), enc.tensors.__getitem__)


def consume(sampler, steps: int, batch_size: int) -> list[int]:
    """Iterate as a DataLoader over ``sampler`` does, noting ``steps`` batches of ``batch_size``."""
    it, seen = iter(sampler), []
    for _ in range(steps):
        seen += [next(it) for _ in range(batch_size)]
        sampler.note_step()
    return seen


def distributed(mount: str, n: int, world: int, rank: int, drop_last: bool, shuffle: bool, bs: int | None = None):
    return MOUNTS[mount](DistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=shuffle,
                                            seed=5, drop_last=drop_last), bs)


# ---- the re-split ---------------------------------------------------------------------------------

@settings(max_examples=150)
@given(n=st.integers(1, 90), before=st.integers(1, 5), after=st.integers(1, 5), drop_last=st.booleans(),
       shuffle=st.booleans(), bs=st.integers(1, 6), progress=st.floats(0, 1), epoch=st.integers(0, 3),
       mount=st.sampled_from(sorted(MOUNTS)), resumed_mount=st.sampled_from(sorted(MOUNTS)))
def test_the_rest_of_an_epoch_is_re_split_over_any_number_of_ranks_each_sample_once(
        n, before, after, drop_last, shuffle, bs, progress, epoch, mount, resumed_mount):
    writers = [distributed(mount, n, before, r, drop_last, shuffle, bs) for r in range(before)]
    order = _global_order(writers[0], epoch)
    steps = int(progress * (len(writers[0]) // bs))
    seen, positions = [], []
    for s in writers:
        s.set_epoch(epoch)
        seen += consume(s, steps, bs)
        positions.append(roundtrip(s.data_position()))
    pos = positions[0]
    assert all(p == pos for p in positions[1:])  # a global position: the same on every rank
    assert (pos["version"], pos["mode"], pos["world_size"], pos["done"]) == (VERSION, "global", before, len(seen))
    assert Counter(seen) == Counter(order[:len(seen)])

    rest, lengths = [], []
    for r in range(after):
        s = distributed(resumed_mount, n, after, r, drop_last, shuffle)
        resumed_epoch, done = s.resume_at(pos)
        lengths.append(s.resumed_length())
        mine = list(s)
        if done:
            assert (resumed_epoch, done, lengths[-1]) == (epoch, len(seen), len(mine))
        rest += mine
    if not done:  # nothing seen yet, or too little left to split: that epoch (or the next) from its start
        assert resumed_epoch == (epoch if not seen else epoch + 1) and lengths[0] is None
        assert rest == [i for r in range(after) for i in _plain(n, after, r, drop_last, shuffle, resumed_epoch)]
        return
    event(f"re-split {before}->{after}")
    left = order[len(seen):]
    if drop_last:  # equal shares: at most after - 1 of the rest are not reached, none twice
        assert not Counter(rest) - Counter(left) and len(left) - len(rest) < after
    else:  # every unseen one once, plus the padding that makes the shares equal
        assert not Counter(left) - Counter(rest) and len(rest) - len(left) == -len(left) % after
    if before == after:  # the same ranks: exactly the uninterrupted order
        for r in range(after):
            assert rest[r * lengths[0]:(r + 1) * lengths[0]] == _plain(n, after, r, drop_last, shuffle, epoch)[steps * bs:]


def _global_order(sampler, epoch: int) -> list[int]:
    inner = getattr(sampler, "inner", sampler)
    proxy = DistributedSampler(inner.dataset, num_replicas=1, rank=0, shuffle=inner.shuffle, seed=inner.seed,
                               drop_last=inner.drop_last)
    proxy.set_epoch(epoch)
    proxy.num_samples = proxy.total_size = inner.total_size
    return list(DistributedSampler.__iter__(proxy))


def _plain(n: int, world: int, rank: int, drop_last: bool, shuffle: bool, epoch: int) -> list[int]:
    s = DistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize("mount", sorted(MOUNTS))
def test_a_re_split_epoch_resumes_again_on_yet_another_number_of_ranks(mount):
    data = 100
    seen = []
    first = [distributed(mount, data, 2, r, False, True, 4) for r in range(2)]
    for s in first:
        seen += consume(s, 3, 4)  # 24 of epoch 0
    pos = first[0].data_position()
    second = [distributed(mount, data, 3, r, False, True, 4) for r in range(3)]
    for s in second:
        s.resume_at(pos)
        seen += consume(s, 2, 4)  # 24 more
    pos = second[0].data_position()
    assert pos["done"] == 48 and pos["world_size"] == 3
    rest = []
    for r in range(1, 5):
        s = distributed(mount, data, 4, r - 1, False, True)
        s.resume_at(pos)
        rest += list(s)
    assert sorted(seen + rest) == list(range(data))  # 52 left over 4 ranks: no padding


def test_a_resume_armed_but_not_started_reports_where_it_will_go():
    s = distributed("wrapped", 40, 2, 0, False, True, 4)
    pos = {**distributed("wrapped", 40, 2, 1, False, True, 4).data_position(), "done": 8, "epoch": 2}
    assert s.resume_at(pos) == (2, 8) and s.data_position()["done"] == 8
    assert s.running_epoch == s.next_epoch == s.epoch == 2


# ---- the format -------------------------------------------------------------------------------------

def test_a_per_rank_position_round_trips_through_typed_json_and_replays_the_seed_draw():
    data = list(range(30))
    torch.manual_seed(4)
    uninterrupted = list(ResumableSampler(RandomSampler(data)))
    torch.manual_seed(4)
    s = ResumableSampler(RandomSampler(data), batch_size=5)
    assert consume(s, 2, 5) == uninterrupted[:10]
    pos = roundtrip(s.data_position())
    assert list(pos) == ["version", "epoch", "mode", "done", "complete", "world_size", "batch_size", "total",
                         "order", "epoch_rng", "generators"]
    assert (pos["mode"], pos["done"], pos["complete"], pos["world_size"]) == ("rank", 10, False, 1)
    assert_same(read_position(pos), pos)
    torch.manual_seed(99)  # another process
    resumed = make_resumable(RandomSampler(data))
    before = torch.get_rng_state()
    assert resumed.resume_at(pos) == (0, 10)
    assert list(resumed) == uninterrupted[10:]
    assert torch.equal(torch.get_rng_state(), before)  # the replayed draw left the caller's RNG alone


def test_a_sampler_with_its_own_generator_resumes_its_permutation():
    """DataLoader(generator=g): the permutation comes from g, which advances every epoch."""
    def loader():
        dl = DataLoader(range(40), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
        dl.batch_sampler.sampler = ResumableSampler(dl.batch_sampler.sampler, batch_size=4)
        return dl

    dl = loader()
    epochs = [[int(i) for b in dl for i in b] for _ in range(2)]   # the uninterrupted run
    first = loader()
    list(first)                                                     # epoch 0
    it = iter(first)
    consumed = []
    for _ in range(3):                                              # 3 batches of epoch 1, then a crash
        consumed += [int(i) for i in next(it)]
        first.batch_sampler.sampler.note_step()
    pos = roundtrip(first.batch_sampler.sampler.data_position())
    assert (pos["epoch"], pos["done"], len(pos["generators"])) == (1, 12, 1)
    resumed = loader()                                              # a new process: g from its seed
    assert resumed.batch_sampler.sampler.resume_at(pos) == (1, 12)
    assert consumed + [int(i) for b in resumed for i in b] == epochs[1]


def test_torchdatas_stateful_protocol_resumes_its_own_generator():
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

    data = list(range(24))
    torch.manual_seed(1)
    s = ResumableSampler(StatefulRandomSampler(data))  # seeds a generator of its own, once
    epochs = [list(s) for _ in range(2)]
    torch.manual_seed(1)
    s = ResumableSampler(StatefulRandomSampler(data))
    list(s)
    it = iter(s)
    head = [next(it) for _ in range(7)]
    state = roundtrip(s.state_dict())  # every index yielded counts (torchdata keeps it in step)
    torch.manual_seed(2)  # another process: another generator seed
    resumed = ResumableSampler(StatefulRandomSampler(data))
    resumed.load_state_dict(state)
    assert head + list(resumed) == epochs[1]


def test_older_formats_still_resume():
    """Positions the front ends wrote before version 2: the Horovod hook's, the Lightning
    callback's (in batches) and the state its sampler gave torchdata."""
    data = list(range(48))
    plain = [DistributedSampler(data, num_replicas=2, rank=r, seed=7) for r in range(2)]
    for s in plain:
        s.set_epoch(1)
    hvd = {"epoch": 1, "batch_size": 4, "mode": "global", "done": 16, "total": 48, "complete": False,
           "order": {"n": 48, "seed": 7, "shuffle": True, "drop_last": False}}
    one = make_resumable(DistributedSampler(data, num_replicas=1, rank=0, seed=7))
    assert one.resume_at(roundtrip(hvd)) == (1, 16)
    assert sorted(list(one) + list(plain[0])[:8] + list(plain[1])[:8]) == data

    lightning = {"epoch": 1, "consumed_batches": 3, "taken_at": 1.0, "batch_size": 4, "epoch_rng": None,
                 "epoch_generators": []}
    s = ResumableSampler(DistributedSampler(data, num_replicas=2, rank=1, seed=7))
    assert read_position(lightning, epoch_batches=6)["complete"] is False
    assert s.resume_at(roundtrip(lightning)) == (1, 12) and list(s) == list(plain[1])[12:]
    assert s.resume_at({**lightning, "consumed_batches": 6}, epoch_batches=6) == (2, 0)

    torchdata_state = {"epoch": 1, "epoch_rng": torch.get_rng_state(), "generators": [], "yielded": 5}
    s = ResumableSampler(DistributedSampler(data, num_replicas=2, rank=0, seed=7))
    s.load_state_dict(roundtrip(torchdata_state))
    assert list(s) == list(plain[0])[5:]


@pytest.mark.parametrize("raw, message", [
    ({"version": 3, "epoch": 0}, "version 3 is not one this code reads"),
    ({"version": 2, "epoch": 0, "mode": "spiral", "done": 0}, "mode='spiral' is invalid"),
    ({"version": 2, "epoch": -1, "mode": "rank", "done": 0}, "epoch=-1 is invalid"),
    ({"version": 2, "epoch": 0, "mode": "global", "done": 4}, "needs 'total' and 'order'"),
    ({"epoch": 0, "offset": 4}, "not written by ckpt-suite"),
])
def test_a_malformed_position_fails_naming_the_key(raw, message):
    with pytest.raises(ValueError, match=message):
        read_position(raw)
    assert read_position(None) is None and read_position({"taken_at": 1.0}) is None  # no sampler when saved


def test_a_per_rank_position_on_another_number_of_ranks_warns_that_it_cannot_re_split():
    class Custom(DistributedSampler):  # its own __iter__: no global order to re-split
        def __iter__(self):
            return iter(list(super().__iter__()))

    data = list(range(40))
    s = ResumableSampler(Custom(data, num_replicas=2, rank=0), batch_size=4)
    consume(s, 2, 4)
    pos = s.data_position()
    assert (pos["mode"], pos["world_size"], pos["done"]) == ("rank", 2, 8)
    other = ResumableSampler(Custom(data, num_replicas=4, rank=0))
    with pytest.warns(UserWarning, match="cannot re-split the rest of epoch 0 from 2 ranks over 4 exactly"):
        assert other.resume_at(pos) == (0, 4)  # the epoch still has 16 fewer: 4 per rank
    assert len(list(other)) == 10 - 4


@pytest.mark.parametrize("reader", ["RandomSampler", "Custom"])
def test_any_sampler_finishes_a_distributed_samplers_epoch_in_its_order_then_draws_its_own(reader):
    """Two devices with a DistributedSampler, then one with the loader's own RandomSampler (Lightning's
    single-device strategy) or a DistributedSampler with its own ``__iter__``."""
    class Custom(DistributedSampler):
        def __iter__(self):
            return iter(list(super().__iter__()))

    data = list(range(40))
    writers = [distributed("wrapped", 40, 2, r, False, True, 4) for r in range(2)]
    seen = [i for s in writers for i in consume(s, 3, 4)]
    pos = writers[0].data_position()
    make = {"RandomSampler": lambda: RandomSampler(data), "Custom": lambda: Custom(data, num_replicas=1, rank=0)}[reader]
    s = ResumableSampler(make(), batch_size=4)
    assert s.resume_at(pos) == (0, 24) and s.resumed_length() == 16
    rest = consume(s, 4, 4)
    assert sorted(seen + rest) == data and s.data_position()["complete"]
    assert sorted(s) == data  # the next epoch: the sampler's own, whole
    with pytest.warns(UserWarning, match="had 40 samples when the checkpoint was taken and this RandomSampler "
                                         "draws from 39; epoch 0 restarts"):
        assert ResumableSampler(RandomSampler(data[1:])).resume_at(pos) == (0, 0)
