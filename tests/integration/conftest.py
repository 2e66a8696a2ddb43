"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import metamode
from metamode.integrations import _registry


@pytest.fixture
def all_shims() -> Iterator[None]:
    """Every shim on for the test, and off after it."""
    metamode.enable()
    try:
        yield
    finally:
        _registry.disable()
