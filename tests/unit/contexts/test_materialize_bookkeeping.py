"""materialize and the bookkeeping that links one replayable build to the next.

A build that skipped draws on meta leaves its generator in a marker state naming it, so the
next build knows it continues that one's stream. When the first build is dropped before
materialize computed where it leaves the stream (never materialized, or only part of it),
eager construction's state at the second build's start is unknowable: its draws are refused,
saying so, never anchored at the marker state as if that were where eager construction
stood. Once the state is known (materialized, kept alive, or reseeded), it is exact.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_refused,
    materialize_exactly,
)

GONE = r"earlier replayable build that was dropped"


def _part() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def _eager_second(generator: torch.Generator | None = None) -> nn.Module:
    torch.manual_seed(0)
    if generator is not None:
        generator.manual_seed(1)
    _part_with(generator)
    return _part_with(generator)


def _part_with(generator: torch.Generator | None) -> nn.Module:
    if generator is None:
        return _part()
    layer = nn.Linear(4, 4)
    with torch.no_grad():
        layer.weight.normal_(generator=generator)
        layer.bias.uniform_(generator=generator)
    return layer


def _second_after(
    handle_first, include_buffers: bool, generator: torch.Generator | None = None
) -> nn.Module:
    torch.manual_seed(0)
    if generator is not None:
        generator.manual_seed(1)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        first = _part_with(generator)
    handle_first(first)
    del first
    gc.collect()
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        return _part_with(generator)


def _dropped(first: nn.Module) -> None:
    pass


def _partly(first: nn.Module) -> None:
    metamode.materialize(first[0])


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_build_after_one_dropped_unmaterialized_is_refused_saying_why(include_buffers):
    second = _second_after(_dropped, include_buffers)
    assert_refused(second, "0.weight", "2.weight", because=GONE)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_build_after_one_dropped_partly_materialized_is_refused_saying_why(include_buffers):
    # the first part's draws were replayed, the later ones never were
    second = _second_after(_partly, include_buffers)
    assert_refused(second, "0.weight", "2.weight", because=GONE)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_build_after_one_dropped_with_a_private_generator_is_refused(include_buffers):
    generator = torch.Generator()
    second = _second_after(_dropped, include_buffers, generator)
    assert_refused(second, "weight", "bias", because=GONE)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_build_after_one_fully_materialized_then_dropped_is_exact(include_buffers):
    ref = _eager_second()
    second = _second_after(metamode.materialize, include_buffers)
    materialize_exactly(second, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_build_after_one_still_alive_is_exact(include_buffers):
    ref = _eager_second()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        first = _part()
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        second = _part()
    materialize_exactly(second, ref)
    del first


@pytest.mark.parametrize("include_buffers", MODES)
def test_reseeding_after_a_dropped_build_is_exact(include_buffers):
    torch.manual_seed(0)
    ref = _part()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        first = _part()
    del first
    gc.collect()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        second = _part()
    materialize_exactly(second, ref)


def test_a_dropped_build_without_draws_on_meta_leaves_nothing_behind():
    # nothing skipped (every draw real, include_buffers=False, no parameters): no marker
    class Buffers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("noise", torch.randn(3))

    torch.manual_seed(0)
    Buffers()
    ref = Buffers()
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        first = Buffers()
    del first
    gc.collect()
    with metamode.empty_weights(replayable=True):
        second = Buffers()
    materialize_exactly(second, ref)


def test_a_closed_program_lives_while_a_storage_it_made_does_and_no_longer():
    import copy
    import weakref

    from metamode._core.recording import registry

    with metamode.empty_weights(replayable=True):
        template = nn.Linear(4, 4)
        copies = nn.ModuleList([copy.deepcopy(template) for _ in range(2)])
    entry = registry.entry(template.weight)
    assert entry is not None
    program = weakref.ref(entry.program)
    del template, entry
    gc.collect()
    registry.sweep()
    assert program() is not None, "the copies' storages still need their program"
    assert metamode.is_materializable(copies)
    del copies
    gc.collect()
    registry.sweep()
    assert program() is None, "a program none of whose storages is alive is kept"
