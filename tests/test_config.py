"""The shared configuration schema: keyword arguments and YAML, validated with clear messages."""

from __future__ import annotations

import pytest

from ckpt_engine.config import CheckpointConfig, ConfigError, Never
from ckpt_engine.policy import Adaptive, EveryNSteps, EverySeconds, MaxInterval


def test_valid_configurations_build_their_policies():
    assert isinstance(CheckpointConfig(path="/x", every_n_steps=5).policy(), EveryNSteps)
    assert isinstance(CheckpointConfig(path="/x", every_seconds=60).policy(), EverySeconds)
    assert isinstance(CheckpointConfig(path="/x", overhead_budget=0.035).policy(), Adaptive)
    p = CheckpointConfig(path="/x", overhead_budget=0.035, max_interval=1800).policy()
    assert isinstance(p, MaxInterval) and isinstance(p.inner, Adaptive)
    assert isinstance(CheckpointConfig(path="/x").policy(), Never)
    assert CheckpointConfig(levels=["/fast"]).location == "/fast"


@pytest.mark.parametrize("kwargs, message", [
    ({"path": "/x", "every_n_steps": 5, "overhead_budget": 0.1}, "every_n_steps and overhead_budget are mutually"),
    ({"path": "/x", "every_n_steps": -1}, "every_n_steps=-1 is invalid"),
    ({"path": "/x", "every_n_steps": 2.5}, "every_n_steps=2.5 is invalid"),
    ({"path": "/x", "every_seconds": 0}, "every_seconds=0 is invalid"),
    ({"path": "/x", "overhead_budget": 3.5}, "overhead_budget=3.5 is invalid.*fraction"),
    ({"path": "/x", "max_interval": -5}, "max_interval=-5 is invalid"),
    ({"path": "/x", "keep_last": 0}, "keep_last=0 is invalid"),
    ({}, "exactly one of 'path' or 'levels'"),
    ({"path": "/x", "levels": ["/y"]}, "exactly one of 'path' or 'levels'"),
    ({"levels": "/y"}, "'levels' must be a non-empty list"),
    ({"levels": ["/a", "s3://b/c"]}, "multi-level persistence is not supported"),
    ({"path": "/x", "storage_options": ["k"]}, "storage_options"),
])
def test_invalid_values_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CheckpointConfig(**kwargs)


def test_yaml_file(tmp_path):
    good = tmp_path / "ckpt.yaml"
    good.write_text("path: s3://bucket/run\noverhead_budget: 0.035\nkeep_last: 3\nstorage_options:\n  anon: false\n")
    cfg = CheckpointConfig.from_yaml(str(good))
    assert cfg.path == "s3://bucket/run" and cfg.overhead_budget == 0.035 and cfg.storage_options == {"anon": False}
    assert CheckpointConfig.from_yaml(str(good), keep_last=7).keep_last == 7
    bad = tmp_path / "bad.yaml"
    bad.write_text("path: /x\nevery_n_step: 5\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key\(s\) 'every_n_step'; known keys:.*every_n_steps"):
        CheckpointConfig.from_yaml(str(bad))
    broken = tmp_path / "broken.yaml"
    broken.write_text("path: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        CheckpointConfig.from_yaml(str(broken))
    with pytest.raises(ConfigError, match="cannot read"):
        CheckpointConfig.from_yaml(str(tmp_path / "missing.yaml"))
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        CheckpointConfig.from_yaml(str(listy))
