"""The pytest plugin: strict mode (flag or ini) and the ``metamode_clean`` fixture.

Inner test sessions run in this process (pytester's in-process mode, fast);
what their leaking tests change is put back here, so the suite's own guard
(tests/conftest.py) sees this process as it was.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator

import pytest
import torch
from torch import nn

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
