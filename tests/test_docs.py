"""The user documents: README.md and the MkDocs site built from docs/.

The site is built with ``mkdocs build --strict`` as a user would build it, so a broken link, a
missing anchor, a snippet of a file that is gone or an API reference that no longer resolves fails
here. README.md is checked for what a newcomer reads first (the two set-up commands, its length)
and for relative links that resolve, anchors included.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
SETUP_BLOCK = [
    "```bash",
    "bash scripts/demo.sh    # set up .venv, then train on 2 ranks, SIGKILL mid-run, resume, show figures and"
    " identical weights",
    "bash scripts/test.sh    # set up .venv, then run the whole test suite (what CI runs)",
    "```",
]
# A working session named by its number (the word followed by a number, or "s" and a number) or as
# this/next/last one: how the work went, which users never saw (a date and a commit say it to anyone).
# "s3" is storage, "TrainingSession" a class.
WORK_SESSION = re.compile(r"\bsessions?\s+\d|\b(?:this|that|next|previous|earlier|last) session\b|\bs(?!3\b)\d{1,3}\b",
                          re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _without_code(text: str) -> str:
    """The Markdown ``text`` without fenced blocks and code spans (links inside them are not links)."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def _github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown`` (lower case, punctuation dropped,
    spaces as hyphens, ``-1``, ``-2`` ... for repeats)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        heading = None if in_fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        title = re.sub(r"`([^`]*)`", r"\1", heading.group(1))
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_readme_starts_with_the_two_setup_commands_and_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[:len(SETUP_BLOCK)] == SETUP_BLOCK, (
        "README.md must open with the fenced block of the two set-up commands (scripts/demo.sh, scripts/test.sh), "
        f"exactly as tests/test_docs.py SETUP_BLOCK has it; it opens with {lines[:len(SETUP_BLOCK)]!r}")
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the detail to a page of docs/ "
        "and link to it")


def test_readme_relative_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(_without_code(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (README.parent / path).resolve() if path else README
        if not file.is_file():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in _github_anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, "README.md links that lead nowhere (fix the link or the heading):\n" + "\n".join(broken)


def test_no_word_of_working_sessions_anywhere_in_the_project() -> None:
    """Every tracked text file (code, tests, benchmarks and their results, CHANGELOG, docs), this one
    excepted for its pattern."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    hits = []
    for name in tracked.split():
        if name == "tests/test_docs.py":
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary, or deleted in the working tree
        for number, line in enumerate(text.splitlines(), 1):
            if WORK_SESSION.search(line):
                hits.append(f"{name}:{number}: {line.strip()}")
    assert not hits, "name the date and the commit instead of a working session:\n" + "\n".join(hits)


def test_configuration_page_names_every_key_of_the_schema() -> None:
    from ckpt_engine.config import CheckpointConfig, LevelSpec

    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(\w+)`", page, flags=re.MULTILINE))
    keys = {f.name for f in dataclasses.fields(CheckpointConfig)} | {f.name for f in dataclasses.fields(LevelSpec)}
    missing = sorted(keys - documented)
    assert not missing, f"docs/configuration.md has no table row for the configuration key(s) {missing}"


def test_api_reference_covers_every_public_name() -> None:
    import ckpt_engine
    import horovod_ckpt
    import lightning_ckpt

    page = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [f"{package.__name__}.{name}" for package in (ckpt_engine, lightning_ckpt, horovod_ckpt)
               for name in package.__all__
               if not re.search(rf"^::: {package.__name__}(\.\w+)*\.{name}\s*$", page, flags=re.MULTILINE)]
    assert not missing, f"docs/api.md has no '::: ' entry for the public name(s) {missing}"


def test_the_api_reference_lists_only_public_names() -> None:
    """Each ``::: package[.module].Name`` of docs/api.md is in that package's ``__all__``."""
    import ckpt_engine
    import horovod_ckpt
    import lightning_ckpt

    public = {p.__name__: set(p.__all__) for p in (ckpt_engine, lightning_ckpt, horovod_ckpt)}
    entries = re.findall(r"^::: (\w+)(?:\.\w+)*\.(\w+)\s*$", (DOCS / "api.md").read_text(encoding="utf-8"),
                         flags=re.MULTILINE)
    extra = [f"{package}.{name}" for package, name in entries if name not in public.get(package, set())]
    assert entries and not extra, f"docs/api.md documents names its package does not export: {extra}"


IMPORT = re.compile(r"^\s*from (ckpt_engine|lightning_ckpt|horovod_ckpt)((?:\.\w+)*) import \(?([\w, ]+)",
                    flags=re.MULTILINE)


def test_docs_and_examples_import_only_what_the_packages_export() -> None:
    """A user copies the docs and the examples: every name they import from the project comes from
    the package itself (``from ckpt_engine import ResumableSampler``), and the package exports it."""
    import ckpt_engine
    import horovod_ckpt
    import lightning_ckpt

    public = {p.__name__: set(p.__all__) for p in (ckpt_engine, lightning_ckpt, horovod_ckpt)}
    files = [README, *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "examples").rglob("*.py"))]
    wrong = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for m in IMPORT.finditer(text):
            package, module, names = m.group(1), m.group(2), [n.strip() for n in m.group(3).split(",") if n.strip()]
            line = text.count("\n", 0, m.start()) + 1
            if f"{package}{module}".startswith("ckpt_engine.testing"):
                continue  # the test support (a backend's conformance suite), imported from where it lives
            if module:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: from {package}{module} (import from {package})")
            wrong += [f"{path.relative_to(ROOT)}:{line}: {package}.{n} is not in {package}.__all__"
                      for n in names if n not in public[package]]
    assert not wrong, "\n".join(wrong)


OLD_NAMES = re.compile(r"\b(?:every_n_steps|every_seconds|final_checkpoint)\s*[=:]|\bextra\s*=\s*\{|"
                       r"(?:Checkpoint|HorovodCheckpointer|DurableTorchState|CheckpointConfig)\([^)]*\bpath\s*=|"
                       r"^path:", re.MULTILINE)
"""The first release's flag names (``path``, ``every_n_steps``, ``every_seconds``, ``final_checkpoint``,
``extra=``) as a user would write them in code or YAML; a level's own ``path:`` is indented or inline."""


def _code_blocks(markdown: str) -> str:
    return "\n".join(re.findall(r"^```[a-z]*\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL))


def test_readme_docs_and_examples_use_only_the_flag_names_of_now() -> None:
    """The old names work one release behind a DeprecationWarning (tests/test_public_api.py); what users
    copy, the README's and the docs' code blocks and the examples, spells only the names of now."""
    texts = {str(p.relative_to(ROOT)): _code_blocks(p.read_text(encoding="utf-8"))
             for p in [README, *sorted(DOCS.glob("*.md"))]}
    texts.update({str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
                  for p in sorted((ROOT / "examples").iterdir()) if p.suffix in (".py", ".yaml", ".yml")})
    found = [f"{name}: {m.group(0)!r}" for name, text in texts.items() for m in OLD_NAMES.finditer(text)]
    assert not found, f"old flag names where users copy from: {found}"


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: install the docs extra (pip install -e '.[docs]'; "
                    "scripts/setup_env.sh does it)")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(ROOT / "mkdocs.yml"), "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # Material's end-of-life banner
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed (exit {done.returncode}):\n{output}"
    assert not re.search(r"^WARNING\b", output, flags=re.MULTILINE), f"mkdocs build --strict warned:\n{output}"
    pages = [site / "index.html"] + [site / page / "index.html" for page in
                                      ("install", "lightning", "horovod", "core", "configuration", "storage", "memory",
                                       "CLI", "FORMAT", "troubleshooting", "api")]
    assert [str(p.relative_to(site)) for p in pages if not p.is_file()] == [], f"pages missing from the site {site}"
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="ckpt_engine.Checkpointer"' in api, "the API reference does not document ckpt_engine.Checkpointer"
