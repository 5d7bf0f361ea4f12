"""The training session both front ends drive (``ckpt_engine.training.session``): one configuration
rule, buffers reserved before the first checkpoint, the agreed decision, restore with writer 0's
per-rank part for ranks that had no writer, final and preemption checkpoints, figures."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from ckpt_engine import Checkpointer, LocalComm
from ckpt_engine.config import DEFAULT_KEEP_LAST, UNSET, CheckpointConfig, resolve_config
from ckpt_engine.testing import SequentialComm, run_ranks
from ckpt_engine.training.parts import Parts, split_weights
from ckpt_engine.training.policy import EveryNSteps
from ckpt_engine.training.preempt import SignalAgreement
from ckpt_engine.training.session import TrainingSession
from helpers import assert_same


class Job:
    """A tiny job: a model with buffers (BatchNorm) and SGD with momentum, whose state appears at
    the first step."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.step = 0

    def train_step(self) -> None:
        self.opt.zero_grad()
        self.model(torch.randn(4, 8)).sum().backward()
        self.opt.step()
        self.step += 1

    def capture(self) -> Parts:
        weights, buffers = split_weights(self.model.state_dict(), (n for n, _ in self.model.named_buffers()))
        return Parts({"model": weights, "optimizer": self.opt.state_dict()}, {"buffers": buffers, "step": self.step})


class Remembering(EveryNSteps):
    """Every 2 steps, with a state of its own (how many checkpoints it scheduled)."""

    def __init__(self) -> None:
        super().__init__(2)
        self.scheduled = 0

    def next_due(self, step: int) -> int:
        self.scheduled += 1
        return super().next_due(step)

    def state_dict(self) -> dict:
        return {"scheduled": self.scheduled}

    def load_state_dict(self, state: dict) -> None:
        self.scheduled = state["scheduled"]


def train(session: TrainingSession, job: Job, steps: int) -> list[int]:
    saved = []
    for _ in range(steps):
        job.train_step()
        if session.due(job.step):
            session.save(job.step)
            saved.append(job.step)
        session.report()
    return saved


def test_keep_last_has_one_default_for_code_flags_yaml_files_and_mappings(tmp_path):
    assert resolve_config(None, {"dirpath": "/x", "keep_last": UNSET}).keep_last == DEFAULT_KEEP_LAST
    assert resolve_config(None, {"dirpath": "/x", "keep_last": None}).keep_last is None  # keep every checkpoint
    yaml = tmp_path / "ckpt.yaml"
    yaml.write_text("dirpath: /x\nkeep_last: 7\n")
    assert resolve_config(str(yaml), {"keep_last": UNSET, "every_n_train_steps": None}).keep_last == 7
    assert resolve_config(str(yaml), {"keep_last": 2}).keep_last == 2  # a flag given in code wins
    yaml.write_text("dirpath: /x\nkeep_last: null\n")
    assert resolve_config(str(yaml), {"keep_last": UNSET}).keep_last is None
    yaml.write_text("levels: [/a, {path: /b, keep_last: 10}]\n")
    assert [lv.keep_last for lv in resolve_config(str(yaml), {}).levels] == [DEFAULT_KEEP_LAST, 10]
    assert resolve_config({"dirpath": "/x"}, {}).keep_last == DEFAULT_KEEP_LAST
    given = CheckpointConfig(dirpath="/x")
    assert resolve_config(given, {"keep_last": UNSET}) is given  # a CheckpointConfig is taken as it is


def test_the_first_checkpoint_finds_its_buffer_reserved_at_the_first_step(tmp_path):
    job = Job()
    session = TrainingSession(CheckpointConfig(dirpath=str(tmp_path), every_n_train_steps=3), job.capture, name="test")
    ck = session.start(LocalComm())
    session.begin()
    assert train(session, job, 1) == []
    ck._pool._reserver.join(30)  # made on ckpt-reserve, while training goes on
    assert ck._pool.allocations == 1  # the momentum buffers included
    assert train(session, job, 5) == [3, 6]
    session.finish(job.step, final=True)  # step 6 is saved: no final checkpoint repeats it
    assert ck._pool.allocations == 1 and ck.steps() == [3, 6]
    session.close()


def test_restore_brings_back_the_state_and_the_policy_and_no_final_checkpoint_repeats_it(tmp_path):
    config, rows = CheckpointConfig(dirpath=str(tmp_path)), []
    job = Job()
    session = TrainingSession(config, job.capture, name="test", policy=Remembering(), on_figures=rows.append)
    session.start(LocalComm())
    session.begin()
    assert train(session, job, 4) == [2, 4]
    session.finish(job.step, final=True)
    session.close()
    assert [(r["kind"], r["step"], r["committed"]) for r in rows] == [("save", 2, True), ("save", 4, True)]
    assert all(0 < r["train_cpu_ms"] < 10_000 for r in rows)  # the training thread's capture + encode + copy

    policy, other = Remembering(), Job(seed=1)
    again = TrainingSession(config, other.capture, name="test", policy=policy)
    ck = again.start(LocalComm())
    resumed = again.restore()
    assert (resumed.step, again.resumed_from, resumed.per_rank["step"], policy.scheduled) == (4, 4, 4, 1)
    assert resumed.rng is not None and resumed.manifest.world_size == 1
    assert_same(resumed.replicated["model"], job.capture().replicated["model"])
    again.finish(4, final=True)
    assert ck.steps() == [2, 4]
    again.close()


def test_a_rank_without_a_writer_resumes_writer_0s_per_rank_part_and_keeps_its_own_rng(tmp_path):
    config = CheckpointConfig(dirpath=str(tmp_path))

    def save(comm):
        session = TrainingSession(config, lambda: Parts({"w": torch.arange(10.0)}, {"who": comm.rank}), name="t")
        session.start(comm)
        session.take(5)
        session.finish(5, final=False)
        session.close()

    assert run_ranks(2, save) == [None, None]

    def restore(comm):
        session = TrainingSession(config, name="t")
        session.start(comm)
        r = session.restore()
        session.close()
        return r.step, r.per_rank["who"], r.rng is None, r.first["who"], r.manifest.world_size

    assert run_ranks(3, restore) == [(5, 0, False, 0, 2), (5, 1, False, 0, 2), (5, 0, True, 0, 2)]


def test_an_exception_takes_a_final_checkpoint_in_one_process_and_warns_under_several(tmp_path):
    job = Job()
    job.train_step()
    one = TrainingSession(CheckpointConfig(dirpath=str(tmp_path / "one")), job.capture, name="test")
    one.start(LocalComm())
    one.abort(job.step, RuntimeError("boom"), final=True)
    one.abort(job.step, RuntimeError("boom"), final=True)  # a second way out finds nothing to do
    assert not one.active and Checkpointer(str(tmp_path / "one"), readonly=True).steps() == [1]

    config = CheckpointConfig(dirpath=str(tmp_path / "two"))
    sessions = [TrainingSession(config, job.capture, name="test") for _ in range(2)]
    for session, comm in zip(sessions, SequentialComm.group(2)):
        session.start(comm)
    for session in sessions:
        with pytest.warns(UserWarning, match="test: no final checkpoint on an exception under several ranks"):
            session.abort(job.step, RuntimeError("boom"), final=True)
    assert Checkpointer(str(tmp_path / "two"), readonly=True).steps() == []


def test_an_agreed_preemption_checkpoints_that_step_and_gives_the_signal_back(tmp_path):
    job = Job()
    session = TrainingSession(CheckpointConfig(dirpath=str(tmp_path), every_n_train_steps=100), job.capture, name="test")
    ck = session.start(LocalComm(), stop=SignalAgreement(None))
    previous = signal.getsignal(signal.SIGTERM)
    session.begin()
    train(session, job, 2)
    assert not session.preempted()
    os.kill(os.getpid(), signal.SIGTERM)  # only sets the flag
    train(session, job, 1)
    assert session.preempted()
    session.stop(job.step)
    assert ck.steps() == [3] and signal.getsignal(signal.SIGTERM) == previous
    session.close()


def test_a_second_signal_during_the_final_checkpoint_does_not_interrupt_it(tmp_path):
    """Under ``ddp_spawn`` a job-wide SIGTERM reaches a rank twice: the SIGTERM itself and, once the
    launcher has died, the SIGINT torch's parent-death signal turns that into (on a loaded machine,
    seconds later). The handlers the session took over stay its own until the final checkpoint is
    committed, so the later notice cannot raise in the middle of it (seen: a run ended with no final
    checkpoint in CI)."""
    job = Job()

    def interrupting(signum, frame):
        raise KeyboardInterrupt("the handler the framework had")

    before = signal.signal(signal.SIGTERM, interrupting)
    try:
        def capture():
            os.kill(os.getpid(), signal.SIGTERM)  # the second notice, while the final checkpoint is taken
            return job.capture()

        session = TrainingSession(CheckpointConfig(dirpath=str(tmp_path), every_n_train_steps=100), job.capture, name="test")
        ck = session.start(LocalComm(), stop=SignalAgreement(None))
        session.begin()
        train(session, job, 2)
        os.kill(os.getpid(), signal.SIGTERM)
        train(session, job, 1)
        assert session.preempted()
        session.stop(job.step, capture)
        assert ck.steps() == [3] and signal.getsignal(signal.SIGTERM) is interrupting
        session.close()
    finally:
        signal.signal(signal.SIGTERM, before)
