"""The pytest plugin as installed: lazy, loaded by its entry point, and off with -p no:metamode.

Inner runs are subprocesses (``runpytest_subprocess``): what is imported, and
what the ``pytest11`` entry point loads, can only be seen in a fresh
interpreter. They load the plugin through the installed entry point only.
"""

from __future__ import annotations

import importlib.metadata

import pytest

pytest_plugins = ["pytester"]


def test_the_entry_point_is_installed():
    entry_points = importlib.metadata.entry_points(group="pytest11")
    (entry,) = [e for e in entry_points if e.name == "metamode"]
    assert entry.value == "metamode._tools.pytest_plugin"


def test_a_suite_that_never_uses_the_plugin_imports_neither_torch_nor_metamodes_core(pytester):
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_plain(request):
            assert request.config.pluginmanager.has_plugin("metamode")  # loaded ...
            loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("metamode."))
            assert loaded == ["metamode._tools", "metamode._tools.pytest_plugin"]  # ... only
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


LEAK_AND_COMPILE = """
import torch


def test_compiles():
    fn = torch.compile(lambda x: x + 1, backend="eager")
    assert fn(torch.ones(2)).tolist() == [2.0, 2.0]


def test_leaks():
    torch.set_default_dtype(torch.float64)
"""


def test_strict_mode_through_the_entry_point_and_torch_compile_is_not_a_leak(pytester):
    pytester.makepyfile(test_leak=LEAK_AND_COMPILE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--metamode-strict")
    # torch.compile tags Module.__init__ once, on purpose (metamode._diagnostics.known_changes).
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_leaks*", "*default dtype torch.float32 -> torch.float64*"]
    )
    result.stdout.no_fnmatch_line("*test_compiles*ERROR*")


def test_fixture_alone_works_through_the_entry_point(pytester):
    pytester.makepyfile(
        test_fixture="""
        import torch

        def test_leaks(metamode_clean):
            torch.set_default_dtype(torch.float64)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)  # the leak is an error at teardown
    result.stdout.fnmatch_lines(["*default dtype torch.float32 -> torch.float64*"])


def test_p_no_metamode_disables_it(pytester):
    pytester.makepyfile(
        test_off="""
        def test_off(request):
            assert not request.config.pluginmanager.has_plugin("metamode")
        """
    )
    assert pytester.runpytest_subprocess("-p", "no:metamode").ret == pytest.ExitCode.OK
    result = pytester.runpytest_subprocess("-p", "no:metamode", "--metamode-strict")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unrecognized arguments: --metamode-strict*"])
