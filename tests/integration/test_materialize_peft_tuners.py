"""Every PEFT tuner and LoRA option the installed PEFT can build offline, beyond those of
test_materialize_peft.py and test_materialize_peft_init.py, created with
``low_cpu_mem_usage=True`` through metamode's shim inside a replayable block, then
materialized: each tensor equals the one ``low_cpu_mem_usage=False`` builds under the same
seed, or materialize refuses upfront naming the read that makes the build differ. On a real
base (plain torch layers, a tiny Llama, a tiny GPT-2), with a second adapter added after the
first was materialized, with the base built in the same block, and on a bfloat16 base. Builds
that raise under a plain (not replayable) meta context raise the same way when replayable.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import peft
import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_exact_or_refused,
    assert_refused,
    materialize_exactly,
    tensors,
)

pytestmark = pytest.mark.filterwarnings("ignore")


# -- base models --------------------------------------------------------------------------


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.v = nn.Linear(16, 16)
        self.o = nn.Linear(16, 4)


class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.q = nn.Linear(16, 16)
        self.v = nn.Linear(16, 16)
        self.lm = nn.Linear(16, 32)


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.conv1 = nn.Conv1d(8, 8, 3)
        self.q = nn.Linear(8, 8)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.v = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)


class Layered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(2, 16, 8))
        self.down = nn.Parameter(torch.randn(8, 16))


class WithExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = Experts()
        self.q = nn.Linear(16, 16)


def llama() -> nn.Module:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def gpt2() -> nn.Module:
    config = GPT2Config(
        vocab_size=64,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


# -- the tuners ---------------------------------------------------------------------------

HOWS = ("get_peft_model", "inject_adapter_in_model")
GET = ("get_peft_model",)  # a tuner with state on the tuner: PEFT refuses inject_adapter_in_model
# On a real base PEFT's own context (include_buffers=False) governs the adapter, so there
# include_buffers=True is checked for a few tuners only (BOTH); a base built in the block,
# in both modes
BOTH = tuple(MODES)
PARAMS = (False,)
QV = ["q", "v"]
ATTN = ["q_proj", "v_proj"]


class Case(NamedTuple):
    base: Callable[[], nn.Module]
    config: Callable[[], peft.config.PeftConfig]
    hows: tuple[str, ...] = HOWS
    modes: tuple[bool, ...] = PARAMS
    deferred: bool = True  # the new adapter has tensors on meta


L = peft.LoraConfig

TUNERS: dict[str, Case] = {
    "fourierft": Case(
        Base, lambda: peft.FourierFTConfig(n_frequency=20, target_modules=QV), modes=BOTH
    ),
    "hra": Case(Base, lambda: peft.HRAConfig(r=4, target_modules=QV)),
    "hra_gs_random": Case(
        Base, lambda: peft.HRAConfig(r=4, target_modules=QV, apply_GS=True, init_weights=False)
    ),
    "miss": Case(Base, lambda: peft.MissConfig(r=4, target_modules=QV)),
    "miss_bat": Case(Base, lambda: peft.MissConfig(r=4, target_modules=QV, init_weights="bat")),
    "miss_mini": Case(
        Base, lambda: peft.MissConfig(r=4, mini_r=2, target_modules=QV, init_weights="mini")
    ),
    "c3a": Case(Base, lambda: peft.C3AConfig(block_size=4, target_modules=QV)),
    "c3a_xavier": Case(
        Base,
        lambda: peft.C3AConfig(block_size=4, target_modules=QV, init_weights="xavier_uniform"),
    ),
    "randlora": Case(Base, lambda: peft.RandLoraConfig(r=4, target_modules=QV)),
    "randlora_sparse": Case(Base, lambda: peft.RandLoraConfig(r=4, target_modules=QV, sparse=True)),
    "shira_random": Case(
        Base, lambda: peft.ShiraConfig(r=2, target_modules=QV, init_weights=False)
    ),
    "vblora": Case(
        Base,
        lambda: peft.VBLoRAConfig(r=4, num_vectors=8, vector_length=4, target_modules=QV),
        hows=GET,
        modes=BOTH,
    ),
    "poly": Case(
        Base, lambda: peft.PolyConfig(r=4, target_modules=QV, n_tasks=2, n_skills=4, n_splits=2)
    ),
    "road_1": Case(
        Base, lambda: peft.RoadConfig(variant="road_1", group_size=4, target_modules=QV)
    ),
    "road_2_random": Case(
        Base,
        lambda: peft.RoadConfig(
            variant="road_2", group_size=4, target_modules=QV, init_weights=False
        ),
    ),
    "waveft_random": Case(
        Base, lambda: peft.WaveFTConfig(n_frequency=20, target_modules=QV, init_weights=False)
    ),
    "delora": Case(Base, lambda: peft.DeloraConfig(r=4, target_modules=QV)),
    "delora_random": Case(
        Base, lambda: peft.DeloraConfig(r=4, target_modules=QV, init_weights=False)
    ),
    "gralora_hybrid": Case(
        Base, lambda: peft.GraloraConfig(r=8, hybrid_r=4, gralora_k=2, target_modules=QV)
    ),
    "osf": Case(Base, lambda: peft.OSFConfig(effective_rank=4, target_modules=QV), modes=BOTH),
    "beft_random": Case(Base, lambda: peft.BeftConfig(target_modules=QV, init_weights=False)),
    "lily_random": Case(
        Base,
        lambda: peft.LilyConfig(r=4, num_B=2, stride_A=1, target_modules=QV, init_weights=False),
    ),
    "pvera_random": Case(
        Base,
        lambda: peft.PveraConfig(r=4, target_modules=QV, init_weights=False),
        hows=GET,
    ),
    "glora": Case(Base, lambda: peft.GloraConfig(r=4, target_modules=QV)),
    "unilora": Case(
        Base,
        lambda: peft.UniLoraConfig(r=4, theta_d_length=32, target_modules=QV),
        hows=GET,
    ),
    "hira_random": Case(Base, lambda: peft.HiraConfig(r=4, target_modules=QV, init_weights=False)),
    "tinylora_uniform": Case(
        Base,
        lambda: peft.TinyLoraConfig(r=2, u=4, target_modules=QV, init_weights="uniform"),
        hows=GET,
        modes=BOTH,
    ),
    "peanut_random": Case(
        Base, lambda: peft.PeanutConfig(r=4, target_modules=QV, init_weights=False)
    ),
    "supertuning": Case(Base, lambda: peft.SupertuningConfig(r=4, target_modules=QV)),
    "trainable_tokens": Case(
        Embedded,
        lambda: peft.TrainableTokensConfig(target_modules=["emb"], token_indices=[1, 3]),
        modes=BOTH,
    ),
    # LN tuning copies the real layer norm: nothing is left on meta
    "ln_tuning": Case(
        Layered, lambda: peft.LNTuningConfig(target_modules=["norm"]), deferred=False
    ),
    "psoft": Case(Base, lambda: peft.PsoftConfig(r=4, target_modules=QV), modes=BOTH),
    "deft": Case(
        Base, lambda: peft.DeftConfig(r=4, target_modules=QV, init_weights=False), modes=BOTH
    ),
    "frod": Case(
        Base,
        lambda: peft.FrodConfig(target_modules=QV, progressbar=False),
        hows=GET,
    ),
    # LoRA options
    "lora_rslora": Case(
        Base, lambda: L(r=4, target_modules=QV, use_rslora=True, init_lora_weights="gaussian")
    ),
    "lora_bias": Case(Base, lambda: L(r=4, target_modules=QV, lora_bias=True)),
    "lora_init_false": Case(Base, lambda: L(r=4, target_modules=QV, init_lora_weights=False)),
    "lora_dropout_bias_all": Case(
        Base,
        lambda: L(r=4, target_modules=QV, lora_dropout=0.1, bias="all", init_lora_weights=False),
    ),
    "lora_modules_to_save": Case(Base, lambda: L(r=4, target_modules=QV, modules_to_save=["o"])),
    "lora_rank_alpha_pattern": Case(
        Base,
        lambda: L(
            r=4,
            target_modules=QV,
            rank_pattern={"v": 2},
            alpha_pattern={"v": 3},
            init_lora_weights="gaussian",
        ),
    ),
    "lora_embedding": Case(
        Embedded, lambda: L(r=4, target_modules=["emb", "q"], init_lora_weights="gaussian")
    ),
    "lora_trainable_token_indices": Case(
        Embedded,
        lambda: L(r=4, target_modules=["q"], trainable_token_indices={"emb": [1, 3]}),
    ),
    "lora_conv": Case(
        Convs, lambda: L(r=4, target_modules=["conv", "conv1"], init_lora_weights="gaussian")
    ),
    "lora_conv_dora": Case(
        Convs, lambda: L(r=4, target_modules=["conv", "conv1"], use_dora=True), modes=BOTH
    ),
    "lora_layers_to_transform": Case(
        Layered,
        lambda: L(
            r=4,
            target_modules=QV,
            layers_to_transform=[1],
            layers_pattern="layers",
            init_lora_weights="gaussian",
        ),
    ),
    "lora_target_parameters": Case(
        WithExperts,
        lambda: L(
            r=4,
            target_modules=[],
            target_parameters=["experts.gate_up", "experts.down"],
            init_lora_weights="gaussian",
        ),
        modes=BOTH,
    ),
    "lora_bdlora": Case(
        Base,
        lambda: L(
            r=4,
            target_modules=QV,
            use_bdlora=peft.BdLoraConfig(
                target_modules_bd_a=["q"], target_modules_bd_b=["v"], nblocks=2
            ),
        ),
    ),
    "lora_kasa": Case(
        Base, lambda: L(r=4, target_modules=QV, kasa_config=peft.KasaConfig()), modes=BOTH
    ),
    "lora_velora": Case(
        Base,
        lambda: L(
            r=4,
            target_modules=QV,
            velora_config=peft.VeloraConfig(num_groups=4, init_type="random"),
        ),
    ),
    "lora_monteclora": Case(
        Base, lambda: L(r=4, target_modules=QV, monteclora_config=peft.MontecloraConfig())
    ),
    "lora_pissa": Case(Base, lambda: L(r=4, target_modules=QV, init_lora_weights="pissa")),
    "lora_pissa_niter": Case(
        Base, lambda: L(r=4, target_modules=QV, init_lora_weights="pissa_niter_2")
    ),
    "lora_olora": Case(Base, lambda: L(r=4, target_modules=QV, init_lora_weights="olora")),
    # transformers models
    "llama_lora_embedding_one_layer": Case(
        llama,
        lambda: L(
            r=4,
            target_modules=[*ATTN, "embed_tokens"],
            layers_to_transform=[1],
            task_type="CAUSAL_LM",
        ),
        modes=BOTH,
    ),
    "llama_lora_layer_replication": Case(
        llama,
        lambda: L(
            r=4,
            target_modules=ATTN,
            layer_replication=[[0, 2], [1, 2]],
            init_lora_weights="gaussian",
        ),
        hows=GET,
    ),
    "llama_alora": Case(
        llama,
        lambda: L(
            r=4, target_modules=ATTN, alora_invocation_tokens=[1, 2], init_lora_weights="gaussian"
        ),
    ),
    "llama_lora_tied": Case(
        llama,
        lambda: L(r=4, target_modules=["embed_tokens", "lm_head"], ensure_weight_tying=True),
    ),
    "llama_adaption_prompt": Case(
        llama,
        lambda: peft.AdaptionPromptConfig(adapter_len=4, adapter_layers=1, task_type="CAUSAL_LM"),
        hows=GET,
    ),
    "llama_trainable_tokens": Case(
        llama,
        lambda: peft.TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[1, 3]),
    ),
    "llama_vera": Case(llama, lambda: peft.VeraConfig(r=4, target_modules=ATTN), hows=GET),
    "gpt2_lora_fan_in_fan_out": Case(
        gpt2,
        lambda: L(
            r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights="gaussian"
        ),
    ),
    "gpt2_ia3": Case(
        gpt2,
        lambda: peft.IA3Config(
            target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"]
        ),
        modes=BOTH,
    ),
    # prompt learning and Shadow: PEFT has no low_cpu_mem_usage path for them (the block
    # itself puts them on meta), so only a base built in the block is checked
    "prompt_tuning": Case(
        llama, lambda: peft.PromptTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"), GET
    ),
    "prefix_tuning": Case(
        llama, lambda: peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"), GET
    ),
    "prefix_tuning_projection": Case(
        llama,
        lambda: peft.PrefixTuningConfig(
            num_virtual_tokens=4,
            prefix_projection=True,
            encoder_hidden_size=8,
            task_type="CAUSAL_LM",
        ),
        GET,
    ),
    "p_tuning_mlp": Case(
        llama,
        lambda: peft.PromptEncoderConfig(
            num_virtual_tokens=4, encoder_hidden_size=8, task_type="CAUSAL_LM"
        ),
        GET,
    ),
    "p_tuning_lstm": Case(
        llama,
        lambda: peft.PromptEncoderConfig(
            num_virtual_tokens=4,
            encoder_hidden_size=8,
            encoder_reparameterization_type="LSTM",
            task_type="CAUSAL_LM",
        ),
        GET,
    ),
    "multitask_prompt_tuning": Case(
        llama,
        lambda: peft.MultitaskPromptTuningConfig(
            num_virtual_tokens=4, num_tasks=2, num_ranks=1, task_type="CAUSAL_LM"
        ),
        GET,
    ),
    "cpt": Case(
        llama,
        lambda: peft.CPTConfig(
            cpt_token_ids=[1, 2, 3],
            cpt_mask=[1, 1, 1],
            cpt_tokens_type_mask=[1, 2, 3],
            task_type="CAUSAL_LM",
        ),
        GET,
    ),
    "cartridge": Case(
        llama, lambda: peft.CartridgeConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"), GET
    ),
    "shadow": Case(
        llama,
        lambda: peft.ShadowConfig(
            r=4,
            shadow_hidden_size=16,
            shadow_num_attention_heads=2,
            shadow_intermediate_size=32,
            task_type="CAUSAL_LM",
        ),
        GET,
    ),
}

ONLY_INSIDE = {
    "prompt_tuning",
    "prefix_tuning",
    "prefix_tuning_projection",
    "p_tuning_mlp",
    "p_tuning_lstm",
    "multitask_prompt_tuning",
    "cpt",
    "cartridge",
    "shadow",
    # PEFT's own low_cpu_mem_usage=True raises for these on a real base
    "lora_pissa",
    "lora_pissa_niter",
    "lora_olora",
}

# refused upfront on a real base, the reason naming the read
REFUSED = {
    "psoft": r"OrthLayer\.reset_parameters.* read \.is_meta",
    "deft": r"DeftLayer\.reset_deft_parameters read \.is_meta",
    "lora_velora": r"__bool__ read the values of a tensor the build computed from random numbers",
    "lora_monteclora": r"MonteCLoRA defers its sampler",
}

# refused upfront, the reason naming PEFT's branch on meta
KASA = "KaSA skip their SVD"
DELORA = "DeLoRA takes ones for the base weight's norms"
HALF = "casts it to the base layer's dtype"

META_BRANCH_ON_A_REAL_BASE = {"lora_kasa": KASA}
META_BRANCH_INSIDE = {"lora_kasa": KASA, "delora": DELORA, "delora_random": DELORA}

INSIDE = sorted(
    ONLY_INSIDE | set(META_BRANCH_INSIDE) | {"llama_vera", "osf", "llama_adaption_prompt"}
)
# a second adapter, where PEFT takes one: adaption prompt keeps the inactive one out of the
# module tree, LoRA takes one adapter with bias="all" only (layer replication: for time)
NO_SECOND = {"llama_adaption_prompt", "lora_dropout_bias_all", "llama_lora_layer_replication"}
SECOND = sorted(
    name
    for name, case in TUNERS.items()
    if "get_peft_model" in case.hows
    and name not in ONLY_INSIDE | set(REFUSED) | set(META_BRANCH_ON_A_REAL_BASE) | NO_SECOND
)
HALF_PRECISION = {
    "frod": None,
    "lora_rslora": HALF,
    "lora_conv_dora": HALF,
    "hra_gs_random": HALF,
    "c3a_xavier": HALF,
    "vblora": HALF,
    "delora_random": HALF,
    "osf": None,
    "tinylora_uniform": None,
}


def _adapt(how: str, base: nn.Module, config, low_cpu_mem_usage: bool) -> nn.Module:
    if how == "get_peft_model":
        return peft.get_peft_model(base, config, low_cpu_mem_usage=low_cpu_mem_usage)
    return peft.inject_adapter_in_model(config, base, low_cpu_mem_usage=low_cpu_mem_usage)


def _on_a_real_base(
    case: Case, how: str, include_buffers: bool, base: Callable[[], nn.Module] | None = None
) -> tuple[nn.Module, nn.Module]:
    """(adapter built replayable with low_cpu_mem_usage=True on a real base, eager adapter)."""
    torch.manual_seed(0)
    real = (base or case.base)()
    torch.manual_seed(1)
    ref = _adapt(how, copy.deepcopy(real), case.config(), low_cpu_mem_usage=False)
    model = copy.deepcopy(real)
    torch.manual_seed(1)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = _adapt(how, model, case.config(), low_cpu_mem_usage=True)
    return model, ref


def _meta(model: nn.Module) -> list[str]:
    return [name for name, tensor in tensors(model).items() if tensor.is_meta]


def _cases(names, modes: tuple[bool, ...] | None = None, get_only: bool = False) -> list:
    params = []
    for name in sorted(names):
        case = TUNERS[name]
        for how in GET if get_only else case.hows:
            for mode in modes or case.modes:
                where = "buffers" if mode else "params"
                params.append(
                    pytest.param(name, how, mode, id=f"{name}-{how.split('_')[0]}-{where}")
                )
    return params


def _refused_upfront(model: nn.Module, ref: nn.Module, because: str) -> None:
    assert not metamode.is_materializable(model)
    assert_exact_or_refused(model, ref, because=because)


@pytest.fixture
def peft_shim(one_intra_op_thread):
    with metamode.enabled("peft"):
        yield


@pytest.mark.parametrize(
    ("name", "how", "include_buffers"),
    _cases(set(TUNERS) - ONLY_INSIDE),
)
def test_a_new_adapter_on_a_real_base(peft_shim, name, how, include_buffers):
    case = TUNERS[name]
    model, ref = _on_a_real_base(case, how, include_buffers)
    adapter = _meta(model)
    assert bool(adapter) == case.deferred
    if name in REFUSED:
        assert_refused(model, *adapter, because=REFUSED[name])
    elif name in META_BRANCH_ON_A_REAL_BASE:
        _refused_upfront(model, ref, META_BRANCH_ON_A_REAL_BASE[name])
    else:
        materialize_exactly(model, ref)


@pytest.mark.parametrize(
    ("name", "how", "include_buffers"),
    _cases(SECOND, modes=PARAMS, get_only=True),
)
def test_a_second_adapter_added_after_the_first_was_materialized(
    peft_shim, name, how, include_buffers
):
    case = TUNERS[name]
    torch.manual_seed(0)
    real = case.base()
    torch.manual_seed(1)
    ref = peft.get_peft_model(copy.deepcopy(real), case.config(), low_cpu_mem_usage=False)
    ref.add_adapter("b", case.config(), low_cpu_mem_usage=False)
    model = copy.deepcopy(real)
    torch.manual_seed(1)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = peft.get_peft_model(model, case.config(), low_cpu_mem_usage=True)
    materialize_exactly(model)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model.add_adapter("b", case.config(), low_cpu_mem_usage=True)
    added = [tensor for tensor in _meta(model) if ".b." in tensor or tensor.endswith(".b")]
    assert bool(added) == case.deferred
    materialize_exactly(model, ref)


@pytest.mark.parametrize(("name", "how", "include_buffers"), _cases(INSIDE, modes=BOTH))
def test_an_adapter_built_with_its_base_in_one_block(peft_shim, name, how, include_buffers):
    case = TUNERS[name]
    torch.manual_seed(0)
    ref = _adapt(how, case.base(), case.config(), low_cpu_mem_usage=False)
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = _adapt(how, case.base(), case.config(), low_cpu_mem_usage=True)
    if name in META_BRANCH_INSIDE:
        _refused_upfront(model, ref, META_BRANCH_INSIDE[name])
    else:
        materialize_exactly(model, ref)


@pytest.mark.parametrize(
    ("name", "how", "include_buffers"),
    _cases(HALF_PRECISION, modes=PARAMS),
)
def test_a_new_adapter_on_a_bfloat16_base(peft_shim, name, how, include_buffers):
    case = TUNERS[name]
    model, ref = _on_a_real_base(
        case, how, include_buffers, base=lambda: case.base().to(torch.bfloat16)
    )
    if HALF_PRECISION[name]:
        _refused_upfront(model, ref, HALF_PRECISION[name])
    else:
        materialize_exactly(model, ref)


def test_xlora_refuses_the_adapters_it_loads_into_meta(peft_shim, tmp_path: Path):
    # Stock PEFT leaves the LoRA weights X-LoRA loads on meta under low_cpu_mem_usage=True
    # (copied into meta tensors), where eager holds the file's values: no replay gives them.
    adapters = {}
    torch.manual_seed(5)
    for index in range(2):
        config = L(r=4, target_modules=ATTN, init_lora_weights="gaussian", task_type="CAUSAL_LM")
        path = tmp_path / f"adapter{index}"
        peft.get_peft_model(llama(), config).save_pretrained(path)
        adapters[str(index)] = str(path)
    config = peft.XLoraConfig(
        task_type="CAUSAL_LM", hidden_size=16, adapters=adapters, xlora_depth=2, xlora_size=8
    )
    torch.manual_seed(0)
    real = llama()
    torch.manual_seed(1)
    with metamode.empty_weights(replayable=True):
        model = peft.get_peft_model(real, config, low_cpu_mem_usage=True)
    loaded = [name for name in _meta(model) if ".lora_" in name]
    assert len(loaded) == 16
    assert any("xlora_classifier" in name for name in _meta(model))
    assert_refused(model, *loaded, because=r"UntypedStorage: the bytes .* read from a file")


def _frod_with_a_float32_adapter_on_a_float64_base(low_cpu_mem_usage: bool) -> nn.Module:
    torch.manual_seed(0)
    base = Base().to(torch.float64)
    model = peft.get_peft_model(base, TUNERS["frod"].config(), low_cpu_mem_usage=False)
    for name, param in model.named_parameters():
        if ".frod_" in name and param.dtype.is_floating_point:
            param.data = param.data.float()
    torch.manual_seed(1)
    with metamode.empty_weights(replayable=True) if low_cpu_mem_usage else contextlib.nullcontext():
        model.add_adapter("b", TUNERS["frod"].config(), low_cpu_mem_usage=low_cpu_mem_usage)
    return model


def test_frod_refuses_an_adapter_whose_dtype_eager_would_pick_otherwise(peft_shim):
    """FRoD picks a new adapter's dtype from an existing adapter and casts it to the base
    layer's, skipping adapters on meta: with a float32 adapter on a float64 base, eager's
    second adapter is cast where the meta one is not, so it is refused upfront."""
    ref = _frod_with_a_float32_adapter_on_a_float64_base(low_cpu_mem_usage=False)
    model = _frod_with_a_float32_adapter_on_a_float64_base(low_cpu_mem_usage=True)
    added = [name for name in _meta(model) if name.endswith("frod_lambda_l.b")]
    assert added
    dtypes = {tensors(model)[n].dtype for n in added}, {tensors(ref)[n].dtype for n in added}
    assert dtypes == ({torch.float32}, {torch.float64})  # eager cast them, meta did not
    _refused_upfront(model, ref, "FRoD leaves an adapter on the meta device")


# name ("-inside": the base built in the block) -> (how, include_buffers, base built in the
# block, what the plain meta build raises)
RAISES = {
    "lora_pissa": ("get_peft_model", False, False, "set_data"),
    "lora_pissa_niter": ("inject_adapter_in_model", False, False, "set_data"),
    "lora_olora": ("get_peft_model", False, False, "set_data"),
    "prompt_tuning": ("get_peft_model", False, False, "Cannot copy out of meta"),
    "p_tuning_lstm": ("get_peft_model", True, False, "Cannot copy out of meta"),
    "shadow": ("get_peft_model", False, False, "Cannot copy out of meta"),
    "randlora": ("get_peft_model", True, False, "Cannot copy out of meta"),
    "shira_random": ("inject_adapter_in_model", True, False, "Cannot copy out of meta"),
    "pvera_random": ("get_peft_model", True, False, "Cannot copy out of meta"),
    "unilora": ("get_peft_model", True, False, "Cannot copy out of meta"),
    "frod": ("get_peft_model", True, False, "not on the expected device"),
    "lora_trainable_token_indices": (
        "inject_adapter_in_model",
        True,
        False,
        "Cannot copy out of meta",
    ),
    "lora_velora": ("get_peft_model", False, True, r"item\(\) cannot be called on meta"),
    "shira_random-inside": ("get_peft_model", False, True, "nonzero"),
}


@pytest.mark.parametrize("key", sorted(RAISES))
def test_builds_a_plain_meta_context_cannot_make_raise_the_same_way(peft_shim, key):
    name = key.removesuffix("-inside")
    how, include_buffers, inside, match = RAISES[key]
    case = TUNERS[name]

    def build(replayable: bool) -> None:
        torch.manual_seed(0)
        real = None if inside else case.base()
        with metamode.empty_weights(include_buffers=include_buffers, replayable=replayable):
            _adapt(how, real if real is not None else case.base(), case.config(), True)

    with pytest.raises(Exception, match=match) as plain:
        build(replayable=False)
    with pytest.raises(type(plain.value), match=match):
        build(replayable=True)
    assert metamode.active() is None


def test_the_conditions_of_peft_branches_refuse_code_they_do_not_know():
    """A PEFT version whose functions keep other local names than the conditions read is
    refused at the read, never taken as building as eager."""
    from metamode.integrations.peft import _cast_skipped, _frod_dtypes_differ

    def genexpr_frame():  # the frame a condition gets: a generator's, inside a function
        return next(sys._getframe() for _ in range(1))

    def move(adapter_name="default"):  # no adapter_layer among its locals
        return genexpr_frame()

    assert _cast_skipped(move())
    assert _frod_dtypes_differ(sys._getframe())  # no FRoD layer as self
