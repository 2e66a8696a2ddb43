"""A break-it pass on torch calls that do not go through the usual Python API surface, and on
forward passes run during construction.

Checked, each against eager construction under the same seed (bitwise, with
``materialize`` leaving the default generator as it was), in both ``include_buffers`` modes
where eager and the build both run:

- ``torch.ops.aten.<op>.<overload>`` and ``torch.ops.aten.<op>`` called directly: random
  inits, ``out=`` overloads, in-place overloads on views, ``index_put_`` / ``scatter_``;
- custom ops (``torch.library.custom_op`` with and without ``mutates_args``, one lying about
  it, ``torch.library.Library`` with CPU and Meta kernels, one drawing random numbers in its
  CPU kernel, one named like an aten random op);
- TorchScript: scripted and traced functions and modules made or called in the build;
- ``torch.autograd.Function`` (in-place and random forwards), ``torch.autograd.grad``,
  ``torch.func.functional_call``, ``torch.vmap`` / ``jvp`` / ``grad``, grad modes;
- forward passes in ``__init__`` (timm-style feature probes through Dropout, BatchNorm in
  training mode, ``nn.MultiheadAttention``, ``TransformerEncoderLayer``,
  ``scaled_dot_product_attention``, ``nn.LSTM`` / ``nn.GRU``) and parametrizations
  (``spectral_norm``, ``weight_norm``, ``orthogonal``) registered in the build;
- tensors from ``torch.from_dlpack``, ``torch.frombuffer``, ``Tensor._make_subclass``,
  ``new_empty`` / ``new_zeros`` / ``new_tensor``, ``empty_strided``, ``as_strided_``.

Each case is exact, or refused upfront (``is_materializable`` agreeing, nothing changed) with
a reason naming the cause. A case where materialize breaks that promise today (silently
wrong, an exact idiom refused or refused for a wrong reason, a crash) is a strict xfail
saying what happens.

Not tested, since the build itself cannot run there whatever metamode does: a custom op
without a Meta kernel or fake impl on meta tensors; ``torch.from_dlpack`` of a meta tensor
(DLPack has no meta device); ``torch.jit.trace`` of a module, or a forward through BatchNorm /
MultiheadAttention / LSTM, with a CPU input and meta parameters (``include_buffers=False``);
``Tensor.set_`` of a meta parameter to a CPU storage; the square ``orthogonal``
parametrization (its ``.item()`` on meta is covered by test_materialize_idioms.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    EXACT,
    MODES,
    REFUSED,
    Built,
    Outcome,
    assert_refused,
    broken,
    build_eagerly,
    build_empty,
    check_idiom,
    idiom_cases,
    materialize_exactly,
    warm_pickling,
)

warm_pickling()

aten = torch.ops.aten

_NO_GENERATOR = "takes no generator="
_UNSEEN_WRITE = "written by code metamode did not record"
_UNSEEN_DRAW = "drawn from .*by code metamode did not record"


def _xfail(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=reason)


# -- custom ops, defined once for the module ---------------------------------------------

_LIB = torch.library.Library("metamode_test_beyond", "DEF")
_LIB.define("twice(Tensor x) -> Tensor")
_LIB.define("random_init_(Tensor(a!) x) -> ()")


def _twice_cpu(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _twice_meta(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _random_init_cpu(x: torch.Tensor) -> None:
    with torch.no_grad():
        x.normal_()


def _random_init_meta(x: torch.Tensor) -> None:
    return None


_LIB.impl("twice", _twice_cpu, "CPU")
_LIB.impl("twice", _twice_meta, "Meta")
_LIB.impl("random_init_", _random_init_cpu, "CPU")
_LIB.impl("random_init_", _random_init_meta, "Meta")


@torch.library.custom_op("metamode_test_beyond::scale", mutates_args=())
def _scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


@_scale.register_fake
def _(x: torch.Tensor, s: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("metamode_test_beyond::arange_fill_", mutates_args=("x",))
def _arange_fill_(x: torch.Tensor) -> None:
    x.copy_(torch.arange(x.numel(), dtype=x.dtype).view_as(x))


@_arange_fill_.register_fake
def _(x: torch.Tensor) -> None:
    return None


@torch.library.custom_op("metamode_test_beyond::adds_one_unsaid", mutates_args=())
def _adds_one_unsaid(x: torch.Tensor) -> torch.Tensor:
    x.add_(1.0)  # a write ``mutates_args=()`` does not declare
    return x.clone()


@_adds_one_unsaid.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("metamode_test_beyond::noisy", mutates_args=())
def _noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand(x.shape)  # draws from the default generator in its CPU kernel


@_noisy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("metamode_test_beyond::noisy_", mutates_args=("x",))
def _noisy_(x: torch.Tensor) -> None:
    x.copy_(torch.rand(x.shape))


@_noisy_.register_fake
def _(x: torch.Tensor) -> None:
    return None


@torch.library.custom_op("metamode_test_beyond::normal_", mutates_args=("x",))
def _not_random_normal_(x: torch.Tensor) -> None:
    """Named like ``aten::normal_``; draws nothing."""
    x.copy_(torch.arange(x.numel(), dtype=x.dtype).view_as(x))


@_not_random_normal_.register_fake
def _(x: torch.Tensor) -> None:
    return None


# -- TorchScript helpers -------------------------------------------------------------------


@torch.jit.script
def _scripted_fill(w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        w.fill_(0.25)
        w[0] = 3.0
    return w


@torch.jit.script
def _scripted_normal(w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        w.normal_(0.0, 0.02)
    return w


@torch.jit.script
def _scripted_uniform(w: torch.Tensor) -> torch.Tensor:
    return w.uniform_(-1.0, 1.0)


@torch.jit.script
def _scripted_rand(n: int) -> torch.Tensor:
    return torch.rand(n)


@torch.jit.script
def _scripted_table(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 2.0


@torch.jit.script
def _scripted_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


class _Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


# == 1. torch.ops.aten called directly ======================================================


def _aten_packet_inits(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(3, 4))
    with torch.no_grad():
        aten.uniform_(m.w, -1.0, 1.0)
    m.register_buffer("b", aten.rand([5]))


def _aten_bernoulli(m: nn.Module) -> None:
    mask = torch.empty(6)
    aten.bernoulli_.float(mask, 0.3)
    m.register_buffer("mask", mask)
    m.w = nn.Parameter(torch.empty(2, 2))
    with torch.no_grad():
        aten.bernoulli_.float(m.w, 0.5)


def _aten_fill_copy_mul(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(3, 4))
    with torch.no_grad():
        aten.fill_.Scalar(m.w, 0.5)
        aten.copy_.default(m.w[0], torch.arange(4.0))
    m.register_buffer("b", aten.mul.Tensor(torch.arange(4.0), 3.0))


def _aten_out_overloads(m: nn.Module) -> None:
    b = torch.empty(4)
    aten.mul.out(torch.arange(4.0), torch.full((4,), 2.0), out=b)
    m.register_buffer("b", b)
    m.w = nn.Parameter(torch.zeros(2, 5))
    with torch.no_grad():
        aten.normal.float_float_out(0.0, 1.0, [5], out=m.w[1])
        aten.add.out(m.w[0], aten.ones_like.default(m.w[0]), out=m.w[0])


def _aten_in_place_on_views(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.zeros(4, 4))
    with torch.no_grad():
        aten.normal_.default(aten.slice.Tensor(m.w, 0, 1, 3))
        aten.fill_.Scalar(aten.diagonal.default(m.w), 7.0)
        aten.uniform_.default(aten.t.default(m.w)[0], 0, 1)


def _aten_index_put_scatter(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.zeros(4, 4))
    with torch.no_grad():
        aten.index_put_.default(m.w, [torch.tensor([0, 2])], torch.randn(2, 4))
        aten.scatter_.value(m.w, 1, torch.tensor([[1], [2], [3], [0]]), 9.0)
    b = torch.zeros(3, 5)
    aten.scatter_.src(b, 0, torch.tensor([[0, 1, 2, 0, 0]]), torch.randn(1, 5))
    m.register_buffer("b", b)
    m.register_buffer(
        "ip", aten.index_put.default(torch.zeros(5), [torch.tensor([1, 3])], torch.rand(2))
    )


def _aten_generator_overloads(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(5)
    m.w = nn.Parameter(torch.empty(3, 4))
    with torch.no_grad():
        aten.normal_.default(m.w, 0.0, 1.0, generator=g)
    m.register_buffer("b", aten.randn.generator([3], generator=g))


def _aten_linear_init(m: nn.Module) -> None:
    m.lin = nn.Linear(3, 3)
    with torch.no_grad():
        aten.normal_.default(m.lin.weight, 0.0, 0.02)
        aten.zero_.default(m.lin.bias)
        aten.add_.Tensor(m.lin.bias, aten.ones_like.default(m.lin.bias), alpha=2)


def _aten_dropout_p0(m: nn.Module) -> None:
    m.register_buffer("d", aten.dropout.default(torch.ones(8), 0.0, True))


def _aten_random_without_generator(m: nn.Module) -> None:
    """``aten.randperm`` / ``randint.low`` / ``randn.out`` / ``native_dropout``: overloads
    whose schema has no ``generator``; drawn for real they are eager's, on meta refused."""
    m.register_buffer("p", aten.randperm.default(7))
    m.register_buffer("i", aten.randint.low(0, 10, [4]))
    r = torch.empty(5)
    aten.randn.out([5], out=r)
    m.register_buffer("r", r)
    m.register_buffer("d", aten.native_dropout.default(torch.ones(8), 0.5, True)[0])


def _aten_randn_after_a_skipped_draw(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(3, 4))
    with torch.no_grad():
        aten.normal_.default(m.w, 0.0, 0.02)
    m.register_buffer("b", aten.randn.default([5]))


# == 2. custom ops ==========================================================================


def _custom_op_pure(m: nn.Module) -> None:
    m.register_buffer("b", torch.ops.metamode_test_beyond.scale(torch.arange(4.0), 3.0))
    m.w = nn.Parameter(_scale(torch.randn(3), 2.0))


def _custom_op_mutating(m: nn.Module) -> None:
    b = torch.zeros(2, 3)
    torch.ops.metamode_test_beyond.arange_fill_(b)
    m.register_buffer("b", b)
    m.w = nn.Parameter(torch.empty(4))
    with torch.no_grad():
        _arange_fill_(m.w)


def _custom_op_unsaid_mutation(m: nn.Module) -> None:
    b = torch.zeros(3)
    m.register_buffer("c", _adds_one_unsaid(b))
    m.register_buffer("b", b)
    m.w = nn.Parameter(torch.zeros(3))
    with torch.no_grad():
        m.register_buffer("d", _adds_one_unsaid(m.w))


def _library_cpu_and_meta(m: nn.Module) -> None:
    m.register_buffer("b", torch.ops.metamode_test_beyond.twice(torch.arange(3.0)))
    m.w = nn.Parameter(torch.ops.metamode_test_beyond.twice.default(torch.ones(2)))


def _library_random_kernel_into_a_real_buffer(m: nn.Module) -> None:
    b = torch.empty(4)
    torch.ops.metamode_test_beyond.random_init_(b)
    m.register_buffer("b", b)


def _custom_op_random_kernel(m: nn.Module) -> None:
    m.register_buffer("b", _noisy(torch.zeros(4)))
    m.w = nn.Parameter(_noisy(torch.zeros(3)))


def _custom_op_random_kernel_in_place(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.zeros(4))
    with torch.no_grad():
        torch.ops.metamode_test_beyond.noisy_(m.w)
    b = torch.zeros(4)
    _noisy_(b)
    m.register_buffer("b", b)


def _library_random_kernel_on_meta(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(4))
    torch.ops.metamode_test_beyond.random_init_(m.w)
    m.v = nn.Parameter(torch.randn(2))


def _custom_op_draws_unused_then_randn(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(3))
    nn.init.normal_(m.w)
    _noisy(torch.zeros(4))  # its draws advance eager's stream; its value is thrown away
    m.v = nn.Parameter(torch.randn(3))


def _custom_op_named_like_aten_random(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.zeros(4))
    with torch.no_grad():
        torch.ops.metamode_test_beyond.normal_(m.w)  # the packet, not the overload


def _custom_op_overload_named_like_aten_random(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.zeros(4))
    with torch.no_grad():
        torch.ops.metamode_test_beyond.normal_.default(m.w)
    m.v = nn.Parameter(torch.randn(3))


# == 3. TorchScript =========================================================================


def _scripted_fill_param(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(3, 4))
    _scripted_fill(m.w)


def _scripted_normal_param(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(3, 4))
    _scripted_normal(m.w)
    m.v = nn.Parameter(torch.randn(3))


def _scripted_factories(m: nn.Module) -> None:
    m.register_buffer("t", _scripted_table(5))
    m.w = nn.Parameter(_scripted_table(3))
    m.register_buffer("r", _scripted_rand(5))
    m.u = nn.Parameter(_scripted_rand(4))


def _scripted_rand_after_a_skipped_draw(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(3))
    nn.init.normal_(m.w)
    _scripted_rand(4)
    m.v = nn.Parameter(torch.randn(3))


def _scripted_rand_last(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(3))
    nn.init.normal_(m.w)
    m.register_buffer("t", _scripted_rand(5))


def _scripted_function_on_build_tensors(m: nn.Module) -> None:
    m.register_buffer("b", _scripted_double(torch.arange(3.0)))
    m.w = nn.Parameter(_scripted_double(torch.ones(2)))


_TRACED = torch.jit.trace(lambda x: x * 2 + 1, torch.ones(3))


def _traced_function_on_build_tensors(m: nn.Module) -> None:
    m.register_buffer("b", _TRACED(torch.arange(3.0)))


def _trace_in_the_build_unused(m: nn.Module) -> None:
    torch.jit.trace(lambda x: x * 2 + 1, torch.ones(3))
    m.register_buffer("b", torch.arange(3.0) + 1)
    m.w = nn.Parameter(torch.randn(3))


def _scripted_module(m: nn.Module) -> None:
    m.sub = torch.jit.script(_Sub())


def _traced_module(m: nn.Module) -> None:
    m.sub = torch.jit.trace(_Sub(), torch.ones(1, 3))


# == 4. autograd.Function, torch.func, grad modes ===========================================


class _InPlaceAffine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2.0).add_(1.0)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _NoisyForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + torch.randn_like(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        return x * s

    @staticmethod
    def backward(ctx, g):
        return g, None


def _function_random_forward(m: nn.Module) -> None:
    m.register_buffer("b", _NoisyForward.apply(torch.zeros(4)))
    x = torch.zeros(3, requires_grad=True)
    m.w = nn.Parameter(_NoisyForward.apply(x).detach())


def _function_of_a_parameter(m: nn.Module) -> None:
    m.lin = nn.Linear(3, 3)
    with torch.no_grad():
        m.register_buffer("b", _Scale.apply(m.lin.weight, 2.0).clone())
    with torch.enable_grad():
        m.register_buffer("c", _Scale.apply(m.lin.weight, 3.0).detach())


def _function_in_place_buffer(m: nn.Module) -> None:
    b = torch.arange(4.0)
    _InPlaceAffine.apply(b)
    m.register_buffer("b", b)


def _function_in_place_param(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.ones(4))
    with torch.no_grad():
        _InPlaceAffine.apply(m.w)


def _functional_call_other_params(m: nn.Module) -> None:
    m.lin = nn.Linear(3, 3)
    params = {"weight": torch.randn(3, 3), "bias": torch.zeros(3)}
    m.register_buffer("probe", torch.func.functional_call(m.lin, params, (torch.ones(1, 3),)))


def _grad_modes(m: nn.Module) -> None:
    m.lin = nn.Linear(3, 3)
    with torch.no_grad():
        with torch.enable_grad():
            y = m.lin.weight * 2
        m.register_buffer("b", y.detach() + 1)
    with torch.enable_grad():
        z = (m.lin.weight**2).sum()
    m.register_buffer("s", z.detach().reshape(1))


def _autograd_grad_of_a_leaf(m: nn.Module) -> None:
    x = torch.arange(3.0, requires_grad=True)
    (g,) = torch.autograd.grad((x * x).sum(), x)
    m.register_buffer("g", g)


def _autograd_grad_of_a_parameter(m: nn.Module) -> None:
    m.lin = nn.Linear(3, 3)
    with torch.enable_grad():
        w = m.lin.weight
        (g,) = torch.autograd.grad((w * w).sum(), w)
    m.register_buffer("g", g)


def _vmap_init(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.vmap(lambda r: r * torch.arange(3.0))(torch.arange(4.0)))


def _vmap_in_place_init(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(4, 3))
    with torch.no_grad():
        torch.vmap(lambda row: row.fill_(2.0))(m.w)


def _jvp_buffer(m: nn.Module) -> None:
    m.register_buffer("j", torch.func.jvp(torch.sin, (torch.arange(3.0),), (torch.ones(3),))[1])


def _func_grad_buffer(m: nn.Module) -> None:
    m.register_buffer("g", torch.func.grad(lambda x: (x**3).sum())(torch.arange(3.0)))


# == 5. forward passes during construction =================================================


class _Probed(nn.Module):
    """timm-style: run ``features`` on a dummy input under ``no_grad`` to size the head, and
    keep part of the probe's output."""

    def __init__(self, p: float = 0.0, training: bool = True, bn: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4) if bn else nn.Identity()
        self.drop = nn.Dropout(p)
        self.train(training)
        with torch.no_grad():
            out = self.features(torch.zeros(1, 3, 8, 8))
        self.head = nn.Linear(out.shape[1], 2)
        self.register_buffer("probe_out", out.flatten()[:4].clone())

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(self.conv(x))).mean((2, 3))


def _probe_dropout_p0(m: nn.Module) -> None:
    m.net = _Probed(0.0)


def _probe_dropout_eval(m: nn.Module) -> None:
    m.net = _Probed(0.5, training=False)


def _probe_batchnorm_train(m: nn.Module) -> None:
    m.net = _Probed(0.0, bn=True)


def _probe_dropout_train(m: nn.Module) -> None:
    m.net = _Probed(0.5)


def _probe_dropout_train_shape_only(m: nn.Module) -> None:
    m.conv = nn.Conv2d(3, 4, 3)
    m.drop = nn.Dropout(0.5)
    with torch.no_grad():
        out = m.drop(m.conv(torch.zeros(1, 3, 8, 8)))
    m.head = nn.Linear(out.numel(), 2)


def _probe_mha_train_dropout(m: nn.Module) -> None:
    m.attn = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)
    x = torch.ones(1, 3, 8)
    with torch.no_grad():
        out, _ = m.attn(x, x, x)
    m.head = nn.Linear(out.shape[-1], 2)


def _probe_mha_train_no_dropout(m: nn.Module) -> None:
    m.attn = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.arange(24.0).reshape(1, 3, 8) / 24
    with torch.no_grad():
        out, _ = m.attn(x, x, x)
    m.register_buffer("probe_out", out)


def _probe_mha_eval(m: nn.Module) -> None:
    m.attn = nn.MultiheadAttention(64, 4, batch_first=True).eval()
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        out, weights = m.attn(x, x, x)
    m.register_buffer("probe_out", out.contiguous())
    m.register_buffer("probe_w", weights)


def _probe_encoder_layer_eval(m: nn.Module) -> None:
    m.enc = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.1).eval()
    with torch.no_grad():
        m.register_buffer("probe_out", m.enc(torch.randn(2, 5, 32)).contiguous())


def _sdpa_with_dropout(m: nn.Module) -> None:
    q = torch.randn(1, 2, 4, 8)
    m.register_buffer("att", F.scaled_dot_product_attention(q, q, q, dropout_p=0.2))


def _sdpa_causal_of_a_linear(m: nn.Module) -> None:
    m.lin = nn.Linear(8, 8)
    q = m.lin(torch.ones(1, 2, 4, 8))
    m.register_buffer("att", F.scaled_dot_product_attention(q, q, q, is_causal=True).detach())


def _probe_lstm_train_dropout(m: nn.Module) -> None:
    m.lstm = nn.LSTM(4, 5, num_layers=2, dropout=0.3)
    with torch.no_grad():
        out, (h, _) = m.lstm(torch.ones(3, 1, 4))
    m.register_buffer("probe_h", h)
    m.head = nn.Linear(out.shape[-1], 2)


def _probe_lstm_eval(m: nn.Module) -> None:
    m.lstm = nn.LSTM(4, 5, num_layers=2, dropout=0.3).eval()
    with torch.no_grad():
        _, (h, _) = m.lstm(torch.ones(3, 1, 4))
    m.register_buffer("probe_h", h)


def _probe_gru_no_dropout(m: nn.Module) -> None:
    m.gru = nn.GRU(4, 5, batch_first=True, bidirectional=True)
    with torch.no_grad():
        out, h = m.gru(torch.ones(1, 3, 4))
    m.register_buffer("probe_h", h)
    m.head = nn.Linear(out.shape[-1], 2)


def _spectral_norm_power_iterations(m: nn.Module) -> None:
    m.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(5, 4), n_power_iterations=3)
    with torch.no_grad():
        m.register_buffer("w_eff", m.lin.weight.clone())


def _spectral_norm_forward(m: nn.Module) -> None:
    m.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(5, 4))
    with torch.no_grad():
        m.register_buffer("y", m.lin(torch.ones(1, 5)))


def _weight_norm_forward(m: nn.Module) -> None:
    m.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(3, 4, 3))
    with torch.no_grad():
        m.register_buffer("y", m.conv(torch.ones(1, 3, 5)))


def _old_spectral_norm_forward(m: nn.Module) -> None:
    m.conv = nn.utils.spectral_norm(nn.Conv2d(3, 4, 3))
    with torch.no_grad():
        m.register_buffer("y", m.conv(torch.ones(1, 3, 5, 5)))


def _orthogonal_householder(m: nn.Module) -> None:
    m.lin = nn.utils.parametrizations.orthogonal(nn.Linear(5, 3), orthogonal_map="householder")


# == 6. tensors made around the usual factories =============================================


class _MyParam(nn.Parameter):
    pass


class _Tagged(torch.Tensor):
    pass


def _from_dlpack_real(m: nn.Module) -> None:
    m.register_buffer("a", torch.from_dlpack(np.arange(4, dtype=np.float32)) * 2)
    m.w = nn.Parameter(torch.from_dlpack(np.ones(3, dtype=np.float32)).clone())


def _from_dlpack_of_a_build_tensor(m: nn.Module) -> None:
    m.register_buffer("b", torch.from_dlpack(torch.arange(4.0)) + 1)
    m.w = nn.Parameter(torch.from_dlpack(torch.randn(3)).clone())


def _frombuffer(m: nn.Module) -> None:
    data = bytearray(np.arange(4, dtype=np.float32).tobytes())
    m.register_buffer("b", torch.frombuffer(data, dtype=torch.float32) * 3)
    m.w = nn.Parameter(torch.frombuffer(bytearray(data), dtype=torch.float32).clone())


def _make_subclass(m: nn.Module) -> None:
    m.w = torch.Tensor._make_subclass(_MyParam, torch.randn(3, 2), True)
    m.register_buffer("b", torch.Tensor._make_subclass(_Tagged, torch.arange(3.0), False))
    m.lin = nn.Linear(2, 2)
    m.alias = torch.Tensor._make_subclass(_MyParam, m.lin.weight.detach(), True)
    with torch.no_grad():
        m.alias.mul_(2.0)


def _new_factories(m: nn.Module) -> None:
    m.lin = nn.Linear(3, 4)
    w = m.lin.weight
    m.register_buffer("e", w.new_empty(2, 2).fill_(1.5))
    m.register_buffer("z", w.new_zeros(3))
    m.register_buffer("t", w.new_tensor([1.0, 2.0, 3.0]))
    m.register_buffer("o", w.new_ones(2, dtype=torch.float64))
    m.p = nn.Parameter(w.new_empty(5).uniform_(-1, 1))


def _empty_strided_params(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty_strided((3, 4), (1, 3)))
    nn.init.normal_(m.w)
    m.v = nn.Parameter(torch.empty_strided((2, 3), (3, 1)).normal_())


def _as_strided_on_params(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.zeros(12))
    m.v = nn.Parameter(torch.zeros(4, 4))
    with torch.no_grad():
        m.w.as_strided_((3, 4), (4, 1))
        m.w.normal_()
        torch.as_strided(m.v, (4,), (5,)).fill_(1.0)
        m.v.as_strided((2, 2), (4, 1), 10).normal_()
    m.u = nn.Parameter(torch.zeros(12))
    with torch.no_grad():
        aten.as_strided_.default(m.u, [3, 4], [1, 3])
        aten.uniform_.default(m.u)


# == the table ==============================================================================

IDIOMS: dict[str, Callable[[nn.Module], None]] = {
    # 1. aten
    "aten packet uniform_ / rand": _aten_packet_inits,
    "aten bernoulli_.float": _aten_bernoulli,
    "aten fill_.Scalar / copy_.default / mul.Tensor": _aten_fill_copy_mul,
    "aten mul.out / normal.float_float_out / add.out into views": _aten_out_overloads,
    "aten in-place overloads on slice / diagonal / t views": _aten_in_place_on_views,
    "aten index_put_ / scatter_ / index_put": _aten_index_put_scatter,
    "aten overloads with generator=": _aten_generator_overloads,
    "aten normal_ / zero_ / add_ into nn.Linear": _aten_linear_init,
    "aten dropout p=0": _aten_dropout_p0,
    "aten random overloads without generator": _aten_random_without_generator,
    "aten randn.default after a skipped draw": _aten_randn_after_a_skipped_draw,
    # 2. custom ops
    "custom_op pure with register_fake": _custom_op_pure,
    "custom_op mutates_args": _custom_op_mutating,
    "custom_op mutating without saying so": _custom_op_unsaid_mutation,
    "Library DEF with CPU and Meta impls": _library_cpu_and_meta,
    "Library random CPU kernel into a buffer": _library_random_kernel_into_a_real_buffer,
    "custom_op overload named like aten normal_": _custom_op_overload_named_like_aten_random,
    "custom_op random CPU kernel": _custom_op_random_kernel,
    "custom_op random CPU kernel in place": _custom_op_random_kernel_in_place,
    "Library random CPU kernel, no-op Meta kernel": _library_random_kernel_on_meta,
    "custom_op draws, value unused, then randn": _custom_op_draws_unused_then_randn,
    "custom_op packet named like aten normal_": _custom_op_named_like_aten_random,
    # 3. TorchScript
    "scripted fill_ of a parameter": _scripted_fill_param,
    "scripted normal_ of a parameter": _scripted_normal_param,
    "scripted arange / rand factories": _scripted_factories,
    "scripted rand after a skipped draw, then randn": _scripted_rand_after_a_skipped_draw,
    "scripted rand after a skipped draw, last": _scripted_rand_last,
    "scripted function on the build's tensors": _scripted_function_on_build_tensors,
    "traced function on the build's tensors": _traced_function_on_build_tensors,
    "jit.trace in the build, unused": _trace_in_the_build_unused,
    "jit.script of a module in the build": _scripted_module,
    "jit.trace of a module in the build": _traced_module,
    # 4. autograd.Function, torch.func
    "autograd.Function with a random forward": _function_random_forward,
    "autograd.Function of a parameter, no_grad and enable_grad": _function_of_a_parameter,
    "autograd.Function in-place forward on a buffer": _function_in_place_buffer,
    "autograd.Function in-place forward on a parameter": _function_in_place_param,
    "func.functional_call with other params": _functional_call_other_params,
    "no_grad / enable_grad nested": _grad_modes,
    "autograd.grad of a leaf": _autograd_grad_of_a_leaf,
    "autograd.grad of a parameter": _autograd_grad_of_a_parameter,
    "vmap init": _vmap_init,
    "vmap in-place init of a parameter": _vmap_in_place_init,
    "func.jvp buffer": _jvp_buffer,
    "func.grad buffer": _func_grad_buffer,
    # 5. forward passes
    "probe forward, Dropout p=0": _probe_dropout_p0,
    "probe forward, Dropout p=0.5 in eval": _probe_dropout_eval,
    "probe forward, BatchNorm in training": _probe_batchnorm_train,
    "probe forward, Dropout p=0.5 in training": _probe_dropout_train,
    "probe forward shape only, Dropout in training": _probe_dropout_train_shape_only,
    "probe MultiheadAttention dropout in training": _probe_mha_train_dropout,
    "probe MultiheadAttention in training, no dropout": _probe_mha_train_no_dropout,
    "probe MultiheadAttention in eval": _probe_mha_eval,
    "probe TransformerEncoderLayer in eval": _probe_encoder_layer_eval,
    "scaled_dot_product_attention dropout_p": _sdpa_with_dropout,
    "scaled_dot_product_attention causal of a Linear": _sdpa_causal_of_a_linear,
    "probe LSTM in training with dropout": _probe_lstm_train_dropout,
    "probe LSTM in eval": _probe_lstm_eval,
    "probe GRU without dropout": _probe_gru_no_dropout,
    "spectral_norm power iterations at registration": _spectral_norm_power_iterations,
    "spectral_norm parametrization forward": _spectral_norm_forward,
    "weight_norm parametrization forward": _weight_norm_forward,
    "nn.utils.spectral_norm forward": _old_spectral_norm_forward,
    "orthogonal householder 3x5": _orthogonal_householder,
    # 6. tensors
    "from_dlpack of NumPy arrays": _from_dlpack_real,
    "from_dlpack of a build tensor": _from_dlpack_of_a_build_tensor,
    "frombuffer": _frombuffer,
    "Tensor._make_subclass": _make_subclass,
    "new_empty / new_zeros / new_tensor / new_ones": _new_factories,
    "empty_strided parameters": _empty_strided_params,
    "as_strided_ / as_strided / aten.as_strided_ on parameters": _as_strided_on_params,
}

# an operator registered through torch.library: torch does not say whether its kernel draws
_CUSTOM = "registered outside torch"
_MARK_DIRTY = (
    "exact idiom refused for a wrong reason: every write of the forward was recorded, but "
    "ctx.mark_dirty bumps the version counter once more after it, which materialize calls "
    "'written by code metamode did not record'"
)

OUTCOMES: dict[str, dict[bool, Outcome]] = {
    "aten random overloads without generator": {
        False: Outcome(EXACT),
        True: Outcome(REFUSED, _NO_GENERATOR),
    },
    "aten randn.default after a skipped draw": {m: Outcome(REFUSED, _NO_GENERATOR) for m in MODES},
    "custom_op overload named like aten normal_": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "custom_op pure with register_fake": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "custom_op mutates_args": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "custom_op mutating without saying so": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "Library DEF with CPU and Meta impls": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "custom_op random CPU kernel": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "custom_op random CPU kernel in place": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "Library random CPU kernel into a buffer": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "Library random CPU kernel, no-op Meta kernel": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "custom_op draws, value unused, then randn": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "custom_op packet named like aten normal_": {m: Outcome(REFUSED, _CUSTOM) for m in MODES},
    "scripted fill_ of a parameter": {m: Outcome(REFUSED, _UNSEEN_WRITE) for m in MODES},
    "scripted normal_ of a parameter": {
        m: Outcome(REFUSED, "code metamode did not record") for m in MODES
    },
    "scripted rand after a skipped draw, then randn": {
        m: Outcome(REFUSED, _UNSEEN_DRAW) for m in MODES
    },
    "scripted rand after a skipped draw, last": {m: Outcome(REFUSED, _UNSEEN_DRAW) for m in MODES},
    "scripted function on the build's tensors": {
        True: broken(
            "refused for a wrong reason: 'dispatch keys changed ... a TorchDispatchMode or a "
            "functorch transform?' (the Python meta kernels TorchScript's ops reach, run below "
            "autograd), where the cause is TorchScript running ops metamode does not see",
            "TorchScript|jit",
        )
    },
    "traced function on the build's tensors": {
        True: broken(
            "refused for a wrong reason: blames a TorchDispatchMode or functorch transform, "
            "where a traced function ran ops metamode does not see",
            "TorchScript|jit|trace",
        )
    },
    "autograd.Function in-place forward on a buffer": {
        False: Outcome(EXACT),
        True: broken(_MARK_DIRTY),
    },
    "autograd.Function in-place forward on a parameter": {m: broken(_MARK_DIRTY) for m in MODES},
    "autograd.grad of a leaf": {True: Outcome(REFUSED, "computed by torch.autograd.grad")},
    "autograd.grad of a parameter": {
        m: Outcome(REFUSED, "computed by torch.autograd.grad") for m in MODES
    },
    "probe forward, Dropout p=0.5 in training": {m: Outcome(REFUSED, "dropout") for m in MODES},
    "probe forward shape only, Dropout in training": {
        m: Outcome(REFUSED, "dropout") for m in MODES
    },
    "probe MultiheadAttention dropout in training": {
        True: Outcome(REFUSED, "multi_head_attention_forward")
    },
    "probe MultiheadAttention in eval": {True: Outcome(REFUSED, "MultiheadAttention.forward")},
    "probe TransformerEncoderLayer in eval": {
        True: Outcome(REFUSED, "MultiheadAttention.forward|TransformerEncoderLayer.forward")
    },
    "scaled_dot_product_attention dropout_p": {
        False: Outcome(EXACT),
        True: Outcome(REFUSED, "scaled_dot_product_attention draws random numbers"),
    },
    "probe LSTM in training with dropout": {True: Outcome(REFUSED, "lstm draws random numbers")},
    # right_inverse's torch.geqrf has no meta kernel; ParametrizationList catches its
    # NotImplementedError and builds otherwise (no 'base' buffer)
    "orthogonal householder 3x5": {
        m: Outcome(REFUSED, "geqrf raised NotImplementedError") for m in MODES
    },
}

# Idioms the build (or eager construction) cannot run in one mode: left out of that mode.
_SKIPPED = {
    ("jit.trace of a module in the build", False),  # CPU input, meta parameters
    ("probe forward, BatchNorm in training", False),  # CPU input, meta parameters
    ("probe MultiheadAttention dropout in training", False),
    ("probe MultiheadAttention in training, no dropout", False),
    ("probe MultiheadAttention in eval", False),
    ("probe TransformerEncoderLayer in eval", False),
    ("scaled_dot_product_attention causal of a Linear", False),
    ("probe LSTM in training with dropout", False),
    ("probe LSTM in eval", False),
    ("probe GRU without dropout", False),
    ("spectral_norm parametrization forward", False),
    ("from_dlpack of a build tensor", True),  # DLPack has no meta device
}

# run under a functorch transform: every call there is refused by its dispatch keys
_FUNCTORCH_BUILDS = {
    "vmap init",
    "vmap in-place init of a parameter",
    "func.jvp buffer",
    "func.grad buffer",
}

# TorchScript holds these modules' parameters: swap_tensors cannot swap them in place
_SCRIPT_MODULES = {"jit.script of a module in the build", "jit.trace of a module in the build"}


def _cases() -> list:
    cases = []
    for case in idiom_cases(
        {k: v for k, v in IDIOMS.items() if k not in {*_FUNCTORCH_BUILDS, *_SCRIPT_MODULES}},
        OUTCOMES,
    ):
        name, mode, _ = case.values
        if (name, mode) in _SKIPPED:
            continue
        cases.append(case)
    return cases


@pytest.mark.parametrize(("idiom", "include_buffers", "outcome"), _cases())
def test_idioms_beyond_the_python_api_are_exact_or_refused_upfront(idiom, include_buffers, outcome):
    check_idiom(IDIOMS[idiom], include_buffers, outcome)


@pytest.mark.parametrize(
    ("idiom", "include_buffers"),
    [pytest.param(name, mode, id=f"{name}-{mode}") for name in _FUNCTORCH_BUILDS for mode in MODES],
)
def test_functorch_transforms_in_the_build_are_recorded_then_exact_or_refused(
    idiom, include_buffers
):
    """Eager construction runs these; inside the context the build must run too, and
    materialize be exact or refuse naming the transform."""
    ref = build_eagerly(lambda: Built(IDIOMS[idiom]))
    model = build_empty(lambda: Built(IDIOMS[idiom]), include_buffers)
    if metamode.is_materializable(model):
        materialize_exactly(model, ref)
    else:
        assert_refused(model, because="functorch|vmap|transform|autograd")


# == what refused and crashed builds leave behind, and submodules after unseen draws =======


@pytest.mark.parametrize(
    ("idiom", "include_buffers"),
    [
        ("jit.script of a module in the build", False),
        ("jit.script of a module in the build", True),
        ("jit.trace of a module in the build", True),  # params-only: a CPU input, meta weights
    ],
)
def test_a_scripted_module_gets_eagers_values_in_new_parameters(idiom, include_buffers):
    """TorchScript holds the module's parameters, so swap_tensors cannot give them their
    values in place: the module gets new ones with eager's values, and materialize warns."""
    ref = build_eagerly(lambda: Built(IDIOMS[idiom]))
    model = build_empty(lambda: Built(IDIOMS[idiom]), include_buffers)
    with pytest.warns(UserWarning, match="swap_tensors cannot"):
        materialize_exactly(model, ref, replaced=("sub.lin.weight", "sub.lin.bias"))


def _scripted_uniform_then_head(m: nn.Module) -> None:
    m.register_buffer("b", torch.empty(4))
    _scripted_uniform(m.b)  # on meta with include_buffers=True: eager draws 4 numbers here
    m.head = nn.Linear(3, 3)


def _library_random_kernel_then_head(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(4))
    torch.ops.metamode_test_beyond.random_init_(m.w)
    m.head = nn.Linear(3, 3)


@pytest.mark.parametrize(
    ("init", "include_buffers"),
    [
        pytest.param(_scripted_uniform_then_head, False, id="scripted uniform_ real buffer"),
        pytest.param(
            _scripted_uniform_then_head,
            True,
            id="scripted uniform_ meta buffer",
        ),
        pytest.param(
            _library_random_kernel_then_head,
            True,
            id="custom op random kernel on meta",
        ),
    ],
)
def test_a_submodule_built_after_an_unseen_draw_is_exact_or_refused(init, include_buffers):
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    if metamode.is_materializable(model.head):
        materialize_exactly(model.head, ref.head)
    else:
        assert_refused(model.head, "weight", because="draw|wrote a tensor on meta")


def test_a_custom_op_is_refused_naming_its_namespace():
    """Whatever its schema says it mutates, torch does not say whether a custom op's kernel
    draws: what it computes is refused, naming the operator's namespace."""
    model = build_empty(lambda: Built(_custom_op_unsaid_mutation), include_buffers=True)
    assert_refused(model, "c", because="namespace 'metamode_test_beyond'")


# == requires_grad of a call's arguments ======================================================


def test_matmul_takes_another_path_when_its_weight_requires_grad():
    """torch folds a 3-d input's batch dimensions into one matmul only when the weight does
    not require grad (``should_fold``), even under ``no_grad``: the bits differ."""
    torch.manual_seed(0)
    weight, x = torch.randn(128, 64, requires_grad=True), torch.randn(2, 7, 64).transpose(1, 0)
    with torch.no_grad():
        assert not torch.equal(F.linear(x, weight), F.linear(x, weight.detach()))


def _linear_of_a_transposed_probe(m: nn.Module) -> None:
    m.proj = nn.Linear(64, 128)
    x = torch.randn(2, 7, 64, device=m.proj.weight.device)
    with torch.no_grad():
        m.register_buffer("probe", F.linear(x.transpose(1, 0), m.proj.weight))
    m.after = nn.Linear(4, 4)


def _attention(batch_first: bool, grad: bool, cross: bool) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        m.attn = nn.MultiheadAttention(64, 4, batch_first=batch_first).eval()
        x = torch.randn(2, 7, 64, device=m.attn.in_proj_weight.device)
        key = x + 1 if cross else x
        with torch.set_grad_enabled(grad):
            out, _ = m.attn(x, key, key)
        m.register_buffer("probe_out", out.detach().contiguous())

    return init


@pytest.mark.parametrize("include_buffers", [True])
@pytest.mark.parametrize(
    "init",
    [
        pytest.param(_linear_of_a_transposed_probe, id="linear of a transposed input"),
        pytest.param(_attention(True, False, True), id="attention batch_first cross"),
        pytest.param(_attention(True, True, True), id="attention cross, grad enabled"),
        pytest.param(_attention(False, False, True), id="attention cross"),
    ],
)
def test_a_call_replays_with_the_requires_grad_its_arguments_had(init, include_buffers):
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    materialize_exactly(model, ref)
