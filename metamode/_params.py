"""Copying a parameter or buffer to another device without losing what it is.

accelerate and PEFT rebuild a moved parameter as
``type(p)(p.to(device), **p.__dict__)``: that mutates the original's
``__dict__`` (it adds ``requires_grad``) and raises for subclasses whose
constructor does not take their attributes. Here the original is never
touched, the subclass constructor is tried the bitsandbytes way first
(attributes as keyword arguments), and if it refuses, the object is rebuilt
the way ``nn.Parameter.__new__`` itself does it.
"""

from __future__ import annotations

import torch
from torch.nn import Parameter

from metamode._torch import make_subclass

__all__ = ["moved_parameter", "moved_tensor"]


def moved_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (a buffer: plain data, no autograd history)."""
    with torch.no_grad():
        return tensor.detach().to(device)


def moved_parameter(param: Parameter, device: torch.device) -> Parameter:
    """A parameter of the same class, ``requires_grad`` and attributes on ``device``."""
    data = moved_tensor(param, device)
    cls = type(param)
    attributes = {k: v for k, v in param.__dict__.items() if k != "requires_grad"}
    requires_grad = param.requires_grad
    if cls is Parameter:
        moved = Parameter(data, requires_grad=requires_grad)
    else:
        moved = _rebuilt_subclass(cls, data, requires_grad, attributes)
    if attributes:
        moved.__dict__.update(attributes)
    return moved


def _rebuilt_subclass(
    cls: type[Parameter], data: torch.Tensor, requires_grad: bool, attributes: dict
) -> Parameter:
    try:  # bitsandbytes-style: every attribute is a constructor argument
        moved = cls(data, requires_grad=requires_grad, **attributes)
    except TypeError:
        try:
            moved = cls(data, requires_grad=requires_grad)
        except TypeError:
            moved = make_subclass(cls, data, requires_grad)
    if type(moved) is not cls or moved.device != data.device:
        moved = make_subclass(cls, data, requires_grad)
    moved.requires_grad_(requires_grad)
    return moved
