"""Crash at every named instant of a save, and at a seeded sample of random ones, on local disk and S3.

A 2-rank job (``tests/dist_worker.py``, mode ``crashloop``) saves one step at a time until
:class:`ckpt_engine.testing.CrashStorage` SIGKILLs every rank at one instant of the save of one step:
each of :data:`~ckpt_engine.testing.CRASH_INSTANTS` once (before the data, a torn data file, between
data and index, around the rank's index and the manifest, during ``latest``, during retention). Then
a few kills come from here at seeded random moments while saves overlap. Each kill is checked twice:

* what it left, read here before the restart: the step's files and manifest, the committed steps,
  what ``latest`` names, the temporary files (:func:`expected`: the kill landed where its name says);
* what the restart made of it (the next job, so that each restart also checks the previous kill):
  it restores the newest committed checkpoint bit for bit, never a torn one (the kill's own step
  when the instant follows the manifest, the step before otherwise), every committed checkpoint
  verifies, and its start-up sweep leaves only committed checkpoints and no temporary file.

A last job saves once and ends: retention caught up (``keep_last`` checkpoints), ``latest`` names the
newest. On S3 a file is one PUT, whole or absent: the instants inside a temporary file's rename
(:data:`~ckpt_engine.testing.RENAME_INSTANTS`) do not exist there, and ``torn-data`` leaves what
``before-data`` leaves (nothing of the upload is visible), so those run on local disk only.
"""

from __future__ import annotations

import fnmatch
import json
import queue
import random
import time
from dataclasses import dataclass

import pytest

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import LATEST, attempt_dirs, manifest_dirs, parse_dir
from ckpt_engine.format.entries import MANIFEST_NAME, data_file, index_file
from ckpt_engine.storage import Storage, open_storage
from ckpt_engine.testing import CRASH_INSTANTS, RENAME_INSTANTS
from dist_worker import digest, make_state
from ranks import kill_job, lines_of, start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # jobs SIGKILLed, restarted
KEEP = 2
SAMPLE = {"local": 3, "s3": 2}
"""Kills at seeded random moments (from the test, while saves overlap), after the named ones."""
OBJECT_STORE_SAME = RENAME_INSTANTS | {"torn-data"}
JOB_S = 240.0


def named(backend: str) -> list[str]:
    """The named instants run on ``backend`` (see the module docstring)."""
    return [i for i in CRASH_INSTANTS if backend == "local" or i not in OBJECT_STORE_SAME]


@dataclass(frozen=True)
class Expected:
    """What a kill at an instant of the save of step ``s`` leaves (saves one at a time, ``keep_last=2``).

    ``present``/``absent``: patterns of names in step ``s``'s directory, ``{r}`` the crashing rank.
    ``uncommitted``: steps whose directory is left without a manifest (``None``: none, or only ``s``'s).
    """

    committed: tuple[int, ...]
    latest: int
    present: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    uncommitted: tuple[int, ...] | None = ()
    tmp_at_root: tuple[str, ...] = ()

    @property
    def restored(self) -> int:
        """The step the restart must restore: the newest committed."""
        return self.committed[-1]


DATA, INDEX, TMP_INDEX = "rank-{r:05d}.bin", "rank-{r:05d}.index.json", ".tmp-*-rank-{r:05d}.index.json"
INDEXES = tuple(index_file(r) for r in range(2))
TMP_MANIFEST = f".tmp-*-{MANIFEST_NAME}"


def expected(instant: str, s: int) -> Expected:
    """What the kill at ``instant`` of the save of ``s`` leaves (``s - 2`` and ``s - 1`` committed before)."""
    # Not committed: the restart restores s - 1; step s's directory (if any) is a leftover to sweep.
    pre = {"committed": (s - 2, s - 1), "latest": s - 1, "uncommitted": None}
    # Committed: the restart restores s (the listing decides); `latest` is a hint that lags until the
    # restart's first commit (docs/FORMAT.md), and retention runs after it: keep_last + 1 checkpoints.
    post = {"committed": (s - 2, s - 1, s), "present": (MANIFEST_NAME,)}
    return {
        "before-data": Expected(**pre, absent=(DATA, MANIFEST_NAME)),
        "torn-data": Expected(**pre, present=(DATA,), absent=(INDEX, MANIFEST_NAME)),
        "before-index": Expected(**pre, present=(DATA,), absent=(INDEX, MANIFEST_NAME)),
        "torn-index": Expected(**pre, present=(DATA, TMP_INDEX), absent=(INDEX, MANIFEST_NAME)),
        "after-index": Expected(**pre, present=(DATA, INDEX), absent=(MANIFEST_NAME,)),
        "before-manifest": Expected(**pre, present=INDEXES, absent=(MANIFEST_NAME, TMP_MANIFEST)),
        "torn-manifest": Expected(**pre, present=(*INDEXES, TMP_MANIFEST), absent=(MANIFEST_NAME,)),
        "after-manifest": Expected(**post, latest=s - 1),
        "torn-latest": Expected(**post, latest=s - 1, tmp_at_root=(f".tmp-*-{LATEST}",)),
        "after-latest": Expected(**post, latest=s),
        # s - 2 lost its manifest, not yet its files: no checkpoint any more, a leftover to sweep.
        "torn-retention": Expected((s - 1, s), s, (MANIFEST_NAME,), uncommitted=(s - 2,)),
    }[instant]


def check_left(storage: Storage, instant: str, s: int, crashed: dict[int, str]) -> None:
    """Assert that the root holds what a kill at ``instant`` of step ``s`` leaves (``crashed``: the
    ranks that reached the instant, each with its detail)."""
    exp = expected(instant, s)
    committed = manifest_dirs(storage)
    assert tuple(step for step, _ in committed) == exp.committed, (instant, committed)
    assert parse_dir(storage.read_bytes(LATEST).decode())[0] == exp.latest, instant
    dirs = [d for d in attempt_dirs(storage) if parse_dir(d)[0] == s]
    assert len(dirs) <= 1, dirs
    names = storage.listdir(dirs[0]) if dirs else []
    for r, detail in crashed.items():
        for pattern in exp.present:
            assert fnmatch.filter(names, pattern.format(r=r)), (instant, r, pattern, names)
        for pattern in exp.absent:
            assert not fnmatch.filter(names, pattern.format(r=r)), (instant, r, pattern, names)
        if instant == "torn-data":
            written, total = map(int, detail.split("/"))
            assert storage.size(f"{dirs[0]}/{data_file(r)}") == written < total, (detail, names)
    without = {parse_dir(d)[0]: d for d in attempt_dirs(storage) if parse_dir(d)[0] not in exp.committed}
    if exp.uncommitted is None:
        assert set(without) <= {s}, (instant, without)
    else:
        assert tuple(without) == exp.uncommitted, (instant, without)
    for old in set(without) - {s}:  # a checkpoint being removed loses its manifest before any file
        assert set(storage.listdir(without[old])) == {data_file(r) for r in range(2)} | set(INDEXES), without[old]
    tmp = list(storage.stale_temp_files())
    assert len(tmp) == len(exp.tmp_at_root) and all(fnmatch.filter(tmp, p) for p in exp.tmp_at_root), (instant, tmp)


class Job:
    """One incarnation of the 2-rank job; every line of both ranks is kept (``lines[r]``)."""

    def __init__(self, root: str, out, env: dict[str, str]) -> None:
        self.procs = start_ranks(2, ["crashloop", root, str(out)], {"KEEP_LAST": str(KEEP), **env})
        self._queues = [lines_of(p) for p in self.procs]
        self.lines: list[list[str]] = [[], []]
        self.deadline = time.monotonic() + JOB_S

    def wait_for(self, prefix: str) -> str:
        """The next line of rank 0 starting with ``prefix``."""
        while True:
            line = self._queues[0].get(timeout=max(0.1, self.deadline - time.monotonic()))
            self.lines[0].append(line)
            if line.startswith(prefix):
                return line
            assert line != "<eof>", f"rank 0 ended while waiting for {prefix!r}:\n" + "\n".join(self.lines[0])

    def end(self, kill: bool = False) -> list[int]:
        """Wait for both ranks to end (``kill``: SIGKILL both now; after ``JOB_S`` seconds anyway);
        their exit codes."""
        if kill:
            kill_job(self.procs)
        try:
            for r, q in enumerate(self._queues):
                while not self.lines[r] or self.lines[r][-1] != "<eof>":
                    self.lines[r].append(q.get(timeout=max(0.1, self.deadline - time.monotonic())))
        except queue.Empty:
            pass
        finally:
            kill_job(self.procs)
        return [p.returncode for p in self.procs]

    def check_restart(self, least: int | None, exact: bool) -> int | None:
        """Rank 0's sweep left only committed checkpoints and no temporary file; every rank restored
        the same step bit for bit, every committed checkpoint verified, and that step is ``least``
        (``exact``) or newer (``None``: there was nothing to restore). Returns the step restored."""
        swept = json.loads(next(line for line in self.lines[0] if line.startswith("swept ")).split(" ", 1)[1])
        assert swept["dirs"] == swept["committed"] and swept["tmp"] == [], swept
        restored = [[line for line in self.lines[r] if line.startswith("restored ")] for r in range(2)]
        if least is None:
            assert restored == [[], []], self.output()
            return None
        assert all(len(lines) == 1 and lines[0].endswith(" ok") for lines in restored), self.output()
        steps = {int(lines[0].split()[1]) for lines in restored}
        assert len(steps) == 1, restored
        step = steps.pop()
        assert step == least if exact else step >= least, (step, least, exact)
        return step

    def crashed(self, instant: str, step: int) -> dict[int, str]:
        """The ranks that reached the kill's instant, each with its detail."""
        found = {}
        for r in range(2):
            for line in self.lines[r]:
                if line.startswith("crash "):
                    _, what, at, rank, _rel, *detail = line.split(" ")
                    assert (what, int(at), int(rank)) == (instant, step, r), line
                    found[r] = detail[0] if detail else ""
        assert found, f"no rank reached {instant} of step {step}:\n{self.output()}"
        return found

    def committed(self) -> int:
        """The newest commit rank 0 reported."""
        return max(int(line.split()[1]) for line in self.lines[0] if line.startswith("committed "))

    def output(self) -> str:
        return "\n".join(f"[{r}] {line}" for r in range(2) for line in self.lines[r][-40:])


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_crash_at_each_named_instant_and_a_seeded_sample(backend, tmp_path, request):
    root = f"{request.getfixturevalue('s3_url')}/crash" if backend == "s3" else str(tmp_path / "ck")
    storage = open_storage(root)
    least: int | None = None  # what the next restart must restore: exactly (named kills), or at least
    for instant in named(backend):
        s = (least or 1) + 2  # a save of this incarnation committed first (`latest`, retention), s - 2 kept
        job = Job(root, tmp_path, {"CRASH_AT": f"{instant}:{s}"})
        codes = job.end()
        assert codes == [-9, -9], (instant, codes, job.output())  # every rank SIGKILLed
        job.check_restart(least, exact=True)
        check_left(storage, instant, s, job.crashed(instant, s))
        least = expected(instant, s).restored
    rng, exact = random.Random(20211), True
    for _ in range(SAMPLE[backend]):
        job = Job(root, tmp_path, {})
        job.wait_for("committed ")
        time.sleep(rng.uniform(0.0, 0.25))  # saves overlap: snapshot, persist, commit, retention
        job.end(kill=True)
        job.check_restart(least, exact)
        least, exact = job.committed(), False  # a commit not yet reported may be restored too
    job = Job(root, tmp_path, {"SAVES": "1"})  # a last restart saves once and ends
    assert job.end() == [0, 0], job.output()
    last = job.check_restart(least, exact) + 1
    committed = manifest_dirs(storage)  # retention caught up; `latest` repaired; nothing else left
    assert [step for step, _ in committed] == [last - 1, last] and attempt_dirs(storage) == [d for _, d in committed]
    assert storage.read_bytes(LATEST).decode() == committed[-1][1] and not list(storage.stale_temp_files())
    assert digest(Checkpointer(root, readonly=True).load()) == digest(make_state(last))
    print(f"\ncrash [{backend}]: {len(named(backend))} named instants and {SAMPLE[backend]} random moments, each "
          "restart restored the newest committed checkpoint bit for bit and swept what the kill left")


def test_crash_storage_refuses_an_instant_its_storage_lacks(tmp_path):
    """An unknown instant, and one inside a temporary file's rename where files are written in one
    request (fsspec's memory://, as S3), would never be reached: refused at once, naming it."""
    from ckpt_engine.testing import CrashStorage

    with pytest.raises(ValueError, match="'torn-manifest'.*one request.*before- or after-"):
        CrashStorage("memory://crash-refused", instant="torn-manifest", step=1)
    with pytest.raises(ValueError, match="'after-data' is not one of"):
        CrashStorage(str(tmp_path), instant="after-data", step=1)
    assert CrashStorage(str(tmp_path), instant="torn-manifest", step=1).instant == "torn-manifest"
