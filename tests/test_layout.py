"""The package's shape, kept as the design says (``docs/`` and CHANGELOG name it): every folder of
code is a regular package (so a built wheel ships it), no module over 400 lines, and no import
circle between modules, counting imports inside functions and under ``TYPE_CHECKING`` (a circle hidden
there is a circle all the same: the two modules cannot be read, tested or moved apart)."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("ckpt_engine", "lightning_ckpt", "horovod_ckpt")
MAX_LINES = 400


def _modules(package: str) -> dict[str, str]:
    """``{dotted name: path}`` of every module of ``package``."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The modules of the project that module ``name`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + path.endswith("__init__.py")]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_every_folder_of_code_is_a_package(package):
    missing = [os.path.relpath(folder, ROOT) for folder, dirs, files in os.walk(os.path.join(ROOT, package))
               if "__pycache__" not in folder and any(f.endswith(".py") for f in files)
               and "__init__.py" not in files]
    assert not missing, f"folders without __init__.py (a wheel would leave them out): {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_over_400_lines(package):
    long = {name: n for name, path in _modules(package).items()
            if (n := sum(1 for _ in open(path))) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package):
    modules = _modules(package)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
