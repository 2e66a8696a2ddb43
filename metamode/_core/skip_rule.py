"""The skip rule: which torch calls are pointless on meta tensors and may return at once.

:func:`skipped_target` states it; ``EmptyWeights`` applies it on meta, and
``metamode.skip_init`` applies a variant to parameters on any device
(:func:`metamode._contexts.skip_init.skipped_parameter`). Why and at what cost:
docs/design.md, "Skipping init".
"""

from __future__ import annotations

import weakref
from types import FunctionType
from typing import Any

import torch

from metamode._core.facts import INIT_FUNCTION_NAMES, VALUE_WRITING_METHOD_NAMES
from metamode._torch import default_torch_function

__all__ = [
    "POINTLESS_ON_META",
    "bound_in_nn_init",
    "dispatches_plainly",
    "skipped_target",
    "split_target",
]

_INIT_MODULE = vars(torch.nn.init)
_INIT_NAMES = frozenset(INIT_FUNCTION_NAMES)
_METHODS = frozenset(getattr(torch.Tensor, name) for name in VALUE_WRITING_METHOD_NAMES)
POINTLESS_ON_META: frozenset[Any] = frozenset(
    [_INIT_MODULE[name] for name in INIT_FUNCTION_NAMES] + list(_METHODS)
)

_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_DEFAULT_TORCH_FUNCTIONS = (
    default_torch_function,
    vars(torch.Tensor)["__torch_function__"].__func__,
)
# subclass -> whether it keeps the default __torch_function__; weak, so classes
# made on the fly are not kept alive by this cache.
_SUBCLASS_IS_PLAIN: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def split_target(args: tuple, kwargs: dict) -> tuple[Any, list[Any]]:
    """The tensor an init-style call writes (first argument, or ``tensor=``/``self=``)
    and every other argument."""
    if args:
        return args[0], [*args[1:], *kwargs.values()]
    target = kwargs.get("tensor", kwargs.get("self"))
    return target, [v for k, v in kwargs.items() if k != "tensor" and k != "self"]


def dispatches_plainly(cls: type) -> bool:
    """True if ``cls`` does not customise ``__torch_function__``."""
    if cls is _PARAMETER or cls is _TENSOR:
        return True
    plain = _SUBCLASS_IS_PLAIN.get(cls)
    if plain is None:
        handler = getattr(cls, "__torch_function__", None)
        plain = getattr(handler, "__func__", handler) in _DEFAULT_TORCH_FUNCTIONS
        _SUBCLASS_IS_PLAIN[cls] = plain
    return plain


def bound_in_nn_init(func: Any, names: frozenset[str]) -> bool:
    """True if ``func`` is what ``torch.nn.init`` binds under one of ``names`` now.

    A library may have rebound ``torch.nn.init.<name>`` (transformers'
    ``guard_torch_init_functions`` does, around ``init_weights``); torch's own
    dispatch then passes the mode whatever is bound there at call time.
    """
    return (
        type(func) is FunctionType
        and func.__name__ in names
        and _INIT_MODULE.get(func.__name__) is func
    )


def _is_value_initialising(func: Any) -> bool:
    return func in POINTLESS_ON_META or bound_in_nn_init(func, _INIT_NAMES)


def skipped_target(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor ``func(*args, **kwargs)`` would return unchanged, or None to run the call.

    Non-None exactly when all of these hold:

    * ``func`` is value-initialising: in ``POINTLESS_ON_META`` (the ``torch.nn.init``
      functions in ``facts.INIT_FUNCTION_NAMES`` and in-place methods that only write values --
      never
      ``resize_``, ``set_``, ``requires_grad_``, ``copy_`` or a shape-changing method, never a
      dunder), or the function ``torch.nn.init`` binds under one of those names at call time;
    * its target (first positional argument, or ``tensor=``/``self=``) is a meta tensor
      whose class does not override ``__torch_function__``;
    * no other argument is a tensor (a skipped call could not have raised a shape error);
    * for a tensor method, autograd would not record it (grad mode off or the target does
      not require grad); the ``torch.nn.init`` functions run under ``no_grad`` themselves.

    A skipped call does not bump the tensor's version counter or raise the dtype errors the
    real call could (``mul_(0.5)`` on an integer meta tensor). The model built is otherwise
    the unskipped build's: structure, shapes, dtypes, devices, ``requires_grad`` and
    parameter identities.
    """
    if not _is_value_initialising(func):
        return None
    target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
    if not isinstance(target, torch.Tensor) or not target.is_meta:
        return None
    if not dispatches_plainly(type(target)):
        return None
    for value in args[1:] if args else ():
        if isinstance(value, torch.Tensor):
            return None
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and (args or (key != "tensor" and key != "self")):
            return None
    if func in _METHODS and target.requires_grad and torch.is_grad_enabled():
        return None
    return target
