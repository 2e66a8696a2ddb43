"""materialize against more construction and init idioms of timm, torchtitan, transformers,
diffusers and PEFT: short inline copies in the shape those libraries write them (the upstream
file named in each docstring), or the installed library's own classes and functions.

Each idiom is a constructor body ``init(m)`` run in ``Built``; each is built eagerly and in
``empty_weights(replayable=True)`` (params-only and ``include_buffers=True``) under one seed,
then must either materialize to eager's tensors bit for bit (values, dtype, strides, ties,
storage sharing, the default generator) or be refused upfront, naming the tensor and the
reason, with ``is_materializable`` agreeing and nothing changed. ``OUTCOMES`` lists the idioms
that are not exact: an accurate refusal is asserted as such; an idiom that breaks the promise
(a crash in the build that plain ``torch.device("meta")`` would not have, a late refusal, a
silently wrong value, a refusal for a wrong reason) is a strict xfail whose reason says what
happens, and whose body asserts what the promise allows."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    REFUSED,
    Outcome,
    broken,
    build_eagerly,
    build_empty,
    check_idiom,
    idiom_cases,
    materialize_exactly,
    warm_pickling,
)

pytestmark = pytest.mark.filterwarnings("ignore")
warm_pickling()  # before the global-state guard's snapshot (a build imports another test file)


# == timm ===================================================================================


def _timm_beit_rel_pos_index_class_token(m: nn.Module) -> None:
    """timm/layers/pos_embed_rel.py ``gen_relative_position_index(class_token=True)``: an
    int64 index table, ``F.pad`` for the class token, then row / column / corner writes."""
    q_size = (2, 3)
    coords = torch.stack(
        torch.meshgrid(torch.arange(q_size[0]), torch.arange(q_size[1]), indexing="ij")
    ).flatten(1)
    relative_coords = coords[:, :, None] - coords[:, None, :]
    relative_coords = relative_coords.permute(1, 2, 0)
    relative_coords[:, :, 0] += q_size[0] - 1
    relative_coords[:, :, 1] += q_size[1] - 1
    relative_coords[:, :, 0] *= 2 * q_size[1] - 1
    num_relative_distance = (2 * q_size[0] - 1) * (2 * q_size[1] - 1)
    index = relative_coords.sum(-1)
    index = F.pad(index, [1, 0, 1, 0])
    index[0, 0:] = num_relative_distance
    index[0:, 0] = num_relative_distance + 1
    index[0, 0] = num_relative_distance + 2
    m.register_buffer("relative_position_index", index.contiguous(), persistent=False)
    m.relative_position_bias_table = nn.Parameter(torch.zeros(num_relative_distance + 3, 2))
    nn.init.trunc_normal_(m.relative_position_bias_table, std=0.02)


def _timm_fourier_embed_empty_then_copy(m: nn.Module) -> None:
    """timm/layers/pos_embed_sincos.py ``FourierEmbed``: ``register_buffer(torch.empty(n))``,
    then ``reset_parameters`` -> ``self.bands.copy_(pixel_freq_bands(...))``."""
    num_bands, max_res = 6, 224.0
    m.register_buffer("bands", torch.empty(num_bands), persistent=False)
    bands = torch.linspace(1.0, max_res / 2, num_bands, dtype=torch.float32) * torch.pi
    m.bands.copy_(bands)


def _timm_rope_mixed_random_freqs(m: nn.Module) -> None:
    """timm/layers/pos_embed_sincos.py ``init_random_2d_freqs``: ``torch.rand`` angles times
    ``2 * torch.pi``, cos / sin of them, stacked into a learnable Parameter."""
    head_dim, depth, num_heads, temperature = 8, 2, 2, 10.0
    mag = 1.0 / (temperature ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim))
    mag = mag.unsqueeze(0).unsqueeze(0)
    angles = torch.rand(depth, num_heads, 1) * 2 * torch.pi
    fx = torch.cat([mag * torch.cos(angles), mag * torch.cos(angles + torch.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(angles), mag * torch.sin(angles + torch.pi / 2)], dim=-1)
    m.freqs = nn.Parameter(torch.stack([fx, fy], dim=0))


def _timm_mrope_axis_strided_setitem(m: nn.Module) -> None:
    """timm/layers/pos_embed_sincos.py ``RotaryEmbeddingMRope``: an int64 ``axis`` buffer
    written through strided slices, next to an ``inv_freq`` buffer."""
    dim, sec_h, sec_w = 16, 2, 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    m.register_buffer("inv_freq", inv_freq, persistent=False)
    axis = torch.zeros(dim // 2, dtype=torch.long)
    axis[1 : sec_h * 3 : 3] = 1
    axis[2 : sec_w * 3 : 3] = 2
    m.register_buffer("axis", axis, persistent=False)


def _timm_scaled_std_conv_gain(m: nn.Module) -> None:
    """timm/layers/std_conv.py ``ScaledStdConv2d``: a ``gain`` Parameter from ``torch.full``
    and a Python-float scale from the weight's fan-in."""
    m.conv = nn.Conv2d(3, 4, 3)
    m.gain = nn.Parameter(torch.full((m.conv.out_channels, 1, 1, 1), 1.0))
    m.scale = 1.0 * m.conv.weight[0].numel() ** -0.5
    with torch.no_grad():
        m.gain.mul_(m.scale)


def _timm_bottleneck_rel_pos(m: nn.Module) -> None:
    """timm/layers/bottleneck_attn.py ``PosEmbedRel``: ``torch.randn(...) * scale`` Parameters,
    then ``trunc_normal_(std=self.scale)`` on them and on ``qkv.weight`` in reset_parameters."""
    feat, dim_head = 3, 4
    m.scale = dim_head**-0.5
    m.height_rel = nn.Parameter(torch.randn(feat * 2 - 1, dim_head) * m.scale)
    m.width_rel = nn.Parameter(torch.randn(feat * 2 - 1, dim_head) * m.scale)
    m.qkv = nn.Conv2d(8, 24, 1, bias=False)
    nn.init.trunc_normal_(m.qkv.weight, std=m.qkv.weight.shape[1] ** -0.5)
    nn.init.trunc_normal_(m.height_rel, std=m.scale)
    nn.init.trunc_normal_(m.width_rel, std=m.scale)


def _timm_vit_moco_init(m: nn.Module) -> None:
    """timm/models/vision_transformer.py ``init_weights_vit_moco``: qkv by a uniform bound from
    ``shape[0] // 3``, xavier elsewhere, chosen by module name."""
    m.qkv = nn.Linear(4, 12)
    m.proj = nn.Linear(4, 4)
    for name, module in m.named_modules():
        if isinstance(module, nn.Linear):
            if "qkv" in name:
                val = math.sqrt(6.0 / float(module.weight.shape[0] // 3 + module.weight.shape[1]))
                nn.init.uniform_(module.weight, -val, val)
            else:
                nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def _timm_beit_fix_init_weight(m: nn.Module) -> None:
    """timm/models/beit.py ``fix_init_weight``: ``param.div_(math.sqrt(2.0 * layer_id))`` on
    ``.weight.data`` of each block's residual projections."""
    m.blocks = nn.ModuleList(
        nn.ModuleDict({"proj": nn.Linear(4, 4), "fc2": nn.Linear(8, 4)}) for _ in range(3)
    )

    def rescale(param: torch.Tensor, layer_id: int) -> None:
        param.div_(math.sqrt(2.0 * layer_id))

    for layer_id, layer in enumerate(m.blocks):
        rescale(layer["proj"].weight.data, layer_id + 1)
        rescale(layer["fc2"].weight.data, layer_id + 1)


def _timm_maxvit_lookup_tensor(m: nn.Module) -> None:
    """timm/layers/pos_embed_rel.py ``generate_lookup_tensor``: a one-hot float table written
    element by element in Python loops (``RelPosBiasTf``)."""
    length = 3
    max_relative_position = length - 1
    vocab_size = 2 * max_relative_position + 1
    ret = torch.zeros(length, length, vocab_size)
    for i in range(length):
        for x in range(length):
            v = x - i + max_relative_position
            if abs(x - i) > max_relative_position:
                continue
            ret[i, x, v] = 1
    m.register_buffer("height_lookup", ret, persistent=False)
    m.relative_position_bias_table = nn.Parameter(torch.zeros(2, vocab_size, vocab_size))
    nn.init.normal_(m.relative_position_bias_table, std=0.02)


def _timm_attention_pool2d(m: nn.Module) -> None:
    """timm/layers/attention_pool2d.py ``AttentionPool2d.init_weights``: zero pos_embed,
    ``trunc_normal_(std=in_features ** -0.5)`` on it and on qkv, zero qkv bias."""
    in_features, seq_len = 8, 4
    m.pos_embed = nn.Parameter(torch.zeros(seq_len + 1, in_features))
    m.qkv = nn.Linear(in_features, in_features * 3)
    nn.init.trunc_normal_(m.pos_embed, std=in_features**-0.5)
    nn.init.trunc_normal_(m.qkv.weight, std=in_features**-0.5)
    nn.init.zeros_(m.qkv.bias)


def _timm_swin_v2_log_coords(m: nn.Module) -> None:
    """timm/models/swin_transformer_v2.py ``WindowAttention``: a log-spaced continuous
    relative-coords table (in-place ``/=`` and ``*=`` on a view), ``logit_scale`` from
    ``torch.log(10 * torch.ones(...))``, ``q_bias`` Parameter and a zero ``k_bias`` buffer."""
    wh, ww, heads, dim = 2, 3, 2, 4
    relative_coords_h = torch.arange(-(wh - 1), wh, dtype=torch.float32)
    relative_coords_w = torch.arange(-(ww - 1), ww, dtype=torch.float32)
    table = torch.stack(torch.meshgrid(relative_coords_h, relative_coords_w, indexing="ij"))
    table = table.permute(1, 2, 0).contiguous().unsqueeze(0)
    table[:, :, :, 0] /= wh - 1
    table[:, :, :, 1] /= ww - 1
    table *= 8
    table = torch.sign(table) * torch.log2(torch.abs(table) + 1.0) / math.log2(8)
    m.register_buffer("relative_coords_table", table, persistent=False)
    m.logit_scale = nn.Parameter(torch.log(10 * torch.ones((heads, 1, 1))))
    m.q_bias = nn.Parameter(torch.zeros(dim))
    m.register_buffer("k_bias", torch.zeros(dim), persistent=False)
    m.v_bias = nn.Parameter(torch.zeros(dim))


def _timm_drop_path_split_tolist(m: nn.Module) -> None:
    """timm/models/convnext.py, swin: ``[x.tolist() for x in torch.linspace(0, rate,
    sum(depths)).split(depths)]``: per-stage drop-path rates."""
    depths = (1, 2)
    dpr = [x.tolist() for x in torch.linspace(0, 0.1, sum(depths)).split(depths)]
    m.stages = nn.ModuleList(nn.ModuleList(nn.Linear(2, 2) for _ in rates) for rates in dpr)
    m.register_buffer("rate", torch.tensor(dpr[-1][-1]))


def _timm_channels_last(m: nn.Module) -> None:
    """timm/train.py: ``model.to(memory_format=torch.channels_last)`` (done in the constructor
    by code that builds a conv stem)."""
    m.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))
    m.stem.to(memory_format=torch.channels_last)


TIMM = {
    "timm beit rel-pos index class_token F.pad": _timm_beit_rel_pos_index_class_token,
    "timm FourierEmbed empty buffer then copy_": _timm_fourier_embed_empty_then_copy,
    "timm rope-mixed init_random_2d_freqs": _timm_rope_mixed_random_freqs,
    "timm MRope int64 axis strided setitem": _timm_mrope_axis_strided_setitem,
    "timm ScaledStdConv gain full + mul_": _timm_scaled_std_conv_gain,
    "timm bottleneck PosEmbedRel randn*scale + trunc_normal_": _timm_bottleneck_rel_pos,
    "timm vit moco init by name": _timm_vit_moco_init,
    "timm beit fix_init_weight div_ by layer": _timm_beit_fix_init_weight,
    "timm maxvit lookup tensor loops": _timm_maxvit_lookup_tensor,
    "timm AttentionPool2d init_weights": _timm_attention_pool2d,
    "timm swin v2 log coords / logit_scale / k_bias": _timm_swin_v2_log_coords,
    "timm drop-path linspace.split .tolist()": _timm_drop_path_split_tolist,
    "timm to(memory_format=channels_last)": _timm_channels_last,
}


# == torchtitan =============================================================================


def _depth_scaled_std(base_std: float, layer_id: int) -> float:
    return base_std / (2 * (layer_id + 1)) ** 0.5


class _TitanLinear(nn.Linear):
    """torchtitan/protocols/module.py: a module carrying a ``_param_init`` dict."""

    def __init__(self, i: int, o: int, param_init: dict[str, Callable], bias: bool = False):
        super().__init__(i, o, bias=bias)
        self._param_init = param_init


def _titan_init_self_parameters(model: nn.Module) -> None:
    for module in model.modules():
        param_init = getattr(module, "_param_init", None)
        if param_init is not None:
            for name, param in module.named_parameters(recurse=False):
                param_init[name](param)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


def _skip_param_init(param: nn.Parameter) -> None:
    pass


def _titan_param_init_dicts(m: nn.Module) -> None:
    """torchtitan/models/llama3/__init__.py + common/param_init.py: per-name ``param_init``
    dicts of ``partial(trunc_normal_, std=s, a=-3 * s, b=3 * s)``, ``depth_scaled_std``, and
    ``skip_param_init`` on an output tied to the embedding; run under ``torch.no_grad()``."""
    s = 8**-0.5
    m.tok_embeddings = nn.Embedding(11, 8)
    m.layers = nn.ModuleList(
        _TitanLinear(
            8,
            8,
            {
                "weight": partial(nn.init.trunc_normal_, std=_depth_scaled_std(0.02, i)),
                "bias": nn.init.zeros_,
            },
            bias=True,
        )
        for i in range(3)
    )
    m.norm = nn.RMSNorm(8)
    m.output = _TitanLinear(
        8, 11, {"weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s)}
    )
    m.tied = _TitanLinear(8, 11, {"weight": _skip_param_init})
    m.tied.weight = m.tok_embeddings.weight
    with torch.no_grad():
        _titan_init_self_parameters(m)


def _titan_cos_sin_rope(m: nn.Module) -> None:
    """torchtitan/models/common/rope.py ``CosSinRoPE._precompute_cache``: ``cat([freqs,
    freqs])``, then ``cat([cos, sin])`` into a non-persistent ``cache`` buffer."""
    dim, end, base = 8, 5, 10000.0
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, dtype=inv_freq.dtype, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq).float()
    theta = torch.cat([freqs, freqs], dim=-1)
    m.register_buffer("cache", torch.cat([theta.cos(), theta.sin()], dim=-1), persistent=False)


def _titan_yarn_complex_rope(m: nn.Module) -> None:
    """torchtitan/models/common/rope.py ``_yarn_inv_freq``: a clamped ramp blending two
    frequency sets, then ``torch.polar`` into a complex64 cache."""
    dim, base, rope_factor, original_seq_len = 8, 10000.0, 4.0, 64
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_seq_len / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low = max(math.floor(find_correction_dim(32.0)), 0)
    high = min(math.ceil(find_correction_dim(1.0)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / rope_factor * ramp + inv_freq * (1 - ramp)
    t = torch.arange(6, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq).float()
    m.register_buffer("cache", torch.polar(torch.ones_like(freqs), freqs), persistent=False)


def _titan_gpt_oss_experts(m: nn.Module) -> None:
    """torchtitan/models/gpt_oss/__init__.py: 3D expert weights *and biases* and per-head
    attention ``sinks``, all ``trunc_normal_`` with a depth-scaled std."""
    e, d, f, heads = 2, 4, 6, 2
    m.mlp1_weight = nn.Parameter(torch.empty(e, 2 * f, d))
    m.mlp1_bias = nn.Parameter(torch.empty(e, 2 * f))
    m.mlp2_weight = nn.Parameter(torch.empty(e, d, f))
    m.mlp2_bias = nn.Parameter(torch.empty(e, d))
    m.sinks = nn.Parameter(torch.empty(heads))
    std = _depth_scaled_std(0.02, 1)
    with torch.no_grad():
        for p in (m.mlp1_weight, m.mlp1_bias, m.mlp2_weight, m.mlp2_bias, m.sinks):
            nn.init.trunc_normal_(p, std=std)


def _titan_bf16_trunc_normal(m: nn.Module) -> None:
    """torchtitan ``final_out_std`` / ``cutoff_factor`` ``trunc_normal_`` on bfloat16
    parameters (training with ``param_dtype`` bf16 and ``init_weights`` after the cast)."""
    m.output = nn.Linear(8, 11, bias=False, dtype=torch.bfloat16)
    m.w1 = nn.Linear(8, 8, bias=False, dtype=torch.bfloat16)
    std = 8**-0.5
    with torch.no_grad():
        nn.init.trunc_normal_(m.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(m.w1.weight, mean=0.0, std=0.02)


def _titan_to_empty_then_init_weights(m: nn.Module) -> None:
    """torchtitan/trainer.py: ``model.to_empty(device=init_device)`` then
    ``model.init_weights(buffer_device=...)`` rewrites every parameter and buffer."""
    from tests.unit.contexts.test_materialize_idioms import _TitanTransformer

    m.model = _TitanTransformer()
    m.model.to_empty(device="cpu")
    with torch.no_grad():
        m.model.init_weights(buffer_device=torch.device("cpu"))


def _titan_flux_timestep_embedding(m: nn.Module) -> None:
    """torchtitan/models/flux/model/layers.py ``timestep_embedding``: ``time_factor * t``,
    ``cat([cos, sin])`` and, for an odd dim, a ``zeros_like`` column; ``.to(t)``."""
    dim, max_period, time_factor = 7, 10000, 1000.0
    t = torch.linspace(0, 1, 4)
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half
    ).to(t.device)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    if torch.is_floating_point(t):
        embedding = embedding.to(t)
    m.register_buffer("table", embedding, persistent=False)
    m.final = nn.Linear(7, 4)
    nn.init.zeros_(m.final.weight)
    nn.init.zeros_(m.final.bias)


def _titan_moe_counters_recreated(m: nn.Module) -> None:
    """torchtitan/models/common/moe.py ``_init_self_buffers``: the MoE counters re-created with
    ``torch.zeros`` under ``torch.device(buffer_device)``, the device read off the old buffer."""
    m.register_buffer("tokens_per_expert", torch.zeros(4, dtype=torch.float32), persistent=False)
    m.register_buffer("expert_bias", torch.zeros(4, dtype=torch.float32), persistent=True)
    m.gate = nn.Linear(8, 4, bias=False)
    buffer_device = m.tokens_per_expert.device
    with torch.device(buffer_device):
        m.tokens_per_expert = torch.zeros(4, dtype=torch.float32)
        m.expert_bias = torch.zeros(4, dtype=torch.float32)
    nn.init.trunc_normal_(m.gate.weight, std=0.02)


TORCHTITAN = {
    "torchtitan param_init dicts + skip_param_init tie": _titan_param_init_dicts,
    "torchtitan CosSinRoPE cat([cos, sin])": _titan_cos_sin_rope,
    "torchtitan yarn ramp + polar": _titan_yarn_complex_rope,
    "torchtitan gpt-oss expert biases and sinks": _titan_gpt_oss_experts,
    "torchtitan trunc_normal_ a/b on bfloat16": _titan_bf16_trunc_normal,
    "torchtitan to_empty(cpu) then init_weights": _titan_to_empty_then_init_weights,
    "torchtitan flux timestep_embedding odd dim": _titan_flux_timestep_embedding,
    "torchtitan MoE counters re-created on buffer device": _titan_moe_counters_recreated,
}


# == transformers ===========================================================================


def _hf_init_copy_inv_freq(m: nn.Module) -> None:
    """transformers 5 ``_init_weights``: ``init.copy_(module.inv_freq, inv_freq)`` of a
    recomputed rotary table into the registered buffer (transformers/initialization.py)."""
    from transformers import initialization as init

    dim, base = 8, 10000.0
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    m.register_buffer("inv_freq", torch.empty_like(inv_freq), persistent=False)
    m.register_buffer("original_inv_freq", torch.empty_like(inv_freq), persistent=False)
    init.copy_(m.inv_freq, inv_freq)
    init.copy_(m.original_inv_freq, inv_freq)
    m.proj = nn.Linear(8, 8)
    init.normal_(m.proj.weight, mean=0.0, std=0.02)
    init.zeros_(m.proj.bias)


def _hf_is_hf_initialized_skip(m: nn.Module) -> None:
    """transformers/initialization.py: ``init.normal_`` skips a tensor flagged
    ``_is_hf_initialized`` (set by loading); the flag set by hand on one weight."""
    from transformers import initialization as init

    m.a = nn.Linear(4, 4)
    m.b = nn.Linear(4, 4)
    m.a.weight._is_hf_initialized = True
    for linear in (m.a, m.b):
        init.normal_(linear.weight, mean=0.0, std=0.02)
        init.zeros_(linear.bias)


def _hf_orthogonal_bf16(m: nn.Module) -> None:
    """transformers/initialization.py ``orthogonal_``: a bf16 tensor goes through an fp32
    ``nn.init.orthogonal_`` and back with ``tensor.copy_`` under no_grad (RL / Mamba heads)."""
    from transformers import initialization as init

    m.fc = nn.Linear(4, 6, dtype=torch.bfloat16)
    init.orthogonal_(m.fc.weight, gain=math.sqrt(2))
    m.head = nn.Linear(6, 3)
    init.orthogonal_(m.head.weight, gain=0.01)


def _hf_gemma_embed_scale(m: nn.Module) -> None:
    """transformers/models/gemma3/modeling_gemma3.py: ``register_buffer("embed_scale",
    torch.tensor(embed_scale), persistent=False)`` (a 0-d buffer from a Python float), and
    Gemma's RMSNorm ``weight = nn.Parameter(torch.zeros(dim))``."""
    hidden = 8
    m.embed = nn.Embedding(10, hidden, padding_idx=0)
    m.register_buffer("embed_scale", torch.tensor(hidden**0.5), persistent=False)
    m.norm_weight = nn.Parameter(torch.zeros(hidden))


def _hf_make_causal_mask(m: nn.Module) -> None:
    """transformers ``_make_causal_mask``: ``torch.full(.., finfo.min)`` then ``masked_fill_``
    by an ``arange`` comparison broadcast against its transpose."""
    tgt_len, dtype = 4, torch.float32
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min)
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    m.register_buffer("causal_mask", mask[None, None, :, :], persistent=False)


def _hf_tie_or_clone_pad_bias(m: nn.Module) -> None:
    """transformers/modeling_utils.py ``_tie_or_clone_weights``: the output weight tied by
    assignment and its bias padded with ``F.pad`` through ``.data =``."""
    m.input_embeddings = nn.Embedding(7, 4)
    m.output_embeddings = nn.Linear(4, 5)
    m.output_embeddings.weight = m.input_embeddings.weight
    m.output_embeddings.bias.data = F.pad(
        m.output_embeddings.bias.data,
        (0, m.output_embeddings.weight.shape[0] - m.output_embeddings.bias.shape[0]),
        "constant",
        0,
    )
    m.output_embeddings.out_features = m.input_embeddings.num_embeddings


def _hf_resize_copy_old_rows(m: nn.Module) -> None:
    """transformers/modeling_utils.py ``_get_resized_embeddings``: a new Embedding,
    ``_init_weights`` on it, then ``new.weight.data[:n, :] = old.weight.data[:n, :]``."""
    m.old = nn.Embedding(5, 4)
    m.new = nn.Embedding(8, 4)
    m.new.weight.data.normal_(mean=0.0, std=0.02)
    n = min(m.old.num_embeddings, m.new.num_embeddings)
    m.new.weight.data[:n, :] = m.old.weight.data[:n, :]


def _hf_llava_image_newline(m: nn.Module) -> None:
    """transformers/models/llava_next/modeling_llava_next.py: ``image_newline =
    nn.Parameter(torch.randn(hidden, dtype=dtype) * embed_std)``, ``embed_std =
    1 / math.sqrt(hidden)``, in a bf16 model."""
    hidden = 8
    embed_std = 1 / math.sqrt(hidden)
    m.image_newline = nn.Parameter(torch.randn(hidden, dtype=torch.bfloat16) * embed_std)
    m.proj = nn.Linear(8, 8, dtype=torch.bfloat16)


def _hf_roberta_position_ids_cumsum(m: nn.Module) -> None:
    """transformers/models/roberta/modeling_roberta.py
    ``create_position_ids_from_input_ids``: ``cumsum`` of a padding mask, ``type_as``,
    times the mask, plus ``padding_idx`` (kept as an int64 buffer for a fixed prompt)."""
    padding_idx = 1
    input_ids = torch.tensor([[0, 5, 6, 1, 1], [0, 7, 1, 1, 1]])
    mask = input_ids.ne(padding_idx).int()
    incremental_indices = (torch.cumsum(mask, dim=1).type_as(mask) + 0) * mask
    m.register_buffer("position_ids", incremental_indices.long() + padding_idx, persistent=False)
    m.position_embeddings = nn.Embedding(8, 4, padding_idx=padding_idx)


TRANSFORMERS = {
    "transformers init.copy_ inv_freq (library)": _hf_init_copy_inv_freq,
    "transformers _is_hf_initialized flag skips init (library)": _hf_is_hf_initialized_skip,
    "transformers init.orthogonal_ bf16 via fp32 copy_ (library)": _hf_orthogonal_bf16,
    "transformers gemma embed_scale 0-d buffer": _hf_gemma_embed_scale,
    "transformers _make_causal_mask masked_fill_": _hf_make_causal_mask,
    "transformers tie + F.pad bias via .data =": _hf_tie_or_clone_pad_bias,
    "transformers resize copies old rows via .data[:n]": _hf_resize_copy_old_rows,
    "transformers llava image_newline randn*std bf16": _hf_llava_image_newline,
    "transformers roberta position ids cumsum": _hf_roberta_position_ids_cumsum,
}


# == diffusers ==============================================================================


def _diffusers_attention_processor(m: nn.Module) -> None:
    """diffusers/models/attention_processor.py: ``Attention(...)`` with ``set_processor`` of
    ``AttnProcessor2_0`` and ``set_processor(AttnProcessor())`` (the library's classes)."""
    from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

    m.attn1 = Attention(query_dim=8, heads=2, dim_head=4, processor=AttnProcessor2_0())
    m.attn2 = Attention(query_dim=8, cross_attention_dim=6, heads=2, dim_head=4, bias=True)
    m.attn2.set_processor(AttnProcessor())


def _diffusers_fuse_projections(m: nn.Module) -> None:
    """diffusers/models/attention_processor.py ``Attention.fuse_projections``: a new
    ``nn.Linear(..., device=to_q.weight.data.device)`` and ``copy_`` of ``torch.cat`` of the
    q/k/v weights (``@torch.no_grad()``), the library's own method."""
    from diffusers.models.attention_processor import Attention

    m.attn = Attention(query_dim=8, heads=2, dim_head=4, bias=True)
    m.attn.fuse_projections()


def _diffusers_alphas_cumprod_buffers(m: nn.Module) -> None:
    """latent-diffusion / diffusers DDPM: float64 ``linspace(...) ** 2`` betas, ``cumprod``
    of alphas, and ``sqrt`` / ``log`` tables registered as float32 buffers."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 10, dtype=torch.float64) ** 2
    alphas = 1.0 - betas
    alphas_cumprod = torch.cumprod(alphas, dim=0)
    alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
    m.register_buffer("betas", betas.to(torch.float32))
    m.register_buffer("alphas_cumprod", alphas_cumprod.to(torch.float32))
    m.register_buffer("alphas_cumprod_prev", alphas_cumprod_prev.to(torch.float32))
    m.register_buffer("sqrt_recip_alphas_cumprod", torch.sqrt(1.0 / alphas_cumprod).float())
    m.register_buffer("log_one_minus", torch.log(1.0 - alphas_cumprod).float())


def _diffusers_betas_for_alpha_bar(m: nn.Module) -> None:
    """diffusers/schedulers/scheduling_ddpm.py ``betas_for_alpha_bar`` (the library's): a
    ``torch.tensor`` of a Python list from ``math.cos``, then ``cumprod`` into a buffer."""
    from diffusers.schedulers.scheduling_ddpm import betas_for_alpha_bar

    betas = betas_for_alpha_bar(8, alpha_transform_type="cosine")
    m.register_buffer("alphas_cumprod", torch.cumprod(1.0 - betas, dim=0))
    m.unet_in = nn.Conv2d(3, 4, 3, padding=1)


def _diffusers_basic_transformer_block(m: nn.Module) -> None:
    """diffusers/models/attention.py ``BasicTransformerBlock(norm_type="ada_norm_zero")``
    with its ``AdaLayerNormZero`` (CombinedTimestepLabelEmbeddings) and GEGLU FeedForward."""
    from diffusers.models.attention import BasicTransformerBlock

    m.block = BasicTransformerBlock(
        dim=8,
        num_attention_heads=2,
        attention_head_dim=4,
        norm_type="ada_norm_zero",
        num_embeds_ada_norm=10,
        activation_fn="geglu",
    )


def _diffusers_zero_module_detach(m: nn.Module) -> None:
    """Older diffusers / ControlNet ``zero_module``: ``p.detach().zero_()`` on each parameter
    (the write goes through a detached alias)."""
    m.conv = nn.Conv2d(4, 4, 1)
    for p in m.conv.parameters():
        p.detach().zero_()
    m.conv_in = nn.Conv2d(3, 4, 3)


def _diffusers_combined_embeddings(m: nn.Module) -> None:
    """diffusers/models/embeddings.py ``CombinedTimestepTextProjEmbeddings`` (SD3): Timesteps
    + TimestepEmbedding + PixArtAlphaTextProjection, the library's."""
    from diffusers.models.embeddings import CombinedTimestepTextProjEmbeddings

    m.time_text_embed = CombinedTimestepTextProjEmbeddings(embedding_dim=8, pooled_projection_dim=6)


def _diffusers_ada_layer_norm_continuous(m: nn.Module) -> None:
    """diffusers/models/normalization.py ``AdaLayerNormContinuous`` + ``RMSNorm`` (the
    library's), then the DiT-style zero-init of the modulation linear."""
    from diffusers.models.normalization import AdaLayerNormContinuous, RMSNorm

    m.norm_out = AdaLayerNormContinuous(8, 8, elementwise_affine=False, eps=1e-6)
    m.norm_q = RMSNorm(4, eps=1e-6)
    nn.init.zeros_(m.norm_out.linear.weight)
    nn.init.zeros_(m.norm_out.linear.bias)


DIFFUSERS = {
    "diffusers Attention + set_processor (library)": _diffusers_attention_processor,
    "diffusers Attention.fuse_projections (library)": _diffusers_fuse_projections,
    "diffusers DDPM alphas_cumprod buffers": _diffusers_alphas_cumprod_buffers,
    "diffusers betas_for_alpha_bar cumprod (library)": _diffusers_betas_for_alpha_bar,
    "diffusers BasicTransformerBlock ada_norm_zero (library)": _diffusers_basic_transformer_block,
    "diffusers zero_module via p.detach().zero_()": _diffusers_zero_module_detach,
    "diffusers CombinedTimestepTextProjEmbeddings (library)": _diffusers_combined_embeddings,
    "diffusers AdaLayerNormContinuous + RMSNorm (library)": _diffusers_ada_layer_norm_continuous,
}


# == PEFT, the library's tuners on a base built in the same block =============================


class _PeftBase(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.v = nn.Linear(16, 16)
        self.o = nn.Linear(16, 4)
        self.norm = nn.LayerNorm(16)


def _peft(kind: str, **kwargs) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        """peft ``get_peft_model(base, <Config>)`` on a base built in the same block."""
        import peft

        config = getattr(peft, kind)(**{"target_modules": ["q", "v"], **kwargs})
        m.model = peft.get_peft_model(_PeftBase(), config)

    return init


PEFT = {
    "peft LoHa init_weights=True": _peft("LoHaConfig", r=2),
    "peft LoKr init_weights=True": _peft("LoKrConfig", r=2),
    "peft OFT": _peft("OFTConfig", r=0, oft_block_size=4),
    "peft BOFT": _peft("BOFTConfig", boft_block_size=4, boft_n_butterfly_factor=1),
    "peft LoRA use_dora (magnitude from base)": _peft("LoraConfig", r=2, use_dora=True),
    "peft LoRA init_lora_weights=False": _peft("LoraConfig", r=2, init_lora_weights=False),
    "peft VeRA (seeded shared projections)": _peft("VeraConfig", r=2),
    "peft HRA": _peft("HRAConfig", r=2),
    "peft AdaLoRA": _peft("AdaLoraConfig", init_r=2, target_r=1, total_step=10),
    "peft FourierFT (seeded spectrum indices)": _peft("FourierFTConfig", n_frequency=8),
    "peft LN tuning (copies of the base norm)": _peft("LNTuningConfig", target_modules=["norm"]),
}


# == torch idioms those libraries rely on ====================================================


def _torch_fork_rng_seeded_init(m: nn.Module) -> None:
    """``with torch.random.fork_rng(): torch.manual_seed(s); ...``: a reproducible init that
    leaves the caller's stream alone (diffusers training utils, research code)."""
    m.a = nn.Linear(4, 4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        m.fixed = nn.Linear(4, 4)
        m.register_buffer("proj", torch.randn(4, 2))
    m.b = nn.Linear(4, 4)


def _torch_get_set_rng_state(m: nn.Module) -> None:
    """``state = torch.get_rng_state()`` ... ``torch.set_rng_state(state)``: two layers drawn
    from the same point of the stream (a twin initialised identically)."""
    state = torch.get_rng_state()
    m.a = nn.Linear(4, 4)
    torch.set_rng_state(state)
    m.b = nn.Linear(4, 4)
    m.c = nn.Linear(4, 4)


def _torch_gumbel_buffer(m: nn.Module) -> None:
    """A fixed Gumbel noise buffer: ``-torch.empty(n).exponential_().log()`` and
    ``uniform_().clamp_(eps).log_().neg_()``."""
    m.register_buffer("g1", -torch.empty(5).exponential_().log())
    m.register_buffer("g2", torch.empty(5).uniform_().clamp_(1e-6).log_().neg_())
    m.fc = nn.Linear(5, 5)


def _torch_scatter_one_hot(m: nn.Module) -> None:
    """A one-hot routing / lookup buffer: ``torch.zeros(...).scatter_(1, idx, 1.0)``
    (torchtitan's router ``scatter_``; timm's NaFlex index tables)."""
    idx = torch.tensor([[2], [0], [1]])
    m.register_buffer("one_hot", torch.zeros(3, 4).scatter_(1, idx, 1.0))
    m.register_buffer(
        "counts",
        torch.zeros(4, dtype=torch.int64).scatter_add_(
            0, idx.flatten(), torch.ones(3, dtype=torch.int64)
        ),
    )


def _torch_index_put(m: nn.Module) -> None:
    """A band mask written with ``index_put_`` (and ``accumulate=True``) on an int64 pair of
    index tensors, then cast to bool (local-attention masks)."""
    mask = torch.zeros(4, 4)
    rows = torch.arange(4)
    mask.index_put_((rows, rows), torch.tensor(1.0))
    mask.index_put_((rows[:-1], rows[1:]), torch.tensor(1.0), accumulate=True)
    m.register_buffer("band", mask.bool(), persistent=False)


def _torch_where_clip_init(m: nn.Module) -> None:
    """Resample-free truncation: ``w.data = torch.where(w.abs() > 2 * std, 0, w)`` on a
    normal draw (value-dependent, but computed in torch)."""
    m.fc = nn.Linear(6, 6)
    std = 0.5
    nn.init.normal_(m.fc.weight, std=std)
    w = m.fc.weight.data
    m.fc.weight.data = torch.where(w.abs() > 2 * std, torch.zeros_like(w), w)


def _torch_expand_parameter(m: nn.Module) -> None:
    """``nn.Parameter(token.expand(1, n, -1))``: a Parameter that is a stride-0 view."""
    token = torch.zeros(1, 1, 4)
    nn.init.normal_(token, std=0.02)
    m.query_tokens = nn.Parameter(token.expand(1, 3, -1))


def _torch_repeat_interleave_buffer(m: nn.Module) -> None:
    """``repeat`` / ``repeat_interleave`` / ``tile`` of a computed row into buffers."""
    base = torch.arange(3, dtype=torch.float32) * 0.5
    m.register_buffer("rep", base.repeat(2, 2))
    m.register_buffer("inter", base.repeat_interleave(2))
    m.register_buffer("tiled", torch.tile(base, (2,)))


def _torch_complex_freqs(m: nn.Module) -> None:
    """``torch.complex(cos, sin)`` freqs and a ``view_as_real`` copy of them."""
    freqs = torch.outer(torch.arange(4).float(), torch.tensor([1.0, 0.1]))
    cis = torch.complex(torch.cos(freqs), torch.sin(freqs))
    m.register_buffer("freqs_cis", cis, persistent=False)
    m.register_buffer("freqs_real", torch.view_as_real(cis).clone(), persistent=False)


def _torch_view_as_complex_of_param(m: nn.Module) -> None:
    """A buffer that is ``view_as_complex`` of a parameter (storage shared with it)."""
    m.w = nn.Parameter(torch.randn(3, 2))
    m.register_buffer("wc", torch.view_as_complex(m.w.data), persistent=False)


def _torch_bf16_buffer_cast(m: nn.Module) -> None:
    """A computed table kept as ``.to(torch.bfloat16)`` next to float32 parameters."""
    freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    m.register_buffer("freqs", freqs.to(torch.bfloat16), persistent=False)
    m.fc = nn.Linear(4, 4)
    m.register_buffer("half_w", m.fc.weight.detach().to(torch.float16).clone())


def _torch_randperm_bernoulli_buffers(m: nn.Module) -> None:
    """Random index and mask buffers: ``torch.randperm`` (shuffle tables) and
    ``torch.empty(n).bernoulli_(p)`` (fixed DropConnect masks)."""
    m.register_buffer("perm", torch.randperm(6))
    m.register_buffer("keep", torch.empty(6).bernoulli_(0.5))
    m.fc = nn.Linear(6, 6)
    m.register_buffer("multi", torch.multinomial(torch.ones(6), 3))


def _torch_copy_transposed(m: nn.Module) -> None:
    """A decoder initialised as the encoder's transpose: ``dec.weight.copy_(enc.weight.t())``
    under no_grad (tied autoencoders)."""
    m.enc = nn.Linear(6, 3)
    m.dec = nn.Linear(3, 6)
    with torch.no_grad():
        m.dec.weight.copy_(m.enc.weight.t())


def _torch_inference_mode_buffer(m: nn.Module) -> None:
    """A cache precomputed under ``torch.inference_mode()`` and registered as a buffer."""
    with torch.inference_mode():
        table = torch.arange(4).float().outer(torch.ones(3))
    m.register_buffer("table", table, persistent=False)
    m.fc = nn.Linear(3, 3)


def _torch_clone_detach_requires_grad(m: nn.Module) -> None:
    """``nn.Parameter(other.weight.clone().detach().requires_grad_(True))`` and a buffer
    from ``other.bias.detach().clone()``: copies of a layer built just before."""
    m.src = nn.Linear(4, 4)
    m.copy = nn.Parameter(m.src.weight.clone().detach().requires_grad_(True))
    m.register_buffer("bias_copy", m.src.bias.detach().clone())


def _torch_data_add_alpha(m: nn.Module) -> None:
    """A weight perturbed from another: ``w.data.add_(other.data, alpha=0.1)`` and
    ``addcmul_`` (noise-init of a student from a teacher)."""
    m.teacher = nn.Linear(4, 4)
    m.student = nn.Linear(4, 4)
    m.student.weight.data.add_(m.teacher.weight.data, alpha=0.1)
    m.student.bias.data.addcmul_(m.teacher.bias.data, m.teacher.bias.data, value=-1.0)


def _torch_trunc_normal_buffer_codebook(m: nn.Module) -> None:
    """An EMA codebook kept as a buffer and drawn with ``trunc_normal_`` (VQ layers whose
    codebook is updated by EMA, not by the optimizer), next to a projection."""
    m.proj = nn.Linear(4, 4)
    m.register_buffer("codebook", torch.empty(8, 4))
    m.register_buffer("cluster_size", torch.zeros(8))
    nn.init.trunc_normal_(m.codebook, std=0.02)
    m.register_buffer("embed_avg", m.codebook.clone())


TORCH = {
    "torch random.fork_rng seeded init": _torch_fork_rng_seeded_init,
    "torch get_rng_state/set_rng_state twin": _torch_get_set_rng_state,
    "torch Gumbel noise buffers exponential_/log_": _torch_gumbel_buffer,
    "torch trunc_normal_ EMA codebook buffer": _torch_trunc_normal_buffer_codebook,
    "torch scatter_/scatter_add_ buffers": _torch_scatter_one_hot,
    "torch index_put_ band mask": _torch_index_put,
    "torch where clip of a normal draw via .data =": _torch_where_clip_init,
    "torch Parameter(token.expand(...))": _torch_expand_parameter,
    "torch repeat/repeat_interleave/tile buffers": _torch_repeat_interleave_buffer,
    "torch complex(cos, sin) freqs": _torch_complex_freqs,
    "torch view_as_complex of a parameter": _torch_view_as_complex_of_param,
    "torch .to(bfloat16)/.to(float16) buffers": _torch_bf16_buffer_cast,
    "torch randperm/bernoulli_/multinomial buffers": _torch_randperm_bernoulli_buffers,
    "torch copy_(other.weight.t())": _torch_copy_transposed,
    "torch inference_mode cache buffer": _torch_inference_mode_buffer,
    "torch clone().detach().requires_grad_() copies": _torch_clone_detach_requires_grad,
    "torch data.add_(alpha=)/addcmul_ from another": _torch_data_add_alpha,
}


IDIOMS: dict[str, Callable[[nn.Module], None]] = {
    **TIMM,
    **TORCHTITAN,
    **TRANSFORMERS,
    **DIFFUSERS,
    **PEFT,
    **TORCH,
}


# == what each idiom gives ==================================================================

_BOOL_READ = r"__bool__ read the values of a tensor the build computed from random numbers"

# idiom -> {include_buffers: Outcome}; an idiom not listed is exact in both modes
OUTCOMES: dict[str, dict[bool, Outcome]] = {
    "timm drop-path linspace.split .tolist()": {
        True: broken(
            "crash: `.tolist()` of a split meta linspace raises 'Cannot copy out of meta "
            "tensor; no data!' in the build (plain torch.device('meta') fails the same way)"
        )
    },
    # to_empty(device="cpu") of layers the context placed: eager's Module._apply keeps each
    # parameter object and gives it the new real memory, which a meta parameter cannot take,
    # so the whole build is refused upfront
    "torchtitan to_empty(cpu) then init_weights": {
        mode: Outcome(REFUSED, "Module._apply made a real CPU tensor") for mode in MODES
    },
    "torch trunc_normal_ EMA codebook buffer": {False: Outcome(REFUSED, _BOOL_READ)},
    "peft BOFT": {
        True: broken(
            "crash: PEFT's perm2mat writes `perm_mat[i, idx] = 1` with a 0-d meta index from a "
            "meta arange, raising 'Tensor.item() cannot be called on meta tensors' in the build "
            "(plain torch.device('meta') fails the same way)"
        )
    },
    "torch Parameter(token.expand(...))": {
        False: Outcome(REFUSED, r"registered with strides \(4, 0, 1\)")
    },
    # ``.float()`` and ``.outer`` take inference tensors under inference mode, where a write
    # to them moves no version counter: their values, and the buffer's, are unknown
    "torch inference_mode cache buffer": {
        True: Outcome(REFUSED, r"an inference tensor that a torch call under torch\.inference_mode")
    },
}


@pytest.mark.parametrize(("idiom", "include_buffers", "outcome"), idiom_cases(IDIOMS, OUTCOMES))
def test_library_idioms_are_exact_or_refused_upfront(idiom, include_buffers, outcome):
    check_idiom(IDIOMS[idiom], include_buffers, outcome)


# -- the plain ``weight`` attribute of the old hook-based reparametrisations --------------------


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("wrap", ["weight_norm", "spectral_norm"])
def test_old_hook_reparametrisations_leave_a_real_weight_attribute(wrap, include_buffers):
    """transformers wav2vec2 / SEW and diffusers vocoders still call ``nn.utils.weight_norm``;
    GAN discriminators call ``nn.utils.spectral_norm``; both set a plain ``weight`` attribute
    (neither parameter nor buffer) when applied and read ``module.weight`` directly:
    materialize gives it eager's value too (``spectral_norm``'s shares ``weight_orig``'s
    memory, as eager's ``weight.data`` does)."""

    def build() -> nn.Module:
        return getattr(nn.utils, wrap)(nn.Linear(4, 3))

    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    # the weight attribute's autograd graph holds weight_g / weight_v: new ones take their place
    held = ("weight_g", "weight_v") if wrap == "weight_norm" else ()
    materialize_exactly(model, ref, replaced=held)
    assert not model.weight.is_meta, "the module's weight attribute is still on meta"
    assert torch.equal(model.weight, ref.weight)
    assert model.weight.stride() == ref.weight.stride()
    assert model.weight.requires_grad == ref.weight.requires_grad
    if wrap == "spectral_norm":
        assert model.weight.data_ptr() == model.weight_orig.data_ptr()
