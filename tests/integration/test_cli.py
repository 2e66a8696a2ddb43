"""``python -m metamode ...`` as a user runs it, in subprocesses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO

ROOT = REPO
RST = re.compile(r"``|:mod:|:func:|:class:|:meth:")


def _metamode(*args: str, cwd: Path | None = None, timeout: float = 300):
    env = dict(os.environ)
    paths = [str(ROOT), *([str(cwd)] if cwd else []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return subprocess.run(
        [sys.executable, "-m", "metamode", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


@pytest.mark.parametrize(
    "command", [[], ["demo"], ["doctor"], ["bench"], ["bench-record"], ["dtype-loads"]]
)
def test_help_is_plain_text(command):
    done = _metamode(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert not RST.search(done.stdout), done.stdout


def test_demo_options_are_documented_and_reject_less_than_one():
    done = _metamode("demo", "--help")
    assert "--threads N  threads" in done.stdout and "--rounds N   rounds" in done.stdout
    for option in ("--threads", "--rounds"):
        for bad in ("0", "-3"):
            done = _metamode("demo", option, bad)
            assert done.returncode == 2
            assert f"argument {option}: must be at least 1, got {bad}" in done.stderr
            assert "Traceback" not in done.stderr


def test_demo_with_one_thread_and_one_round_says_so_in_the_singular():
    done = _metamode("demo", "--threads", "1", "--rounds", "1", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not re.search(r"\b1 (threads|rounds)\b", done.stdout), done.stdout
    assert ", 1 thread\n" in done.stdout
    assert "2. 1 thread x 1 round of concurrent" in done.stdout


def test_doctor_exit_codes_clean_findings_and_unimportable(tmp_path):
    (tmp_path / "leaves_dtype.py").write_text(
        "import torch\ntorch.set_default_dtype(torch.float64)\n"
    )
    (tmp_path / "broken_on_import.py").write_text("raise RuntimeError('broken\\nsecond line')\n")

    clean = _metamode("doctor", "--import", "peft", cwd=tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "clean (nothing found)" in clean.stdout

    findings = _metamode("doctor", "--import", "leaves_dtype", cwd=tmp_path)
    assert findings.returncode == 1, findings.stdout + findings.stderr
    assert "default dtype: is torch.float64" in findings.stdout

    for module, error in (
        ("missing_module", "ModuleNotFoundError: No module named 'missing_module'"),
        ("broken_on_import", "RuntimeError: broken"),
    ):
        done = _metamode("doctor", "--import", module, cwd=tmp_path)
        assert done.returncode == 2
        assert done.stdout == ""
        assert done.stderr == f"python -m metamode doctor: error: --import {module}: {error}\n"


def test_exit_codes_are_in_the_help_and_the_tools_guide():
    done = _metamode("doctor", "--help")
    assert "2 a --import module could not be imported" in " ".join(done.stdout.split())
    guide = " ".join((ROOT / "docs" / "guides" / "tools.md").read_text().split())
    assert "exit 0 clean, 1 findings, 2 a `--import` module could not be imported" in guide


def _env_with(*extra_paths: str) -> dict[str, str]:
    paths = [str(REPO), *extra_paths, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def test_doctor_import_through_the_cli(tmp_path):
    clean = subprocess.run(
        [sys.executable, "-m", "metamode", "doctor", "--import", "peft"],
        env=_env_with(),
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
        env=_env_with(str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dirty.returncode == 1, dirty.stdout + dirty.stderr
    assert "torch.nn.Module.register_parameter: is not torch's own" in dirty.stdout
    assert "left by: patches_on_import.register_parameter" in dirty.stdout


def test_dtype_loads_prints_a_row_per_race_with_no_wrong_round():
    done = _metamode("dtype-loads", "--rounds", "1", "--settings", "metamode", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if " | metamode | " in line]
    assert len(rows) == 4, done.stdout
    for row in rows:
        assert row[2:6] == ["wrong dtype 0/1", "wrong 0/1", "errors 0", "default after float32"]
