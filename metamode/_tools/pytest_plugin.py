"""pytest plugin: fail tests that leave global torch state changed.

Enabled by the entry point ``metamode`` or ``-p metamode._tools.pytest_plugin``.
``pytest --metamode-strict`` (ini: ``metamode_strict = true``) checks every test; the
``metamode_clean`` fixture checks one. Compared: :func:`metamode._diagnostics.invariants.snapshot`
before the test's function-scoped fixtures are set up and after they are torn down (wider
fixtures are outside the window). A leak is an error at teardown, naming what changed and
what replaced it; nothing is repaired. Nothing of torch or metamode's core is imported
until the option, the ini key or the fixture is used.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from metamode._diagnostics.invariants import Snapshot

__all__ = ["metamode_clean", "pytest_addoption"]

_CHANGED_NAME = re.compile(
    r"^(torch(?:\.nn\.Module|\.nn\.init|\.Tensor)?)\.(\w+) (replaced|added)$"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("metamode", "metamode: global torch state checks")
    group.addoption(
        "--metamode-strict",
        action="store_true",
        default=None,
        dest="metamode_strict",
        help="fail every test that leaves global torch state changed "
        "(patched torch functions, default dtype/device, modes left on the stack)",
    )
    parser.addini(
        "metamode_strict",
        type="bool",
        default=False,
        help="like --metamode-strict, for every run",
    )


def _strict(config: pytest.Config) -> bool:
    flag = config.getoption("metamode_strict", default=None)
    return bool(config.getini("metamode_strict")) if flag is None else bool(flag)


def _snapshot() -> Snapshot:
    # Imported on first use (torch, metamode's hooks): see the module docstring.
    from metamode._diagnostics.invariants import snapshot

    return snapshot()


def _leak_message(before: Snapshot) -> str | None:
    import torch

    from metamode._diagnostics.originals import describe

    changes = _snapshot().changes_since(before)
    if not changes:
        return None
    namespaces = {
        "torch.nn.Module": torch.nn.Module,
        "torch.nn.init": torch.nn.init,
        "torch.Tensor": torch.Tensor,
        "torch": torch,
    }
    described = []
    for change in changes:
        match = _CHANGED_NAME.match(change)
        if match:
            value = vars(namespaces[match.group(1)]).get(match.group(2))
            if value is not None:
                change += f" (now {describe(value)})"
        described.append(change)
    return (
        "metamode: test left global torch state changed: "
        + "; ".join(described)
        + ". Later tests run in the changed process; metamode.doctor(repair=True) restores "
        "torch's originals."
    )


def _checked(before: Snapshot) -> None:
    message = _leak_message(before)
    if message:
        pytest.fail(message, pytrace=False)


@pytest.fixture(autouse=True)
def _metamode_strict_check(request: pytest.FixtureRequest) -> Iterator[None]:
    # Autouse fixtures from plugins are set up first and torn down last among
    # a test's function-scoped fixtures: the window covers all of them.
    if not _strict(request.config):
        yield
        return
    before = _snapshot()
    yield
    _checked(before)


@pytest.fixture
def metamode_clean(request: pytest.FixtureRequest) -> Iterator[Snapshot]:
    """Fail this test if it leaves global torch state changed, naming what changed.

    Yields the snapshot taken before the test. In strict mode every test is
    already checked, and this fixture adds nothing.
    """
    before = _snapshot()
    yield before
    if not _strict(request.config):
        _checked(before)
