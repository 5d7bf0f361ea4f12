"""Fault injection: failing storage, flipped/truncated/missing/swapped bytes, damaged manifests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ckpt_engine import Checkpointer, CheckpointError, CorruptionError
from ckpt_engine.errors import FormatError
from ckpt_engine.format.catalog import manifest_dirs
from ckpt_engine.storage import Storage, StorageWrapper, open_storage
from ckpt_engine.testing import FailingStorage


def state(v: float) -> dict:
    return {"model": {"w": torch.full((300, 200), v), "b": torch.full((7,), v)}, "step": int(v)}


def saved(tmp_path, steps=(1, 2)) -> str:
    with Checkpointer(str(tmp_path)) as ck:
        for s in steps:
            ck.save(state(float(s)), s, {"step": s})
    return str(tmp_path)


def _storage(root) -> Storage:
    return open_storage(root)


def newest_dir(root) -> str:
    return os.path.join(root, manifest_dirs(_storage(root))[-1][1])


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt_engine", *args], capture_output=True, text=True)


def test_storage_failing_mid_write_commits_nothing_and_keeps_the_previous(tmp_path):
    storage = FailingStorage(str(tmp_path))
    ck = Checkpointer(storage)
    ck.save(state(1.0), 1)
    ck.wait()
    storage.fail_on = "step-000000000002"
    ck.save(state(2.0), 2)
    with pytest.raises(CheckpointError, match="No space left on device"):
        ck.wait()
    assert ck.steps() == [1]
    assert ck.load()["step"] == 1
    storage.fail_on = None
    ck.save(state(3.0), 3)  # training goes on; the error was raised once
    ck.close()
    assert ck.steps() == [1, 3]


def test_background_error_surfaces_on_the_next_save(tmp_path):
    storage = FailingStorage(str(tmp_path))
    storage.fail_on = "rank-00000.bin"
    ck = Checkpointer(storage)
    ck.save(state(1.0), 1)
    ck._worker.drain()
    with pytest.raises(CheckpointError, match="could not write .*rank-00000.bin"):
        ck.save(state(2.0), 2)
    storage.fail_on = None
    ck.close()


@pytest.mark.slow
def test_flipped_byte_is_named_by_load_and_verify(tmp_path):
    root = saved(tmp_path)
    data = os.path.join(newest_dir(root), "rank-00000.bin")
    with open(data, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptionError, match=r"rank-00000\.bin: checksum mismatch in tensor 'state\['model'\]\['w'\]'"):
        Checkpointer(root).load()
    out = cli("verify", root)
    assert out.returncode == 1
    assert "rank-00000.bin" in out.stderr and "state['model']['w']" in out.stderr
    assert cli("verify", root, "--step", "1").returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "delete_data", "delete_index", "flip_index", "flip_manifest",
                                    "truncate_manifest", "swap_data"])
def test_damaged_checkpoints_are_detected(tmp_path, damage):
    root = saved(tmp_path, steps=(1, 2))
    d = newest_dir(root)
    older = os.path.join(root, manifest_dirs(_storage(root))[0][1])
    target = {"truncate": "rank-00000.bin", "delete_data": "rank-00000.bin", "delete_index": "rank-00000.index.json",
              "flip_index": "rank-00000.index.json", "flip_manifest": "manifest.json",
              "truncate_manifest": "manifest.json", "swap_data": "rank-00000.bin"}[damage]
    path = os.path.join(d, target)
    raw = open(path, "rb").read()
    if damage.startswith("truncate"):
        open(path, "wb").write(raw[: len(raw) // 2])
    elif damage.startswith("delete"):
        os.unlink(path)
    elif damage.startswith("flip"):
        pos = len(raw) // 2
        open(path, "wb").write(raw[:pos] + bytes([raw[pos] ^ 1]) + raw[pos + 1:])
    else:
        open(path, "wb").write(open(os.path.join(older, target), "rb").read())
    with pytest.raises(CheckpointError) as err:
        Checkpointer(root).load()
    assert os.path.basename(d) in str(err.value)
    out = cli("verify", root)
    assert out.returncode == 1 and os.path.basename(d) in out.stderr


def test_manifest_pointing_outside_the_directory_is_rejected(tmp_path):
    root = saved(tmp_path, steps=(1,))
    path = os.path.join(newest_dir(root), "manifest.json")
    from ckpt_engine.format.manifest import seal, unseal
    body = json.loads(unseal(open(path, "rb").read(), path))
    body["ranks"][0]["data_file"] = "../../../etc/passwd"
    open(path, "wb").write(seal(json.dumps(body).encode()))
    with pytest.raises(FormatError, match="names files"):
        Checkpointer(root).load()


def test_committer_fails_fast_when_a_rank_reports_failure(tmp_path):
    """Rank 1 (simulated by its abort marker) failed: rank 0's commit raises at once, naming it."""
    from ckpt_engine.save.commit import CommitInputs, commit, write_abort
    from ckpt_engine.errors import CommitTimeoutError
    storage = _storage(str(tmp_path))
    write_abort(storage, "step-000000000001-a", 1, "failed", "disk full on node 7")
    inputs = CommitInputs(1, 2, "a", lambda r, t: None)
    with pytest.raises(CheckpointError, match="rank 1 failed.*disk full on node 7"):
        commit(storage, "step-000000000001-a", inputs, timeout=30)
    storage.makedirs("step-000000000002-a")
    with pytest.raises(CommitTimeoutError, match=r"ranks \[0, 1\] did not report"):
        commit(storage, "step-000000000002-a", CommitInputs(2, 2, "a", lambda r, t: None), timeout=0.2)


def test_every_flipped_byte_of_every_file_is_detected(tmp_path):
    """Data (padding included), index files and the manifest: any changed byte fails verification."""
    import random

    from ckpt_engine.load.open import open_checkpoint
    from ckpt_engine.load.read import verify
    with Checkpointer(str(tmp_path)) as ck:
        ck.save({"w": torch.randn(50, 7), "b": torch.randn(3), "m": torch.tensor([True]), "s": "x"}, 1,
                {"rng": torch.arange(5)})
    storage = _storage(str(tmp_path))
    dirname = manifest_dirs(storage)[-1][1]
    rng = random.Random(5)
    checked = 0
    for name in sorted(os.listdir(tmp_path / dirname)):
        path = tmp_path / dirname / name
        raw = path.read_bytes()
        positions = range(len(raw)) if len(raw) <= 2048 else sorted(rng.sample(range(len(raw)), 400))
        for pos in positions:
            path.write_bytes(raw[:pos] + bytes([raw[pos] ^ 0x04]) + raw[pos + 1:])
            with pytest.raises(CheckpointError):
                verify(storage, open_checkpoint(storage, dirname))
            checked += 1
        path.write_bytes(raw)
    verify(storage, open_checkpoint(storage, dirname))
    assert checked > 1000


def test_load_with_fallback_returns_the_newest_checkpoint_that_verifies(tmp_path):
    root = saved(tmp_path, steps=(1, 2, 3))
    for step_dir in manifest_dirs(_storage(root))[-2:]:  # damage steps 2 and 3
        path = os.path.join(root, step_dir[1], "rank-00000.bin")
        raw = bytearray(open(path, "rb").read())
        raw[10] ^= 1
        open(path, "wb").write(bytes(raw))
    ck = Checkpointer(root)
    with pytest.raises(CorruptionError):
        ck.load()
    assert ck.load(fallback=True)["step"] == 1
    assert len(ck.load_failures) == 2 and "checksum mismatch" in ck.load_failures[0]
    assert ck.load_local() == {"step": 1}  # local comes from the same checkpoint


class NoLatestStorage(StorageWrapper):
    """The real storage, except that updating the ``latest`` hint fails (a full or read-only root
    where the checkpoint's own directory could still be written)."""

    def write_atomic(self, rel, data, **kw):
        if rel == "latest":
            return self.run("write", rel, _fail_io)
        return super().write_atomic(rel, data, **kw)


def _fail_io():
    raise OSError(5, "Input/output error (injected)")


def test_a_failed_latest_write_after_the_manifest_is_a_warning_and_the_save_counts(tmp_path):
    """Only the manifest decides visibility, so only the manifest decides success: retention runs,
    the counters and the figures say committed, and the failure of the hint is a warning."""
    from ckpt_engine import CheckpointWarning
    from ckpt_engine.training.figures import figure_row
    ck = Checkpointer(NoLatestStorage(str(tmp_path)), keep_last=1)  # on_error="raise"
    ck.save(state(1.0), 1)
    with pytest.warns(CheckpointWarning, match=r"committed.*latest"):
        ck.wait()
    ck.save(state(2.0), 2)
    with pytest.warns(CheckpointWarning, match=r"step-000000000002.*committed.*latest"):
        ck.wait(retention=True)
    assert ck.counters["committed"] == 2 and ck.counters["failed"] == 0
    assert ck.records[-1].committed and figure_row(ck.records[-1], {})["committed"]
    assert ck.steps() == [2] and [d for d in os.listdir(tmp_path) if d.startswith("step-")] == \
        [manifest_dirs(_storage(str(tmp_path)))[-1][1]]  # retention removed step 1
    assert ck.load()["step"] == 2
    ck.close()


class GatedFailingStorage(FailingStorage):
    """``FailingStorage`` whose failing writes first wait for ``gate``: several saves queue up
    behind it, so their failures all happen before anything is reported (no timing involved)."""

    def __init__(self, *a, **kw):
        import threading
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def write_stream(self, rel, chunks, **kw):
        if self.fail_on and self.fail_on in rel:
            assert self.gate.wait(60), "the test never opened the gate"
        return super().write_stream(rel, chunks, **kw)


def _three_failed_saves(tmp_path, on_error: str) -> Checkpointer:
    storage = GatedFailingStorage(str(tmp_path))
    storage.fail_on = "rank-00000.bin"
    ck = Checkpointer(storage, on_error=on_error, max_inflight=3)
    for s in (1, 2, 3):
        ck.save(state(float(s)), s)  # none has failed yet: every job waits at the gate
    storage.gate.set()
    return ck


def test_each_of_several_background_failures_is_counted_and_warned(tmp_path):
    from ckpt_engine import CheckpointWarning
    ck = _three_failed_saves(tmp_path, "warn")
    with pytest.warns(CheckpointWarning) as caught:
        ck.wait()
    assert ck.counters["failed"] == 3
    messages = [str(w.message) for w in caught if "not saved" in str(w.message)]
    assert len(messages) == 3
    assert [f"step-00000000000{s}-" in m for s, m in zip((1, 2, 3), messages)] == [True] * 3
    assert [r.error is not None and not r.committed for r in ck.records] == [True] * 3
    ck.storage.fail_on = None
    ck.close()


def test_with_raise_each_call_surfaces_the_earliest_unreported_failure(tmp_path):
    ck = _three_failed_saves(tmp_path, "raise")
    for s in (1, 2):
        with pytest.raises(CheckpointError, match=f"step-00000000000{s}-"):
            ck.wait()
    ck.storage.fail_on = None
    with pytest.raises(CheckpointError, match="step-000000000003-"):
        ck.save(state(4.0), 4)  # the next call raises the next one, once
    assert ck.counters["failed"] == 3
    ck.save(state(4.0), 4)
    ck.close()
    assert ck.steps() == [4]
