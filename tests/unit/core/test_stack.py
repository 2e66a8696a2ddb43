"""Reading and repairing the calling thread's mode stack (``metamode._core.stack``).

An out-of-order exit removes one context from the middle of the stack; every mode
above it must come back in its order.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import _pop_mode

import metamode
from metamode import ContextMisuseError
from metamode._core import stack as _stack
from metamode._core.stack import stack_depth


def _drain_to(depth: int) -> None:
    # Leave this thread's stack as the test found it even when an assertion failed.
    while stack_depth() > depth:
        _pop_mode()


# Fails if _stack.remove pushes the modes it popped back in reverse order.


def test_out_of_order_exit_keeps_two_newer_contexts_in_their_order():
    base = stack_depth()
    outer = metamode.empty_weights()
    middle = metamode.empty_weights(include_buffers=True)
    skip = metamode.skip_empty_weights()
    try:
        outer.__enter__()
        middle.__enter__()
        skip.__enter__()
        with pytest.raises(ContextMisuseError, match="reverse order"):
            outer.__exit__(None, None, None)
        assert list(_stack.modes_innermost_first())[:2] == [skip, middle]
        assert stack_depth() == base + 2
        # Still inside the skip, entered last: nothing is active, nothing moves.
        assert metamode.active() is None
        assert nn.Linear(2, 2).weight.device.type == "cpu"
        assert torch.empty(1).device.type == "cpu"
        skip.__exit__(None, None, None)
        assert metamode.active() is middle and torch.empty(1).is_meta
        middle.__exit__(None, None, None)
        assert stack_depth() == base
    finally:
        _drain_to(base)


def test_remove_keeps_order_of_three_modes_above():
    base = stack_depth()
    modes = [metamode.empty_weights() for _ in range(4)]
    try:
        for mode in modes:
            mode.__enter__()
        assert _stack.remove(modes[0]) is True
        assert list(_stack.modes_innermost_first())[:3] == modes[:0:-1]
        assert _stack.remove(modes[0]) is False, "already gone: reported, stack unchanged"
        assert list(_stack.modes_innermost_first())[:3] == modes[:0:-1]
    finally:
        _drain_to(base)
