"""Which torch calls compute nothing on a meta tensor and may return at once.

Building an empty model spends most of its time *initialising* parameters
that live on the meta device: ``reset_parameters`` calls ``kaiming_uniform_``,
``uniform_``, ``normal_``... and each runs a Python meta kernel that checks
arguments and produces no values. Inside an empty-weights context those calls
are pointless, so the mode returns the tensor unchanged instead.

The rule is deliberately narrow, so skipping can never change a result:

* the call must be one of the value-initialising functions below -- the
  ``torch.nn.init`` functions that dispatch through ``__torch_function__`` or
  an in-place tensor method that only writes values (never ``resize_``,
  ``set_``, ``requires_grad_``, ``copy_`` or a shape-changing method);
* the tensor it initialises (first positional argument, or the ``tensor=`` /
  ``self=`` keyword) must be on the meta device -- real tensors are never
  skipped;
* no other argument may be a tensor, so a skipped call could not have raised a
  broadcasting or shape error.

Dunder methods are never in the set, so operators pass through untouched.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_pointless_on_meta", "POINTLESS_ON_META"]

_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)
_VALUE_WRITING_METHODS = (
    "uniform_",
    "normal_",
    "fill_",
    "zero_",
    "random_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "bernoulli_",
    "erfinv_",
    "clamp_",
    "mul_",
    "add_",
    "sub_",
    "div_",
)

POINTLESS_ON_META: frozenset[Any] = frozenset(
    [getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS]
    + [getattr(torch.Tensor, name) for name in _VALUE_WRITING_METHODS]
)


def is_pointless_on_meta(func: Any, args: tuple, kwargs: dict) -> bool:
    """True if ``func(*args, **kwargs)`` would only write values into a meta tensor."""
    if func not in POINTLESS_ON_META:
        return False
    if args:
        target, others = args[0], list(args[1:]) + list(kwargs.values())
    else:
        target = kwargs.get("tensor", kwargs.get("self"))
        others = [v for k, v in kwargs.items() if k not in ("tensor", "self")]
    if not isinstance(target, torch.Tensor) or not target.is_meta:
        return False
    return not any(isinstance(value, torch.Tensor) for value in others)
