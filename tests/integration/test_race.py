"""The reproducer that started metamode: two overlapping contexts in two threads.

Three Events force the interleaving A enters, B enters, A exits, B builds a
Linear, B exits; then the main thread and a fresh thread build Linears. Stock
PEFT (a copy of accelerate's patch/restore) loses B's live patch, leaks A's
wrapper forever, and puts every later Linear on meta. The stock run happens in
a subprocess (it corrupts its interpreter) and shows the same assertions
fail there.
"""

from __future__ import annotations

import pytest

import metamode
from metamode.lab import scenarios
from tests.conftest import run_python

pytestmark = pytest.mark.per_interpreter

FIXED = {
    "live_context_linear": "meta",
    "register_parameter_is_torchs": True,
    "main_thread_linear_after": "cpu",
    "other_thread_linear_after": "cpu",
    "corrupted": False,
}


@pytest.mark.slow
def test_stock_peft_corrupts_the_process():
    result = run_python("from metamode.lab.scenarios import main; main(['overlap', 'stock-peft'])")
    assert result == {
        "live_context_linear": "cpu",  # (1) the live context lost its patch
        "register_parameter_is_torchs": False,  # (2) the wrapper outlived both contexts
        "main_thread_linear_after": "meta",  # (3) unrelated modules get meta parameters
        "other_thread_linear_after": "meta",
        "corrupted": True,
    }


def test_metamode_contexts_overlap_safely():
    assert scenarios.overlap("metamode") == FIXED


def test_peft_own_init_empty_weights_is_safe_after_enable_for_peft():
    metamode.enable_for_peft()
    try:
        import peft.utils.integrations as integrations

        assert integrations.init_empty_weights.__module__ == "metamode.integrations.peft"
        assert scenarios.overlap("peft-shim") == FIXED
    finally:
        metamode.disable_for_peft()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stock-peft", "peft-shim"])
def test_the_scenario_in_a_fresh_interpreter(kind):
    """Same scenario, same interpreter state for both kinds: only the shim differs."""
    result = run_python(
        f"import sys; sys.argv = ['x', 'overlap', {kind!r}]; "
        "from metamode.lab.scenarios import main; main()"
    )
    assert result["corrupted"] is (kind == "stock-peft")
