"""``metamode.skip_init()``: leave parameters as allocated, in this thread only.

Loaders build a model and then overwrite every parameter with a checkpoint,
so initialising the parameters first is wasted work. diffusers'
``no_init_weights`` and transformers' own copy avoid it by assigning no-op
functions to ``torch.nn.init.*`` for the whole process -- while one thread
loads, every other thread's new modules silently keep uninitialised memory,
and overlapping loads can restore each other's no-ops.

Here the same effect is a torch-function mode on the calling thread's stack.
The rule is narrower than "skip every ``torch.nn.init`` call", because a mode
sees only calls that dispatch through ``__torch_function__``, and skipping the
wrong one would change a result rather than just save time:

* The calls skipped are the *value-overwriting* ones -- a result that does not
  depend on the tensor's current contents: the ``torch.nn.init`` functions
  torch lets a mode intercept whole (``uniform_``, ``normal_``, ``constant_``,
  ``kaiming_uniform_``, whichever function is bound under that name in
  ``torch.nn.init`` when it runs) and the tensor methods ``uniform_``,
  ``normal_``, ``fill_``, ``zero_``, ``random_``, ``exponential_``,
  ``geometric_``, ``log_normal_``, ``cauchy_`` and ``bernoulli_``. Through
  those, ``ones_``, ``zeros_``, ``xavier_uniform_``, ``xavier_normal_`` and
  ``kaiming_normal_`` are skipped too. ``trunc_normal_`` (it resamples values
  outside ``[a, b]``), ``orthogonal_``, ``sparse_``, ``eye_`` and ``dirac_``
  compute through other operations and still write.
* Only writes into an ``nn.Parameter`` are skipped. Buffers and plain tensors
  are always written, so whatever a module *computes* while it is built (a
  running variance, a random projection, the scratch tensors inside
  ``trunc_normal_``'s rejection loop) is still computed. Arithmetic
  (``mul_``, ``clamp_``...) and ``copy_`` always run.
* Never skipped: a tensor method while autograd would record it (grad mode on
  and the parameter requires grad: the real call raises for a leaf, and that
  must stay observable), a parameter class that overrides
  ``__torch_function__``, or a call with another tensor among its arguments
  (it could raise a shape error).

A skipped call returns its tensor unchanged, like the real in-place call
would. Compared with diffusers' ``no_init_weights`` it skips more (``ones_``,
``zeros_``, direct ``param.normal_()``) and less (init calls on buffers and on
``param.data``, which is a plain tensor; ``trunc_normal_`` and the others
above): skipping less only costs time. (Skipping the scratch tensors'
sampling too would make ``trunc_normal_``'s rejection loop spin forever on
out-of-range memory.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter

from metamode._core.modes import ThreadScopedMode, _bare_decorator
from metamode._core.skip_rule import (
    OVERWRITING_METHOD_NAMES,
    bound_in_nn_init,
    dispatches_plainly,
    split_target,
)

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
    """The parameter ``func(*args, **kwargs)`` would only overwrite, or None to run it."""
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
    """Leave parameters as allocated: see :func:`skip_init` and the module docstring."""

    def _fresh(self) -> SkipInit:
        return SkipInit()

    def _settings(self) -> tuple:
        return ()

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

    While active in the calling thread, the calls that would fill an
    ``nn.Parameter`` with initial values (``torch.nn.init.*``, ``uniform_``,
    ``normal_``, ``fill_``, ``zero_``...) return it untouched, so a module
    built here keeps whatever memory its parameters were allocated with --
    diffusers' ``no_init_weights`` without assigning anything in
    ``torch.nn.init``. Other threads build and initialise modules as usual.
    Buffers and plain tensors are always written; the exact rule is in
    :mod:`metamode._contexts.skip_init`.

    Use it only when every parameter is about to be overwritten (loading a
    checkpoint); parameters left out keep arbitrary values.

    Returns a single-use context; as a decorator, each call gets a fresh one.

        >>> with metamode.skip_init():
        ...     layer = torch.nn.Linear(4096, 4096)   # no kaiming_uniform_ pass
        >>> layer.load_state_dict(checkpoint)
    """
    if _bare is not None:
        raise TypeError(_bare_decorator("skip_init", _bare))
    return SkipInit()
