"""Thread helpers shared by the scenarios, the tiny-pipeline fixture and the tests.

Events and barriers decide the order; the timeouts here only keep a bug from
hanging the run, and are never used for ordering.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

__all__ = ["WAIT_S", "run_threads", "wait"]

WAIT_S = 60.0


def wait(event: threading.Event, what: str = "the other thread") -> None:
    """Block until ``event`` is set; raise TimeoutError naming ``what`` after WAIT_S."""
    if not event.wait(WAIT_S):
        raise TimeoutError(f"deadlocked waiting for {what}")


def run_threads(targets: Iterable[Callable[[], object]]) -> None:
    """Start one thread per target, then join them all."""
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
