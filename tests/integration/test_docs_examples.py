"""Every Python example in the README runs offline as written (issue 12, section 7).

Each ```python block runs in a fresh interpreter, in order, and must exit 0.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

_BLOCKS = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)


def test_the_readme_has_examples():
    assert len(_BLOCKS) >= 4


@pytest.mark.parametrize("code", _BLOCKS, ids=[f"block{i + 1}" for i in range(len(_BLOCKS))])
def test_readme_example_runs(code, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, f"{code}\n--- stderr ---\n{done.stderr[-3000:]}"
