"""Moving a parameter or buffer onto a context's device (``metamode._core.params``).

A moved tensor keeps its class, attributes and dispatch. Subclass constructors are
tried the bitsandbytes way (attributes as keywords) and then as ``nn.Parameter.__new__``
does; a lazy module's uninitialised tensors are placed as ``torch.device`` places them.
"""

from __future__ import annotations

import weakref
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

import metamode
from metamode._core import params as _params
from metamode._core.stack import stack_depth

# -- lazy modules ----------------------------------------------------------------


def _lazy_description(module: nn.Module, buffers: bool) -> list[tuple]:
    tensors = [*module.named_parameters(), *(module.named_buffers() if buffers else [])]
    return [(name, type(t), t.device, t.dtype, t.requires_grad) for name, t in tensors]


@pytest.mark.parametrize("include_buffers", [False, True])
def test_lazy_modules_build_as_under_torch_device_meta(include_buffers):
    # An UninitializedParameter holds no data to copy: detaching it raises.
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


# -- the bitsandbytes-style constructor path ----------------------------------------------------
# Fails if _params._rebuilt_subclass stops calling cls(data, requires_grad=..., **attributes).


class KeywordParam(nn.Parameter):
    """bitsandbytes-style: attributes are constructor keywords, and construction is observable.

    Like ``bnb.nn.Params4bit``, defaults exist, so a rebuild *without* the keywords
    also succeeds; only the record of constructor calls tells the two paths apart.
    """

    calls: ClassVar[list[tuple[str, bool, object, int]]] = []
    made: ClassVar[list[weakref.ref]] = []

    def __new__(cls, data=None, requires_grad=False, quant_state=None, blocksize=64):
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self.quant_state = quant_state
        self.blocksize = blocksize
        cls.calls.append((data.device.type, requires_grad, quant_state, blocksize))
        cls.made.append(weakref.ref(self))
        return self


def test_bitsandbytes_style_subclass_is_rebuilt_through_its_constructor():
    KeywordParam.calls.clear()
    KeywordParam.made.clear()
    original = KeywordParam(torch.empty(4), True, quant_state={"s": 1}, blocksize=32)
    module = nn.Module()
    with metamode.empty_weights():
        module.quant = original
    moved = module.quant
    assert type(moved) is KeywordParam and moved.is_meta and moved.requires_grad
    assert KeywordParam.calls == [("cpu", True, {"s": 1}, 32), ("meta", True, {"s": 1}, 32)]
    assert KeywordParam.made[-1]() is moved, "the constructor's object must be the one kept"
    assert moved.quant_state == {"s": 1} and moved.blocksize == 32
    assert original.device.type == "cpu" and "requires_grad" not in original.__dict__


# -- constructors without keywords, or refusing them ----------------------------------------------


class PlainConstructorParam(nn.Parameter):
    """Takes (data, requires_grad) only; attributes are set afterwards."""

    made: ClassVar[list[tuple[weakref.ref, str, bool]]] = []

    def __new__(cls, data=None, requires_grad=True):
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        cls.made.append((weakref.ref(self), data.device.type, requires_grad))
        return self


class DowncastingParam(nn.Parameter):
    """A constructor that returns a plain Parameter instead of its own class."""

    def __new__(cls, data=None, requires_grad=True):
        if data is not None and data.is_meta:
            return nn.Parameter(data, requires_grad)
        return torch.Tensor._make_subclass(cls, data, requires_grad)


def test_subclass_without_keyword_constructor_is_rebuilt_through_it():
    PlainConstructorParam.made.clear()
    original = PlainConstructorParam(torch.empty(2), requires_grad=False)
    original.role = "gate"
    module = nn.Module()
    with metamode.empty_weights():
        module.p = original
    moved = module.p
    assert type(moved) is PlainConstructorParam and moved.is_meta and moved.role == "gate"
    reference, device, requires_grad = PlainConstructorParam.made[-1]
    assert reference() is moved and (device, requires_grad) == ("meta", False)


def test_constructor_that_returns_another_class_is_overruled():
    module = nn.Module()
    with metamode.empty_weights():
        module.p = DowncastingParam(torch.empty(3), requires_grad=False)
    assert type(module.p) is DowncastingParam and module.p.is_meta
    assert module.p.shape == (3,) and not module.p.requires_grad


class ValueErrorParam(nn.Parameter):
    """Raises ValueError (not TypeError) on any keyword it does not know."""

    def __new__(cls, data=None, requires_grad=True, **unknown):
        if unknown:
            raise ValueError(f"unknown options {sorted(unknown)}")
        return super().__new__(cls, data, requires_grad)


class KeyErrorParam(nn.Parameter):
    def __new__(cls, data=None, requires_grad=True, **options):
        options["scale"]
        return super().__new__(cls, data, requires_grad)


@pytest.mark.parametrize("cls", [ValueErrorParam, KeyErrorParam])
def test_parameter_subclass_refusing_keywords_is_rebuilt(cls):
    # Whatever a constructor raises on the keyword attempt, the positional one follows.
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


# -- tensor subclasses as buffers -----------------------------------------------------------------


class RecordingTensor(torch.Tensor):
    """A tensor subclass whose __torch_function__ must see the calls that move it."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclass_buffers_keep_their_dispatch_when_moved():
    RecordingTensor.seen.clear()
    buffer = torch.ones(2).as_subclass(RecordingTensor)
    RecordingTensor.seen.clear()
    module = nn.Module()
    with metamode.empty_weights(include_buffers=True):
        module.register_buffer("recorded", buffer)
    assert module.recorded.is_meta and type(module.recorded) is RecordingTensor
    assert "to" in RecordingTensor.seen, RecordingTensor.seen
    assert buffer.device.type == "cpu"
