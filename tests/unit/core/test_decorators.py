"""Contexts used as decorators, beyond the per-class contract in test_mode_contract.py.

A decorated function called inside an equal context (recursion, one decorated function
calling another) runs in that context instead of pushing a new one, so recursion depth
costs no deeper torch dispatch and ties hold across the calls; the bare-decorator
mistake is refused with the fix.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import metamode
from metamode._core.stack import stack_depth


@pytest.mark.parametrize(
    ("factory", "fix"),
    [
        (metamode.empty_weights, r"use @metamode\.empty_weights\(\) instead"),
        (metamode.skip_init, r"use @metamode\.skip_init\(\) instead"),
        (metamode.skip_empty_weights, r"use @metamode\.skip_empty_weights\(\) instead"),
        (metamode.default_dtype, r"use @metamode\.default_dtype\(torch\.float16\)"),
    ],
)
def test_bare_decorator_says_use_parentheses(factory, fix):
    # Not a confusing argument error ("include_buffers must be a bool, not <function ...>").
    with pytest.raises(TypeError, match=r"without (parentheses|a dtype) on .*build") as raised:

        @factory
        def build():
            return nn.Linear(2, 2)

    assert raised.match(fix)


def test_decorator_keeps_include_buffers():
    @metamode.empty_weights(include_buffers=True)
    def build() -> torch.Tensor:
        return torch.empty(2)

    assert build().is_meta


def test_decorating_an_async_generator_is_refused():
    async def agen():
        yield

    with pytest.raises(TypeError, match="async"):
        metamode.empty_weights()(agen)


# -- recursion ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        metamode.empty_weights,
        metamode.skip_init,
        metamode.skip_empty_weights,
        lambda: metamode.default_dtype(torch.float16),
    ],
    ids=["empty_weights", "skip_init", "skip_empty_weights", "default_dtype"],
)
def test_decorated_recursion_300_deep(make):
    # One mode per level would overflow the interpreter's stack: torch dispatches
    # every call through each mode on the stack in turn, one Python frame each.
    assert sys.getrecursionlimit() >= 1000

    @make()
    def build(depth: int) -> nn.Module:
        if depth == 0:
            assert stack_depth() == 1
            return nn.Linear(2, 2)
        return build(depth - 1)

    build(300)
    assert stack_depth() == 0


def test_decorated_recursion_shares_one_context_so_ties_hold():
    shared = nn.Linear(2, 2)  # built outside: real

    @metamode.empty_weights()
    def attach(depth: int, into: list) -> None:
        holder = nn.Module()
        holder.w = shared.weight
        into.append(holder.w)
        if depth:
            attach(depth - 1, into)

    seen: list = []
    attach(3, seen)
    assert all(w is seen[0] for w in seen) and seen[0].is_meta


def test_decorated_call_inside_a_different_context_still_gets_its_own():
    @metamode.empty_weights()
    def build() -> nn.Module:
        return nn.Linear(2, 2)

    with metamode.empty_weights(device="cpu"):
        assert build().weight.is_meta
        with metamode.skip_empty_weights():
            assert build().weight.is_meta
    assert stack_depth() == 0
