"""The documentation is tested like code.

Every ```python block in README.md and in docs/ runs offline as written, each in a fresh
interpreter, and must exit 0. A page's ```ipython blocks are the cells of one IPython session,
run in order. Every test that docs/guarantees.md names exists.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
GUIDES = sorted((REPO / "docs" / "guides").glob("*.md"))


def _blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), re.M | re.S)


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


PYTHON = [(page, i, code) for page in PAGES for i, code in enumerate(_blocks(page, "python"), 1)]
IPYTHON = [page for page in PAGES if _blocks(page, "ipython")]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


def test_the_readme_and_every_guide_have_examples():
    assert len(_blocks(REPO / "README.md", "python")) >= 3
    assert GUIDES and all(_blocks(page, "python") for page in GUIDES), GUIDES


@pytest.mark.parametrize(
    ("page", "index", "code"), PYTHON, ids=[f"{_name(p)}:{i}" for p, i, _ in PYTHON]
)
def test_python_example_runs(page, index, code, tmp_path):
    done = _run(["-c", code], tmp_path)
    assert done.returncode == 0, f"{_name(page)} block {index}:\n{code}\n{done.stderr[-3000:]}"


_SESSION = """
import json, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
for cell in json.loads(sys.argv[1]):
    shell.run_cell(cell).raise_error()
"""


@pytest.mark.parametrize("page", IPYTHON, ids=[_name(p) for p in IPYTHON])
def test_ipython_cells_run_in_one_session(page, tmp_path):
    cells = _blocks(page, "ipython")
    done = _run(["-c", _SESSION, json.dumps(cells)], tmp_path)
    assert done.returncode == 0, f"{_name(page)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


# -- docs/guarantees.md names tests that exist ---------------------------------------------------

_SPAN = re.compile(r"`([^`]+)`")


def _test_references(page: Path) -> list[tuple[str, str | None]]:
    """(file pattern, test name pattern or None) for every test the page's table names.

    In a table row's second column, ``a/test_x.py::test_y`` names a test, ``::test_z`` or a
    bare ``test_z`` one in the file named last, and ``a/test_x.py`` a whole file.
    """
    references: list[tuple[str, str | None]] = []
    for row in page.read_text().splitlines():
        cells = row.split(" | ")
        if not row.startswith("|") or len(cells) < 2:
            continue
        current = None
        for span in _SPAN.findall(cells[-1]):
            path, _, name = span.partition("::")
            if path.endswith(".py"):
                current = path
                references.append((path, name or None))
            elif current and (name or re.fullmatch(r"test_\w+", path)):
                references.append((current, name or path))
    return references


def _test_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


def test_every_test_named_in_the_guarantees_exists():
    references = _test_references(REPO / "docs" / "guarantees.md")
    assert len(references) > 50, references
    missing = []
    for pattern, name in references:
        files = sorted((REPO / "tests").glob(pattern)) or sorted(REPO.glob(pattern))
        if not files:
            missing.append(pattern)
        elif name and not any(fnmatch.filter(_test_names(f), name) for f in files):
            missing.append(f"{pattern}::{name}")
    assert missing == []


# -- the README's links (the site's own links are checked by mkdocs build --strict) -------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's toc slugify, code marks dropped)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_link_in_the_readme_resolves():
    broken = []
    for link in _LINK.findall((REPO / "README.md").read_text()):
        if "://" in link:
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path
        if not target.exists() or (anchor and anchor not in _anchors(target)):
            broken.append(link)
    assert broken == []
