"""This project's pytest configuration (pyproject.toml): an exception in a thread that a test
started fails that test (pytest alone only warns). Checked in a fresh pytest subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO


def _env(*extra_paths: str) -> dict[str, str]:
    paths = [str(REPO), *extra_paths, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_exception_in_a_thread_fails_the_test(tmp_path):
    (tmp_path / "test_thread.py").write_text(
        textwrap.dedent(
            """
            import threading

            def test_thread_raises():
                thread = threading.Thread(target=lambda: 1 / 0)
                thread.start()
                thread.join()
            """
        )
    )
    # This project's pytest configuration, applied to a test outside the project.
    done = _pytest(tmp_path, "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), ".")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "ZeroDivisionError" in done.stdout and "1 failed" in done.stdout
    # Without the setting pytest only warns: the rule is what makes it fail.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    plain = _pytest(tmp_path, "-c", str(tmp_path / "pytest.ini"), ".")
    assert plain.returncode == 0 and "1 passed" in plain.stdout, plain.stdout[-3000:]
