"""One retention rule (ckpt_engine/save/retention.py) for the commit, a full disk and ``ckpt gc``:
the rule property-tested on any set of committed directories, then the three callers on one root
after a restart below the earlier steps, where they used to disagree (``gc`` and a full disk ranked
the running job's newest checkpoint by its step and deleted it)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpt_engine import Checkpointer
from ckpt_engine.cli import gc
from ckpt_engine.format.catalog import dir_name, manifest_dirs, parse_dir
from ckpt_engine.save.retention import retention
from ckpt_engine.storage import open_storage
from test_disk_full import QuotaStorage, state, used_bytes

# attempt tags as the library makes them: an incarnation's tag (time first), then a save counter
committed_dirs = st.sets(st.builds(lambda step, inc, n: dir_name(step, f"{inc:011x}{n:04d}"),
                                   st.integers(0, 12), st.integers(1, 4), st.integers(0, 20)), max_size=25)


@given(committed_dirs, st.one_of(st.none(), st.integers(1, 6)), st.booleans())
def test_the_rule(names, keep_last, writing):
    r = retention(names, keep_last, writing=writing)
    if not names:
        assert r.keep == r.remove == frozenset() and r.newest is None
        return
    attempts = {n: parse_dir(n)[1] for n in names}
    assert r.newest == max(names, key=lambda n: (attempts[n], parse_dir(n)[0]))  # the last commit
    assert r.newest in r.keep  # always, whatever its step
    assert r.keep | r.remove == names and not r.keep & r.remove
    steps = [parse_dir(n)[0] for n in r.keep]
    assert len(steps) == len(set(steps))  # one attempt per step
    for old, new in r.superseded.items():  # the newest attempt of its step replaces it
        assert parse_dir(old)[0] == parse_dir(new)[0] and new in r.keep | r.beyond
        assert new == r.newest or attempts[old] < attempts[new]
    if keep_last is None:
        assert not r.beyond and len(r.keep) == len({parse_dir(n)[0] for n in names})
        return
    budget = max(1, keep_last - (1 if writing else 0))
    others = len({parse_dir(n)[0] for n in names} - {parse_dir(r.newest)[0]})
    assert len(r.keep) == min(budget, others + 1)
    lowest_kept = min((parse_dir(n)[0] for n in r.keep - {r.newest}), default=math.inf)
    assert all(parse_dir(n)[0] < lowest_kept for n in r.beyond)  # the highest steps are kept


def test_the_caller_names_the_newest_commit_and_bad_input_is_refused():
    a5, b1 = dir_name(5, "0000000000a0001"), dir_name(1, "0000000000b0001")
    assert retention([a5, b1], 1).keep == {b1}  # b1's tag is the later one
    assert retention([a5, b1], 1, newest=a5).keep == {a5}  # the commit just made, as retain() says
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        retention([a5], 0)
    with pytest.raises(ValueError, match="'step-1' is not a checkpoint directory name"):
        retention(["step-1"], 2)
    with pytest.raises(ValueError, match="is not among the committed"):
        retention([a5], 2, newest=b1)


def _committed(root) -> list[int]:
    return [step for step, _ in manifest_dirs(open_storage(str(root)))]


def _gc_removes(root, keep_last: int) -> list[str]:
    return [i.name for i in gc.plan(open_storage(str(root)), keep_last, grace_s=math.inf).remove]


def test_a_restart_below_the_earlier_steps_is_kept_by_commit_full_disk_and_gc_alike(tmp_path):
    """Job A saves steps 1..5 with keep_last=3; job B starts afresh in the same root and saves step 1,
    then step 2 on a disk too full for it. Every caller of the rule keeps B's newest checkpoint; the
    full disk removes what B's commit of step 2 would remove, and ``ckpt gc --keep-last 3`` finds
    nothing to remove after either commit (it planned to delete B's step 1, the full disk deleted it)."""
    a = Checkpointer(str(tmp_path), keep_last=3)
    for s in range(1, 6):
        a.save(state(float(s)), s)
        a.wait(retention=True)
    a.close()
    assert _committed(tmp_path) == [3, 4, 5]

    storage = QuotaStorage(str(tmp_path))
    b = Checkpointer(storage, keep_last=3)
    b.save(state(1.0), 1)
    b.wait(retention=True)
    assert _committed(tmp_path) == [1, 4, 5]  # B's step 1 (its newest), and A's highest two
    assert _gc_removes(tmp_path, 3) == []
    a4 = dict(manifest_dirs(open_storage(str(tmp_path))))[4]
    assert _gc_removes(tmp_path, 2) == [a4]  # keeping 2: B's newest and A's highest

    storage.quota = used_bytes(tmp_path) + used_bytes(tmp_path) // 6  # half a checkpoint free
    b.save(state(2.0), 2)
    b.wait(retention=True)
    assert b.counters["disk_full"] == 1 and b.records[-1].committed
    assert _committed(tmp_path) == [1, 2, 5]  # room made by A's step 4, B's step 1 kept
    assert _gc_removes(tmp_path, 3) == []
    assert b.load(step=2)["step"] == 2 and b.load(step=1)["step"] == 1
    b.close()
