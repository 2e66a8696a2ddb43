"""PEFT's low_cpu_mem_usage=True, through metamode's shim, inside a replayable block, then
materialize: every tensor equals the one low_cpu_mem_usage=False builds under the same seed,
and materialize leaves the default generator as it was."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import MODES, materialize_exactly

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
    "oft_rank": lambda: peft.OFTConfig(r=4, oft_block_size=0, target_modules=["q", "v"]),
    "oft_block_size_random": lambda: peft.OFTConfig(
        oft_block_size=4, target_modules=["q", "v"], init_weights=False
    ),
    "oft_coft_random": lambda: peft.OFTConfig(
        r=4, oft_block_size=0, target_modules=["q", "v"], coft=True, init_weights=False
    ),
    "oft_block_share_random": lambda: peft.OFTConfig(
        r=4, oft_block_size=0, target_modules=["q", "v"], block_share=True, init_weights=False
    ),
}

# BOFT fills its permutation buffer entry by entry (perm_mat[i, idx] = 1 reads idx.item()),
# so with include_buffers=True its build raises on meta, as under accelerate's
# init_empty_weights(include_buffers=True): these are checked with include_buffers=False.
BOFT = {
    "boft_block_size": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=["q", "v"]),
    "boft_block_size_random": lambda: peft.BOFTConfig(
        boft_block_size=4, target_modules=["q", "v"], init_weights=False
    ),
    "boft_block_num_random": lambda: peft.BOFTConfig(
        boft_block_size=0, boft_block_num=2, target_modules=["q", "v"], init_weights=False
    ),
}

# VeRA keeps shared projections on the tuner, so only get_peft_model builds it; it moves
# them with .to(), which raises on meta with include_buffers=True (as under accelerate).
VERA = {
    "vera": lambda: peft.VeraConfig(r=4, target_modules=["q", "v"]),
    "vera_random": lambda: peft.VeraConfig(r=4, target_modules=["q", "v"], init_weights=False),
}

HOWS = ["get_peft_model", "inject_adapter_in_model"]


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


def assert_adapter_materializes_to_eager(config, how: str, include_buffers: bool) -> None:
    torch.manual_seed(0)
    base = Base()
    torch.manual_seed(1)
    ref = _adapt(how, copy.deepcopy(base), config(), low_cpu_mem_usage=False)
    adapted = copy.deepcopy(base)
    torch.manual_seed(1)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = _adapt(how, adapted, config(), low_cpu_mem_usage=True)
    on_meta = {n for n, p in model.named_parameters() if p.is_meta}
    assert on_meta, "low_cpu_mem_usage=True should leave the new adapter on meta"
    materialize_exactly(model, ref)
    x = torch.ones(2, 16)
    assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_new_adapter_materializes_to_the_eager_adapter(peft_shim, name, how, include_buffers):
    assert_adapter_materializes_to_eager(CONFIGS[name], how, include_buffers)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("name", sorted(BOFT))
def test_new_boft_adapter_materializes_to_the_eager_adapter(peft_shim, name, how):
    assert_adapter_materializes_to_eager(BOFT[name], how, include_buffers=False)


@pytest.mark.parametrize("name", sorted(VERA))
def test_new_vera_adapter_materializes_to_the_eager_adapter(peft_shim, name):
    assert_adapter_materializes_to_eager(VERA[name], "get_peft_model", include_buffers=False)
