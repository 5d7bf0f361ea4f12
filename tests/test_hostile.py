"""Hostile and damaged checkpoints (issue #14 items 3, 4, 5, 6 and 10).

Every reader (``load``, ``load_local``, ``steps``, ``ckpt ls/verify/inspect/export``) must fail
fast with a :class:`FormatError` or :class:`CorruptionError` naming the file: never hang on a FIFO,
never read a device or an oversized file whole, never allocate what a file only claims, never
follow a symbolic link out of the checkpoint, never let a hostile value escape as another
exception. The fallback skips a checkpoint when any part a rank will use fails verification.

Manifests are sealed: hostile bodies are re-sealed with the project's own ``seal``, as an attacker
with write access would. Readers that could hang or exhaust memory before the fix run in a
subprocess with a timeout and an address-space limit, so they fail instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import xxhash
from helpers import flip_local
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_engine import Checkpointer, CheckpointError, CorruptionError, FormatError
from ckpt_engine.cli import main
from ckpt_engine.cli.inspect import describe
from ckpt_engine.format.catalog import manifest_dirs
from ckpt_engine.format.manifest import seal, unseal
from ckpt_engine.load.open import open_checkpoint
from ckpt_engine.load.read import read_local, read_state
from ckpt_engine.storage import open_storage
from ckpt_engine.testing import SequentialComm, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- writing small real checkpoints ---------------------------------------------------------------
def state(v: float) -> dict:
    return {"model": {"w": torch.full((64, 8), v), "b": torch.full((3,), v)}, "step": int(v)}


def local(v: float, rank: int) -> dict:
    return {"rank": rank, "bn": torch.full((5,), v + rank), "pos": int(v) * 10 + rank}


def write(root, steps=(1, 2), world: int = 1) -> str:
    """Checkpoints of ``steps`` at ``root`` written by ``world`` ranks (each its own slices and local)."""
    root = str(root)
    cks = [Checkpointer(root, comm=comm) for comm in SequentialComm.group(world)]
    for s in steps:
        for r, ck in enumerate(cks):
            ck.save(state(float(s)), s, local(float(s), r))
        for ck in cks:
            ck.wait()
    for ck in reversed(cks):
        ck.close()
    return root


def dirs(root: str) -> list[str]:
    return [d for _, d in manifest_dirs(open_storage(root))]


def manifest_body(root: str, dirname: str) -> dict:
    path = os.path.join(root, dirname, "manifest.json")
    return json.loads(unseal(open(path, "rb").read(), path))


def reseal_text(root: str, dirname: str, text: str) -> None:
    """Replace the manifest's body by ``text``, sealed as the writer would."""
    with open(os.path.join(root, dirname, "manifest.json"), "wb") as f:
        f.write(seal(text.encode()))


def rewrite_manifest(root: str, dirname: str, mutate) -> None:
    body = manifest_body(root, dirname)
    mutate(body)
    reseal_text(root, dirname, json.dumps(body))


def rewrite_index(root: str, dirname: str, rank: int, mutate) -> None:
    """Change ``rank``'s index file and record its new size and checksum in the (re-sealed) manifest."""
    path = os.path.join(root, dirname, f"rank-{rank:05d}.index.json")
    body = json.loads(open(path, "rb").read())
    mutate(body)
    raw = json.dumps(body).encode()
    open(path, "wb").write(raw)
    rewrite_manifest(root, dirname, lambda m: m["ranks"][rank].update(index_bytes=len(raw),
                                                                      index_xxh3=xxhash.xxh3_64_hexdigest(raw)))


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> str:
    return write(tmp_path_factory.mktemp("hostile") / "ck", steps=(1, 2))


@pytest.fixture
def root(template, tmp_path) -> str:
    """A private copy of a 1-rank root holding steps 1 and 2 (tests damage step 2)."""
    return shutil.copytree(template, str(tmp_path / "ck"), symlinks=True)


# ---- collectives between threads (for the collective restore) -------------------------------------
# ---- item 3: a damaged local section defeats the fallback -----------------------------------------
def test_fallback_skips_a_checkpoint_whose_local_section_is_damaged(root):
    flip_local(root, dirs(root)[-1], 0)
    with pytest.raises(CorruptionError, match=r"rank-00000\.bin.*local"):
        Checkpointer(root, readonly=True).load()
    ck = Checkpointer(root, readonly=True)
    assert ck.load(fallback=True)["step"] == 1
    assert ck.load_local()["pos"] == 10  # the local of the same, verified checkpoint
    assert len(ck.load_failures) == 1 and "rank-00000.bin" in ck.load_failures[0]


class Reader:
    """A reader's communicator that is never used to communicate (``load`` is not a collective)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def broadcast(self, value, src=0):
        return value

    def all_gather(self, value):
        raise AssertionError("load() must not communicate")


def test_each_rank_verifies_its_own_local_and_writer_0s_before_choosing(tmp_path):
    root = write(tmp_path / "ck", steps=(1, 2, 3), world=2)
    d = dirs(root)
    flip_local(root, d[-1], 1)  # step 3: only rank 1 reads it
    flip_local(root, d[-2], 0)  # step 2: writer 0's, which every rank reads (per-rank state's fallback)
    r1 = Checkpointer(root, comm=Reader(1, 2), readonly=True)
    assert r1.load(fallback=True)["step"] == 1
    assert r1.load_local()["rank"] == 1 and r1.load_local(rank=0)["rank"] == 0
    alone = Checkpointer(root, readonly=True)  # one rank reading 2 writers' checkpoint: writer 0's local only
    assert alone.load(fallback=True)["step"] == 3
    assert alone.load_local()["pos"] == 30


def test_restore_is_a_collective_all_ranks_fall_back_together(tmp_path):
    root = write(tmp_path / "ck", steps=(1, 2), world=2)
    flip_local(root, dirs(root)[-1], 1)  # only rank 1 would notice
    got = run_ranks(2, lambda comm: Checkpointer(root, comm=comm, readonly=True).restore())
    assert [r.step for r in got] == [1, 1], got
    assert [r.local["rank"] for r in got] == [0, 1] and [r.first["rank"] for r in got] == [0, 0]
    assert got[1].state["step"] == 1 and got[1].local["pos"] == 11
    # Three readers of two writers: rank 2 has no writer of its own, it gets writer 0's as `first`.
    got = run_ranks(3, lambda comm: Checkpointer(root, comm=comm, readonly=True).restore())
    assert [r.step for r in got] == [1, 1, 1] and got[2].local is None and got[2].first["pos"] == 10
    failed = run_ranks(2, lambda comm: Checkpointer(root, comm=comm, readonly=True).restore(fallback=False))
    assert all(isinstance(e, CorruptionError) for e in failed), failed


# ---- item 4: readers hung or exhausted ------------------------------------------------------------
PROBE = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from ckpt_engine import Checkpointer
from ckpt_engine.cli import main
root, out, report = sys.argv[1:4]
res = {}
def run(name, fn):
    try:
        res[name] = ["ok", fn()]
    except BaseException as e:
        res[name] = [type(e).__name__, str(e)[:400]]
run("steps", lambda: Checkpointer(root, readonly=True).steps())
run("load", lambda: Checkpointer(root, readonly=True).load()["step"])
run("fallback", lambda: Checkpointer(root, readonly=True).load(fallback=True)["step"])
for cmd in (["ls", root, "--all"], ["verify", root], ["inspect", root], ["export", root, out]):
    run(cmd[0], lambda: main(cmd))
res["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
json.dump(res, open(report, "w"))
"""


def probe(root: str, tmp_path) -> dict:
    """Every reader on ``root`` in a subprocess (3 GiB address space, 60 s): what each returned or raised."""
    report = str(tmp_path / "report.json")
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, root, str(tmp_path / "out.pt"), report], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a reader hung (60 s)")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.load(open(report))


def _fifo(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path)


def _dev_zero(path: str) -> None:
    os.unlink(path)
    os.symlink("/dev/zero", path)


def _sparse(path: str, size: int) -> None:
    os.truncate(path, size)  # a hole: no disk used


@pytest.mark.slow
@pytest.mark.parametrize("damage, file", [
    (_fifo, "manifest.json"),
    (_dev_zero, "manifest.json"),
    (_fifo, "rank-00000.index.json"),
    (_dev_zero, "rank-00000.index.json"),
    (_fifo, "rank-00000.bin"),
    (lambda p: _sparse(p, 3 << 30), "manifest.json"),
])
def test_no_reader_hangs_or_reads_a_device_or_a_huge_file(root, tmp_path, damage, file):
    newest = dirs(root)[-1]
    damage(os.path.join(root, newest, file))
    res = probe(root, tmp_path)
    assert res["load"][0] in ("FormatError", "CorruptionError") and file in res["load"][1], res
    assert res["fallback"] == ["ok", 1], res
    assert res["steps"][1][0] == 1 and res["ls"] == ["ok", 0], res
    assert res["verify"] == res["inspect"] == res["export"] == ["ok", 1], res  # exit code 1: unreadable
    assert res["maxrss_mib"] < 1500, res


@pytest.mark.slow
def test_an_index_claimed_larger_than_the_cap_is_never_read(root, tmp_path):
    newest = dirs(root)[-1]
    path = os.path.join(root, newest, "rank-00000.index.json")
    _sparse(path, 1536 << 20)
    rewrite_manifest(root, newest, lambda b: b["ranks"][0].update(index_bytes=1536 << 20))
    res = probe(root, tmp_path)
    assert res["load"][0] == "FormatError" and "index_bytes" in res["load"][1] and "manifest.json" in res["load"][1]
    assert res["fallback"] == ["ok", 1] and res["steps"] == ["ok", [1]], res
    assert res["maxrss_mib"] < 1500, res


def test_a_local_tensor_claiming_a_terabyte_fails_before_any_allocation(root):
    newest = dirs(root)[-1]

    def claim(body: dict) -> None:
        body["local_tensors"][0][1] = [1 << 38]  # float32: 1 TiB, over an entry of 20 bytes
        entry = next(e for e in body["entries"] if e[0] == 1 and e[1] == 0)
        entry[3] = 1 << 38

    rewrite_index(root, newest, 0, claim)
    with pytest.raises(FormatError, match=r"rank-00000\.index\.json.*local"):
        Checkpointer(root, readonly=True).load_local()
    assert Checkpointer(root, readonly=True).load(fallback=True)["step"] == 1


def test_a_replicated_tensor_claiming_more_than_the_data_file_fails_before_allocating(root):
    newest = dirs(root)[-1]
    huge = 1 << 40

    def claim_index(body: dict) -> None:
        entry = next(e for e in body["entries"] if e[0] == 0 and e[1] == 0)
        last = max(e[4] for e in body["entries"])
        delta = huge - entry[5]
        entry[3], entry[5] = huge // 4, huge  # 2**38 float32 elements
        for e in body["entries"]:
            if e[4] > entry[4]:
                e[4] += delta
        body["data_bytes"] += delta
        assert last < body["data_bytes"]

    rewrite_index(root, newest, 0, claim_index)
    rewrite_manifest(root, newest, lambda b: (b["tensors"][0].__setitem__(1, [1 << 38]),
                                              b["ranks"][0].update(data_bytes=b["ranks"][0]["data_bytes"] + huge - 2048)))
    with pytest.raises(CorruptionError, match=r"rank-00000\.bin"):
        Checkpointer(root, readonly=True).load()


# ---- item 5: symbolic links out of the root --------------------------------------------------------
def test_a_symlinked_step_directory_is_refused(root, tmp_path):
    outside = write(tmp_path / "outside", steps=(5,))
    name = dirs(outside)[0]
    os.symlink(os.path.join(outside, name), os.path.join(root, name))
    ck = Checkpointer(root, readonly=True)
    assert ck.steps() == [1, 2]
    with pytest.raises(FormatError, match=f"{name}.*symbolic link"):
        ck.load()
    assert ck.load(fallback=True)["step"] == 2


@pytest.mark.parametrize("file", ["manifest.json", "rank-00000.index.json", "rank-00000.bin"])
def test_a_symlinked_file_in_a_checkpoint_is_refused(root, tmp_path, file):
    newest = dirs(root)[-1]
    path = os.path.join(root, newest, file)
    copy = str(tmp_path / file)
    shutil.copy(path, copy)  # the very same bytes, outside the root
    os.unlink(path)
    os.symlink(copy, path)
    with pytest.raises(FormatError, match=f"{file}.*symbolic link"):
        Checkpointer(root, readonly=True).load()
    assert Checkpointer(root, readonly=True).load(fallback=True)["step"] == 1
    assert main(["verify", root]) == 1


# ---- item 6: hostile values escape the error family ------------------------------------------------
def _nested(depth: int) -> object:
    v: object = 0
    for _ in range(depth):
        v = [v]
    return v


def _duplicate_key(text: str) -> str:
    return '{"step": 2, ' + text[1:]


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda b: b.update(state=_nested(600)), id="nested-600"),
    pytest.param(lambda b: b.update(state={"$f": 10 ** 4000}), id="float-10**4000"),
    pytest.param(lambda b: b.update(created_at=1e20), id="created_at-1e20"),
    pytest.param(lambda b: b.update(created_at=float("nan")), id="created_at-nan"),
    pytest.param(lambda b: b.update(state={"$tensor": 99}), id="tensor-99"),
    pytest.param(lambda b: b.update(state={"$tensor": -1}), id="tensor-minus-1"),
    pytest.param(lambda b: b.update(state={"$tensor": 0, "as": "pickle"}), id="tensor-as"),
    pytest.param(lambda b: b.update(state={"$device": "nonsense:7"}), id="device"),
    pytest.param(lambda b: b.update(state={"$dict": [[[1, 2], 3]]}), id="list-as-key"),
    pytest.param(lambda b: b.update(state={"$dict": [[{"$tensor": 0}, 3]]}), id="tensor-as-key"),
    pytest.param(lambda b: b.update(state={"$dict": [["a", 1], ["a", 2]]}), id="duplicate-dict-key"),
    pytest.param(lambda b: b.update(state={"$np": ["uint8", 1000]}), id="np-overflow"),
    pytest.param(lambda b: b.update(state={"$np": ["int64", [1, 2]]}), id="np-list"),
    pytest.param(lambda b: b.update(state={"$size": [2 ** 70]}), id="size-overflow"),
    pytest.param(lambda b: b.update(state={"$dtype": "object"}), id="dtype-value"),
    pytest.param(lambda b: b.update(state={"$ndarray": {"dtype": "uint8", "shape": [1] * 65, "data": "AA=="}}),
                 id="ndarray-65-dims"),
    pytest.param(lambda b: b["tensors"][0].__setitem__(0, "object"), id="dtype-table"),
    pytest.param(lambda b: b["tensors"][0].__setitem__(1, [0, 1 << 62, 1 << 62]), id="shape-overflow"),
    pytest.param(lambda b: b["tensors"][0].__setitem__(1, [1] * 65), id="shape-65-dims"),
    pytest.param(lambda b: b.update(step=2 + (1 << 64)), id="step-beyond-int64"),
    pytest.param(lambda b: b.update(meta={"attempt": b["meta"]["attempt"], "x": _nested(600)}), id="meta-nested"),
    pytest.param(lambda b: b["ranks"][0].update(index_bytes=1 << 40), id="index-bytes-cap"),
])
def test_hostile_manifest_values_are_format_errors_naming_the_file(root, mutate, capsys):
    newest = dirs(root)[-1]
    rewrite_manifest(root, newest, mutate)
    where = os.path.join(root, newest)
    with pytest.raises(FormatError, match=where):
        Checkpointer(root, readonly=True).load()
    assert Checkpointer(root, readonly=True).load(fallback=True)["step"] == 1
    assert main(["inspect", root]) == 1 and main(["verify", root]) == 1 and main(["ls", root, "--all"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_duplicate_json_keys_and_nan_tokens_are_refused(root):
    newest = dirs(root)[-1]
    text = json.dumps(manifest_body(root, newest))
    for hostile in (_duplicate_key(text), text.replace('"created_at": ', '"created_at": NaN, "x": ', 1),
                    text.replace('"created_at": ', '"created_at": 1e999, "x": ', 1)):
        reseal_text(root, newest, hostile)
        with pytest.raises(FormatError, match="manifest.json"):
            Checkpointer(root, readonly=True).load()
        assert Checkpointer(root, readonly=True).steps() == [1]


def test_ls_and_inspect_survive_an_absurd_commit_time(root, capsys):
    newest = dirs(root)[-1]
    rewrite_manifest(root, newest, lambda b: b.update(created_at=1e20))
    assert main(["ls", root, "--all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [(1, "committed, latest"),
                                                        (2, "damaged manifest (ckpt verify)")]
    assert main(["inspect", root]) == 1
    assert "created_at" in capsys.readouterr().err


@pytest.mark.parametrize("mutate, field", [
    (lambda b: b.update(attempt="someoneelse00000001"), "attempt"),
    (lambda b: b.update(world_size=3), "world_size"),
    (lambda b: b.update(stats={"x": _nested(600)}), "nested"),
    (lambda b: b.update(local={"$tensor": 7}), "tensor"),
])
def test_an_index_that_disagrees_with_its_manifest_is_refused(root, mutate, field):
    newest = dirs(root)[-1]
    rewrite_index(root, newest, 0, mutate)
    with pytest.raises(FormatError, match=rf"rank-00000\.index\.json.*{field}"):
        Checkpointer(root, readonly=True).load()
    assert Checkpointer(root, readonly=True).load(fallback=True)["step"] == 1


# Random JSON, rich in the value-tree vocabulary and in hostile numbers.
_LEAVES = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats()
           | st.sampled_from([10 ** 4000, -1, 0, 1, 99, 2 ** 63, "nan", "float32", "cuda:-1", "../../etc", "$tensor",
                              "AA==", "uint8"])
           | st.text(max_size=6))
_KEYS = st.sampled_from(["$tensor", "$f", "$dict", "$tuple", "$bytes", "$ndarray", "$np", "$dtype", "$size",
                         "$device", "as", "dtype", "shape", "data", "x"])
_JSON = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=2),
                     max_leaves=8)


def _mutate(data, doc):
    """Replace one node of ``doc`` (found by a random walk) with random JSON; returns the new doc."""
    if not isinstance(doc, (dict, list)) or not doc or data.draw(st.integers(0, 3)) == 0:
        return data.draw(_JSON)
    keys = sorted(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = data.draw(st.sampled_from(keys))
    doc[key] = _mutate(data, doc[key])
    return doc


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory) -> str:
    return write(tmp_path_factory.mktemp("fuzz") / "ck", steps=(1,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), target=st.sampled_from(["manifest", "index"]))
def test_random_mutations_only_ever_raise_format_or_corruption_errors(fuzz_root, data, target):
    dirname = dirs(fuzz_root)[-1]
    saved = {n: open(os.path.join(fuzz_root, dirname, n), "rb").read()
             for n in ("manifest.json", "rank-00000.index.json")}
    try:
        if target == "manifest":
            body = manifest_body(fuzz_root, dirname)
            reseal_text(fuzz_root, dirname, json.dumps(_mutate(data, body)))
        else:
            rewrite_index(fuzz_root, dirname, 0, lambda b: _mutate_in(data, b))
        storage = open_storage(fuzz_root)
        try:
            ck = open_checkpoint(storage, dirname)
            read_state(storage, ck)
            read_local(storage, ck, 0)
            describe(ck)
        except (FormatError, CorruptionError):
            pass
    finally:
        for n, raw in saved.items():
            open(os.path.join(fuzz_root, dirname, n), "wb").write(raw)


def _mutate_in(data, body: dict) -> None:
    """Mutate the index ``body`` in place (its top level stays an object)."""
    key = data.draw(st.sampled_from(sorted(body)))
    body[key] = _mutate(data, body[key])


# ---- item 10: a stray file named like a step directory ---------------------------------------------
def test_ls_all_shows_stray_entries_named_like_steps_as_not_checkpoints(root, tmp_path, capsys):
    with open(os.path.join(root, "step-000000000010-abc"), "w") as f:
        f.write("not a checkpoint")
    os.symlink(str(tmp_path), os.path.join(root, "step-000000000011-abc"))
    assert main(["ls", root, "--all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [
        (1, "committed"), (2, "committed, latest"), (10, "not a checkpoint (a file)"),
        (11, "not a checkpoint (a symbolic link)")]
    assert main(["ls", root, "--all"]) == 0
    assert Checkpointer(root, readonly=True).steps() == [1, 2]


# ---- writers never write what readers refuse ------------------------------------------------------
def test_nesting_at_the_limit_round_trips_and_beyond_it_is_refused_at_save(tmp_path):
    from ckpt_engine import UnsupportedValueError
    from ckpt_engine.state.values import MAX_DEPTH

    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save({"deep": _nested(MAX_DEPTH - 1)}, 1)  # the state dict itself is one level
    ck.wait()
    assert ck.load()["deep"] == _nested(MAX_DEPTH - 1)
    with pytest.raises(UnsupportedValueError, match=r"state\['deep'\].*nested deeper than 64"):
        ck.save({"deep": _nested(MAX_DEPTH)}, 2)
    with pytest.raises(UnsupportedValueError, match="65 dimensions"):
        ck.save({"t": torch.zeros([1] * 65)}, 3)
    ck.close()


def test_a_manifest_beyond_the_readers_cap_is_never_committed(tmp_path, monkeypatch):
    import ckpt_engine.format.manifest as manifest

    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save(state(1.0), 1)
    ck.wait()
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 2048)
    ck.save({**state(2.0), "notes": "x" * 4096}, 2)
    with pytest.raises(CheckpointError, match="manifest.*more than the 1984 readers accept"):
        ck.wait()
    ck.close()
    assert Checkpointer(str(tmp_path / "ck"), readonly=True).steps() == [1]


def test_restore_on_several_levels_is_the_same_call(tmp_path):
    with Checkpointer(levels=[str(tmp_path / "l1"), str(tmp_path / "l2")]) as ck:
        for s in (1, 2):
            ck.save(state(float(s)), s, local(float(s), 0))
        ck.wait()
        got = ck.restore()
    assert (got.step, got.state["step"], got.local["pos"], got.first["pos"], got.level) == (2, 2, 20, 20, 0)
