"""The torch-function modes that carry all of metamode's state.

A metamode context *is* a :class:`torch.overrides.TorchFunctionMode`. PyTorch
keeps one mode stack per thread, so entering a context can only ever affect
the thread that entered it; nothing here is stored in a global, and no torch
function or class attribute is reassigned.

Two things need more than a mode, and both live elsewhere:

* moving *parameters* (and, with ``include_buffers``, buffers) happens when
  they are registered on a module -- an event a mode cannot see -- so
  :mod:`metamode._hooks` installs torch's official registration hooks, which
  ask this module's :func:`active_empty_weights` what to do;
* copying a parameter faithfully is :mod:`metamode._params`' job.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode
from torch.utils._device import _device_constructors

from metamode import _stack
from metamode._params import moved_parameter, moved_tensor
from metamode._skippable import skipped_target

__all__ = [
    "ContextMisuseError",
    "EmptyWeights",
    "KeepRegistered",
    "SkipEmptyWeights",
    "ThreadScopedMode",
    "active_empty_weights",
]

_F = TypeVar("_F", bound=Callable[..., Any])

_NEW, _ENTERED, _EXITED = "new", "entered", "exited"


class ContextMisuseError(RuntimeError):
    """A metamode context was used in a way that would corrupt some thread's state.

    Raised instead of guessing: re-entering a context object, exiting it in a
    thread that did not enter it, or exiting it while a context entered after
    it is still open.
    """


class ThreadScopedMode(TorchFunctionMode):
    """A single-use mode that refuses every exit that would corrupt a stack.

    ``TorchFunctionMode.__exit__`` pops whatever is on top of the current
    thread's stack. That is right for ``with`` blocks but silently wrong when
    contexts are entered and exited by hand, from generators or from another
    thread. This base class checks ownership and order first, so misuse raises
    :class:`ContextMisuseError` and leaves every other context intact.

    Instances are also decorators: each call of the decorated function runs
    under a fresh copy (see :meth:`_fresh`), so one decorator serves any number
    of calls and threads.
    """

    def __init__(self) -> None:
        super().__init__()
        self._state = _NEW
        self._owner: int | None = None

    # -- subclass interface -------------------------------------------------
    def _fresh(self) -> ThreadScopedMode:
        """A new, un-entered context with the same settings."""
        raise NotImplementedError

    def _after_enter(self) -> None:
        """Called once this mode is on the stack."""

    def _before_exit(self) -> None:
        """Called just before this mode leaves the stack (also on misuse)."""

    # -- context protocol ---------------------------------------------------
    def __enter__(self) -> ThreadScopedMode:
        if self._state != _NEW:
            raise ContextMisuseError(
                f"{self!r} was already entered once; contexts are single-use. "
                f"Create a new one for each `with` block (or use it as a decorator)."
            )
        self._owner = threading.get_ident()
        self._state = _ENTERED
        _push_mode(self)
        try:
            self._after_enter()
        except BaseException:
            _pop_mode()
            self._state = _EXITED
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._state != _ENTERED:
            raise ContextMisuseError(f"{self!r} is not active; it cannot be exited.")
        if threading.get_ident() != self._owner:
            raise ContextMisuseError(
                f"{self!r} was entered in thread {self._owner} but exited in thread "
                f"{threading.get_ident()}. A context only exists on the stack of the "
                f"thread that entered it; exit it there."
            )
        self._state = _EXITED
        self._before_exit()
        if _stack.top() is self:
            _pop_mode()
            return
        # Out of order: something entered after us is still open. Take only
        # ourselves off the stack so nothing leaks, keep the newer contexts
        # active, and say so loudly.
        newer = []
        for mode in _stack.modes_innermost_first():
            if mode is self:
                break
            newer.append(mode)
        if not _stack.remove(self):
            raise ContextMisuseError(
                f"{self!r} is no longer on this thread's torch-function mode stack; "
                f"something popped it (a TorchFunctionMode exited out of order?)."
            )
        raise ContextMisuseError(
            f"{self!r} exited while {newer!r} (entered after it) is still active. "
            f"It has been removed; the newer contexts stay active. Exit contexts in "
            f"the reverse order of entering them."
        )

    # -- decorator protocol -------------------------------------------------
    def __call__(self, func: _F) -> _F:
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"cannot decorate async function {func.__qualname__}: metamode contexts "
                f"are thread-scoped, and other tasks on this thread would run inside it "
                f"across every `await`. Enter the context around synchronous code instead."
            )
        if inspect.isgeneratorfunction(func):
            raise TypeError(
                f"cannot decorate generator function {func.__qualname__}: the context "
                f"would stay active in the caller's code between `yield`s."
            )

        @functools.wraps(func)
        def run_inside(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return run_inside  # type: ignore[return-value]

    @property
    def is_active(self) -> bool:
        """True between a successful ``__enter__`` and ``__exit__``."""
        return self._state == _ENTERED


class EmptyWeights(ThreadScopedMode):
    """Build modules with their parameters (and optionally buffers) on ``device``.

    Create it with :func:`metamode.empty_weights`. Parameters are moved when
    they are registered, by :mod:`metamode._hooks`; this mode's own
    ``__torch_function__`` does two cheaper things for the calls that build a
    module:

    * with ``include_buffers=True`` it points factory functions at ``device``,
      exactly like ``with torch.device(device)`` (torch's own constructor
      list), inside this mode, so nesting order is kept -- torch always moves
      a ``DeviceContext`` to the bottom of the stack;
    * it returns early from value-initialising calls on meta tensors
      (``nn.init.*``, ``uniform_``, ``fill_``, ...): on meta they compute
      nothing, yet cost a Python meta kernel each. See
      :mod:`metamode._skippable` for the exact rule.
    """

    def __init__(self, device: torch.device, include_buffers: bool) -> None:
        super().__init__()
        self.device = device
        self.include_buffers = include_buffers
        self._suspended = 0
        self._skip_init = device.type == "meta"
        # original tensor -> moved tensor, so tied weights stay tied; weak so a
        # huge model's CPU originals are not kept alive by the context.
        self._moved: torch.utils.weak.WeakIdKeyDictionary | None = None

    def _fresh(self) -> EmptyWeights:
        return EmptyWeights(self.device, self.include_buffers)

    def __repr__(self) -> str:
        return (
            f"metamode.empty_weights(device={str(self.device)!r}, "
            f"include_buffers={self.include_buffers})"
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._suspended:
            return func(*args, **kwargs)
        if self.include_buffers and kwargs.get("device") is None and func in _device_constructors():
            kwargs["device"] = self.device
        elif self._skip_init:
            target = skipped_target(func, args, kwargs)
            if target is not None:
                return target
        return func(*args, **kwargs)

    # Called by the registration hooks, always in the owner thread.
    def place_parameter(self, param: torch.nn.Parameter) -> torch.nn.Parameter | None:
        if _already_on(param, self.device):
            return None
        return self._memoised(param, moved_parameter)

    def place_buffer(self, tensor: torch.Tensor) -> torch.Tensor | None:
        if not self.include_buffers or _already_on(tensor, self.device):
            return None
        return self._memoised(tensor, moved_tensor)

    def _memoised(self, tensor, move):
        if self._moved is None:
            self._moved = torch.utils.weak.WeakIdKeyDictionary()
        moved = self._moved.get(tensor)
        if moved is None:
            moved = move(tensor, self.device)
            self._moved[tensor] = moved
        return moved


class SkipEmptyWeights(ThreadScopedMode):
    """Suspend the empty-weights contexts active in this thread when entered.

    Create it with :func:`metamode.skip_empty_weights`. The registration hooks
    see this mode above the contexts it suspends and leave registrations
    alone. Mode handlers cannot see modes above themselves, so the suspended
    contexts also get a counter, which stops their factory redirection and
    init skipping. A context entered *inside* the skip is not suspended:
    the innermost context wins.
    """

    def __init__(self) -> None:
        super().__init__()
        self._suspends: list[EmptyWeights] = []

    def _fresh(self) -> SkipEmptyWeights:
        return SkipEmptyWeights()

    def __repr__(self) -> str:
        return "metamode.skip_empty_weights()"

    def _after_enter(self) -> None:
        self._suspends = [m for m in _stack.modes_innermost_first() if isinstance(m, EmptyWeights)]
        for mode in self._suspends:
            mode._suspended += 1

    def _before_exit(self) -> None:
        for mode in self._suspends:
            mode._suspended -= 1
        self._suspends = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class KeepRegistered(ThreadScopedMode):
    """Base for modes that may keep a module's parameter (or buffer) when code
    running in this thread assigns a different one under the same name.

    The registration hooks (:mod:`metamode._hooks`) ask the innermost such
    mode, and only when ``module`` already holds a *different* tensor under
    ``name`` -- a re-assignment, which building a module rarely does -- so the
    question costs nothing on ordinary registrations. If :meth:`keeps` says
    yes, the hook returns the existing tensor and torch registers it again in
    place of the new one: the assignment changes nothing. Used by the
    transformers shim to stop weight tying in one thread.
    """

    def keeps(self, module: torch.nn.Module, name: str, value: torch.Tensor) -> bool:
        """True to keep ``module``'s current ``name`` instead of ``value``."""
        raise NotImplementedError

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_SCOPES = (EmptyWeights, SkipEmptyWeights)


def active_empty_weights() -> EmptyWeights | None:
    """The empty-weights context governing this thread now, or None."""
    mode = _stack.innermost(_SCOPES)
    return mode if isinstance(mode, EmptyWeights) else None


def kept_registration(
    module: torch.nn.Module, name: str, value: torch.Tensor, existing: torch.Tensor | None
) -> torch.Tensor | None:
    """``existing`` if this thread's innermost :class:`KeepRegistered` keeps it
    in place of ``value``, else None. Called by the registration hooks."""
    if existing is None or existing is value:
        return None
    guard = _stack.innermost(KeepRegistered)
    if guard is not None and guard.keeps(module, name, value):
        return existing
    return None


def _already_on(tensor: torch.Tensor, device: torch.device) -> bool:
    here = tensor.device
    return here.type == device.type and (device.index is None or here.index == device.index)
