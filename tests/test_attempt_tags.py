"""The job incarnation tag in attempt directory names (issue 14, item 7).

Two starts in the same millisecond must not share a tag: their saves of one step would go to the
same directory and mix files (both writers reported success while the newest checkpoint failed
verification). The tag keeps a time prefix, because later incarnations must sort after earlier ones
(restore's tie-break between attempts of a step, the flusher's order, docs/FORMAT.md).
"""

from __future__ import annotations

import time

import torch

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import dir_name, parse_dir
from ckpt_engine.levels.destination import new_generation

FROZEN = 1_700_000_000.123  # a fixed Unix time: every tag below is made "in the same millisecond"


def test_tags_made_in_the_same_millisecond_never_collide(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: FROZEN)
    tags = [new_generation() for _ in range(100_000)]
    assert len(set(tags)) == len(tags), f"{len(tags) - len(set(tags))} collisions among {len(tags)} tags"


def test_tags_are_valid_attempt_names_and_sort_by_start_time(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: FROZEN)
    early = new_generation()
    monkeypatch.setattr(time, "time", lambda: FROZEN + 1.0)
    late = new_generation()
    assert early < late and len(early) == len(late)
    old_format = f"{int(FROZEN * 1000) % (1 << 44):011x}f"  # an earlier release's tag, same millisecond
    assert old_format + "00000001" < late + "00000001"
    for tag in (early, late):
        name = dir_name(7, f"{tag}{1:08d}")
        assert parse_dir(name) == (7, f"{tag}00000001"), name


def test_checkpointers_started_in_the_same_millisecond_get_distinct_tags(tmp_path, monkeypatch):
    """17 starts on one root with the clock frozen: more than the old tag's 16 values (pigeonhole)."""
    monkeypatch.setattr(time, "time", lambda: FROZEN)
    root = str(tmp_path / "ck")
    dirs = []
    for i in range(17):
        with Checkpointer(root) as ck:
            ck.save({"v": torch.tensor(i)}, 1)
            ck.wait()
            dirs.append(ck.records[-1].dirname)
    assert len(set(dirs)) == len(dirs), f"shared attempt directories: {sorted(dirs)}"
    with Checkpointer(root, readonly=True) as ck:
        assert ck.steps() == [1]
