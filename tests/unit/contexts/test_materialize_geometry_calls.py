"""materialize and torch calls that change their tensor arguments' geometry in place.

``resize_``, ``resize_as_`` and the in-place view ops (``t_``, ``transpose_``, ``unsqueeze_``,
``squeeze_``, ``as_strided_``, ``swapdims_``, ``swapaxes_``, ``detach_``) are replayed on
their arguments as they were before the call; ``Tensor.set_`` and ``.data =`` never reach a
torch function mode, and the recording notices them when it next sees the tensor. Under
``torch.use_deterministic_algorithms(True)`` with
``torch.utils.deterministic.fill_uninitialized_memory`` on, the memory a resize adds is filled
(NaN for floating and complex dtypes, the largest value for integers, True for bool), and
replay fills it too. Each case is exact (values, strides, storage offsets and sharing, in
both modes), or refused upfront for its real reason; a case where materialize breaks that
promise is a strict xfail saying what happens. Floating results are compared by their bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_exact_or_refused,
    build_eagerly,
    build_empty,
    deterministic,
    materialize_exactly,
    tensors,
)

Body = Callable[[nn.Module], None]


class Shaped(nn.Module):
    """A linear layer (meta in both modes), then ``body(self)``."""

    def __init__(self, body: Body) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        body(self)


def _offsets(module: nn.Module) -> dict[str, int]:
    return {name: t.storage_offset() for name, t in tensors(module).items()}


def check_exact(body: Body, include_buffers: bool) -> nn.Module:
    """Built eagerly and on meta under one seed, ``Shaped(body)`` materializes to eager's
    tensors, storage offsets included."""
    ref = build_eagerly(lambda: Shaped(body))
    model = build_empty(lambda: Shaped(body), include_buffers)
    materialize_exactly(model, ref)
    assert _offsets(model) == _offsets(ref), "storage offsets differ from eager"
    return model


def check_either(body: Body, include_buffers: bool, *names: str, because: str) -> str:
    """Exact (offsets included), or refused upfront naming ``names`` for ``because``."""
    ref = build_eagerly(lambda: Shaped(body))
    model = build_empty(lambda: Shaped(body), include_buffers)
    outcome = assert_exact_or_refused(model, ref, *names, because=because)
    if outcome == "exact":
        assert _offsets(model) == _offsets(ref), "storage offsets differ from eager"
    return outcome


def _cases(bodies: dict[str, Body], broken: dict[tuple[str, bool], str] | None = None) -> list:
    """``(name, include_buffers)`` for each body in both modes; ``broken`` ones (by name and
    mode) run as strict xfails with the reason given."""
    broken = broken or {}
    cases = []
    for name in sorted(bodies):
        for mode in MODES:
            reason = broken.get((name, mode))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            cases.append(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}"))
    return cases


# -- 1. in-place view ops: chains, on buffers, parameters, views, after writes -------------


def _chain(m: nn.Module) -> None:
    b = torch.randn(2, 3)
    b.t_()
    b.unsqueeze_(0)
    b.transpose_(0, 2)
    b.squeeze_(2)
    b.mul_(2.0)
    m.register_buffer("b", b)


def _chain_on_a_weight_copy(m: nn.Module) -> None:
    w = m.fc.weight.detach().clone()
    w.t_()
    w.unsqueeze_(1)
    w.swapdims_(0, 2)
    w.swapaxes_(1, 2)
    w.squeeze_()
    w.add_(1.0)
    m.register_buffer("w", w)


def _swapdims_after_writes(m: nn.Module) -> None:
    b = torch.randn(3, 4)
    b.mul_(2.0)
    b.swapdims_(0, 1)
    b.add_(torch.arange(3.0))
    b.swapaxes_(0, 1)
    b.sub_(torch.arange(4.0))
    m.register_buffer("b", b)


def _as_strided_with_offset(m: nn.Module) -> None:
    b = torch.randn(12)
    b.as_strided_((3, 2), (1, 3), 2)
    b.mul_(3.0)
    m.register_buffer("b", b)


def _as_strided_twice(m: nn.Module) -> None:
    b = torch.randn(12)
    b.as_strided_((2, 2), (4, 1), 5)
    b.as_strided_((3,), (2,), 1)  # relative to the storage, not the first view
    b.add_(10.0)
    m.register_buffer("b", b)


def _registered_buffer_transposed(m: nn.Module) -> None:
    m.register_buffer("w", torch.randn(2, 3))
    m.w.t_()
    m.w.mul_(torch.arange(3.0).unsqueeze(1))


def _parameter_transposed_in_place(m: nn.Module) -> None:
    with torch.no_grad():
        m.fc.weight.t_()
        m.fc.weight.mul_(2.0)
        m.fc.bias.unsqueeze_(0)


def _parameter_data_transposed(m: nn.Module) -> None:
    # the alias .data gives changes geometry; the parameter keeps its own
    m.fc.weight.data.t_()
    alias = m.fc.weight.data
    alias.transpose_(0, 1)
    alias.mul_(2.0)


def _view_of_a_buffer_transposed_then_written(m: nn.Module) -> None:
    m.register_buffer("base", torch.randn(3, 4))
    v = m.base[1:]
    v.t_()
    v.add_(torch.arange(4.0).unsqueeze(1))
    m.register_buffer("v", v)


def _view_of_a_parameter_transposed(m: nn.Module) -> None:
    v = m.fc.weight.detach()[1:]
    v.t_()
    v.unsqueeze_(0)
    with torch.no_grad():
        v.mul_(3.0)
    m.register_buffer("v", v)


def _detach_of_a_computed_tensor(m: nn.Module) -> None:
    x = m.fc.weight * 2.0
    x.detach_()
    x.add_(1.0)
    m.register_buffer("x", x)


def _two_aliases_one_transposed(m: nn.Module) -> None:
    a = torch.randn(2, 3)
    b = a.detach()
    b.t_()
    b.mul_(torch.arange(2.0))
    m.register_buffer("a", a)
    m.register_buffer("b", b)


def _squeeze_of_an_expanded_view(m: nn.Module) -> None:
    row = torch.randn(1, 3)
    e = row.expand(2, 3)
    e.unsqueeze_(0)
    e.squeeze_(0)
    e.t_()
    m.register_buffer("row", row)
    m.register_buffer("e", e.clone())


def _transposed_then_made_contiguous(m: nn.Module) -> None:
    b = torch.randn(2, 3, 4)
    b.transpose_(0, 2)
    m.register_buffer("c", b.contiguous())
    m.register_buffer("b", b)


def _as_strided_of_a_flat_view(m: nn.Module) -> None:
    x = torch.randn(4, 3)
    y = x.view(12)
    y.as_strided_((4, 3), (1, 4))
    y.mul_(2.0)
    m.register_buffer("x", x)
    m.register_buffer("y", y)


def _squeeze_of_several_dims(m: nn.Module) -> None:
    x = torch.randn(1, 3, 1)
    x.squeeze_((0, 2))
    x.add_(1.0)
    m.register_buffer("x", x)


def _transpose_of_channels_last(m: nn.Module) -> None:
    x = torch.randn(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    x.transpose_(1, 3)
    x.mul_(2.0)
    m.register_buffer("x", x)


def _aliased_buffers_one_transposed(m: nn.Module) -> None:
    x = torch.randn(2, 3)
    m.register_buffer("a", x)
    m.register_buffer("b", x.view(6))
    m.a.t_()
    m.a.mul_(2.0)


VIEW_OPS = {
    "t_ unsqueeze_ transpose_ squeeze_ then a write": _chain,
    "a chain on a weight's clone (swapdims_, swapaxes_)": _chain_on_a_weight_copy,
    "swapdims_ and swapaxes_ between writes": _swapdims_after_writes,
    "as_strided_ with a storage offset": _as_strided_with_offset,
    "as_strided_ twice": _as_strided_twice,
    "a registered buffer t_ then written": _registered_buffer_transposed,
    "a parameter t_ and bias unsqueeze_ under no_grad": _parameter_transposed_in_place,
    "a parameter's .data t_ (the parameter keeps its shape)": _parameter_data_transposed,
    "a view of a buffer t_ then written through": _view_of_a_buffer_transposed_then_written,
    "a view of a parameter t_ unsqueeze_ then written": _view_of_a_parameter_transposed,
    "detach_ of a computed tensor": _detach_of_a_computed_tensor,
    "one of two aliases t_ then written": _two_aliases_one_transposed,
    "unsqueeze_ squeeze_ t_ of an expanded view": _squeeze_of_an_expanded_view,
    "transpose_ then contiguous()": _transposed_then_made_contiguous,
    "as_strided_ of a flat view, written through": _as_strided_of_a_flat_view,
    "squeeze_ of two dims": _squeeze_of_several_dims,
    "transpose_ of a channels_last tensor": _transpose_of_channels_last,
    "one of two registered aliases t_ then written": _aliased_buffers_one_transposed,
}


# initialisers after a geometry change: fan-in and the draws' layout follow the new shape


def _kaiming_after_t(m: nn.Module) -> None:
    with torch.no_grad():
        m.fc.weight.t_()
    nn.init.kaiming_uniform_(m.fc.weight)


def _orthogonal_after_t(m: nn.Module) -> None:
    with torch.no_grad():
        m.fc.weight.t_()
    nn.init.orthogonal_(m.fc.weight)


def _xavier_between_unsqueeze_and_squeeze(m: nn.Module) -> None:
    with torch.no_grad():
        m.fc.weight.unsqueeze_(0)
    nn.init.xavier_normal_(m.fc.weight)
    with torch.no_grad():
        m.fc.weight.squeeze_(0)


def _normal_into_a_transposed_alias(m: nn.Module) -> None:
    w = m.fc.weight.detach()
    w.t_()
    nn.init.normal_(w, std=0.5)


def _uniform_after_resize(m: nn.Module) -> None:
    m.register_buffer("x", torch.empty(3, 4))
    m.x.resize_(2, 6)
    nn.init.uniform_(m.x)


def _normal_into_as_strided(m: nn.Module) -> None:
    x = torch.zeros(12)
    x.as_strided_((3, 2), (2, 6), 1)
    nn.init.normal_(x)
    m.register_buffer("x", x)


def _fill_between_transposes(m: nn.Module) -> None:
    x = torch.empty(2, 3)
    x.t_()
    x.fill_(1.0)
    x.t_()
    x[0].fill_(2.0)
    m.register_buffer("x", x)


INITS_AFTER = {
    "kaiming_uniform_ after t_": _kaiming_after_t,
    "orthogonal_ after t_": _orthogonal_after_t,
    "xavier_normal_ between unsqueeze_ and squeeze_": _xavier_between_unsqueeze_and_squeeze,
    "normal_ into a transposed alias of a weight": _normal_into_a_transposed_alias,
    "uniform_ after resize_ of a buffer": _uniform_after_resize,
    "normal_ into an as_strided_ view": _normal_into_as_strided,
    "fill_ between transposes (covering, then partial)": _fill_between_transposes,
}


@pytest.mark.parametrize(("view_op", "include_buffers"), _cases(VIEW_OPS))
def test_in_place_view_ops(view_op: str, include_buffers: bool) -> None:
    """Chains of in-place view ops on new tensors, buffers, parameters and views: exact."""
    check_exact(VIEW_OPS[view_op], include_buffers)


@pytest.mark.parametrize(("init", "include_buffers"), _cases(INITS_AFTER))
def test_initialisers_after_a_geometry_change(init: str, include_buffers: bool) -> None:
    """An initialiser skipped on meta after a geometry change sees the new shape: exact."""
    check_exact(INITS_AFTER[init], include_buffers)


# -- 2. set_, resize_, resize_as_ and .data assignments ------------------------------------


def _set_onto_another(m: nn.Module) -> None:
    a = torch.zeros(3)
    b = torch.randn(2, 2)
    a.set_(b)
    a.mul_(2.0)
    m.register_buffer("a", a)
    m.register_buffer("b", b)


def _set_onto_a_transposed_view(m: nn.Module) -> None:
    a = torch.zeros(1)
    b = torch.randn(3, 4)
    a.set_(b[1:].t())
    a.add_(1.0)
    m.register_buffer("a", a)
    m.register_buffer("b", b)


def _set_onto_a_weight(m: nn.Module) -> None:
    m.register_buffer("tied", m.fc.weight.new_zeros(0))
    m.tied.set_(m.fc.weight.detach())
    m.tied.mul_(2.0)  # writes the weight too


def _set_then_source_transposed(m: nn.Module) -> None:
    a = torch.zeros(3)
    b = torch.randn(2, 3)
    a.set_(b)
    b.t_()
    b.add_(torch.arange(2.0))
    m.register_buffer("a", a)
    m.register_buffer("b", b)


def _set_to_its_own_slice(m: nn.Module) -> None:
    a = torch.randn(6)
    a.set_(a[2:].view(2, 2))
    a.mul_(2.0)
    m.register_buffer("a", a)


def _resize_shrinks_then_grows_within(m: nn.Module) -> None:
    b = torch.randn(6)
    b.resize_(2)
    b.mul_(3.0)
    b.resize_(2, 3)
    m.register_buffer("b", b)


def _resize_grows_then_written(m: nn.Module) -> None:
    b = m.fc.weight.detach().clone()
    b.resize_(5, 3)
    b[4:] = 1.0
    m.register_buffer("b", b)


def _resize_shrinks_then_grows_past(m: nn.Module) -> None:
    b = torch.randn(4)
    b.resize_(1)
    b.resize_(6)
    b[4:] = 9.0
    m.register_buffer("b", b)


def _resize_as_a_transposed_tensor(m: nn.Module) -> None:
    b = torch.randn(6)
    b.resize_as_(torch.zeros(3, 2).t())
    b.mul_(2.0)
    m.register_buffer("b", b)


def _resize_channels_last_same_numel(m: nn.Module) -> None:
    b = torch.randn(2, 3, 2, 2)
    b.resize_(2, 3, 2, 2, memory_format=torch.channels_last)
    b.add_(1.0)
    m.register_buffer("b", b)


def _resize_a_buffer_then_transposed(m: nn.Module) -> None:
    m.register_buffer("r", torch.randn(4))
    m.r.resize_(2, 2)
    m.r.t_()
    m.r.mul_(torch.arange(2.0))


def _resize_a_view_with_offset(m: nn.Module) -> None:
    m.register_buffer("base", torch.randn(6))
    v = m.base[2:]
    v.resize_(3)  # shrinks within the storage
    v.mul_(2.0)
    m.register_buffer("v", v)


def _data_assigned_then_transposed(m: nn.Module) -> None:
    m.register_buffer("w", torch.zeros(2))
    m.w.data = torch.randn(2, 3)
    m.w.t_()
    m.w.mul_(2.0)


def _weight_data_a_transposed_view(m: nn.Module) -> None:
    m.fc.weight.data = m.fc.weight.data.t()
    with torch.no_grad():
        m.fc.weight.mul_(2.0)


def _weight_data_transposed_in_place(m: nn.Module) -> None:
    data = m.fc.weight.data
    data.t_()
    m.fc.weight.data = data
    with torch.no_grad():
        m.fc.weight.add_(1.0)


def _data_swapped_between_buffers(m: nn.Module) -> None:
    m.register_buffer("a", torch.randn(2, 3))
    m.register_buffer("b", torch.randn(3))
    m.a.data, m.b.data = m.b.data, m.a.data
    m.a.unsqueeze_(0)
    m.b.t_()


def _set_and_data_mixed(m: nn.Module) -> None:
    m.register_buffer("a", torch.randn(4))
    m.register_buffer("b", torch.zeros(1))
    m.b.set_(m.a)
    m.a.data = torch.randn(2, 2)
    m.a.t_()
    m.b.mul_(2.0)


SET_AND_RESIZE = {
    "set_ onto another tensor, then written": _set_onto_another,
    "set_ onto a transposed view, then written": _set_onto_a_transposed_view,
    "set_ of a buffer onto a weight, then written": _set_onto_a_weight,
    "set_, then the source t_": _set_then_source_transposed,
    "set_ onto its own slice": _set_to_its_own_slice,
    "resize_ shrinks, write, then grows within the storage": _resize_shrinks_then_grows_within,
    "resize_ of a weight's clone grows, new rows written": _resize_grows_then_written,
    "resize_ shrinks, then grows past the storage, new part written": (
        _resize_shrinks_then_grows_past
    ),
    "resize_as_ a transposed tensor": _resize_as_a_transposed_tensor,
    "resize_ to channels_last, same numel": _resize_channels_last_same_numel,
    "resize_ of a registered buffer, then t_": _resize_a_buffer_then_transposed,
    "resize_ of a view with an offset, shrinking": _resize_a_view_with_offset,
    ".data = other, then t_": _data_assigned_then_transposed,
    "weight.data = weight.data.t()": _weight_data_a_transposed_view,
    "weight.data t_ then assigned back": _weight_data_transposed_in_place,
    ".data swapped between buffers, then view ops": _data_swapped_between_buffers,
    "set_ and .data = mixed": _set_and_data_mixed,
}


@pytest.mark.parametrize(("idiom", "include_buffers"), _cases(SET_AND_RESIZE))
def test_set_resize_and_data_assignments(idiom: str, include_buffers: bool) -> None:
    """set_ onto tensors and views, resize_ within and past the storage, .data =: exact."""
    check_exact(SET_AND_RESIZE[idiom], include_buffers)


def _set_onto_a_storage(m: nn.Module) -> None:
    a = torch.zeros(1)
    b = torch.randn(3, 4)
    a.set_(b.untyped_storage(), 1, (2, 2), (1, 2))
    a.mul_(2.0)
    m.register_buffer("a", a)
    m.register_buffer("b", b)


@pytest.mark.parametrize("include_buffers", MODES)
def test_set_onto_another_tensors_storage(include_buffers: bool) -> None:
    """set_ onto an untyped storage: the storage is handed out, so refused saying so."""
    check_either(_set_onto_a_storage, include_buffers, "a", because=r"untyped_storage\(\)")


# -- 3. what follows a set_ (unseen: noticed from the version counter) ----------------------


def _set_then_read(m: nn.Module) -> None:
    a = m.fc.weight.new_zeros(4, 3)
    a.set_(m.fc.weight.detach().clone())
    m.register_buffer("x", a + 1.0)


def _set_then_summed(m: nn.Module) -> None:
    a = torch.zeros(4)
    b = torch.randn(4)
    a.set_(b)
    m.register_buffer("x", a.sum(0, keepdim=True))


SET_THEN_READ = {
    "a.set_(b), then a + 1 registered": _set_then_read,
    "a.set_(b), then a.sum() registered": _set_then_summed,
}


@pytest.mark.parametrize(
    ("idiom", "include_buffers"),
    _cases(SET_THEN_READ),
)
def test_a_tensor_read_after_set_(idiom: str, include_buffers: bool) -> None:
    """A tensor set_ onto another, then only read: exact, or refused for the set_."""
    check_either(SET_THEN_READ[idiom], include_buffers, "x", because="set_")


def _set_then_matmul(m: nn.Module) -> None:
    a = m.fc.weight.new_zeros(1)
    a.set_(m.fc.weight.detach())
    m.register_buffer("x", a @ m.fc.weight.detach().t())


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_matmul_of_a_tensor_after_set_(include_buffers: bool) -> None:
    """A matmul of a tensor set_ onto a weight: exact, or refused upfront."""
    check_either(_set_then_matmul, include_buffers, "x", because="set_")


def _set_then_multiplied_by_a_tensor(m: nn.Module) -> None:
    a = torch.zeros(4)
    b = torch.randn(4)
    a.set_(b)
    a.mul_(torch.full((4,), 3.0))
    m.register_buffer("a", a)


def test_a_tensor_written_with_a_tensor_after_set_() -> None:
    """A tensor set_ onto another, then written with a tensor argument."""
    check_either(_set_then_multiplied_by_a_tensor, True, "a", because="set_")


def _set_emptied(m: nn.Module) -> None:
    a = torch.randn(3)
    a.set_()
    a.resize_(2, 2)
    a.fill_(2.0)
    m.register_buffer("a", a)


def test_set_with_no_source_then_resized_and_filled() -> None:
    """set_() with no source, then resize_ and fill_, on meta."""
    check_either(_set_emptied, True, "a", because="set_")


def test_set_with_no_source_params_only() -> None:
    """The same with real buffers: nothing to replay, exact."""
    check_exact(_set_emptied, False)


# -- 4. a real parameter registered (params-only: a meta twin), then reshaped ---------------


def _twin_transposed(m: nn.Module) -> None:
    p = nn.Parameter(torch.randn(2, 3))
    m.p = p
    with torch.no_grad():
        p.t_()


def _twin_unsqueezed_then_scaled(m: nn.Module) -> None:
    p = nn.Parameter(torch.randn(2, 3))
    m.p = p
    with torch.no_grad():
        p.unsqueeze_(0)
        p.mul_(2.0)


def _twin_data_assigned(m: nn.Module) -> None:
    p = nn.Parameter(torch.randn(2, 3))
    m.p = p
    p.data = torch.randn(3, 2)


def _twin_scaled(m: nn.Module) -> None:
    p = nn.Parameter(torch.randn(2, 3))
    m.p = p
    with torch.no_grad():
        p.mul_(2.0)


TWINS = {
    "p.t_() after self.p = p": _twin_transposed,
    "p.unsqueeze_(0), p.mul_ after self.p = p": _twin_unsqueezed_then_scaled,
    "p.data = other after self.p = p": _twin_data_assigned,
    "p.mul_ after self.p = p": _twin_scaled,
}


@pytest.mark.parametrize(
    ("idiom", "include_buffers"),
    _cases(TWINS),
)
def test_a_registered_parameter_reshaped_through_its_original(
    idiom: str, include_buffers: bool
) -> None:
    """Geometry changed through the registered tensor's original handle: exact or refused."""
    check_either(TWINS[idiom], include_buffers, "p", because="after")


# -- 5. torch's deterministic fill of the memory a resize adds -----------------------------


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes (NaN equals nothing; its bit pattern equals itself)."""
    return tensor.view(torch.uint8)


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _grown(dtype: torch.dtype) -> Body:
    def body(m: nn.Module) -> None:
        x = m.fc.weight.new_ones(2, dtype=dtype)  # meta in both modes
        with deterministic():
            x.resize_(5)
        m.register_buffer("bits", _bits(x))

    return body


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_memory_a_resize_adds_is_filled_for_every_dtype(
    dtype: torch.dtype, include_buffers: bool
) -> None:
    """NaN (floating, complex: NaN+0j), the largest value (integers), True (bool), bitwise."""
    check_exact(_grown(dtype), include_buffers)


def _view_with_offset(m: nn.Module) -> None:
    m.register_buffer("base", m.fc.weight.new_ones(4, dtype=torch.int32))
    v = m.base[2:]
    with deterministic():
        v.resize_(5)  # the storage grows from 4 elements to 7
    m.register_buffer("v", v)


def _non_contiguous(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, 3, dtype=torch.int16).t()
    with deterministic():
        x.resize_(4, 4)
    m.register_buffer("x", x)


def _shrunk_then_grown(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(6, dtype=torch.int64).cumsum(0)
    with deterministic():
        x.resize_(2)
        x.resize_(3, 3)  # elements 2..5 keep their values, 6..8 are new
    m.register_buffer("x", x)


def _shrunk_then_grown_within(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(6, dtype=torch.int64).cumsum(0)
    with deterministic():
        x.resize_(1)
        x.resize_(2, 3)  # within the storage: nothing new
    m.register_buffer("x", x)


def _grown_twice_float(m: nn.Module) -> None:
    x = m.fc.weight.detach().flatten().clone()
    with deterministic():
        x.resize_(14)
        x.resize_(4, 4)
    m.register_buffer("bits", _bits(x))


def _resize_as_channels_last(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, dtype=torch.int8)
    template = m.fc.weight.new_zeros(2, 3, 2, 2).to(memory_format=torch.channels_last)
    with deterministic():
        x.resize_as_(template, memory_format=torch.preserve_format)
    m.register_buffer("x", x)


def _resize_as_default_format(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, dtype=torch.int8)
    template = m.fc.weight.new_zeros(2, 3, 2, 2).to(memory_format=torch.channels_last)
    with deterministic():
        x.resize_as_(template)
    m.register_buffer("x", x)


def _resize_channels_last(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(4, dtype=torch.int32)
    with deterministic():
        x.resize_(2, 3, 2, 2, memory_format=torch.channels_last)
    m.register_buffer("x", x)


def _warn_only(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, dtype=torch.int32)
    with deterministic(warn_only=True):
        x.resize_(5)
    m.register_buffer("x", x)


def _toggled(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, dtype=torch.int64)
    with deterministic():
        x.resize_(4)  # filled
    with deterministic(fill=False):
        x.resize_(6)  # not filled: written below
    x[4:] = 7
    with deterministic():
        x.resize_(8)  # filled again
    m.register_buffer("x", x)


def _registered_buffer_grown(m: nn.Module) -> None:
    m.register_buffer("g", m.fc.weight.new_ones(2, dtype=torch.int32))
    with deterministic():
        m.g.resize_(2, 3)
    m.g.add_(1)


def _made_by_a_factory_then_grown(m: nn.Module) -> None:
    x = torch.empty(2, dtype=torch.int64)
    with deterministic():
        x.fill_(3)
        x.resize_(4)
    m.register_buffer("x", x)


def _empty_grown(m: nn.Module) -> None:
    with deterministic():
        x = torch.empty(0, dtype=torch.bfloat16).resize_(2, 2)
        y = torch.empty(2, dtype=torch.complex64)
        y.resize_(3)
    m.register_buffer("x", _bits(x))
    m.register_buffer("y", _bits(y))


def _grown_then_read(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, dtype=torch.int32)
    with deterministic():
        x.resize_(4)
    m.register_buffer("s", (x == torch.iinfo(torch.int32).max).sum(0, keepdim=True))


def _a_wider_view_grown(m: nn.Module) -> None:
    """An int32 view of 6 bytes of int16s: the fill starts at int32 element 6 // 4 = 1,
    over the third int16, which was data."""
    x = m.fc.weight.new_ones(3, dtype=torch.int16)
    y = x[:2].view(torch.int32)
    with deterministic():
        y.resize_(2)
    m.register_buffer("x", x)
    m.register_buffer("y", y)


def _conjugate_view_grown(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, dtype=torch.complex64)
    y = x.conj()
    with deterministic():
        y.resize_(4)  # torch fills the raw memory: read through the conjugate bit
    m.register_buffer("bits", _bits(y.resolve_conj()))


def _grown_between_transposes(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, 2, dtype=torch.float16)
    with deterministic():
        x.t_()
        x.resize_(3, 3)
        x.t_()
    m.register_buffer("bits", _bits(x.contiguous()))


def _a_views_resize(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, dtype=torch.int32)
    y = x.unsqueeze(0)
    with deterministic():
        y.resize_(2, 3)  # grows x's storage too
    m.register_buffer("x", x)
    m.register_buffer("y", y)


def _registered_grown_twice(m: nn.Module) -> None:
    with deterministic():
        m.register_buffer("x", torch.zeros(2, dtype=torch.int64).resize_(4))
        m.x.resize_(6)
    m.register_buffer("y", m.x[2:].clone())


GROWN = {
    "resize_ of a view with an offset": _view_with_offset,
    "resize_ of a transposed tensor": _non_contiguous,
    "resize_ smaller, then larger than the storage": _shrunk_then_grown,
    "resize_ smaller, then larger within the storage": _shrunk_then_grown_within,
    "resize_ of a float copy of a weight, twice": _grown_twice_float,
    "resize_as_ a channels_last tensor, preserve_format": _resize_as_channels_last,
    "resize_as_ a channels_last tensor, default format": _resize_as_default_format,
    "resize_ to channels_last": _resize_channels_last,
    "resize_ under warn_only": _warn_only,
    "the flags toggled between resize_ calls": _toggled,
    "a registered buffer resize_'d, then written": _registered_buffer_grown,
    "torch.empty filled, then resize_'d": _made_by_a_factory_then_grown,
    "torch.empty resize_'d (bfloat16, complex64)": _empty_grown,
    "the grown memory read by a comparison": _grown_then_read,
    "an int32 view of int16 memory resize_'d": _a_wider_view_grown,
    "a conjugate view resize_'d": _conjugate_view_grown,
    "resize_ between t_ calls (float16)": _grown_between_transposes,
    "a view resize_'d (its base's storage grows)": _a_views_resize,
    "a registered buffer grown twice, a slice cloned": _registered_grown_twice,
}


@pytest.mark.parametrize(("idiom", "include_buffers"), _cases(GROWN))
def test_the_memory_a_resize_adds(idiom: str, include_buffers: bool) -> None:
    """Growth of views, offsets, strided and channels_last layouts, toggled flags: exact."""
    check_exact(GROWN[idiom], include_buffers)


def _wider_view_grown_under(algorithms: bool, fill: bool) -> Body:
    """As ``_a_wider_view_grown`` under the given flags; only the int16s (whose bytes the
    resize copies, or fills) are registered: without the fill, the new bytes are garbage."""

    def body(m: nn.Module) -> None:
        x = m.fc.weight.new_ones(3, dtype=torch.int16)
        y = x[:2].view(torch.int32)
        with deterministic(algorithms, fill):
            y.resize_(2)
        m.register_buffer("x", x)

    return body


NOT_FILLED = {
    "both flags off": (False, False),
    "deterministic algorithms on, fill off": (True, False),
    "fill on, deterministic algorithms off": (False, True),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("flags", sorted(NOT_FILLED))
def test_a_resize_without_both_flags_is_not_filled(flags: str, include_buffers: bool) -> None:
    """Eager keeps the third int16 (a fill would overwrite it): replay must too."""
    model = check_exact(_wider_view_grown_under(*NOT_FILLED[flags]), include_buffers)
    assert model.x.tolist() == [1, 1, 1]


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_resize_built_unfilled_materialized_under_the_fill(include_buffers: bool) -> None:
    """Built with the flags off, materialized with them on: eager did not fill."""
    body = _wider_view_grown_under(False, False)
    ref = build_eagerly(lambda: Shaped(body))
    model = build_empty(lambda: Shaped(body), include_buffers)
    with deterministic():
        assert_exact_or_refused(model, ref, "x", because="deterministic|fill")


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize(
    "idiom",
    ["the flags toggled between resize_ calls", "an int32 view of int16 memory resize_'d"],
)
def test_a_filled_resize_materialized_under_the_fill(idiom: str, include_buffers: bool) -> None:
    """torch fills during replay, and so does metamode: the same bytes, once or twice."""
    ref = build_eagerly(lambda: Shaped(GROWN[idiom]))
    model = build_empty(lambda: Shaped(GROWN[idiom]), include_buffers)
    with deterministic():
        materialize_exactly(model, ref)


# other spellings of a growing resize


def _function_resize_as(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, dtype=torch.int64)
    with deterministic():
        torch.resize_as_(x, m.fc.weight)
    m.register_buffer("x", x)


def _aten_resize(m: nn.Module) -> None:
    x = m.fc.weight.new_ones(2, dtype=torch.int64)
    with deterministic():
        torch.ops.aten.resize_.default(x, [5])
    m.register_buffer("x", x)


@pytest.mark.parametrize(
    ("idiom", "include_buffers"),
    _cases({"torch.resize_as_(x, y)": _function_resize_as, "aten.resize_": _aten_resize}),
)
def test_other_spellings_of_a_growing_resize(idiom: str, include_buffers: bool) -> None:
    """torch.resize_as_ and aten.resize_ grow and fill as the methods do."""
    body = {"torch.resize_as_(x, y)": _function_resize_as, "aten.resize_": _aten_resize}[idiom]
    check_either(body, include_buffers, "x", because="resize_")


# a write that covers the storage as it was before a resize grew it


def _prefix_written_after_growth(fill: bool) -> Body:
    def body(m: nn.Module) -> None:
        t = m.fc.weight.new_ones(2, dtype=torch.int64)
        with deterministic(fill, fill):
            t.resize_(4)
        if not fill:
            t[2:] = 3
        t[:2].fill_(5)  # the storage's first size: not all of it any more
        m.register_buffer("t", t)

    return body


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize(
    "fill",
    [True, False],
    ids=["filled", "written"],
)
def test_a_prefix_overwritten_after_a_resize_grew_the_storage(
    fill: bool, include_buffers: bool
) -> None:
    """A write of the storage's first size after a resize grew it covers only part of it."""
    check_either(_prefix_written_after_growth(fill), include_buffers, "t", because="resize_")


# -- 6. out= tensors torch resizes (a warning in eager), and tensors from outside -----------


def _out_grown(m: nn.Module) -> None:
    z = torch.zeros(2)
    torch.add(torch.randn(4), 1.0, out=z)
    m.register_buffer("z", z)


def _out_a_registered_buffer(m: nn.Module) -> None:
    m.register_buffer("z", torch.zeros(2))
    torch.mul(torch.randn(2, 3), 2.0, out=m.z)


def _out_of_cat(m: nn.Module) -> None:
    z = m.fc.weight.new_zeros(1)
    torch.cat([m.fc.weight.detach(), m.fc.weight.detach()], out=z)
    m.register_buffer("z", z)


def _out_a_view_with_offset(m: nn.Module) -> None:
    base = m.fc.weight.new_zeros(6)
    z = base[2:4]
    torch.add(m.fc.bias.detach(), 1.0, out=z)  # 2 -> 4 elements: the storage grows
    m.register_buffer("z", z)
    m.register_buffer("base", base)


def _out_grown_under_the_fill(m: nn.Module) -> None:
    base = m.fc.weight.new_zeros(3)
    z = base[1:]
    with deterministic():
        torch.add(m.fc.bias.detach(), 1.0, out=z)
    m.register_buffer("base", base)
    m.register_buffer("z", z)


def _out_transposed(m: nn.Module) -> None:
    z = m.fc.weight.new_zeros(2, 2).t()
    torch.mm(m.fc.weight.detach(), m.fc.weight.detach().t(), out=z)
    m.register_buffer("z", z)


def _randperm_out_under_the_fill(m: nn.Module) -> None:
    z = m.fc.weight.new_zeros(2, dtype=torch.int64)
    with deterministic():
        torch.randperm(6, out=z)
    m.register_buffer("z", z)


OUT_RESIZED = {
    "torch.add(out=) a smaller tensor": _out_grown,
    "torch.mul(out=) a registered buffer": _out_a_registered_buffer,
    "torch.cat(out=) a 1-element tensor": _out_of_cat,
    "torch.add(out=) a view with an offset": _out_a_view_with_offset,
    "torch.add(out=) a view, under the fill": _out_grown_under_the_fill,
    "torch.mm(out=) a transposed tensor": _out_transposed,
    "torch.randperm(out=) under the fill": _randperm_out_under_the_fill,
}


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize(("idiom", "include_buffers"), _cases(OUT_RESIZED))
def test_out_tensors_resized_by_torch(idiom: str, include_buffers: bool) -> None:
    """An out= tensor of the wrong size, resized (and grown) by the op: exact."""
    check_exact(OUT_RESIZED[idiom], include_buffers)


class FromOutside(nn.Module):
    """``body(self, source)``: ``source`` is a real tensor made before the block."""

    def __init__(self, source: torch.Tensor, body: Callable[[nn.Module, torch.Tensor], None]):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        body(self, source)


def _outside_transposed(m: nn.Module, source: torch.Tensor) -> None:
    source.t_()
    m.register_buffer("x", m.fc.weight.new_zeros(3, 2).copy_(source))


def _outside_view_as_strided(m: nn.Module, source: torch.Tensor) -> None:
    v = source.view(6)
    v.as_strided_((3,), (2,), 1)
    m.register_buffer("x", m.fc.weight.new_zeros(3).copy_(v))


def _outside_grown(m: nn.Module, source: torch.Tensor) -> None:
    with deterministic():
        source.resize_(3, 3)
    m.register_buffer("x", m.fc.weight.new_zeros(3, 3).copy_(source).isnan())


OUTSIDE = {
    "t_ of an outside tensor, then copied in": _outside_transposed,
    "as_strided_ of a view of an outside tensor": _outside_view_as_strided,
    "resize_ of an outside tensor under the fill": _outside_grown,
}


@pytest.mark.parametrize(("idiom", "include_buffers"), _cases(OUTSIDE))
def test_geometry_calls_on_a_tensor_from_outside(idiom: str, include_buffers: bool) -> None:
    """The outside tensor's memory is the same before and after (only its geometry
    changed, or it grew): exact, or refused naming the outside tensor."""
    body = OUTSIDE[idiom]
    ref = build_eagerly(lambda: FromOutside(torch.arange(6.0).view(2, 3), body))
    source = torch.arange(6.0).view(2, 3)
    model = build_empty(lambda: FromOutside(source, body), include_buffers)
    assert_exact_or_refused(model, ref, "x", because="outside the recording")
