"""``metamode.enable()``: every integration whose library is installed, at once.

Each public module of :mod:`metamode.integrations` (one per library) calls
:func:`register` when imported; :func:`_integrations` imports them all, so a
new shim is one new file and nothing here lists them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from metamode.integrations._rebind import _LOCK, SHARED

__all__ = ["EnableResult", "Integration", "disable", "enable", "enabled", "is_enabled", "register"]


@dataclass(frozen=True)
class Integration:
    """One library's shim: how to turn it on and off, and which shims it must follow."""

    library: str
    enable: Callable[[], tuple[str, ...]]
    disable: Callable[[], tuple[str, ...]]
    is_enabled: Callable[[], bool]
    after: tuple[str, ...] = ()


_REGISTERED: dict[str, Integration] = {}


def register(integration: Integration) -> None:
    """Called by each integration module at import."""
    _REGISTERED[integration.library] = integration


class EnableResult(dict[str, tuple[str, ...]]):
    """What :func:`enable` did: ``{library: rebound module.name bindings}``.

    A library whose installed version has nothing for its shim to route maps
    to ``()``. ``left_alone`` says, for each supported library given ``()`` or
    not enabled at all, why (``{"transformers": "not installed"}``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.left_alone: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"EnableResult({dict(self)!r}, left_alone={self.left_alone!r})"


def load() -> None:
    """Import every integration module (each registers its shim and its library knowledge;
    none imports its library)."""
    import metamode.integrations as package

    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")


def _integrations() -> list[tuple[str, Callable[[], tuple[str, ...]], Callable, Callable]]:
    """(library, enable, disable, is_enabled) for every shim, each after those it names."""
    load()
    ordered: list[Integration] = []

    def place(integration: Integration) -> None:
        if integration not in ordered:
            for name in integration.after:
                place(_REGISTERED[name])
            ordered.append(integration)

    for name in sorted(_REGISTERED):
        place(_REGISTERED[name])
    return [(i.library, i.enable, i.disable, i.is_enabled) for i in ordered]


def _installed(library: str) -> bool:
    return importlib.util.find_spec(library) is not None


def enable() -> EnableResult:
    """Enable metamode's shim for every supported library that is installed.

    PEFT, accelerate, diffusers and transformers, each as its own
    ``enable_for_*`` function would (see those for what each covers). Imports those
    libraries. All or nothing: if one shim refuses (an incompatible version),
    the ones this call enabled are disabled again before the error
    propagates. Idempotent.

    Returns an :class:`EnableResult`: ``{library: rebound bindings}`` for each
    installed library (``()`` where its version has nothing to route), with
    ``.left_alone`` giving the reason for every supported library it did not
    change.

    Raises:
        metamode.IncompatibleLibraryError: an installed library lacks the
            internals its shim replaces; nothing was changed.
    """
    with _LOCK:
        enabled = EnableResult()
        newly: list[Callable[[], tuple[str, ...]]] = []
        try:
            for library, turn_on, turn_off, is_on in _integrations():
                if not _installed(library):
                    enabled.left_alone[library] = "not installed"
                    continue
                was_on = is_on()
                enabled[library] = turn_on()
                reason = SHARED.get(f"left alone: {library}")
                if not enabled[library] and reason:
                    enabled.left_alone[library] = reason
                if not was_on:
                    newly.append(turn_off)
        except BaseException:
            for turn_off in reversed(newly):
                turn_off()
            raise
        return enabled


def disable() -> dict[str, tuple[str, ...]]:
    """Disable every metamode shim; returns ``{library: restored bindings}``."""
    with _LOCK:
        restored: dict[str, tuple[str, ...]] = {}
        for library, _, turn_off, is_on in reversed(_integrations()):
            if _installed(library) and is_on():
                restored[library] = turn_off()
        return restored


def _find(library: str) -> tuple[Callable, Callable, Callable]:
    for name, turn_on, turn_off, is_on in _integrations():
        if name == library:
            return turn_on, turn_off, is_on
    known = ", ".join(repr(name) for name, *_ in _integrations())
    raise ValueError(f"metamode has no shim for {library!r}; it has shims for {known}.")


def is_enabled(library: str) -> bool:
    """True if metamode's shim for ``library`` (``"peft"``, ``"accelerate"``,
    ``"diffusers"``, ``"transformers"``) is on. Raises ``ValueError`` for other names."""
    return bool(_find(library)[2]())


@contextlib.contextmanager
def enabled(*libraries: str) -> Iterator[None]:
    """Turn the named shims on for the block (all four if none are named), for tests.

    Shims that were already on stay on afterwards; the others are turned off
    again on exit, whatever happens in the block. Not for production code:
    call :func:`enable` once at start-up instead.
    """
    names = libraries or tuple(name for name, *_ in _integrations() if _installed(name))
    found = [(name, *_find(name)) for name in names]
    turned_on: list[Callable] = []
    try:
        for _, turn_on, turn_off, is_on in found:
            if not is_on():
                turn_on()
                turned_on.append(turn_off)
        yield
    finally:
        for turn_off in reversed(turned_on):
            turn_off()
