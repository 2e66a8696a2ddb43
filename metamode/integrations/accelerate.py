"""Shim for accelerate's ``init_empty_weights`` / ``init_on_device``: rebound, by identity,
in accelerate and in every imported accelerate, diffusers, transformers and PEFT module
that bound them. What stock does: docs/design.md, "Shims"; names bound in your own
modules: docs/limitations.md.
"""

from __future__ import annotations

import torch

from metamode._contexts.empty_weights import init_empty_weights as _init_empty_weights
from metamode._contexts.empty_weights import init_on_device as _init_on_device
from metamode._core.modes import EmptyWeights
from metamode.integrations._rebind import Rebinding
from metamode.integrations._registry import Integration, register

__all__ = ["disable_for_accelerate", "enable_for_accelerate"]


def init_empty_weights(include_buffers: bool | None = None) -> EmptyWeights:
    """metamode's replacement for ``accelerate.init_empty_weights`` (same arguments)."""
    return _init_empty_weights(include_buffers)


def init_on_device(device: torch.device, include_buffers: bool | None = None) -> EmptyWeights:
    """metamode's replacement for ``accelerate.init_on_device`` (same arguments)."""
    return _init_on_device(device, include_buffers)


_ACCELERATE = Rebinding(
    package="accelerate",
    extra="accelerate",
    home_module="accelerate.big_modeling",
    replacements={"init_empty_weights": init_empty_weights, "init_on_device": init_on_device},
    scan=("diffusers", "transformers", "peft"),
)


def enable_for_accelerate() -> tuple[str, ...]:
    """Make ``accelerate.init_empty_weights`` and ``init_on_device`` thread-scoped.

    After this, both return metamode contexts (:func:`metamode.init_empty_weights`,
    :func:`metamode.init_on_device`): same arguments, same
    ``ACCELERATE_INIT_INCLUDE_BUFFERS`` handling, but they affect only the
    thread that enters them and patch nothing. Rebinds the names in
    accelerate and in every imported accelerate, diffusers, transformers and
    PEFT module that bound them, atomically under a lock; idempotent.

    Returns the rebound ``module.name`` bindings.

    Raises:
        ImportError: accelerate is not installed.
        metamode.IncompatibleLibraryError: this accelerate lacks one of the
            names; nothing was changed.
    """
    return _ACCELERATE.enable()


def disable_for_accelerate() -> tuple[str, ...]:
    """Restore accelerate's functions everywhere the shim put its own.

    Returns the restored bindings (empty if the shim was not enabled).
    """
    return _ACCELERATE.disable()


def accelerate_enabled() -> bool:
    return _ACCELERATE.enabled


register(
    Integration("accelerate", enable_for_accelerate, disable_for_accelerate, accelerate_enabled)
)
