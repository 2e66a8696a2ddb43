"""``Tensor.to`` towards meta, of a tensor the context put on meta.

Eager construction has that tensor on the CPU, so its ``.to("meta")`` is a copy: a new meta
tensor, into which a later draw draws nothing. Each spelling of the move (by string, by
device, by keyword, positional ``copy``, by another tensor, through ``Module.to``) must give
the same: the draws after one into the moved tensor are refused, the tensor it was moved from
stays eager's, and the result is a new object, as eager's is.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    Built,
    assert_refused,
    build_eagerly,
    build_empty,
    materialize_exactly,
)

_ASKED = "the build asked for itself"
_META = torch.device("meta")

MOVES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "to('meta')": lambda w: w.to("meta"),
    "to(torch.device('meta'))": lambda w: w.to(_META),
    "to(device='meta')": lambda w: w.to(device="meta"),
    "to(device='meta', non_blocking=True)": lambda w: w.to(device="meta", non_blocking=True),
    "to('meta', float32)": lambda w: w.to("meta", torch.float32),
    "to('meta', float32, False, False)": lambda w: w.to("meta", torch.float32, False, False),
    "to('meta', copy=False)": lambda w: w.to("meta", copy=False),
    "to(a tensor made on meta)": lambda w: w.to(torch.empty(1, device="meta")),
    "to('meta', float64)": lambda w: w.to("meta", torch.float64),
}


def _moved_then_drawn(move: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 3)
        nn.init.normal_(move(m.a.weight))  # eager: into a new meta tensor, drawing nothing
        m.lin = nn.Linear(3, 3)

    return init


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("move", sorted(MOVES))
def test_a_draw_into_a_placed_tensor_moved_to_meta_refuses_the_draws_after_it(
    move, include_buffers
):
    model = build_empty(lambda: Built(_moved_then_drawn(MOVES[move])), include_buffers)
    assert_refused(model, "lin.weight", "lin.bias", because=_ASKED)


def _moved_then_original_drawn(
    move: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 3)
        moved = move(m.a.weight)  # kept, never drawn into
        m.same = moved is m.a.weight
        m.moved = [moved.detach()]
        nn.init.normal_(m.a.weight)  # eager: the CPU weight, a real draw
        m.lin = nn.Linear(3, 3)

    return init


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("move", sorted(MOVES))
def test_the_tensor_moved_from_stays_eagers(move, include_buffers):
    build = lambda: Built(_moved_then_original_drawn(MOVES[move]))  # noqa: E731
    ref = build_eagerly(build)
    assert ref.moved[0].is_meta and not ref.same
    model = build_empty(build, include_buffers)
    assert not model.same, "eager's .to('meta') of its CPU tensor is a new tensor"
    materialize_exactly(model.a, ref.a)
    materialize_exactly(model.lin, ref.lin)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_move_by_the_placed_tensors_own_device_returns_it_and_stays_exact(include_buffers):
    """``w.device`` stands for the CPU: eager's ``.to`` returns ``w`` itself, and so does
    the build's; the draw into it is eager's."""

    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 3)
        moved = m.a.weight.to(m.a.weight.device)
        assert moved is m.a.weight
        nn.init.normal_(moved)
        m.lin = nn.Linear(3, 3)

    materialize_exactly(
        build_empty(lambda: Built(init), include_buffers), build_eagerly(lambda: Built(init))
    )


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_cast_under_a_meta_device_context_is_no_move(include_buffers):
    """``torch.device("meta")`` as a context sets where factories put tensors, not where
    ``.to(dtype)`` moves one: eager's cast of its CPU weight is that weight."""

    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 3)
        with torch.device("meta"):
            m.same = m.a.weight.to(torch.float32) is m.a.weight
        nn.init.normal_(m.a.weight)
        m.lin = nn.Linear(3, 3)

    build = lambda: Built(init)  # noqa: E731
    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    assert model.same and ref.same
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_module_to_meta_then_reset_refuses_what_follows(include_buffers):
    """``Module.to`` moves each tensor with ``Tensor.to`` and, the moved tensor being unlike
    the CPU one, gives the module new parameters; eager's reset then draws into meta, drawing
    nothing."""

    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 3)
        weight = m.a.weight
        m.a.to("meta")
        assert m.a.weight is not weight  # eager: CPU and meta tensors are unlike, a new one
        m.a.reset_parameters()
        m.lin = nn.Linear(3, 3)

    model = build_empty(lambda: Built(init), include_buffers)
    assert_refused(model, "lin.weight", "lin.bias", because=_ASKED)


def _drawn_into(m: nn.Module, device: str) -> None:
    nn.init.normal_(m.a.weight.to(device))


def _module_moved(m: nn.Module, device: str) -> None:
    m.a.to(device)


def _buffer_moved(m: nn.Module, device: str) -> None:
    m.a.register_buffer("b", torch.zeros(3))
    m.a.register_buffer("z", m.a.b.to(device) * 2)


STRING_MOVES: dict[str, tuple[Callable[[nn.Module, str], None], str]] = {
    "normal_(w.to(str(w.device)))": (_drawn_into, "lin.weight"),
    "module.to(str(w.device))": (_module_moved, "a.weight"),
    "module.to(w.device.type)": (_module_moved, "a.weight"),
    "register_buffer(buffer.to(str(w.device)) * 2)": (_buffer_moved, "a.z"),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("spelling", sorted(STRING_MOVES))
def test_a_placed_device_turned_into_a_string_is_refused_as_documented(spelling, include_buffers):
    """``.to(str(w.device))`` is ``.to('cpu')`` in eager (``w`` itself) and ``.to('meta')``
    here: the string cannot be told from a literal ``'meta'``, so the move is a copy to meta
    the build asked for, refused where a module keeps it or a draw goes into it (over-refusal,
    documented). A real buffer (params-only) moves for real, as eager's does."""
    move, refused = STRING_MOVES[spelling]

    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 3)
        device = m.a.weight.device
        move(m, device.type if spelling.endswith("type)") else str(device))
        m.lin = nn.Linear(3, 3)

    model = build_empty(lambda: Built(init), include_buffers)
    if refused == "a.z" and not include_buffers:
        materialize_exactly(model, build_eagerly(lambda: Built(init)))
    else:
        assert_refused(model, refused, because=_ASKED)


def test_moving_inside_the_block_leaves_no_copy_behind_outside_it():
    """Outside every context, ``.to('meta')`` of a meta tensor is that tensor, as torch has it."""
    with metamode.empty_weights(replayable=True):
        layer = nn.Linear(3, 3)
    assert layer.weight.to("meta") is layer.weight
