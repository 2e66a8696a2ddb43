"""Shim for PEFT's ``low_cpu_mem_usage`` path: ``init_empty_weights``, ``_init_on_device``
and ``_skip_init_on_device`` of ``peft.utils.integrations`` rebound to thread-scoped
contexts (README, "How it works"; why a toggle is safe: docs/design.md, "Shims").
"""

from __future__ import annotations

import sys
from types import CodeType
from typing import Any

import torch

from metamode._contexts.empty_weights import empty_weights, skip_empty_weights
from metamode._core.facts import register_meta_branch
from metamode._core.modes import EmptyWeights, SkipEmptyWeights
from metamode.integrations._rebind import _LOCK, SHARED, Rebinding
from metamode.integrations._registry import Integration, register

__all__ = ["disable_for_peft", "enable_for_peft"]


def init_empty_weights(include_buffers: bool | None = None) -> EmptyWeights:
    """metamode's replacement for ``peft.utils.integrations.init_empty_weights``.

    Replayable: a new adapter made with ``low_cpu_mem_usage=True`` can be
    given its eager values by :func:`metamode.materialize`.
    """
    return empty_weights(include_buffers=_include_buffers(include_buffers), replayable=True)


def _include_buffers(value: bool | None) -> bool:
    """PEFT's ``include_buffers`` (None is False), checked like :func:`metamode.empty_weights`."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(
            f"include_buffers must be True, False or None, not {value!r} "
            f"({type(value).__name__}); a non-empty string such as 'no' would mean True"
        )
    return value


class _InitOnDevice:
    """metamode's replacement for ``peft.utils.integrations._init_on_device``.

    Called like PEFT's; reads and writes of its ``_skip`` attribute go to PEFT's function's,
    so there is one flag whichever function a stock context finds.
    """

    def __call__(self, device: torch.device, include_buffers: bool | None = None) -> EmptyWeights:
        return empty_weights(include_buffers=_include_buffers(include_buffers), device=device)

    def __getattr__(self, name: str) -> Any:
        if name == "_skip":
            return getattr(_peft_function(), "_skip", False)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_skip":
            _peft_function()._skip = value
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name == "_skip":
            vars(_peft_function()).pop("_skip", None)
        else:
            object.__delattr__(self, name)

    def __repr__(self) -> str:
        return "<metamode's replacement for peft.utils.integrations._init_on_device>"


_init_on_device = _InitOnDevice()
_PEFT_FUNCTION = "peft: _init_on_device"  # SHARED key: PEFT's own function


def _peft_function() -> Any:
    function = SHARED.get(_PEFT_FUNCTION)
    if function is None:
        raise RuntimeError(
            "metamode's PEFT _init_on_device was used before enable_for_peft() recorded "
            "PEFT's own function; call metamode.enable_for_peft() first."
        )
    return function


def _skip_init_on_device() -> SkipEmptyWeights:
    """metamode's replacement for ``peft.utils.integrations._skip_init_on_device``."""
    return skip_empty_weights()


_PEFT = Rebinding(
    package="peft",
    extra="peft",
    home_module="peft.utils.integrations",
    replacements={
        "init_empty_weights": init_empty_weights,
        "_init_on_device": _init_on_device,
        "_skip_init_on_device": _skip_init_on_device,
    },
)


def enable_for_peft() -> tuple[str, ...]:
    """Make PEFT's ``low_cpu_mem_usage=True`` path thread-safe.

    Rebinds ``init_empty_weights``, ``_init_on_device`` and ``_skip_init_on_device`` in
    ``peft.utils.integrations`` and in every imported PEFT module that bound them by name,
    all at once under a lock. Safe before or after PEFT's submodules are imported, and more
    than once. LoRA weights are still created on ``meta`` and materialised by
    ``set_peft_model_state_dict(..., low_cpu_mem_usage=True)``.

    Returns the rebound ``module.name`` bindings.

    Raises:
        ImportError: PEFT is not installed (``pip install 'metamode[peft]'``).
        metamode.IncompatibleLibraryError: this PEFT lacks one of those names;
            nothing was changed.
    """
    with _LOCK:
        bound = _PEFT.enable()
        SHARED[_PEFT_FUNCTION] = _PEFT._originals["_init_on_device"]
        return bound


def disable_for_peft() -> tuple[str, ...]:
    """Restore PEFT's original functions everywhere the shim put its own.

    Returns the restored bindings (empty if the shim was not enabled).
    """
    return _PEFT.disable()


def peft_enabled() -> bool:
    return _PEFT.enabled


register(Integration("peft", enable_for_peft, disable_for_peft, peft_enabled))


def _branching_on_meta() -> list[CodeType]:
    """PEFT functions that build an adapter otherwise when its tensors are on meta."""
    found = []
    for module_name, qualnames in (
        ("peft.tuners.lora.layer", ("LoraLayer.mica_init", "Embedding.mica_init")),
        ("peft.tuners.lora.variants", ("MontecloraLinearVariant.init",)),
    ):
        module = sys.modules.get(module_name)
        for qualname in qualnames if module is not None else ():
            owner, _, name = qualname.partition(".")
            function = getattr(getattr(module, owner, None), name, None)
            code = getattr(function, "__code__", None)
            if code is not None:
                found.append(code)
    return found


register_meta_branch(
    _branching_on_meta,
    "PEFT initialises this adapter otherwise when its tensors are on the meta device "
    "(MiCA skips its SVD init, MonteCLoRA defers its sampler): create it with "
    "low_cpu_mem_usage=False",
)
