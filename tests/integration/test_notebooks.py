"""The notebooks are documentation people run, so CI runs them: top to bottom, on CPU.

Every notebook is executed with nbclient in a fresh IPython kernel, and any cell
error fails its test (nbclient's default; cells may not opt out with the
``raises-exception`` tag). The notebooks assert their own claims -- "the
concurrent latents equal the sequential ones", "doctor() repaired the kernel"
-- so a notebook that runs is a notebook whose story still holds.

The kernel is started from *this* interpreter (``sys.executable``) through a
kernelspec written for the test run, not the ``python3`` spec found on the
machine: that one says ``python`` and would run whatever interpreter is first
on ``PATH``, possibly one without the code under test.

Committed notebooks carry no outputs (``nbstripout``, with the flags in
``NBSTRIPOUT`` below): outputs hold timings and plots that change each run and
would go stale silently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from tests.conftest import REPO

# the notebooks are the docs' executed examples: every interpreter cell runs them
pytestmark = pytest.mark.per_interpreter

NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_NAME = "metamode-under-test"
CELL_TIMEOUT_S = 300  # a guard against a hung cell; each notebook takes well under a minute


# The strip command of docs/development/index.md. Besides outputs and execution counts,
# it drops what a run records about the machine (run metadata, the Python version) and
# keeps the committed cell ids.
NBSTRIPOUT = [
    "nbstripout",
    "--keep-id",
    "--extra-keys",
    "metadata.language_info.codemirror_mode metadata.language_info.file_extension "
    "metadata.language_info.mimetype metadata.language_info.nbconvert_exporter "
    "metadata.language_info.pygments_lexer metadata.language_info.version",
]


@pytest.fixture(scope="session")
def kernel_specs(tmp_path_factory: pytest.TempPathFactory) -> KernelSpecManager:
    kernels = tmp_path_factory.mktemp("kernels")
    spec_dir = kernels / KERNEL_NAME
    spec_dir.mkdir()
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "metamode (test interpreter)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[str(kernels)])


def execute(notebook: nbformat.NotebookNode, specs: KernelSpecManager) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel with ``notebooks/`` as working directory."""
    kernel = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)
    client = NotebookClient(
        notebook,
        km=kernel,
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    return client.execute()


def notebook_dir_listing() -> list[str]:
    return sorted(p.name for p in NOTEBOOK_DIR.iterdir() if p.name != "__pycache__")


def stream_text(cell: nbformat.NotebookNode) -> str:
    return "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream")


def test_there_are_notebooks_to_run() -> None:
    # A renamed folder must not turn the parametrised tests below into zero tests.
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.slow
def test_kernel_runs_this_interpreter(kernel_specs: KernelSpecManager) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    executed = execute(notebook, kernel_specs)
    assert stream_text(executed.cells[0]).strip() == sys.executable


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_stripped(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        where = f"{path.name} cell {cell.id}"
        if cell.cell_type == "code":
            assert cell.outputs == [], (
                f"{where} has outputs: run nbstripout (see docs/development/index.md)"
            )
            assert cell.execution_count is None, f"{where} has an execution count"
        tags = cell.metadata.get("tags", [])
        assert "raises-exception" not in tags, f"{where} may fail; notebooks must run cleanly"
    verify = subprocess.run(
        [sys.executable, "-m", *NBSTRIPOUT, "--verify", str(path)], capture_output=True, text=True
    )
    assert verify.returncode == 0, (
        f"{verify.stdout}{verify.stderr}run nbstripout (see docs/development/index.md)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, kernel_specs: KernelSpecManager) -> None:
    before = notebook_dir_listing()
    notebook = nbformat.read(path, as_version=4)
    executed = execute(notebook, kernel_specs)  # raises CellExecutionError on any error
    ran = [c for c in executed.cells if c.cell_type == "code"]
    assert ran and all(c.execution_count is not None for c in ran)
    # Notebooks write scratch files to temporary directories, never next to themselves.
    assert notebook_dir_listing() == before
