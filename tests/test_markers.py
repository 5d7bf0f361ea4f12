"""The quick subset (``-m "not slow and not s3 and not azure"``) starts no process and no server.

Read from the source, without running a test: every test that starts a process (a Python interpreter,
a job of ranks, ``torchrun``, ``horovodrun``, Lightning's spawn, ``mkdocs``), directly, through a
helper of tests/ (``ranks.start_ranks``, ``forkserver.launch``, ...) or through a fixture, must be
marked ``slow`` on its module, class, function or every one of its parameters. Tests that use the
object-store servers get ``s3`` / ``azure`` from tests/conftest.py by their fixtures; that those marks
are there before ``-m`` selects is checked on a small suite collected in this process.

Not counted as starting a process: tools that take milliseconds (``git``, ``mount``, ``umount``), a
``python -c pass`` (a process id that is surely dead), and a DataLoader's worker processes (forks of
this one, no interpreter start-up).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STARTS = {f"subprocess.{f}" for f in ("Popen", "run", "call", "check_call", "check_output", "getoutput",
                                       "getstatusoutput")} | {
    f"os.{f}" for f in ("system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve",
                        "execvp", "execvpe", "spawnv", "spawnve")} | {
    f"{m}.{f}" for m in ("multiprocessing", "torch.multiprocessing") for f in ("Process", "Pool", "spawn",
                                                                               "start_processes", "get_context")} | {
    "pty.fork", "pty.spawn", "asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell"}
"""Calls that start a process themselves; everything else starts one only by calling one of these."""
CHEAP_TOOLS = {"git", "mount", "umount"}
SERVERS = {"s3_server": "s3", "azurite_server": "azure"}


@dataclass
class Module:
    """One file of tests/: what its names refer to, its functions and its classes."""

    name: str
    tree: ast.Module
    names: dict[str, str] = field(default_factory=dict)
    """Local name -> dotted name (``sp`` -> ``subprocess``, ``start_ranks`` -> ``ranks.start_ranks``)."""
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    """Dotted name -> definition, for module-level functions and methods of module-level classes."""
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)


def load(path: Path) -> Module:
    """``path`` parsed, its imports (also those inside functions) and definitions indexed."""
    mod = Module(path.stem, ast.parse(path.read_text(), str(path)))
    for node in ast.walk(mod.tree):  # imports inside functions too
        if isinstance(node, ast.Import):
            mod.names.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                              for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mod.names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    for node in mod.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mod.names[node.name] = f"{mod.name}.{node.name}"
            mod.functions[f"{mod.name}.{node.name}"] = node
        elif isinstance(node, ast.ClassDef):
            mod.names[node.name] = f"{mod.name}.{node.name}"
            mod.classes[f"{mod.name}.{node.name}"] = node
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    mod.functions[f"{mod.name}.{node.name}.{item.name}"] = item
    return mod


def dotted(mod: Module, expr: ast.expr, cls: str | None = None) -> str | None:
    """What a called expression names, resolved through the module's imports (``self.x`` -> ``cls.x``)."""
    if isinstance(expr, ast.Name):
        return mod.names.get(expr.id, expr.id)
    if isinstance(expr, ast.Attribute):
        if isinstance(expr.value, ast.Name) and expr.value.id in ("self", "cls") and cls:
            return f"{cls}.{expr.attr}"
        base = dotted(mod, expr.value, cls)
        return base and f"{base}.{expr.attr}"
    return None


def cheap(call: ast.Call) -> bool:
    """A tool that takes milliseconds, or ``python -c pass``."""
    first = call.args[0] if call.args else None
    if not isinstance(first, (ast.List, ast.Tuple)) or not first.elts:
        return False
    words = [e.value if isinstance(e, ast.Constant) else ast.unparse(e) for e in first.elts]
    return words[0] in CHEAP_TOOLS or words == ["sys.executable", "-c", "pass"]


class Project:
    """Every module of tests/, and which of their functions start a process (with the call that does)."""

    def __init__(self, root: Path = TESTS) -> None:
        self.modules = {p.stem: load(p) for p in sorted(root.glob("*.py"))}
        self.owner = {f: m for m in self.modules.values() for f in [*m.functions, *m.classes]}
        self.why: dict[str, str] = {}
        self._seen: dict[int, list[tuple[ast.Call, str]]] = {}
        changed = True
        while changed:  # to a fixed point: a function calling one that starts a process starts one
            changed = False
            for name, m in self.owner.items():
                if name not in self.why and (reason := self._starts(m, name)):
                    self.why[name], changed = reason, True

    def _calls(self, m: Module, node: ast.AST, cls: str | None) -> list[tuple[ast.Call, str]]:
        """Every call in ``node`` with what it names (once per node: the fixed point asks again)."""
        if (key := id(node)) not in self._seen:
            self._seen[key] = [(call, target) for call in ast.walk(node) if isinstance(call, ast.Call)
                               if (target := dotted(m, call.func, cls)) is not None]
        return self._seen[key]

    def _starts(self, m: Module, name: str) -> str | None:
        if name in m.classes:  # making an object that can start processes
            return next((f"{name}() -> {f}" for f in self.why if f.startswith(f"{name}.")), None)
        cls = name.rsplit(".", 1)[0] if name.rsplit(".", 1)[0] in m.classes else None
        return self.reason(m, m.functions[name], cls)

    def reason(self, m: Module, node: ast.AST, cls: str | None = None) -> str | None:
        """The first call in ``node`` that starts a process, as ``target`` or ``helper -> ...``."""
        for call, target in self._calls(m, node, cls):
            if target in STARTS and not cheap(call):
                return target
            if target in self.why:
                return f"{target} -> {self.why[target]}"
        return None

    def fixtures(self, m: Module) -> dict[str, tuple[Module, ast.FunctionDef]]:
        """The fixtures a test of ``m`` can ask for by name: conftest's, those imported, its own."""
        found = {}
        for source in (self.modules["conftest"], m):
            for node in source.tree.body:
                if isinstance(node, ast.FunctionDef) and is_fixture(node):
                    found[node.name] = (source, node)
        for local, target in m.names.items():
            if (f := self.modules.get(target.rsplit(".", 1)[0])) and is_fixture(f.functions.get(target)):
                found[local] = (f, f.functions[target])
        return found


def decorators(node: ast.FunctionDef | ast.ClassDef) -> str:
    """The source of ``node``'s decorators."""
    return " ".join(ast.unparse(d) for d in node.decorator_list)


def is_fixture(node: ast.FunctionDef | None) -> bool:
    """Whether ``node`` is a fixture (decorated with ``pytest.fixture``)."""
    return node is not None and "pytest.fixture" in decorators(node)


def requested(node: ast.FunctionDef, known: dict) -> tuple[list[str], list[str]]:
    """The fixtures a function asks for: by its arguments, and by ``request.getfixturevalue(...)``
    (a name, a name from its parameters, or an f-string matched against the ``known`` fixtures)."""
    dynamic = []
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        if isinstance(call.func, ast.Attribute) and call.func.attr == "getfixturevalue" and call.args:
            arg = call.args[0]
            if isinstance(arg, ast.JoinedStr):
                pattern = "".join(re.escape(v.value) if isinstance(v, ast.Constant) else r"\w+" for v in arg.values)
                dynamic += [n for n in known if re.fullmatch(pattern, n)]
            else:  # constants in the call, or in the parameters that name the fixture
                where = call if not isinstance(arg, ast.Name) else ast.Module(node.decorator_list, [])
                dynamic += [c.value for c in ast.walk(where) if isinstance(c, ast.Constant) and c.value in known]
    return [a.arg for a in node.args.args if a.arg not in ("self", "cls")], dynamic


def says_slow(project: Project, m: Module, node: ast.expr) -> bool:
    """``pytest.mark.slow`` in this expression, or in the body of the decorator of tests/ it names."""
    if "pytest.mark.slow" in ast.unparse(node):
        return True
    name = dotted(m, node.func if isinstance(node, ast.Call) else node)
    owner = project.owner.get(name or "")
    return owner is not None and name in owner.functions and "pytest.mark.slow" in ast.unparse(owner.functions[name])


def marks_of(m: Module, test: ast.FunctionDef, cls: ast.ClassDef | None) -> list[ast.expr]:
    """The mark expressions that apply to ``test``: its module's, its class's, its own."""
    def assigned(body: list[ast.stmt]) -> list[ast.expr]:
        return [n.value for n in body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    return assigned(m.tree.body) + (cls.decorator_list + assigned(cls.body) if cls else []) + test.decorator_list


def slow(project: Project, m: Module, test: ast.FunctionDef, cls: ast.ClassDef | None) -> bool:
    """Whether pytest will see ``slow`` on every case of ``test``."""
    marks = marks_of(m, test, cls)
    if any(says_slow(project, m, d) for d in marks if "parametrize" not in ast.unparse(d)):
        return True
    for d in test.decorator_list:  # every parameter marked
        if isinstance(d, ast.Call) and "parametrize" in ast.unparse(d.func) and len(d.args) > 1:
            cases = d.args[1]
            if isinstance(cases, (ast.List, ast.Tuple)) and cases.elts and all(
                    isinstance(c, ast.Call) and "pytest.param" in ast.unparse(c.func)
                    and any(k.arg == "marks" and says_slow(project, m, k.value) for k in c.keywords) for c in cases.elts):
                return True
    return False


def collected(m: Module) -> Iterator[tuple[ast.FunctionDef, ast.ClassDef | None]]:
    """``(test, class or None)`` for every test function pytest collects from ``m``."""
    for node in m.tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            yield node, None
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            yield from ((f, node) for f in node.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test"))


def check(project: Project, m: Module, test: ast.FunctionDef, cls: ast.ClassDef | None) -> list[str]:
    """What is wrong with ``test``'s marks: a process started (by itself or by a fixture it asks for,
    autouse ones included) without ``slow``; a server fixture asked for by name at run time (which
    tests/conftest.py cannot see) without its marker where the name is asked for."""
    fixtures = project.fixtures(m)
    problems = []
    reason = project.reason(m, test, cls and f"{m.name}.{cls.name}")
    static, dynamic = requested(test, fixtures)
    here = " ".join(ast.unparse(d) for d in marks_of(m, test, cls))
    autouse = [n for n, (_, f) in fixtures.items() if "autouse=True" in decorators(f)]
    todo: list[tuple[str, str | None]] = [(n, None) for n in static + autouse] + [(n, here) for n in dynamic]
    seen: set[tuple[str, str | None]] = set()
    while todo:
        name, marks = todo.pop()
        if name in SERVERS:
            if marks is not None and f"pytest.mark.{SERVERS[name]}" not in marks:
                problems.append(f"uses the {SERVERS[name]} server through a fixture asked for by name at run time "
                                f"and is not marked {SERVERS[name]} there")
            continue
        if (name, marks) in seen or name not in fixtures:
            continue
        seen.add((name, marks))
        source, fixture = fixtures[name]
        reason = reason or ((found := project.reason(source, fixture)) and f"fixture {name}: {found}")
        static, dynamic = requested(fixture, fixtures)
        todo += [(n, marks) for n in static] + [(n, decorators(fixture)) for n in dynamic]
    if reason and not slow(project, m, test, cls):
        problems.append(f"starts a process ({reason}) and is not marked slow")
    return sorted(set(problems))


def offenders(project: Project) -> list[str]:
    """Every test of ``project`` whose marks do not say what it starts, with why."""
    return [f"{m.name}.py::{cls.name + '::' if cls else ''}{test.name} {problem}"
            for m in project.modules.values() if m.name.startswith("test_")
            for test, cls in collected(m) for problem in check(project, m, test, cls)]


def test_every_test_that_starts_a_process_is_marked_slow():
    found = offenders(Project())
    assert not found, "\n".join(found)


def test_the_scan_sees_starts_through_helpers_fixtures_and_marks(tmp_path):
    """The scan itself, on a small suite: direct and indirect starts are found, marks in each place
    count, cheap tools do not; a server fixture asked for by name needs its marker there (one asked
    for as an argument gets it from conftest.py)."""
    (tmp_path / "conftest.py").write_text("import pytest\n")
    (tmp_path / "launch.py").write_text(
        "import subprocess, sys\n"
        "def job():\n    return subprocess.Popen([sys.executable, 'w.py'])\n"
        "def sha():\n    return subprocess.run(['git', 'rev-parse', 'HEAD'])\n")
    (tmp_path / "test_suite.py").write_text(
        "import os\nimport pytest\nfrom launch import job, sha\n"
        "@pytest.fixture\ndef started():\n    return job()\n"
        "def test_direct():\n    os.system('true')\n"
        "def test_helper():\n    from launch import job as start\n    start()\n"
        "def test_fixture(started):\n    pass\n"
        "def test_cheap():\n    sha()\n"
        "@pytest.mark.slow\ndef test_marked():\n    job()\n"
        "@pytest.mark.parametrize('n', [pytest.param(1, marks=pytest.mark.slow), 2])\n"
        "def test_one_case_marked(n):\n    job()\n"
        "class TestClass:\n    pytestmark = pytest.mark.slow\n    def test_in_class(self):\n        job()\n"
        "@pytest.fixture\ndef s3_root(s3_server):\n    return 's3://b/x'\n"
        "@pytest.mark.parametrize('where', ['s3'])\n"
        "def test_by_name(where, request):\n    request.getfixturevalue(f'{where}_root')\n"
        "@pytest.mark.parametrize('where', [pytest.param('s3', marks=pytest.mark.s3)])\n"
        "def test_by_name_marked(where, request):\n    request.getfixturevalue(f'{where}_root')\n"
        "def test_s3_by_fixture(s3_root):\n    pass\n")
    found = offenders(Project(tmp_path))
    assert [f.split(" ")[0] for f in found] == [f"test_suite.py::test_{n}" for n in
                                                ("direct", "helper", "fixture", "one_case_marked", "by_name")], found
    assert "fixture started: launch.job -> subprocess.Popen" in found[2]
    assert "uses the s3 server through a fixture asked for by name at run time" in found[4]


SMALL_SUITE = """
def test_s3(s3_url):
    pass

def test_azure(az_url):
    pass

def test_any(any_url):
    pass

def test_none(tmp_path):
    pass
"""


def test_server_tests_are_left_out_by_their_marker(pytester):
    """tests/conftest.py marks a test by the server fixtures it asks for before ``-m`` selects (seen
    once: the marks came after the selection, and the quick subset started moto and azurite)."""
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(test_small=SMALL_SUITE)
    result = pytester.inline_run("--collect-only", "-p", "no:cacheprovider", "-m", "not s3 and not azure")
    kept = [item.name for item in result.getcalls("pytest_collection_finish")[0].session.items]
    assert kept == ["test_any[local]", "test_any[memory]", "test_any[fsspec-local]", "test_none"]
