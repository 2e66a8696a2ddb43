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

Importing metamode installs torch's official parameter/buffer registration
hooks once (they do nothing unless a metamode context is active in the
calling thread).
"""

from metamode import _hooks  # noqa: F401  (installs the registration hooks)
from metamode._contexts import (
    active,
    empty_weights,
    init_empty_weights,
    init_on_device,
    skip_empty_weights,
)
from metamode._modes import ContextMisuseError, EmptyWeights, SkipEmptyWeights
from metamode.integrations._peft import disable_for_peft, enable_for_peft
from metamode.integrations._rebind import IncompatibleLibraryError

__version__ = "0.1.0"

# Features whose modules are still being integrated; resolved on first access.
_PENDING = {
    "doctor": ("metamode._doctor", "doctor"),
    "summary": ("metamode._summary", "summary"),
    "testing": ("metamode.testing", None),
    "skip_init": ("metamode._skip_init", "skip_init"),
    "default_dtype": ("metamode._default_dtype", "default_dtype"),
    "enable": ("metamode.integrations._enable_all", "enable"),
    "enable_for_accelerate": ("metamode.integrations._accelerate", "enable_for_accelerate"),
    "disable_for_accelerate": ("metamode.integrations._accelerate", "disable_for_accelerate"),
    "enable_for_diffusers": ("metamode.integrations._diffusers", "enable_for_diffusers"),
    "disable_for_diffusers": ("metamode.integrations._diffusers", "disable_for_diffusers"),
    "enable_for_transformers": ("metamode.integrations._transformers", "enable_for_transformers"),
    "disable_for_transformers": ("metamode.integrations._transformers", "disable_for_transformers"),
}


def __getattr__(name: str):
    if name not in _PENDING:
        raise AttributeError(f"module 'metamode' has no attribute {name!r}")
    import importlib

    module_name, attr = _PENDING[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)


def load_ipython_extension(ipython) -> None:
    """``%load_ext metamode``: registers the ``%%empty_weights`` cell magic."""
    from metamode._ipython import load_ipython_extension as load

    load(ipython)


__all__ = [
    "ContextMisuseError",
    "EmptyWeights",
    "IncompatibleLibraryError",
    "SkipEmptyWeights",
    "active",
    "disable_for_peft",
    "empty_weights",
    "enable_for_peft",
    "init_empty_weights",
    "init_on_device",
    "skip_empty_weights",
]
