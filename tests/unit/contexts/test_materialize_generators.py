"""materialize and random generators: user generators re-seeded during the build, the default
generator re-seeded, forked or restored inside the build, and draws between two builds.

Every replayed draw comes from the state eager construction was in at that call; neither the
default generator nor a user generator is changed by ``materialize``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    materialize_exactly,
    named,
)


def _layer(gen: torch.Generator | None = None) -> nn.Linear:
    layer = nn.Linear(4, 4)
    nn.init.normal_(layer.weight, generator=gen)
    nn.init.uniform_(layer.bias, -0.1, 0.1, generator=gen)
    return layer


def _reseeded_per_layer(gen: torch.Generator, seed_of) -> nn.Sequential:
    layers = []
    for i in range(3):
        gen.manual_seed(seed_of(i))
        layers.append(_layer(gen))
    return nn.Sequential(*layers)


RESEEDS = {"seed_i": lambda i: i, "seed_0_each_time": lambda i: 0}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("reseed", sorted(RESEEDS))
def test_a_user_generator_reseeded_per_layer(reseed, include_buffers):
    gen = torch.Generator()
    model = assert_eager_equal(lambda: _reseeded_per_layer(gen, RESEEDS[reseed]), include_buffers)
    if reseed == "seed_0_each_time":
        assert torch.equal(model[0].weight, model[2].weight)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_user_generator_restored_with_set_state_per_layer(include_buffers):
    gen = torch.Generator().manual_seed(5)
    start = gen.get_state()

    def build() -> nn.Sequential:
        layers = []
        for _ in range(2):
            gen.set_state(start)
            layers.append(_layer(gen))
        return nn.Sequential(*layers)

    assert_eager_equal(build, include_buffers)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_fresh_generator_per_layer(include_buffers):
    def build() -> nn.Sequential:
        return nn.Sequential(*[_layer(torch.Generator().manual_seed(i)) for i in range(3)])

    assert_eager_equal(build, include_buffers)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_user_generator_drawn_from_after_the_block_is_neither_used_nor_changed(
    include_buffers,
):
    gen = torch.Generator().manual_seed(3)
    ref = nn.Sequential(_layer(gen), _layer(gen))
    gen.manual_seed(3)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = nn.Sequential(_layer(gen), _layer(gen))
    torch.randn(5, generator=gen)
    state = gen.get_state()
    materialize_exactly(model, ref)
    assert torch.equal(gen.get_state(), state), "materialize drew from the user's generator"


@pytest.mark.parametrize("together", [True, False], ids=["together", "separately"])
@pytest.mark.parametrize("include_buffers", MODES)
def test_one_user_generator_shared_by_two_builds(include_buffers, together):
    gen = torch.Generator().manual_seed(11)
    ref_a, ref_b = _layer(gen), _layer(gen)
    gen.manual_seed(11)
    first = build_empty(lambda: _layer(gen), include_buffers)
    second = build_empty(lambda: _layer(gen), include_buffers)
    if together:
        materialize_exactly(nn.ModuleList([first, second]), nn.ModuleList([ref_a, ref_b]))
    else:
        materialize_exactly(second, ref_b)
        materialize_exactly(first, ref_a)


def _seeded_inside() -> nn.Sequential:
    first = nn.Linear(4, 4)
    torch.manual_seed(42)
    second = nn.Linear(4, 4)
    torch.random.manual_seed(43)
    third = nn.Linear(4, 4)
    torch.default_generator.manual_seed(44)
    return nn.Sequential(first, second, third, nn.Linear(4, 4))


def _forked_inside() -> nn.Sequential:
    first = nn.Linear(4, 4)
    with torch.random.fork_rng(devices=[]):
        second = nn.Linear(4, 4)  # the same draws as third
    third = nn.Linear(4, 4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(9)
        fourth = nn.Linear(4, 4)
    return nn.Sequential(first, second, third, fourth, nn.Linear(4, 4))


def _restored_inside() -> nn.Sequential:
    state = torch.get_rng_state()
    first = nn.Linear(4, 4)
    torch.set_rng_state(state)
    second = nn.Linear(4, 4)  # the same draws as first
    saved = torch.default_generator.get_state()
    third = nn.Linear(4, 4)
    torch.default_generator.set_state(saved)
    return nn.Sequential(first, second, third, nn.Linear(4, 4))


DEFAULT_GENERATOR_CHANGES = {
    "manual_seed": _seeded_inside,
    "fork_rng": _forked_inside,
    "get/set_rng_state": _restored_inside,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("change", sorted(DEFAULT_GENERATOR_CHANGES))
def test_the_default_generator_changed_inside_the_build(change, include_buffers):
    build = DEFAULT_GENERATOR_CHANGES[change]
    model = assert_eager_equal(build, include_buffers)
    if change == "fork_rng":
        assert torch.equal(model[1].weight, model[2].weight)
    if change == "get/set_rng_state":
        assert torch.equal(model[0].weight, model[1].weight)


@pytest.mark.parametrize("together", [True, False], ids=["together", "separately"])
@pytest.mark.parametrize("include_buffers", MODES)
def test_a_default_generator_draw_between_two_builds_refuses_the_second(include_buffers, together):
    ref_first = build_eagerly(_net)
    first = build_empty(_net, include_buffers)
    torch.randn(1)  # eager's state here is unknowable: the builds drew nothing for real
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        second = _net()
    if together:
        both = nn.ModuleList([first, second])
        message = assert_refused(both, "1.0.weight", "1.2.weight")
        assert not named(message, "0.0.weight")
        assert not named(message, "0.2.bias")
    else:
        assert_refused(second, "0.weight", "0.bias", "2.weight")
    materialize_exactly(first, ref_first)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_reseed_between_two_builds_makes_the_second_exact(include_buffers):
    ref = nn.ModuleList([build_eagerly(_net, 0), build_eagerly(_net, 5)])
    model = nn.ModuleList(
        [build_empty(_net, include_buffers, 0), build_empty(_net, include_buffers, 5)]
    )
    materialize_exactly(model, ref)


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_real_draw_inside_the_build_keeps_the_stream_aligned(include_buffers):
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.before = nn.Linear(3, 3)
            self.register_buffer("noise", torch.rand(5, device="cpu"))  # real in both modes
            self.after = nn.Linear(3, 3)

    ref = build_eagerly(Mixed)
    model = build_empty(Mixed, include_buffers)
    materialize_exactly(model.after)
    assert_same_tensors(model.after, ref.after)
    materialize_exactly(model, ref)
