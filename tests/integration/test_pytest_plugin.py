"""The pytest plugin: strict mode (flag or ini) and the ``metamode_clean`` fixture.

Inner test sessions run in this process (pytester's in-process mode, fast);
what their leaking tests change is put back here, so the suite's own guard
(tests/conftest.py) sees this process as it was.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import REPO

pytest_plugins = ["pytester"]

LEAKY_TESTS = """
import torch
from torch import nn

TORCHS_REGISTER_PARAMETER = vars(nn.Module)["register_parameter"]


def leaky_register_parameter(self, name, param):
    return TORCHS_REGISTER_PARAMETER(self, name, param)


def test_clean():
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_leaks_a_patch():
    nn.Module.register_parameter = leaky_register_parameter


def test_leaks_default_dtype():
    torch.set_default_dtype(torch.float64)
"""


def _plugin_args() -> list[str]:
    """``-p`` unless the ``pytest11`` entry point already loads the plugin.

    Registering the module a second time under another name is an error in
    pluggy, so this works before and after the entry point is installed.
    """
    entry_points = importlib.metadata.entry_points(group="pytest11")
    if any(ep.name == "metamode" for ep in entry_points):
        return []
    return ["-p", "metamode._tools.pytest_plugin"]


@pytest.fixture
def restore_torch() -> Iterator[None]:
    """Put back what the inner sessions' leaking tests change."""
    register_parameter = vars(nn.Module)["register_parameter"]
    yield
    nn.Module.register_parameter = register_parameter
    torch.set_default_dtype(torch.float32)


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*_plugin_args(), "-p", "no:cacheprovider", *args)


def test_strict_flag_fails_leaking_tests_naming_what_changed(pytester, restore_torch):
    pytester.makepyfile(test_leak=LEAKY_TESTS)
    result = _run(pytester, "--metamode-strict")
    # A leak is found at teardown: pytest's "error" outcome, and the run fails.
    result.assert_outcomes(passed=3, errors=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaks_a_patch*",
            "*torch.nn.Module.register_parameter replaced "
            "(now test_leak.leaky_register_parameter (*test_leak.py:*))*",
            "*ERROR at teardown of test_leaks_default_dtype*",
            "*default dtype torch.float32 -> torch.float64*",
        ]
    )
    assert "ERROR at teardown of test_clean" not in result.stdout.str()


def test_strict_is_opt_in(pytester, restore_torch):
    pytester.makepyfile(test_leak=LEAKY_TESTS)
    result = _run(pytester)
    result.assert_outcomes(passed=3)


def test_ini_option_turns_strict_on(pytester, restore_torch):
    pytester.makepyfile(test_leak=LEAKY_TESTS)
    pytester.makeini("[pytest]\nmetamode_strict = true\n")
    result = _run(pytester)
    result.assert_outcomes(passed=3, errors=2)


def test_strict_passes_a_clean_suite_and_fixtures_that_restore_what_they_change(pytester):
    pytester.makepyfile(
        test_clean="""
        import pytest
        import torch
        from torch import nn

        import metamode


        @pytest.fixture(scope="module")
        def float64_for_this_module():
            torch.set_default_dtype(torch.float64)
            yield
            torch.set_default_dtype(torch.float32)


        @pytest.fixture
        def restores_dtype():
            before = torch.get_default_dtype()
            yield
            torch.set_default_dtype(before)


        def test_builds_on_meta():
            with metamode.empty_weights():
                assert nn.Linear(2, 2).weight.is_meta


        def test_module_scoped_state_is_not_blamed_on_a_test(float64_for_this_module):
            assert torch.get_default_dtype() is torch.float64


        def test_body_change_undone_by_its_own_fixture(restores_dtype):
            torch.set_default_dtype(torch.float16)
        """
    )
    result = _run(pytester, "--metamode-strict")
    result.assert_outcomes(passed=3)


def test_metamode_clean_fixture_checks_one_test(pytester, restore_torch):
    pytester.makepyfile(
        test_fixture="""
        import torch


        def test_clean(metamode_clean):
            torch.zeros(2)


        def test_leaks(metamode_clean):
            torch.set_default_dtype(torch.float64)


        def test_unchecked():
            torch.set_default_dtype(torch.float32)  # undoes test_leaks; not checked
        """
    )
    result = _run(pytester)
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_leaks*", "*default dtype torch.float32 -> torch.float64*"]
    )


# -- the pytest11 entry point, and -p no:metamode (a fresh pytest in a subprocess) ---------


def _pytest_in_subprocess(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_pytest_plugin_loads_through_its_entry_point_and_can_be_disabled(tmp_path):
    entry_points = importlib.metadata.entry_points(group="pytest11")
    assert [ep.value for ep in entry_points if ep.name == "metamode"] == [
        "metamode._tools.pytest_plugin"
    ], "metamode is not installed with its pytest11 entry point (pip install -e .)"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    # No -p: only the entry point can add --metamode-strict.
    loaded = _pytest_in_subprocess(tmp_path, "-c", "pytest.ini", "--metamode-strict", ".")
    assert loaded.returncode == 0 and "1 passed" in loaded.stdout, loaded.stdout + loaded.stderr
    disabled = _pytest_in_subprocess(
        tmp_path, "-c", "pytest.ini", "-p", "no:metamode", "--metamode-strict", "."
    )
    assert disabled.returncode == 4, disabled.stdout + disabled.stderr
    assert "unrecognized arguments: --metamode-strict" in disabled.stderr
