"""A context whose exit is refused (another thread closed it) stops acting in its owner.

A generator holding a context, closed or garbage-collected in another thread, must not
leave the context active in the thread that entered it. Were it left active, the owner
would keep building on meta (or in float64, or skipping init), ``active()`` would report
the context, and the owner's next ``with`` exit would raise an out-of-order error.
"""

from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch

import metamode
from metamode import ContextMisuseError
from metamode._core.stack import stack_depth, top
from metamode.integrations.transformers import LinspaceOnCpu


def _held(make):
    """A generator holding ``make()`` open across its one ``yield``."""
    with make():
        yield


def _close_in_other_thread(gen) -> list[BaseException]:
    errors: list[BaseException] = []

    def close() -> None:
        try:
            gen.close()
        except BaseException as error:
            errors.append(error)

    worker = threading.Thread(target=close, name="closer")
    worker.start()
    worker.join()
    return errors


def test_closed_from_other_thread_stops_acting_and_says_so():
    gen = _held(metamode.empty_weights)
    next(gen)
    assert torch.nn.Linear(2, 2).weight.is_meta
    mode = top()
    errors = _close_in_other_thread(gen)

    assert len(errors) == 1 and isinstance(errors[0], ContextMisuseError)
    message = str(errors[0])
    assert "metamode.empty_weights(device='meta'" in message
    assert repr(threading.current_thread().name) in message and "'closer'" in message
    assert "inert" in message and "thread that entered it" in message

    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # meta, for good, before
    assert metamode.active() is None
    assert not mode.is_active
    assert top() is mode  # still on the owner's stack: only the owner can pop it
    with metamode.skip_init():  # the owner's next context drops it
        assert stack_depth() == 1
    assert stack_depth() == 0


def test_garbage_collected_in_other_thread(monkeypatch):
    unraisable: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: unraisable.append(info.exc_value))
    holder = [_held(metamode.empty_weights)]
    next(holder[0])
    handed_over = threading.Event()

    def collect() -> None:
        handed_over.wait()
        holder.clear()  # the last reference dies here, in this thread
        gc.collect()

    worker = threading.Thread(target=collect, name="collector")
    worker.start()
    handed_over.set()
    worker.join()

    assert len(unraisable) == 1 and isinstance(unraisable[0], ContextMisuseError)
    assert "'collector'" in str(unraisable[0])
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    assert metamode.active() is None
    with metamode.empty_weights():  # the owner's next context works and drops it
        assert torch.nn.Linear(2, 2).weight.is_meta
        assert stack_depth() == 1
    assert stack_depth() == 0


def test_owner_with_block_exits_cleanly_past_an_inert_mode():
    # The inert mode sits above the outer block; left there, the outer exit would
    # raise "exited while ... (entered after it) is still active".
    with metamode.empty_weights(device="cpu") as outer:
        gen = _held(metamode.empty_weights)
        next(gen)
        assert torch.nn.Linear(2, 2).weight.is_meta
        _close_in_other_thread(gen)
        assert metamode.active() is outer
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    assert stack_depth() == 0


def test_inert_empty_weights_is_not_suspended_by_a_later_skip():
    with metamode.empty_weights() as outer:
        gen = _held(lambda: metamode.empty_weights(include_buffers=True))
        next(gen)
        inert = top()
        _close_in_other_thread(gen)
        with metamode.skip_empty_weights() as skip:
            assert skip._suspends == [outer]
            assert not inert._suspended
            assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
        assert torch.nn.Linear(2, 2).weight.is_meta
    assert stack_depth() == 0


def test_inert_skip_no_longer_suspends():
    with metamode.empty_weights(include_buffers=True) as outer:
        gen = _held(metamode.skip_empty_weights)
        next(gen)
        assert torch.empty(1).device.type == "cpu" and outer._suspended
        _close_in_other_thread(gen)
        assert not outer._suspended
        assert torch.empty(1).is_meta  # factory redirection is back
        assert torch.nn.Linear(2, 2).weight.is_meta  # and so are the hooks
    assert stack_depth() == 0


def _skip_init_probe():
    param = torch.nn.Parameter(torch.zeros(2))
    with torch.no_grad():
        torch.nn.init.ones_(param)
    return bool(param.eq(1).all())


@pytest.mark.parametrize(
    ("make", "probe", "acting", "plain"),
    [
        (metamode.skip_init, _skip_init_probe, False, True),
        (
            lambda: metamode.default_dtype(torch.float64),
            lambda: torch.zeros(1).dtype,
            torch.float64,
            torch.float32,
        ),
        (LinspaceOnCpu, lambda: torch.linspace(0, 1, 3).device.type, "cpu", "meta"),
        (
            lambda: metamode.empty_weights(include_buffers=True),
            lambda: torch.empty(1).device.type,
            "meta",
            "cpu",
        ),
    ],
    ids=["skip_init", "default_dtype", "LinspaceOnCpu", "empty_weights"],
)
def test_every_thread_scoped_mode_goes_inert(make, probe, acting, plain):
    # torch.device("meta") sits below, so LinspaceOnCpu's effect (cpu) is visible.
    device = torch.device("meta") if make is LinspaceOnCpu else torch.device("cpu")
    with device:
        gen = _held(make)
        next(gen)
        assert probe() == acting
        errors = _close_in_other_thread(gen)
        assert [type(e) for e in errors] == [ContextMisuseError]
        assert probe() == plain
        with metamode.skip_empty_weights():  # drops the inert mode before torch.device exits
            pass
    assert stack_depth() == 0


def test_refused_exit_retried_in_owner_finishes_quietly():
    context = metamode.default_dtype(torch.float16)
    context.__enter__()
    failed = threading.Event()

    def exit_here() -> None:
        with pytest.raises(ContextMisuseError, match="inert"):
            context.__exit__(None, None, None)
        failed.set()

    worker = threading.Thread(target=exit_here)
    worker.start()
    worker.join()
    assert failed.is_set()
    assert torch.zeros(1).dtype == torch.float32
    context.__exit__(None, None, None)  # the remedy: exit it in the owner
    assert stack_depth() == 0
    with pytest.raises(ContextMisuseError, match="not active"):
        context.__exit__(None, None, None)


def test_decorated_function_unaffected_by_inert_mode_below():
    gen = _held(metamode.empty_weights)
    next(gen)
    _close_in_other_thread(gen)

    @metamode.empty_weights()
    def build():
        return torch.nn.Linear(2, 2)

    assert build().weight.is_meta
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    assert stack_depth() == 0


def test_a_mode_class_whose_handler_ignores_inertness_is_refused_at_definition():
    from metamode._core.modes import ThreadScopedMode

    with pytest.raises(TypeError, match=r"Forgetful.__torch_function__ must pass calls through"):

        class Forgetful(ThreadScopedMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))


def test_a_static_handler_without_the_inert_check_is_refused_with_the_same_message():
    from metamode._core.modes import ThreadScopedMode

    with pytest.raises(TypeError, match=r"Static.__torch_function__ must pass calls through"):

        class Static(ThreadScopedMode):
            @staticmethod
            def __torch_function__(func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))
