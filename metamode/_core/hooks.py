"""torch's official registration hooks, installed once per process.

A torch-function mode cannot see ``Module.register_parameter``: it is plain
Python, not a torch function. Instead of replacing it (what accelerate and
PEFT do, and what breaks under threads), metamode registers one global
parameter hook and one global buffer hook via
``torch.nn.modules.module.register_module_*_registration_hook``.

They are installed when :mod:`metamode._core.modes` is first imported (the
first use of any public name does it) -- never lazily inside a context, so
entering and leaving contexts changes no global state -- and never removed:
removing a hook while another thread iterates torch's hook dict can raise.
When no metamode context is active in the calling thread the hooks return
after one C call (``len`` of the thread's mode stack).
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

import torch
from torch import Tensor
from torch.nn import Parameter

from metamode._core.modes import (
    LoadedIntoEmptyWeightsWarning,
    active_empty_weights,
    kept_registration,
)
from metamode._core.stack import stack_depth
from metamode._torch import DisableTorchFunction, registration_hooks

__all__ = ["installed"]


def _on_parameter_registered(module, name, param):
    if not stack_depth():
        return None
    existing = module._parameters.get(name)
    if existing is not None and existing is not param:  # a re-assignment: rare
        kept = kept_registration(module, name, param, existing)
        if kept is not None:
            return kept
    context = active_empty_weights()
    if context is None:
        return None
    if type(param) is Parameter:
        # Metamode's own bookkeeping skips the mode stack (docs/design.md, "Hot
        # paths"); subclasses keep their dispatch: their constructors may rely on it.
        with DisableTorchFunction():
            moved = context.place_parameter(param, module, name)
    else:
        moved = context.place_parameter(param, module, name)
    if (
        moved is not None
        and existing is not None
        and existing.device == moved.device
        and (stacklevel := _load_state_dict_caller())
    ):
        warnings.warn(
            f"load_state_dict(assign=True) inside {context!r} assigned "
            f"{type(module).__qualname__}.{name}, and the block put it back on "
            f"{moved.device}: the loaded values are not in the model. Call "
            f"load_state_dict(..., assign=True) after the block (outside the "
            f"context, or outside the %%empty_weights cell).",
            LoadedIntoEmptyWeightsWarning,
            stacklevel=stacklevel,
        )
    return moved


def _load_state_dict_caller() -> int:
    """The stack level of the code that called ``Module.load_state_dict`` (of the code that
    called ``Module._load_from_state_dict``, if that was called directly), or 0 if the
    registration did not come from ``Module._load_from_state_dict``.

    Asked only when a parameter the context already placed is being replaced by
    one it had to move (torch runs the hooks before storing it).
    """
    frame: FrameType | None = sys._getframe(1)  # the hook: level 1 for its warnings.warn
    level = 1
    while frame is not None and frame.f_code is not _LOAD_FROM_STATE_DICT:
        frame, level = frame.f_back, level + 1
    if frame is None:
        return 0
    loading_level = level
    while frame is not None and frame.f_code is not _LOAD_STATE_DICT:
        frame, level = frame.f_back, level + 1
    return (level if frame is not None else loading_level) + 1  # its caller


_LOAD_FROM_STATE_DICT = torch.nn.Module._load_from_state_dict.__code__
_LOAD_STATE_DICT = torch.nn.Module.load_state_dict.__code__


def _on_buffer_registered(module, name, tensor):
    if tensor is None or not stack_depth():
        return None
    existing = module._buffers.get(name)
    if existing is not None and existing is not tensor:
        kept = kept_registration(module, name, tensor, existing)
        if kept is not None:
            return kept
    context = active_empty_weights()
    if context is None:
        return None
    if type(tensor) is Tensor:
        with DisableTorchFunction():
            return context.place_buffer(tensor, module, name)
    return context.place_buffer(tensor, module, name)


# A function attribute marks them, so a second copy of the package finds them.
_on_parameter_registered.__metamode_hook__ = True  # type: ignore[attr-defined]
_on_buffer_registered.__metamode_hook__ = True  # type: ignore[attr-defined]


def _already_installed(hooks: dict) -> bool:
    return any(getattr(hook, "__metamode_hook__", False) for hook in list(hooks.values()))


def _install() -> None:
    # Re-importing this module (importlib.reload, a second copy of the package)
    # must not stack a second pair of hooks.
    if not _already_installed(registration_hooks("parameter")):
        torch.nn.modules.module.register_module_parameter_registration_hook(
            _on_parameter_registered
        )
    if not _already_installed(registration_hooks("buffer")):
        torch.nn.modules.module.register_module_buffer_registration_hook(_on_buffer_registered)


def installed() -> bool:
    """True if this process has metamode's registration hooks (it always should)."""
    return _already_installed(registration_hooks("parameter")) and _already_installed(
        registration_hooks("buffer")
    )


_install()
