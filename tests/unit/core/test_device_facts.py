"""The torch functions whose answers the recorder corrects for tensors the context placed on
meta: each is handed to a torch function mode (so the recorder sees it), and
``metamode._core.facts`` names it.

- ``torch.device(d)`` and ``torch._C._nn._parse_to(...)`` make a new device object from a
  device or a tensor (``derives_device``): one made from a placed tensor's device stands for
  the CPU, as that device does.
- ``torch._has_compatible_shallow_copy_type(a, b)`` (``compares_types``): ``Module._apply``
  asks it before giving a parameter the memory of the tensor it made; eager's answer for a
  CPU tensor and a meta one is False.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from metamode._core.facts import fact_of


class _Seen(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


_META = torch.empty(2, device="meta")


def _enter(device: torch.device) -> None:
    with device:  # torch's device context holds torch.device(device)
        pass


DERIVING: dict[str, tuple[Any, Any]] = {
    "torch.device(d)": (torch.device, lambda: torch.device(_META.device)),
    "_parse_to(d)": (torch._C._nn._parse_to, lambda: torch._C._nn._parse_to(_META.device)),
    "_parse_to(tensor)": (torch._C._nn._parse_to, lambda: torch._C._nn._parse_to(_META)),
    "_parse_to(device=d)": (
        torch._C._nn._parse_to,
        lambda: torch._C._nn._parse_to(device=_META.device),
    ),
    "entering a device": (torch.device, lambda: _enter(_META.device)),
    "Module.to(d)": (torch._C._nn._parse_to, lambda: nn.Linear(1, 1, device="meta").to("meta")),
}


@pytest.mark.parametrize("row", sorted(DERIVING))
def test_a_device_made_from_a_device_or_tensor_is_seen_and_named(row):
    func, call = DERIVING[row]
    assert fact_of(func).derives_device and fact_of(func).query
    with _Seen() as seen:
        call()
    assert func in seen.funcs, f"{row}: the mode is not handed {func}"


def test_the_parsed_device_is_a_new_object():
    """Why the rule is needed: identity does not survive a parse."""
    device = _META.device
    assert torch.device(device) is not device
    assert torch._C._nn._parse_to(device)[0] is not device


def test_module_apply_asks_whether_implementations_are_alike():
    func = torch._has_compatible_shallow_copy_type
    assert fact_of(func).compares_types and fact_of(func).query
    with _Seen() as seen:
        nn.Linear(1, 1, device="meta").to(torch.float64)
    assert func in seen.funcs
    assert not func(torch.empty(1), torch.empty(1, device="meta")), "eager: CPU and meta unlike"
    assert func(_META, torch.empty(1, device="meta"))
