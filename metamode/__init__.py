"""metamode: thread-scoped empty-weight construction for PyTorch.

Build models with their weights on the ``meta`` device -- the trick behind
``low_cpu_mem_usage`` -- without patching ``torch.nn.Module`` or any torch
function. Every context lives on PyTorch's per-thread torch-function mode
stack, so it affects only the thread that entered it and cannot leak.

    >>> import metamode, torch
    >>> with metamode.empty_weights():
    ...     layer = torch.nn.Linear(4096, 4096)
    >>> layer.weight.device
    device(type='meta')

The first use of metamode's API (any public name, or importing a module that
defines contexts) installs torch's official parameter/buffer registration
hooks once (they do nothing unless a metamode context is active in the
calling thread). ``import metamode`` alone imports nothing else, so the
pytest plugin costs runs that never use it nothing.
"""

import importlib
from typing import TYPE_CHECKING

# Public name -> the module that defines it. Resolved on first access
# (PEP 562), so ``import metamode._pytest_plugin`` -- what pytest's entry point
# does in every run -- imports neither torch nor the hooks. The first access
# to any public name imports the core, which installs the hooks
# (metamode._modes imports metamode._hooks).
_PUBLIC = {
    "active": "metamode._contexts",
    "empty_weights": "metamode._contexts",
    "init_empty_weights": "metamode._contexts",
    "init_on_device": "metamode._contexts",
    "skip_empty_weights": "metamode._contexts",
    "default_dtype": "metamode._default_dtype",
    "doctor": "metamode._doctor",
    "ContextMisuseError": "metamode._modes",
    "EmptyWeights": "metamode._modes",
    "SkipEmptyWeights": "metamode._modes",
    "skip_init": "metamode._skip_init",
    "summary": "metamode._summary",
    "disable_for_accelerate": "metamode.integrations._accelerate",
    "enable_for_accelerate": "metamode.integrations._accelerate",
    "disable_for_diffusers": "metamode.integrations._diffusers",
    "enable_for_diffusers": "metamode.integrations._diffusers",
    "disable": "metamode.integrations._enable_all",
    "enable": "metamode.integrations._enable_all",
    "disable_for_peft": "metamode.integrations._peft",
    "enable_for_peft": "metamode.integrations._peft",
    "IncompatibleLibraryError": "metamode.integrations._rebind",
    "disable_for_transformers": "metamode.integrations._transformers",
    "enable_for_transformers": "metamode.integrations._transformers",
}


def __getattr__(name: str) -> object:
    if name == "testing":
        return importlib.import_module("metamode.testing")
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'metamode' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, "testing"})


if TYPE_CHECKING:
    from metamode import testing
    from metamode._contexts import (
        active,
        empty_weights,
        init_empty_weights,
        init_on_device,
        skip_empty_weights,
    )
    from metamode._default_dtype import default_dtype
    from metamode._doctor import doctor
    from metamode._modes import ContextMisuseError, EmptyWeights, SkipEmptyWeights
    from metamode._skip_init import skip_init
    from metamode._summary import summary
    from metamode.integrations._accelerate import disable_for_accelerate, enable_for_accelerate
    from metamode.integrations._diffusers import disable_for_diffusers, enable_for_diffusers
    from metamode.integrations._enable_all import disable, enable
    from metamode.integrations._peft import disable_for_peft, enable_for_peft
    from metamode.integrations._rebind import IncompatibleLibraryError
    from metamode.integrations._transformers import (
        disable_for_transformers,
        enable_for_transformers,
    )

__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """``%load_ext metamode``: registers the ``%%empty_weights`` cell magic."""
    from metamode._ipython import load_ipython_extension as load

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
    # library shims
    "enable",
    "disable",
    "enable_for_peft",
    "disable_for_peft",
    "enable_for_accelerate",
    "disable_for_accelerate",
    "enable_for_diffusers",
    "disable_for_diffusers",
    "enable_for_transformers",
    "disable_for_transformers",
    # inspection
    "doctor",
    "summary",
    "testing",
    # types and errors
    "EmptyWeights",
    "SkipEmptyWeights",
    "ContextMisuseError",
    "IncompatibleLibraryError",
]
