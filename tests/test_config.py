"""The shared configuration schema: keyword arguments and YAML, validated with clear messages."""

from __future__ import annotations

import pytest

from ckpt_engine.config import CheckpointConfig, ConfigError, Never, resolve_config
from ckpt_engine.training.policy import Adaptive, EveryNSteps, EverySeconds, MaxInterval


def test_valid_configurations_build_their_policies():
    assert isinstance(CheckpointConfig(dirpath="/x", every_n_train_steps=5).policy(), EveryNSteps)
    assert isinstance(CheckpointConfig(dirpath="/x", train_time_interval=60).policy(), EverySeconds)
    assert isinstance(CheckpointConfig(dirpath="/x", overhead_budget=0.035).policy(), Adaptive)
    p = CheckpointConfig(dirpath="/x", overhead_budget=0.035, max_interval=1800).policy()
    assert isinstance(p, MaxInterval) and isinstance(p.inner, Adaptive)
    assert isinstance(CheckpointConfig(dirpath="/x").policy(), Never)
    assert CheckpointConfig(levels=["/fast"]).location == "/fast"


def test_levels_take_paths_or_mappings_with_top_level_defaults():
    cfg = CheckpointConfig(levels=["/nvme/run", {"path": "s3://b/run", "keep_last": 10,
                                                 "storage_options": {"anon": False}}, {"path": "/nfs/run"}],
                           keep_last=2, storage_options={"x": 1})
    assert cfg.location == "/nvme/run"
    assert [(lv.location, lv.keep_last, dict(lv.storage_options)) for lv in cfg.levels] == [
        ("/nvme/run", 2, {"x": 1}), ("s3://b/run", 10, {"anon": False}), ("/nfs/run", 2, {"x": 1})]
    keep_all = CheckpointConfig(levels=["/a", {"path": "/b", "keep_last": None}], keep_last=3)
    assert [lv.keep_last for lv in keep_all.levels] == [3, None]  # an explicit null keeps everything


@pytest.mark.parametrize("kwargs, message", [
    ({"dirpath": "/x", "every_n_train_steps": 5, "overhead_budget": 0.1}, "every_n_train_steps and overhead_budget are mutually"),
    ({"dirpath": "/x", "every_n_train_steps": -1}, "every_n_train_steps=-1 is invalid"),
    ({"dirpath": "/x", "every_n_train_steps": 2.5}, "every_n_train_steps=2.5 is invalid"),
    ({"dirpath": "/x", "train_time_interval": 0}, "train_time_interval=0 is invalid"),
    ({"dirpath": "/x", "overhead_budget": 3.5}, "overhead_budget=3.5 is invalid.*fraction"),
    ({"dirpath": "/x", "max_interval": -5}, "max_interval=-5 is invalid"),
    ({"dirpath": "/x", "keep_last": 0}, "keep_last=0 is invalid"),
    ({}, "exactly one of 'dirpath' or 'levels'"),
    ({"dirpath": "/x", "levels": ["/y"]}, "exactly one of 'dirpath' or 'levels'"),
    ({"levels": "/y"}, "'levels' must be a non-empty list"),
    ({"levels": []}, "'levels' must be a non-empty list"),
    ({"levels": [{"path": "/a", "keep": 3}]}, r"levels\[0\]: unknown key\(s\) 'keep'; a level takes path"),
    ({"levels": ["/a", {"storage_options": {}}]}, r"levels\[1\]: 'path' must be a non-empty string"),
    ({"levels": ["/a", 7]}, r"levels\[1\]: 'path' must be a non-empty string.*got 7"),
    ({"levels": ["/a", {"path": "s3://b/c", "keep_last": 0}]}, r"levels\[1\].keep_last=0 is invalid"),
    ({"levels": ["/a", {"path": "s3://b/c", "storage_options": "anon"}]}, r"levels\[1\].storage_options='anon'"),
    ({"levels": ["/a", "file:///a/"]}, r"levels\[1\] \('file:///a/'\) is the same place as levels\[0\]"),
    ({"levels": ["/a", "s3://b/c"], "keep_last": -1}, "keep_last=-1 is invalid"),
    ({"dirpath": "/x", "storage_options": ["k"]}, "storage_options"),
    ({"dirpath": "/x", "restore_route": "fastest"}, r"restore_route='fastest' is invalid.*'auto', 'read', 'exchange'"),
])
def test_invalid_values_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CheckpointConfig(**kwargs)


def test_yaml_file(tmp_path):
    good = tmp_path / "ckpt.yaml"
    good.write_text("dirpath: s3://bucket/run\noverhead_budget: 0.035\nkeep_last: 3\nstorage_options:\n  anon: false\n")
    cfg = CheckpointConfig.from_yaml(str(good))
    assert cfg.dirpath == "s3://bucket/run" and cfg.overhead_budget == 0.035 and cfg.storage_options == {"anon": False}
    assert CheckpointConfig.from_yaml(str(good), keep_last=7).keep_last == 7
    bad = tmp_path / "bad.yaml"
    bad.write_text("dirpath: /x\nevery_n_step: 5\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key\(s\) 'every_n_step'; known keys:.*every_n_train_steps"):
        CheckpointConfig.from_yaml(str(bad))
    broken = tmp_path / "broken.yaml"
    broken.write_text("dirpath: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        CheckpointConfig.from_yaml(str(broken))
    with pytest.raises(ConfigError, match="cannot read"):
        CheckpointConfig.from_yaml(str(tmp_path / "missing.yaml"))
    levels = tmp_path / "levels.yaml"
    levels.write_text("levels:\n  - /local_nvme/run\n  - path: s3://bucket/run\n    keep_last: 10\n"
                      "keep_last: 2\nevery_n_train_steps: 50\n")
    cfg = CheckpointConfig.from_yaml(str(levels))
    assert [(lv.location, lv.keep_last) for lv in cfg.levels] == [("/local_nvme/run", 2), ("s3://bucket/run", 10)]
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        CheckpointConfig.from_yaml(str(listy))


def test_a_storage_given_in_code_is_a_path_and_its_url_the_location(tmp_path):
    """Code (tests, benchmarks, users testing their failure handling) may hand the front ends a Storage."""
    import torch

    from ckpt_engine import Checkpointer
    from ckpt_engine.testing import SlowStorage

    storage = SlowStorage(str(tmp_path / "ck"))
    config = resolve_config(None, {"dirpath": storage, "every_n_train_steps": 2})
    assert config.dirpath is storage and config.location == storage.url
    ck = Checkpointer.from_config(config)
    try:
        assert ck.storage is storage
        ck.save({"w": torch.ones(3)}, 1)
        ck.wait()
        assert ck.steps() == [1]
    finally:
        ck.close()
    with pytest.raises(ConfigError, match="non-empty string"):
        resolve_config(None, {"dirpath": 42})


def test_restore_route_reaches_the_checkpointer_from_yaml_and_both_front_ends(tmp_path):
    from ckpt_engine import Checkpointer
    from lightning_ckpt import AsyncShardedCheckpoint

    conf = tmp_path / "ckpt.yaml"
    conf.write_text(f"dirpath: {tmp_path / 'run'}\nrestore_route: exchange\n")
    cfg = CheckpointConfig.from_yaml(str(conf))
    assert cfg.restore_route == "exchange" and CheckpointConfig(dirpath="/x").restore_route == "auto"
    with Checkpointer.from_config(cfg) as ck:
        assert ck._exchange.route == "exchange"
    assert AsyncShardedCheckpoint(str(tmp_path), restore_route="read").config.restore_route == "read"
    with pytest.raises(ConfigError, match="restore_route"):
        AsyncShardedCheckpoint(str(tmp_path), restore_route="sideways")


def test_the_first_release_names_still_work_and_warn_once_each(tmp_path, monkeypatch):
    """``path``, ``every_n_steps``, ``every_seconds`` (and Horovod's ``final_checkpoint``) are the names
    of the first release: in code, in YAML and read back, they work for one release and warn once per
    name and process; with the new name beside them they are an error naming both."""
    import datetime
    import warnings

    from ckpt_engine import config as config_module

    monkeypatch.setattr(config_module, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = CheckpointConfig(path="/x", every_n_steps=5)
        again = CheckpointConfig(path="/y", every_n_steps=6)
        assert cfg.path == "/x" and cfg.every_n_steps == 5  # read back under the old names too
    assert (cfg.dirpath, cfg.every_n_train_steps, again.dirpath) == ("/x", 5, "/y")
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(said) == 2 and "'path' is deprecated" in said[0] and "use 'dirpath'" in said[0]
    assert "'every_n_steps' is deprecated" in said[1] and "use 'every_n_train_steps'" in said[1]
    old = tmp_path / "old.yaml"
    old.write_text("path: /z\nevery_seconds: 30\nfinal_checkpoint: false\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = CheckpointConfig.from_yaml(str(old))  # 'path' warned already in this process: once each
        with pytest.raises(ConfigError, match="give 'dirpath' or its old name 'path', not both"):
            CheckpointConfig(dirpath="/a", path="/b")
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(said) == 2 and f"{old}: 'every_seconds' is deprecated" in said[0] and "train_time_interval" in said[0]
    assert "'final_checkpoint' is deprecated" in said[1] and "use 'save_on_train_end'" in said[1]
    assert (cfg.dirpath, cfg.train_time_interval, cfg.save_on_train_end) == ("/z", 30, False)
    assert CheckpointConfig(dirpath="/x", train_time_interval=datetime.timedelta(minutes=2)).train_time_interval == 120
