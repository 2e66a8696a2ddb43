"""Dtype windows: threads that need one dtype share the process default, threads that need
another take turns, and the default ends where it was. Every interleaving here is forced
with Events or by waiting for a thread to be seen parked; none uses a sleep."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from metamode._core import dtype_windows
from metamode._core.dtype_windows import WindowState, dtype_window
from metamode.lab.threads import WAIT_S, wait

pytestmark = pytest.mark.per_interpreter


def _until(predicate: Callable[[WindowState], bool], what: str) -> None:
    if not dtype_windows.wait_until(predicate, WAIT_S):
        raise TimeoutError(f"deadlocked waiting for {what}")


class _Thread(threading.Thread):
    """A thread that records what it saw and re-raises its error on ``finish()``."""

    def __init__(self, body: Callable[[], object]) -> None:
        super().__init__()
        self.body = body
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.body()
        except BaseException as error:
            self.error = error

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


def test_a_window_sets_the_default_and_the_last_close_puts_it_back():
    with dtype_window(torch.float16):
        assert torch.get_default_dtype() == torch.float16
        assert dtype_windows.state().baseline == torch.float32
        with dtype_window(torch.float16):
            assert dtype_windows.windows_open_in_this_thread() == 2
        assert torch.get_default_dtype() == torch.float16
    assert torch.get_default_dtype() == torch.float32
    assert dtype_windows.state() == WindowState(baseline=None)


def test_same_dtype_windows_of_two_threads_are_open_at_once():
    a_open, b_checked = threading.Event(), threading.Event()
    seen = {}

    def a() -> None:
        with dtype_window(torch.bfloat16):
            a_open.set()
            wait(b_checked, "B")

    def b() -> None:
        wait(a_open, "A")
        with dtype_window(torch.bfloat16):
            seen["running"] = sorted(map(str, dtype_windows.state().running.values()))
            seen["default"] = torch.get_default_dtype()
        b_checked.set()

    threads = [_Thread(a), _Thread(b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.finish()
    assert seen == {"running": ["torch.bfloat16", "torch.bfloat16"], "default": torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_another_dtype_parks_until_the_running_windows_close():
    a_open, a_release = threading.Event(), threading.Event()
    log = []

    def a() -> None:
        with dtype_window(torch.float16):
            log.append(("A runs in", torch.get_default_dtype()))
            a_open.set()
            wait(a_release, "the test")
            log.append(("A still in", torch.get_default_dtype()))

    def b() -> None:
        wait(a_open, "A")
        with dtype_window(torch.float32):
            log.append(("B runs in", torch.get_default_dtype()))

    ta, tb = _Thread(a), _Thread(b)
    ta.start()
    tb.start()
    _until(lambda s: tb.ident in s.parked, "B to park")
    assert torch.get_default_dtype() == torch.float16  # what every other thread sees now
    a_release.set()
    ta.finish()
    tb.finish()
    assert log == [
        ("A runs in", torch.float16),
        ("A still in", torch.float16),
        ("B runs in", torch.float32),
    ]
    assert torch.get_default_dtype() == torch.float32


def test_waiters_are_served_in_arrival_order_so_no_dtype_starves():
    """A float16 window runs; B waits for float32; C, a later float16, queues behind B."""
    a_open, a_release, b_in, c_in = (threading.Event() for _ in range(4))
    order = []

    def a() -> None:
        with dtype_window(torch.float16):
            a_open.set()
            wait(a_release, "the test")
        order.append("A closed")

    def opener(name: str, dtype: torch.dtype, inside: threading.Event) -> Callable[[], None]:
        def run() -> None:
            with dtype_window(dtype):
                order.append(f"{name} runs")
                inside.set()

        return run

    ta = _Thread(a)
    ta.start()
    wait(a_open, "A")
    tb = _Thread(opener("B", torch.float32, b_in))
    tb.start()
    _until(lambda s: tb.ident in s.parked, "B to park")
    tc = _Thread(opener("C", torch.float16, c_in))
    tc.start()
    _until(lambda s: tc.ident in s.parked, "C to park behind B")
    assert not c_in.is_set()
    a_release.set()
    for thread in (ta, tb, tc):
        thread.finish()
    assert order.index("B runs") < order.index("C runs")


def test_a_nested_window_of_another_dtype_runs_alone_and_the_outer_one_resumes():
    a_outer, a_release, b_open, b_release = (threading.Event() for _ in range(4))
    seen = []

    def a() -> None:
        with dtype_window(torch.float16):
            a_outer.set()
            wait(a_release, "the test")
            with dtype_window(torch.float32):  # B still runs float16: A parks
                seen.append(("A inner", torch.get_default_dtype()))
            seen.append(("A outer again", torch.get_default_dtype()))

    def b() -> None:
        wait(a_outer, "A")
        with dtype_window(torch.float16):
            b_open.set()
            wait(b_release, "the test")
            seen.append(("B", torch.get_default_dtype()))

    ta, tb = _Thread(a), _Thread(b)
    ta.start()
    tb.start()
    wait(b_open, "B")
    a_release.set()
    _until(lambda s: ta.ident in s.parked, "A's inner window to park")
    b_release.set()
    ta.finish()
    tb.finish()
    assert seen == [
        ("B", torch.float16),
        ("A inner", torch.float32),
        ("A outer again", torch.float16),
    ]
    assert torch.get_default_dtype() == torch.float32


def test_an_error_inside_a_window_still_puts_the_default_back():
    with pytest.raises(RuntimeError, match="boom"), dtype_window(torch.float16):
        raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32
    assert dtype_windows.state() == WindowState(baseline=None)


def test_close_windows_opened_since_closes_what_a_call_left_open():
    dtype_windows.open_window(torch.float16)
    depth = dtype_windows.windows_open_in_this_thread()
    dtype_windows.open_window(torch.bfloat16)
    dtype_windows.open_window(torch.bfloat16)
    dtype_windows.close_windows_opened_since(depth)
    assert torch.get_default_dtype() == torch.float16
    dtype_windows.close_windows_opened_since(0)
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.float8_e4m3fn])
def test_a_dtype_torch_cannot_make_its_default_raises_torchs_error_and_changes_nothing(dtype):
    with pytest.raises(TypeError), dtype_window(dtype):
        pass
    assert dtype_windows.state() == WindowState(baseline=None)
    assert torch.get_default_dtype() == torch.float32


def test_a_process_default_other_than_float32_is_the_baseline_put_back():
    torch.set_default_dtype(torch.float64)
    try:
        with dtype_window(torch.float16):
            assert torch.get_default_dtype() == torch.float16
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_child_forked_while_another_threads_window_is_open_starts_without_it():
    import multiprocessing

    a_open, a_release = threading.Event(), threading.Event()

    def a() -> None:
        with dtype_window(torch.float16):
            a_open.set()
            wait(a_release, "the test")

    thread = _Thread(a)
    thread.start()
    wait(a_open, "A")
    try:
        context = multiprocessing.get_context("fork")
        with context.Pool(1) as pool:
            seen = pool.apply_async(_in_a_forked_child).get(timeout=WAIT_S)
    finally:
        a_release.set()
        thread.finish()
    assert seen == ("torch.float32", "torch.bfloat16", "torch.float32", {})


def _in_a_forked_child() -> tuple:
    before = str(torch.get_default_dtype())
    with dtype_window(torch.bfloat16):  # would park forever behind the parent's thread A
        inside = str(torch.get_default_dtype())
    return before, inside, str(torch.get_default_dtype()), dtype_windows.state().stacks
