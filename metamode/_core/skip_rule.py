"""Which torch calls compute nothing on a meta tensor and may return at once.

Building an empty model spends much of its time *initialising* parameters
that live on the meta device: ``reset_parameters`` and transformers'
``_init_weights`` call ``kaiming_uniform_``, ``uniform_``, ``normal_``... and
each runs a meta kernel that checks arguments and produces no values --
``normal_``'s is Python (torch's ``_refs``), ~0.7 ms a call, so 0.1-0.2 s for
a Llama-7B skeleton, several times the cost of building the skeleton itself.
Inside an empty-weights context those calls are pointless, so the mode
returns the tensor unchanged instead.

The rule is deliberately narrow, so skipping can never change a result:

* the call must be value-initialising: one of the ``torch.nn.init`` functions
  below that dispatch through ``__torch_function__`` (whichever function is
  bound under that name in ``torch.nn.init`` when it is called -- transformers'
  ``guard_torch_init_functions`` rebinds them to flag-checking wrappers during
  ``init_weights``, and torch's dispatch then names the wrapper), or an
  in-place tensor method that only writes values (never ``resize_``,
  ``set_``, ``requires_grad_``, ``copy_`` or a shape-changing method);
* the tensor it initialises (first positional argument, or the ``tensor=`` /
  ``self=`` keyword) must be on the meta device -- real tensors are never
  skipped -- and its class must not override ``__torch_function__`` (such a
  subclass gets every call it would have got);
* no other argument may be a tensor, so a skipped call could not have raised a
  broadcasting or shape error;
* a tensor *method* is not skipped while autograd would record it (grad mode
  on and the tensor requires grad): the real call raises for a leaf or gives
  a non-leaf a new ``grad_fn``, and both must stay observable. The
  ``torch.nn.init`` functions run under ``no_grad`` themselves, so they are
  always skippable.

What a skipped call does not do: bump the tensor's version counter, or raise
the dtype errors a real in-place call could (``mul_(0.5)`` on an integer meta
tensor). Neither changes the model that comes out: its module structure,
shapes, dtypes, devices, ``requires_grad`` and parameter identities are
exactly those of the unskipped build (``tests/integration/test_bench.py`` checks this on
pure-torch, transformers, diffusers and PEFT models).

Dunder methods are never in the set, so operators pass through untouched.
"""

from __future__ import annotations

import weakref
from types import FunctionType
from typing import Any

import torch

from metamode._torch import default_torch_function

__all__ = ["POINTLESS_ON_META", "bound_in_nn_init", "skipped_target"]

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
# In-place methods whose result does not depend on the tensor's current values
# (metamode.skip_init skips these on real parameters too).
OVERWRITING_METHOD_NAMES = (
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
)
# On a meta tensor, value arithmetic computes nothing either.
_VALUE_WRITING_METHODS = (
    *OVERWRITING_METHOD_NAMES,
    "erfinv_",
    "clamp_",
    "mul_",
    "add_",
    "sub_",
    "div_",
)

_INIT_MODULE = vars(torch.nn.init)
_INIT_NAMES = frozenset(_INIT_FUNCTIONS)
_METHODS = frozenset(getattr(torch.Tensor, name) for name in _VALUE_WRITING_METHODS)
POINTLESS_ON_META: frozenset[Any] = frozenset(
    [_INIT_MODULE[name] for name in _INIT_FUNCTIONS] + list(_METHODS)
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
    """The tensor ``func(*args, **kwargs)`` would return unchanged, or None to run it.

    Non-None exactly when the call would only write values into a meta tensor
    (the rule in the module docstring); the mode then returns that tensor
    instead of calling ``func``.
    """
    if not _is_value_initialising(func):
        return None
    target, others = split_target(args, kwargs)
    if not isinstance(target, torch.Tensor) or not target.is_meta:
        return None
    if not dispatches_plainly(type(target)):
        return None
    if any(isinstance(value, torch.Tensor) for value in others):
        return None
    if func in _METHODS and target.requires_grad and torch.is_grad_enabled():
        return None
    return target
