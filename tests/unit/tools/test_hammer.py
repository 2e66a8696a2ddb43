"""metamode.testing.hammer(): catches stock PEFT's race, passes metamode.

The mechanics tests are deterministic: failures are triggered on a chosen
call, and the "all threads run at once" property is checked with a barrier
inside ``fn`` (a timeout there is a guard, never the synchronisation).
"""

from __future__ import annotations

import itertools
import sys
import threading

import pytest
import torch

import metamode
from metamode.lab.scenarios import TinyAttentionBlock
from metamode.testing import HammerReport, hammer
from tests.conftest import run_python

STOCK_THEN_SHIM = r"""
import itertools, json, threading
import metamode
from metamode.lab.scenarios import _inject, check_injected, TinyAttentionBlock
from metamode.testing import hammer

calls = itertools.count()

def build_and_inject():
    low_cpu_mem_usage = next(calls) % 2 == 0  # half the calls on meta, half real
    model = TinyAttentionBlock()
    _inject(model, low_cpu_mem_usage)
    problems = check_injected(model, low_cpu_mem_usage)
    assert not problems, problems

def summary(report):
    first = report.first_failure
    return {"ok": report.ok, "rounds": report.rounds, "calls": report.calls,
            "kinds": sorted({f.kind for f in report.failures}),
            "first": None if first is None else {
                "kind": first.kind, "message": first.message, "traceback": first.traceback},
            "text": str(report)}

metamode.enable_for_peft()  # PEFT's own low_cpu_mem_usage path, routed through metamode
shim = summary(hammer(build_and_inject, threads=8, rounds=25))
metamode.disable_for_peft()  # stock PEFT: this corrupts the interpreter, so it runs last
stock = summary(hammer(build_and_inject, threads=8, rounds=50))
print(json.dumps({"shim": shim, "stock": stock}))
"""


@pytest.fixture(scope="module")
def peft_runs() -> dict:
    return run_python(STOCK_THEN_SHIM)


@pytest.mark.slow
def test_hammer_catches_stock_peft_race(peft_runs):
    stock = peft_runs["stock"]
    assert stock["ok"] is False
    assert stock["rounds"] < 50  # stopped at the first failing round
    first = stock["first"]
    if first["kind"] == "exception":  # a thread's own model came out wrong
        assert "expected" in first["message"]  # "... on meta, expected cpu" or vice versa
        assert "Traceback (most recent call last)" in first["traceback"]
        assert "build_and_inject" in first["traceback"]
    else:  # every model right this round, but the patch outlived the contexts
        assert first["kind"] == "process state"
        assert "torch.nn.Module.register_parameter replaced" in first["message"]
    assert "FAILED" in stock["text"]


@pytest.mark.slow
def test_hammer_passes_peft_through_metamode(peft_runs):
    shim = peft_runs["shim"]
    assert shim["ok"] is True, shim["text"]
    assert (shim["rounds"], shim["calls"]) == (25, 200)


def test_hammer_passes_metamode_empty_weights():
    calls = itertools.count()
    lock = threading.Lock()

    def build() -> None:
        with lock:
            on_meta = next(calls) % 2 == 0
        if on_meta:
            with metamode.empty_weights():
                model = TinyAttentionBlock()
        else:
            model = TinyAttentionBlock()
        devices = {p.device.type for p in model.parameters()}
        assert devices == {"meta" if on_meta else "cpu"}, devices

    report = hammer(build, threads=8, rounds=30)
    assert report.ok, report
    assert (report.rounds, report.calls, report.first_failure) == (30, 240, None)


def test_every_thread_calls_fn_once_per_round_all_at_once():
    threads, rounds = 4, 5
    together = threading.Barrier(threads)  # passes only if all calls of a round overlap
    seen: list[int] = []
    lock = threading.Lock()

    def fn() -> None:
        assert sys.getswitchinterval() == pytest.approx(1e-6)
        together.wait(timeout=30)
        with lock:
            seen.append(threading.get_ident())

    old = sys.getswitchinterval()
    report = hammer(fn, threads=threads, rounds=rounds)
    assert report.ok, report
    assert report.calls == len(seen) == threads * rounds
    assert len(set(seen)) == threads
    assert sys.getswitchinterval() == old


def test_exception_is_reported_with_round_thread_and_traceback():
    calls = itertools.count()
    lock = threading.Lock()

    def fn() -> None:
        with lock:
            call = next(calls)
        if call == 9:  # the 10th call: in round 2 with 4 threads
            raise ValueError("tuner broke")

    report = hammer(fn, threads=4, rounds=10)
    assert not report.ok
    failure = report.first_failure
    assert failure is not None and len(report.failures) == 1
    assert (failure.round, failure.kind) == (2, "exception")
    assert failure.thread in range(4)
    assert failure.message == "ValueError: tuner broke"
    assert "Traceback (most recent call last)" in failure.traceback
    assert 'raise ValueError("tuner broke")' in failure.traceback
    assert report.rounds == 3  # stopped after the failing round
    assert "tuner broke" in str(report)


def test_mode_left_on_a_worker_thread_is_a_failure_and_is_cleaned_up():
    calls = itertools.count()
    lock = threading.Lock()

    def fn() -> None:
        with lock:
            call = next(calls)
        if call == 0:
            metamode.empty_weights().__enter__()  # never exited

    report = hammer(fn, threads=2, rounds=3, stop_on_failure=False)
    assert [(f.round, f.kind) for f in report.failures] == [(0, "thread state")]
    assert "metamode.empty_weights(" in report.failures[0].message
    assert report.rounds == 3


def test_process_state_change_is_caught_after_the_round():
    def fn() -> None:
        torch.set_default_dtype(torch.float64)

    try:
        report = hammer(fn, threads=2, rounds=3)
    finally:
        torch.set_default_dtype(torch.float32)
    assert [(f.round, f.thread, f.kind) for f in report.failures] == [(0, None, "process state")]
    assert "default dtype torch.float32 -> torch.float64" in report.failures[0].message


def test_bad_arguments():
    with pytest.raises(ValueError, match="threads and rounds"):
        hammer(lambda: None, threads=0)
    with pytest.raises(TypeError, match="callable"):
        hammer(None)  # type: ignore[arg-type]
    assert isinstance(hammer(lambda: None, threads=1, rounds=1), HammerReport)
