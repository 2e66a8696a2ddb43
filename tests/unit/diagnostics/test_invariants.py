"""The suite-wide guard (tests/conftest.py) must be able to fail: it sees each kind of leak."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from metamode._diagnostics.invariants import snapshot


class _Passthrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_snapshot_sees_every_kind_of_leak(monkeypatch):
    before = snapshot()
    assert snapshot().changes_since(before) == []

    monkeypatch.setattr(nn.Module, "register_parameter", lambda *args: None)
    monkeypatch.setattr(torch.nn.init, "normal_", lambda tensor, *a, **k: tensor)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: None)
    handle = torch.nn.modules.module.register_module_parameter_registration_hook(lambda *a: None)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    mode = _Passthrough()
    mode.__enter__()
    try:
        changes = snapshot().changes_since(before)
    finally:
        mode.__exit__(None, None, None)
        torch.set_default_dtype(old_dtype)
        handle.remove()
    assert "torch.nn.Module.register_parameter replaced" in changes
    assert "torch.nn.init.normal_ replaced" in changes
    assert "torch.empty replaced" in changes
    assert "torch.nn.modules.module._global_parameter_registration_hooks changed" in changes
    assert "default dtype torch.float32 -> torch.float64" in changes
    assert "this thread's torch-function mode stack depth 0 -> 1" in changes


def test_default_device_change_is_seen():
    before = snapshot()
    torch.set_default_device("meta")
    try:
        changes = snapshot().changes_since(before)
    finally:
        torch.set_default_device(None)
    assert any(change.startswith("default device") for change in changes)


def test_guard_reports_a_replaced_tensor_method():
    before = snapshot()
    original = vars(torch.Tensor)["register_hook"]
    setattr(torch.Tensor, "register_hook", lambda self, hook: None)  # noqa: B010 (planted)
    try:
        changes = snapshot().changes_since(before)
    finally:
        setattr(torch.Tensor, "register_hook", original)  # noqa: B010
    assert changes == ["torch.Tensor.register_hook replaced"], changes
    assert snapshot().changes_since(before) == []


def test_guard_reports_a_device_table_rebuilt_with_a_replaced_factory():
    from torch.utils._device import _device_constructors

    before = snapshot()
    original = torch.linspace
    torch.linspace = lambda *args, **kwargs: original(*args, **kwargs)
    try:
        _device_constructors.cache_clear()
        _device_constructors()
        torch.linspace = original
        changes = snapshot().changes_since(before)
    finally:
        torch.linspace = original
        _device_constructors.cache_clear()
        _device_constructors()
    assert changes == ["torch.utils._device._device_constructors() changed"], changes
    assert snapshot().changes_since(before) == []


@pytest.mark.parametrize("kind", ["parameter", "buffer", "module"])
def test_guard_reports_an_added_global_hook(kind):
    from torch.nn.modules import module as torch_module

    register = {
        "parameter": torch_module.register_module_parameter_registration_hook,
        "buffer": torch_module.register_module_buffer_registration_hook,
        "module": torch_module.register_module_module_registration_hook,
    }[kind]
    before = snapshot()
    handle = register(lambda *args: None)
    try:
        changes = snapshot().changes_since(before)
    finally:
        handle.remove()
    assert changes, f"a new global {kind} registration hook went unnoticed"
    assert snapshot().changes_since(before) == []


class _PassthroughDispatch(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_SWITCHES = {
    "grad mode": lambda: torch.no_grad(),
    "inference mode": lambda: torch.inference_mode(),
    "torch functions enabled": lambda: torch._C.DisableTorchFunction(),
    "torch-dispatch mode stack depth": lambda: _PassthroughDispatch(),
    "cpu autocast (enabled, dtype)": lambda: torch.autocast("cpu", dtype=torch.float16),
}


@pytest.mark.parametrize("switch", sorted(_SWITCHES))
def test_guard_reports_a_switch_left_on_in_this_thread(switch):
    before = snapshot()
    with _SWITCHES[switch]():
        changes = snapshot().changes_since(before)
    assert any(change.startswith(switch + " ") for change in changes), changes
    assert snapshot().changes_since(before) == []


@pytest.mark.parametrize(
    ("read", "write", "change"),
    [
        (
            torch.__future__.get_swap_module_params_on_conversion,
            torch.__future__.set_swap_module_params_on_conversion,
            "torch.__future__ swap_module_params_on_conversion False -> True",
        ),
        (
            torch.__future__.get_overwrite_module_params_on_conversion,
            torch.__future__.set_overwrite_module_params_on_conversion,
            "torch.__future__ overwrite_module_params_on_conversion False -> True",
        ),
        (
            torch.are_deterministic_algorithms_enabled,
            torch.use_deterministic_algorithms,
            "deterministic algorithms (enabled, warn only) (False, False) -> (True, False)",
        ),
        (
            lambda: not torch.is_autocast_cache_enabled(),
            lambda on: torch.set_autocast_cache_enabled(not on),
            "autocast cache True -> False",
        ),
    ],
)
def test_guard_reports_a_process_flag_left_flipped(read, write, change):
    before = snapshot()
    assert not read()
    write(True)
    try:
        changes = snapshot().changes_since(before)
    finally:
        write(False)
    assert changes == [change]
    assert snapshot().changes_since(before) == []


def test_guard_reports_fill_uninitialized_memory_left_off():
    import torch.utils.deterministic as deterministic

    before = snapshot()
    deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    try:
        changes = snapshot().changes_since(before)
    finally:
        deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    assert changes == ["fill_uninitialized_memory True -> False"], changes
