"""A break-it pass on today's rules of "exact or refused upfront", with idioms real code uses.

What is checked, each against eager construction under the same seed, bitwise, with the
default generator left as it was (or, where refused, ``is_materializable`` saying so first,
``NotMaterializableError`` naming the cause, nothing changed):

1. calls torch tags random that draw nothing for some arguments (``CONDITIONAL_DRAWS``):
   dropout with ``p`` as a tensor or a numpy float, ``functools.partial``, an
   ``nn.Dropout`` subclass, ``inplace=True``, all keywords, ``p=1``, packed sequences, a
   one-layer LSTM with dropout, ``proj_size``, attention, ``rrelu``, each run on the meta
   output of a forward probe with draws after it;
2. operators registered through ``torch.library`` (refused with every later draw) against
   ``torch.ops.aten`` and ``prims`` ops (not refused);
3. writes into meta tensors nobody recorded (``DisableTorchFunction``, TorchScript,
   ``.data`` aliases) against ordinary init idioms that must stay exact;
4. real results of real and meta inputs (params only);
5. grad mode of computing calls, against the opposite mode at materialize time;
6. materialize inside the caller's dispatch modes and functorch transforms, which are back
   and working afterwards;
7. ``.grad`` in the build (backward, ``zero_grad``, optimizers, ``autograd.grad``);
8. containers referencing parameters (``UserDict``, ``UserList``, ``OrderedDict`` reordered,
   a dict subclass whose ``__getitem__`` copies);
9. the old and the new fp32 precision APIs mixed between build and materialize.

A case where metamode breaks the promise is a strict xfail saying what happens: a write
through ``.data`` with torch functions disabled (silently wrong), ``set_`` of a parameter to
itself (refused), and two builds torch itself cannot run with parameters on meta.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils._python_dispatch import TorchDispatchMode

import metamode
from tests.unit.contexts.materialize_checks import (
    EITHER,
    EXACT,
    MODES,
    REFUSED,
    Built,
    Outcome,
    assert_exact_or_refused,
    assert_refused,
    assert_same_tensors,
    broken,
    build_eagerly,
    build_empty,
    check_idiom,
    idiom_cases,
    materialize_exactly,
    warm_pickling,
)

warm_pickling()


@torch.library.custom_op("mmtodaytest::scale", mutates_args=())
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_scale.register_fake
def _(x):
    return torch.empty_like(x)


@torch.jit.script
def _scripted_uniform(w: torch.Tensor) -> torch.Tensor:
    return w.uniform_(-1.0, 1.0)


def _probe(self: nn.Module) -> torch.Tensor:
    """A forward probe: a layer's output on a real input (meta where the layer is)."""
    self.a = nn.Linear(4, 4)
    return self.a(torch.ones(2, 4, device=self.a.weight.device))


def _after(self: nn.Module) -> None:
    """Draws after the idiom: what any draw the idiom did or did not make shifts."""
    self.b = nn.Linear(4, 3)


def _with(idiom: Callable[[nn.Module, torch.Tensor], None]) -> Callable[[nn.Module], None]:
    def init(self: nn.Module) -> None:
        x = _probe(self)
        idiom(self, x)
        _after(self)

    return init


class _Dropout(nn.Dropout):
    """A user's dropout subclass."""

    def forward(self, x):
        return super().forward(x) * 1.0


def _lstm(**kwargs) -> Callable[[nn.Module, torch.Tensor], None]:
    def idiom(self, x):
        self.rnn = nn.LSTM(4, 5, batch_first=True, **kwargs)
        self.rnn(torch.ones(2, 3, 4, device=self.rnn.weight_ih_l0.device))

    return idiom


def _packed(kind: type[nn.RNNBase], **kwargs) -> Callable[[nn.Module, torch.Tensor], None]:
    def idiom(self, x):
        self.rnn = kind(4, 5, batch_first=True, **kwargs)
        inputs = torch.ones(2, 3, 4, device=self.rnn.weight_ih_l0.device)
        seq = pack_padded_sequence(inputs, [3, 2], batch_first=True)
        self.rnn(seq)

    return idiom


def _eval_gru(self, x):
    self.rnn = nn.GRU(4, 5, num_layers=2, dropout=0.5).eval()
    self.rnn(torch.ones(3, 2, 4, device=self.rnn.weight_ih_l0.device))


def _mha(dropout: float, training: bool) -> Callable[[nn.Module, torch.Tensor], None]:
    def idiom(self, x):
        self.att = nn.MultiheadAttention(4, 2, dropout=dropout).train(training)
        q = torch.ones(3, 1, 4, device=self.att.in_proj_weight.device)
        self.att(q, q, q)

    return idiom


DRAWS: dict[str, Callable[[nn.Module], None]] = {
    "dropout p=tensor(0.)": _with(lambda s, x: F.dropout(x, p=torch.tensor(0.0, device="cpu"))),
    "dropout p=tensor(.5)": _with(lambda s, x: F.dropout(x, p=torch.tensor(0.5, device="cpu"))),
    "dropout p=np.float32(0)": _with(lambda s, x: F.dropout(x, p=np.float32(0.0))),
    "dropout p=np.float64(0)": _with(lambda s, x: F.dropout(x, p=np.float64(0.0))),
    "dropout p=np.float64(.5)": _with(lambda s, x: F.dropout(x, p=np.float64(0.5))),
    "partial(F.dropout, p=0.0)": _with(lambda s, x: functools.partial(F.dropout, p=0.0)(x)),
    "partial(F.dropout, p=0.5)": _with(lambda s, x: functools.partial(F.dropout, p=0.5)(x)),
    "Dropout subclass p=0": _with(lambda s, x: _Dropout(0.0)(x)),
    "Dropout subclass p=.5": _with(lambda s, x: _Dropout(0.5)(x)),
    "Dropout subclass eval": _with(lambda s, x: _Dropout(0.5).eval()(x)),
    "dropout inplace p=0": _with(lambda s, x: F.dropout(x, 0.0, True, inplace=True)),
    "dropout inplace p=.5": _with(lambda s, x: F.dropout(x, 0.5, True, inplace=True)),
    "dropout all keywords p=0": _with(
        lambda s, x: F.dropout(input=x, p=0.0, training=True, inplace=False)
    ),
    "dropout all keywords p=.5": _with(
        lambda s, x: F.dropout(input=x, p=0.5, training=True, inplace=False)
    ),
    "dropout p=1": _with(lambda s, x: F.dropout(x, 1.0)),
    "dropout p=True": _with(lambda s, x: F.dropout(x, True)),
    "torch.dropout train=0": _with(lambda s, x: torch.dropout(x, 0.5, False)),
    "alpha_dropout p=.5": _with(lambda s, x: F.alpha_dropout(x, 0.5, True)),
    "dropout2d p=0": _with(lambda s, x: F.dropout2d(x.reshape(1, 2, 4, 1), 0.0)),
    "lstm 1 layer dropout .5 train": _with(_lstm(dropout=0.5)),
    "lstm 2 layers dropout .5 train": _with(_lstm(num_layers=2, dropout=0.5)),
    "lstm 2 layers dropout 0": _with(_lstm(num_layers=2)),
    "lstm proj_size": _with(_lstm(num_layers=2, proj_size=3)),
    "lstm proj_size dropout .5": _with(_lstm(num_layers=2, proj_size=3, dropout=0.5)),
    "packed lstm dropout 0": _with(_packed(nn.LSTM, num_layers=2)),
    "packed lstm dropout .5": _with(_packed(nn.LSTM, num_layers=2, dropout=0.5)),
    "packed gru dropout 0": _with(_packed(nn.GRU, num_layers=2)),
    "packed gru dropout .5": _with(_packed(nn.GRU, num_layers=2, dropout=0.5)),
    "packed rnn_tanh 1 layer dropout .5": _with(_packed(nn.RNN, dropout=0.5)),
    "gru eval dropout .5": _with(_eval_gru),
    "mha train dropout 0": _with(_mha(0.0, True)),
    "mha train dropout .5": _with(_mha(0.5, True)),
    "mha eval dropout .5": _with(_mha(0.5, False)),
    "sdpa default": _with(lambda s, x: F.scaled_dot_product_attention(x, x, x)),
    "sdpa dropout .5": _with(lambda s, x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)),
    "rrelu eval": _with(lambda s, x: F.rrelu(x)),
    "rrelu training": _with(lambda s, x: F.rrelu(x, training=True)),
    "nn.RReLU train": _with(lambda s, x: nn.RReLU()(x)),
}


def _both(outcome: Outcome) -> dict[bool, Outcome]:
    return {mode: outcome for mode in MODES}


DRAW_OUTCOMES: dict[str, dict[bool, Outcome]] = {}
# everything else: exact, or refused upfront because the call draws
DRAW_DEFAULT = Outcome(EITHER, because="draws random numbers")


def _draw_cases() -> list:
    cases = idiom_cases(DRAWS, DRAW_OUTCOMES)
    return [
        pytest.param(
            *c.values[:2],
            DRAW_DEFAULT if c.values[2].kind == EXACT and not c.values[2].broken else c.values[2],
            marks=c.marks,
            id=c.id,
        )
        for c in cases
    ]


@pytest.mark.parametrize(("idiom", "include_buffers", "outcome"), _draw_cases())
def test_conditional_draws(idiom, include_buffers, outcome):
    check_idiom(DRAWS[idiom], include_buffers, outcome)


EXACT_DRAWLESS = [
    "dropout p=np.float64(0)",
    "dropout p=np.float32(0)",
    "dropout p=tensor(0.)",
    "partial(F.dropout, p=0.0)",
    "Dropout subclass p=0",
    "Dropout subclass eval",
    "dropout inplace p=0",
    "dropout all keywords p=0",
    "dropout p=1",
    "dropout p=True",
    "torch.dropout train=0",
    "dropout2d p=0",
    "lstm 2 layers dropout 0",
    "lstm proj_size",
    "lstm 1 layer dropout .5 train",
    "packed gru dropout 0",
    "packed rnn_tanh 1 layer dropout .5",
    "packed lstm dropout 0",
    "gru eval dropout .5",
    "mha train dropout 0",
    "mha eval dropout .5",
    "sdpa default",
    "rrelu eval",
]


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", EXACT_DRAWLESS)
def test_drawless_calls_are_exact(idiom, include_buffers):
    """Calls whose arguments say they draw nothing: exact, not merely not refused."""
    check_idiom(DRAWS[idiom], include_buffers, Outcome(EXACT))


@pytest.mark.parametrize("idiom", ["packed gru dropout .5", "packed rnn_tanh 1 layer dropout .5"])
def test_packed_sequences_refuse_only_later_draws(idiom):
    """A packed sequence through a dropping RNN: the layers built before it are eager's."""
    model = build_empty(lambda: Built(DRAWS[idiom]))
    assert metamode.is_materializable(model.a)


# == 2. custom ops, aten and prims ============================================================


def _custom_after_draws(self):
    self.a = nn.Linear(4, 4)
    self.b = nn.Linear(4, 3)
    self.register_buffer("s", torch.ops.mmtodaytest.scale(torch.ones(3)))


def _custom_in_probe(self):
    x = _probe(self)
    torch.ops.mmtodaytest.scale(x)
    _after(self)


def _custom_on_meta_after_draws(self):
    x = _probe(self)
    _after(self)
    self.register_buffer("s", torch.ops.mmtodaytest.scale(x).detach())


def _aten_ops(self):
    self.a = nn.Linear(4, 4)
    with torch.no_grad():
        torch.ops.aten.normal_.default(self.a.weight, 0.0, 0.02)
        torch.ops.aten.mul_.Tensor(self.a.bias, 0.5)
        torch.ops.aten.uniform_(self.a.bias, -0.1, 0.1)  # the packet
    _after(self)


def _prims_ops(self):
    self.a = nn.Linear(4, 4)
    with torch.no_grad():
        self.register_buffer("s", torch.ops.prims.mul.default(self.a.weight, self.a.weight))
    _after(self)


OPS = {
    "custom op after every draw": _custom_after_draws,
    "custom op in a forward probe": _custom_in_probe,
    "custom op on meta after every draw": _custom_on_meta_after_draws,
    "aten ops and packets": _aten_ops,
    "prims op": _prims_ops,
}


# == 3. writes nobody recorded into meta tensors ==============================================


def _disabled_fill(self):
    self.a = nn.Linear(4, 4)
    with torch.no_grad(), torch._C.DisableTorchFunction():
        self.a.weight.fill_(1.0)
    _after(self)


def _disabled_fill_first(self):
    self.w = nn.Parameter(torch.empty(4))
    with torch.no_grad(), torch._C.DisableTorchFunction():
        self.w.fill_(1.0)
    _after(self)


def _disabled_data_fill(self):
    self.a = nn.Linear(4, 4)
    _after(self)
    with torch._C.DisableTorchFunction():
        self.a.weight.data.fill_(1.0)  # .data: a version counter of its own


def _disabled_detach_fill(self):
    self.a = nn.Linear(4, 4)
    _after(self)
    with torch.no_grad(), torch._C.DisableTorchFunction():
        self.a.weight.detach().fill_(1.0)


def _scripted(self):
    self.a = nn.Linear(4, 4)
    with torch.no_grad():
        _scripted_uniform(self.a.weight)
    _after(self)


def _data_assign(self):
    self.a = nn.Linear(4, 4)
    self.a.weight.data = torch.ones(4, 4)
    _after(self)


def _requires_grad_off(self):
    self.a = nn.Linear(4, 4)
    self.a.weight.requires_grad_(False)
    _after(self)


def _set_to_itself(self):
    self.a = nn.Linear(4, 4)
    with torch.no_grad():
        self.a.weight.set_(self.a.weight)
    _after(self)


class _Symmetric(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


def _parametrized(self):
    self.a = nn.Linear(4, 4)
    torch.nn.utils.parametrize.register_parametrization(self.a, "weight", _Symmetric())
    _after(self)


def _hf_init(self):
    self.a = nn.Linear(4, 4)
    self.n = nn.LayerNorm(4)
    _after(self)
    for m in self.modules():
        if isinstance(m, nn.Linear):
            m.weight.data.normal_(mean=0.0, std=0.02)
            if m.bias is not None:
                m.bias.data.zero_()
        elif isinstance(m, nn.LayerNorm):
            m.bias.data.zero_()
            m.weight.data.fill_(1.0)


def _init_on_views(self):
    self.a = nn.Linear(4, 4)
    nn.init.normal_(self.a.weight[:2])
    nn.init.zeros_(self.a.weight[2:])
    nn.init.trunc_normal_(self.a.weight.view(-1)[:3], std=0.02)
    _after(self)


def _copy_between(self):
    self.a = nn.Linear(4, 4)
    self.c = nn.Linear(4, 4)
    with torch.no_grad():
        self.c.weight.copy_(self.a.weight)
    _after(self)


WRITES = {
    "DisableTorchFunction fill_ then layers": _disabled_fill,
    "DisableTorchFunction fill_ before any draw": _disabled_fill_first,
    "DisableTorchFunction .data.fill_ after draws": _disabled_data_fill,
    "DisableTorchFunction .detach().fill_ after draws": _disabled_detach_fill,
    "TorchScript uniform_ then layers": _scripted,
    ".data = assignment": _data_assign,
    "requires_grad_(False)": _requires_grad_off,
    "set_ to itself": _set_to_itself,
    "parametrize": _parametrized,
    "HF _init_weights loop": _hf_init,
    "nn.init on views": _init_on_views,
    "copy_ between params": _copy_between,
}


# == 4. real results of real and meta inputs ==================================================


def _linear_buffer(self):
    self.a = nn.Linear(4, 4)
    with torch.no_grad():
        self.register_buffer("y", F.linear(torch.ones(2, 4), self.a.weight))
    _after(self)


def _where_buffer(self):
    self.a = nn.Linear(4, 4)
    mask = torch.arange(4) % 2 == 0
    with torch.no_grad():
        self.register_buffer("y", torch.where(mask, self.a.bias, torch.zeros(4)))
    _after(self)


def _empty_like_cpu(self):
    self.a = nn.Linear(4, 4)
    self.register_buffer("y", torch.empty_like(self.a.weight, device="cpu").normal_())
    _after(self)


def _zeros_like_cpu(self):
    self.a = nn.Linear(4, 4)
    self.register_buffer("y", torch.zeros_like(self.a.weight, device="cpu") + 1)
    _after(self)


def _real_add_meta(self):
    self.a = nn.Linear(4, 4)
    y = torch.ones(4)
    with torch.no_grad():
        y.add_(self.a.bias)
    self.register_buffer("y", y)
    _after(self)


MIXED = {
    "F.linear(real, meta) buffer": _linear_buffer,
    "torch.where(real mask, meta, real)": _where_buffer,
    "empty_like(meta, device=cpu).normal_()": _empty_like_cpu,
    "zeros_like(meta, device=cpu) + 1": _zeros_like_cpu,
    "real.add_(meta)": _real_add_meta,
}

# == 7. .grad in the build ====================================================================


def _backward(self):
    x = _probe(self)
    x.sum().backward()


def _zero_grad_keep(self):
    _backward(self)
    self.zero_grad(set_to_none=False)
    _after(self)


def _grad_none_in_build(self):
    _backward(self)
    self.zero_grad()
    _after(self)


def _optimizer_no_step(self):
    self.a = nn.Linear(4, 4)
    self.opt = torch.optim.AdamW(self.a.parameters(), lr=0.1)
    _after(self)


def _sgd_step(self):
    _backward(self)
    torch.optim.SGD(self.a.parameters(), lr=0.1).step()
    _after(self)


def _manual_step(self):
    _backward(self)
    with torch.no_grad():
        self.a.weight -= 0.1 * self.a.weight.grad
    self.a.weight.grad = None
    self.a.bias.grad = None
    _after(self)


def _retain_grad(self):
    x = _probe(self)
    x.retain_grad()
    x.sum().backward()
    self.register_buffer("g", x.grad.detach().clone())
    self.zero_grad()
    _after(self)


def _autograd_grad(self):
    x = _probe(self)
    (g,) = torch.autograd.grad(x.sum(), self.a.weight)
    self.register_buffer("g", g.detach())
    _after(self)


GRADS = {
    "zero_grad(set_to_none=False) after backward": _zero_grad_keep,
    "backward then zero_grad() in the build": _grad_none_in_build,
    "optimizer made in the build, no step": _optimizer_no_step,
    "SGD step in the build": _sgd_step,
    "manual step from .grad": _manual_step,
    "retain_grad on a probe output": _retain_grad,
    "torch.autograd.grad": _autograd_grad,
}


_CUSTOM = Outcome(REFUSED, because="registered outside torch")
OPS_OUTCOMES = {
    "custom op after every draw": _both(_CUSTOM),
    "custom op in a forward probe": _both(_CUSTOM),
    "custom op on meta after every draw": _both(_CUSTOM),
}


@pytest.mark.parametrize(("idiom", "include_buffers", "outcome"), idiom_cases(OPS, OPS_OUTCOMES))
def test_custom_aten_prims(idiom, include_buffers, outcome):
    check_idiom(OPS[idiom], include_buffers, outcome)


def test_custom_op_refusal_names_the_op():
    model = build_empty(lambda: Built(_custom_in_probe))
    message = assert_refused(model, "b.weight", because="registered outside torch")
    assert "pybind11" not in message and "scale" in message, message


_UNSEEN = Outcome(REFUSED, because="did not record")
WRITES_OUTCOMES = {
    "DisableTorchFunction fill_ then layers": _both(_UNSEEN),
    "DisableTorchFunction fill_ before any draw": _both(_UNSEEN),
    "DisableTorchFunction .detach().fill_ after draws": _both(_UNSEEN),
    "TorchScript uniform_ then layers": _both(_UNSEEN),
    "DisableTorchFunction .data.fill_ after draws": _both(
        broken(
            "silently wrong: is_materializable says yes and a.weight gets Linear's init, not "
            "eager's ones: a write through .data (a version counter of its own) into meta is "
            "not seen"
        )
    ),
    "set_ to itself": _both(
        broken(
            "refused, a.weight 'written by code metamode did not record': p.set_(p) under "
            "no_grad is a torch call the mode sees"
        )
    ),
    ".data = assignment": {
        False: broken(
            "the build raises: set_data of a CPU tensor on a meta parameter (params only); "
            "eager builds"
        )
    },
}
MIXED_OUTCOMES = {
    "torch.where(real mask, meta, real)": {
        False: broken("the build raises: 'Tensor on device meta is not on the expected device cpu'")
    }
}
GRADS_OUTCOMES = {
    "zero_grad(set_to_none=False) after backward": _both(Outcome(REFUSED, because=r"\.grad")),
    "SGD step in the build": _both(Outcome(REFUSED, because=r"\.grad")),
    "manual step from .grad": _both(Outcome(REFUSED, because=r"\.grad")),
    "retain_grad on a probe output": _both(Outcome(REFUSED, because=r"\.grad")),
    "torch.autograd.grad": _both(Outcome(REFUSED, because="autograd.grad")),
}


@pytest.mark.parametrize(
    ("idiom", "include_buffers", "outcome"), idiom_cases(WRITES, WRITES_OUTCOMES)
)
def test_unseen_writes(idiom, include_buffers, outcome):
    check_idiom(WRITES[idiom], include_buffers, outcome)


@pytest.mark.parametrize(
    ("idiom", "include_buffers", "outcome"), idiom_cases(MIXED, MIXED_OUTCOMES)
)
def test_mixed_real_and_meta(idiom, include_buffers, outcome):
    check_idiom(MIXED[idiom], include_buffers, outcome)


@pytest.mark.parametrize(
    ("idiom", "include_buffers", "outcome"), idiom_cases(GRADS, GRADS_OUTCOMES)
)
def test_grads(idiom, include_buffers, outcome):
    check_idiom(GRADS[idiom], include_buffers, outcome)


@pytest.mark.parametrize("include_buffers", MODES)
def test_grad_set_to_none_after_the_block(include_buffers):
    """Backward in the build, ``p.grad = None`` after the block: exact."""
    ref = build_eagerly(lambda: Built(_zero_grad_keep))
    model = build_empty(lambda: Built(_zero_grad_keep), include_buffers)
    for p in model.parameters():
        p.grad = None
    for p in ref.parameters():
        p.grad = None
    materialize_exactly(model, ref)


# == 5. grad mode of computing calls ==========================================================


class _Forwards(nn.Module):
    """LSTM, GRU, conv and linear forwards whose outputs are kept as buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, num_layers=2)
        self.gru = nn.GRU(4, 5)
        self.conv = nn.Conv1d(4, 3, 2)
        self.lin = nn.Linear(4, 3)
        x = torch.linspace(-1, 1, 24).reshape(3, 2, 4).to(self.lin.weight.device)
        self.register_buffer("l", self.lstm(x)[0].detach())
        self.register_buffer("g", self.gru(x)[0].detach())
        self.register_buffer("c", self.conv(x.transpose(1, 2)).detach())
        self.register_buffer("y", self.lin(x).detach())
        self.after = nn.Linear(4, 4)


GRAD_MODES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "no_grad": torch.no_grad,
    "enable_grad": torch.enable_grad,
    "inference_mode": torch.inference_mode,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("build_mode", sorted(GRAD_MODES))
@pytest.mark.parametrize("materialize_mode", sorted(GRAD_MODES))
def test_grad_mode_of_forwards(build_mode, materialize_mode, include_buffers):
    """Forwards in the build under one grad mode, materialize under another: exact."""
    with GRAD_MODES[build_mode]():
        ref = build_eagerly(_Forwards)
        model = build_empty(_Forwards, include_buffers)
    with GRAD_MODES[materialize_mode]():
        assert_exact_or_refused(model, ref)


# == 6. the caller's dispatch modes and functorch transforms =================================


class _Raising(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} under the caller's mode")


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _net(self):
    self.a = nn.Linear(4, 4)
    self.register_buffer("r", torch.randn(4))
    self.n = nn.BatchNorm1d(4)
    _after(self)


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialize_inside_a_raising_dispatch_mode(include_buffers):
    ref = build_eagerly(lambda: Built(_net))
    model = build_empty(lambda: Built(_net), include_buffers)
    with _Raising():
        assert metamode.is_materializable(model)
        metamode.materialize(model)
        with pytest.raises(RuntimeError, match="under the caller's mode"):
            torch.ones(2) + 1  # the mode is back and still works
    assert_same_tensors(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialize_inside_nested_dispatch_modes(include_buffers):
    ref = build_eagerly(lambda: Built(_net))
    model = build_empty(lambda: Built(_net), include_buffers)
    outer, inner = _Counting(), _Counting()
    with outer, inner:
        metamode.materialize(model)
        assert (outer.count, inner.count) == (0, 0)
        torch.ones(2) + 1
        assert inner.count > 0 and outer.count > 0
    assert_same_tensors(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialize_inside_fake_tensor_mode(include_buffers):
    ref = build_eagerly(lambda: Built(_net))
    model = build_empty(lambda: Built(_net), include_buffers)
    with FakeTensorMode() as fake:
        metamode.materialize(model)
        made = torch.ones(2)
        assert type(made).__name__ == "FakeTensor" and made.fake_mode is fake
    assert_same_tensors(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialize_inside_vmap_and_grad(include_buffers):
    ref = build_eagerly(lambda: Built(_net))
    model = build_empty(lambda: Built(_net), include_buffers)

    def inside(x):
        metamode.materialize(model.a)
        return x * 2

    assert torch.equal(torch.func.vmap(inside)(torch.ones(3)), torch.full((3,), 2.0))

    def grad_inside(x):
        metamode.materialize(model)
        return (x * x).sum()

    assert torch.equal(torch.func.grad(grad_inside)(torch.ones(3)), torch.full((3,), 2.0))
    assert_same_tensors(model, ref)


# == 8. containers referencing parameters ====================================================


class _CopyDict(dict):
    def __getitem__(self, key):
        return dict.__getitem__(self, key).detach().clone()


class _FrozenList(list):
    def __setitem__(self, key, value):
        raise TypeError("frozen")


CONTAINERS = {
    "UserDict": lambda w, b: collections.UserDict({"w": w, "b": b}),
    "UserList": lambda w, b: collections.UserList([w, b]),
    "OrderedDict moved": lambda w, b: _moved(collections.OrderedDict(w=w, b=b)),
    "dict copying __getitem__": lambda w, b: _CopyDict(w=w, b=b),
    "frozen list": lambda w, b: _FrozenList([w, b]),
}


def _moved(d):
    d.move_to_end("w")
    return d


def _values(place) -> list:
    if isinstance(place, dict):
        return [dict.__getitem__(place, k) for k in place]
    if isinstance(place, collections.UserDict):
        return list(place.data.values())
    return list(place)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("kind", sorted(CONTAINERS))
def test_containers_follow_materialize(kind, include_buffers):
    def init(self):
        self.a = nn.Linear(4, 4)
        self.refs = CONTAINERS[kind](self.a.weight, self.a.bias)
        _after(self)

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    keys = list(model.refs.keys()) if hasattr(model.refs, "keys") else None
    materialize_exactly(model, ref)
    got = _values(model.refs)
    assert got[0] is model.a.weight or got[1] is model.a.weight, "a stale reference"
    assert all(not t.is_meta for t in got)
    if keys is not None:
        assert list(model.refs.keys()) == keys


# == 9. old and new fp32 precision APIs ======================================================


@contextlib.contextmanager
def _restored():
    mk = torch.backends.mkldnn
    saved = (
        torch.get_float32_matmul_precision(),
        torch.backends.fp32_precision,
        mk.fp32_precision,
        mk.matmul.fp32_precision,
        mk.conv.fp32_precision,
        mk.rnn.fp32_precision,
    )
    try:
        yield
    finally:
        mk.matmul.fp32_precision = saved[3]
        mk.conv.fp32_precision = saved[4]
        mk.rnn.fp32_precision = saved[5]
        mk.fp32_precision = saved[2]
        torch.backends.fp32_precision = saved[1]
        torch.set_float32_matmul_precision(saved[0])


def _old(value):
    return lambda: torch.set_float32_matmul_precision(value)


def _new(attr, value):
    def set_it():
        target = torch.backends if attr == "top" else getattr(torch.backends.mkldnn, attr)
        target.fp32_precision = value

    return set_it


PRECISIONS = {
    "old high / new matmul tf32": (_old("high"), _new("matmul", "tf32"), EXACT),
    "old medium / new matmul bf16": (_old("medium"), _new("matmul", "bf16"), EXACT),
    "new matmul bf16 / old medium": (_new("matmul", "bf16"), _old("medium"), EXACT),
    "old highest / new matmul bf16": (_old("highest"), _new("matmul", "bf16"), REFUSED),
    "new conv bf16 / default": (_new("conv", "bf16"), lambda: None, REFUSED),
    "new rnn bf16 / default": (_new("rnn", "bf16"), lambda: None, REFUSED),
    "top-level bf16 / old medium": (_new("top", "bf16"), _old("medium"), REFUSED),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("case", sorted(PRECISIONS))
def test_fp32_precision_apis_mixed(case, include_buffers):
    at_build, at_materialize, expected = PRECISIONS[case]
    with _restored():
        at_build()
        ref = build_eagerly(_Forwards)
        model = build_empty(_Forwards, include_buffers)
    with _restored():
        at_materialize()
        if expected == EXACT:
            materialize_exactly(model, ref)
        else:
            assert_refused(model, because="settings")
