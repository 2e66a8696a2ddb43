"""PEFT adapters built with ``low_cpu_mem_usage=True`` through metamode's shim, then
materialized, against ``low_cpu_mem_usage=False`` under the same seed: inits that read the
base weight (DoRA, orthogonal), a second adapter added after the first was materialized,
PEFT inside a user's own replayable block, and an init that branches on meta (MiCA).
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_refused,
    materialize_exactly,
)

pytestmark = pytest.mark.filterwarnings("ignore")


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.v = nn.Linear(16, 16)
        self.o = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x) + self.v(x))


@pytest.fixture
def peft_shim():
    with metamode.enabled("peft"):
        yield


CONFIGS = {
    "lora": lambda: peft.LoraConfig(r=4, target_modules=["q", "v"]),
    "lora_gaussian": lambda: peft.LoraConfig(
        r=4, target_modules=["q", "v"], init_lora_weights="gaussian"
    ),
    "dora": lambda: peft.LoraConfig(r=4, use_dora=True, target_modules=["q", "v"]),
    "orthogonal": lambda: peft.LoraConfig(
        r=4, target_modules=["q", "v"], init_lora_weights="orthogonal"
    ),
}


def _base() -> nn.Module:
    torch.manual_seed(0)
    return Base()


def _adapted(config, low_cpu_mem_usage: bool, base: nn.Module) -> nn.Module:
    model = copy.deepcopy(base)
    torch.manual_seed(1)
    if not low_cpu_mem_usage:
        return peft.get_peft_model(model, config(), low_cpu_mem_usage=False)
    with metamode.empty_weights(replayable=True):  # recorded, to be materialized
        return peft.get_peft_model(model, config(), low_cpu_mem_usage=True)


@pytest.mark.parametrize("name", ["dora", "orthogonal"])
def test_dora_and_orthogonal_inits(peft_shim, name):
    base = _base()
    ref = _adapted(CONFIGS[name], False, base)
    model = _adapted(CONFIGS[name], True, base)
    assert any(p.is_meta for p in model.parameters())
    materialize_exactly(model, ref)
    x = torch.ones(2, 16)
    assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_an_adapter_added_after_the_first_was_materialized(peft_shim, name):
    base = _base()
    ref = _adapted(CONFIGS[name], False, base)
    ref.add_adapter("b", CONFIGS[name](), low_cpu_mem_usage=False)
    model = _adapted(CONFIGS[name], True, base)
    materialize_exactly(model)
    with metamode.empty_weights(replayable=True):
        model.add_adapter("b", CONFIGS[name](), low_cpu_mem_usage=True)
    assert any(p.is_meta for n, p in model.named_parameters() if ".b." in n or n.endswith(".b"))
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", ["lora", "lora_gaussian", "dora"])
def test_peft_inside_a_users_replayable_block(peft_shim, name, include_buffers):
    torch.manual_seed(0)
    ref = peft.get_peft_model(Base(), CONFIGS[name](), low_cpu_mem_usage=False)
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = peft.get_peft_model(Base(), CONFIGS[name](), low_cpu_mem_usage=True)
    materialize_exactly(model, ref)


def test_mica_which_skips_its_init_on_meta_is_refused_naming_the_read(peft_shim):
    # Eager MiCA sets lora_B from the base weight's SVD and zeroes lora_A; on meta it
    # returns before both, leaving nn.Linear's own init in the recording.
    config = lambda: peft.LoraConfig(r=4, target_modules=["q", "v"], init_lora_weights="mica")  # noqa: E731
    model = _adapted(config, True, _base())
    adapter = [n for n, p in model.named_parameters() if p.is_meta]
    assert any("lora_A" in n for n in adapter) and any("lora_B" in n for n in adapter)
    assert_refused(model, *adapter, because=r"is_meta|device")


def test_an_adapter_built_outside_a_replayable_block_is_not_recorded(peft_shim):
    # PEFT's low_cpu_mem_usage=True mostly loads adapters: the shim records nothing then
    model = peft.get_peft_model(_base(), CONFIGS["lora"](), low_cpu_mem_usage=True)
    adapter = [n for n, p in model.named_parameters() if p.is_meta]
    assert_refused(model, *adapter, because="replayable=True")
