"""``%load_ext metamode`` and ``%%empty_weights`` in a real Jupyter kernel (nbclient).

One kernel runs one notebook; each test reads the outputs of its cells. The
last cell raises inside the magic and must fail the execution -- the reason
the magic runs the cell itself instead of through a nested ``run_cell``,
which would report success.
"""

from __future__ import annotations

import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

CELLS = {
    "prefix": "import sys; print(sys.prefix)",
    "load": "%load_ext metamode",
    "meta": (
        "%%empty_weights\n"
        "import torch, threading\n"
        "layer = torch.nn.Linear(4, 4)\n"
        "bn = torch.nn.BatchNorm1d(4)\n"
        "elsewhere = {}\n"
        "other = threading.Thread(target=lambda: elsewhere.update(\n"
        "    d=torch.nn.Linear(1, 1).weight.device.type))\n"
        "other.start(); other.join()\n"
        "layer.weight.device"
    ),
    "after_meta": (
        "print(bn.weight.device.type, bn.running_mean.device.type, elsewhere['d'],\n"
        "      torch.nn.Linear(1, 1).weight.device.type)"
    ),
    "buffers": (
        "%%empty_weights --include-buffers\n"
        "bn2 = torch.nn.BatchNorm1d(4)\n"
        "x = %time 1 + 1\n"
        "print(bn2.weight.device.type, bn2.running_mean.device.type, x)"
    ),
    "device": "%%empty_weights --device cpu\nprint(torch.nn.Linear(1, 1).weight.device.type)",
    "bad_device": "%%empty_weights --device nowhere\nprint('not run')",
    "raises_tagged": "%%empty_weights\nraise ValueError('inside the magic')",
    "after_raise": (
        "import metamode._core.stack\n"
        "print(metamode._core.stack.stack_depth(), torch.nn.Linear(1, 1).weight.device.type)"
    ),
    "raises": "%%empty_weights\nbroken = torch.nn.Linear(2, 2)\nraise RuntimeError('cell failed')",
}
TAGGED = {"bad_device", "raises_tagged"}  # errors allowed: nbclient goes on

pytestmark = pytest.mark.slow  # every test reads one notebook run in a kernel


@pytest.fixture(scope="module")
def executed() -> dict:
    cells = []
    for name, source in CELLS.items():
        cell = nbformat.v4.new_code_cell(source)
        if name in TAGGED:
            cell.metadata["tags"] = ["raises-exception"]
        cells.append(cell)
    notebook = nbformat.v4.new_notebook(cells=cells)
    client = NotebookClient(notebook, timeout=120, kernel_name="python3")
    with pytest.raises(CellExecutionError) as failure:
        client.execute()
    return {
        "outputs": dict(
            zip(CELLS, (cell.get("outputs", []) for cell in notebook.cells), strict=True)
        ),
        "failure": str(failure.value),
    }


def _stream(executed: dict, name: str, stream: str = "stdout") -> str:
    outputs = executed["outputs"][name]
    return "".join(o["text"] for o in outputs if o.get("name") == stream)


def _error(executed: dict, name: str) -> dict:
    [error] = [o for o in executed["outputs"][name] if o["output_type"] == "error"]
    return error


def test_kernel_runs_this_environment(executed):
    assert _stream(executed, "prefix").strip() == sys.prefix


def test_cell_builds_on_meta_and_returns_its_last_expression(executed):
    [result] = executed["outputs"]["meta"]
    assert result["output_type"] == "execute_result"
    assert result["data"]["text/plain"] == "device(type='meta')"


def test_only_the_cell_and_its_thread_are_affected(executed):
    # parameters meta, buffers not (default), another thread cpu, next cell cpu
    assert _stream(executed, "after_meta").split() == ["meta", "cpu", "cpu", "cpu"]


def test_include_buffers_and_line_magics_inside_the_cell(executed):
    assert _stream(executed, "buffers").split()[-3:] == ["meta", "meta", "2"]


def test_device_option(executed):
    assert _stream(executed, "device").strip() == "cpu"


def test_bad_device_is_a_usage_error(executed):
    # IPython prints a UsageError as one line on stderr, without a traceback
    assert _stream(executed, "bad_device", "stderr").startswith(
        "UsageError: %%empty_weights: invalid device 'nowhere'"
    )
    assert _stream(executed, "bad_device") == ""


def test_exception_inside_the_cell_leaves_nothing_behind(executed):
    assert _error(executed, "raises_tagged")["ename"] == "ValueError"
    assert _stream(executed, "after_raise").split() == ["0", "cpu"]


def test_exception_inside_the_cell_fails_the_notebook(executed):
    assert "RuntimeError" in executed["failure"] and "cell failed" in executed["failure"]
