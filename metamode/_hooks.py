"""torch's official registration hooks, installed once per process.

A torch-function mode cannot see ``Module.register_parameter``: it is plain
Python, not a torch function. Instead of replacing it (what accelerate and
PEFT do, and what breaks under threads), metamode registers one global
parameter hook and one global buffer hook via
``torch.nn.modules.module.register_module_*_registration_hook``.

They are installed when :mod:`metamode` is imported -- never lazily inside a
context, so entering and leaving contexts changes no global state -- and never
removed: removing a hook while another thread iterates torch's hook dict can
raise. When no metamode context is active in the calling thread the hooks
return after one C call (``len`` of the thread's mode stack).

Besides placing tensors, the hooks let a :class:`metamode._modes.KeepRegistered`
mode keep a module's existing parameter or buffer when a different one is
assigned under the same name (a hook may return the tensor to register).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._C import DisableTorchFunction
from torch.nn import Parameter
from torch.nn.modules import module as _torch_module

from metamode._modes import active_empty_weights, kept_registration
from metamode._stack import stack_depth

__all__ = ["installed"]


def _on_parameter_registered(module, name, param):
    if not stack_depth():
        return None
    kept = kept_registration(module, name, param, module._parameters.get(name))
    if kept is not None:
        return kept
    context = active_empty_weights()
    if context is None:
        return None
    if type(param) is Parameter:
        # Moving is metamode's own bookkeeping: its handful of torch calls need
        # not each take a ~1.5 us trip through the mode stack (measured: 1.59x
        # -> 1.41x torch.device('meta') on a Llama-7B skeleton). Subclasses keep
        # their dispatch: their constructors may rely on it.
        with DisableTorchFunction():
            return context.place_parameter(param)
    return context.place_parameter(param)


def _on_buffer_registered(module, name, tensor):
    if tensor is None or not stack_depth():
        return None
    kept = kept_registration(module, name, tensor, module._buffers.get(name))
    if kept is not None:
        return kept
    context = active_empty_weights()
    if context is None:
        return None
    if type(tensor) is Tensor:
        with DisableTorchFunction():
            return context.place_buffer(tensor)
    return context.place_buffer(tensor)


_on_parameter_registered.__metamode_hook__ = True
_on_buffer_registered.__metamode_hook__ = True


def _already_installed(hooks: dict) -> bool:
    return any(getattr(hook, "__metamode_hook__", False) for hook in list(hooks.values()))


def _install() -> None:
    # Re-importing this module (importlib.reload, a second copy of the package)
    # must not stack a second pair of hooks.
    if not _already_installed(_torch_module._global_parameter_registration_hooks):
        torch.nn.modules.module.register_module_parameter_registration_hook(
            _on_parameter_registered
        )
    if not _already_installed(_torch_module._global_buffer_registration_hooks):
        torch.nn.modules.module.register_module_buffer_registration_hook(_on_buffer_registered)


def installed() -> bool:
    """True if this process has metamode's registration hooks (it always should)."""
    return _already_installed(
        _torch_module._global_parameter_registration_hooks
    ) and _already_installed(_torch_module._global_buffer_registration_hooks)


_install()
