"""A snapshot of the process-global torch state that model construction touches.

Empty-weight helpers elsewhere corrupt exactly these things: class attributes
of ``torch.nn.Module``, functions in ``torch.nn.init`` and ``torch``'s factory
functions (and torch's table of those ``torch.device(...)`` places), the default
dtype and device, torch's global registration hooks, the numeric settings a replay
depends on (float32 matmul precision, intra-op threads, mkldnn, this thread's
flush-denormal flags), the switches a replay sets and puts back (the calling thread's
grad and inference mode, autocast, dispatch keys and modes, torch's ``__future__``
conversion flags, deterministic algorithms), and the calling thread's mode stack (seen
through the intended changes listed in :mod:`metamode._diagnostics.known_changes`). Taking a
snapshot before and comparing after is how the test suite proves that metamode leaves
nothing behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.deterministic

from metamode import _torch
from metamode._core import dtype_windows
from metamode._core import hooks as _hooks  # noqa: F401  (hooks before any snapshot)
from metamode._core.recording import settings, thread_state
from metamode._core.stack import stack_depth
from metamode._diagnostics import known_changes as _known_changes

__all__ = ["Snapshot", "snapshot", "FACTORY_NAMES"]

FACTORY_NAMES = (
    "empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange",
    "linspace", "logspace", "eye", "tensor", "as_tensor", "empty_like", "zeros_like",
    "ones_like", "full_like", "rand_like", "randn_like", "empty_strided",
)  # fmt: skip


@dataclass(frozen=True)
class Snapshot:
    module_attrs: dict[str, int]
    init_functions: dict[str, int]
    factories: dict[str, int]
    device_table: frozenset[int]  # the factories torch.device(...) places
    tensor_methods: dict[str, int]
    hooks: dict[str, tuple[int, ...]]
    default_dtype: torch.dtype
    device_context: object
    mode_stack_depth: int
    dtype_windows: dict[int, tuple[torch.dtype, ...]]
    numeric_settings: dict[str, object]
    switches: dict[str, object]

    def changes_since(self, before: Snapshot) -> list[str]:
        """Human-readable differences, empty if the process is as it was."""
        changes: list[str] = []
        for label, old, new in (
            ("torch.nn.Module", before.module_attrs, self.module_attrs),
            ("torch.nn.init", before.init_functions, self.init_functions),
            ("torch", before.factories, self.factories),
            ("torch.Tensor", before.tensor_methods, self.tensor_methods),
        ):
            for name in sorted(old.keys() | new.keys()):
                if old.get(name) != new.get(name):
                    verb = (
                        "replaced"
                        if name in old and name in new
                        else "added"
                        if name in new
                        else "removed"
                    )
                    changes.append(f"{label}.{name} {verb}")
        if before.device_table != self.device_table:
            changes.append("torch.utils._device._device_constructors() changed")
        for name in before.hooks:
            if before.hooks[name] != self.hooks[name]:
                changes.append(f"{name} changed")
        if before.default_dtype != self.default_dtype:
            changes.append(f"default dtype {before.default_dtype} -> {self.default_dtype}")
        if before.device_context != self.device_context:
            changes.append(f"default device {before.device_context} -> {self.device_context}")
        if before.mode_stack_depth != self.mode_stack_depth:
            changes.append(
                f"this thread's torch-function mode stack depth "
                f"{before.mode_stack_depth} -> {self.mode_stack_depth}"
            )
        if before.dtype_windows != self.dtype_windows:
            changes.append(f"dtype windows {before.dtype_windows} -> {self.dtype_windows}")
        for current, previous in (
            (self.numeric_settings, before.numeric_settings),
            (self.switches, before.switches),
        ):
            for name, old_value in previous.items():
                if current[name] != old_value:
                    changes.append(f"{name} {old_value!r} -> {current[name]!r}")
        return changes


def _identities(owner: object, names=None) -> dict[str, int]:
    # Known, intended changes (metamode._diagnostics.known_changes) are seen through: a
    # recognised wrapper counts as what it wraps, a recognised addition and
    # its "done" flags as absent.
    namespace = vars(owner)
    keys = namespace.keys() if names is None else [n for n in names if n in namespace]
    identities = {}
    for name in keys:
        if _known_changes.is_marker(owner, name):
            continue
        value = _known_changes.underlying(owner, name, namespace[name])
        if value is not None:
            identities[name] = id(value)
    return identities


def _switches() -> dict[str, object]:
    include, exclude = _torch.dispatch_keys()
    return {
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "torch functions enabled": _torch.torch_function_enabled(),
        "torch-dispatch mode stack depth": _torch.dispatch_mode_stack_depth(),
        "dispatch keys (included, excluded)": (str(include), str(exclude)),
        "cpu autocast (enabled, dtype)": (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
        ),
        "autocast cache": torch.is_autocast_cache_enabled(),
        "torch.__future__ swap_module_params_on_conversion": (
            torch.__future__.get_swap_module_params_on_conversion()
        ),
        "torch.__future__ overwrite_module_params_on_conversion": (
            torch.__future__.get_overwrite_module_params_on_conversion()
        ),
        "deterministic algorithms (enabled, warn only)": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "fill_uninitialized_memory": (
            torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
        ),
    }


def snapshot() -> Snapshot:
    """Record the global torch state (identities, not copies: cheap)."""
    device_context = _torch.global_device_context()
    return Snapshot(
        module_attrs=_identities(torch.nn.Module),
        init_functions=_identities(torch.nn.init),
        factories=_identities(torch, FACTORY_NAMES),
        device_table=frozenset(map(id, _torch.device_constructors())),
        tensor_methods=_identities(torch.Tensor),
        hooks={name: tuple(hooks) for name, hooks in _torch.all_registration_hooks().items()},
        default_dtype=torch.get_default_dtype(),
        device_context=(
            _torch.current_device(),
            None if device_context is None else device_context.device,
        ),
        mode_stack_depth=stack_depth(),
        dtype_windows=dtype_windows.state().stacks,
        numeric_settings={
            **settings.now()._asdict(),
            "flush_denormal": thread_state.flushes_denormals(),
        },
        switches=_switches(),
    )
