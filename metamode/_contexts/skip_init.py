"""``metamode.skip_init()``: leave parameters as allocated, in this thread only."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter

from metamode._core.facts import OVERWRITING_METHOD_NAMES
from metamode._core.modes import ThreadScopedMode, _bare_decorator
from metamode._core.skip_rule import bound_in_nn_init, dispatches_plainly, split_target

__all__ = ["SkipInit", "skip_init"]

# torch.nn.init functions that call handle_torch_function themselves, so a mode
# sees them as one call (the others only show up as the methods they call).
_WHOLE_INIT_NAMES = frozenset(("uniform_", "normal_", "constant_", "kaiming_uniform_"))
_INIT_MODULE = vars(torch.nn.init)
_TORCHS_INIT_FUNCTIONS = frozenset(_INIT_MODULE[name] for name in _WHOLE_INIT_NAMES)

_OVERWRITING_METHODS = frozenset(getattr(torch.Tensor, name) for name in OVERWRITING_METHOD_NAMES)


def _is_init_function(func: Any) -> bool:
    return func in _TORCHS_INIT_FUNCTIONS or bound_in_nn_init(func, _WHOLE_INIT_NAMES)


def skipped_parameter(func: Any, args: tuple, kwargs: dict) -> Parameter | None:
    """The parameter ``func(*args, **kwargs)`` would only overwrite, or None to run it.

    The rule of :func:`metamode._core.skip_rule.skipped_target`, with two differences. The
    target is an ``nn.Parameter`` on any device (buffers and plain tensors, ``param.data``
    included, are always written). The calls are only those whose result ignores the
    tensor's current values: ``torch.nn.init``'s ``uniform_``, ``normal_``, ``constant_``
    and ``kaiming_uniform_`` (as bound at call time) and the methods in
    ``OVERWRITING_METHOD_NAMES`` -- through which ``ones_``, ``zeros_``, ``xavier_*`` and
    ``kaiming_normal_`` are skipped; ``trunc_normal_``, ``orthogonal_``, ``sparse_``,
    ``eye_`` and ``dirac_`` still write, and arithmetic and ``copy_`` always run.
    """
    is_method = func in _OVERWRITING_METHODS
    if not is_method and not _is_init_function(func):
        return None
    target, others = split_target(args, kwargs)
    if not isinstance(target, Parameter) or not dispatches_plainly(type(target)):
        return None
    if any(isinstance(value, torch.Tensor) for value in others):
        return None
    if is_method and target.requires_grad and torch.is_grad_enabled():
        return None
    return target


class SkipInit(ThreadScopedMode):
    """Leave parameters as allocated: see :func:`skip_init`."""

    def __repr__(self) -> str:
        return "metamode.skip_init()"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._inert:
            return func(*args, **kwargs)
        target = skipped_parameter(func, args, kwargs)
        if target is not None:
            return target
        return func(*args, **kwargs)


def skip_init(_bare: object = None, /) -> SkipInit:
    """Context manager and decorator: don't initialise parameters in this thread.

    While active in the calling thread, the calls that would fill an ``nn.Parameter``
    with initial values (``torch.nn.init.*``, ``uniform_``, ``normal_``, ``fill_``,
    ``zero_``...) return it untouched, so a module built here keeps whatever memory its
    parameters were allocated with. Nothing is assigned in ``torch.nn.init``; other
    threads build and initialise modules as usual. Buffers and plain tensors are always
    written; the exact rule: :func:`metamode._contexts.skip_init.skipped_parameter`.

    Use it only when every parameter is about to be overwritten (loading a checkpoint);
    parameters left out keep arbitrary values.

    Returns a single-use context; as a decorator, each call gets a fresh one.

    Raises:
        TypeError: used as ``@metamode.skip_init`` without parentheses, or given an argument.

    Examples:
        >>> with metamode.skip_init():
        ...     layer = torch.nn.Linear(4096, 4096)   # no kaiming_uniform_ pass
        >>> layer.load_state_dict(checkpoint)
    """
    if _bare is not None:
        raise TypeError(_bare_decorator("skip_init", _bare))
    return SkipInit()
