"""Suite-wide guard: no test may leave global torch state changed.

Every test runs between two snapshots of what empty-weight helpers are known
to corrupt (``torch.nn.Module`` attributes, ``torch.nn.init``, torch's
factory functions, ``torch.Tensor`` methods, registration hooks, default
dtype/device, this thread's mode stack). Stock-library reproducers that
corrupt the process run in subprocesses, so this guard holds for them too.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import metamode._core.modes  # noqa: F401  (the core: hooks are installed before the first snapshot)
from metamode._diagnostics.invariants import snapshot


@pytest.fixture(autouse=True)
def _torch_left_as_it_was():
    before = snapshot()
    yield
    changes = snapshot().changes_since(before)
    if changes:
        pytest.fail("test left global torch state changed: " + "; ".join(changes), pytrace=False)


@pytest.fixture
def one_intra_op_thread():
    """Run tiny models with one intra-op thread, restoring the setting afterwards.

    Why: the tensors are far too small to gain from intra-op parallelism, but OpenMP's
    parallel regions (GroupNorm, conv) still spin-wait on each other; on a busy 2-core
    machine that measured 20-60x slower per denoising step (50 ms vs 1-4 s). Results
    compared with each other are all computed under this setting, so bit-exactness holds.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_python(code: str, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter; return the JSON it prints last."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# Version-requirement markers: ``@pytest.mark.requires_transformers_5`` runs a test only where
# the installed transformers' major version is 5. Elsewhere the test is *deselected* (reported
# as "N deselected", listed with -v via --collect-only), never skipped. Registered in
# pyproject.toml; the CI matrix (.ci/matrix) relies on them.
_VERSION_MARKERS = {
    "requires_transformers_4": ("transformers", 4),
    "requires_transformers_5": ("transformers", 5),
}


def _installed_major(package: str) -> int | None:
    try:
        return int(importlib.metadata.version(package).split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return None


REPO = Path(__file__).resolve().parent.parent  # the repository root
_INTEGRATION = REPO / "tests" / "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests/integration slow; deselect tests whose version requirement is unmet."""
    for item in items:
        if _INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.slow)
    unmet = {
        name
        for name, (package, major) in _VERSION_MARKERS.items()
        if _installed_major(package) != major
    }
    deselected = [item for item in items if unmet & {m.name for m in item.iter_markers()}]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skipped test is not a pass: every test here must run on a CPU-only machine."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped and session.exitstatus == pytest.ExitCode.OK:
        reporter.write_line(f"{len(skipped)} test(s) skipped: failing the run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
