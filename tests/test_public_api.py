"""The public API a user can guess (#46): one result type for every ``restore()``, one options object
for every front end, Lightning's names everywhere, the first release's names one release behind a
``DeprecationWarning``.

The Horovod hook runs here in this process on one rank (``_comm=LocalComm()``: what Horovod's own
communicator would do with one rank); its jobs of several ranks are in test_horovod*.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ckpt_engine import CheckpointConfig, Checkpointer, LocalComm, NoCheckpointError, Restored
from ckpt_engine import config as config_module
from lightning_ckpt import AsyncShardedCheckpoint


@pytest.fixture(autouse=True)
def _warn_again(monkeypatch):
    """Each old name warns once per process: a fresh process for each test here."""
    monkeypatch.setattr(config_module, "_warned", set())


def _deprecations(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_core_restore_returns_none_when_nothing_is_committed_and_a_restored_with_where_each_part_came_from(tmp_path):
    root = tmp_path / "ck"
    with Checkpointer(str(root), keep_last=2) as ck:
        assert ck.restore() is None  # nothing committed: start fresh, no exception to catch
        with pytest.raises(NoCheckpointError, match=r"no committed checkpoint of step 7"):
            ck.restore(7)  # an explicit step that is not there is an error, not a silent fresh start
        ck.save({"w": torch.arange(4.0)}, 3, local={"rank": 0})
        ck.wait()
        r = ck.restore()
    assert isinstance(r, Restored) and (r.step, r.level, r.local, r.first) == (3, 0, {"rank": 0}, {"rank": 0})
    assert torch.equal(r.state["w"], torch.arange(4.0))
    assert r.where == f"{root}/{r.dirname}"  # a local path as the user gave it
    assert r.sources == {"state": f"read from level 0 ({r.where})", "local": f"read from level 0 ({r.where})",
                         "first": f"read from level 0 ({r.where})"}


def test_one_options_object_is_taken_by_the_core_and_both_front_ends(tmp_path):
    from horovod_ckpt import HorovodCheckpointer

    config = CheckpointConfig(dirpath=str(tmp_path / "ck"), every_n_train_steps=2, keep_last=1,
                              save_on_train_end=False, save_on_sigterm=False, restore_route="read")
    with Checkpointer.from_config(config) as ck:
        assert (ck.keep_last, ck._exchange.route) == (1, "read")
    cb = AsyncShardedCheckpoint(config=config)
    assert cb.config == config and (cb.save_on_train_end, cb.save_on_sigterm) == (False, False)
    assert AsyncShardedCheckpoint(config=config, keep_last=5).config.keep_last == 5  # a flag given wins
    assert AsyncShardedCheckpoint(config={"dirpath": str(tmp_path), "keep_last": 4}).config.keep_last == 4
    hook = HorovodCheckpointer(config=config, model=torch.nn.Linear(2, 2), _comm=LocalComm())
    try:
        assert hook.config == config
    finally:
        hook.close()


def test_the_horovod_hook_returns_the_cores_restored_and_none_for_nothing(tmp_path):
    from horovod_ckpt import HorovodCheckpointer

    model = torch.nn.Linear(3, 2)
    hook = HorovodCheckpointer(str(tmp_path), model=model, every_n_train_steps=2, _comm=LocalComm(),
                               save_on_sigterm=False)
    assert hook.restore() is None and hook.step == 0 and hook.restored is None  # was 0: "nothing" and "step 0"
    for _ in range(4):
        hook.after_step()
    hook.close()
    again = HorovodCheckpointer(str(tmp_path), model=torch.nn.Linear(3, 2), _comm=LocalComm(), save_on_sigterm=False)
    try:
        r = again.restore()
        assert isinstance(r, Restored) and r is again.restored and (r.step, r.level, again.step) == (4, 0, 4)
        assert r.where == f"{tmp_path}/{r.dirname}"
        assert torch.equal(again.tracked.model.weight, model.weight)
    finally:
        again.close()


def test_the_horovod_hooks_old_arguments_work_and_warn_once_each(tmp_path):
    from horovod_ckpt import HorovodCheckpointer

    scale = torch.nn.Linear(1, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook = HorovodCheckpointer(path=str(tmp_path), model=torch.nn.Linear(2, 2), every_n_steps=3,
                                   final_checkpoint=False, extra={"scale": scale}, comm=LocalComm(),
                                   save_on_sigterm=False)
    try:
        said = _deprecations(caught)
        assert len(said) == 5, said
        for old, new in (("path", "dirpath"), ("every_n_steps", "every_n_train_steps"),
                         ("final_checkpoint", "save_on_train_end"), ("extra", "register"), ("comm", "_comm")):
            assert any(f"'{old}' is deprecated" in s and new in s for s in said), (old, said)
        assert (hook.config.dirpath, hook.config.every_n_train_steps, hook.config.save_on_train_end) == \
            (str(tmp_path), 3, False)
        assert "scale" in hook.tracked.capture()[0]["extra"]
    finally:
        hook.close()
    with pytest.raises(TypeError, match="unexpected keyword argument.*'every_n_stepz'"):
        HorovodCheckpointer(str(tmp_path), model=torch.nn.Linear(2, 2), every_n_stepz=3, _comm=LocalComm())
    with pytest.raises(Exception, match="give 'every_n_train_steps' or its old name 'every_n_steps', not both"):
        HorovodCheckpointer(str(tmp_path), model=torch.nn.Linear(2, 2), every_n_steps=3, every_n_train_steps=3,
                            _comm=LocalComm())


def test_the_lightning_callbacks_old_names_work_warn_and_speak_in_errors_as_written(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb = AsyncShardedCheckpoint(path=str(tmp_path), every_seconds=30)
    said = _deprecations(caught)
    assert len(said) == 2 and "'path' is deprecated" in said[0] and "'every_seconds' is deprecated" in said[1]
    assert (cb.config.dirpath, cb.config.train_time_interval) == (str(tmp_path), 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(Exception, match=r"every_n_steps=-3 is invalid"):  # the name the user wrote
            AsyncShardedCheckpoint(str(tmp_path), every_n_steps=-3)
        with pytest.raises(ValueError, match="give 'dirpath' or its old name 'path', not both"):
            AsyncShardedCheckpoint(dirpath=str(tmp_path), path=str(tmp_path))
