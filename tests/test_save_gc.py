"""No garbage collection runs inside a checkpoint's time on the training thread.

The demo's one checkpoint in a few with a 200-260 ms stall (2-8 ms for the others) was Python's
full collection of the whole process, started by an allocation inside ``save()`` (see
``ckpt_engine.host.collector``). Deterministic: with a collection threshold of 1 a collection is due at
every allocation of a container, so any allocation inside ``save()`` would start one; the
assertions are on which collections started where, not on a duration.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from ckpt_engine import Checkpointer, LocalComm
from ckpt_engine.config import CheckpointConfig
from ckpt_engine.host.collector import pause_collector, resume_collector
from ckpt_engine.training.parts import Parts
from ckpt_engine.training.session import TrainingSession


class Collections:
    """Generations of the automatic collections started on this thread, by where they started."""

    def __init__(self) -> None:
        self.where = "before"
        self.started: dict[str, list[int]] = {}
        self._thread = threading.get_ident()

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start" and threading.get_ident() == self._thread:
            self.started.setdefault(self.where, []).append(info["generation"])


@contextmanager
def collection_due_at_every_allocation(seen: Collections | None = None) -> Iterator[Collections]:
    seen, threshold = seen or Collections(), gc.get_threshold()
    gc.collect()
    gc.callbacks.append(seen)
    gc.set_threshold(1, 1, 1)
    try:
        yield seen
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(seen)


def state(step: int) -> dict:
    """A training state with the containers a real one has (an optimizer's groups, plain values)."""
    return {"model": {f"layer{i}.weight": torch.full((32, 32), float(i)) for i in range(8)},
            "optimizer": {"state": {i: {"step": torch.tensor(float(step)), "exp_avg": torch.zeros(32, 32)}
                                    for i in range(8)},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(8))}]},
            "loops": {"epoch": step // 10, "batches": [step, {"done": step}]}}


@pytest.mark.parametrize("defer", [False, True])
def test_no_collection_starts_inside_save_and_the_one_due_runs_right_after(tmp_path, defer):
    with Checkpointer(str(tmp_path), comm=LocalComm()) as ck:
        ck.save(state(1), 1)  # the layout is cached and the buffer allocated, as in a running job
        ck.wait()
        s, local, save = state(2), {"rng": [1, 2, 3]}, ck.save  # (a bound method is an allocation)
        with collection_due_at_every_allocation() as seen:
            seen.where = "save"
            handle = save(s, 2, local, defer=defer)
            seen.where = "after"
            _ = [{"a": i} for i in range(10)]  # the training loop allocates again
        if handle is not None:
            handle.wait_snapshot()
        ck.wait()
        assert seen.started.get("save", []) == []
        assert seen.started.get("after"), "the collection held off during save() must run at the next allocation"
        assert gc.isenabled()
        assert ck.load()["loops"] == s["loops"]


def test_no_collection_starts_while_the_session_captures_and_saves(tmp_path):
    seen = Collections()

    def capture() -> Parts:
        seen.where = "capture"
        return Parts(state(3), {"data": {"position": [3, {"epoch": 0}]}})  # a front end's dictionaries

    session = TrainingSession(CheckpointConfig(dirpath=str(tmp_path), every_n_train_steps=3), capture, name="test")
    ck = session.start(LocalComm())
    session.begin()
    save = ck.save

    def timed_save(*args: Any, **kwargs: Any) -> Any:
        seen.where = "save"
        try:
            return save(*args, **kwargs)
        finally:
            seen.where = "after"

    try:
        session.take(1)
        ck.save = timed_save  # type: ignore[method-assign]
        with collection_due_at_every_allocation(seen):
            session.take(3)
            _ = [{"a": i} for i in range(10)]
        assert seen.started.get("capture", []) == [] and seen.started.get("save", []) == []
        assert seen.started.get("after"), "the collection held off during the checkpoint must run after it"
    finally:
        session.finish(3, final=False)
        session.close()


def test_the_collector_ends_as_the_user_left_it():
    assert gc.isenabled()
    pause_collector()
    assert not gc.isenabled()
    pause_collector()  # nested (a session's capture and the save inside it)
    resume_collector()
    assert not gc.isenabled()
    resume_collector()
    assert gc.isenabled()
    gc.disable()
    try:
        pause_collector()
        resume_collector()
        assert not gc.isenabled()  # disabled by the user: stays so
    finally:
        gc.enable()


def test_overlapping_pauses_on_two_threads_end_with_the_last():
    first_in, second_done = threading.Event(), threading.Event()

    def other() -> None:
        pause_collector()
        first_in.set()
        second_done.wait(10)
        resume_collector()

    t = threading.Thread(target=other)
    t.start()
    first_in.wait(10)
    pause_collector()
    resume_collector()
    assert not gc.isenabled()  # the other thread's pause is still on
    second_done.set()
    t.join(10)
    assert gc.isenabled()


def test_the_lightning_callback_takes_its_checkpoints_with_the_collector_paused(tmp_path):
    """The hooks that take a checkpoint (the step's, and the next epoch's start after an epoch's
    last step) run paused to their end: a collection due during the checkpoint runs in the loop
    after the hook, not in the hook's agreement on the next step or its figures."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_ckpt import AsyncShardedCheckpoint

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.randn(8, 4))
            return torch.utils.data.DataLoader(data, batch_size=2)  # 4 steps an epoch

    cb = AsyncShardedCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, resume="never")
    seen: list[tuple[str, int, bool]] = []
    for name in ("save", "report", "finish"):  # the checkpoint, the figures the hook reports after it; the end
        method = getattr(cb.session, name)

        def spy(*args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
            seen.append((_name, cb.session.ck.records[-1].step if cb.session.ck.records else 0, gc.isenabled()))
            return _method(*args, **kwargs)

        setattr(cb.session, name, spy)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model())
    in_hooks = seen[:[name for name, _, _ in seen].index("finish")]  # on_train_end waits for commits: not paused
    # steps 2, 4 (the first epoch's last: taken at the second's start) and 6, each found the previous one's record
    assert [(name, step) for name, step, _ in in_hooks if name == "save"] == [("save", 0), ("save", 2), ("save", 4)]
    assert len(in_hooks) == 3 + 6 and not any(enabled for _, _, enabled in in_hooks), in_hooks
    assert gc.isenabled()
    assert Checkpointer(str(tmp_path), readonly=True).steps() == [2, 4, 6]
