"""CI runs what pyproject.toml claims: a matrix cell on every supported interpreter, each
running the tests whose guarantees rest on the interpreter (``.ci/matrix --list``)."""

from __future__ import annotations

import importlib
import re
import subprocess
import tomllib

import pytest
from packaging.specifiers import SpecifierSet

from tests.conftest import REPO

_PER_INTERPRETER = "-m not slow or per_interpreter"
# Modules whose every test rests on the interpreter: the forced races and the exact skip.
_PER_INTERPRETER_MODULES = (
    "tests.integration.test_race",
    "tests.unit.integrations.test_exact_skip",
    "tests.unit.integrations.test_exact_skip_sites",
    "tests.integration.test_materialize_hf",
    "tests.integration.test_materialize_fsdp",
    "tests.integration.test_notebooks",
)


def _cells() -> dict[str, dict[str, str]]:
    done = subprocess.run(
        ["bash", str(REPO / ".ci" / "matrix"), "--list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    fields = ("python", "version", "constraints", "tests")
    rows = (line.split("\t") for line in done.stdout.splitlines())
    return {cell: dict(zip(fields, rest, strict=True)) for cell, *rest in rows}


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_every_cell_has_its_interpreter_and_constraints():
    cells = _cells()
    assert {"oldest", "newest", "py312", "py313"} <= cells.keys()
    for cell, row in cells.items():
        assert row["version"] != "missing", f"cell {cell}: no interpreter {row['python']}"
        assert (REPO / row["constraints"]).is_file(), row["constraints"]


def test_the_claimed_interpreters_are_exactly_the_ones_ci_runs():
    tested = {row["version"] for row in _cells().values()}
    assert tested == {"3.11", "3.12", "3.13"}
    project = _project()
    classifiers = {
        match.group(1)
        for classifier in project["classifiers"]
        if (match := re.fullmatch(r"Programming Language :: Python :: (3\.\d+)", classifier))
    }
    assert classifiers == tested
    requires = SpecifierSet(project["requires-python"])
    assert {f"3.{minor}" for minor in range(6, 20) if f"3.{minor}.0" in requires} == tested


def test_each_interpreter_beyond_the_main_jobs_runs_the_per_interpreter_selection():
    cells = _cells()
    main = cells["oldest"]["version"]  # python3, as .ci/run's main job
    others = {cell: row for cell, row in cells.items() if row["version"] != main}
    assert {row["version"] for row in others.values()} == {"3.12", "3.13"}
    for cell, row in others.items():
        assert row["tests"] == _PER_INTERPRETER, cell
        assert (REPO / row["constraints"]).read_text().count("-c ../constraints.txt") == 1


@pytest.mark.parametrize("name", _PER_INTERPRETER_MODULES)
def test_the_modules_every_interpreter_runs_are_marked_per_interpreter(name):
    marks = importlib.import_module(name).pytestmark
    marks = marks if isinstance(marks, list) else [marks]
    assert "per_interpreter" in {mark.name for mark in marks}


def test_the_newest_cell_pins_every_library_it_checks_against_the_registry():
    matrix = (REPO / ".ci" / "matrix").read_text()
    checked = re.search(r"^NEWEST_CHECKED=\((.*)\)$", matrix, re.MULTILINE)
    assert checked is not None
    libraries = checked.group(1).split()
    assert libraries == ["torch", "transformers", "peft", "diffusers", "accelerate"]
    pins = (REPO / ".ci" / "constraints-newest.txt").read_text()
    for library in libraries:
        assert re.search(rf"^{library}==\S+$", pins, re.MULTILINE), library
