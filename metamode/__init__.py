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
