"""Helpers for tests that run builds and materializes in several threads: every interleaving
is forced with events, never with sleeps."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

import metamode

WAIT_S = 30.0  # guards against a hang; never used for ordering


@pytest.fixture(autouse=True)
def default_generator_kept() -> Iterator[None]:
    """Builds in threads leave the default generator in marker states: put it back."""
    state = torch.default_generator.get_state()
    yield
    torch.default_generator.set_state(state)


def run_threads(*targets: Callable[[], object], names: tuple[str, ...] = ()) -> None:
    """Run each target in a thread of its own; re-raise the first error."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as error:
                errors.append(error)

        return run

    threads = [
        threading.Thread(target=guarded(t), name=names[i] if i < len(names) else None)
        for i, t in enumerate(targets)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive(), f"{thread.name} hangs"
    if errors:
        raise errors[0]


def at_once(*calls: Callable[[], object]) -> None:
    """Run each call in a thread of its own, all released together by a barrier."""
    start = threading.Barrier(len(calls))

    def after_start(call: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            start.wait(WAIT_S)
            call()

        return run

    run_threads(*[after_start(call) for call in calls])


class Turns:
    """Strict turn-taking between threads: ``with turns(i):`` runs after turn ``i - 1``."""

    def __init__(self, count: int) -> None:
        self._events = [threading.Event() for _ in range(count + 1)]
        self._events[0].set()

    def wait(self, index: int) -> None:
        assert self._events[index].wait(WAIT_S), f"turn {index} never came"

    @contextlib.contextmanager
    def __call__(self, index: int) -> Iterator[None]:
        self.wait(index)
        try:
            yield
        finally:
            self._events[index + 1].set()


def replayable_or_eager(
    replayable: bool, include_buffers: bool = False
) -> contextlib.AbstractContextManager:
    """A replayable ``empty_weights`` context, or none (eager construction)."""
    if not replayable:
        return contextlib.nullcontext()
    return metamode.empty_weights(include_buffers=include_buffers, replayable=True)


@contextlib.contextmanager
def switching_often() -> Iterator[None]:
    """Make the interpreter switch threads every 10 microseconds in the block."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
