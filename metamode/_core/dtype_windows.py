"""Sharing torch's process-wide default dtype between threads that each need it set.

torch has one default dtype per process (``torch.set_default_dtype``), and neither
``torch.get_default_dtype`` nor ``torch.set_default_dtype`` reaches a torch-function mode, so
no per-thread context can stand in for a library that sets it around a model's construction.
A *dtype window* is such a region: while a thread has windows open, the process default is
the dtype of its innermost one. Threads whose innermost windows need the same dtype run
together; a thread that needs another dtype parks (blocked, running no code) until every
running window needs its dtype or none is running. Waiters are served in arrival order, a
run of waiters needing one dtype together, so no dtype starves. The first window to open
records the process default and the last to close puts it back. Why this design, and what a
thread outside every window sees meanwhile: docs/design.md, "Dtype windows".
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = [
    "WindowState",
    "close_window",
    "close_windows_opened_since",
    "closing_call",
    "default_for_this_thread",
    "dtype_window",
    "inside_closing_call",
    "open_window",
    "settable",
    "state",
    "wait_until",
    "windows_open_in_this_thread",
]

# The dtypes torch.set_default_dtype accepts.
_SETTABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def settable(dtype: object) -> bool:
    """True for a dtype a window can be opened in (torch.set_default_dtype accepts it)."""
    return dtype in _SETTABLE


@dataclass
class _Waiter:
    thread: int
    dtype: torch.dtype


@dataclass
class WindowState:
    """A snapshot of the windows, for the doctor and the tests."""

    baseline: torch.dtype | None  # the process default before the first open window
    running: dict[int, torch.dtype] = field(default_factory=dict)  # thread -> dtype
    parked: dict[int, torch.dtype] = field(default_factory=dict)  # thread -> dtype it waits for
    stacks: dict[int, tuple[torch.dtype, ...]] = field(default_factory=dict)  # thread -> open


_condition = threading.Condition(threading.Lock())
_stacks: dict[int, list[torch.dtype]] = {}  # thread -> the dtypes of its open windows
_running: dict[int, torch.dtype] = {}  # thread -> the dtype its innermost window runs in
_queue: list[_Waiter] = []  # parked threads, in arrival order
_baseline: torch.dtype | None = None


def _may_run(waiter: _Waiter) -> bool:
    if any(dtype != waiter.dtype for dtype in _running.values()):
        return False
    if _running and torch.get_default_dtype() != waiter.dtype:
        return False  # code inside a running window set the default itself: wait it out
    for ahead in _queue:
        if ahead is waiter:
            return True
        if ahead.dtype != waiter.dtype:
            return False
    return True


def _run_in(thread: int, dtype: torch.dtype) -> None:
    """Make ``thread``'s innermost window run in ``dtype``, parking until it may."""
    global _baseline
    waiter = _Waiter(thread, dtype)
    _queue.append(waiter)
    _condition.notify_all()  # whoever waits to see this thread park
    try:
        _condition.wait_for(lambda: _may_run(waiter))
    finally:
        _queue.remove(waiter)
        _condition.notify_all()
    if _baseline is None:
        _baseline = torch.get_default_dtype()
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)
    _running[thread] = dtype


def _settle() -> None:
    """After a thread stopped running: the baseline back once nothing runs or is open."""
    global _baseline
    if not _stacks and _baseline is not None:
        if torch.get_default_dtype() != _baseline:
            torch.set_default_dtype(_baseline)
        _baseline = None
    _condition.notify_all()


def open_window(dtype: torch.dtype) -> None:
    """Open a window in the calling thread: returns once the process default is ``dtype``
    for this thread (parking it until then). Close it with :func:`close_window`.

    Raises torch's own error, with nothing changed, for a dtype torch cannot make its default.
    """
    if dtype not in _SETTABLE:
        torch.set_default_dtype(dtype)  # raises torch's error for what it refuses
        raise TypeError(f"metamode's dtype windows take {_SETTABLE}, not {dtype}")
    thread = threading.get_ident()
    with _condition:
        stack = _stacks.get(thread)
        if stack and _running.get(thread) == dtype:
            stack.append(dtype)
            return
        _running.pop(thread, None)  # parked, its outer window constrains no one
        try:
            _run_in(thread, dtype)
        except BaseException:  # interrupted while parked: back to the outer window
            if stack:
                _run_in(thread, stack[-1])
            else:
                _settle()
            raise
        _stacks.setdefault(thread, []).append(dtype)


def close_window() -> None:
    """Close the calling thread's innermost window (its outer one, if any, runs again)."""
    thread = threading.get_ident()
    with _condition:
        stack = _stacks[thread]
        stack.pop()
        if stack:
            # Not running at all when a wait for the outer window was interrupted: the
            # outer window stays open, and its own close_window closes it.
            if _running.get(thread) != stack[-1]:
                _running.pop(thread, None)
                _run_in(thread, stack[-1])
            return
        del _stacks[thread]
        _running.pop(thread, None)
        _settle()


def default_for_this_thread() -> torch.dtype:
    """The process default this thread would see now if no other thread had a window open:
    its innermost window's dtype, else the default before the first open window, else the
    process default. For a library call that builds in, or reads, whatever the default is
    (a load given no dtype): open a window in this dtype around it."""
    with _condition:
        stack = _stacks.get(threading.get_ident())
        if stack:
            return stack[-1]
        return _baseline if _baseline is not None else torch.get_default_dtype()


def windows_open_in_this_thread() -> int:
    with _condition:
        return len(_stacks.get(threading.get_ident(), ()))


def close_windows_opened_since(depth: int) -> None:
    """Close the calling thread's windows down to ``depth`` open ones, all of them even if
    a wait between two is interrupted (the first such exception is raised afterwards)."""
    interrupted: BaseException | None = None
    while windows_open_in_this_thread() > depth:
        try:
            close_window()
        except BaseException as error:
            interrupted = interrupted or error
    if interrupted is not None:
        raise interrupted


_calls = threading.local()


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: the other threads' windows are gone, and
    the default is what the first window found."""
    global _condition, _baseline
    _condition = threading.Condition(threading.Lock())
    mine = threading.get_ident()
    for table in (_stacks, _running):
        for thread in [t for t in table if t != mine]:
            del table[thread]
    _queue.clear()
    if _stacks:
        torch.set_default_dtype(_running[mine])
    elif _baseline is not None:
        torch.set_default_dtype(_baseline)
        _baseline = None


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def closing_call() -> Iterator[None]:
    """Mark the calling thread as inside a library call that closes, when it returns or
    raises, the windows opened during it (a load whose library restores the default dtype
    inline, with no context manager to route)."""
    depth = windows_open_in_this_thread()
    _calls.depth = getattr(_calls, "depth", 0) + 1
    try:
        yield
    finally:
        _calls.depth -= 1
        close_windows_opened_since(depth)


def inside_closing_call() -> bool:
    """True inside :func:`closing_call` in this thread: a window opened now will be closed."""
    return getattr(_calls, "depth", 0) > 0


@contextlib.contextmanager
def dtype_window(dtype: torch.dtype) -> Iterator[None]:
    """A dtype window as a context manager (see the module docstring)."""
    open_window(dtype)
    try:
        yield
    finally:
        close_window()


def wait_until(predicate: Callable[[WindowState], bool], timeout: float) -> bool:
    """Block until ``predicate(state())`` holds (re-checked at every change); False after
    ``timeout`` seconds. For tests and tools that need a thread parked or running."""
    with _condition:
        return _condition.wait_for(lambda: predicate(_state()), timeout)


def state() -> WindowState:
    """Where the windows stand now."""
    with _condition:
        return _state()


def _state() -> WindowState:
    return WindowState(
        baseline=_baseline,
        running=dict(_running),
        parked={w.thread: w.dtype for w in _queue},
        stacks={thread: tuple(stack) for thread, stack in _stacks.items()},
    )
