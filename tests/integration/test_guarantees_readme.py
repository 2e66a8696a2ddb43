"""README statements that had no test: each is checked here as the README states it.

Subprocesses: a fresh pytest for the suite-wide thread-exception rule and the
``pytest11`` entry point, the CLI for ``doctor --import``, and stock accelerate
(whose context patches ``nn.Module.register_parameter`` while it is open).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO, run_python


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


# -- thread exceptions fail tests (pyproject: filterwarnings) -------------------------------------


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


# -- the pytest11 entry point, and -p no:metamode -------------------------------------------------


def test_pytest_plugin_loads_through_its_entry_point_and_can_be_disabled(tmp_path):
    entry_points = importlib.metadata.entry_points(group="pytest11")
    assert [ep.value for ep in entry_points if ep.name == "metamode"] == [
        "metamode._tools.pytest_plugin"
    ], "metamode is not installed with its pytest11 entry point (pip install -e .)"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    # No -p: only the entry point can add --metamode-strict.
    loaded = _pytest(tmp_path, "-c", "pytest.ini", "--metamode-strict", ".")
    assert loaded.returncode == 0 and "1 passed" in loaded.stdout, loaded.stdout + loaded.stderr
    disabled = _pytest(tmp_path, "-c", "pytest.ini", "-p", "no:metamode", "--metamode-strict", ".")
    assert disabled.returncode == 4, disabled.stdout + disabled.stderr
    assert "unrecognized arguments: --metamode-strict" in disabled.stderr


# -- doctor --import, through the CLI --------------------------------------------------------------


def test_doctor_import_through_the_cli(tmp_path):
    clean = subprocess.run(
        [sys.executable, "-m", "metamode", "doctor", "--import", "peft"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "clean" in clean.stdout
    (tmp_path / "patches_on_import.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            _torchs = nn.Module.register_parameter


            def register_parameter(self, name, param):
                return _torchs(self, name, param)


            nn.Module.register_parameter = register_parameter
            """
        )
    )
    dirty = subprocess.run(
        [sys.executable, "-m", "metamode", "doctor", "--import", "patches_on_import"],
        env=_env(str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dirty.returncode == 1, dirty.stdout + dirty.stderr
    assert "torch.nn.Module.register_parameter: is not torch's own" in dirty.stdout
    assert "left by: patches_on_import.register_parameter" in dirty.stdout


# -- accelerate unties tied weights (accelerate#3668); metamode keeps them -------------------------

_TIES = """
import json
import torch
from torch import nn
{context_import}


class SharedEmbeddingLM(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Parameter(torch.empty(10, 4))
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.embed.weight = shared
        self.head.weight = shared


shared = nn.Parameter(torch.empty(3))
a, b = nn.Module(), nn.Module()
with init_empty_weights():
    model = SharedEmbeddingLM()
    a.w = shared
    b.w = shared
print(json.dumps({{
    "model_tied": model.head.weight is model.embed.weight,
    "model_on_meta": model.head.weight.is_meta and model.embed.weight.is_meta,
    "twice_registered_tied": a.w is b.w,
    "original_dict_mutated": "requires_grad" in shared.__dict__,
}}))
"""


def test_stock_accelerate_unties_what_metamode_keeps_tied():
    stock = run_python(_TIES.format(context_import="from accelerate import init_empty_weights"))
    assert stock == {
        "model_tied": False,
        "model_on_meta": True,
        "twice_registered_tied": False,
        "original_dict_mutated": True,
    }
    ours = run_python(_TIES.format(context_import="from metamode import init_empty_weights"))
    assert ours == {
        "model_tied": True,
        "model_on_meta": True,
        "twice_registered_tied": True,
        "original_dict_mutated": False,
    }
