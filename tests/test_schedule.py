"""The decision loop on a real training job (CPU): the adaptive policy checkpoints repeatedly,
every rank agrees on the steps, and the figures are there to log."""

from __future__ import annotations

import math

import torch

from ckpt_engine import Checkpointer
from ckpt_engine.training.policy import Adaptive, EveryNSteps
from ckpt_engine.training.schedule import Schedule


def train(ck, policy, steps, width=256, clock=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
    opt = torch.optim.Adam(model.parameters())
    sched = Schedule(policy, ck) if clock is None else Schedule(policy, ck, clock)
    saved = []
    for step in range(1, steps + 1):
        x = torch.randn(64, width)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched.should_save(step):
            ck.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "policy": policy.state_dict()}, step)
            sched.saved(step)
            saved.append(step)
    ck.wait(retention=True)
    return saved


def test_every_n_steps_schedule(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=2) as ck:
        assert train(ck, EveryNSteps(7), 30) == [7, 14, 21, 28]
        assert ck.steps() == [21, 28]


def test_adaptive_policy_on_a_real_loop_checkpoints_repeatedly_and_reports(tmp_path):
    policy = Adaptive(0.5, profile_steps=5)  # a generous budget: checkpoints come often even on a loaded machine
    with Checkpointer(str(tmp_path), keep_last=2) as ck:
        saved = train(ck, policy, 200, width=512)
        assert len(saved) >= 3
        ck.wait()
        assert [r.step for r in ck.records] == saved  # the checkpointer took exactly the saves the schedule decided
        f = policy.figures()
        assert f["interval_steps"] >= 1 and f["iteration_s"] > 0 and not math.isnan(f["checkpoint_cost_s"])
        assert f["expected_lost_work_s"] > 0
        assert not math.isnan(policy.persist)  # persist times were observed from the real worker
        restored = ck.load()["policy"]
        assert restored["k"] >= 1 and restored["budget"] == 0.5
