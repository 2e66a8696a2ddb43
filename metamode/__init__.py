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

from metamode import (
    _hooks,  # noqa: F401  (installs the registration hooks)
    testing,
)
from metamode._contexts import (
    active,
    empty_weights,
    init_empty_weights,
    init_on_device,
    skip_empty_weights,
)
from metamode._default_dtype import default_dtype
from metamode._doctor import doctor
from metamode._materialize import NotMaterializableError, is_materializable, materialize
from metamode._modes import ContextMisuseError, EmptyWeights, SkipEmptyWeights
from metamode._skip_init import skip_init
from metamode._summary import summary
from metamode.integrations._accelerate import disable_for_accelerate, enable_for_accelerate
from metamode.integrations._diffusers import disable_for_diffusers, enable_for_diffusers
from metamode.integrations._enable_all import disable, enable
from metamode.integrations._peft import disable_for_peft, enable_for_peft
from metamode.integrations._rebind import IncompatibleLibraryError
from metamode.integrations._transformers import disable_for_transformers, enable_for_transformers

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
    # build now, materialize later
    "materialize",
    "is_materializable",
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
    "NotMaterializableError",
]
