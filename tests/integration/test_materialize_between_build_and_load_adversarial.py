"""What real loaders do between a replayable build and ``materialize``.

A model is built on meta in ``empty_weights(replayable=True)``; then, as transformers,
accelerate, diffusers, safetensors, PEFT and hand-written loaders do, part of it is loaded,
tied, swapped, cast, wrapped, adapted or copied; then ``materialize`` gives the rest its
values. The same steps run on an eager build under the same seed: every tensor must be that
build's, bitwise (what was loaded is kept as loaded, the rest is what eager construction drew
in build order), or ``materialize`` refuses upfront, naming the tensors and why, with
``is_materializable`` agreeing. Every model is a tiny in-code config with random weights;
checkpoints are a second eager build's state dict written to ``tmp_path``.

``tests/unit/contexts/test_materialize_after_the_block.py`` and
``test_materialize_post_build_adversarial.py`` cover these changes on plain ``nn`` modules;
this file runs them through the libraries' own loaders and on their models.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import accelerate
import accelerate.utils
import diffusers.models.model_loading_utils as diffusers_loading
import peft
import pytest
import safetensors.torch
import torch
import torch.nn.utils.parametrize as P
import transformers as tf
import transformers.modeling_utils as tf_modeling
from diffusers import UNet2DModel
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_refused,
    assert_same_tensors,
    materialize_exactly,
    named,
    tensors,
    warm_pickling,
)

pytestmark = pytest.mark.filterwarnings("ignore")
warm_pickling()  # before the global-state guard's first snapshot

_WAIT_S = 120.0  # guards against a hang; never used for ordering
RE = metamode.empty_weights


def _llama(tied: bool = False) -> nn.Module:
    return tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tied,
        )
    )


def _tied() -> nn.Module:
    return _llama(tied=True)


def _unet() -> nn.Module:
    return UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=4,
    )


def _eager(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def _empty(build: Callable[[], nn.Module], include_buffers: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    with RE(include_buffers=include_buffers, replayable=True):
        return build()


def _meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in tensors(model).values())


class Checkpoint:
    """A second eager build's tensors (seed 123), written with safetensors and torch.save."""

    def __init__(self, build: Callable[[], nn.Module], folder: Path, keep: str) -> None:
        full = {k: v.clone() for k, v in _eager(build, 123).state_dict().items()}
        self.full = full
        self.part = {k: v for k, v in full.items() if keep in k}
        self.safetensors = folder / "part.safetensors"
        self.pt = folder / "part.pt"
        safetensors.torch.save_file(self.part, self.safetensors)
        torch.save(self.part, self.pt)

    def fresh(self) -> dict[str, torch.Tensor]:
        return safetensors.torch.load_file(self.safetensors)


# -- the steps: each runs on the eager model (replay=False) and on the empty one --------
# A step returns the module to materialize (None: the model itself).

Step = Callable[[nn.Module, Checkpoint, bool], "nn.Module | None"]


def _assign_part(m, ck, replay):
    m.load_state_dict(ck.fresh(), strict=False, assign=True)


def _assign_embed(m, ck, replay):
    key = "model.embed_tokens.weight"
    m.load_state_dict({key: ck.full[key].clone()}, strict=False, assign=True)


def _assign_embed_then_tie(m, ck, replay):
    _assign_embed(m, ck, replay)
    m.tie_weights()


def _set_module_tensor(m, ck, replay):
    for key in ("model.layers.1.mlp.up_proj.weight", "lm_head.weight", "model.norm.weight"):
        accelerate.utils.set_module_tensor_to_device(m, key, "cpu", value=ck.full[key].clone())


def _set_module_tensor_tied(m, ck, replay):
    key = "model.embed_tokens.weight"
    accelerate.utils.set_module_tensor_to_device(m, key, "cpu", value=ck.full[key].clone())


def _set_module_tensor_float16(m, ck, replay):
    key = "model.layers.0.self_attn.q_proj.weight"
    value = ck.full[key].clone()
    accelerate.utils.set_module_tensor_to_device(m, key, "cpu", value=value, dtype=torch.float16)


def _set_module_buffer(m, ck, replay):
    value = torch.linspace(0.5, 1.0, 4)
    accelerate.utils.set_module_tensor_to_device(m, "model.rotary_emb.inv_freq", "cpu", value=value)


def _load_checkpoint_in_model(m, ck, replay):
    accelerate.utils.load_checkpoint_in_model(m, str(ck.safetensors), device_map={"": "cpu"})


def _load_checkpoint_in_model_bfloat16(m, ck, replay):
    accelerate.utils.load_checkpoint_in_model(
        m, str(ck.pt), device_map={"": "cpu"}, dtype=torch.bfloat16
    )


def _hf_load_parameter(m, ck, replay):
    for key in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
        tf_modeling._load_parameter_into_model(m, key, ck.full[key].clone())


def _mmap_load(m, ck, replay):
    loaded = torch.load(ck.pt, mmap=True, weights_only=True)
    m.load_state_dict(loaded, strict=False, assign=True)


def _bytes_load(m, ck, replay):
    loaded = safetensors.torch.load(safetensors.torch.save(ck.part))
    m.load_state_dict(loaded, strict=False, assign=True)


def _numpy_load(m, ck, replay):
    loaded = {k: torch.from_numpy(v.numpy().copy()) for k, v in ck.part.items()}
    m.load_state_dict(loaded, strict=False, assign=True)


def _fused_views(m, ck, replay):
    # q, k and v sliced out of one fused checkpoint tensor: three parameters, one storage
    fused = torch.randn(96, 32, generator=torch.Generator().manual_seed(3))
    q, k, v = fused[:32], fused[32:48], fused[64:80]
    prefix = "model.layers.0.self_attn."
    loaded = {f"{prefix}q_proj.weight": q, f"{prefix}k_proj.weight": k, f"{prefix}v_proj.weight": v}
    m.load_state_dict(loaded, strict=False, assign=True)


def _state_dict_round_trip(m, ck, replay):
    m.load_state_dict(m.state_dict(), assign=True)


def _in_a_second_block(replay: bool, make: Callable[[], object]) -> object:
    """``make()`` in a replayable block of its own for the empty model, plainly for eager."""
    if not replay:
        return make()
    with RE(replayable=True):
        return make()


def _new_input_embeddings(m, ck, replay):
    m.set_input_embeddings(_in_a_second_block(replay, lambda: nn.Embedding(64, 32)))
    m.tie_weights()


def _new_output_embeddings(m, ck, replay):
    m.set_output_embeddings(_in_a_second_block(replay, lambda: nn.Linear(32, 64, bias=False)))
    m.tie_weights()


def _casts_that_keep_values(m, ck, replay):
    m.float()
    m.to(torch.float32)
    m.requires_grad_(False).eval()


def _training_switches(m, ck, replay):
    m.gradient_checkpointing_enable()
    m.enable_input_require_grads()
    peft.prepare_model_for_kbit_training(m, use_gradient_checkpointing=True)


def _hooks(m, ck, replay):
    m.model.layers[0].register_forward_hook(lambda *args: None)
    m.register_forward_pre_hook(lambda *args: None)
    m.lm_head.weight.register_hook(lambda grad: grad)
    m.register_load_state_dict_post_hook(lambda *args: None)
    m.register_state_dict_pre_hook(lambda *args: None)


def _compiled(m, ck, replay):
    return torch.compile(m)


def _compiled_original(m, ck, replay):
    torch.compile(m)


class _QuantLinear(nn.Module):
    """A quantization-style replacement holding the original Linear's parameter objects."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias


def _quant_swap(m, ck, replay):
    for module in list(m.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(module, name, _QuantLinear(child))


def _drop_first_layer(m, ck, replay):
    m.model.layers = nn.ModuleList([m.model.layers[1]])


def _materialize_a_layer_then_cast_it(m, ck, replay):
    if replay:
        metamode.materialize(m.model.layers[0])
    m.model.layers[0].half()


def _materialize_a_layer_then_data_assign(m, ck, replay):
    if replay:
        metamode.materialize(m.model.layers[0])
    key = "model.layers.0.mlp.up_proj.weight"
    m.get_parameter(key).data = ck.full[key].clone()


def _materialize_a_layer_then_load_into_it(m, ck, replay):
    if replay:
        metamode.materialize(m.model.layers[0])
    prefix = "model.layers.0."
    own = {k[len(prefix) :]: v for k, v in ck.full.items() if k.startswith(prefix)}
    m.model.layers[0].load_state_dict(own)


def _materialize_the_head_then_cast_it(m, ck, replay):
    if replay:
        metamode.materialize(m.lm_head)
    m.lm_head.half()


def _diffusers_load_into_meta(m, ck, replay):
    diffusers_loading.load_model_dict_into_meta(m, ck.fresh())


def _diffusers_load_into_meta_float16(m, ck, replay):
    diffusers_loading.load_model_dict_into_meta(m, ck.fresh(), dtype=torch.float16)


# name -> (build, checkpoint filter, step, include_buffers modes)
EXACT: dict[str, tuple[Callable[[], nn.Module], str, Step, list[bool]]] = {
    "load_state_dict(part, strict=False, assign=True)": (_llama, "layers.1", _assign_part, MODES),
    "assign the tied embedding only": (_tied, "-", _assign_embed, MODES),
    "assign the tied embedding, then tie_weights()": (_tied, "-", _assign_embed_then_tie, MODES),
    "accelerate set_module_tensor_to_device": (_llama, "-", _set_module_tensor, MODES),
    "accelerate set_module_tensor_to_device, tied": (_tied, "-", _set_module_tensor_tied, MODES),
    "accelerate set_module_tensor_to_device(dtype=float16)": (
        _llama,
        "-",
        _set_module_tensor_float16,
        MODES,
    ),
    "accelerate set_module_tensor_to_device of a meta buffer": (
        _llama,
        "-",
        _set_module_buffer,
        [True],
    ),
    "accelerate load_checkpoint_in_model(device_map)": (
        _llama,
        "layers.1",
        _load_checkpoint_in_model,
        MODES,
    ),
    "accelerate load_checkpoint_in_model(dtype=bfloat16)": (
        _llama,
        "layers.0",
        _load_checkpoint_in_model_bfloat16,
        MODES,
    ),
    "transformers _load_parameter_into_model": (_tied, "-", _hf_load_parameter, MODES),
    "torch.load(mmap=True), assign": (_llama, "layers.1", _mmap_load, [False]),
    "safetensors.torch.load(bytes), assign": (_llama, "layers.1", _bytes_load, [False]),
    "torch.from_numpy checkpoint, assign": (_llama, "layers.1", _numpy_load, [False]),
    "assign views of one fused checkpoint tensor": (_llama, "-", _fused_views, [False]),
    "state_dict() round trip with assign=True": (_tied, "-", _state_dict_round_trip, MODES),
    "tie_weights() on an untied model": (_llama, "-", lambda m, ck, r: m.tie_weights(), MODES),
    "tie_weights() on a tied model": (_tied, "-", lambda m, ck, r: m.tie_weights(), MODES),
    "set_input_embeddings built in a second block, tied": (
        _tied,
        "-",
        _new_input_embeddings,
        MODES,
    ),
    "set_output_embeddings built in a second block, tied": (
        _tied,
        "-",
        _new_output_embeddings,
        [False],
    ),
    "set_output_embeddings built in a second block, untied": (
        _llama,
        "-",
        _new_output_embeddings,
        [False],
    ),
    "float() / to(float32) / requires_grad_(False) / eval()": (
        _llama,
        "-",
        _casts_that_keep_values,
        MODES,
    ),
    "gradient checkpointing, input grads, prepare_model_for_kbit_training": (
        _llama,
        "-",
        _training_switches,
        [False],
    ),
    "forward, pre-forward, gradient and state-dict hooks": (_llama, "-", _hooks, [False]),
    "torch.compile wrapper, materialize the wrapper": (_tied, "-", _compiled, MODES),
    "torch.compile wrapper, materialize the original": (_llama, "-", _compiled_original, [True]),
    "quantization-style module swap keeping the parameters": (_llama, "-", _quant_swap, [False]),
    "a layer dropped before materialize": (_llama, "-", _drop_first_layer, MODES),
    "materialize a layer, half() it, then the rest": (
        _llama,
        "-",
        _materialize_a_layer_then_cast_it,
        MODES,
    ),
    "materialize a layer, param.data = checkpoint, then the rest": (
        _llama,
        "-",
        _materialize_a_layer_then_data_assign,
        [False],
    ),
    "materialize a layer, load_state_dict into it, then the rest": (
        _llama,
        "-",
        _materialize_a_layer_then_load_into_it,
        [False],
    ),
    "materialize the tied head, half() it, then the rest": (
        _tied,
        "-",
        _materialize_the_head_then_cast_it,
        [True],
    ),
    "diffusers load_model_dict_into_meta": (_unet, "down_blocks", _diffusers_load_into_meta, MODES),
    "diffusers load_model_dict_into_meta(dtype=float16)": (
        _unet,
        "down_blocks",
        _diffusers_load_into_meta_float16,
        [False],
    ),
}


# -- refused upfront, for the right reason -----------------------------------------------

_WRITTEN = "written after"
_REPLACED = "replaced after the block"
_UNREGISTERED = "not registered inside"
_OTHER_BUILD = "another replayable"


def _resize(m, ck, replay):
    m.resize_token_embeddings(80, mean_resizing=False)


def _resize_in_a_second_block(m, ck, replay):
    _in_a_second_block(replay, lambda: m.resize_token_embeddings(80, mean_resizing=False))


def _safetensors_load_model(m, ck, replay):
    safetensors.torch.load_model(m, ck.safetensors, strict=False)


def _hf_flags(m, ck, replay, missing_flagged: bool):
    """transformers' way after a partial load: loaded tensors flagged, then
    ``initialize_weights`` for what the checkpoint lacked (modules already initialised by the
    constructor stay flagged unless ``missing_flagged`` is False)."""
    _assign_part(m, ck, replay)
    if not missing_flagged:
        for module in m.modules():
            module._is_hf_initialized = False
    for key in ck.part:
        m.get_parameter(key)._is_hf_initialized = True
    m.initialize_weights()


def _hf_initialize_weights_again(m, ck, replay):
    _hf_flags(m, ck, replay, missing_flagged=True)


def _hf_initialize_the_missing(m, ck, replay):
    _hf_flags(m, ck, replay, missing_flagged=False)


EXACT["transformers initialize_weights after a partial load (nothing unflagged)"] = (
    _llama,
    "layers.1",
    _hf_initialize_weights_again,
    [False],
)


def _accelerate_utilities(m, ck, replay):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    tied = accelerate.utils.find_tied_parameters(m)
    accelerate.utils.compute_module_sizes(m)
    accelerate.utils.infer_auto_device_map(m, max_memory={"cpu": "1GB"})
    accelerate.utils.retie_parameters(m, tied)
    add_hook_to_module(m, AlignDevicesHook(io_same_device=True))


def _dispatch(m, ck, replay):
    _assign_embed(m, ck, replay)
    if not replay:
        accelerate.dispatch_model(m, device_map={"": "cpu"})
        return
    with pytest.raises(NotImplementedError, match="meta"):  # Module.to of meta tensors
        accelerate.dispatch_model(m, device_map={"": "cpu"})


EXACT["accelerate tie, size and device-map utilities, AlignDevicesHook"] = (
    _tied,
    "-",
    _accelerate_utilities,
    MODES,
)
EXACT["accelerate dispatch_model failing on meta, then materialize"] = (
    _llama,
    "-",
    _dispatch,
    MODES,
)
EXACT["nn.Module.compile() in place"] = (_llama, "-", lambda m, ck, r: m.compile(), [False])


def _exact_cases() -> list:
    return [
        pytest.param(name, mode, id=f"{name}-{mode}")
        for name, (_, _, _, modes) in EXACT.items()
        for mode in modes
    ]


@pytest.mark.parametrize(("idiom", "include_buffers"), _exact_cases())
def test_loader_steps_between_build_and_materialize_are_exact(
    idiom, include_buffers, tmp_path: Path
):
    build, keep, step, _ = EXACT[idiom]
    ck = Checkpoint(build, tmp_path, keep)
    ref = _eager(build)
    ref_target = step(ref, ck, False)
    ref_target = ref if ref_target is None else ref_target
    model = _empty(build, include_buffers)
    target = step(model, ck, True)
    target = model if target is None else target
    assert _meta(target), "nothing was left on meta"
    materialize_exactly(target, ref_target)


# name -> (build, keep, step, include_buffers, names, because)
REFUSED: dict[str, tuple[Callable[[], nn.Module], str, Step, bool, tuple[str, ...], str]] = {
    "safetensors load_model (copies into meta)": (
        _llama,
        "layers.1",
        _safetensors_load_model,
        False,
        ("model.layers.1.mlp.up_proj.weight",),
        _WRITTEN,
    ),
    "load_state_dict(own state_dict) without assign": (
        _llama,
        "-",
        lambda m, ck, r: m.load_state_dict(m.state_dict()),
        False,
        ("model.embed_tokens.weight", "lm_head.weight"),
        _WRITTEN,
    ),
    "model.half()": (
        _llama,
        "-",
        lambda m, ck, r: m.half(),
        False,
        ("lm_head.weight",),
        "memory was replaced",
    ),
    "model.to(bfloat16)": (
        _llama,
        "-",
        lambda m, ck, r: m.to(torch.bfloat16),
        True,
        ("model.norm.weight",),
        "memory was replaced",
    ),
    "resize_token_embeddings after the block": (
        _llama,
        "-",
        _resize,
        False,
        ("model.embed_tokens.weight", "lm_head.weight"),
        _REPLACED,
    ),
    "resize_token_embeddings in a second block": (
        _tied,
        "-",
        _resize_in_a_second_block,
        False,
        ("model.embed_tokens.weight", "lm_head.weight"),
        _OTHER_BUILD,
    ),
    "transformers initialize_weights of the missing keys": (
        _llama,
        "layers.1",
        _hf_initialize_the_missing,
        False,
        ("lm_head.weight", "model.layers.0.mlp.up_proj.weight"),
        _WRITTEN,
    ),
    "transformers _init_weights(lm_head)": (
        _llama,
        "-",
        lambda m, ck, r: m._init_weights(m.lm_head),
        False,
        ("lm_head.weight",),
        _WRITTEN,
    ),
    "model.to('meta') with real buffers": (
        _llama,
        "-",
        lambda m, ck, r: m.to("meta"),
        False,
        ("model.rotary_emb.inv_freq",),
        _REPLACED,
    ),
}


@pytest.mark.parametrize("idiom", sorted(REFUSED))
def test_loader_steps_replay_cannot_follow_are_refused_upfront(idiom, tmp_path: Path):
    build, keep, step, include_buffers, names, because = REFUSED[idiom]
    ck = Checkpoint(build, tmp_path, keep)
    model = _empty(build, include_buffers)
    step(model, ck, True)
    assert_refused(model, *names, because=because)


def test_set_input_embeddings_built_after_the_block_is_kept_and_the_rest_is_exact():
    # the new embedding is real, drawn from the generator state the build left (the guide:
    # reseed after the block for eager's numbers): kept as loaded; the rest is eager's
    ref = _eager(_llama)
    model = _empty(_llama)
    embedding = nn.Embedding(64, 32)
    model.set_input_embeddings(embedding)
    ref.set_input_embeddings(copy.deepcopy(embedding))
    materialize_exactly(model, ref)
    assert model.model.embed_tokens is embedding


def test_to_empty_then_materialize_keeps_what_to_empty_allocated():
    model = _empty(_llama)
    model.to_empty(device="cpu")
    pointers = {name: t.data_ptr() for name, t in tensors(model).items()}
    assert metamode.is_materializable(model)
    materialize_exactly(model)
    assert {name: t.data_ptr() for name, t in tensors(model).items()} == pointers


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_deepcopy_of_the_meta_model_is_refused_and_the_original_stays_exact(include_buffers):
    ref = _eager(_tied)
    model = _empty(_tied, include_buffers)
    copied = copy.deepcopy(model)
    assert_refused(copied, "lm_head.weight", "model.norm.weight", because=_UNREGISTERED)
    materialize_exactly(model, ref)
    assert_refused(copied, "lm_head.weight", because=_UNREGISTERED)


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialize_twice_and_submodules_in_either_order(include_buffers):
    ref = _eager(_tied)
    model = _empty(_tied, include_buffers)
    for sub in (model.lm_head, model.model.layers[1], model.model.embed_tokens):
        materialize_exactly(sub)
    materialize_exactly(model.model.layers[0])
    materialize_exactly(model, ref)
    materialize_exactly(model, ref)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_parametrize_cached_around_materialize():
    def build() -> nn.Module:
        model = _llama()
        P.register_parametrization(model.model.layers[0].mlp.up_proj, "weight", nn.Identity())
        return model

    ref = _eager(build)
    model = _empty(build)
    with P.cached():
        materialize_exactly(model, ref)


# -- two builds: tensors of one loaded into the other ------------------------------------


def _layer0(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if "layers.0" in k}


@pytest.mark.parametrize("a_first", [True, False], ids=["A materialized first", "B first"])
def test_assign_loading_another_builds_tensors(a_first):
    ref_a, ref_b = _eager(_llama, 0), _eager(_llama, 1)
    ref_b.load_state_dict(_layer0(ref_a.state_dict()), strict=False, assign=True)
    a = _empty(_llama, seed=0)
    if a_first:
        materialize_exactly(a, ref_a)
    b = _empty(_llama, seed=1)
    b.load_state_dict(_layer0(a.state_dict()), strict=False, assign=True)
    materialize_exactly(b, ref_b)
    if not a_first:
        materialize_exactly(a, ref_a)
    weight = "model.layers.0.mlp.up_proj.weight"
    assert b.get_parameter(weight).data_ptr() == a.get_parameter(weight).data_ptr()


def test_a_module_of_one_meta_build_put_into_another():
    ref_a, ref_b = _eager(_llama, 0), _eager(_llama, 1)
    ref_b.lm_head = ref_a.lm_head
    a, b = _empty(_llama, seed=0), _empty(_llama, seed=1)
    b.lm_head = a.lm_head
    materialize_exactly(b, ref_b)
    materialize_exactly(a, ref_a)
    assert b.lm_head.weight is a.lm_head.weight


class _WeightNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))
        self.out = nn.Linear(8, 2)


def test_a_loaded_direction_leaves_the_build_computed_magnitude_eager():
    # weight_norm's g is the norm of the *initial* weight: loading v after the block must
    # not make replay compute g from the loaded v
    loaded = {"fc.parametrizations.weight.original1": torch.full((8, 8), 0.5)}
    ref = _eager(_WeightNormed)
    ref.load_state_dict(loaded, strict=False, assign=True)
    model = _empty(_WeightNormed)
    model.load_state_dict(loaded, strict=False, assign=True)
    materialize_exactly(model, ref)


def test_a_materialized_direction_written_leaves_the_magnitude_eager():
    ref = _eager(_WeightNormed)
    model = _empty(_WeightNormed)
    materialize_exactly(model.fc.parametrizations.weight)
    for m in (ref, model):
        with torch.no_grad():
            m.fc.parametrizations.weight.original1.fill_(0.5)
    materialize_exactly(model, ref)


# -- PEFT on a replayable meta base ------------------------------------------------------


@pytest.fixture
def peft_shim():
    metamode.enable_for_peft()
    try:
        yield
    finally:
        metamode.disable_for_peft()


def _lora(**extra) -> peft.LoraConfig:
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **extra)


ADAPTERS = {
    "get_peft_model(low_cpu_mem_usage=True)": lambda b, c: peft.get_peft_model(
        b, c, low_cpu_mem_usage=True
    ),
    "get_peft_model(low_cpu_mem_usage=False)": lambda b, c: peft.get_peft_model(
        b, c, low_cpu_mem_usage=False
    ),
    "inject_adapter_in_model(low_cpu_mem_usage=True)": lambda b, c: peft.inject_adapter_in_model(
        c, b, low_cpu_mem_usage=True
    ),
    "inject_adapter_in_model(low_cpu_mem_usage=False)": lambda b, c: peft.inject_adapter_in_model(
        c, b, low_cpu_mem_usage=False
    ),
    "transformers add_adapter": lambda b, c: b.add_adapter(c) or b,
}


def _adapted(how: str, config: peft.LoraConfig, tied: bool = False, in_a_block: bool = True):
    """Eager: seed 0, base, adapter. Empty: seed 0, base in a replayable block, the adapter
    in a second one (or after the block, ``in_a_block=False``)."""
    torch.manual_seed(0)
    eager_how = how.replace("=True", "=False")  # True leaves an eager adapter on meta
    ref = ADAPTERS[eager_how](_llama(tied), copy.deepcopy(config))
    torch.manual_seed(0)
    with RE(replayable=True):
        base = _llama(tied)
    if in_a_block:
        with RE(replayable=True):
            model = ADAPTERS[how](base, config)
    else:
        model = ADAPTERS[how](base, config)
    return model, ref


@pytest.mark.parametrize("how", sorted(ADAPTERS))
def test_an_adapter_in_a_second_block_on_a_meta_base_is_exact(peft_shim, how):
    model, ref = _adapted(how, _lora())
    materialize_exactly(model, ref)


@pytest.mark.parametrize("init", [False, "gaussian", "orthogonal"])
def test_lora_inits_in_a_second_block_on_a_meta_base_are_exact(peft_shim, init):
    model, ref = _adapted("get_peft_model(low_cpu_mem_usage=True)", _lora(init_lora_weights=init))
    materialize_exactly(model, ref)


def test_the_base_layers_first_then_the_adapters(peft_shim):
    model, ref = _adapted("get_peft_model(low_cpu_mem_usage=True)", _lora(), tied=True)
    bases = [m.base_layer for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert bases
    for base_layer in bases:
        materialize_exactly(base_layer)
    assert any(p.is_meta for n, p in model.named_parameters() if "lora_" in n)
    materialize_exactly(model, ref)


@pytest.mark.parametrize(
    "how",
    ["get_peft_model(low_cpu_mem_usage=False)", "inject_adapter_in_model(low_cpu_mem_usage=False)"],
)
def test_an_adapter_added_after_the_block_on_a_meta_base_is_refused(peft_shim, how):
    model, _ = _adapted(how, _lora(), in_a_block=False)
    names = [n for n, p in model.named_parameters() if "lora_A" in n]
    message = assert_refused(model, *names, because=_UNREGISTERED)
    assert not named(message, names[0].replace("lora_A.default", "base_layer"))


@pytest.mark.parametrize(
    ("extra", "because"),
    [
        ({"init_lora_weights": "pissa"}, _OTHER_BUILD),
        ({"init_lora_weights": "olora"}, "later replayable build wrote it"),
        ({"use_dora": True}, _OTHER_BUILD),
        ({"modules_to_save": ["lm_head"]}, _OTHER_BUILD),
    ],
    ids=["pissa", "olora", "dora", "modules_to_save"],
)
def test_adapters_computed_from_a_meta_base_of_another_build_are_refused(peft_shim, extra, because):
    model, _ = _adapted("get_peft_model(low_cpu_mem_usage=True)", _lora(**extra))
    assert_refused(model, because=because)


def _on_a_loaded_base(extra: dict, after: Callable[[nn.Module], None] | None = None):
    """Eager: seed 0, base, checkpoint assigned, adapter. Empty: seed 0, base in a block,
    checkpoint assigned, adapter in a second block; then ``after`` on both."""
    loaded = _eager(_llama, 123).state_dict()
    torch.manual_seed(0)
    ref = _llama()
    ref.load_state_dict({k: v.clone() for k, v in loaded.items()}, assign=True)
    ref = peft.get_peft_model(ref, _lora(**extra), low_cpu_mem_usage=False)
    torch.manual_seed(0)
    with RE(replayable=True):
        base = _llama()
    base.load_state_dict({k: v.clone() for k, v in loaded.items()}, assign=True)
    with RE(replayable=True):
        model = peft.get_peft_model(base, _lora(**extra), low_cpu_mem_usage=True)
    for m in (ref, model):
        if after is not None:
            after(m)
    return model, ref


def _double_the_original_head(m: nn.Module) -> None:
    with torch.no_grad():
        m.base_model.model.lm_head.original_module.weight.mul_(2)


def _double_a_base_weight(m: nn.Module) -> None:
    with torch.no_grad():
        m.get_submodule(_Q).base_layer.weight.mul_(2)


_Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("extra", "after"),
    [
        ({"use_dora": True}, None),
        ({"modules_to_save": ["lm_head"]}, None),
        ({"modules_to_save": ["lm_head"]}, _double_the_original_head),
    ],
    ids=["dora", "modules_to_save", "modules_to_save, then the original head written"],
)
def test_an_adapter_computed_from_a_loaded_base_is_exact(peft_shim, extra, after):
    model, ref = _on_a_loaded_base(extra, after)
    materialize_exactly(model, ref)


def test_a_loaded_base_written_after_the_dora_block_refuses_its_magnitude(peft_shim):
    model, _ = _on_a_loaded_base({"use_dora": True}, _double_a_base_weight)
    message = assert_refused(model, f"{_Q}.lora_magnitude_vector.default.weight")
    assert not named(message, f"{_Q}.lora_A.default.weight")


def test_peft_from_pretrained_on_a_meta_base_is_refused(peft_shim, tmp_path: Path):
    torch.manual_seed(7)
    peft.get_peft_model(_llama(), _lora(init_lora_weights=False)).save_pretrained(tmp_path)
    torch.manual_seed(0)
    with RE(replayable=True):
        base = _llama()
    model = peft.PeftModel.from_pretrained(base, tmp_path, low_cpu_mem_usage=True)
    names = [n for n, p in model.named_parameters() if "lora_" in n]
    assert_refused(model, *names)


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_an_adapter_state_dict_loaded_into_meta_adapters_is_refused(peft_shim, low_cpu_mem_usage):
    torch.manual_seed(11)
    loaded = peft.get_peft_model_state_dict(
        peft.get_peft_model(_llama(), _lora(init_lora_weights=False))
    )
    model, _ = _adapted("get_peft_model(low_cpu_mem_usage=True)", _lora())
    peft.set_peft_model_state_dict(model, loaded, low_cpu_mem_usage=low_cpu_mem_usage)
    names = [n for n, p in model.named_parameters() if "lora_" in n]
    assert_refused(model, *names, because=_REPLACED if low_cpu_mem_usage else _WRITTEN)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known limit (guide, 'Cost and limits': writes through .data after the block): "
    "merge_adapter on meta adapters adds lora_B @ lora_A through weight.data +=, which moves "
    "no version counter; is_materializable accepts and the base weights come back unmerged",
)
def test_merge_adapter_on_meta_adapters_is_exact_or_refused(peft_shim):
    model, ref = _adapted("get_peft_model(low_cpu_mem_usage=True)", _lora(init_lora_weights=False))
    ref.merge_adapter()
    model.merge_adapter()
    if metamode.is_materializable(model):
        materialize_exactly(model, ref)
    else:
        assert_refused(model)


# -- threads -------------------------------------------------------------------------------


def test_materialize_from_another_thread():
    ref = _eager(_tied)
    model = _empty(_tied, include_buffers=True)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            materialize_exactly(model, ref)
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(_WAIT_S)
    assert not thread.is_alive() and not errors, errors


def test_the_tied_halves_materialized_at_once_from_two_threads():
    ref = _eager(_tied)
    model = _empty(_tied, include_buffers=True)
    barrier = threading.Barrier(2, timeout=_WAIT_S)
    errors: list[BaseException] = []

    def run(sub: nn.Module) -> None:
        try:
            barrier.wait()
            metamode.materialize(sub)
        except BaseException as error:
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=(s,)) for s in (model.model.embed_tokens, model.lm_head)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_WAIT_S)
    assert not errors, errors
    materialize_exactly(model, ref)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_thread_pool_materializing_the_submodules():
    ref = _eager(_tied)
    model = _empty(_tied, include_buffers=True)
    subs = [*model.model.layers, model.lm_head, model.model.rotary_emb, model.model.norm]
    with ThreadPoolExecutor(len(subs)) as pool:
        list(pool.map(metamode.materialize, subs))
    materialize_exactly(model, ref)


def test_materialize_while_another_threads_replayable_block_is_open():
    ref = _eager(_tied)
    other_ref = _eager(lambda: nn.Sequential(_llama(), nn.Linear(4, 4)), seed=5)
    model = _empty(_tied, include_buffers=True)
    built, go = threading.Event(), threading.Event()
    made: dict[str, nn.Module] = {}

    def build() -> None:
        torch.manual_seed(5)
        with RE(replayable=True):
            first = _llama()
            built.set()
            go.wait(_WAIT_S)
            made["other"] = nn.Sequential(first, nn.Linear(4, 4))

    thread = threading.Thread(target=build)
    thread.start()
    try:
        assert built.wait(_WAIT_S)
        materialize_exactly(model, ref)  # the other build is paused: the generator is still
    finally:
        go.set()
        thread.join(_WAIT_S)
    materialize_exactly(made["other"], other_ref)


def test_materialize_while_another_thread_keeps_building():
    ref = _eager(_tied)
    other_ref = _eager(_llama, seed=5)
    model = _empty(_tied, include_buffers=True)
    stop, started = threading.Event(), threading.Event()
    made: list[nn.Module] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            while not stop.is_set():
                torch.manual_seed(5)
                with RE(replayable=True):
                    made.append(_llama())
                started.set()
        except BaseException as error:
            errors.append(error)
            started.set()

    thread = threading.Thread(target=build)
    thread.start()
    try:
        assert started.wait(_WAIT_S)
        # the other thread moves the default generator: checked by value, not by state
        assert metamode.is_materializable(model)
        metamode.materialize(model)
    finally:
        stop.set()
        thread.join(_WAIT_S)
    assert not errors, errors
    assert_same_tensors(model, ref)
    materialize_exactly(made[-1], other_ref)


# -- real tensors put where a registered one was --------------------------------------------


def test_a_meta_tensor_given_other_meta_memory_is_refused_as_replaced():
    model = _empty(_llama, include_buffers=True)
    weight = model.model.layers[0].mlp.up_proj.weight
    weight.data = weight.data.half()
    assert_refused(model, "model.layers.0.mlp.up_proj.weight", because="memory was replaced")


_ATTEMPTS = 40  # the cast's new tensor often takes the dead meta tensor's address


def test_a_materialized_rotary_cast_then_the_rest():
    """The cast's new real buffer may sit at the dead meta buffer's address: kept."""
    ref = _eager(_llama)
    ref.model.rotary_emb.to(torch.float64)
    for _ in range(_ATTEMPTS):
        model = _empty(_llama, include_buffers=True)
        metamode.materialize(model.model.rotary_emb)
        model.model.rotary_emb.to(torch.float64)
        materialize_exactly(model, ref)


def test_a_real_buffer_given_loaded_memory_by_data_assignment_is_kept():
    """The buffer keeps its implementation, the one the block registered: a load, kept."""
    ref = _eager(_llama)
    model = _empty(_llama)
    for m in (ref, model):
        m.model.rotary_emb.inv_freq.data = torch.linspace(0.5, 1.0, 4)
    materialize_exactly(model, ref)


def test_the_same_buffer_loaded_by_copy_or_reassignment_is_kept():
    for how in ("copy", "assign"):
        ref = _eager(_llama)
        model = _empty(_llama)
        for m in (ref, model):
            if how == "copy":
                m.model.rotary_emb.inv_freq.copy_(torch.linspace(0.5, 1.0, 4))
            else:
                m.model.rotary_emb.inv_freq = torch.linspace(0.5, 1.0, 4)
        materialize_exactly(model, ref)
