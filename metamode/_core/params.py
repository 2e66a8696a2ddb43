"""Copying a parameter or buffer to another device without losing what it is.

accelerate and PEFT rebuild a moved parameter as
``type(p)(p.to(device), **p.__dict__)``: that mutates the original's
``__dict__`` (it adds ``requires_grad``) and raises for subclasses whose
constructor does not take their attributes. Here the original is never
touched, the subclass constructor is tried the bitsandbytes way first
(attributes as keyword arguments), and if it refuses, the object is rebuilt
the way ``nn.Parameter.__new__`` itself does it.

A lazy module's ``UninitializedParameter``/``UninitializedBuffer`` holds no
data to copy: it is recreated, uninitialised, on the new device -- what
``torch.device(device)`` gives.
"""

from __future__ import annotations

import copyreg
from typing import Any

import torch
from torch.nn import Parameter

from metamode._torch import UninitializedTensorMixin, make_subclass, neg_view

__all__ = ["carry_attributes", "moved_parameter", "moved_tensor", "slot_names"]


def carry_attributes(source: torch.Tensor, target: torch.Tensor) -> None:
    """Give ``target`` the Python attributes ``source`` has: its ``__dict__`` (but
    ``requires_grad``, which ``Parameter`` reads from the tensor) and its ``__slots__``,
    except where its class dispatches for itself (a wrapper subclass such as DTensor keeps
    its data in slots: ``target``'s are its own)."""
    attributes = source.__dict__
    if attributes:
        target.__dict__.update({k: v for k, v in attributes.items() if k != "requires_grad"})
    cls = type(source)
    if cls is Parameter or cls is torch.Tensor:
        return
    if cls.__torch_dispatch__ is not _TENSOR_DISPATCH:
        return
    for name in slot_names(cls):
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))
        elif hasattr(target, name):  # deleted on the source, or never set
            delattr(target, name)


_TENSOR_DISPATCH = torch.Tensor.__torch_dispatch__


def slot_names(cls: type) -> list[str]:
    """The ``__slots__`` names instances of ``cls`` have (its bases' too), as pickle reads them."""
    names: Any = copyreg._slotnames(cls)  # type: ignore[attr-defined]
    return names


def moved_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (a buffer: plain data, no autograd history)."""
    if isinstance(tensor, UninitializedTensorMixin):
        return _uninitialised_on(tensor, device)
    with torch.no_grad():
        data = tensor.detach()
        conj, neg = data.is_conj(), data.is_neg()
        if not (conj or neg):
            return _strided_as(data.to(device), data)
        # the same memory without the bits (``to`` would resolve them), the bits put back
        if conj:
            data = data.conj()
        if neg:
            data = neg_view(data)
        moved = _strided_as(data.to(device), data)
        if neg:
            moved = neg_view(moved)
        return moved.conj() if conj else moved


def _strided_as(moved: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``moved`` with ``data``'s strides where ``to`` made a strided view contiguous
    (``t[:, ::2]``); a stride-0 view (``t.expand(...)``) stays contiguous: its elements
    share memory, which a copy cannot write."""
    if data.layout is not torch.strided or moved.stride() == data.stride():
        return moved
    if any(
        stride == 0 and size > 1 for size, stride in zip(data.shape, data.stride(), strict=True)
    ):
        return moved
    return torch.empty_strided(
        data.shape, data.stride(), dtype=data.dtype, device=moved.device
    ).copy_(moved)


def moved_parameter(param: Parameter, device: torch.device) -> Parameter:
    """A parameter of the same class, ``requires_grad`` and attributes on ``device``."""
    if isinstance(param, UninitializedTensorMixin):
        return _uninitialised_on(param, device)
    data = moved_tensor(param, device)
    cls = type(param)
    requires_grad = param.requires_grad
    if cls is Parameter:
        moved = Parameter(data, requires_grad=requires_grad)
    else:
        attributes = {k: v for k, v in param.__dict__.items() if k != "requires_grad"}
        moved = _rebuilt_subclass(cls, data, requires_grad, attributes)
    carry_attributes(param, moved)
    return moved


def _uninitialised_on(tensor, device: torch.device):
    moved = type(tensor)(requires_grad=tensor.requires_grad, device=device, dtype=tensor.dtype)
    carry_attributes(tensor, moved)  # UninitializedBuffer's ``persistent``
    return moved


def _rebuilt_subclass(
    cls: type[Parameter], data: torch.Tensor, requires_grad: bool, attributes: dict
) -> Parameter:
    # A third-party constructor refusing arguments it does not know may raise
    # anything (TypeError, ValueError, KeyError, an assert...): both attempts
    # are only attempts, and the last resort below needs no constructor. If
    # even that fails, every refusal is in the error.
    refusals: list[Exception] = []
    moved = None
    attempts = ({"requires_grad": requires_grad, **attributes}, {"requires_grad": requires_grad})
    for kwargs in attempts:
        try:  # first bitsandbytes-style: every attribute is a constructor argument
            moved = cls(data, **kwargs)
            break
        except Exception as refusal:
            refusals.append(refusal)
    if moved is None or type(moved) is not cls or moved.device != data.device:
        try:
            moved = make_subclass(cls, data, requires_grad)
        except Exception as error:
            raise TypeError(
                f"cannot rebuild a {cls.__qualname__} on {data.device}: its constructor "
                f"refused ({'; '.join(f'{type(e).__name__}: {e}' for e in refusals)}) and "
                f"torch.Tensor._make_subclass failed ({type(error).__name__}: {error}). "
                f"Build this parameter outside the metamode context, or give its class a "
                f"constructor that accepts (data, requires_grad=...)."
            ) from error
    moved.requires_grad_(requires_grad)
    return moved
