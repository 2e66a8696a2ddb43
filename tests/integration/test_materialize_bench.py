"""`python -m metamode bench-materialize` runs and prints every row (no timing asserts)."""

from __future__ import annotations

import subprocess
import sys

from metamode.lab.bench_materialize import PHASES


def test_bench_materialize_prints_every_row():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "metamode",
            "bench-materialize",
            "--model",
            "torch-small",
            "--tiny",
            "--reps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for phase in PHASES:
        assert any(line.startswith(phase + " ") for line in lines), phase
    assert "materialize / eager:" in done.stdout


def test_bench_materialize_fsdp_prints_a_row_per_rank():
    done = subprocess.run(
        [sys.executable, "-m", "metamode", "bench-materialize", "--fsdp", "--tiny"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert [row.split(":")[0] for row in rows] == ["rank 0", "rank 1"]
    assert all("materialize its shards" in row for row in rows)
