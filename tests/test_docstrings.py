"""Docstrings name what exists: every module a package's docstring lists (``:mod:`.name```), and
every file a docstring or comment of the three packages points to (``levels/restore.py``,
``docs/FORMAT.md``, ``tests/test_x.py``), resolved in the package, in ``ckpt_engine/`` or at the
repository's root."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ckpt_engine", "lightning_ckpt", "horovod_ckpt")
FILES = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
ELSEWHERE = {"runner/http/http_server.py": "horovod"}
"""Files of other projects a comment names, and the project: looked for where it is installed."""
OTHERS = [Path(spec.submodule_search_locations[0]) for spec in map(importlib.util.find_spec, set(ELSEWHERE.values()))
          if spec is not None and spec.submodule_search_locations]
MOD = re.compile(r":mod:`\.([A-Za-z_][A-Za-z0-9_]*)`")
PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)+[\w-]+\.(?:py|md|yaml|sh))\b")


def _exists(module: Path, name: str) -> bool:
    return (module / f"{name}.py").exists() or (module / name / "__init__.py").exists()


@pytest.mark.parametrize("init", [p for p in FILES if p.name == "__init__.py"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_a_package_docstring_lists_exists(init):
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    missing = [name for name in MOD.findall(doc) if not _exists(init.parent, name)]
    assert not missing, f"{init.relative_to(ROOT)} lists modules that do not exist: {missing}"


def test_every_file_a_docstring_or_comment_points_to_exists():
    missing = []
    for path in FILES:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for ref in PATH.findall(line):
                if ref in ELSEWHERE and importlib.util.find_spec(ELSEWHERE[ref]) is None:
                    continue  # not installed here: nothing to look in
                bases = (path.parent, path.parent.parent, ROOT / "ckpt_engine", ROOT, *OTHERS)
                if not any((base / ref).exists() for base in bases):
                    missing.append(f"{path.relative_to(ROOT)}:{lineno}: {ref}")
    assert not missing, "files named that do not exist:\n" + "\n".join(missing)
