"""Regression tests for the smaller core defects.

Each test failed on the code before its fix (run against the previous commit);
what it failed with is noted on the test.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

import metamode
from metamode._core import params as _params
from metamode._core.modes import LoadedIntoEmptyWeightsWarning
from metamode._core.stack import stack_depth

# -- LazyLinear ----------------------------------------------------------------


def _lazy_description(module: nn.Module, buffers: bool) -> list[tuple]:
    tensors = [*module.named_parameters(), *(module.named_buffers() if buffers else [])]
    return [(name, type(t), t.device, t.dtype, t.requires_grad) for name, t in tensors]


@pytest.mark.parametrize("include_buffers", [False, True])
def test_lazy_modules_build_as_under_torch_device_meta(include_buffers):
    # Before: ValueError "Attempted to use an uninitialized parameter in <method 'detach'...".
    with torch.device("meta"):
        expected = [nn.LazyLinear(3), nn.LazyBatchNorm1d(), nn.LazyConv2d(4, 3)]
    with metamode.empty_weights(include_buffers=include_buffers):
        got = [nn.LazyLinear(3), nn.LazyBatchNorm1d(), nn.LazyConv2d(4, 3)]
    for want, have in zip(expected, got, strict=True):
        # Without include_buffers, buffers stay where they were made, as documented.
        assert _lazy_description(have, include_buffers) == _lazy_description(want, include_buffers)
    assert type(got[0].weight) is UninitializedParameter
    got[0](torch.ones(2, 5, device="meta"))  # materialises on meta, as under torch.device
    assert got[0].weight.shape == (3, 5) and got[0].weight.is_meta


def test_uninitialised_buffer_with_explicit_device_is_moved_keeping_persistent():
    module = nn.Module()
    with metamode.empty_weights(include_buffers=True):
        module.register_buffer("b", UninitializedBuffer(device="cpu", persistent=False))
    assert type(module.b) is UninitializedBuffer and module.b.is_meta
    assert module.b.persistent is False


# -- Parameter subclasses whose constructor refuses keyword arguments ------------


class StrictParam(nn.Parameter):
    """Raises ValueError (not TypeError) on any keyword it does not know."""

    def __new__(cls, data=None, requires_grad=True, **unknown):
        if unknown:
            raise ValueError(f"unknown options {sorted(unknown)}")
        return super().__new__(cls, data, requires_grad)


class KeyErrorParam(nn.Parameter):
    def __new__(cls, data=None, requires_grad=True, **options):
        options["scale"]
        return super().__new__(cls, data, requires_grad)


@pytest.mark.parametrize("cls", [StrictParam, KeyErrorParam])
def test_parameter_subclass_refusing_keywords_is_rebuilt(cls):
    # Before: the ValueError/KeyError escaped and crashed the build.
    module = nn.Module()
    param = cls.__new__(
        cls, torch.ones(2), requires_grad=False, **({"scale": 1} if cls is KeyErrorParam else {})
    )
    param.note = "kept"
    with metamode.empty_weights():
        module.p = param
    assert type(module.p) is cls and module.p.is_meta
    assert module.p.requires_grad is False and module.p.note == "kept"


class Unbuildable(nn.Parameter):
    def __new__(cls, data=None, requires_grad=True, **kwargs):
        if kwargs.pop("_real", False):
            return super().__new__(cls, data, requires_grad)
        raise ValueError("refused")


def test_parameter_subclass_that_cannot_be_rebuilt_names_every_refusal(monkeypatch):
    param = Unbuildable(torch.ones(2), _real=True)

    def make_subclass_fails(*args, **kwargs):
        raise RuntimeError("no _make_subclass either")

    monkeypatch.setattr(_params, "make_subclass", make_subclass_fails)
    with (
        pytest.raises(
            TypeError, match=r"cannot rebuild a Unbuildable on meta.*ValueError: refused"
        ),
        metamode.empty_weights(),
    ):
        nn.Module().p = param
    assert stack_depth() == 0


# -- indexed devices -------------------------------------------------------------


@pytest.mark.parametrize("device", ["meta:0", "cpu:0", "meta", "cpu"])
def test_ties_hold_with_indexed_devices(device):
    # Before: with "meta:0"/"cpu:0", `b.w is a.weight` was False (a placed
    # parameter reports no index, so it was moved -- and untied -- again).
    with metamode.empty_weights(device=device):
        a = nn.Linear(2, 2)
        b = nn.Module()
        b.w = a.weight
    assert b.w is a.weight
    assert a.weight.device.type == torch.device(device).type


# -- default_dtype matches set_default_dtype ---------------------------------------

CASES = {
    "tensor([1.5, tensor(2.)])": lambda: torch.tensor([1.5, torch.tensor(2.0)]),
    "tensor([np.float32, float])": lambda: torch.tensor([np.float32(1.5), 2.5]),
    "full(np.bool_)": lambda: torch.full((1,), np.bool_(True)),
    "arange(np.bool_)": lambda: torch.arange(np.bool_(True)),
    "full(np.uint8)": lambda: torch.full((1,), np.uint8(1)),
    "full(np.float16)": lambda: torch.full((1,), np.float16(1)),
    "tensor([np.int32, float])": lambda: torch.tensor([np.int32(1), 2.5]),
    "tensor([np.float16, float])": lambda: torch.tensor([np.float16(1), 2.5]),
    "tensor([np.bool_, float])": lambda: torch.tensor([np.bool_(True), 2.5]),
    "tensor([float, float64 tensor])": lambda: torch.tensor(
        [1.5, torch.tensor(2.0, dtype=torch.float64)]
    ),
    "tensor([float, bfloat16 tensor])": lambda: torch.tensor(
        [1.5, torch.tensor(2.0, dtype=torch.bfloat16)]
    ),
    "tensor([int tensor, float])": lambda: torch.tensor([torch.tensor(2), 1.5]),
    "tensor([[float], [float32 1-d tensor]])": lambda: torch.tensor([[1.5], torch.ones(1)]),
    "as_tensor([float, tensor])": lambda: torch.as_tensor([1.5, torch.tensor(2.0)]),
    "asarray([np.float32, float])": lambda: torch.asarray([np.float32(1.5), 2.5]),
    "tensor([np.uint8])": lambda: torch.tensor([np.uint8(1)]),
    "tensor([[], []])": lambda: torch.tensor([[], []]),
}


def _under_torchs_default(dtype, call):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return call().dtype
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_default_dtype_matches_set_default_dtype_on_mixed_data(dtype):
    # Before: the first three cases gave float32 where torch gives
    # float16 / float64 / float64.
    mismatches = []
    for name, call in CASES.items():
        expected = _under_torchs_default(dtype, call)
        with metamode.default_dtype(dtype):
            got = call().dtype
        if got != expected:
            mismatches.append(f"{name}: {got}, torch's default gives {expected}")
    assert mismatches == []


# -- misused constructors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: metamode.empty_weights("cpu"), r"Did you mean empty_weights\(device='cpu'\)\?"),
        (
            lambda: metamode.empty_weights(torch.device("meta")),
            r"Did you mean empty_weights\(device='meta'\)\?",
        ),
    ],
)
def test_positional_device_says_what_was_meant(call, says):
    # Before: "include_buffers must be a bool, not 'cpu'".
    with pytest.raises(TypeError, match=says):
        call()


@pytest.mark.parametrize(
    ("factory", "fix"),
    [
        (metamode.empty_weights, r"use @metamode\.empty_weights\(\) instead"),
        (metamode.skip_init, r"use @metamode\.skip_init\(\) instead"),
        (metamode.skip_empty_weights, r"use @metamode\.skip_empty_weights\(\) instead"),
        (metamode.default_dtype, r"use @metamode\.default_dtype\(torch\.float16\)"),
    ],
)
def test_bare_decorator_says_use_parentheses(factory, fix):
    # Before: "include_buffers must be a bool, not <function ...>", "skip_init()
    # takes 0 positional arguments but 1 was given", "dtype must be a torch.dtype".
    with pytest.raises(TypeError, match=r"without (parentheses|a dtype) on .*build") as raised:

        @factory
        def build():
            return nn.Linear(2, 2)

    assert raised.match(fix)


# -- deep recursion --------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        metamode.empty_weights,
        metamode.skip_init,
        metamode.skip_empty_weights,
        lambda: metamode.default_dtype(torch.float16),
    ],
    ids=["empty_weights", "skip_init", "skip_empty_weights", "default_dtype"],
)
def test_decorated_recursion_300_deep(make):
    # Before: RecursionError -- each level pushed a mode, and torch dispatches
    # every call through each mode on the stack in turn (one Python frame each).
    assert sys.getrecursionlimit() >= 1000

    @make()
    def build(depth: int) -> nn.Module:
        if depth == 0:
            assert stack_depth() == 1
            return nn.Linear(2, 2)
        return build(depth - 1)

    build(300)
    assert stack_depth() == 0


def test_decorated_recursion_shares_one_context_so_ties_hold():
    shared = nn.Linear(2, 2)  # built outside: real

    @metamode.empty_weights()
    def attach(depth: int, into: list) -> None:
        holder = nn.Module()
        holder.w = shared.weight
        into.append(holder.w)
        if depth:
            attach(depth - 1, into)

    seen: list = []
    attach(3, seen)
    assert all(w is seen[0] for w in seen) and seen[0].is_meta


def test_decorated_call_inside_a_different_context_still_gets_its_own():
    @metamode.empty_weights()
    def build() -> nn.Module:
        return nn.Linear(2, 2)

    with metamode.empty_weights(device="cpu"):
        assert build().weight.is_meta
        with metamode.skip_empty_weights():
            assert build().weight.is_meta
    assert stack_depth() == 0


# -- load_state_dict(assign=True) inside a block ------------------------------------------


@pytest.mark.per_interpreter
def test_assign_inside_the_block_warns_naming_the_parameter_and_the_fix():
    # Before: silently back on meta, no warning.
    state = nn.Linear(2, 2).state_dict()
    with metamode.empty_weights():
        model = nn.Sequential(nn.Linear(2, 2))
        with pytest.warns(LoadedIntoEmptyWeightsWarning) as caught:
            model.load_state_dict({f"0.{k}": v for k, v in state.items()}, assign=True)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "Linear.weight" in messages[0] and "Linear.bias" in messages[1]
    assert "after the block" in messages[0]
    assert caught[0].filename == __file__  # points at the load_state_dict call
    model.load_state_dict({f"0.{k}": v for k, v in state.items()}, assign=True)
    assert torch.equal(model[0].weight, state["weight"])


def _through(depth, call, *args):
    """``call(*args)``, ``depth`` frames further down the stack."""
    return call(*args) if depth == 0 else _through(depth - 1, call, *args)


class _WrappedLinear(nn.Linear):
    """Overrides that put frames between torch's ``_load_from_state_dict`` and the
    registration hook, and between ``load_state_dict`` and ``_load_from_state_dict``."""

    def __setattr__(self, name, value):
        _through(12, super().__setattr__, name, value)

    def _load_from_state_dict(self, *args):
        _through(12, super()._load_from_state_dict, *args)


@pytest.mark.per_interpreter
def test_assign_inside_the_block_warns_through_overriding_subclasses():
    # Before: no warning (the walk gave up 8 frames above the hook).
    state = nn.Linear(2, 2).state_dict()
    with metamode.empty_weights():
        model = _WrappedLinear(2, 2)
        with pytest.warns(LoadedIntoEmptyWeightsWarning) as caught:
            call_line = sys._getframe().f_lineno + 1
            model.load_state_dict(state, assign=True)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "Linear.weight" in messages[0] and "Linear.bias" in messages[1]
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, call_line)] * 2
    model.load_state_dict(state, assign=True)
    assert torch.equal(model.weight, state["weight"])


@pytest.mark.per_interpreter
def test_assign_by_a_direct_load_from_state_dict_call_warns_at_that_call():
    state = nn.Linear(2, 2).state_dict()
    with metamode.empty_weights():
        model = nn.Linear(2, 2)
        with pytest.warns(LoadedIntoEmptyWeightsWarning) as caught:
            call_line = sys._getframe().f_lineno + 1
            model._load_from_state_dict(
                state, "", {"assign_to_params_buffers": True}, True, [], [], []
            )
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, call_line)] * 2


def test_no_warning_for_ordinary_reassignment_or_assign_outside():
    state = nn.Linear(2, 2).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with metamode.empty_weights():
            model = nn.Linear(2, 2)
            model.weight = nn.Parameter(torch.ones(2, 2))  # construction code does this
            model.load_state_dict({k: v.to("meta") for k, v in state.items()}, assign=True)
        model.load_state_dict(state, assign=True)
    assert torch.equal(model.weight, state["weight"])
