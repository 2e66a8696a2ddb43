"""The public constructors of metamode's contexts, and their drop-in aliases."""

from __future__ import annotations

import functools
import os

import torch

from metamode._core.modes import (
    EmptyWeights,
    SkipEmptyWeights,
    _bare_decorator,
    active_empty_weights,
)

__all__ = ["active", "empty_weights", "init_empty_weights", "init_on_device", "skip_empty_weights"]

DeviceLike = torch.device | str | int


def empty_weights(
    include_buffers: bool = False, device: DeviceLike = "meta", *, replayable: bool = False
) -> EmptyWeights:
    """Context manager and decorator: build modules without allocating their weights.

    While active *in the calling thread*, every parameter registered on a
    module is placed on ``device`` (``"meta"`` by default: shapes and dtypes,
    no memory). Other threads are unaffected, and no torch function or class
    attribute is replaced, so nothing can leak out of the block.

    Args:
        include_buffers: also place buffers there, and send factory calls
            without an explicit ``device=`` (``torch.empty``, ``torch.arange``,
            ...) there -- the semantics of ``with torch.device(device)``. Keep
            it False for models whose buffers are computed at construction
            (RoPE ``inv_freq``, position ids): on meta they would be lost.
        device: where parameters go.
        replayable: also record the build (device meta only), so that
            :func:`metamode.materialize` can later give every tensor exactly
            the values eager construction would have. Costs 1.4-2.5x build
            time (docs/benchmarks.md), hence opt-in.

    Returns a single-use context; as a decorator, each call gets a fresh one.
    Within one context, a parameter registered twice maps to the same moved
    parameter, so tied weights stay tied.

    Raises:
        ValueError: ``device`` is not a device this torch build can allocate on.
        TypeError: ``include_buffers`` is not a bool.
    """
    if not isinstance(include_buffers, bool):
        raise TypeError(_misused("empty_weights", include_buffers))
    parsed = _checked_device(device)
    if replayable and parsed.type != "meta":
        raise ValueError(f"replayable=True records meta builds only, not device {str(parsed)!r}")
    return EmptyWeights(parsed, include_buffers, bool(replayable))


def skip_empty_weights(_bare: object = None, /) -> SkipEmptyWeights:
    """Context manager and decorator: suspend this thread's empty-weights contexts.

    Registrations inside it keep their tensors where they are -- PEFT's
    ``skip_init_on_device``, but scoped to the calling thread instead of a
    process-wide flag. A context entered inside it is active again (the
    innermost context wins).
    """
    if _bare is not None:
        raise TypeError(_bare_decorator("skip_empty_weights", _bare))
    return SkipEmptyWeights()


def _misused(name: str, include_buffers: object) -> str:
    """The error for a non-bool ``include_buffers``, saying what was probably meant."""
    if callable(include_buffers):
        return _bare_decorator(name, include_buffers)
    if isinstance(include_buffers, (str, torch.device)) or type(include_buffers) is int:
        device = str(include_buffers) if not isinstance(include_buffers, int) else include_buffers
        return (
            f"include_buffers must be a bool, not {include_buffers!r} (the first positional "
            f"argument is include_buffers). Did you mean {name}(device={device!r})?"
        )
    return f"include_buffers must be a bool, not {include_buffers!r}"


def active() -> EmptyWeights | None:
    """The empty-weights context in force in the calling thread, or None.

    None also while a :func:`skip_empty_weights` is suspending it.
    """
    return active_empty_weights()


def init_empty_weights(include_buffers: bool | None = None) -> EmptyWeights:
    """Drop-in for ``accelerate.init_empty_weights`` (and PEFT's copy), thread-scoped.

    ``include_buffers=None`` reads ``ACCELERATE_INIT_INCLUDE_BUFFERS`` like
    accelerate does.
    """
    return empty_weights(include_buffers=_resolve_include_buffers(include_buffers))


def init_on_device(device: DeviceLike, include_buffers: bool | None = None) -> EmptyWeights:
    """Drop-in for ``accelerate.init_on_device``, thread-scoped."""
    return empty_weights(include_buffers=_resolve_include_buffers(include_buffers), device=device)


_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def _resolve_include_buffers(include_buffers: bool | None) -> bool:
    if include_buffers is not None:
        return include_buffers  # empty_weights rejects anything but a bool, naming it
    value = os.environ.get("ACCELERATE_INIT_INCLUDE_BUFFERS", "false").lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"ACCELERATE_INIT_INCLUDE_BUFFERS={value!r} is not a truth value")
    return value in _TRUE


def _checked_device(device: DeviceLike) -> torch.device:
    try:
        parsed = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"invalid device {device!r}: {error}") from None
    _check_allocatable(str(parsed))
    return parsed


@functools.lru_cache(maxsize=32)
def _check_allocatable(device: str) -> None:
    # Fail at construction, with the device named, rather than deep inside a
    # model's __init__ on the first parameter.
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        raise ValueError(f"cannot place tensors on device {device!r}: {error}") from None
