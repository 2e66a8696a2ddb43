"""The torch-function modes that carry all of metamode's state.

A metamode context *is* a :class:`torch.overrides.TorchFunctionMode`. PyTorch
keeps one mode stack per thread, so entering a context can only ever affect
the thread that entered it; nothing here is stored in a global, and no torch
function or class attribute is reassigned.

Two things need more than a mode, and both live elsewhere:

* moving *parameters* (and, with ``include_buffers``, buffers) happens when
  they are registered on a module -- an event a mode cannot see -- so
  :mod:`metamode._core.hooks` installs torch's official registration hooks, which
  ask this module's :func:`active_empty_weights` what to do;
* copying a parameter faithfully is :mod:`metamode._core.params`' job.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Self, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from metamode._core import stack as _stack
from metamode._core.facts import is_device_probe
from metamode._core.params import moved_parameter, moved_tensor
from metamode._core.recording import Recorder
from metamode._core.skip_rule import skipped_target
from metamode._torch import (
    DeviceContext,
    DisableTorchFunction,
    device_constructors,
    pop_mode,
    push_mode,
)

__all__ = [
    "ContextMisuseError",
    "EmptyWeights",
    "KeepRegistered",
    "LoadedIntoEmptyWeightsWarning",
    "SkipEmptyWeights",
    "ThreadScopedMode",
    "active_empty_weights",
    "skipping_empty_weights",
]

_F = TypeVar("_F", bound=Callable[..., Any])

_NEW, _ENTERED, _EXITED = "new", "entered", "exited"
# Entered, then an exit was refused because it came from another thread: the
# mode may still sit on its owner's stack, but it no longer acts (see
# ThreadScopedMode._refuse_foreign_exit).
_INERT = "inert"

# Inert modes not yet taken off their owner's stack. Only the owner thread can
# do that (a thread's stack is its own); it does so the next time it enters or
# exits a metamode context. Weak: a dead thread's stack frees its modes.
_LEFT_INERT: weakref.WeakSet[ThreadScopedMode] = weakref.WeakSet()
_LEFT_INERT_LOCK = threading.Lock()


class ContextMisuseError(RuntimeError):
    """A metamode context was used in a way that would corrupt some thread's state.

    Raised instead of guessing: re-entering a context object, exiting it in a
    thread that did not enter it, or exiting it while a context entered after
    it is still open.
    """


class LoadedIntoEmptyWeightsWarning(UserWarning):
    """``load_state_dict(assign=True)`` ran inside an empty-weights block and was undone.

    (Defined here, not in :mod:`metamode._core.hooks`, so reloading that module
    cannot make the class the hooks raise differ from the one users filter.)
    """


class ThreadScopedMode(TorchFunctionMode):
    """A single-use mode that refuses every exit that would corrupt a stack.

    ``TorchFunctionMode.__exit__`` pops whatever is on top of the current
    thread's stack. That is right for ``with`` blocks but silently wrong when
    contexts are entered and exited by hand, from generators or from another
    thread. This base class checks ownership and order first, so misuse raises
    :class:`ContextMisuseError` and leaves every other context intact.

    An exit refused because it came from another thread (a generator holding
    the context closed or garbage-collected there) still raises, and also
    makes the context *inert*: its ``__torch_function__`` passes every call
    through, :func:`active_empty_weights` and the registration hooks ignore
    it, and its owner thread drops it from its stack the next time it enters
    or exits a metamode context.

    Instances are also decorators: each call of the decorated function runs
    under a fresh copy (see :meth:`_fresh`), so one decorator serves any number
    of calls and threads.
    """

    _inert = False  # class default; set on the instance only, never on the class

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # An inert mode on its owner's stack must not act, so every handler
        # starts with ``if self._inert: return func(*args, **kwargs)``. Checked
        # here rather than added by a wrapper: a wrapper would cost a Python
        # frame in every torch call and shift the frames the handlers inspect.
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_function__")
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if handler is not None and (code is None or "_inert" not in code.co_names):
            raise TypeError(
                f"{cls.__qualname__}.__torch_function__ must pass calls through while the "
                f"context is inert: start it with `if self._inert: return func(*args, **kwargs)`."
            )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))  # a context that only marks the stack

    def __init__(self) -> None:
        super().__init__()
        self._state = _NEW
        self._owner: int | None = None
        self._owner_name = ""

    # -- subclass interface -------------------------------------------------
    def _settings(self) -> tuple:
        """The constructor's arguments: equal settings, equal effect."""
        return ()

    def _fresh(self) -> Self:
        """A new, un-entered context with the same settings."""
        return type(self)(*self._settings())

    def _after_enter(self) -> None:
        """Called once this mode is on the stack."""

    def _before_exit(self) -> None:
        """Called just before this mode leaves the stack (also on misuse)."""

    def _after_refused_exit(self) -> None:
        """Called, in the refusing thread, once this mode has become inert."""

    # -- context protocol ---------------------------------------------------
    def __enter__(self) -> ThreadScopedMode:
        if self._state != _NEW:
            raise ContextMisuseError(
                f"{self!r} was already entered once; contexts are single-use. "
                f"Create a new one for each `with` block (or use it as a decorator)."
            )
        if _LEFT_INERT:
            _drop_inert_modes()
        self._owner = threading.get_ident()
        self._owner_name = threading.current_thread().name
        self._state = _ENTERED
        push_mode(self)
        try:
            self._after_enter()
        except BaseException:
            pop_mode()
            self._state = _EXITED
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._state == _INERT and threading.get_ident() == self._owner:
            # The refused exit, retried in the right thread: finish it quietly.
            self._state = _EXITED
            with _LEFT_INERT_LOCK:
                _LEFT_INERT.discard(self)
            _stack.remove(self)
            return
        if self._state != _ENTERED:
            raise ContextMisuseError(f"{self!r} is not active; it cannot be exited.")
        if threading.get_ident() != self._owner:
            self._refuse_foreign_exit()
        if _LEFT_INERT:
            _drop_inert_modes()
        self._state = _EXITED
        self._before_exit()
        if _stack.top() is self:
            pop_mode()
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

    def _refuse_foreign_exit(self) -> None:
        # This thread cannot touch the owner's stack, and raising alone would
        # leave the context acting in the owner for good. So it stops acting
        # (inert) and the refusal stays loud.
        self._state = _INERT
        self._inert = True
        with _LEFT_INERT_LOCK:
            _LEFT_INERT.add(self)
        self._after_refused_exit()
        here = threading.current_thread()
        raise ContextMisuseError(
            f"{self!r} was entered in thread {self._owner_name!r} ({self._owner}) but "
            f"exited in thread {here.name!r} ({here.ident}). A context exists only on "
            f"the stack of the thread that entered it, so it cannot be removed from "
            f"here; it is now inert (it no longer acts in {self._owner_name!r}, which "
            f"drops it when it next enters or exits a metamode context). Fix: exit it "
            f"in the thread that entered it -- a generator holding it must be closed "
            f"or exhausted in that thread, not garbage-collected or closed elsewhere."
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

        settings = self._settings()

        @functools.wraps(func)
        def run_inside(*args: Any, **kwargs: Any) -> Any:
            # Already directly inside an equivalent context (recursion, or one
            # decorated function calling another): pushing another would change
            # nothing but cost a Python frame in *every* torch call below it --
            # torch dispatches through each mode on the stack in turn, so 300
            # recursive calls made 300-deep dispatch and a RecursionError.
            current = _stack.top()
            if (
                type(current) is type(self)
                and current._state == _ENTERED
                and current._settings() == settings
            ):
                return func(*args, **kwargs)
            with self._fresh():
                return func(*args, **kwargs)

        return run_inside  # type: ignore[return-value]

    @property
    def is_active(self) -> bool:
        """True between a successful ``__enter__`` and ``__exit__`` (False once inert)."""
        return self._state == _ENTERED


def _drop_inert_modes() -> None:
    """Take the calling thread's inert modes off its stack (only it can)."""
    me = threading.get_ident()
    with _LEFT_INERT_LOCK:
        mine = [mode for mode in _LEFT_INERT if mode._owner == me]
        for mode in mine:
            _LEFT_INERT.discard(mode)
    for mode in mine:
        _stack.remove(mode)


def _foreign(mode: TorchFunctionMode) -> bool:
    """Whether ``mode`` is neither metamode's nor torch's device context (whose placement a
    recording maps to the CPU)."""
    return not isinstance(mode, ThreadScopedMode | DeviceContext)


class EmptyWeights(ThreadScopedMode):
    """Build modules with their parameters (and optionally buffers) on ``device``.

    Create it with :func:`metamode.empty_weights`. Parameters are moved when they are
    registered, by :mod:`metamode._core.hooks`. The mode itself, for the calls that build a
    module: with ``include_buffers=True`` it sends factory calls without ``device=`` to
    ``device`` (torch's own constructor list, as ``with torch.device(device)``); on meta it
    returns early from the calls :func:`metamode._core.skip_rule.skipped_target` skips.
    A replayable context records the build (:mod:`metamode._core.recording`); one entered
    while another records in the thread joins that recording.
    """

    def __init__(
        self, device: torch.device, include_buffers: bool, replayable: bool = False
    ) -> None:
        super().__init__()
        self.device = device
        self.include_buffers = include_buffers
        self.replayable = replayable
        # The skip_empty_weights contexts suspending this one (a set, not a
        # counter: an inert skip drops itself from another thread).
        self._suspended: set[SkipEmptyWeights] = set()
        self._skip_init = device.type == "meta"
        # original tensor -> moved tensor, so tied weights stay tied; weak so a
        # huge model's CPU originals are not kept alive by the context.
        self._moved: torch.utils.weak.WeakIdKeyDictionary | None = None
        # The recording this context writes (its own, or the one it joined).
        self._recorder: Recorder | None = None
        self._records = False  # the calls reach this context's handler first

    def _settings(self) -> tuple:
        return (self.device, self.include_buffers, self.replayable)

    def __repr__(self) -> str:
        return (
            f"metamode.empty_weights(device={str(self.device)!r}, "
            f"include_buffers={self.include_buffers}"
            + (", replayable=True)" if self.replayable else ")")
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._inert:
            return func(*args, **kwargs)
        if self._records:
            return self._recorder.record(func, args, kwargs, self)  # type: ignore[union-attr]
        if self._recorder is not None:  # joined: the recording context below records
            return self._redirected(func, args, kwargs)
        return self.placed_call(func, args, kwargs)[0]

    def _redirected(self, func, args, kwargs):
        if self._sends_to_device(func, kwargs):
            kwargs = {**kwargs, "device": self.device}
        return func(*args, **kwargs)

    def _sends_to_device(self, func, kwargs) -> bool:
        """A factory call without ``device=`` goes to ``device``; in a recorded build, not
        when a library's device probe makes it (it then builds as eager construction does,
        so the recording can be replayed)."""
        return (
            self.include_buffers
            and kwargs.get("device") is None
            and func in device_constructors()
            and (self._recorder is None or not is_device_probe(_caller_outside_metamode()))
        )

    def placed_call(self, func, args, kwargs) -> tuple[Any, bool]:
        """Run ``func`` as this context does; True when it skipped the call instead."""
        if self._suspended:
            return func(*args, **kwargs), False
        if self._sends_to_device(func, kwargs):
            return func(*args, **{**kwargs, "device": self.device}), False
        if self._skip_init:
            target = skipped_target(func, args, kwargs)
            if target is not None:
                return target, True
        return func(*args, **kwargs), False

    def skips(self, func, args, kwargs) -> torch.Tensor | None:
        """The tensor this context returns in place of running ``func``, or None."""
        if self._skip_init and not self._suspended:
            return skipped_target(func, args, kwargs)
        return None

    def _after_enter(self) -> None:
        # A meta context entered while another records in this thread is part of that
        # build: it joins the recording, replayable or not.
        if self.device.type == "meta":
            for mode in _stack.modes_innermost_first():
                if (
                    isinstance(mode, EmptyWeights)
                    and mode is not self
                    and not mode._inert
                    and mode._recorder is not None
                ):
                    self._recorder = mode._recorder
                    self._recorder.joined(self.device)
                    return
        if self.replayable:
            self._recorder = Recorder()
            self._records = True
            below = next((m for m in _stack.modes_innermost_first() if _foreign(m)), None)
            if below is not None:
                self._recorder.diverge(
                    f"it was built inside {type(below).__qualname__}, a torch function mode "
                    f"entered before this context, which every torch call of the build went "
                    f"through and replay cannot repeat; enter it inside the replayable "
                    f"context (its own torch calls are recorded there), or build without it"
                )

    def _before_exit(self) -> None:
        if self._records and self._recorder is not None:
            self._recorder.close()

    def _after_refused_exit(self) -> None:
        if self._recorder is not None:
            self._recorder.abandon(
                "its empty_weights context was exited from another thread, so the "
                "recording of the build is incomplete"
            )

    def place_parameter(
        self, param: torch.nn.Parameter, module: Any = None, name: str | None = None
    ) -> torch.nn.Parameter | None:
        """What to register in place of ``param``: its twin on ``device``, or None to keep
        ``param`` (already there, or left in place by a subclass). One original maps to one
        twin for the context's life, so ties stay ties. Called by the registration hooks,
        in the owner thread only."""
        placed = None
        if not _already_on(param, self.device) and not self._leaves_in_place(param):
            placed = self._memoised(param, moved_parameter)
        if self._recorder is not None:
            self._recorder.registered(param, placed, module, name)
        return placed

    def _leaves_in_place(self, param: torch.nn.Parameter) -> bool:
        """Subclass interface: True to leave a registered parameter where it is."""
        return False

    def place_buffer(
        self, tensor: torch.Tensor, module: Any = None, name: str | None = None
    ) -> torch.Tensor | None:
        """What to register in place of ``tensor``: with ``include_buffers=True`` its twin
        on ``device``, else (or when already there) None to keep it. Called by the
        registration hooks, in the owner thread only."""
        placed = None
        if self.include_buffers and not _already_on(tensor, self.device):
            placed = self._memoised(tensor, moved_tensor)
        if self._recorder is not None:
            self._recorder.registered(tensor, placed, module, name)
        return placed

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
    contexts also record it (a set of suspenders), which stops their factory redirection and
    init skipping. A context entered *inside* the skip is not suspended:
    the innermost context wins.
    """

    def __init__(self) -> None:
        super().__init__()
        self._suspends: list[EmptyWeights] = []

    def __repr__(self) -> str:
        return "metamode.skip_empty_weights()"

    def _after_enter(self) -> None:
        self._suspends = [
            m
            for m in _stack.modes_innermost_first()
            if isinstance(m, EmptyWeights) and not m._inert
        ]
        for mode in self._suspends:
            mode._suspended.add(self)

    def _before_exit(self) -> None:
        for mode in self._suspends:
            mode._suspended.discard(self)
        self._suspends = []

    _after_refused_exit = _before_exit  # an inert skip suspends nothing


class KeepRegistered(ThreadScopedMode):
    """Base for modes that may keep a module's parameter (or buffer) when code
    running in this thread assigns a different one under the same name.

    The registration hooks ask the innermost such mode, and only when
    ``module`` already holds a *different* tensor under ``name``. If
    :meth:`keeps` says yes, the hook returns the existing tensor, so the
    assignment changes nothing. (The transformers shim stops weight tying in
    one thread this way.)
    """

    def keeps(self, module: torch.nn.Module, name: str, value: torch.Tensor) -> bool:
        """True to keep ``module``'s current ``name`` instead of ``value``."""
        raise NotImplementedError


_SCOPES = (EmptyWeights, SkipEmptyWeights)


def _caller_outside_metamode() -> Any:
    """The code of the innermost frame that is not metamode's own (the torch call's caller)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("metamode."):
        frame = frame.f_back
    return frame.f_code


def active_empty_weights() -> EmptyWeights | None:
    """The empty-weights context governing this thread now, or None."""
    mode = _stack.innermost(_SCOPES, skip_inert=True)
    return mode if isinstance(mode, EmptyWeights) else None


def skipping_empty_weights() -> bool:
    """True while a :class:`SkipEmptyWeights` is the innermost empty-weights scope of this
    thread (its registrations are left where they are)."""
    return isinstance(_stack.innermost(_SCOPES, skip_inert=True), SkipEmptyWeights)


def kept_registration(
    module: torch.nn.Module, name: str, value: torch.Tensor, existing: torch.Tensor
) -> torch.Tensor | None:
    """``existing`` (a different tensor ``module`` holds under ``name``) if this
    thread's innermost :class:`KeepRegistered` keeps it in place of ``value``,
    else None. Called by the registration hooks on re-assignments only."""
    guard = _stack.innermost(KeepRegistered, skip_inert=True)
    if isinstance(guard, KeepRegistered) and guard.keeps(module, name, value):
        return existing
    return None


def _bare_decorator(name: str, func: object) -> str:
    """The error for ``@metamode.<name>`` used without parentheses (or given an argument)."""
    what = getattr(func, "__qualname__", None) or repr(func)
    if callable(func):
        return (
            f"metamode.{name} was used as a decorator without parentheses on {what}: "
            f"use @metamode.{name}() instead."
        )
    return f"metamode.{name}() takes no arguments, got {what}."


def _already_on(tensor: torch.Tensor, device: torch.device) -> bool:
    # Tensors on cpu and meta carry no index, whatever index the context was
    # given ("meta:0", "cpu:0"); comparing it would move -- and so untie -- a
    # parameter the context had already placed.
    with DisableTorchFunction():  # metamode's own read, not one of the build's
        here = tensor.device
    return here.type == device.type and (
        device.index is None or here.index is None or here.index == device.index
    )


# Installs the registration hooks. Here, in the module every context class comes
# from, so the hooks are in place before any context can be entered; at the end,
# because metamode._core.hooks imports active_empty_weights from this module.
from metamode._core import hooks as _hooks  # noqa: E402, F401
