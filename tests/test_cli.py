"""The ``ckpt`` command line on real checkpoints written by 2 ranks (local disk and S3 via moto):
output content, exit codes, ``--json`` shapes, exports that load without ckpt-suite bit for bit,
and no progress output when stderr is not a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pickletools
import pty
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
import uuid
import zipfile

import pytest
import torch

from ckpt_engine import Checkpointer
from ckpt_engine.format.catalog import manifest_dirs
from ckpt_engine.cli import main
from ckpt_engine.storage import open_storage
from dist_worker import make_local, make_state
from helpers import assert_same, bits
from ranks import write_two_ranks

pytestmark = pytest.mark.integration
WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m ckpt_engine ARGS`` with stdout and stderr piped (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "ckpt_engine", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)


@pytest.fixture(scope="module")
def local_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("two-ranks") / "ck")
    write_two_ranks(root)
    return root


@pytest.fixture(scope="module")
def s3_root(s3_server) -> str:
    root = f"s3://ckpt/cli-{uuid.uuid4().hex[:12]}"
    write_two_ranks(root)
    return root


@pytest.fixture
def local_copy(local_root, tmp_path) -> str:
    """A private copy of the 2-rank checkpoint, for tests that damage or delete."""
    dest = str(tmp_path / "copy")
    shutil.copytree(local_root, dest)
    return dest


def out_json(capsys) -> object:
    return json.loads(capsys.readouterr().out)


# ---- ls ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_ls_table_and_json(where, request, capsys):
    root = request.getfixturevalue(f"{where}_root")
    assert main(["ls", root, "--json"]) == 0
    rows = out_json(capsys)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(rows[0]) == {"step", "world_size", "total_bytes", "rank_bytes", "tensors", "time", "dir", "status"}
    for r in rows:
        assert r["world_size"] == 2 and len(r["rank_bytes"]) == 2 and sum(r["rank_bytes"]) == r["total_bytes"]
        assert r["tensors"] == 9 and r["dir"].startswith(f"step-{r['step']:012d}-")
    assert [r["status"] for r in rows] == ["committed", "committed", "committed, latest"]
    assert main(["ls", root]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["step", "ranks", "total", "per", "rank", "time", "status"]
    assert table[1].split()[:2] == ["1", "2"] and table[3].endswith("committed, latest")


@pytest.mark.slow
def test_ls_all_shows_leftovers_and_empty_root(local_copy, tmp_path, capsys):
    os.makedirs(f"{local_copy}/step-000000000004-ffffffffffff00000001")
    with open(f"{local_copy}/step-000000000004-ffffffffffff00000001/rank-00001.abort.json", "w") as f:
        f.write('{"reason": "failed"}')
    assert main(["ls", local_copy, "--all", "--json"]) == 0
    rows = out_json(capsys)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["status"] == "uncommitted (0 index files, 1 aborted)" and rows[-1]["world_size"] is None
    assert main(["ls", local_copy]) == 0
    assert "4" not in [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert main(["ls", str(tmp_path / "nothing")]) == 0
    assert "no committed checkpoint" in capsys.readouterr().out


# ---- verify -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_verify_ok_and_missing_step(where, request, capsys):
    root = request.getfixturevalue(f"{where}_root")
    assert main(["verify", root]) == 0
    assert capsys.readouterr().out.startswith("OK step 3: 9 tensors")
    assert main(["verify", root, "--all", "--json"]) == 0
    doc = out_json(capsys)
    assert doc["ok"] is True and [c["step"] for c in doc["checkpoints"]] == [1, 2, 3]
    assert set(doc["checkpoints"][0]) == {"dir", "step", "world_size", "tensors", "bytes", "ok", "error"}
    assert main(["verify", root, "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "no committed checkpoint of step 7" in err and "[1, 2, 3]" in err


@pytest.mark.slow
def test_verify_names_the_damaged_file_and_tensor(local_copy, capsys):
    name = manifest_dirs(open_storage(local_copy))[-1][1]
    path = f"{local_copy}/{name}/rank-00001.bin"
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["verify", local_copy]) == 1
    err = capsys.readouterr().err
    assert err.startswith("FAILED") and "rank-00001.bin" in err and "checksum mismatch in tensor" in err
    assert main(["verify", local_copy, "--step", "2"]) == 0
    capsys.readouterr()
    assert main(["verify", local_copy, "--all", "--json"]) == 1
    doc = out_json(capsys)
    assert doc["ok"] is False and [c["ok"] for c in doc["checkpoints"]] == [True, True, False]
    assert main(["export", local_copy, str(local_copy) + ".pt"]) == 1  # export verifies while reading
    assert not os.path.exists(str(local_copy) + ".pt")


@pytest.mark.slow
def test_damaged_manifest_fails_verify_and_is_kept_by_gc(local_copy, capsys):
    name = manifest_dirs(open_storage(local_copy))[-1][1]
    with open(f"{local_copy}/{name}/manifest.json", "r+b") as f:
        f.truncate(100)
    assert main(["verify", local_copy]) == 1
    assert "not a sealed manifest" in capsys.readouterr().err
    assert main(["verify", local_copy, "--all", "--json"]) == 1
    doc = out_json(capsys)
    assert [(c["step"], c["ok"], c["world_size"]) for c in doc["checkpoints"]] == [(1, True, 2), (2, True, 2),
                                                                                   (3, False, None)]
    assert main(["inspect", local_copy]) == 1
    assert main(["ls", local_copy, "--all", "--json"]) == 0
    assert out_json(capsys)[-1]["status"] == "damaged manifest (ckpt verify)"
    assert main(["gc", local_copy, "--keep-last", "1", "--grace", "0s", "--yes", "--json"]) == 0
    doc = out_json(capsys)
    assert [r["name"] for r in doc["keep"]] == [name] and "unreadable" in doc["keep"][0]["reason"]
    assert os.path.exists(f"{local_copy}/{name}/manifest.json")


# ---- inspect ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_inspect_text_and_json(local_root, capsys):
    assert main(["inspect", local_root, "--step", "2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("step 2 ") and "2 rank(s)" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ")}
    assert lines["model.big"].split()[1:4] == ["float32", "[512,", "1024]"]
    assert "split over 2 ranks" in lines["model.big"]
    assert "tied to model.emb.weight" in lines["model.head.weight"]
    assert "bfloat16" in lines["model.bf16"] and "int64" in lines["model.count"]
    assert "'lr': 0.002" in lines["optimizer.param_groups"] and "(0.9, 0.999)" in lines["optimizer.param_groups"]
    assert "rank 1:" in text and lines["pos"].split()[-1] == "21"  # rank 1's local at step 2

    assert main(["inspect", local_root, "--json"]) == 0
    doc = out_json(capsys)
    assert (doc["step"], doc["world_size"]) == (3, 2)
    tensors = {t["key"]: t for t in doc["state"]["tensors"]}
    assert tensors["model.big"] | {"index": 0} == {
        "key": "model.big", "dtype": "float32", "shape": [512, 1024], "bytes": 512 * 1024 * 4,
        "placement": "split over 2 ranks", "index": 0, "tied_to": None, "numpy": False}
    assert tensors["model.head.weight"]["tied_to"] == "model.emb.weight"
    values = {v["key"]: v for v in doc["state"]["values"]}
    assert values["step"] == {"key": "step", "type": "int", "repr": "3", "value": 3}
    assert values["optimizer.param_groups"]["value"][0]["$dict"][0] == ["lr", {"$f": 0.003}]
    for r, rank in enumerate(doc["ranks"]):
        local = {v["key"]: v["value"] for v in rank["local"]["values"]}
        assert local == {"rank": r, "pos": 30 + r}
        assert [t["key"] for t in rank["local"]["tensors"]] == ["bn.running_mean", "rng"]
        assert rank["data_bytes"] >= rank["state_bytes"] + rank["local_bytes"] > rank["state_bytes"] > 0
    assert main(["inspect", local_root, "--rank", "1"]) == 0
    rank0, rank1 = capsys.readouterr().out.split("\nrank 0:")[1].split("\nrank 1:")
    assert main(["inspect", local_root, "--rank", "2"]) == 2 and "ranks 0..1" in capsys.readouterr().err
    assert "bn.running_mean" not in rank0 and "bn.running_mean" in rank1
    assert [line.split() for line in rank1.splitlines() if line.split()[:1] == ["pos"]] == [["pos", "int", "31"]]


# ---- diff -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_diff_two_steps_reports_changes_and_exit_codes(local_root, capsys):
    assert main(["diff", local_root, "2", "3", "--json"]) == 1
    doc = out_json(capsys)
    changes = {c["key"]: c for c in doc["changes"]}
    a, b = make_state(2)["model"], make_state(3)["model"]
    big = changes["model.big"]
    assert big["status"] == "changed" and big["numel"] == 512 * 1024
    assert big["differing"] == int((bits(a["big"]).view(-1, 4) != bits(b["big"]).view(-1, 4)).any(1).sum())
    assert big["max_abs_diff"] == (a["big"].double() - b["big"].double()).abs().max().item()
    mask = changes["model.mask"]
    assert mask["differing"] == int((a["mask"] != b["mask"]).sum()) and mask["max_abs_diff"] is None
    assert changes["model.count"]["max_abs_diff"] == 1.0
    assert changes["step"] == {"key": "step", "status": "changed", "a": "2", "b": "3", "numel": None,
                               "differing": None, "max_abs_diff": None, "note": ""}
    assert doc["counts"] == {"changed": 12, "unchanged": 0, "added": 0, "removed": 0} and doc["identical"] is False

    assert main(["diff", local_root, "3", "3"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("identical")
    assert main(["diff", local_root, "3", "3", "--json"]) == 0
    assert all(c["note"] == "same checksums" for c in out_json(capsys)["changes"] if c["differing"] is not None)
    assert main(["diff", local_root, "2", "3", "--quiet"]) == 1
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_diff_across_storages_with_path_at_step(local_root, s3_root, capsys):
    assert main(["diff", f"{local_root}@3", f"{s3_root}@3"]) == 0  # same bytes written to disk and to S3
    assert capsys.readouterr().out.rstrip().endswith("identical")
    assert main(["diff", f"{local_root}@1", s3_root, "--json"]) == 1
    assert out_json(capsys)["counts"]["changed"] == 12


def test_diff_added_removed_values_and_dtype_changes(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    x = torch.tensor([1.0, float("nan"), -0.0, 4.0])
    with Checkpointer(a) as ck:
        ck.save({"x": x, "gone": torch.ones(2), "cast": torch.ones(3), "v": 1, "same": (1, 2.5)}, 1)
    with Checkpointer(b) as ck:
        ck.save({"x": torch.tensor([1.0, float("nan"), 0.0, 2.5]), "new": 5, "cast": torch.ones(3).double(),
                 "v": True, "same": (1, 2.5)}, 1)
    assert main(["diff", a, b, "--json"]) == 1
    changes = {c["key"]: c for c in out_json(capsys)["changes"]}
    assert changes["x"]["differing"] == 2 and changes["x"]["max_abs_diff"] == 1.5  # -0.0 vs 0.0 differs in bits
    assert changes["gone"]["status"] == "removed" and changes["new"]["status"] == "added"
    assert changes["cast"]["note"] == "dtype or shape changed"
    assert changes["v"]["status"] == "changed"  # 1 and True are different values
    assert changes["same"]["status"] == "unchanged"
    assert main(["diff", a, b, "--all"]) == 1
    text = capsys.readouterr().out
    assert "float32[4]" in text and "same" in text and "1 → True" in text
    assert main(["diff", a]) == 2 and "diff takes" in capsys.readouterr().err
    assert main(["diff", a, "x", "y"]) == 2


# ---- export -----------------------------------------------------------------------------------
CHECK_TORCH = r"""
import hashlib, json, sys
sys.modules["ckpt_engine"] = None  # loading must not need ckpt-suite
import torch
obj = torch.load(sys.argv[1], weights_only=True)
def walk(v, path):
    if isinstance(v, torch.Tensor):
        raw = v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        yield path, f"{v.dtype}{list(v.shape)}:{hashlib.sha256(raw).hexdigest()}"
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from walk(x, f"{path}[{k!r}]")
    elif isinstance(v, (list, tuple)):
        yield path, type(v).__name__
        for i, x in enumerate(v):
            yield from walk(x, f"{path}[{i}]")
    else:
        yield path, repr(v)
print(json.dumps(dict(walk(obj, ""))))
print(json.dumps(obj["model"]["emb.weight"] is obj["model"]["head.weight"] if "model" in obj else None))
"""


def pickled_modules(path: str) -> set[str]:
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    mods = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            mods.add(str(arg).split(" ")[0])
    return mods


@pytest.mark.slow
def test_export_torch_loads_without_ckpt_suite_bit_for_bit(local_root, tmp_path, capsys):
    out = str(tmp_path / "state.pt")
    assert main(["export", local_root, "--step", "3", out]) == 0
    assert "exported step 3" in capsys.readouterr().out
    loaded = torch.load(out, weights_only=True)
    assert_same(make_state(3), loaded)
    assert loaded["model"]["emb.weight"] is loaded["model"]["head.weight"]
    assert pickled_modules(out) <= {"torch", "collections", "torch._utils", "_codecs", "builtins"}
    check = subprocess.run([sys.executable, "-I", "-c", CHECK_TORCH, out], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    lines = check.stdout.splitlines()
    assert lines[1] == "true"
    first = json.loads(lines[0])
    assert first["['step']"] == "3" and first["['optimizer']['param_groups'][0]['betas']"] == "tuple"

    flat = str(tmp_path / "flat.pt")
    assert main(["export", local_root, flat, "--flat", "--include-local", "--json", "--step", "2"]) == 0
    doc = out_json(capsys)
    assert doc["format"] == "torch" and doc["step"] == 2 and doc["tensors"] == 12 and doc["values"] == 4
    got = torch.load(flat, weights_only=True)
    assert torch.equal(bits(got["state.model.big"]), bits(make_state(2)["model"]["big"]))
    assert torch.equal(got["local.rng"], make_local(2, 0)["rng"]) and got["local.pos"] == 20
    assert got["state.optimizer.param_groups"] == make_state(2)["optimizer"]["param_groups"]


@pytest.mark.slow
def test_export_safetensors_from_s3_matches_bit_for_bit(s3_root, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = str(tmp_path / "state.safetensors")
    assert main(["export", s3_root, out, "--local-rank", "1"]) == 0
    capsys.readouterr()
    tensors = load_file(out)
    expected = make_state(3)
    assert torch.equal(bits(tensors["state.model.bf16"]), bits(expected["model"]["bf16"]))
    assert torch.equal(tensors["state.model.head.weight"], expected["model"]["emb.weight"])  # tied: written twice
    assert torch.equal(tensors["state.optimizer.state.0.exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])
    assert torch.equal(tensors["local.bn.running_mean"], make_local(3, 1)["bn.running_mean"])
    meta = safe_open(out, "pt").metadata()
    assert json.loads(meta["state.optimizer.param_groups"]) == [{"lr": 0.003, "betas": [0.9, 0.999], "params": [0]}]
    assert meta["state.step"] == "3" and meta["local.pos"] == "31" and meta["format"] == "pt"
    assert len(tensors) == 12


@pytest.mark.slow
def test_export_to_an_fsspec_url_and_errors(local_root, s3_root, tmp_path, capsys):
    url = f"{s3_root}-export/state.pt"
    assert main(["export", local_root, url, "--json"]) == 0
    assert out_json(capsys)["file_bytes"] > 2_000_000
    import fsspec

    with fsspec.open(url, "rb") as f:
        assert_same(make_state(3), torch.load(f, weights_only=True))
    assert main(["export", local_root, str(tmp_path / "x.pt"), "--local-rank", "5"]) == 2
    assert "ranks 0..1" in capsys.readouterr().err
    assert main(["export", local_root, str(tmp_path / "x.pt"), "--out-option", "novalue"]) == 2


# ---- gc ---------------------------------------------------------------------------------------
def make_leftover(root: str, step: int, age_s: float) -> str:
    name = f"step-{step:012d}-eeeeeeeeeeee{step:08d}"
    os.makedirs(f"{root}/{name}")
    with open(f"{root}/{name}/rank-00000.bin", "wb") as f:
        f.write(b"x" * 100)
    then = time.time() - age_s
    os.utime(f"{root}/{name}/rank-00000.bin", (then, then))
    return name


@pytest.mark.slow
def test_gc_dry_run_then_delete(local_copy, capsys):
    old = make_leftover(local_copy, 9, 7200)
    young = make_leftover(local_copy, 10, 5)
    os.makedirs(f"{local_copy}/step-000000000011-eeeeeeeeeeee00000011")  # a save that just began
    before = sorted(os.listdir(local_copy))
    assert main(["gc", local_copy, "--keep-last", "2"]) == 0
    text = capsys.readouterr().out
    assert "would remove 2 item(s)" in text and "beyond --keep-last 2" in text and old in text
    assert "dry run" in text and f"{young}" in text.split("kept:")[1]
    assert sorted(os.listdir(local_copy)) == before
    assert main(["gc", local_copy, "--keep-last", "2", "--yes", "--json"]) == 0
    doc = out_json(capsys)
    assert doc["dry_run"] is False and {r["reason"] for r in doc["remove"]} == {"beyond --keep-last 2", "uncommitted"}
    assert [r["name"] for r in doc["keep"]] == [young, "step-000000000011-eeeeeeeeeeee00000011"]
    assert [r["step"] for r in json.loads(run("ls", local_copy, "--json").stdout)] == [2, 3]
    assert os.path.isdir(f"{local_copy}/{young}") and not os.path.exists(f"{local_copy}/{old}")
    assert main(["gc", local_copy, "--keep-last", "0"]) == 2
    assert main(["gc", local_copy, "--grace", "soon"]) == 2
    assert "--grace" in capsys.readouterr().err


@pytest.mark.slow
def test_gc_on_s3_spares_committed_and_young_leftovers(s3_server, s3_root, capsys):
    root = f"s3://ckpt/gc-{uuid.uuid4().hex[:8]}"
    st = open_storage(root)
    st.write_atomic("step-000000000001-eeeeeeeeeeee00000001/rank-00000.bin", b"x" * 10)
    with Checkpointer(root) as ck:  # its start-up sweep would delete the leftover: write that afterwards
        ck.save({"w": torch.ones(4)}, 2)
    st.write_atomic("step-000000000001-eeeeeeeeeeee00000001/rank-00000.bin", b"x" * 10)
    assert main(["gc", root, "--json"]) == 0
    doc = out_json(capsys)
    assert doc["remove"] == [] and doc["keep"][0]["step"] == 1 and doc["keep"][0]["age_s"] < 600
    assert main(["gc", root, "--grace", "0s", "--yes"]) == 0
    assert "removed 1 item(s)" in capsys.readouterr().out
    assert main(["ls", root, "--all", "--json"]) == 0
    assert [r["step"] for r in out_json(capsys)] == [2]


# ---- progress, storage options, usage ---------------------------------------------------------
@pytest.mark.slow
def test_no_progress_output_when_piped(local_root, tmp_path):
    for args in (["verify", local_root], ["export", local_root, str(tmp_path / "p.pt")],
                 ["diff", local_root, "1", "3"]):
        out = run(*args)
        assert out.returncode in (0, 1), out.stderr
        assert out.stderr == "", out.stderr
    js = run("verify", local_root, "--json")
    assert js.stderr == "" and json.loads(js.stdout)["ok"] is True


@pytest.mark.slow
def test_progress_bar_on_a_terminal_only_on_stderr(local_root):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_engine", "verify", local_root], stdout=subprocess.PIPE,
                            stderr=slave, cwd=REPO)
    os.close(slave)
    seen = b""
    while select.select([master], [], [], 30)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.wait(60) == 0
    assert b"verify step 3" in seen and b"%|" in seen
    assert b"%|" not in proc.stdout.read()


@pytest.mark.slow
def test_storage_options_reach_fsspec(s3_server, s3_root):
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    opt = "client_kwargs=" + json.dumps({"endpoint_url": s3_server.endpoint, "region_name": "us-east-1"})
    out = run("ls", s3_root, "--json", "--storage-option", opt, env=env)
    assert out.returncode == 0, out.stderr
    assert [r["step"] for r in json.loads(out.stdout)] == [1, 2, 3]
    bad = run("ls", s3_root, "--storage-option", "novalue")
    assert bad.returncode == 2 and "key=value" in bad.stderr
    usage = run("frobnicate")
    assert usage.returncode == 2 and "invalid choice" in usage.stderr
