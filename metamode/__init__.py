"""metamode: thread-scoped empty-weight construction for PyTorch.

Build models with their weights on the ``meta`` device without patching
``torch.nn.Module`` or any torch function: every context lives on PyTorch's per-thread
torch-function mode stack, so it affects only the thread that entered it.

    >>> import metamode, torch
    >>> with metamode.empty_weights():
    ...     layer = torch.nn.Linear(4096, 4096)
    >>> layer.weight.device
    device(type='meta')
"""

import importlib as _importlib
import typing as _typing

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "active": "metamode._contexts.empty_weights",
    "empty_weights": "metamode._contexts.empty_weights",
    "init_empty_weights": "metamode._contexts.empty_weights",
    "init_on_device": "metamode._contexts.empty_weights",
    "skip_empty_weights": "metamode._contexts.empty_weights",
    "default_dtype": "metamode._contexts.default_dtype",
    "doctor": "metamode._diagnostics.doctor",
    "ContextMisuseError": "metamode._core.modes",
    "EmptyWeights": "metamode._core.modes",
    "SkipEmptyWeights": "metamode._core.modes",
    "LoadedIntoEmptyWeightsWarning": "metamode._core.modes",
    "materialize": "metamode._contexts.materialize",
    "is_materializable": "metamode._contexts.materialize",
    "NotMaterializableError": "metamode._contexts.materialize",
    "skip_init": "metamode._contexts.skip_init",
    "summary": "metamode._diagnostics.summary",
    "disable_for_accelerate": "metamode.integrations.accelerate",
    "enable_for_accelerate": "metamode.integrations.accelerate",
    "disable_for_diffusers": "metamode.integrations.diffusers",
    "enable_for_diffusers": "metamode.integrations.diffusers",
    "disable": "metamode.integrations._registry",
    "enable": "metamode.integrations._registry",
    "enabled": "metamode.integrations._registry",
    "is_enabled": "metamode.integrations._registry",
    "EnableResult": "metamode.integrations._registry",
    "disable_for_peft": "metamode.integrations.peft",
    "enable_for_peft": "metamode.integrations.peft",
    "IncompatibleLibraryError": "metamode.integrations._rebind",
    "disable_for_transformers": "metamode.integrations.transformers",
    "enable_for_transformers": "metamode.integrations.transformers",
}
_SUBMODULES = ("testing", "integrations")

if _typing.TYPE_CHECKING:
    from metamode import integrations, testing
    from metamode._contexts.default_dtype import default_dtype
    from metamode._contexts.empty_weights import (
        active,
        empty_weights,
        init_empty_weights,
        init_on_device,
        skip_empty_weights,
    )
    from metamode._contexts.materialize import (
        NotMaterializableError,
        is_materializable,
        materialize,
    )
    from metamode._contexts.skip_init import skip_init
    from metamode._core.modes import (
        ContextMisuseError,
        EmptyWeights,
        LoadedIntoEmptyWeightsWarning,
        SkipEmptyWeights,
    )
    from metamode._diagnostics.doctor import doctor
    from metamode._diagnostics.summary import summary
    from metamode.integrations._rebind import IncompatibleLibraryError
    from metamode.integrations._registry import (
        EnableResult,
        disable,
        enable,
        enabled,
        is_enabled,
    )
    from metamode.integrations.accelerate import disable_for_accelerate, enable_for_accelerate
    from metamode.integrations.diffusers import disable_for_diffusers, enable_for_diffusers
    from metamode.integrations.peft import disable_for_peft, enable_for_peft
    from metamode.integrations.transformers import (
        disable_for_transformers,
        enable_for_transformers,
    )


# Names whose use needs the integrations' knowledge of their libraries (the builds they
# record, the materialize that replays them).
_NEEDS_INTEGRATIONS = frozenset(["empty_weights", "materialize", "is_materializable"])


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
        if name in _NEEDS_INTEGRATIONS:
            _importlib.import_module("metamode.integrations._registry").load()
    elif name in _SUBMODULES:
        value = _importlib.import_module(f"metamode.{name}")
    else:
        raise AttributeError(f"module 'metamode' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext metamode``: registers the ``%%empty_weights`` cell magic."""
    from metamode._tools.ipython import load_ipython_extension as load

    load(ipython)


__all__ = [
    # contexts
    "empty_weights",
    "skip_empty_weights",
    "active",
    "init_empty_weights",
    "init_on_device",
    "skip_init",
    "default_dtype",
    # build now, materialize later
    "materialize",
    "is_materializable",
    # library shims
    "enable",
    "disable",
    "enabled",
    "is_enabled",
    "enable_for_peft",
    "disable_for_peft",
    "enable_for_accelerate",
    "disable_for_accelerate",
    "enable_for_diffusers",
    "disable_for_diffusers",
    "enable_for_transformers",
    "disable_for_transformers",
    "integrations",
    # inspection
    "doctor",
    "summary",
    "testing",
    # types and errors
    "EmptyWeights",
    "SkipEmptyWeights",
    "ContextMisuseError",
    "IncompatibleLibraryError",
    "NotMaterializableError",
    "EnableResult",
    "LoadedIntoEmptyWeightsWarning",
]
