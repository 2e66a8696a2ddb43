"""hammer gives up on a deadlocked round after one deadline.

The deadlock is forced, not hoped for: ``fn`` blocks on an Event that is set
only after ``hammer`` has returned, so the round can never finish in time.
Releasing it afterwards lets every worker thread end: none leaks.
"""

from __future__ import annotations

import threading

from metamode.testing import hammer


def _hammer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hammer-")]


def test_a_deadlocked_round_is_a_timeout_failure_after_one_deadline_and_no_thread_leaks(
    monkeypatch,
):
    assert _hammer_threads() == []
    joins: list[float | None] = []  # the timeouts hammer gives its worker threads to end
    join = threading.Thread.join

    def recorded_join(self, timeout=None):
        if self.name.startswith("hammer-"):
            joins.append(timeout)
        return join(self, timeout)

    monkeypatch.setattr(threading.Thread, "join", recorded_join)
    release = threading.Event()
    entered = threading.Semaphore(0)

    def blocked() -> None:
        entered.release()
        release.wait()

    threads, timeout = 4, 0.5
    try:
        report = hammer(blocked, threads=threads, rounds=3, timeout=timeout)
    finally:
        release.set()
    assert not report.ok and report.rounds == 0 and report.calls == 0
    (failure,) = report.failures
    assert failure.kind == "timeout" and failure.round == 0 and failure.thread is None
    assert f"within {timeout} s" in failure.message
    # Every worker did reach fn(): the round really was stuck inside it.
    for _ in range(threads):
        assert entered.acquire(timeout=60)
    # One deadline for the round and the abandoned threads together: once the round
    # timed out, the stuck workers get no time of their own. Before, each got
    # `timeout` on top of the round's: (threads + 1) x timeout (9 minutes with the
    # defaults).
    assert joins == [0.0] * threads
    for thread in _hammer_threads():
        thread.join(60)
    assert _hammer_threads() == []
