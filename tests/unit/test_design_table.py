"""Every row of docs/design.md's table of a result's inputs names tests that exist.

The table ("materialize: every input of a result") gives each input torch consults the
test that holds it, as node ids relative to ``tests/unit/contexts/``; a bare ``::name``
continues the file named before it in the same cell.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
TESTS = ROOT / "tests" / "unit" / "contexts"
SECTION = "## materialize: every input of a result"
_REFERENCE = re.compile(r"^(?P<file>\S+\.py)?(?:::(?P<test>\w+))?")


def _rows() -> list[str]:
    text = DESIGN.read_text()
    start = text.index(SECTION)
    end = text.index("\n### Left open", start)
    rows = []
    for line in text[start:end].splitlines():
        if line.startswith("| ") and not line.startswith(("| ---", "| input |")):
            rows.append(line)
    return rows


@cache
def _functions(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))


def _references(row: str) -> list[tuple[Path, str | None]]:
    """(file, test or None) for each test reference in the row's last cell."""
    cell = row.rstrip().rstrip("|").rsplit(" | ", 1)[-1]
    found: list[tuple[Path, str | None]] = []
    current: Path | None = None
    for quoted in re.findall(r"`([^`]+)`", cell):
        match = _REFERENCE.match(quoted)
        assert match is not None
        if match["file"]:
            current = (TESTS / match["file"]).resolve()
        if match["test"] and current is None:
            raise AssertionError(f"{quoted!r} names a test before any file: {row[:80]}")
        if match["file"] or match["test"]:
            assert current is not None
            found.append((current, match["test"]))
    return found


ROWS = _rows()


def test_the_table_is_found() -> None:
    assert len(ROWS) >= 40, "the table of a result's inputs was not found in docs/design.md"


@pytest.mark.parametrize("row", ROWS, ids=[r[2:50] for r in ROWS])
def test_each_row_names_tests_that_exist(row: str) -> None:
    references = _references(row)
    assert references, f"no test named for: {row[:120]}"
    for path, test in references:
        assert path.is_file(), f"{path} (named in docs/design.md) does not exist"
        if test is not None:
            assert test in _functions(path), f"{path.name} has no {test} (docs/design.md)"
