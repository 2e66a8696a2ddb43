"""materialize and the thread state torch consults for a result: autocast (in the build and
around materialize), the default dtype a complex result was promoted from, grad and
inference mode around materialize, a dispatch mode in the build. Each build replays under
the state it ran in, whatever the caller's, or is refused before anything changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_exact_or_refused,
    assert_refused,
    build_eagerly,
    build_empty,
    materialize_exactly,
)


class Built(nn.Module):
    def __init__(self, init) -> None:
        super().__init__()
        init(self)
        self.after = nn.Linear(4, 4)


def _autocast() -> AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16)


# -- a build under autocast ------------------------------------------------------------


def _matmul_in_autocast(m: nn.Module) -> None:
    a = torch.randn(4, 4)
    with _autocast():
        m.w = nn.Parameter(a @ a.T)  # eager: bfloat16


def _linear_in_autocast(m: nn.Module) -> None:
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with _autocast():
        m.register_buffer("y", F.linear(x, w))


def _mm_then_fp32_op_in_autocast(m: nn.Module) -> None:
    a = torch.randn(4, 4)
    with _autocast():
        h = torch.mm(a, a)
        m.w = nn.Parameter(h.float().exp())


def _float16_autocast(m: nn.Module) -> None:
    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        m.w = nn.Parameter(torch.matmul(a, a))


def _whole_build_in_autocast(m: nn.Module) -> None:
    with _autocast():
        m.lin = nn.Linear(4, 4)  # no autocast op: eager's float32 values
        a = torch.randn(4, 4)
        m.w = nn.Parameter(a @ a)


AUTOCAST_BUILDS = {
    "a @ a.T": _matmul_in_autocast,
    "F.linear": _linear_in_autocast,
    "mm then float().exp()": _mm_then_fp32_op_in_autocast,
    "float16 matmul": _float16_autocast,
    "nn.Linear and matmul": _whole_build_in_autocast,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(AUTOCAST_BUILDS))
def test_a_build_under_autocast_is_replayed_under_it_or_refused(idiom, include_buffers):
    # the old code replayed without autocast: ReplayError (float32 where the build made
    # bfloat16) or, where the build computed on meta, float32 tensors eager has bfloat16
    build = AUTOCAST_BUILDS[idiom]
    ref = build_eagerly(lambda: Built(build))
    model = build_empty(lambda: Built(build), include_buffers)
    outcome = assert_exact_or_refused(model, ref, because="autocast")
    if not include_buffers:
        assert outcome == "exact"


def test_autocast_on_meta_tensors_is_refused_naming_it():
    def init(m: nn.Module) -> None:
        m.lin = nn.Linear(4, 4)
        with _autocast():
            m.register_buffer("y", m.lin.weight.detach() @ m.lin.weight.detach().T)

    model = build_empty(lambda: Built(init))
    assert_refused(model, "y", because=r"autocast\('cpu'\) on meta tensors")


def test_an_init_function_under_autocast_on_meta_is_exact():
    # in-place inits have no autocast kernel: eager's values, whatever the region
    def init(m: nn.Module) -> None:
        with _autocast():
            m.lin = nn.Linear(4, 4)
            nn.init.normal_(m.lin.weight, std=0.02)

    assert_eager_equal(lambda: Built(init), False)


# -- materialize under another thread state ----------------------------------------------


def _matmul_param(m: nn.Module) -> None:
    a = torch.randn(4, 4)
    m.w = nn.Parameter(a @ a.T)


def _conv_buffer(m: nn.Module) -> None:
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    m.register_buffer("y", F.conv2d(x, w))


@contextmanager
def _float16_autocast_ctx() -> Iterator[None]:
    with torch.autocast("cpu", dtype=torch.float16):
        yield


AROUND: dict[str, Callable[[], AbstractContextManager]] = {
    "autocast bfloat16": _autocast,
    "autocast float16": _float16_autocast_ctx,
    "enable_grad": torch.enable_grad,
    "no_grad": torch.no_grad,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("around", sorted(AROUND))
@pytest.mark.parametrize("init", [_matmul_param, _conv_buffer])
def test_materialize_replays_under_the_build_state_whatever_the_callers(
    init, around, include_buffers
):
    # the old code: is_materializable said True, then materialize raised ReplayError
    # (bfloat16 where the build made float32) inside autocast
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    with AROUND[around]():
        materialize_exactly(model, ref)
    assert not torch.is_autocast_enabled("cpu") or around.startswith("autocast")


def test_a_build_under_autocast_materialized_outside_it_and_inside_another():
    ref = build_eagerly(lambda: Built(_matmul_in_autocast))
    model = build_empty(lambda: Built(_matmul_in_autocast))
    with torch.autocast("cpu", dtype=torch.float16):
        materialize_exactly(model, ref)
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # torch's default, put back


# -- the default dtype a result was promoted from --------------------------------------


def _s4d(m: nn.Module) -> None:
    n = 4
    m.A = nn.Parameter(-0.5 + 1j * math.pi * torch.arange(n))  # S4D-Lin


def _complex_scalar_times_int(m: nn.Module) -> None:
    m.B = nn.Parameter(1j * torch.arange(4))


def _exp_of_imaginary_positions(m: nn.Module) -> None:
    m.register_buffer("rot", torch.exp(2j * math.pi * torch.arange(6) / 6))


def _float_from_int(m: nn.Module) -> None:
    m.register_buffer("halves", torch.arange(4) * 0.5)


PROMOTED = {
    "S4D -0.5 + 1j*pi*arange": _s4d,
    "1j * arange": _complex_scalar_times_int,
    "exp(2j*pi*arange/n)": _exp_of_imaginary_positions,
    "arange * 0.5": _float_from_int,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(PROMOTED))
def test_a_result_promoted_from_the_default_dtype_is_refused_under_another(idiom, include_buffers):
    # the old code let the complex ones through the check: ReplayError (complex64 where
    # the build made complex128) at materialize
    build = PROMOTED[idiom]
    torch.set_default_dtype(torch.float64)
    try:
        ref = build_eagerly(lambda: Built(build))
        model = build_empty(lambda: Built(build), include_buffers)
    finally:
        torch.set_default_dtype(torch.float32)
    outcome = assert_exact_or_refused(model, ref, because="default dtype")
    if include_buffers or idiom in ("S4D -0.5 + 1j*pi*arange", "1j * arange"):
        assert outcome == "refused"  # a meta tensor (a real buffer is eager's, and kept)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(PROMOTED))
def test_a_result_promoted_from_the_default_dtype_is_exact_under_the_same(idiom, include_buffers):
    torch.set_default_dtype(torch.float64)
    try:
        assert_eager_equal(lambda: Built(PROMOTED[idiom]), include_buffers)
    finally:
        torch.set_default_dtype(torch.float32)


# -- dispatch keys replay cannot reproduce ---------------------------------------------


class _Doubling(TorchDispatchMode):
    """Changes every matmul's result: what a dispatch mode may do."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default:
            result = result * 2
        return result


def test_a_call_under_a_dispatch_mode_is_refused():
    # the old code replayed it without the mode: values half of eager's
    def init(m: nn.Module) -> None:
        a = torch.randn(4, 4)
        with _Doubling():
            m.w = nn.Parameter(a @ a)

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init))
    assert torch.equal(ref.w, 2 * (lambda a: a @ a)(_first_randn()))
    assert_refused(model, "w", because="dispatch keys")


def _first_randn() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(4, 4)
