"""metamode.enable_for_peft(): how it rebinds, and that PEFT behaves exactly as before."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

import metamode
from metamode.lab.scenarios import TinyAttentionBlock
from tests.conftest import run_python

NAMES = ("init_empty_weights", "_init_on_device", "_skip_init_on_device")
BOUND_BY_NAME = {
    "peft.tuners.tuners_utils.init_empty_weights",
    "peft.peft_model.init_empty_weights",
    "peft.tuners.adalora.layer._skip_init_on_device",
}


@pytest.fixture
def integrations():
    import peft.utils.integrations as integrations

    originals = {name: getattr(integrations, name) for name in NAMES}
    yield integrations
    metamode.disable_for_peft()
    assert {name: getattr(integrations, name) for name in NAMES} == originals


@pytest.fixture
def shim(integrations):
    metamode.enable_for_peft()
    return integrations


# -- rebinding ---------------------------------------------------------------------


def test_enable_rebinds_every_by_name_import_and_disable_restores(integrations):
    import peft.peft_model
    import peft.tuners.adalora.layer
    import peft.tuners.tuners_utils

    originals = {name: getattr(integrations, name) for name in NAMES}
    bound = metamode.enable_for_peft()
    assert set(bound) >= BOUND_BY_NAME
    assert {f"peft.utils.integrations.{name}" for name in NAMES} <= set(bound)
    for name in NAMES:
        assert getattr(integrations, name).__module__ == "metamode.integrations.peft"
    assert peft.tuners.tuners_utils.init_empty_weights is integrations.init_empty_weights
    assert peft.tuners.adalora.layer._skip_init_on_device is integrations._skip_init_on_device

    assert metamode.enable_for_peft() == bound, "enable is idempotent"
    assert set(metamode.disable_for_peft()) == set(bound)
    assert peft.tuners.tuners_utils.init_empty_weights is originals["init_empty_weights"]
    assert peft.peft_model.init_empty_weights is originals["init_empty_weights"]
    assert peft.tuners.adalora.layer._skip_init_on_device is originals["_skip_init_on_device"]
    assert metamode.disable_for_peft() == ()


def test_aliases_are_found_by_identity(integrations):
    alias = types.ModuleType("peft._metamode_alias_probe")
    alias.empty = integrations.init_empty_weights  # `from ... import X as empty`
    sys.modules[alias.__name__] = alias
    try:
        assert "peft._metamode_alias_probe.empty" in metamode.enable_for_peft()
        assert alias.empty is integrations.init_empty_weights
        metamode.disable_for_peft()
        assert alias.empty.__module__ == "peft.utils.integrations"
    finally:
        del sys.modules[alias.__name__]


class _RefusingModule(types.ModuleType):
    def __setattr__(self, name, value):
        raise AttributeError(f"{self.__name__} is read-only")


def test_a_failed_rebinding_changes_nothing(integrations):
    import peft.tuners.tuners_utils

    original = integrations.init_empty_weights
    refusing = _RefusingModule("peft.zzz_refusing")
    vars(refusing)["bound"] = original
    sys.modules[refusing.__name__] = refusing
    try:
        with pytest.raises(AttributeError, match="read-only"):
            metamode.enable_for_peft()
    finally:
        del sys.modules[refusing.__name__]
    assert integrations.init_empty_weights is original
    assert peft.tuners.tuners_utils.init_empty_weights is original


def test_peft_without_the_expected_names_is_refused_and_nothing_changes(integrations, monkeypatch):
    import peft.tuners.tuners_utils

    original = integrations.init_empty_weights
    monkeypatch.delattr(integrations, "_skip_init_on_device")
    expected = r"peft 0\.\d+.*_skip_init_on_device"
    with pytest.raises(metamode.IncompatibleLibraryError, match=expected):
        metamode.enable_for_peft()
    assert integrations.init_empty_weights is original
    assert peft.tuners.tuners_utils.init_empty_weights is original


@pytest.mark.slow
def test_modules_imported_after_enable_get_the_shim_and_are_restored():
    result = run_python(
        """
import importlib, json, sys
import metamode
metamode.enable_for_peft()
del sys.modules["peft.tuners.adalora.layer"]
layer = importlib.import_module("peft.tuners.adalora.layer")  # a fresh `from ... import`
during = layer._skip_init_on_device.__module__
metamode.disable_for_peft()
print(json.dumps([during, layer._skip_init_on_device.__module__]))
"""
    )
    assert result == ["metamode.integrations.peft", "peft.utils.integrations"]


@pytest.mark.slow
def test_missing_peft_names_the_extra():
    result = run_python(
        """
import json, sys
sys.modules["peft"] = None  # as if PEFT were not installed
import metamode, torch
before = vars(torch.nn.Module)["register_parameter"]
try:
    metamode.enable_for_peft()
    print(json.dumps("no error"))
except ImportError as error:
    print(json.dumps([str(error), vars(torch.nn.Module)["register_parameter"] is before]))
"""
    )
    assert "pip install 'metamode[peft]'" in result[0] and result[1] is True


# -- semantics equal PEFT's own low_cpu_mem_usage path ---------------------------------


def _devices(model: nn.Module) -> dict[str, str]:
    return {name: p.device.type for name, p in model.named_parameters()}


def _lora_state_dict(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    generator = torch.Generator().manual_seed(seed)
    return {
        key: torch.randn(value.shape, generator=generator)
        for key, value in get_peft_model_state_dict(model).items()
    }


def _inject_and_load(model, config, low_cpu_mem_usage, state_dict=None):
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    inject_adapter_in_model(config, model, low_cpu_mem_usage=low_cpu_mem_usage)
    after_injection = _devices(model)
    if state_dict is not None:
        set_peft_model_state_dict(model, state_dict, low_cpu_mem_usage=low_cpu_mem_usage)
    return after_injection


def _load(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, state_dict)


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v", "up"])


@pytest.mark.parametrize("shimmed", [False, True], ids=["stock", "shim"])
def test_lora_meta_after_injection_real_after_loading_same_output(integrations, shimmed):
    if shimmed:
        metamode.enable_for_peft()
    torch.manual_seed(0)
    reference, model = TinyAttentionBlock(), TinyAttentionBlock()
    model.load_state_dict(reference.state_dict())
    _inject_and_load(reference, _lora_config(), low_cpu_mem_usage=False)
    state_dict = _lora_state_dict(reference, seed=1)
    _load(reference, state_dict)
    after_injection = _inject_and_load(model, _lora_config(), True, state_dict)

    assert after_injection == {
        name: "meta" if "lora_" in name else "cpu" for name in after_injection
    }
    assert set(_devices(model).values()) == {"cpu"}
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("shimmed", [False, True], ids=["stock", "shim"])
def test_adalora_ranknum_stays_real(integrations, shimmed):
    from peft import AdaLoraConfig

    if shimmed:
        metamode.enable_for_peft()
    model = TinyAttentionBlock()
    config = AdaLoraConfig(init_r=4, target_modules=["q", "v"], total_step=10)
    devices = _inject_and_load(model, config, low_cpu_mem_usage=True)
    ranknum = {n: d for n, d in devices.items() if "ranknum" in n}
    assert ranknum and set(ranknum.values()) == {"cpu"}
    lora = {n: d for n, d in devices.items() if "lora_" in n}
    assert lora and set(lora.values()) == {"meta"}
    assert model.q.ranknum["default"].item() == 4.0


class WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


@pytest.mark.parametrize("shimmed", [False, True], ids=["stock", "shim"])
def test_lora_on_multihead_attention_keeps_base_weights_real(integrations, shimmed):
    from peft import LoraConfig

    if shimmed:
        metamode.enable_for_peft()
    torch.manual_seed(0)
    reference, model = WithAttention(), WithAttention()
    model.load_state_dict(reference.state_dict())
    config = LoraConfig(r=2, target_modules=["attn"])
    _inject_and_load(reference, config, low_cpu_mem_usage=False)
    state_dict = _lora_state_dict(reference, seed=3)
    _load(reference, state_dict)
    devices = _inject_and_load(model, LoraConfig(r=2, target_modules=["attn"]), True, state_dict)

    base = {n: d for n, d in devices.items() if "lora_" not in n}
    assert base and set(base.values()) == {"cpu"}, base
    assert {d for n, d in devices.items() if "lora_" in n} == {"meta"}
    x = torch.randn(5, 1, 8, generator=torch.Generator().manual_seed(4))
    assert torch.equal(model(x), reference(x))
