"""hammer gives up on a deadlocked round after one deadline (issue 12, section 6).

The deadlock is forced, not hoped for: ``fn`` blocks on an Event that is set
only after ``hammer`` has returned, so the round can never finish in time.
Releasing it afterwards lets every worker thread end: none leaks.
"""

from __future__ import annotations

import threading
import time

from metamode.testing import hammer


def _hammer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hammer-")]


def test_a_deadlocked_round_is_a_timeout_failure_after_one_deadline_and_no_thread_leaks():
    assert _hammer_threads() == []
    release = threading.Event()
    entered = threading.Semaphore(0)

    def blocked() -> None:
        entered.release()
        release.wait()

    threads, timeout = 4, 0.5
    started = time.monotonic()
    try:
        report = hammer(blocked, threads=threads, rounds=3, timeout=timeout)
        waited = time.monotonic() - started
    finally:
        release.set()
    assert not report.ok and report.rounds == 0 and report.calls == 0
    (failure,) = report.failures
    assert failure.kind == "timeout" and failure.round == 0 and failure.thread is None
    assert f"within {timeout} s" in failure.message
    # Every worker did reach fn(): the round really was stuck inside it.
    for _ in range(threads):
        assert entered.acquire(timeout=60)
    # One deadline for the round and the abandoned threads together. Before,
    # each of the stuck threads got its own `timeout` to join on top of the
    # round's: (threads + 1) x timeout = 2.5 s here (9 minutes with the
    # defaults). A liveness bound with a 4x margin, not a performance number.
    assert waited < threads * timeout, f"gave up after {waited:.2f} s"
    for thread in _hammer_threads():
        thread.join(60)
    assert _hammer_threads() == []
