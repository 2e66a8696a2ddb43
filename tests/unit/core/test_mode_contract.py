"""The ThreadScopedMode contract, checked once for every context class.

Every metamode context derives from :class:`metamode._core.modes.ThreadScopedMode`
and inherits its rules: single use, refused exits that would corrupt a stack
(never entered, out of order, from another thread), inertness after a foreign
exit, and the decorator protocol (a fresh copy per call, no generator or
coroutine targets, reuse of an equal enclosing context only where
``_settings()`` says so). Each test below runs for every class in
``FACTORIES``; ``test_every_mode_class_has_a_factory`` fails when a new class
is added without one.

Concurrency is ordered with Events and Barriers only; a Barrier's timeout only
keeps a bug from hanging the run. Exceptions raised in worker threads are
collected and re-raised in the test's thread.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import metamode
from metamode import ContextMisuseError
from metamode._contexts.default_dtype import DefaultDtype
from metamode._contexts.skip_init import SkipInit
from metamode._core import stack as _stack
from metamode._core.modes import EmptyWeights, KeepRegistered, SkipEmptyWeights, ThreadScopedMode
from metamode._core.stack import stack_depth
from metamode._torch import pop_mode
from metamode.integrations import peft as _peft_shim
from metamode.integrations._exact_skip import GuardLoadedTensors, SkipLibraryInit
from metamode.integrations.transformers import LinspaceOnCpu, NoInitWeights, NoTieWeights
from metamode.lab.threads import WAIT_S

# One factory per class: each call builds a fresh, never-entered context.
FACTORIES: dict[type[ThreadScopedMode], Callable[[], ThreadScopedMode]] = {
    EmptyWeights: metamode.empty_weights,
    SkipEmptyWeights: metamode.skip_empty_weights,
    SkipInit: metamode.skip_init,
    DefaultDtype: lambda: metamode.default_dtype(torch.float64),
    LinspaceOnCpu: LinspaceOnCpu,
    SkipLibraryInit: lambda: SkipLibraryInit(frozenset({"normal_"})),
    GuardLoadedTensors: lambda: GuardLoadedTensors(frozenset({"normal_"}), ("torch.nn.init",)),
    NoInitWeights: lambda: NoInitWeights(frozenset({"normal_"})),
    NoTieWeights: lambda: NoTieWeights(None),
    _peft_shim._ShimEmptyWeights: _peft_shim.init_empty_weights,
}
# Bases that are never entered themselves (their subclasses are in FACTORIES).
ABSTRACT = {KeepRegistered}

# The packages whose modules define context classes.
_PACKAGES = ("metamode._core", "metamode._contexts", "metamode.integrations")

every_mode = pytest.mark.parametrize(
    "make", list(FACTORIES.values()), ids=[cls.__name__ for cls in FACTORIES]
)


@pytest.fixture(autouse=True)
def _stack_depth_restored() -> Iterator[None]:
    """Every scenario leaves this thread's stack as deep as it found it.

    On a mismatch the stack is drained back (so one failure does not cascade)
    and the test fails.
    """
    base = stack_depth()
    yield
    depth = stack_depth()
    while stack_depth() > base:
        pop_mode()
    assert depth == base, f"the scenario left the mode stack at depth {depth}, not {base}"


def _in_thread(target: Callable[[], Any], name: str = "worker") -> BaseException | None:
    """Run ``target`` in a new thread; return what it raised (None if nothing)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as error:  # handed to the calling thread
            raised.append(error)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive(), f"thread {name!r} did not finish"
    return raised[0] if raised else None


def _exit_in_other_thread(context: ThreadScopedMode) -> ContextMisuseError:
    raised = _in_thread(lambda: context.__exit__(None, None, None), name="foreign-exit")
    if not isinstance(raised, ContextMisuseError):
        raise AssertionError(f"a foreign exit raised {raised!r}, not ContextMisuseError")
    return raised


def _top() -> Any:
    return _stack.top()


def _modes() -> list[Any]:
    return list(_stack.modes_innermost_first())


# -- the parametrization is complete ------------------------------------------------------


def _metamode_mode_classes() -> set[type]:
    for package_name in _PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            importlib.import_module(info.name)
    found: set[type] = set()
    pending = list(ThreadScopedMode.__subclasses__())
    while pending:
        cls = pending.pop()
        if cls in found:
            continue
        pending.extend(cls.__subclasses__())
        # Classes tests define (tests.*) are not part of the package.
        if cls.__module__ == "metamode" or cls.__module__.startswith("metamode."):
            found.add(cls)
    return found


def test_every_mode_class_has_a_factory():
    classes = _metamode_mode_classes()
    assert EmptyWeights in classes and NoInitWeights in classes, "the walk found the classes"
    missing = sorted(cls.__qualname__ for cls in classes - set(FACTORIES) - ABSTRACT)
    assert not missing, f"ThreadScopedMode subclasses without a factory in FACTORIES: {missing}"
    stale = sorted(cls.__qualname__ for cls in set(FACTORIES) - classes)
    assert not stale, f"FACTORIES names classes that are not metamode modes: {stale}"


@pytest.mark.parametrize(
    ("cls", "make"), list(FACTORIES.items()), ids=[c.__name__ for c in FACTORIES]
)
def test_each_factory_builds_a_new_context_of_its_class(cls, make):
    first, second = make(), make()
    assert type(first) is cls and first is not second
    assert not first.is_active and not first._inert
    fresh = first._fresh()
    assert type(fresh) is cls and fresh is not first and not fresh.is_active
    assert repr(fresh) == repr(first) and fresh._settings() == first._settings()


# -- single use, exits that are refused ---------------------------------------------------


@every_mode
def test_a_context_is_active_exactly_between_enter_and_exit(make):
    base = stack_depth()
    context = make()
    assert not context.is_active
    with context as entered:
        assert entered is context and context.is_active
        assert _top() is context and stack_depth() == base + 1
    assert not context.is_active and stack_depth() == base


@every_mode
def test_entering_a_used_context_again_is_refused(make):
    base = stack_depth()
    context = make()
    with context:
        pass
    with pytest.raises(ContextMisuseError, match="single-use"):
        context.__enter__()
    assert stack_depth() == base and not context.is_active


@every_mode
def test_entering_an_active_context_again_is_refused_and_pushes_nothing(make):
    base = stack_depth()
    context = make()
    with context:
        with pytest.raises(ContextMisuseError, match="single-use"):
            context.__enter__()
        assert context.is_active and _top() is context
        assert stack_depth() == base + 1
    assert stack_depth() == base and not context.is_active


@every_mode
def test_exiting_a_context_never_entered_is_refused(make):
    base = stack_depth()
    context = make()
    with pytest.raises(ContextMisuseError, match="not active"):
        context.__exit__(None, None, None)
    assert stack_depth() == base and not context.is_active


@every_mode
def test_exiting_a_context_twice_is_refused(make):
    base = stack_depth()
    context = make()
    with context:
        pass
    with pytest.raises(ContextMisuseError, match="not active"):
        context.__exit__(None, None, None)
    assert stack_depth() == base


@every_mode
@pytest.mark.parametrize("newer_count", [1, 2, 3])
def test_out_of_order_exit_removes_only_that_context_and_keeps_the_newer_in_order(
    make, newer_count
):
    # What __exit__ does, for one newer context as for several: take only the
    # exiting context off the stack, leave every newer one active and in its
    # place, and raise naming them (innermost first). The newer contexts are
    # one of the same class, then others.
    base = stack_depth()
    below = _modes()
    outer = make()
    makers = list(FACTORIES.values())
    start = makers.index(make)
    newer = [makers[(start + i) % len(makers)]() for i in range(newer_count)]
    outer.__enter__()
    for context in newer:
        context.__enter__()
    assert _modes() == [*reversed(newer), outer, *below]

    with pytest.raises(ContextMisuseError, match="still active") as refused:
        outer.__exit__(None, None, None)
    assert "reverse order" in str(refused.value)
    assert repr(list(reversed(newer))) in str(refused.value)

    assert not outer.is_active
    assert _modes() == [*reversed(newer), *below], "the newer contexts moved or left"
    assert all(context.is_active for context in newer)
    assert stack_depth() == base + newer_count
    for context in reversed(newer):
        context.__exit__(None, None, None)
    assert stack_depth() == base and _modes() == below
    with pytest.raises(ContextMisuseError, match="not active"):
        outer.__exit__(None, None, None)


# -- exit from another thread -----------------------------------------------------------


@every_mode
def test_exit_from_another_thread_is_refused_and_leaves_the_context_inert(make):
    base = stack_depth()
    context = make()
    context.__enter__()
    error = _exit_in_other_thread(context)
    message = str(error)
    assert "entered in thread" in message and "'foreign-exit'" in message
    assert "inert" in message
    assert context._inert and not context.is_active
    # Only the owner can take it off its stack; until then it sits there, ignored.
    assert _top() is context and stack_depth() == base + 1
    assert _stack.innermost(ThreadScopedMode, skip_inert=True) is not context
    context.__exit__(None, None, None)  # retried in the owner: finishes quietly
    assert stack_depth() == base and not context.is_active
    with pytest.raises(ContextMisuseError, match="not active"):
        context.__exit__(None, None, None)


@every_mode
def test_the_owner_drops_an_inert_context_when_it_next_enters_one(make):
    base = stack_depth()
    context = make()
    context.__enter__()
    _exit_in_other_thread(context)
    with make() as following:
        assert _modes()[:1] == [following] and context not in _modes()
        assert stack_depth() == base + 1
    assert stack_depth() == base and not context.is_active


@every_mode
def test_the_owner_drops_an_inert_context_when_it_next_exits_one(make):
    base = stack_depth()
    outer = make()
    with outer:
        context = make()
        context.__enter__()
        _exit_in_other_thread(context)
        assert _top() is context
    # outer's exit dropped the inert context above it instead of refusing as out of order.
    assert stack_depth() == base and context not in _modes()
    assert not outer.is_active and not context.is_active


@every_mode
def test_a_decorated_call_pushes_a_fresh_context_past_an_inert_one(make):
    base = stack_depth()
    context = make()
    context.__enter__()
    _exit_in_other_thread(context)
    seen: list[Any] = []

    @make()
    def call() -> None:
        seen.append((_modes(), stack_depth(), _top().is_active))

    call()
    ((modes, depth, active),) = seen
    assert modes[0] is not context and type(modes[0]) is type(context) and active
    assert context not in modes and depth == base + 1
    assert stack_depth() == base


# -- exceptions -----------------------------------------------------------------------------


@every_mode
def test_an_exception_inside_propagates_and_pops_the_context(make):
    base = stack_depth()
    outer, inner, innermost = make(), make(), make()
    with outer:
        with pytest.raises(KeyError, match="boom"), inner, innermost:
            raise KeyError("boom")
        assert not inner.is_active and not innermost.is_active and outer.is_active
        assert _top() is outer and stack_depth() == base + 1
    assert stack_depth() == base and not outer.is_active


# -- decorator protocol -----------------------------------------------------------------------


@every_mode
def test_each_decorated_call_runs_under_a_fresh_context(make):
    base = stack_depth()
    decorator = make()
    seen: list[Any] = []

    @decorator
    def call(value: int, *, times: int) -> int:
        """Doc."""
        seen.append(_top())
        assert stack_depth() == base + 1
        return value * times

    assert call.__name__ == "call" and call.__doc__ == "Doc." and call.__wrapped__
    assert call(3, times=2) == 6 and call(4, times=2) == 8
    first, second = seen
    for context in seen:
        assert type(context) is type(decorator) and context is not decorator
        assert repr(context) == repr(decorator) and context._settings() == decorator._settings()
        assert not context.is_active
    assert first is not second
    assert not decorator.is_active and stack_depth() == base


@every_mode
def test_an_exception_in_a_decorated_call_propagates_and_pops_the_context(make):
    base = stack_depth()

    @make()
    def fail() -> None:
        assert stack_depth() == base + 1
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        fail()
    assert stack_depth() == base
    with pytest.raises(KeyError, match="boom"):
        fail()  # and the decorator still works
    assert stack_depth() == base


@every_mode
def test_a_decorated_function_runs_in_several_threads_at_once(make):
    threads = 4
    inside = threading.Barrier(threads, timeout=WAIT_S)
    checked = threading.Barrier(threads, timeout=WAIT_S)
    decorator = make()
    seen: dict[int, Any] = {}
    errors: list[BaseException] = []

    @decorator
    def call() -> None:
        mine = _top()
        seen[threading.get_ident()] = mine
        inside.wait()  # every thread is inside its call now
        assert _top() is mine and mine.is_active and stack_depth() == 1
        assert mine._owner == threading.get_ident()
        checked.wait()  # no call returns before all checked theirs

    def run() -> None:
        try:
            assert stack_depth() == 0
            call()
            assert stack_depth() == 0
        except BaseException as error:
            errors.append(error)
            inside.abort()  # release the others instead of leaving them waiting
            checked.abort()

    workers = [threading.Thread(target=run, name=f"call-{i}") for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(WAIT_S)
    assert not any(worker.is_alive() for worker in workers), "a decorated call hung"
    # The first error is the cause; BrokenBarrierError in the others only follows from it.
    for error in errors:
        if not isinstance(error, threading.BrokenBarrierError):
            raise error
    if errors:
        raise errors[0]
    contexts = list(seen.values())
    assert len(seen) == threads and len({id(context) for context in contexts}) == threads
    assert all(type(context) is type(decorator) for context in contexts)
    assert decorator not in contexts and not any(context.is_active for context in contexts)


@every_mode
def test_decorated_recursion_reuses_an_equal_active_context(make):
    # A call directly inside an equal (same class, same _settings()), active
    # context runs in it rather than pushing another.
    base = stack_depth()
    decorator = make()
    depths: list[int] = []
    tops: list[Any] = []

    @decorator
    def recurse(levels: int) -> None:
        depths.append(stack_depth())
        tops.append(_top())
        if levels:
            recurse(levels - 1)

    recurse(3)
    assert depths == [base + 1] * 4 and all(top is tops[0] for top in tops)
    assert stack_depth() == base


def _generator():
    yield


async def _coroutine() -> None:
    return None


async def _async_generator():
    yield


@every_mode
@pytest.mark.parametrize(
    ("target", "match"),
    [(_generator, "generator"), (_coroutine, "async"), (_async_generator, "async")],
    ids=["generator", "coroutine", "async-generator"],
)
def test_decorating_a_generator_or_coroutine_function_is_refused(make, target, match):
    base = stack_depth()
    decorator = make()
    with pytest.raises(TypeError, match=match):
        decorator(target)
    assert not decorator.is_active and stack_depth() == base
