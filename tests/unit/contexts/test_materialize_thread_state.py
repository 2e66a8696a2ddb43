"""materialize and the thread state torch consults for a result: autocast (in the build and
around materialize), the default dtype a complex result was promoted from, grad and
inference mode around materialize, a dispatch mode in the build. Each build replays under
the state it ran in, whatever the caller's, or is refused before anything changes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_exact_or_refused,
    assert_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    flushing,
    materialize_exactly,
    tensors,
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


# -- torch.__future__: swapping parameters on conversion -----------------------------------


@pytest.fixture
def swapping() -> Iterator[None]:
    """``Module._apply`` (``.double()``, ``.to()``) swaps each parameter in place with
    ``torch.utils.swap_tensors``, which refuses a tensor that has a weak reference."""
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def _cast_inside(m: nn.Module) -> None:
    m.lin = nn.Linear(4, 4)
    m.lin.double()


def _cast_inside_and_back(m: nn.Module) -> None:
    m.lin = nn.Linear(4, 4).double()
    m.lin.float()
    m.conv = nn.Conv1d(2, 2, 3).to(torch.float64)


def _cast_then_init(m: nn.Module) -> None:
    m.lin = nn.Linear(4, 4).double()
    nn.init.normal_(m.lin.weight)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("init", [_cast_inside, _cast_inside_and_back, _cast_then_init])
def test_a_cast_that_swaps_parameters_inside_the_build(swapping, init, include_buffers):
    # the old code: "_apply(): Couldn't swap Linear.weight" in the build (its weak
    # references to the parameters)
    assert_eager_equal(lambda: Built(init), include_buffers)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_cast_that_swaps_parameters_after_the_build_is_refused_by_reason(
    swapping, include_buffers
):
    # the old code: "_apply(): Couldn't swap Linear.weight" after the block
    model = build_empty(lambda: nn.Linear(4, 4), include_buffers)
    weight = model.weight
    model.double()
    assert model.weight is weight and model.weight.dtype == torch.float64
    assert_refused(model, "weight", "bias", because="materialize first, then cast")


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_cast_that_swaps_parameters_after_materialize(swapping, include_buffers):
    # the old code: "_apply(): Couldn't swap Linear.weight" after materialize (its weak
    # reference to the installed tensor)
    ref = build_eagerly(lambda: nn.Linear(4, 4))
    model = build_empty(lambda: nn.Linear(4, 4), include_buffers)
    materialize_exactly(model, ref)
    weight = model.weight
    model.double()
    assert model.weight is weight
    assert torch.equal(model.weight, ref.weight.double())


def test_a_tie_materialized_in_two_steps_then_cast(swapping):
    # the old code: "_apply(): Couldn't swap" (its weak reference to what it installed)
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight  # tied

    ref = build_eagerly(Pair)
    model = build_empty(Pair)
    materialize_exactly(model.a)
    materialize_exactly(model, ref)
    model.double()
    assert model.a.weight is model.b.weight


@pytest.mark.parametrize("include_buffers", MODES)
def test_load_state_dict_assign_that_swaps_parameters_after_the_build(swapping, include_buffers):
    # the old code: "Cannot swap t1 because it has weakref associated with it"
    ref = build_eagerly(lambda: nn.Linear(4, 4))
    model = build_empty(lambda: nn.Linear(4, 4), include_buffers)
    weight = model.weight
    model.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, assign=True)
    assert model.weight is weight and torch.equal(model.weight, ref.weight)
    materialize_exactly(model, ref)  # nothing left on meta: nothing to do


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_cast_that_overwrites_parameters_inside_the_build(include_buffers):
    def init(m: nn.Module) -> None:
        m.lin = nn.Linear(4, 4)
        m.lin.double()  # a new Parameter object in _parameters, no registration hook

    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        assert_eager_equal(lambda: Built(init), include_buffers)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialize_inside_a_dispatch_mode_replays_without_it(include_buffers):
    # the old code replayed through the caller's mode: every matmul doubled
    ref = build_eagerly(lambda: Built(_matmul_param))
    model = build_empty(lambda: Built(_matmul_param), include_buffers)
    with _Doubling():
        materialize_exactly(model, ref)


# -- deterministic algorithms: torch fills uninitialised memory -------------------------

_UNINITIALISED: dict[str, Callable[[], torch.Tensor]] = {
    "empty": lambda: torch.empty(2, 3),
    "empty_like": lambda: torch.empty_like(torch.zeros(2, 3, dtype=torch.int32)),
    "empty_strided": lambda: torch.empty_strided((2, 3), (1, 2), dtype=torch.float16),
    "empty_permuted": lambda: torch.empty_permuted((2, 3), (1, 0), dtype=torch.complex64),
    "new_empty": lambda: torch.zeros(1, dtype=torch.bfloat16).new_empty(2, 3),
    "new_empty_strided": lambda: torch.zeros(1, dtype=torch.int64).new_empty_strided(
        (2, 3), (3, 1)
    ),
}


@contextmanager
def _filling() -> Iterator[None]:
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


def test_every_uninitialised_factory_is_listed():
    from metamode._core.facts import UNINITIALISED_FACTORY_NAMES

    assert sorted(_UNINITIALISED) == sorted(UNINITIALISED_FACTORY_NAMES)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("factory", sorted(_UNINITIALISED))
def test_uninitialised_memory_torch_filled_in_the_build_is_filled_by_materialize(
    factory, include_buffers
):
    def init(m: nn.Module) -> None:
        with _filling():
            m.filled = nn.Parameter(_UNINITIALISED[factory](), requires_grad=False)
            m.register_buffer("also", _UNINITIALISED[factory]())

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    materialize_exactly(model)  # outside deterministic mode: the fill is the build's
    for name in ("filled", "also"):
        got, want = getattr(model, name), getattr(ref, name)
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
        bits = got.contiguous().view(torch.uint8)
        assert torch.equal(bits, want.contiguous().view(torch.uint8)), name


# -- process-wide settings: kept by the recording, compared at materialize ----------------


# setting -> (set it, the value the build runs under, another value)
def _attribute(owner: object, name: str) -> tuple[Callable[[], object], Callable[[object], None]]:
    return lambda: getattr(owner, name), lambda value: setattr(owner, name, value)


_MKLDNN = torch.backends.mkldnn
# setting -> (its getter, its setter, a value to build under, another)
_SETTINGS: dict[str, tuple[Callable[[], object], Callable[[object], None], object, object]] = {
    "float32_matmul_precision": (
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
        "medium",
        "highest",
    ),
    "float32_conv_precision": (*_attribute(_MKLDNN.conv, "fp32_precision"), "bf16", "ieee"),
    "float32_rnn_precision": (*_attribute(_MKLDNN.rnn, "fp32_precision"), "bf16", "ieee"),
    "intra_op_threads": (torch.get_num_threads, torch.set_num_threads, 1, 2),
    "mkldnn": (*_attribute(_MKLDNN, "enabled"), False, True),
    "mkldnn_deterministic": (*_attribute(_MKLDNN, "deterministic"), True, False),
    "nnpack": (torch._C._get_nnpack_enabled, torch.backends.nnpack.set_flags, False, True),
}


@contextmanager
def _setting(name: str, value: object) -> Iterator[None]:
    get, set_, _, _ = _SETTINGS[name]
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def _computed(m: nn.Module) -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    m.register_buffer("product", a @ b)
    m.w = nn.Parameter(torch.randn(4096).sum().expand(2).clone())


def _computed_names(include_buffers: bool) -> tuple[str, ...]:
    """What ``_computed`` leaves on meta (params-only keeps its real buffer)."""
    return ("product", "w") if include_buffers else ("w",)


def test_every_process_setting_has_a_row():
    from metamode._core.recording.settings import ProcessSettings

    assert sorted(_SETTINGS) == sorted(ProcessSettings._fields)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", sorted(_SETTINGS))
def test_a_process_setting_that_differs_at_materialize_refuses_computed_values(
    name, include_buffers
):
    _, _, build_value, other = _SETTINGS[name]
    with _setting(name, build_value):
        ref = build_eagerly(lambda: Built(_computed))
        model = build_empty(lambda: Built(_computed), include_buffers)
    with _setting(name, other):
        assert_refused(model, *_computed_names(include_buffers), because=name)
    with _setting(name, build_value):
        materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", sorted(_SETTINGS))
def test_a_process_setting_does_not_refuse_values_that_do_not_depend_on_it(name, include_buffers):
    _, _, build_value, other = _SETTINGS[name]

    def made(m: nn.Module) -> None:
        m.fc = nn.Linear(8, 8)
        m.register_buffer("ids", torch.arange(8))

    ref = build_eagerly(lambda: Built(made))
    with _setting(name, build_value):
        model = build_empty(lambda: Built(made), include_buffers)
    with _setting(name, other):
        materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_process_setting_changed_and_restored_during_the_build(include_buffers):
    def changes(m: nn.Module) -> None:
        with _setting("float32_matmul_precision", "medium"):
            _computed(m)

    ref = build_eagerly(lambda: Built(changes))
    model = build_empty(lambda: Built(changes), include_buffers)
    assert_refused(model, *_computed_names(include_buffers), because="matmul_precision")
    with _setting("float32_matmul_precision", "medium"):
        materialize_exactly(model, ref)


# -- grad mode in the build ----------------------------------------------------------------
# Some CPU kernels choose their implementation by grad mode (LSTM's oneDNN kernel runs only
# without grad), so each call is replayed under the grad mode it ran under.


def test_lstm_takes_another_kernel_under_grad_mode():
    torch.manual_seed(0)
    lstm, x = nn.LSTM(4, 5), torch.ones(3, 1, 4)
    weights = [w.detach() for w in lstm._flat_weights]
    hx = (torch.zeros(1, 1, 5), torch.zeros(1, 1, 5))
    runs = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            runs.append(torch.lstm(x, hx, weights, True, 1, 0.0, True, False, False)[1])
    assert not torch.equal(*runs)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_forward_replays_under_the_grad_mode_it_ran_under(grad, include_buffers):
    def probed(m: nn.Module) -> None:
        m.lstm = nn.LSTM(4, 5)
        with torch.set_grad_enabled(grad):
            _, (h, _) = m.lstm(torch.ones(3, 1, 4, device=m.lstm.weight_ih_l0.device))
        m.register_buffer("probe_h", h.detach())

    ref = build_eagerly(lambda: Built(probed))
    model = build_empty(lambda: Built(probed), include_buffers)
    with torch.set_grad_enabled(not grad):  # the caller's mode does not matter
        materialize_exactly(model, ref)


# -- inference mode in the build ---------------------------------------------------------
# A call under torch.inference_mode() makes inference tensors; eager's are, so replay runs
# it under inference mode too. An inference tensor has no version counter: one that a call
# under inference mode takes as an argument may have been written there unseen.


def _inference_factories(m: nn.Module) -> None:
    with torch.inference_mode():
        m.register_buffer("ones", torch.ones(2, 3))
        m.register_buffer("drawn", torch.randn(4))
        m.w = nn.Parameter(torch.full((3,), 2.0))
        m.frozen = nn.Parameter(torch.rand(2), requires_grad=False)


def _inference_computed(m: nn.Module) -> None:
    x, w = torch.arange(4.0), torch.randn(3)
    with torch.inference_mode():
        m.register_buffer("table", torch.outer(x, w))
        m.register_buffer("halved", x.to(torch.float16))
        m.w = nn.Parameter(x.exp())


def _inference_after_a_skipped_init(m: nn.Module) -> None:
    m.lin = nn.Linear(3, 3)  # params-only: its draws are skipped, the real stream shifts
    with torch.inference_mode():
        m.register_buffer("noise", torch.randn(3))


def _inference_chain(m: nn.Module) -> None:
    """Out-of-place calls taking inference tensors: torch's schemas say they write none."""
    with torch.inference_mode():
        m.register_buffer("b", torch.arange(4).to(torch.float32))  # takes an inference tensor
        m.w = nn.Parameter(torch.arange(3.0).exp())


INFERENCE_EXACT = {
    "factories": _inference_factories,
    "computed from ordinary tensors": _inference_computed,
    "drawn after a skipped init": _inference_after_a_skipped_init,
    "a chain of out-of-place calls": _inference_chain,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("build", sorted(INFERENCE_EXACT))
def test_tensors_made_under_inference_mode_are_eagers_inference_tensors(build, include_buffers):
    model = assert_eager_equal(lambda: Built(INFERENCE_EXACT[build]), include_buffers)
    assert any(t.is_inference() for t in tensors(model).values())
    assert not model.after.weight.is_inference()


def _inference_written_in_place(m: nn.Module) -> None:
    with torch.inference_mode():
        t = torch.zeros(3)
        t.add_(1.0)
        t[0] = 5.0
        m.register_buffer("b", t)
    m.w = nn.Parameter(t * 2)  # an ordinary tensor computed from a written inference one


INFERENCE_REFUSED = {"written in place": _inference_written_in_place}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("build", sorted(INFERENCE_REFUSED))
def test_inference_tensors_taken_by_calls_under_inference_mode_are_refused(build, include_buffers):
    """Refused where meta (the parameter; the buffer with ``include_buffers``); a real buffer
    the build computed is eager's and kept."""
    init = INFERENCE_REFUSED[build]
    model = build_empty(lambda: Built(init), include_buffers)
    names = ("w", "b") if include_buffers else ("w",)
    assert_refused(model, *names, because=r"inference tensor that a torch call under")
    if not include_buffers:
        ref = build_eagerly(lambda: Built(init))
        assert model.b.is_inference() and torch.equal(model.b, ref.b)


# -- flush-denormal: the CPU's flags, set per thread -------------------------------------


def _subnormal_products(m: nn.Module) -> None:
    m.register_buffer("product", torch.full((3,), 1e-30) * 1e-10)  # subnormal unless flushed
    m.w = nn.Parameter(torch.full((2,), 1e-39) + torch.zeros(2))


def _flush_switched_in_the_build(m: nn.Module) -> None:
    with flushing():
        _subnormal_products(m)
    m.register_buffer("kept", torch.full((3,), 1e-30) * 1e-10)


def _flush_in_the_whole_build(m: nn.Module) -> None:
    with flushing():
        _subnormal_products(m)
        m.scaled = nn.Parameter(torch.randn(4, 4) * 1e-310)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_build_flushing_denormals_is_exact_only_where_the_thread_flushes_them(
    include_buffers,
):
    """Materialize never sets the flags (the intra-op workers a thread starts keep the flags
    it had then): where the thread keeps denormals, the build's values are refused, naming
    the setting, and nothing changes."""
    ref = build_eagerly(lambda: _Only(_flush_in_the_whole_build))
    model = build_empty(lambda: _Only(_flush_in_the_whole_build), include_buffers)
    assert ref.w.eq(0).all() and ref.product.eq(0).all()  # eager flushed them
    meta = [name for name, tensor in tensors(model).items() if tensor.is_meta]
    assert_refused(model, *meta, because=r"flushed \(torch.set_flush_denormal\(True\)\)")
    with flushing():
        materialize_exactly(model, ref)


class _Only(nn.Module):
    def __init__(self, init) -> None:
        super().__init__()
        init(self)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("at_materialize", [False, True], ids=["kept", "flushed"])
def test_a_build_that_switched_flush_denormal_refuses_what_the_thread_computes_otherwise(
    at_materialize, include_buffers
):
    ref = build_eagerly(lambda: Built(_flush_switched_in_the_build))
    model = build_empty(lambda: Built(_flush_switched_in_the_build), include_buffers)
    assert ref.product.eq(0).all() and ref.kept.ne(0).all()
    flushed = {"w", "product"}
    meta = {name for name, tensor in tensors(model).items() if tensor.is_meta}
    other = meta - flushed if at_materialize else meta & flushed
    with flushing(at_materialize):
        assert_refused(model, *sorted(other), because="set_flush_denormal")
        for name in meta - other:
            assert metamode.is_materializable(tensors(model)[name]), name
    assert all(tensors(model)[name].is_meta for name in meta)  # nothing changed


def test_a_build_in_a_thread_that_inherited_flush_denormal():
    """A thread started while its parent flushes denormals flushes them too (the CPU's flags
    are copied into a new thread): its build is refused where they are kept, and exact
    where they are flushed."""
    results: dict[str, nn.Module] = {}

    def build() -> None:
        results["ref"] = build_eagerly(lambda: Built(_subnormal_products))
        results["model"] = build_empty(lambda: Built(_subnormal_products), True)

    with flushing():
        thread = threading.Thread(target=build)
        thread.start()
        thread.join()
    assert results["ref"].product.eq(0).all()
    assert_refused(results["model"], "product", "w", because="subnormal floats flushed")
    with flushing():
        metamode.materialize(results["model"])
    assert_same_tensors(results["model"], results["ref"])
