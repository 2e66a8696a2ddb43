"""Route PEFT's ``low_cpu_mem_usage`` path through metamode.

PEFT (``peft.utils.integrations``) carries a copy of accelerate's
``init_empty_weights``: it assigns a wrapper to
``torch.nn.Module.register_parameter`` on entry and puts back the value it
captured on exit, and ``_skip_init_on_device`` flips a process-global
``_init_on_device._skip``. Two threads whose contexts overlap lose and then
leak that patch. The shim rebinds the three module-level names to metamode's
thread-scoped contexts; every PEFT call site reaches them:

* ``tuners_utils``, ``peft_model``, ``adalora.layer`` bound them with
  ``from peft.utils.integrations import ...`` -- found by identity and rebound;
* ``skip_init_on_device`` (the decorator on LoRA's MultiheadAttention
  ``_restore_weights``) and PEFT's ``init_empty_weights`` look the names up in
  ``peft.utils.integrations`` at call time -- rebound there.
"""

from __future__ import annotations

import torch

from metamode._contexts import empty_weights, skip_empty_weights
from metamode._modes import EmptyWeights, SkipEmptyWeights
from metamode.integrations._rebind import Rebinding

__all__ = ["disable_for_peft", "enable_for_peft"]


def init_empty_weights(include_buffers: bool | None = None) -> EmptyWeights:
    """metamode's replacement for ``peft.utils.integrations.init_empty_weights``.

    Replayable: a new adapter made with ``low_cpu_mem_usage=True`` can be
    given its eager values by :func:`metamode.materialize`.
    """
    return empty_weights(include_buffers=bool(include_buffers), replayable=True)


def _init_on_device(device: torch.device, include_buffers: bool | None = None) -> EmptyWeights:
    """metamode's replacement for ``peft.utils.integrations._init_on_device``."""
    return empty_weights(include_buffers=bool(include_buffers), device=device)


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

    Rebinds ``init_empty_weights``, ``_init_on_device`` and
    ``_skip_init_on_device`` in ``peft.utils.integrations`` and in every
    imported PEFT module that bound them by name, all at once under a lock.
    Safe to call before or after PEFT's submodules are imported, and more than
    once. Memory savings are unchanged: LoRA weights are still created on
    ``meta`` and materialised by ``set_peft_model_state_dict(...,
    low_cpu_mem_usage=True)``.

    Returns the rebound ``module.name`` bindings.

    Raises:
        ImportError: PEFT is not installed (``pip install 'metamode[peft]'``).
        metamode.IncompatibleLibraryError: this PEFT lacks one of those names;
            nothing was changed.
    """
    return _PEFT.enable()


def disable_for_peft() -> tuple[str, ...]:
    """Restore PEFT's original functions everywhere the shim put its own.

    Returns the restored bindings (empty if the shim was not enabled).
    """
    return _PEFT.disable()


def peft_enabled() -> bool:
    return _PEFT.enabled
