"""``%%empty_weights`` behaves like other cell magics.

In-process ``InteractiveShell`` (tests/unit/tools/test_ipython.py runs a real kernel for
the rest): a trailing ``;`` suppresses the output, and a traceback from the
cell shows the cell's frames, not metamode's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def shell() -> Iterator[InteractiveShell]:
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=config)
    try:
        shell.run_line_magic("load_ext", "metamode")
        yield shell
    finally:
        InteractiveShell.clear_instance()


def test_trailing_semicolon_suppresses_the_output(shell, capsys):
    shown = shell.run_cell("%%empty_weights\nimport torch\ntorch.nn.Linear(2, 2).weight.device\n")
    assert shown.success and str(shown.result) == "meta"
    assert "device(type='meta')" in capsys.readouterr().out

    for ending in (";", ";  # silenced", "; "):
        quiet = shell.run_cell(
            f"%%empty_weights\nlayer = torch.nn.Linear(2, 2)\nlayer.weight.device{ending}\n"
        )
        assert quiet.success and quiet.result is None
        assert capsys.readouterr().out == ""
        assert str(shell.user_ns["layer"].weight.device) == "meta"  # the cell still ran


def test_a_traceback_from_the_cell_does_not_show_metamodes_frame(shell, capsys):
    failed = shell.run_cell("%%empty_weights\ndef f():\n    raise ValueError('boom')\nf()\n")
    assert not failed.success and isinstance(failed.error_in_exec, ValueError)
    shown = ANSI.sub("", capsys.readouterr().out)
    assert "raise ValueError('boom')" in shown and "ValueError: boom" in shown
    assert "metamode" not in shown, shown
    assert "_ipython.py" not in shown and "exec(body, namespace)" not in shown
