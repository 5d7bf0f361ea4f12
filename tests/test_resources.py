"""No thread or executor lives at import; every thread a ``Checkpointer`` starts ends with its
``close()``, the hashing thread beside the write included (it was a pool made at import, shared by
every checkpointer of the process and never shut down)."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import torch

from ckpt_engine import Checkpointer
from ckpt_engine.save import buffers, persist

ROOT = Path(__file__).resolve().parent.parent


STARTERS = {"Thread", "Timer", "ThreadPoolExecutor", "ProcessPoolExecutor", "Pool"}


def _module_level_calls(tree: ast.Module):
    """Calls that run at import: in module-level statements, not inside a function or a class body's methods."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Call):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def test_no_module_starts_a_thread_or_an_executor_at_import():
    for package in ("ckpt_engine", "lightning_ckpt", "horovod_ckpt"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for call in _module_level_calls(ast.parse(path.read_text(), str(path))):
                name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
                assert name not in STARTERS, f"{path.relative_to(ROOT)}:{call.lineno}: {name}() at import"


def test_close_ends_every_thread_the_checkpointer_started_the_hashing_one_included(tmp_path, monkeypatch):
    # the copy's own checksums off, and every write large enough: persist hashes beside the write
    monkeypatch.setattr(buffers.HostBuffer, "checksums", property(lambda self: None, lambda self, value: None))
    monkeypatch.setattr(persist, "_OVERLAP_MIN", 0)
    before = set(threading.enumerate())
    seen: set[str] = set()
    ck = Checkpointer(str(tmp_path), keep_last=2)
    for step in (1, 2, 3):
        ck.save({"w": torch.full((1024, 64), float(step))}, step)
        ck.wait(retention=True)
        seen |= {t.name for t in set(threading.enumerate()) - before}
    ck.close()
    assert any(name.startswith("ckpt-hash") for name in seen), seen
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left, f"threads left after close(): {left}"
    assert Checkpointer(str(tmp_path), readonly=True).load()["w"][0, 0] == 3.0
