"""Strip outputs from the notebooks before committing them.

    python notebooks/_strip.py            # strip every notebooks/*.ipynb in place
    python notebooks/_strip.py --check    # exit 1, naming them, if any is not stripped

Why stripped: the outputs of these notebooks hold timings, memory numbers and
plots that change on every run; committing them would turn every re-run into a
diff and let a stale output claim something the code no longer does. CI
executes the notebooks instead (tests/test_notebooks.py) and checks that they
are committed without outputs.

Besides outputs and execution counts, this drops what a run records about the
machine it ran on: per-cell timing metadata, widget state, and the kernel's
``language_info`` details (the Python version); Jupyter fills those in again
when the notebook is opened.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
_RUN_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")


def strip(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``notebook`` without outputs or run metadata (modified in place and returned)."""
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in _RUN_METADATA:
            cell.metadata.pop(key, None)
    notebook.metadata.pop("widgets", None)
    language = notebook.metadata.get("language_info")
    if language is not None:
        notebook.metadata["language_info"] = {"name": language.get("name", "python")}
    return notebook


def is_stripped(notebook: nbformat.NotebookNode) -> bool:
    return strip(copy.deepcopy(notebook)) == notebook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    parser.add_argument("--check", action="store_true", help="report, do not modify")
    args = parser.parse_args(argv)
    not_stripped = 0
    for path in args.paths or sorted(HERE.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        if is_stripped(notebook):
            continue
        if args.check:
            print(f"{path}: has outputs or run metadata; run python notebooks/_strip.py")
            not_stripped += 1
        else:
            nbformat.write(strip(notebook), path)
            print(f"stripped {path}")
    return 1 if not_stripped else 0


if __name__ == "__main__":
    sys.exit(main())
