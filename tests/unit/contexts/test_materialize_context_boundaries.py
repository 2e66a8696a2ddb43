"""materialize across context boundaries: nested replayable contexts, consecutive contexts
with and without a re-seed between them, suspended stretches, and parts materialized one by
one or together. A tensor's value never depends on what else is materialized with it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_exact_or_refused,
    assert_same_tensors,
    build_eagerly,
    materialize_exactly,
)


def _part() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3))


@metamode.empty_weights(replayable=True)
def _decorated_part() -> nn.Sequential:
    return _part()


@metamode.empty_weights(include_buffers=True, replayable=True)
def _decorated_part_with_buffers() -> nn.Sequential:
    return nn.Sequential(_part(), nn.BatchNorm1d(3))


class UsesDecoratedHelpers(nn.Module):
    def __init__(self, helper) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.inner = helper()
        self.last = nn.Linear(3, 2)


HELPERS = {
    "plain": (_decorated_part, _part),
    "with_buffers": (
        _decorated_part_with_buffers,
        lambda: nn.Sequential(_part(), nn.BatchNorm1d(3)),
    ),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_a_decorated_replayable_helper_inside_a_replayable_block(helper, include_buffers):
    decorated, plain = HELPERS[helper]
    ref = build_eagerly(lambda: UsesDecoratedHelpers(plain))
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = UsesDecoratedHelpers(decorated)
    materialize_exactly(model, ref)


@pytest.mark.parametrize("outer", MODES)
@pytest.mark.parametrize("inner", MODES)
def test_nested_with_blocks(outer, inner):
    def build(nested) -> nn.Sequential:
        first = nn.Linear(4, 4)
        with nested():
            middle = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        return nn.Sequential(first, middle, nn.Linear(4, 2))

    ref = build_eagerly(lambda: build(_nothing))
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=outer, replayable=True):
        model = build(lambda: metamode.empty_weights(include_buffers=inner, replayable=True))
    materialize_exactly(model, ref)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_non_replayable_block_nested_inside_is_exact_or_refused(include_buffers):
    def build(nested) -> nn.Sequential:
        first = nn.Linear(4, 4)
        with nested():
            middle = nn.Linear(4, 4)
        return nn.Sequential(first, middle, nn.Linear(4, 2))

    ref = build_eagerly(lambda: build(_nothing))
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = build(metamode.empty_weights)
    assert_exact_or_refused(model, ref, "1.weight", "1.bias")


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_suspended_stretch_gets_its_eager_values_and_keeps_the_stream(include_buffers):
    # Inside skip_empty_weights the layer is built for real, from a stream the meta build
    # before it did not advance: those real values are the build's, not loaded ones, so
    # materialize replaces them by eager's (same parameter objects), and what comes after
    # the stretch still gets its eager values.
    def build(suspend) -> nn.Sequential:
        first = nn.Linear(4, 4)
        with suspend():
            real = nn.Linear(4, 4)
        return nn.Sequential(first, real, nn.Linear(4, 2))

    ref = build_eagerly(lambda: build(_nothing))
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = build(metamode.skip_empty_weights)
    assert not any(t.is_meta for t in model[1].parameters())
    materialize_exactly(model, ref)


def _consecutive(include_buffers: bool, reseed: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref_a = _part()
    if reseed:
        torch.manual_seed(0)
    ref_b = _part()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        a = _part()
    if reseed:
        torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        b = _part()
    return nn.ModuleDict({"a": a, "b": b}), nn.ModuleDict({"a": ref_a, "b": ref_b})


ORDERS = {
    "together": [None],
    "a_then_b": ["a", "b"],
    "b_then_a": ["b", "a"],
    "b_only": ["b"],
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("reseed", [True, False], ids=["reseeded", "continued"])
def test_two_consecutive_contexts_in_any_materialize_order(reseed, order, include_buffers):
    model, ref = _consecutive(include_buffers, reseed)
    for key in ORDERS[order]:
        part, want = (model, ref) if key is None else (model[key], ref[key])
        materialize_exactly(part, want)
    if order == "b_only":
        assert all(t.is_meta for t in model["a"].parameters())
    else:
        assert_same_tensors(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_three_consecutive_contexts_the_middle_one_alone(include_buffers):
    torch.manual_seed(0)
    ref = nn.ModuleList([_part() for _ in range(3)])
    torch.manual_seed(0)
    parts = []
    for _ in range(3):
        with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
            parts.append(_part())
    model = nn.ModuleList(parts)
    materialize_exactly(model[1], ref[1])
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_consecutive_contexts_with_real_draws_inside_the_first(include_buffers):
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("noise", torch.randn(3, device="cpu"))

    torch.manual_seed(0)
    ref = nn.ModuleList([Noisy(), _part()])
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        first = Noisy()
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        second = _part()
    materialize_exactly(second, ref[1])
    materialize_exactly(first, ref[0])


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_submodule_does_not_depend_on_what_else_is_materialized(include_buffers):
    def build() -> nn.Sequential:
        return nn.Sequential(_part(), _part(), _part())

    model = assert_eager_equal(build, include_buffers)
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        again = build()
    materialize_exactly(again[2])
    materialize_exactly(again[0])
    materialize_exactly(again, model)
