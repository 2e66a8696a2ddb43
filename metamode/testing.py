"""Testing helpers for code that builds models on ``meta``: :func:`hammer`, e.g. for a
tuner's ``low_cpu_mem_usage`` path (docs/guides/tools.md, "Test your tuner's
low_cpu_mem_usage path").
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from metamode._core.stack import modes_innermost_first, remove, stack_depth
from metamode._diagnostics.invariants import snapshot

__all__ = ["HammerFailure", "HammerReport", "hammer"]


@dataclass(frozen=True)
class HammerFailure:
    """One thing that went wrong in one round.

    Attributes:
        round: 0-based round number.
        thread: the worker (0 .. threads-1), or None for a process-wide check
            made in the calling thread after the round.
        kind: ``"exception"`` (``fn`` raised), ``"thread state"`` (``fn`` left
            torch-function modes on its thread's stack), ``"process state"``
            (global torch state changed) or ``"timeout"``.
        message: what happened.
        traceback: the formatted traceback for ``"exception"``, else ``""``.
    """

    round: int
    thread: int | None
    kind: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        where = "after the round" if self.thread is None else f"thread {self.thread}"
        text = f"round {self.round}, {where}: {self.kind}: {self.message}"
        return f"{text}\n{self.traceback.rstrip()}" if self.traceback else text


@dataclass(frozen=True)
class HammerReport:
    """What :func:`hammer` saw. ``ok`` is True when nothing failed.

    ``rounds`` is the number of rounds run (fewer than requested when it
    stopped at the first failing round); ``calls`` is how many times ``fn``
    was called. ``str()`` shows the first failure's traceback.
    """

    threads: int
    rounds: int
    rounds_requested: int
    calls: int
    failures: tuple[HammerFailure, ...]

    @property
    def ok(self) -> bool:
        """True when no round failed."""
        return not self.failures

    @property
    def first_failure(self) -> HammerFailure | None:
        """The first failure recorded, or None when ``ok``."""
        return self.failures[0] if self.failures else None

    def __str__(self) -> str:
        run = f"{self.rounds} of {self.rounds_requested} rounds x {self.threads} threads"
        if self.ok:
            return f"hammer: ok ({run}, {self.calls} calls)"
        failed_rounds = len({f.round for f in self.failures})
        return (
            f"hammer: FAILED: {len(self.failures)} failures in {failed_rounds} rounds ({run}, "
            f"{self.calls} calls)\nfirst failure: {self.first_failure}"
        )

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(str(self))


def hammer(
    fn: Callable[[], object],
    threads: int = 8,
    rounds: int = 200,
    switch_interval: float = 1e-6,
    *,
    stop_on_failure: bool = True,
    timeout: float = 60.0,
) -> HammerReport:
    """Call ``fn()`` in ``threads`` threads at once, ``rounds`` times; check after each round.

    Each round, a barrier releases every worker thread at the same moment, each calls
    ``fn()`` with no arguments, and the calling thread waits for all of them. Then it checks:

    * every ``fn()`` returned (an exception is a failure, with its traceback);
    * every worker's torch-function mode stack is as deep as before its call
      (leftover modes are recorded, then removed so rounds stay independent);
    * global torch state -- ``torch.nn.Module`` and ``torch.nn.init``
      attributes, factories, registration hooks, default dtype/device, the
      calling thread's mode stack -- is what it was before the first round.

    ``fn`` should itself raise if its own result is wrong. Worker threads are reused across
    rounds. Meanwhile ``sys.setswitchinterval(switch_interval)`` is in force process-wide
    (restored afterwards), so races show up within a few rounds.

    Args:
        fn: the code under test.
        threads: worker threads per round.
        rounds: rounds to run.
        switch_interval: the interpreter's thread switch interval meanwhile.
        stop_on_failure: stop after the first round with a failure (later
            rounds would run in a process the failure may have corrupted).
        timeout: seconds one round may take (one deadline for the round and its worker
            threads) before it counts as a deadlock; blocked threads are abandoned
            (daemon threads; each finishes on its own if ``fn`` ever returns).

    Returns a :class:`HammerReport`. The process is not repaired: after a
    failure, ``metamode.doctor(repair=True)`` restores torch's originals.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    if threads < 1 or rounds < 1:
        raise ValueError(f"threads and rounds must be >= 1 (got {threads}, {rounds})")
    if switch_interval <= 0:
        raise ValueError(f"switch_interval must be > 0 (got {switch_interval})")

    start = threading.Barrier(threads + 1)
    end = threading.Barrier(threads + 1)
    lock = threading.Lock()
    failures: list[HammerFailure] = []
    calls = [0]
    stopping = threading.Event()

    def record(failure: HammerFailure) -> None:
        with lock:
            failures.append(failure)

    def worker(index: int) -> None:
        for round_index in range(rounds):
            try:
                start.wait()
            except threading.BrokenBarrierError:
                return
            if stopping.is_set():
                return
            depth = stack_depth()
            try:
                fn()
            except BaseException as error:
                record(
                    HammerFailure(
                        round_index,
                        index,
                        "exception",
                        f"{type(error).__name__}: {error}",
                        traceback.format_exc(),
                    )
                )
            left = list(modes_innermost_first())[: max(stack_depth() - depth, 0)]
            if left:
                record(
                    HammerFailure(
                        round_index,
                        index,
                        "thread state",
                        f"fn() left {len(left)} torch-function mode(s) on its thread's stack: "
                        f"{left!r}",
                    )
                )
                for mode in left:
                    remove(mode)
            with lock:
                calls[0] += 1
            try:
                end.wait()
            except threading.BrokenBarrierError:
                return

    before = snapshot()
    reported: list[str] = []
    completed = 0
    timed_out = False
    old_interval = sys.getswitchinterval()
    workers = [
        threading.Thread(target=worker, args=(i,), name=f"hammer-{i}", daemon=True)
        for i in range(threads)
    ]
    sys.setswitchinterval(switch_interval)
    try:
        for thread in workers:
            thread.start()
        for round_index in range(rounds):
            deadline = time.monotonic() + timeout
            try:
                start.wait(_left(deadline))
                end.wait(_left(deadline))
            except threading.BrokenBarrierError:
                record(
                    HammerFailure(
                        round_index,
                        None,
                        "timeout",
                        f"the round did not finish within {timeout} s (fn() deadlocked or "
                        f"blocked?); its threads were abandoned",
                    )
                )
                timed_out = True
                break
            completed = round_index + 1
            changes = snapshot().changes_since(before)
            if changes and changes != reported:
                reported = changes
                record(
                    HammerFailure(
                        round_index,
                        None,
                        "process state",
                        "global torch state changed: " + "; ".join(changes),
                    )
                )
            if failures and stop_on_failure:
                break
    finally:
        stopping.set()
        start.abort()
        end.abort()
        sys.setswitchinterval(old_interval)
        # Workers blocked in fn() cannot be interrupted: after a timeout they
        # get no more time at all, else the wait would add up per thread.
        deadline = time.monotonic() + (0 if timed_out else timeout)
        for thread in workers:
            thread.join(_left(deadline))
    with lock:
        return HammerReport(threads, completed, rounds, calls[0], tuple(failures))


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
