"""``python -m ckpt_engine ls|verify`` on real checkpoints: output content, exit codes, JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from ckpt_engine import Checkpointer
from ckpt_engine.cli import main


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt_engine", *args], capture_output=True, text=True)


def test_ls_json_and_table(tmp_path, capsys):
    with Checkpointer(str(tmp_path)) as ck:
        for step in (10, 20):
            ck.save({"w": torch.zeros(1000), "step": step}, step, {"rank": 0})
    out = run("ls", str(tmp_path), "--json")
    assert out.returncode == 0
    rows = json.loads(out.stdout)
    assert [r["step"] for r in rows] == [10, 20]
    assert set(rows[0]) == {"step", "world_size", "total_bytes", "rank_bytes", "tensors", "time", "dir"}
    assert rows[0]["world_size"] == 1 and rows[0]["rank_bytes"] == [rows[0]["total_bytes"]] and rows[0]["tensors"] == 1
    assert main(["ls", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["step", "ranks", "total"] and table[1].split()[0] == "10"


def test_ls_empty_and_verify_exit_codes(tmp_path, capsys):
    assert main(["ls", str(tmp_path)]) == 0
    assert "no committed checkpoint" in capsys.readouterr().out
    assert main(["verify", str(tmp_path)]) == 2
    with Checkpointer(str(tmp_path)) as ck:
        ck.save({"w": torch.ones(10)}, 3)
    assert main(["verify", str(tmp_path)]) == 0
    assert "OK step 3" in capsys.readouterr().out
    assert main(["verify", str(tmp_path), "--step", "4"]) == 2


def test_storage_options_are_parsed(tmp_path):
    out = run("ls", f"memory://nothing-here", "--storage-option", "skip_instance_cache=true")
    assert out.returncode == 0 and "no committed checkpoint" in out.stdout
    bad = run("ls", str(tmp_path), "--storage-option", "novalue")
    assert bad.returncode != 0 and "key=value" in bad.stderr
