"""``CrashStorage``'s named instants, in this process: each one fires once, at the file and moment its
docstring names, inside the real write path of a real save. test_crash.py kills jobs at these
instants (SIGKILL, so nothing of the killed process is measured); here ``crash`` records and raises
instead, so that what the instant does is seen (and the crash tests' premise checked) without a job."""

from __future__ import annotations

import os

import pytest
import torch

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import LATEST, manifest_dirs
from ckpt_engine.storage import open_storage
from ckpt_engine.testing import CRASH_INSTANTS, RENAME_INSTANTS, CrashStorage


class Crashed(Exception):
    pass


class Recording(CrashStorage):
    """Records each crash (instant, file, detail), then raises where the job would have died."""

    def crash(self, rel: str, detail: str = "") -> None:
        self.crashes.append((self.instant, rel, detail))
        raise Crashed(f"{self.instant} at {rel}")


def _state(step: int) -> dict:
    return {"w": torch.full((256, 64), float(step)), "step": step}


# instant -> the file it fires at (a suffix of the relative path), for the save of step 2
WHERE = {"before-data": "rank-00000.bin", "torn-data": "rank-00000.bin", "before-index": "rank-00000.index.json",
         "torn-index": "rank-00000.index.json", "after-index": "rank-00000.index.json",
         "before-manifest": "manifest.json", "torn-manifest": "manifest.json", "after-manifest": "manifest.json",
         "torn-latest": LATEST, "after-latest": LATEST}


@pytest.mark.parametrize("instant", CRASH_INSTANTS)
def test_each_instant_fires_once_at_its_file_of_the_step_named(tmp_path, instant):
    storage = Recording(str(tmp_path), instant=instant, step=2)
    storage.crashes = []
    ck = Checkpointer(storage, keep_last=1, on_error="warn")
    ck.save(_state(1), 1)
    ck.wait(retention=True)
    assert storage.crashes == []  # step 1 is not the step named
    with pytest.warns(Warning):
        ck.save(_state(2), 2)
        ck.wait(retention=True)
    ck.close()
    assert len(storage.crashes) == 1, storage.crashes
    fired, rel, detail = storage.crashes[0]
    if instant == "torn-retention":  # the first removal after the commit: step 1's manifest
        assert rel.startswith("step-000000000001-") and fired == instant
        return
    step_dir = manifest_dirs(open_storage(str(tmp_path)))  # what is committed after the failure
    assert rel.endswith(WHERE[instant]) and (rel == LATEST or rel.startswith("step-000000000002-")), rel
    if instant == "torn-data":
        written, total = map(int, detail.split("/"))
        assert written == total // 2 and total >= 256 * 64 * 4
    if instant in ("after-manifest", "torn-latest", "after-latest"):
        assert [s for s, _ in step_dir][-1] == 2  # committed before the crash
    else:
        assert all(s != 2 for s, _ in step_dir)


def test_rename_instants_exist_only_where_files_are_renamed_and_instants_are_named(tmp_path):
    with pytest.raises(ValueError, match="writes a file in one request"):
        CrashStorage("memory://crash-instants", instant=sorted(RENAME_INSTANTS)[0], step=1)
    with pytest.raises(ValueError, match="instant='never' is not one of"):
        CrashStorage(str(tmp_path), instant="never", step=1)
    assert os.path.isdir(tmp_path)

