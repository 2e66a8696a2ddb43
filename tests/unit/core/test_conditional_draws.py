"""Each row of ``facts.CONDITIONAL_DRAWS`` against torch itself: for every argument case, the
row's rule says a call may draw exactly when eager's default generator moves in that call
(with inputs for which it draws when it may: rrelu's negative ones)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from metamode._core.facts import CONDITIONAL_DRAWS, fact_of

_X3, _X4, _X5 = torch.ones(2, 3, 4), torch.ones(2, 3, 4, 4), torch.ones(2, 3, 2, 2, 2)
_Q = torch.ones(1, 2, 3, 4)

# function -> for (dropout probability, training flag), the call as code makes it (made
# ready first: a module's construction draws too)
_CALLS: dict[Callable, Callable[[float, bool], Callable[[], object]]] = {
    F.dropout: lambda p, t: lambda: F.dropout(_X4, p, t),
    F.dropout1d: lambda p, t: lambda: F.dropout1d(_X3, p, t),
    F.dropout2d: lambda p, t: lambda: F.dropout2d(_X4, p, t),
    F.dropout3d: lambda p, t: lambda: F.dropout3d(_X5, p, t),
    F.alpha_dropout: lambda p, t: lambda: F.alpha_dropout(_X4, p, t),
    F.feature_alpha_dropout: lambda p, t: lambda: F.feature_alpha_dropout(_X4, p, t),
    torch.dropout: lambda p, t: lambda: torch.dropout(_X4, p, t),
    torch.dropout_: lambda p, t: lambda: torch.dropout_(_X4.clone(), p, train=t),
    torch.feature_dropout: lambda p, t: lambda: torch.feature_dropout(_X4, p, t),
    torch.feature_dropout_: lambda p, t: lambda: torch.feature_dropout_(_X4.clone(), p, t),
    torch.alpha_dropout: lambda p, t: lambda: torch.alpha_dropout(_X4, p=p, train=t),
    torch.alpha_dropout_: lambda p, t: lambda: torch.alpha_dropout_(_X4.clone(), p, t),
    torch.feature_alpha_dropout: lambda p, t: lambda: torch.feature_alpha_dropout(_X4, p, t),
    torch.feature_alpha_dropout_: lambda p, t: (
        lambda: torch.feature_alpha_dropout_(_X4.clone(), p, t)
    ),
    F.scaled_dot_product_attention: lambda p, t: (
        lambda: F.scaled_dot_product_attention(_Q, _Q, _Q, dropout_p=p)
    ),
    F.multi_head_attention_forward: lambda p, t: _called(
        nn.MultiheadAttention(4, 2, dropout=p).train(t), _X3, _X3, _X3
    ),
    # dropout between layers: two of them
    torch.lstm: lambda p, t: _called(nn.LSTM(4, 4, 2, dropout=p).train(t), _X3),
    torch.gru: lambda p, t: _called(nn.GRU(4, 4, 2, dropout=p).train(t), _X3),
    torch.rnn_tanh: lambda p, t: _called(nn.RNN(4, 4, 2, dropout=p).train(t), _X3),
    torch.rnn_relu: lambda p, t: _called(
        nn.RNN(4, 4, 2, nonlinearity="relu", dropout=p).train(t), _X3
    ),
    # rrelu draws for the negative elements only
    F.rrelu: lambda p, t: lambda: F.rrelu(-_X4, training=t),
    torch.rrelu: lambda p, t: lambda: torch.rrelu(-_X4, 0.1, 0.3, t),
    F.rrelu_: lambda p, t: lambda: F.rrelu_(-_X4, training=t),
    torch.rrelu_: lambda p, t: lambda: torch.rrelu_(-_X4, 0.1, 0.3, t),
}


def _called(module: nn.Module, *inputs: torch.Tensor) -> Callable[[], object]:
    return lambda: module(*inputs)


_CASES = [(0.0, True), (0.5, True), (1.0, True), (0.5, False)]


class _Rules(TorchFunctionMode):
    """What the row's rule says of each call of ``func`` the block makes."""

    def __init__(self, func: Callable) -> None:
        super().__init__()
        self.func, self.said = func, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self.func:
            rule = fact_of(func).draws_when
            assert rule is not None
            self.said.append(rule(args, kwargs))
        return func(*args, **kwargs)


def test_every_row_has_a_case():
    assert {row[0] for row in CONDITIONAL_DRAWS} == set(_CALLS)


@pytest.mark.parametrize("func", [row[0] for row in CONDITIONAL_DRAWS], ids=lambda f: f.__name__)
@pytest.mark.parametrize(("p", "training"), _CASES)
def test_the_rule_says_a_call_draws_when_eagers_generator_moves(func, p, training):
    assert fact_of(func).random  # the op's tag says it may draw: the rule narrows it
    with warnings.catch_warnings():  # RNNs warn about dropout at p = 1
        warnings.simplefilter("ignore")
        call = _CALLS[func](p, training)
    state = torch.default_generator.get_state()
    rules = _Rules(func)
    with torch.no_grad(), rules:
        call()
    moved = not torch.equal(torch.default_generator.get_state(), state)
    assert rules.said and all(said == moved for said in rules.said), (rules.said, moved)


_PACKED = torch.nn.utils.rnn.pack_sequence([torch.ones(3, 4), torch.ones(2, 4)])


@pytest.mark.parametrize(
    ("func", "layer"), [(torch.lstm, nn.LSTM), (torch.gru, nn.GRU)], ids=["lstm", "gru"]
)
@pytest.mark.parametrize(("p", "training"), _CASES)
def test_the_rule_reads_a_packed_sequences_overload(func, layer, p, training):
    """A packed sequence calls the op's other overload (data, batch_sizes, ...), where the
    dropout and training arguments sit one place later."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = layer(4, 4, 2, dropout=p).train(training)
    state = torch.default_generator.get_state()
    rules = _Rules(func)
    with torch.no_grad(), rules:
        module(_PACKED)
    moved = not torch.equal(torch.default_generator.get_state(), state)
    assert rules.said and all(said == moved for said in rules.said), (rules.said, moved)


@pytest.mark.parametrize("layer", [nn.LSTM, nn.GRU, nn.RNN], ids=["lstm", "gru", "rnn"])
def test_a_one_layer_rnn_draws_nothing_whatever_its_dropout(layer):
    """An RNN's dropout runs between layers: with one, none (torch warns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = layer(4, 4, 1, dropout=0.5).train()
    func = {nn.LSTM: torch.lstm, nn.GRU: torch.gru, nn.RNN: torch.rnn_tanh}[layer]
    state = torch.default_generator.get_state()
    rules = _Rules(func)
    with torch.no_grad(), rules:
        module(_X3)
    assert torch.equal(torch.default_generator.get_state(), state)
    assert rules.said == [False]


@pytest.mark.parametrize(
    "p",
    [np.float32(0), np.float64(0), torch.tensor(0.0), torch.tensor(1.0), np.float32(0.5)],
    ids=["np.float32(0)", "np.float64(0)", "tensor(0.)", "tensor(1.)", "np.float32(.5)"],
)
def test_a_probability_of_any_real_type_is_read(p):
    state = torch.default_generator.get_state()
    rules = _Rules(F.dropout)
    with torch.no_grad(), rules:
        F.dropout(_X4, p)
    moved = not torch.equal(torch.default_generator.get_state(), state)
    assert rules.said == [moved]
