"""PEFT's low_cpu_mem_usage=True, through metamode's shim, inside a replayable block, then
materialize: the new adapter equals the one low_cpu_mem_usage=False builds under the same
seed."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from torch import nn

import metamode

pytestmark = pytest.mark.filterwarnings("ignore")


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.v = nn.Linear(16, 16)
        self.o = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x) + self.v(x))


CONFIGS = {
    "lora": lambda: peft.LoraConfig(r=4, target_modules=["q", "v"]),
    "lora_gaussian": lambda: peft.LoraConfig(
        r=4, target_modules=["q", "v"], init_lora_weights="gaussian"
    ),
    "loha": lambda: peft.LoHaConfig(r=4, target_modules=["q", "v"]),
    "lokr": lambda: peft.LoKrConfig(r=4, target_modules=["q", "v"]),
    "ia3": lambda: peft.IA3Config(target_modules=["q", "v", "o"], feedforward_modules=["o"]),
    "adalora": lambda: peft.AdaLoraConfig(r=4, target_modules=["q", "v"], total_step=10),
}


@pytest.fixture
def peft_shim():
    metamode.enable_for_peft()
    try:
        yield
    finally:
        metamode.disable_for_peft()


def _adapt(how: str, base: nn.Module, config, low_cpu_mem_usage: bool) -> nn.Module:
    if how == "get_peft_model":
        return peft.get_peft_model(base, config, low_cpu_mem_usage=low_cpu_mem_usage)
    return peft.inject_adapter_in_model(config, base, low_cpu_mem_usage=low_cpu_mem_usage)


@pytest.mark.parametrize("how", ["get_peft_model", "inject_adapter_in_model"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_new_adapter_materializes_to_the_eager_adapter(peft_shim, name, how):
    torch.manual_seed(0)
    base = Base()
    torch.manual_seed(1)
    ref = _adapt(how, copy.deepcopy(base), CONFIGS[name](), low_cpu_mem_usage=False)
    adapted = copy.deepcopy(base)
    torch.manual_seed(1)
    with metamode.empty_weights(replayable=True):
        model = _adapt(how, adapted, CONFIGS[name](), low_cpu_mem_usage=True)
    on_meta = {n for n, p in model.named_parameters() if p.is_meta}
    assert on_meta, "low_cpu_mem_usage=True should leave the new adapter on meta"
    assert metamode.is_materializable(model)
    assert metamode.materialize(model) is model
    want = dict(ref.named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n
        assert got[n].requires_grad == want[n].requires_grad, n
        assert type(got[n]) is type(want[n]), n
    x = torch.ones(2, 16)
    assert torch.equal(model(x), ref(x))
