"""transformers 4.x `_init_weights` under the shim: per thread, right after any exit order."""

from __future__ import annotations

import pytest

from metamode import ContextMisuseError
from metamode.integrations.transformers import InitWeightsFlag, NoInitWeights

NAMES = frozenset({"normal_"})


def test_flag_reads_false_only_inside_a_no_init_weights_context():
    flag = InitWeightsFlag(True)
    assert bool(flag) is True
    with NoInitWeights(NAMES):
        assert bool(flag) is False
        with NoInitWeights(NAMES):
            assert bool(flag) is False
        assert bool(flag) is False
    assert bool(flag) is True


def test_flag_is_true_again_after_an_out_of_order_exit():
    # A context that restored the value it saw on entry would leave False for good after
    # exiting a, then c, then b (every later from_pretrained would skip init_weights).
    flag = InitWeightsFlag(True)
    a, b, c = NoInitWeights(NAMES), NoInitWeights(NAMES), NoInitWeights(NAMES)
    a.__enter__()
    b.__enter__()
    c.__enter__()
    with pytest.raises(ContextMisuseError):
        a.__exit__(None, None, None)
    assert bool(flag) is False
    c.__exit__(None, None, None)
    b.__exit__(None, None, None)
    assert bool(flag) is True


def test_a_false_default_stays_false():
    flag = InitWeightsFlag(False)
    assert bool(flag) is False
    with NoInitWeights(NAMES):
        assert bool(flag) is False
    assert bool(flag) is False
