"""materialize against the init idioms of timm, torchtitan, transformers, diffusers, PEFT
and plain torch, written inline as those libraries write them (short copies of their shape;
diffusers' and PEFT's own functions where they are installed).

Each idiom is a constructor body ``init(m)`` run in ``Built``; each is built eagerly and in
``empty_weights(replayable=True)`` (params-only and ``include_buffers=True``) under one seed,
then must either materialize to eager's tensors bit for bit (dtype, strides, ties, storage
sharing, the default generator) or be refused upfront, naming the tensor and the reason, with
``is_materializable`` agreeing and nothing changed. ``OUTCOMES`` lists the idioms that are not
exact: an accurate refusal is asserted as such; an idiom that breaks the promise (a crash in the
build, a late refusal, a silently wrong value, a refusal for a wrong reason) is a strict xfail
whose reason says what happens, and whose body asserts what the promise allows. The exact
idioms are also materialized child by child, last child first."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    REFUSED,
    Built,
    Outcome,
    broken,
    build_eagerly,
    build_empty,
    check_idiom,
    idiom_cases,
    materialize_exactly,
    tensors,
    warm_pickling,
)

pytestmark = pytest.mark.filterwarnings("ignore")


# == timm ===================================================================================


def _timm_vit_tokens(m: nn.Module) -> None:
    """VisionTransformer: zero tokens, then trunc_normal_ / normal_ in init_weights."""
    m.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
    m.reg_token = nn.Parameter(torch.zeros(1, 2, 8))
    m.pos_embed = nn.Parameter(torch.randn(1, 5, 8) * 0.02)
    nn.init.trunc_normal_(m.pos_embed, std=0.02)
    nn.init.normal_(m.cls_token, std=1e-6)
    nn.init.normal_(m.reg_token, std=1e-6)


def _timm_drop_path_schedule(m: nn.Module) -> None:
    """``dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]``."""
    dpr = [x.item() for x in torch.linspace(0, 0.1, 4)]
    m.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in dpr)
    m.register_buffer("rates", torch.tensor(dpr))
    m.scale = nn.Parameter(torch.full((4,), dpr[-1]))


def _timm_drop_path_tolist(m: nn.Module) -> None:
    """Newer timm: ``torch.linspace(0, dpr, depth).tolist()`` and ``calculate_drop_path_rates``."""
    dpr = torch.linspace(0, 0.2, 3).tolist()
    m.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in dpr)
    for block, rate in zip(m.blocks, dpr, strict=True):
        with torch.no_grad():
            block.bias.mul_(1 - rate)


def _timm_trunc_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def _timm_apply_init_weights(m: nn.Module) -> None:
    """``self.apply(self._init_weights)`` with trunc_normal_(std=.02) on every Linear."""
    m.blocks = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
    m.head = nn.Linear(6, 3)
    m.apply(_timm_trunc_init)
    m.head.weight.data.mul_(0.001)  # head_init_scale
    m.head.bias.data.mul_(0.001)


def _timm_layer_scale(m: nn.Module) -> None:
    """LayerScale / ConvNeXt gamma: ``init_values * torch.ones(dim)``."""
    m.gamma = nn.Parameter(1e-5 * torch.ones(6))
    m.gamma2 = nn.Parameter(torch.full((6,), 1e-6))
    m.ls = nn.Parameter(1e-6 * torch.ones(6, 1, 1))


def _timm_relative_position_bias(m: nn.Module) -> None:
    """Swin's relative position bias table and its index buffer."""
    wh, ww, heads = 3, 2, 2
    m.relative_position_bias_table = nn.Parameter(torch.zeros((2 * wh - 1) * (2 * ww - 1), heads))
    coords = torch.stack(torch.meshgrid([torch.arange(wh), torch.arange(ww)], indexing="ij"))
    coords_flatten = torch.flatten(coords, 1)
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
    relative_coords = relative_coords.permute(1, 2, 0).contiguous()
    relative_coords[:, :, 0] += wh - 1
    relative_coords[:, :, 1] += ww - 1
    relative_coords[:, :, 0] *= 2 * ww - 1
    m.register_buffer("relative_position_index", relative_coords.sum(-1), persistent=False)
    nn.init.trunc_normal_(m.relative_position_bias_table, std=0.02)


def _timm_lecun_normal(m: nn.Module) -> None:
    """``lecun_normal_`` via variance_scaling_: fan from the tensor, truncated normal."""
    m.fc = nn.Linear(5, 4)
    fan_in, _ = nn.init._calculate_fan_in_and_fan_out(m.fc.weight)
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    nn.init.trunc_normal_(m.fc.weight, std=std)
    nn.init.normal_(m.fc.bias, std=1e-6)


def _timm_mae_patch_embed(m: nn.Module) -> None:
    """MAE: xavier_uniform_ on the conv weight seen as 2D through ``.data.view``."""
    m.proj = nn.Conv2d(3, 8, 2, 2)
    w = m.proj.weight.data
    nn.init.xavier_uniform_(w.view([w.shape[0], -1]))


def _sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def _timm_mae_numpy_pos_embed(m: nn.Module) -> None:
    """MAE: a frozen pos_embed filled from a NumPy sin-cos table with ``.data.copy_``."""
    m.pos_embed = nn.Parameter(torch.zeros(1, 4, 8), requires_grad=False)
    table = _sincos_1d(8, np.arange(4, dtype=np.float32))
    m.pos_embed.data.copy_(torch.from_numpy(table).float().unsqueeze(0))


def _timm_efficientnet_goog(m: nn.Module) -> None:
    """``_init_weight_goog``: normal_ by fan-out on convs, uniform_ by range on linears."""
    m.conv = nn.Conv2d(4, 6, 3, groups=2)
    m.fc = nn.Linear(6, 5)
    fan_out = m.conv.kernel_size[0] * m.conv.kernel_size[1] * m.conv.out_channels // 2
    m.conv.weight.data.normal_(0, math.sqrt(2.0 / fan_out))
    init_range = 1.0 / math.sqrt(m.fc.weight.size(0))
    m.fc.weight.data.uniform_(-init_range, init_range)
    m.fc.bias.data.zero_()


def _timm_named_apply(m: nn.Module) -> None:
    """``named_apply(init_weights_vit_jax)``: choices by module name."""
    m.head = nn.Linear(4, 3)
    m.mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    m.qkv = nn.Linear(4, 12)
    for name, module in m.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name.startswith("head"):
            nn.init.zeros_(module.weight)
            nn.init.constant_(module.bias, -math.log(3))
        else:
            nn.init.xavier_uniform_(module.weight)
            if "mlp" in name:
                nn.init.normal_(module.bias, std=1e-6)
            else:
                nn.init.zeros_(module.bias)


def _timm_resnet_zero_init_last(m: nn.Module) -> None:
    """ResNet: kaiming_normal_(fan_out, relu), BN ones/zeros, last BN of a block zeroed."""
    m.conv = nn.Conv2d(3, 4, 3, bias=False)
    m.bn1 = nn.BatchNorm2d(4)
    m.bn3 = nn.BatchNorm2d(4)
    for module in m.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    nn.init.zeros_(m.bn3.weight)


TIMM = {
    "timm vit cls/reg/pos tokens": _timm_vit_tokens,
    "timm drop-path linspace .item()": _timm_drop_path_schedule,
    "timm drop-path linspace .tolist()": _timm_drop_path_tolist,
    "timm apply(_init_weights) trunc_normal_": _timm_apply_init_weights,
    "timm LayerScale init_values*ones": _timm_layer_scale,
    "timm swin relative position bias": _timm_relative_position_bias,
    "timm lecun_normal_ variance scaling": _timm_lecun_normal,
    "timm MAE xavier_uniform_ on data.view": _timm_mae_patch_embed,
    "timm MAE numpy pos_embed data.copy_": _timm_mae_numpy_pos_embed,
    "timm efficientnet goog init": _timm_efficientnet_goog,
    "timm named_apply by name": _timm_named_apply,
    "timm resnet zero_init_last": _timm_resnet_zero_init_last,
}


# == torchtitan =============================================================================


def _precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def _titan_freqs_cis(m: nn.Module) -> None:
    """``precompute_freqs_cis``: a complex64 buffer from torch.polar."""
    m.register_buffer("freqs_cis", _precompute_freqs_cis(8, 6), persistent=False)


def _apply_llama3_scaling(freqs: torch.Tensor) -> torch.Tensor:
    scale_factor, low_freq_factor, high_freq_factor, old_context_len = 8, 1, 4, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    freqs = torch.where(wavelen > low_freq_wavelen, freqs / scale_factor, freqs)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * freqs / scale_factor + smooth * freqs
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, freqs)


def _titan_llama3_scaled_rope(m: nn.Module) -> None:
    freqs = 1.0 / (500000.0 ** (torch.arange(0, 16, 2)[:8].float() / 16))
    freqs = _apply_llama3_scaling(freqs)
    t = torch.arange(5, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    m.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)


class _TitanBlock(nn.Module):
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.wq = nn.Linear(8, 8, bias=False)
        self.w1 = nn.Linear(8, 16, bias=False)
        self.attention_norm = nn.RMSNorm(8)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        for linear in (self.wq, self.w1):
            std = self.weight_init_std
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        self.attention_norm.reset_parameters()


class _TitanTransformer(nn.Module):
    """torchtitan's Transformer: skeleton in __init__, values in ``init_weights``."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(11, 8)
        self.register_buffer("freqs_cis", _precompute_freqs_cis(8, 6), persistent=False)
        self.layers = nn.ModuleDict({str(i): _TitanBlock(i) for i in range(2)})
        self.norm = nn.RMSNorm(8)
        self.output = nn.Linear(8, 11, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = _precompute_freqs_cis(8, 6)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        final_out_std = 8**-0.5
        cutoff_factor = 3
        nn.init.trunc_normal_(
            self.output.weight,
            mean=0.0,
            std=final_out_std,
            a=-cutoff_factor * final_out_std,
            b=cutoff_factor * final_out_std,
        )


def _titan_init_weights(m: nn.Module) -> None:
    """``init_weights()`` under ``torch.no_grad()``, buffers on the freqs_cis device."""
    m.model = _TitanTransformer()
    with torch.no_grad():
        m.model.init_weights()


def _titan_init_weights_buffer_device_cpu(m: nn.Module) -> None:
    """``init_weights(buffer_device=torch.device("cpu"))``: a ``torch.device`` block inside."""
    m.model = _TitanTransformer()
    with torch.no_grad():
        m.model.init_weights(buffer_device=torch.device("cpu"))


def _titan_tied_by_assignment(m: nn.Module) -> None:
    m.model = _TitanTransformer(tie=True)
    with torch.no_grad():
        m.model.init_weights()


def _titan_moe(m: nn.Module) -> None:
    """GroupedExperts 3D weights, router, expert_bias / tokens_per_expert buffers."""
    m.w1 = nn.Parameter(torch.empty(4, 8, 16))
    m.w2 = nn.Parameter(torch.empty(4, 16, 8))
    m.gate = nn.Linear(8, 4, bias=False)
    m.register_buffer("expert_bias", torch.zeros(4, dtype=torch.float32), persistent=True)
    m.register_buffer("tokens_per_expert", torch.zeros(4, dtype=torch.float32), persistent=False)
    with torch.no_grad():
        for w in (m.w1, m.w2, m.gate.weight):
            nn.init.trunc_normal_(w, mean=0.0, std=0.02)
        m.expert_bias.zero_()


TORCHTITAN = {
    "torchtitan precompute_freqs_cis polar": _titan_freqs_cis,
    "torchtitan llama3 scaled rope": _titan_llama3_scaled_rope,
    "torchtitan init_weights under no_grad": _titan_init_weights,
    "torchtitan init_weights(buffer_device=cpu)": _titan_init_weights_buffer_device_cpu,
    "torchtitan tied output by assignment": _titan_tied_by_assignment,
    "torchtitan MoE experts and buffers": _titan_moe,
}


# == transformers ===========================================================================


def _hf_rotary(m: nn.Module) -> None:
    """LlamaRotaryEmbedding: int64 arange .float(), inv_freq kept twice."""
    base, dim = 10000.0, 8
    inv_freq = 1.0 / (
        base
        ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=None, dtype=torch.float) / dim)
    )
    m.register_buffer("inv_freq", inv_freq, persistent=False)
    m.original_inv_freq = m.inv_freq
    m.attention_scaling = 1.0


def _hf_init_weights_data_normal(m: nn.Module) -> None:
    """``_init_weights``: ``module.weight.data.normal_`` and padding_idx row zeroed."""
    m.embed = nn.Embedding(7, 4, padding_idx=2)
    m.proj = nn.Linear(4, 4)
    m.norm = nn.LayerNorm(4)
    for module in m.modules():
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)


def _hf_position_ids(m: nn.Module) -> None:
    """BERT embeddings: ``torch.arange(n).expand((1, -1))`` and token_type_ids buffers."""
    m.word_embeddings = nn.Embedding(10, 4)
    m.register_buffer("position_ids", torch.arange(6).expand((1, -1)), persistent=False)
    m.register_buffer(
        "token_type_ids", torch.zeros(m.position_ids.size(), dtype=torch.long), persistent=False
    )


def _hf_distilbert_sinusoidal(m: nn.Module) -> None:
    """DistilBERT ``create_sinusoidal_embeddings``: NumPy table written by setitem."""
    n_pos, dim = 6, 8
    m.position_embeddings = nn.Embedding(n_pos, dim)
    out = m.position_embeddings.weight
    position_enc = np.array(
        [[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for pos in range(n_pos)]
    )
    out.requires_grad = False
    out[:, 0::2] = torch.FloatTensor(np.sin(position_enc[:, 0::2]))
    out[:, 1::2] = torch.FloatTensor(np.cos(position_enc[:, 1::2]))
    out.detach_()


def _hf_zeros_then_normal(m: nn.Module) -> None:
    """``nn.Parameter(torch.zeros(...))`` in __init__, ``.normal_`` later in _init_weights."""
    m.mask_token = nn.Parameter(torch.zeros(1, 1, 4))
    m.latents = nn.Parameter(torch.zeros(3, 4))
    m.fc = nn.Linear(4, 4)
    m.mask_token.data.normal_(mean=0.0, std=0.02)
    m.latents.data.normal_()


def _hf_legacy_float_tensor_normal(m: nn.Module) -> None:
    """``nn.Parameter(torch.FloatTensor(n, d).normal_())``: a legacy constructor filled."""
    m.fc = nn.Linear(3, 3)
    m.codevectors = nn.Parameter(torch.FloatTensor(1, 4, 3).normal_())


def _hf_gpt2_scaled_residual(m: nn.Module) -> None:
    """GPT-2: Conv1D ``torch.empty`` + normal_, then c_proj rescaled by n_layer."""
    m.c_attn_weight = nn.Parameter(torch.empty(4, 12))
    m.c_attn_bias = nn.Parameter(torch.zeros(12))
    nn.init.normal_(m.c_attn_weight, std=0.02)
    m.c_proj = nn.Linear(4, 4)
    for name, p in m.named_parameters():
        if name == "c_proj.weight":
            p.data.normal_(mean=0.0, std=(0.02 / math.sqrt(2 * 3)))


def _hf_gpt2_causal_mask(m: nn.Module) -> None:
    """GPT-2 ``bias`` / ``masked_bias`` buffers."""
    n = 5
    m.register_buffer(
        "bias",
        torch.tril(torch.ones((n, n), dtype=torch.bool)).view(1, 1, n, n),
        persistent=False,
    )
    m.register_buffer("masked_bias", torch.tensor(-1e4), persistent=False)
    m.register_buffer(
        "min_mask", torch.full((n, n), torch.finfo(torch.float32).min).triu(1), persistent=False
    )


def _alibi_slopes(n: int) -> list[float]:
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]


def _hf_alibi(m: nn.Module) -> None:
    """ALiBi slopes from a Python list, then times the positions."""
    slopes = torch.tensor(_alibi_slopes(4))
    m.register_buffer("slopes", slopes, persistent=False)
    m.register_buffer("alibi", slopes[:, None] * torch.arange(6)[None, :], persistent=False)


def _hf_tied_before_init(m: nn.Module) -> None:
    """Tie first, then ``_init_weights`` writes the shared weight twice."""
    m.embed = nn.Embedding(9, 4)
    m.lm_head = nn.Linear(4, 9, bias=False)
    m.lm_head.weight = m.embed.weight
    for module in (m.embed, m.lm_head):
        module.weight.data.normal_(mean=0.0, std=0.02)


def _hf_resize_embeddings_mean(m: nn.Module) -> None:
    """``_init_added_embeddings_weights_with_mean``: new rows from MultivariateNormal(mean, cov)
    when ``constraints.positive_definite.check(...).all()``, else the mean."""
    old = nn.Embedding(6, 3)
    new = nn.Embedding(8, 3)
    n, added = old.weight.shape[0], 2
    new.weight.data[:n, :] = old.weight.data[:n, :]
    old_weight = old.weight.data.to(torch.float32)
    mean_embeddings = torch.mean(old_weight, axis=0)
    old_centered = old_weight - mean_embeddings
    covariance = old_centered.T @ old_centered / n
    epsilon = 1e-9
    is_covariance_psd = torch.distributions.constraints.positive_definite.check(
        epsilon * covariance
    ).all()
    if is_covariance_psd:
        distribution = torch.distributions.multivariate_normal.MultivariateNormal(
            mean_embeddings, covariance_matrix=epsilon * covariance
        )
        new.weight.data[-added:, :] = distribution.sample(sample_shape=(added,))
    else:
        new.weight.data[-added:, :] = mean_embeddings[None, :].repeat(added, 1)
    m.embed = new


def _hf_whisper_sinusoids(m: nn.Module) -> None:
    """Whisper ``sinusoids``: ``np.log`` scalar times a tensor, copied in under no_grad."""
    length, channels = 6, 8
    log_timescale_increment = np.log(10000) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length).view(-1, 1) * inv_timescales.view(1, -1)
    m.embed_positions = nn.Embedding(length, channels)
    with torch.no_grad():
        m.embed_positions.weight.copy_(torch.cat([scaled_time.sin(), scaled_time.cos()], dim=1))


def _hf_t5_init(m: nn.Module) -> None:
    """T5: factor * d_model ** -0.5 on q/k/v and a relative attention bias embedding."""
    factor, d_model, heads = 1.0, 8, 2
    m.q = nn.Linear(d_model, d_model, bias=False)
    m.o = nn.Linear(d_model, d_model, bias=False)
    m.relative_attention_bias = nn.Embedding(32, heads)
    m.q.weight.data.normal_(mean=0.0, std=factor * ((d_model * 4) ** -0.5))
    m.o.weight.data.normal_(mean=0.0, std=factor * ((heads * 4) ** -0.5))
    m.relative_attention_bias.weight.data.normal_(mean=0.0, std=factor * ((d_model) ** -0.5))


def _hf_wav2vec_torch_tensor_uniform(m: nn.Module) -> None:
    """Wav2Vec2 ``masked_spec_embed``: ``nn.Parameter(torch.Tensor(n).uniform_())``."""
    m.fc = nn.Linear(4, 4)
    m.masked_spec_embed = nn.Parameter(torch.Tensor(4).uniform_())


TRANSFORMERS = {
    "transformers rotary inv_freq int64 arange": _hf_rotary,
    "transformers _init_weights data.normal_ + padding_idx": _hf_init_weights_data_normal,
    "transformers position_ids arange.expand buffer": _hf_position_ids,
    "transformers distilbert numpy sinusoidal setitem": _hf_distilbert_sinusoidal,
    "transformers zeros then data.normal_": _hf_zeros_then_normal,
    "transformers FloatTensor(n).normal_()": _hf_legacy_float_tensor_normal,
    "transformers gpt2 scaled residual init": _hf_gpt2_scaled_residual,
    "transformers gpt2 causal mask buffers": _hf_gpt2_causal_mask,
    "transformers alibi slopes": _hf_alibi,
    "transformers tie then init twice": _hf_tied_before_init,
    "transformers resize embeddings mean init": _hf_resize_embeddings_mean,
    "transformers whisper sinusoids np.log": _hf_whisper_sinusoids,
    "transformers t5 init": _hf_t5_init,
    "transformers wav2vec Tensor(n).uniform_()": _hf_wav2vec_torch_tensor_uniform,
}


# == diffusers ==============================================================================


def _get_timestep_embedding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    half_dim = dim // 2
    exponent = -math.log(10000) * torch.arange(
        start=0, end=half_dim, dtype=torch.float32, device=timesteps.device
    )
    exponent = exponent / (half_dim - 1)
    emb = torch.exp(exponent)
    emb = timesteps[:, None].float() * emb[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    return torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)  # flip_sin_to_cos


def _diffusers_timestep_table(m: nn.Module) -> None:
    """A buffer from ``get_timestep_embedding`` of ``torch.arange``."""
    m.register_buffer("table", _get_timestep_embedding(torch.arange(5), 8), persistent=False)
    m.linear_1 = nn.Linear(8, 16)


def _diffusers_real_timestep_embedding(m: nn.Module) -> None:
    """diffusers' own ``get_timestep_embedding`` and ``TimestepEmbedding``."""
    from diffusers.models.embeddings import TimestepEmbedding, get_timestep_embedding

    m.register_buffer(
        "table", get_timestep_embedding(torch.arange(4), 8, flip_sin_to_cos=True), persistent=False
    )
    m.time_embedding = TimestepEmbedding(8, 16)


def _zero_module(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        nn.init.zeros_(p)
    return module


def _diffusers_zero_module(m: nn.Module) -> None:
    """ControlNet ``zero_module(nn.Conv2d(...))`` and ``zeros_`` on conv_out."""
    m.conv_in = nn.Conv2d(3, 4, 3)
    m.controlnet_block = _zero_module(nn.Conv2d(4, 4, 1))
    m.conv_out = nn.Conv2d(4, 3, 3)
    torch.nn.init.zeros_(m.conv_out.weight)
    torch.nn.init.zeros_(m.conv_out.bias)


def _diffusers_group_norm(m: nn.Module) -> None:
    """GroupNorm affine init and AdaGroupNorm-style constant_."""
    m.norm = nn.GroupNorm(2, 4, eps=1e-6, affine=True)
    m.norm2 = nn.GroupNorm(2, 4)
    nn.init.constant_(m.norm2.weight, 0.5)
    nn.init.constant_(m.norm2.bias, 0.1)


def _diffusers_sinusoidal_positional(m: nn.Module) -> None:
    """SinusoidalPositionalEmbedding: ``pe[0, :, 0::2] = torch.sin(position * div_term)``."""
    embed_dim, max_seq_length = 8, 5
    position = torch.arange(max_seq_length).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, embed_dim, 2) * (-math.log(10000.0) / embed_dim))
    pe = torch.zeros(1, max_seq_length, embed_dim)
    pe[0, :, 0::2] = torch.sin(position * div_term)
    pe[0, :, 1::2] = torch.cos(position * div_term)
    m.register_buffer("pe", pe)


def _diffusers_patch_embed(m: nn.Module) -> None:
    """diffusers' ``PatchEmbed`` with its sin-cos ``pos_embed`` buffer (torch output)."""
    from diffusers.models.embeddings import PatchEmbed

    m.patch = PatchEmbed(height=4, width=4, patch_size=2, in_channels=3, embed_dim=8)


def _diffusers_pos_embed_numpy(m: nn.Module) -> None:
    """Older diffusers: ``torch.from_numpy(get_2d_sincos_pos_embed(...)).float().unsqueeze(0)``."""
    table = _sincos_1d(8, np.arange(4, dtype=np.float32))
    m.register_buffer("pos_embed", torch.from_numpy(table).float().unsqueeze(0), persistent=False)
    m.proj = nn.Linear(8, 8)


def _diffusers_ada_norm_zero(m: nn.Module) -> None:
    """DiT's adaLN-Zero: ``nn.init.constant_(adaLN_modulation[-1].weight, 0)`` per block."""
    m.blocks = nn.ModuleList(
        nn.Sequential(nn.SiLU(), nn.Linear(4, 24), nn.LayerNorm(4, elementwise_affine=False))
        for _ in range(2)
    )
    for block in m.blocks:
        nn.init.constant_(block[1].weight, 0)
        nn.init.constant_(block[1].bias, 0)
    m.t_embedder = nn.Sequential(nn.Linear(8, 4), nn.SiLU(), nn.Linear(4, 4))
    nn.init.normal_(m.t_embedder[0].weight, std=0.02)
    nn.init.normal_(m.t_embedder[2].weight, std=0.02)


DIFFUSERS = {
    "diffusers get_timestep_embedding inline": _diffusers_timestep_table,
    "diffusers get_timestep_embedding + TimestepEmbedding (library)": (
        _diffusers_real_timestep_embedding
    ),
    "diffusers zero_module / zeros_ conv_out": _diffusers_zero_module,
    "diffusers GroupNorm affine constant_": _diffusers_group_norm,
    "diffusers SinusoidalPositionalEmbedding setitem": _diffusers_sinusoidal_positional,
    "diffusers PatchEmbed (library)": _diffusers_patch_embed,
    "diffusers numpy 2d sincos pos_embed": _diffusers_pos_embed_numpy,
    "diffusers DiT adaLN-Zero": _diffusers_ada_norm_zero,
}


# == PEFT, written inline ===================================================================


def _lora_pair(m: nn.Module, r: int = 2) -> None:
    m.base = nn.Linear(6, 5)
    m.lora_A = nn.Linear(6, r, bias=False)
    m.lora_B = nn.Linear(r, 5, bias=False)


def _peft_gaussian(m: nn.Module) -> None:
    _lora_pair(m)
    nn.init.normal_(m.lora_A.weight, std=1 / 2)
    nn.init.zeros_(m.lora_B.weight)


def _peft_kaiming(m: nn.Module) -> None:
    _lora_pair(m)
    nn.init.kaiming_uniform_(m.lora_A.weight, a=math.sqrt(5))
    nn.init.zeros_(m.lora_B.weight)


def _peft_pissa(m: nn.Module) -> None:
    """PiSSA: SVD of the base weight; the residual assigned back through ``weight.data =``."""
    _lora_pair(m)
    r, scaling = 2, 1.0
    weight = m.base.weight
    V, S, Uh = torch.linalg.svd(weight.data, full_matrices=False)
    Vr, Sr, Uhr = V[:, :r], S[:r], Uh[:r]
    Sr /= scaling
    lora_A = torch.diag(torch.sqrt(Sr)) @ Uhr
    lora_B = Vr @ torch.diag(torch.sqrt(Sr))
    m.lora_A.weight.data = lora_A
    m.lora_B.weight.data = lora_B
    weight = weight.data - scaling * lora_B @ lora_A
    m.base.weight.data = weight.to(torch.float32)


def _peft_olora(m: nn.Module) -> None:
    """OLoRA: QR of the base weight, base reduced in place."""
    _lora_pair(m)
    r, scale = 2, 0.5
    dtype = m.base.weight.dtype
    Q, R = torch.linalg.qr(m.base.weight.data.to(torch.float32))
    Qr, Rr = Q[:, :r], R[:r]
    m.lora_A.weight.data = Rr.contiguous()
    m.lora_B.weight.data = Qr.contiguous()
    weight = m.base.weight.data - scale * (m.lora_B.weight @ m.lora_A.weight)
    m.base.weight.data = weight.to(dtype)


def _peft_dora_magnitude(m: nn.Module) -> None:
    """DoRA: magnitude from ``(W + B @ A * s).norm(p=2, dim=1)``, a new Parameter."""
    _lora_pair(m)
    nn.init.kaiming_uniform_(m.lora_A.weight, a=math.sqrt(5))
    nn.init.normal_(m.lora_B.weight)
    with torch.no_grad():
        weight = m.base.weight + m.lora_B.weight @ m.lora_A.weight * 0.5
        weight_norm = torch.linalg.norm(weight, dim=1).to(weight.dtype)
    m.magnitude = nn.Parameter(weight_norm, requires_grad=True)


def _peft_vera_shared(m: nn.Module) -> None:
    """VeRA: shared frozen projections from a seeded Generator, kaiming_uniform_."""
    g = torch.Generator(device="cpu").manual_seed(0)
    m.register_buffer("vera_A", nn.init.kaiming_uniform_(torch.empty(2, 6), generator=g))
    m.register_buffer("vera_B", nn.init.kaiming_uniform_(torch.empty(5, 2), generator=g))
    m.lambda_d = nn.Parameter(torch.ones(2) * 0.1)
    m.lambda_b = nn.Parameter(torch.zeros(5))


PEFT_INLINE = {
    "peft lora gaussian": _peft_gaussian,
    "peft lora kaiming a=sqrt(5)": _peft_kaiming,
    "peft pissa svd + weight.data =": _peft_pissa,
    "peft olora qr": _peft_olora,
    "peft dora magnitude": _peft_dora_magnitude,
    "peft vera seeded generator buffers": _peft_vera_shared,
}


# == plain torch, and other model code =====================================================


def _torch_weight_norm_then_init(m: nn.Module) -> None:
    """``parametrizations.weight_norm`` then an init of ``original1`` (the direction)."""
    m.fc = nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
    nn.init.normal_(m.fc.parametrizations.weight.original1, std=0.02)


def _torch_orthogonal_parametrization(m: nn.Module) -> None:
    m.fc = nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))


def _torch_deepcopy_clones(m: nn.Module) -> None:
    """DETR ``_get_clones``: deepcopy of a submodule inside the build, then one re-inited."""
    layer = nn.Linear(4, 4)
    m.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(3))
    m.layers[1].reset_parameters()


def _torch_deepcopy_ema(m: nn.Module) -> None:
    """An EMA / teacher copy made by deepcopy, frozen."""
    m.student = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    m.teacher = copy.deepcopy(m.student)
    for p in m.teacher.parameters():
        p.requires_grad_(False)


def _torch_to_bfloat16(m: nn.Module) -> None:
    m.fc = nn.Linear(4, 3)
    m.fc.to(torch.bfloat16)
    m.norm = nn.LayerNorm(3).to(dtype=torch.float16)


def _torch_half_then_float(m: nn.Module) -> None:
    m.fc = nn.Linear(4, 3)
    m.fc.half()
    m.fc.float()


def _torch_manual_seed_per_layer(m: nn.Module) -> None:
    m.layers = nn.ModuleList()
    for i in range(3):
        torch.manual_seed(100 + i)
        m.layers.append(nn.Linear(3, 3))


def _torch_generator_to_inits(m: nn.Module) -> None:
    """``generator=`` passed to nn.init functions (torch >= 2.2)."""
    g = torch.Generator().manual_seed(7)
    m.a = nn.Linear(4, 4)
    nn.init.normal_(m.a.weight, generator=g)
    nn.init.kaiming_uniform_(m.a.bias.view(1, -1), a=math.sqrt(5), generator=g)
    m.b = nn.Parameter(torch.empty(3, 3))
    nn.init.trunc_normal_(m.b, std=0.5, generator=g)
    m.c = nn.Parameter(torch.empty(3, 3))
    nn.init.orthogonal_(m.c, generator=g)


def _torch_embedding_from_pretrained(m: nn.Module) -> None:
    m.emb = nn.Embedding.from_pretrained(torch.randn(6, 3), freeze=True, padding_idx=0)
    m.emb2 = nn.Embedding.from_pretrained(torch.arange(12.0).view(4, 3), freeze=False)


def _torch_mha_bias_kv(m: nn.Module) -> None:
    m.attn = nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True)
    m.attn2 = nn.MultiheadAttention(8, 2, kdim=6, vdim=5, bias=False)


def _torch_lstm_flatten(m: nn.Module) -> None:
    m.lstm = nn.LSTM(4, 6, num_layers=2, proj_size=3)
    m.lstm.flatten_parameters()


def _torch_lstm_forget_bias(m: nn.Module) -> None:
    """The forget-gate bias set to 1 through ``_all_weights`` and ``.data`` slices."""
    m.lstm = nn.LSTM(3, 4, bidirectional=True)
    for names in m.lstm._all_weights:
        for name in filter(lambda n: "bias" in n, names):
            bias = getattr(m.lstm, name)
            n = bias.size(0)
            bias.data[n // 4 : n // 2].fill_(1.0)


def _torch_shape_probe_forward(m: nn.Module) -> None:
    """A dummy forward to size the flatten (CNN code), under a global forward hook."""
    m.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2))
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, inp, out: seen.append(type(mod))
    )
    try:
        with torch.no_grad():
            n = m.features(torch.zeros(1, 3, 8, 8)).flatten(1).shape[1]
    finally:
        handle.remove()
    m.fc = nn.Linear(n, 2)


def _torch_state_dict_copy(m: nn.Module) -> None:
    """A twin initialised from the other's ``state_dict()`` (target nets, EMA)."""
    m.online = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    m.target = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    m.target.load_state_dict(m.online.state_dict())


def _torch_state_dict_read(m: nn.Module) -> None:
    """``state_dict()`` read inside the build, a value computed from it."""
    m.fc = nn.Linear(4, 4)
    sd = m.fc.state_dict()
    m.register_buffer("norm", sd["weight"].norm(dim=1))
    m.fc2 = nn.Linear(4, 4)


def _torch_vector_to_parameters(m: nn.Module) -> None:
    """``vector_to_parameters``: each parameter's ``.data`` becomes a view of one vector."""
    m.fc = nn.Linear(3, 2)
    vec = torch.randn(8)
    nn.utils.vector_to_parameters(vec, m.fc.parameters())


def _torch_parameters_to_vector(m: nn.Module) -> None:
    m.fc = nn.Linear(3, 2)
    m.register_buffer("flat", nn.utils.parameters_to_vector(m.fc.parameters()).detach())


def _torch_default_dtype_inside(m: nn.Module) -> None:
    """A layer built under another default dtype, set and restored inside the build."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        m.fc64 = nn.Linear(3, 3)
    finally:
        torch.set_default_dtype(old)
    m.fc = nn.Linear(3, 3)


def _torch_fuse_conv_bn(m: nn.Module) -> None:
    """``fuse_conv_bn_eval`` inside the build (deploy-time reparametrisation)."""
    conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    nn.init.uniform_(bn.running_var, 0.5, 1.5)
    nn.init.normal_(bn.running_mean)
    bn.eval()
    m.fused = nn.utils.fusion.fuse_conv_bn_eval(conv.eval(), bn)


def _torch_prune_l1(m: nn.Module) -> None:
    m.fc = nn.Linear(4, 4)
    nn.utils.prune.l1_unstructured(m.fc, "weight", amount=0.5)


def _torch_prune_random(m: nn.Module) -> None:
    m.fc = nn.Linear(4, 4)
    nn.utils.prune.random_unstructured(m.fc, "weight", amount=0.5)


def _torch_new_factories(m: nn.Module) -> None:
    """``weight.new_zeros`` / ``new_full`` / ``new_empty().normal_()`` / ``zeros_like``."""
    m.fc = nn.Linear(4, 3, bias=False)
    m.bias = nn.Parameter(m.fc.weight.new_zeros(3))
    m.scale = nn.Parameter(m.fc.weight.new_full((3,), 0.5))
    m.noise = nn.Parameter(m.fc.weight.new_empty(3, 4).normal_())
    m.register_buffer("ema", torch.zeros_like(m.fc.weight))


def _torch_legacy_tensor_reset(m: nn.Module) -> None:
    """Old-style layer: ``nn.Parameter(torch.Tensor(out, in))`` then ``reset_parameters``."""
    m.weight = nn.Parameter(torch.Tensor(3, 4))
    m.bias = nn.Parameter(torch.Tensor(3))
    nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5))
    bound = 1 / math.sqrt(4)
    nn.init.uniform_(m.bias, -bound, bound)


def _torch_legacy_tensor_list_buffer(m: nn.Module) -> None:
    """VQ codebooks: ``register_buffer("initted", torch.Tensor([not kmeans_init]))``."""
    embed = torch.randn(5, 3)
    m.register_buffer("initted", torch.Tensor([True]))
    m.register_buffer("cluster_size", torch.zeros(5))
    m.register_buffer("embed", embed)
    m.register_buffer("embed_avg", embed.clone())


def _torch_vq_codebook(m: nn.Module) -> None:
    """VQ-VAE: uniform_(-1/K, 1/K) and an l2-normalised codebook."""
    m.codebook = nn.Embedding(6, 3)
    m.codebook.weight.data.uniform_(-1 / 6, 1 / 6)
    m.register_buffer("normed", F.normalize(torch.randn(6, 3), dim=-1))


def _torch_sparse_init(m: nn.Module) -> None:
    m.fc = nn.Linear(5, 4)
    nn.init.sparse_(m.fc.weight, sparsity=0.5, std=0.01)


def _torch_dirac_eye(m: nn.Module) -> None:
    m.conv = nn.Conv2d(3, 3, 3)
    nn.init.dirac_(m.conv.weight)
    m.fc = nn.Linear(4, 4)
    nn.init.eye_(m.fc.weight)


def _torch_fno_complex(m: nn.Module) -> None:
    """FNO SpectralConv: ``scale * torch.rand(..., dtype=torch.cfloat)``."""
    scale = 1 / (3 * 3)
    m.weights1 = nn.Parameter(scale * torch.rand(3, 3, 2, 2, dtype=torch.cfloat))


def _torch_view_as_real_param(m: nn.Module) -> None:
    """A complex init kept as a real parameter through ``view_as_real``."""
    m.w = nn.Parameter(torch.view_as_real(torch.randn(3, 2, dtype=torch.cfloat)))


def _torch_random_orthogonal_qr(m: nn.Module) -> None:
    """Random rotations: ``torch.linalg.qr(torch.randn(n, n))[0]`` and matrix_exp of a skew."""
    q, _ = torch.linalg.qr(torch.randn(4, 4))
    m.register_buffer("rotation", q)
    a = torch.randn(3, 3)
    m.cayley = nn.Parameter(torch.linalg.matrix_exp(a - a.T))


def _torch_mamba_dt_init(m: nn.Module) -> None:
    """Mamba: A_log from arange.repeat, dt bias from rand/exp/expm1, copied under no_grad."""
    d_inner, d_state = 4, 3
    a = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1).contiguous()
    m.A_log = nn.Parameter(torch.log(a))
    m.D = nn.Parameter(torch.ones(d_inner))
    m.dt_proj = nn.Linear(2, d_inner)
    dt = torch.exp(torch.rand(d_inner) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(
        min=1e-4
    )
    inv_dt = dt + torch.log(-torch.expm1(-dt))
    with torch.no_grad():
        m.dt_proj.bias.copy_(inv_dt)


def _torch_parameter_attributes(m: nn.Module) -> None:
    """Flags set on Parameter objects (Mamba ``_no_weight_decay``, Megatron-style attributes)."""
    m.A_log = nn.Parameter(torch.randn(3))
    m.A_log._no_weight_decay = True
    m.fc = nn.Linear(3, 3)
    m.fc.bias._no_reinit = True
    m.register_buffer("buf", torch.randn(2))
    m.buf.tag = "kept"


def _torch_more_layers(m: nn.Module) -> None:
    m.deconv = nn.ConvTranspose2d(4, 6, 3, groups=2)
    m.bag = nn.EmbeddingBag(7, 3, mode="sum", padding_idx=0)
    m.bilinear = nn.Bilinear(3, 4, 2)
    m.prelu = nn.PReLU(3, init=0.1)
    m.inorm = nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
    m.adaptive = nn.AdaptiveLogSoftmaxWithLoss(8, 10, cutoffs=[4, 8], div_value=2.0)


def _torch_half_precision_layers(m: nn.Module) -> None:
    m.fc = nn.Linear(4, 3, dtype=torch.bfloat16)
    nn.init.trunc_normal_(m.fc.weight, std=0.02)
    m.emb = nn.Embedding(5, 3, dtype=torch.float16)


def _torch_shared_module(m: nn.Module) -> None:
    """BART: one ``shared`` embedding registered as encoder and decoder embed_tokens."""
    m.shared = nn.Embedding(7, 4, padding_idx=1)
    m.encoder = nn.Module()
    m.decoder = nn.Module()
    m.encoder.embed_tokens = m.shared
    m.decoder.embed_tokens = m.shared


def _torch_block_diag_kron(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.block_diag(torch.randn(2, 2), torch.eye(2)))
    m.register_buffer("k", torch.kron(torch.eye(2), torch.randn(2, 2)))


def _torch_numpy_rng(m: nn.Module) -> None:
    """A local NumPy RandomState, values copied with ``torch.tensor(..., dtype=)``."""
    rng = np.random.RandomState(0)
    m.w = nn.Parameter(torch.tensor(rng.standard_normal((3, 4)), dtype=torch.float32))
    m.fc = nn.Linear(3, 3)


def _torch_share_memory(m: nn.Module) -> None:
    """``share_memory_()`` inside the build (hogwild-style workers)."""
    m.fc = nn.Linear(4, 4)
    m.fc.share_memory()
    m.fc2 = nn.Linear(4, 4)


def _torch_spectral_norm_init(m: nn.Module) -> None:
    """``parametrizations.spectral_norm`` on a conv after its init."""
    conv = nn.Conv2d(3, 4, 3)
    nn.init.xavier_uniform_(conv.weight)
    m.conv = nn.utils.parametrizations.spectral_norm(conv)


def _torch_register_parametrization_scale(m: nn.Module) -> None:
    """A user parametrisation with a ``right_inverse`` (stores ``weight / 2``)."""

    class Double(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
            return x / 2

    m.fc = nn.Linear(3, 3)
    nn.utils.parametrize.register_parametrization(m.fc, "weight", Double())


def _torch_transformer_encoder(m: nn.Module) -> None:
    """``nn.TransformerEncoder(nn.TransformerEncoderLayer(...), n)``: clones of a template."""
    m.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 2)


def _torch_apply_xavier_dim_gt_1(m: nn.Module) -> None:
    """``for p in self.parameters(): if p.dim() > 1: nn.init.xavier_uniform_(p)``."""
    m.embed = nn.Embedding(5, 4)
    m.fc = nn.Linear(4, 4)
    m.norm = nn.LayerNorm(4)
    for p in m.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)


def _torch_requires_grad_false_buffer_like_param(m: nn.Module) -> None:
    """A frozen Parameter used as a constant, written by ``fill_`` under no_grad."""
    m.temperature = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))
    m.logit_bias = nn.Parameter(torch.zeros([]), requires_grad=False)
    with torch.no_grad():
        m.logit_bias.fill_(-10.0)


@torch.no_grad()
def _decorated_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        module.bias.zero_()


@torch.jit.ignore
def _jit_ignored_table(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32).unsqueeze(0).repeat(2, 1) / n


def _torch_decorated_helpers(m: nn.Module) -> None:
    """``@torch.no_grad()``-decorated init (torchtitan, timm) and a ``@torch.jit.ignore`` helper."""
    m.fc = nn.Linear(4, 4)
    m.fc2 = nn.Linear(4, 2)
    m.apply(_decorated_init)
    m.register_buffer("table", _jit_ignored_table(3), persistent=False)


def _torch_explicit_cpu_device(m: nn.Module) -> None:
    """``factory_kwargs = {"device": device, "dtype": dtype}`` with device="cpu" passed through."""
    factory_kwargs = {"device": torch.device("cpu"), "dtype": torch.float32}
    m.fc = nn.Linear(3, 3, **factory_kwargs)
    m.w = nn.Parameter(torch.empty(3, 2, **factory_kwargs))
    nn.init.normal_(m.w)
    m.register_buffer("mask", torch.ones(3, **factory_kwargs))


def _torch_dcgan_weights_init(m: nn.Module) -> None:
    """DCGAN ``weights_init``: nn.init on ``m.weight.data``, chosen by class name."""
    m.conv = nn.ConvTranspose2d(4, 3, 4, 2, 1, bias=False)
    m.bn = nn.BatchNorm2d(3)
    m.act = nn.LeakyReLU(0.2)
    for module in m.modules():
        classname = module.__class__.__name__
        if classname.find("Conv") != -1:
            nn.init.normal_(module.weight.data, 0.0, 0.02)
        elif classname.find("BatchNorm") != -1:
            nn.init.normal_(module.weight.data, 1.0, 0.02)
            nn.init.constant_(module.bias.data, 0)
    m.out = nn.Linear(3, 3)
    nn.init.xavier_normal_(m.out.weight, gain=nn.init.calculate_gain("leaky_relu", 0.2))


def _torch_yolo_detect_bias(m: nn.Module) -> None:
    """YOLOv5 ``_initialize_biases``: ``.data`` of a view written, rewrapped as a new Parameter."""
    na, nc, stride = 3, 2, 8.0
    m.m = nn.ModuleList(nn.Conv2d(4, na * (nc + 5), 1) for _ in range(2))
    for mi in m.m:
        b = mi.bias.view(na, -1)
        b.data[:, 4] += math.log(8 / (640 / stride) ** 2)
        b.data[:, 5 : 5 + nc] += math.log(0.6 / (nc - 0.99))
        mi.bias = torch.nn.Parameter(b.view(-1), requires_grad=True)


def _torch_retinanet_prior(m: nn.Module) -> None:
    """RetinaNet: normal_(std=0.01) convs and a prior-probability bias."""
    m.cls_logits = nn.Conv2d(4, 6, 3, padding=1)
    nn.init.normal_(m.cls_logits.weight, std=0.01)
    nn.init.constant_(m.cls_logits.bias, -math.log((1 - 0.01) / 0.01))


def _timm_blur_pool_filter(m: nn.Module) -> None:
    """timm BlurPool2d: ``torch.tensor(np.poly1d(...).coeffs)`` outer product, repeated."""
    coeffs = torch.tensor((np.poly1d((0.5, 0.5)) ** 2).coeffs.astype(np.float32))
    blur = (coeffs[:, None] * coeffs[None, :])[None, None, :, :].repeat(3, 1, 1, 1)
    m.register_buffer("filt", blur, persistent=False)
    m.conv = nn.Conv2d(3, 3, 1)


def _timm_swin_attn_mask(m: nn.Module) -> None:
    """Swin's shifted-window attention mask: Python-loop slice writes, masked_fill."""
    h = w = 4
    window, shift = 2, 1
    img_mask = torch.zeros((1, h, w, 1))
    cnt = 0
    for hs in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
        for ws in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
            img_mask[:, hs, ws, :] = cnt
            cnt += 1
    windows = img_mask.view(1, h // window, window, w // window, window, 1)
    windows = windows.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window * window)
    attn_mask = windows.unsqueeze(1) - windows.unsqueeze(2)
    attn_mask = attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(attn_mask == 0, 0.0)
    m.register_buffer("attn_mask", attn_mask, persistent=False)
    m.proj = nn.Linear(4, 4)


def _timm_resample_pos_embed(m: nn.Module) -> None:
    """timm ``resample_abs_pos_embed``: a pos_embed interpolated (bicubic) to a new grid."""
    old = torch.randn(1, 4, 8) * 0.02
    grid = old.reshape(1, 2, 2, 8).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(3, 3), mode="bicubic", antialias=True, align_corners=False)
    m.pos_embed = nn.Parameter(grid.permute(0, 2, 3, 1).reshape(1, 9, 8))


def _hf_vit_trunc_normal_data_assign(m: nn.Module) -> None:
    """HF ViT ``_init_weights``: ``w.data = trunc_normal_(w.data.to(float32)).to(dtype)``."""
    m.fc = nn.Linear(4, 4, dtype=torch.bfloat16)
    m.fc.weight.data = nn.init.trunc_normal_(
        m.fc.weight.data.to(torch.float32), mean=0.0, std=0.02
    ).to(m.fc.weight.dtype)
    m.fc.bias.data.zero_()
    m.position_embeddings = nn.Parameter(torch.zeros(1, 3, 4))
    m.position_embeddings.data = nn.init.trunc_normal_(
        m.position_embeddings.data.to(torch.float32), mean=0.0, std=0.02
    ).to(m.position_embeddings.dtype)


def _rwkv_time_mix(m: nn.Module) -> None:
    """RWKV: per-element Python loops into ``torch.ones``, then pow / zigzag parameters."""
    dim, layer_id, n_layer = 6, 1, 3
    ratio_0_to_1 = layer_id / (n_layer - 1)
    ratio_1_to_almost0 = 1.0 - (layer_id / n_layer)
    ddd = torch.ones(1, 1, dim)
    for i in range(dim):
        ddd[0, 0, i] = i / dim
    m.time_maa_k = nn.Parameter(1.0 - torch.pow(ddd, ratio_1_to_almost0))
    decay_speed = torch.ones(dim)
    for n in range(dim):
        decay_speed[n] = -6 + 5 * (n / (dim - 1)) ** (0.7 + 1.3 * ratio_0_to_1)
    m.time_decay = nn.Parameter(decay_speed.reshape(1, 1, dim))
    zigzag = torch.tensor([(i + 1) % 3 - 1 for i in range(dim)]) * 0.5
    m.time_first = nn.Parameter(torch.ones(dim) * math.log(0.3) + zigzag)


def _glow_actnorm_data_init(m: nn.Module) -> None:
    """Glow ActNorm: data-dependent init from a random batch, ``.data.copy_`` of mean/std."""
    m.loc = nn.Parameter(torch.zeros(1, 3, 1, 1))
    m.scale = nn.Parameter(torch.ones(1, 3, 1, 1))
    x = torch.randn(4, 3, 2, 2)
    with torch.no_grad():
        flatten = x.permute(1, 0, 2, 3).contiguous().view(3, -1)
        mean = flatten.mean(1).unsqueeze(1).unsqueeze(2).unsqueeze(3).permute(1, 0, 2, 3)
        std = flatten.std(1).unsqueeze(1).unsqueeze(2).unsqueeze(3).permute(1, 0, 2, 3)
        m.loc.data.copy_(-mean)
        m.scale.data.copy_(1 / (std + 1e-6))


def _bn_stats_from_a_warmup_forward(m: nn.Module) -> None:
    """A warm-up forward in train mode on a random batch sets BatchNorm's running stats."""
    m.net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        m.net(torch.randn(8, 3))


def _torch_shape_probe_through_batchnorm(m: nn.Module) -> None:
    """The flatten size probed through Conv + BatchNorm in train mode (the default): eager's
    probe moves the running stats."""
    m.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    n = m.features(torch.zeros(2, 3, 5, 5)).flatten(1).shape[1]
    m.fc = nn.Linear(n, 2)


def _torch_instance_norm_running_stats(m: nn.Module) -> None:
    """``F.instance_norm`` with running stats in train mode, on a deterministic batch."""
    m.norm = nn.InstanceNorm1d(3, track_running_stats=True)
    m.norm(torch.arange(24.0).view(2, 3, 4))


def _torch_foreach_scaling(m: nn.Module) -> None:
    """``torch._foreach_mul_`` / ``_foreach_add_`` over the parameters (fused-optimizer style)."""
    m.a = nn.Linear(3, 3)
    m.b = nn.Linear(3, 3)
    with torch.no_grad():
        params = [m.a.weight, m.b.weight]
        torch._foreach_mul_(params, 0.5)
        torch._foreach_add_([m.a.bias, m.b.bias], [m.a.bias, m.b.bias], alpha=2.0)


def _torch_out_variants(m: nn.Module) -> None:
    """Factories and draws with ``out=`` into a registered tensor."""
    m.w = nn.Parameter(torch.empty(3, 4))
    torch.randn(3, 4, out=m.w.data)
    m.register_buffer("steps", torch.empty(5))
    torch.linspace(0, 1, 5, out=m.steps)
    m.v = nn.Parameter(torch.empty(4))
    torch.normal(0.0, 2.0, size=(4,), out=m.v.data)


def _torch_stack_module_state(m: nn.Module) -> None:
    """An ensemble for vmap: ``torch.func.stack_module_state`` of freshly built members."""
    members = [nn.Linear(3, 2) for _ in range(3)]
    params, _ = torch.func.stack_module_state(members)
    m.weight = nn.Parameter(params["weight"])
    m.bias = nn.Parameter(params["bias"])


def _timm_freeze_batch_norm(m: nn.Module) -> None:
    """timm ``freeze_batch_norm_2d``: a FrozenBatchNorm2d's buffers take the BN's ``.data``."""

    class FrozenBatchNorm2d(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.register_buffer("weight", torch.ones(n))
            self.register_buffer("bias", torch.zeros(n))
            self.register_buffer("running_mean", torch.zeros(n))
            self.register_buffer("running_var", torch.ones(n))

    bn = nn.BatchNorm2d(3)
    nn.init.normal_(bn.weight)
    res = FrozenBatchNorm2d(3)
    res.weight.data = bn.weight.data.clone().detach()
    res.bias.data = bn.bias.data.clone().detach()
    res.running_mean.data = bn.running_mean.data
    res.running_var.data = bn.running_var.data
    m.bn = res


def _torch_dedupe_by_data_ptr(m: nn.Module) -> None:
    """Tie two heads only if they already share memory, compared by ``data_ptr()``."""
    m.embed = nn.Embedding(5, 3)
    m.head = nn.Linear(3, 5, bias=False)
    if m.head.weight.data_ptr() == m.embed.weight.data_ptr():
        m.head.weight = m.embed.weight


def _torch_branch_on_device_type(m: nn.Module) -> None:
    """A CPU-only init path chosen by ``weight.device.type == "cpu"``."""
    m.fc = nn.Linear(3, 3)
    if m.fc.weight.device.type == "cpu":
        nn.init.ones_(m.fc.bias)


def _torch_branch_on_is_cpu(m: nn.Module) -> None:
    m.fc = nn.Linear(3, 3)
    if m.fc.weight.is_cpu:
        with torch.no_grad():
            m.fc.weight.mul_(2.0)


def _lsuv_one_step(m: nn.Module) -> None:
    """LSUV-style data-dependent rescale: ``w.data /= layer(noise).std()``."""
    m.fc = nn.Linear(4, 4)
    with torch.no_grad():
        m.fc.weight.data /= m.fc(torch.randn(16, 4)).std()


def _performer_orthogonal_features(m: nn.Module) -> None:
    """Performer ``gaussian_orthogonal_random_matrix``: QR blocks scaled by row norms."""
    nb_rows, nb_columns = 6, 4
    blocks = []
    for _ in range(nb_rows // nb_columns):
        q, _ = torch.linalg.qr(torch.randn((nb_columns, nb_columns)), mode="reduced")
        blocks.append(q.t())
    remaining = nb_rows - (nb_rows // nb_columns) * nb_columns
    if remaining > 0:
        q, _ = torch.linalg.qr(torch.randn((nb_columns, nb_columns)), mode="reduced")
        blocks.append(q.t()[:remaining])
    final = torch.cat(blocks)
    multiplier = torch.randn((nb_rows, nb_columns)).norm(dim=1)
    m.register_buffer("projection_matrix", torch.diag(multiplier) @ final)
    m.to_q = nn.Linear(4, 4)


def _numpy_randn_from_numpy_float(m: nn.Module) -> None:
    """Research code: ``nn.Parameter(torch.from_numpy(rng.randn(...)).float())``."""
    rng = np.random.RandomState(1)
    m.fc = nn.Linear(3, 3)
    m.w = nn.Parameter(torch.from_numpy(rng.randn(3, 4)).float())


def _torch_tensor_of_a_parameter(m: nn.Module) -> None:
    """``torch.tensor(param)`` (a copy, with torch's warning) as a buffer."""
    m.fc = nn.Linear(3, 3)
    m.register_buffer("snapshot", torch.tensor(m.fc.weight))


def _torch_unfold_buffer(m: nn.Module) -> None:
    """An overlapping-window view (``unfold``) of a temporary, registered as a buffer."""
    m.register_buffer("windows", torch.arange(8.0).unfold(0, 3, 1))
    m.fc = nn.Linear(3, 3)


def _torch_partial_view_param_unwritten(m: nn.Module) -> None:
    """``nn.Parameter(torch.randn(3, 4)[:, :2])``: part of a temporary, never written."""
    m.w = nn.Parameter(torch.randn(3, 4)[:, :2])
    m.fc = nn.Linear(2, 2)


def _torch_quantized_buffer(m: nn.Module) -> None:
    m.register_buffer("q", torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8))
    m.fc = nn.Linear(2, 2)


def _torchtitan_float8_cast(m: nn.Module) -> None:
    """A float8 weight and its float32 scale (torchao / torchtitan float8 style)."""
    w = torch.randn(4, 4)
    scale = w.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
    m.register_buffer("scale", scale.float())
    m.register_buffer("w8", (w / scale).to(torch.float8_e4m3fn))
    m.fc = nn.Linear(2, 2)


def _torch_none_buffer_assigned(m: nn.Module) -> None:
    """``register_buffer("mask", None)`` then ``self.mask = ...`` (goes to ``_buffers``)."""
    m.register_buffer("mask", None)
    m.fc = nn.Linear(3, 3)
    m.mask = torch.tril(torch.ones(3, 3))
    m.register_parameter("extra", None)
    m.extra = nn.Parameter(torch.randn(3))


def _torch_parameter_list_dict(m: nn.Module) -> None:
    m.plist = nn.ParameterList([nn.Parameter(torch.randn(2)) for _ in range(3)])
    m.plist.append(nn.Parameter(torch.zeros(2)))
    m.pdict = nn.ParameterDict(
        {"a": nn.Parameter(torch.randn(3)), "b": nn.Parameter(torch.ones(1))}
    )
    m.pdict["c"] = nn.Parameter(torch.randn(2, 2))


def _torch_to_cpu_inside(m: nn.Module) -> None:
    """``SubModule(...).to(device)`` inside a constructor, device being CPU."""
    m.rotary = nn.Linear(3, 3).to("cpu")
    m.fc = nn.Linear(3, 3).to(torch.device("cpu"), torch.float32)


def _diffusers_gaussian_fourier(m: nn.Module) -> None:
    """diffusers' ``GaussianFourierProjection``: ``del self.weight``, re-registered via ``W``."""
    from diffusers.models.embeddings import GaussianFourierProjection

    m.proj = GaussianFourierProjection(embedding_size=8, scale=16.0)
    m.fc = nn.Linear(16, 4)


def _diffusers_rotary_pos_embed(m: nn.Module) -> None:
    """diffusers' ``get_1d_rotary_pos_embed``, real (cos/sin, repeat_interleave) and complex."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    cos, sin = get_1d_rotary_pos_embed(8, 5, use_real=True)
    m.register_buffer("cos", cos, persistent=False)
    m.register_buffer("sin", sin, persistent=False)
    m.register_buffer("cis", get_1d_rotary_pos_embed(8, 5, use_real=False), persistent=False)
    m.fc = nn.Linear(8, 8)


def _timm_trunc_normal_tf(m: nn.Module) -> None:
    """timm ``trunc_normal_tf_``: uniform_, erfinv_, mul_, add_, clamp_ under no_grad."""
    m.fc = nn.Linear(5, 4)
    mean, std, a, b = 0.0, 0.02, -2.0, 2.0
    tensor = m.fc.weight

    def norm_cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    with torch.no_grad():
        lower, upper = norm_cdf(a), norm_cdf(b)
        tensor.uniform_(2 * lower - 1, 2 * upper - 1)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.0))
        tensor.add_(mean)
        tensor.clamp_(min=a, max=b)


def _timm_hybrid_embed_probe(m: nn.Module) -> None:
    """timm ``HybridEmbed``: the backbone's feature size probed in eval mode, mode restored."""
    m.backbone = nn.Sequential(nn.Conv2d(3, 4, 3, 2), nn.BatchNorm2d(4), nn.ReLU())
    with torch.no_grad():
        training = m.backbone.training
        if training:
            m.backbone.eval()
        o = m.backbone(torch.zeros(1, 3, 7, 7))
        feature_size = o.shape[-2:]
        feature_dim = o.shape[1]
        m.backbone.train(training)
    m.proj = nn.Conv2d(feature_dim, 8, 1)
    m.register_buffer("grid", torch.tensor(list(feature_size)), persistent=False)


def _hf_wav2vec_pos_conv(m: nn.Module) -> None:
    """Wav2Vec2 positional conv: weight_norm(dim=2), then ``_init_weights`` draws into the
    computed weight (a no-op on the parameters that still moves the stream)."""
    conv = nn.Conv1d(4, 4, kernel_size=3, padding=1, groups=2)
    m.conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)
    k = m.conv.kernel_size[0] * m.conv.in_channels
    nn.init.normal_(m.conv.weight, mean=0, std=2 * math.sqrt(1 / k))
    nn.init.constant_(m.conv.bias, 0)
    m.after = nn.Linear(4, 4)


def _torch_zero_size(m: nn.Module) -> None:
    """Zero-size layers and placeholder buffers (``nn.Linear(0, 3)`` still draws its bias)."""
    m.empty_in = nn.Linear(0, 3)
    m.empty_out = nn.Linear(3, 0)
    m.register_buffer("placeholder", torch.empty(0))
    m.after = nn.Linear(3, 3)


def _torch_odd_dtypes_and_flags(m: nn.Module) -> None:
    """float64 and complex64 Linear layers, an integer Parameter, a buffer that requires grad."""
    m.f64 = nn.Linear(3, 3, dtype=torch.float64)
    m.c64 = nn.Linear(3, 3, dtype=torch.complex64)
    m.idx = nn.Parameter(torch.arange(4), requires_grad=False)
    m.register_buffer("tracked", torch.randn(3, requires_grad=True))


warm_pickling()  # before the global-state guard's snapshot


def _torch_pickle_round_trip(m: nn.Module) -> None:
    """A module cloned by ``torch.save`` / ``torch.load`` through memory."""
    import io

    layer = nn.Linear(3, 3)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    m.a = layer
    m.b = torch.load(buffer, weights_only=False)


def _torch_load_state_dict_assign(m: nn.Module) -> None:
    """``target.load_state_dict(online.state_dict(), assign=True)`` inside the build."""
    m.online = nn.Linear(4, 4)
    m.target = nn.Linear(4, 4)
    m.target.load_state_dict(
        {k: v.detach().clone() for k, v in m.online.state_dict().items()}, assign=True
    )


def _torch_copy_params_by_zip(m: nn.Module) -> None:
    """A target network synced by ``for p, q in zip(...): q.data.copy_(p.data)`` (DQN, BYOL)."""
    m.online = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m.target = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for p, q in zip(m.online.parameters(), m.target.parameters(), strict=True):
        q.data.copy_(p.data)
        q.requires_grad = False


def _numpy_qr_round_trip(m: nn.Module) -> None:
    """An orthogonal init computed in NumPy from a torch draw: ``.numpy()`` and back."""
    m.fc = nn.Linear(4, 4)
    q, _ = np.linalg.qr(torch.randn(4, 4).numpy())
    with torch.no_grad():
        m.fc.weight.copy_(torch.from_numpy(q))


TORCH = {
    "torch weight_norm then init original1": _torch_weight_norm_then_init,
    "torch parametrizations.orthogonal": _torch_orthogonal_parametrization,
    "torch deepcopy clones then reset one": _torch_deepcopy_clones,
    "torch deepcopy EMA teacher": _torch_deepcopy_ema,
    "torch module.to(bfloat16) inside": _torch_to_bfloat16,
    "torch half() then float() inside": _torch_half_then_float,
    "torch manual_seed per layer": _torch_manual_seed_per_layer,
    "torch generator= to nn.init": _torch_generator_to_inits,
    "torch Embedding.from_pretrained": _torch_embedding_from_pretrained,
    "torch MultiheadAttention bias_kv / kdim": _torch_mha_bias_kv,
    "torch LSTM proj_size flatten_parameters": _torch_lstm_flatten,
    "torch LSTM forget-gate bias slices": _torch_lstm_forget_bias,
    "torch shape-probe forward under a global hook": _torch_shape_probe_forward,
    "torch load_state_dict(other.state_dict())": _torch_state_dict_copy,
    "torch state_dict read inside": _torch_state_dict_read,
    "torch vector_to_parameters": _torch_vector_to_parameters,
    "torch parameters_to_vector buffer": _torch_parameters_to_vector,
    "torch set_default_dtype inside": _torch_default_dtype_inside,
    "torch fuse_conv_bn_eval": _torch_fuse_conv_bn,
    "torch prune.l1_unstructured": _torch_prune_l1,
    "torch prune.random_unstructured": _torch_prune_random,
    "torch new_zeros/new_full/new_empty/zeros_like": _torch_new_factories,
    "torch Parameter(torch.Tensor(o, i)) + reset": _torch_legacy_tensor_reset,
    "torch Tensor([bool]) buffer": _torch_legacy_tensor_list_buffer,
    "torch VQ codebook uniform_/normalize": _torch_vq_codebook,
    "torch nn.init.sparse_": _torch_sparse_init,
    "torch dirac_/eye_": _torch_dirac_eye,
    "torch FNO complex rand": _torch_fno_complex,
    "torch Parameter(view_as_real(complex))": _torch_view_as_real_param,
    "torch random rotation qr/matrix_exp": _torch_random_orthogonal_qr,
    "torch mamba dt/A_log init": _torch_mamba_dt_init,
    "torch attributes on Parameter objects": _torch_parameter_attributes,
    "torch more layers": _torch_more_layers,
    "torch bf16/fp16 layers": _torch_half_precision_layers,
    "torch shared module registered twice": _torch_shared_module,
    "torch block_diag/kron": _torch_block_diag_kron,
    "torch numpy RandomState values": _torch_numpy_rng,
    "torch share_memory() inside": _torch_share_memory,
    "torch spectral_norm after init": _torch_spectral_norm_init,
    "torch register_parametrization right_inverse": _torch_register_parametrization_scale,
    "torch TransformerEncoder of a template layer": _torch_transformer_encoder,
    "torch xavier_uniform_ on p.dim() > 1": _torch_apply_xavier_dim_gt_1,
    "torch CLIP logit_scale / frozen scalar": _torch_requires_grad_false_buffer_like_param,
    "torch @no_grad-decorated init, @jit.ignore helper": _torch_decorated_helpers,
    "torch explicit device='cpu' factory kwargs": _torch_explicit_cpu_device,
    "torch DCGAN weights_init on .data": _torch_dcgan_weights_init,
    "torch YOLOv5 detect bias via view.data": _torch_yolo_detect_bias,
    "torch RetinaNet prior bias": _torch_retinanet_prior,
    "timm BlurPool numpy poly1d filter": _timm_blur_pool_filter,
    "timm swin shifted-window attn_mask": _timm_swin_attn_mask,
    "timm resample_abs_pos_embed bicubic": _timm_resample_pos_embed,
    "transformers ViT w.data = trunc_normal_(fp32).to(dtype)": _hf_vit_trunc_normal_data_assign,
    "RWKV per-element loops": _rwkv_time_mix,
    "Glow ActNorm data-dependent init": _glow_actnorm_data_init,
    "torch BatchNorm stats from a warm-up forward": _bn_stats_from_a_warmup_forward,
    "torch shape probe through BatchNorm in train mode": _torch_shape_probe_through_batchnorm,
    "torch InstanceNorm running stats forward": _torch_instance_norm_running_stats,
    "torch _foreach_mul_/_foreach_add_": _torch_foreach_scaling,
    "torch randn/linspace/normal out=": _torch_out_variants,
    "torch.func.stack_module_state ensemble": _torch_stack_module_state,
    "timm freeze_batch_norm_2d .data assignments": _timm_freeze_batch_norm,
    "torch tie if data_ptr() equal": _torch_dedupe_by_data_ptr,
    "torch branch on device.type == 'cpu'": _torch_branch_on_device_type,
    "torch branch on is_cpu": _torch_branch_on_is_cpu,
    "LSUV one-step rescale by a forward's std": _lsuv_one_step,
    "Performer orthogonal random features": _performer_orthogonal_features,
    "numpy RandomState from_numpy().float()": _numpy_randn_from_numpy_float,
    "torch.tensor(param) copy": _torch_tensor_of_a_parameter,
    "torch unfold view buffer": _torch_unfold_buffer,
    "torch Parameter(randn(3, 4)[:, :2]) unwritten": _torch_partial_view_param_unwritten,
    "torch quantize_per_tensor buffer": _torch_quantized_buffer,
    "torchtitan float8_e4m3fn cast": _torchtitan_float8_cast,
    "torch None buffer/parameter then assigned": _torch_none_buffer_assigned,
    "torch ParameterList / ParameterDict": _torch_parameter_list_dict,
    "torch .to('cpu') inside": _torch_to_cpu_inside,
    "diffusers GaussianFourierProjection del/re-register (library)": _diffusers_gaussian_fourier,
    "diffusers get_1d_rotary_pos_embed (library)": _diffusers_rotary_pos_embed,
    "timm trunc_normal_tf_ erfinv_": _timm_trunc_normal_tf,
    "timm HybridEmbed eval-mode probe": _timm_hybrid_embed_probe,
    "transformers wav2vec2 pos conv weight_norm dim=2": _hf_wav2vec_pos_conv,
    "torch zero-size layers and buffers": _torch_zero_size,
    "torch float64/complex64/int params, grad buffer": _torch_odd_dtypes_and_flags,
    "torch save/load round trip of a layer": _torch_pickle_round_trip,
    "torch load_state_dict(..., assign=True) inside": _torch_load_state_dict_assign,
    "torch target net synced by data.copy_": _torch_copy_params_by_zip,
    "numpy qr of a torch draw via .numpy()": _numpy_qr_round_trip,
}


IDIOMS: dict[str, Callable[[nn.Module], None]] = {
    **TIMM,
    **TORCHTITAN,
    **TRANSFORMERS,
    **DIFFUSERS,
    **PEFT_INLINE,
    **TORCH,
}


# == what each idiom gives ==================================================================

_NUMPY = r"numpy|ndarray|array"
_PARAMETRIZE = r"register_parametrization|parametrize\b|set_\("
_MIXED_FORWARD = (
    "crash: a forward of a real input through a meta layer raises 'Tensor on device meta is "
    "not on the expected device cpu!' in the build"
)

# idiom -> {include_buffers: Outcome}; an idiom not listed is exact in both modes
OUTCOMES: dict[str, dict[bool, Outcome]] = {
    "timm drop-path linspace .item()": {
        True: broken("crash: the build raises 'Tensor.item() cannot be called on meta tensors'")
    },
    "timm drop-path linspace .tolist()": {
        True: broken("crash: the build raises 'Cannot copy out of meta tensor; no data!'")
    },
    "transformers resize embeddings mean init": {
        mode: broken(
            "crash: `if (...).all():` on a value computed from a meta weight raises "
            "'Tensor.item() cannot be called on meta tensors' in the build"
        )
        for mode in MODES
    },
    "torch parametrizations.orthogonal": {
        mode: broken("crash: the build raises 'Tensor.item() cannot be called on meta tensors'")
        for mode in MODES
    },
    "torch vector_to_parameters": {
        False: broken(
            "crash: `param.data = vec[...]` of a real vector into a meta parameter raises "
            "'incompatible tensor type' in the build"
        )
    },
    "torch fuse_conv_bn_eval": {
        False: broken(
            "crash: the real running_var meets the meta conv weight: 'Tensor on device cpu is "
            "not on the expected device meta!' in the build"
        )
    },
    "torch share_memory() inside": {
        mode: broken("crash: the build raises '_share_fd_: only available on CPU'")
        for mode in MODES
    },
    "torch BatchNorm stats from a warm-up forward": {False: broken(_MIXED_FORWARD)},
    "torch shape probe through BatchNorm in train mode": {False: broken(_MIXED_FORWARD)},
    "timm freeze_batch_norm_2d .data assignments": {
        False: broken(
            "crash: `frozen_buffer.data = bn.weight.data.clone()` of a meta value into a real "
            "buffer raises 'incompatible tensor type' in the build"
        )
    },
    "torch tie if data_ptr() equal": {
        mode: Outcome(REFUSED, r"_torch_dedupe_by_data_ptr read the memory address .* data_ptr\(\)")
        for mode in MODES
    },
    "torch branch on device.type == 'cpu'": {
        mode: Outcome(REFUSED, r"_torch_branch_on_device_type read \.device.*compared")
        for mode in MODES
    },
    "torch branch on is_cpu": {
        mode: Outcome(REFUSED, r"_torch_branch_on_is_cpu read \.is_cpu") for mode in MODES
    },
    "LSUV one-step rescale by a forward's std": {False: broken(_MIXED_FORWARD)},
    "torch quantize_per_tensor buffer": {
        True: Outcome(REFUSED, r"asked for torch\.qint8 and made torch\.float32 on meta")
    },
    "torch .to('cpu') inside": {
        mode: broken(
            "crash: `.to('cpu')` of a meta module inside the build raises 'Cannot copy out of "
            "meta tensor; no data!'"
        )
        for mode in MODES
    },
    "timm HybridEmbed eval-mode probe": {False: broken(_MIXED_FORWARD)},
    "torch save/load round trip of a layer": {
        mode: Outcome(REFUSED, r"torch\.load \(or pickle\) rebuilt it") for mode in MODES
    },
    "numpy qr of a torch draw via .numpy()": {
        False: Outcome(REFUSED, r"numpy read the values"),
        True: broken(
            "crash: `.numpy()` of the meta draw raises 'can't convert meta device type tensor "
            "to numpy' in the build"
        ),
    },
}


@pytest.mark.parametrize(("idiom", "include_buffers", "outcome"), idiom_cases(IDIOMS, OUTCOMES))
def test_library_init_idioms_are_exact_or_refused_upfront(idiom, include_buffers, outcome):
    check_idiom(IDIOMS[idiom], include_buffers, outcome)


@pytest.mark.parametrize("include_buffers", MODES)
def test_deep_copies_do_not_depend_on_their_template_staying_alive(include_buffers):
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        template = nn.Linear(4, 4)
        model = nn.ModuleList([copy.deepcopy(template) for _ in range(2)])
    before = metamode.is_materializable(model)
    del template
    assert metamode.is_materializable(model) == before


# -- Python attributes set on the tensors -----------------------------------------------------


@pytest.mark.parametrize("include_buffers", MODES)
def test_attributes_set_on_parameters_survive_materialize(include_buffers):
    model = build_empty(lambda: Built(_torch_parameter_attributes), include_buffers)
    materialize_exactly(model)
    assert model.A_log._no_weight_decay is True
    assert model.fc.bias._no_reinit is True


@pytest.mark.parametrize("include_buffers", MODES)
def test_attributes_set_on_buffers_survive_materialize(include_buffers):
    model = build_empty(lambda: Built(_torch_parameter_attributes), include_buffers)
    materialize_exactly(model)
    assert getattr(model.buf, "tag", None) == "kept"


# -- PEFT's own inits, on a base built in the same block ----------------------------------------


class _PeftBase(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.q = nn.Linear(16, 16)
        self.v = nn.Linear(16, 16)
        self.o = nn.Linear(16, 4)


PEFT_CONFIGS = {
    "pissa (SVD of the base, base rewritten)": ("LoraConfig", {"init_lora_weights": "pissa"}),
    "pissa_niter_2 (svd_lowrank draws)": ("LoraConfig", {"init_lora_weights": "pissa_niter_2"}),
    "olora (QR of the base)": ("LoraConfig", {"init_lora_weights": "olora"}),
    "modules_to_save (a deepcopy of o)": ("LoraConfig", {"modules_to_save": ["o"]}),
    "trainable_token_indices": ("LoraConfig", {"trainable_token_indices": {"emb": [0, 3]}}),
    "LoRA on an Embedding": ("LoraConfig", {"target_modules": ["emb", "q"]}),
    "rslora gaussian": ("LoraConfig", {"use_rslora": True, "init_lora_weights": "gaussian"}),
    "IA3": ("IA3Config", {"target_modules": ["q", "o"], "feedforward_modules": ["o"]}),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", sorted(PEFT_CONFIGS))
def test_peft_inits_on_a_base_built_in_the_same_block(name, include_buffers):
    import peft

    kind, kwargs = PEFT_CONFIGS[name]

    def config():
        if kind == "IA3Config":
            return peft.IA3Config(**kwargs)
        return peft.LoraConfig(**{"r": 4, "target_modules": ["q", "v"], **kwargs})

    with metamode.enabled("peft"):
        torch.manual_seed(0)
        ref = peft.get_peft_model(_PeftBase(), config(), low_cpu_mem_usage=False)
        torch.manual_seed(0)
        with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
            model = peft.get_peft_model(_PeftBase(), config(), low_cpu_mem_usage=True)
    assert any(t.is_meta for t in tensors(model).values())
    materialize_exactly(model, ref)


def _exact_in_both_modes() -> list[str]:
    return [name for name in IDIOMS if not OUTCOMES.get(name)]


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", _exact_in_both_modes())
def test_children_materialized_last_first_then_the_rest(idiom, include_buffers):
    init = IDIOMS[idiom]
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    children = [c for c in model.children() if any(t.is_meta for t in tensors(c).values())]
    for child in reversed(children):
        materialize_exactly(child)
    materialize_exactly(model, ref)


# -- torch's deterministic mode fills what ``torch.empty`` returns -----------------------------


@pytest.fixture
def deterministic_during_the_build():
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    fill = torch.utils.deterministic.fill_uninitialized_memory

    def build(include_buffers: bool | None) -> nn.Module:
        def module() -> nn.Module:
            m = nn.Module()
            m.w = nn.Parameter(torch.empty(64))  # eager: NaN under deterministic mode
            m.fc = nn.Linear(2, 2)
            return m

        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        try:
            if include_buffers is None:
                return build_eagerly(module)
            return build_empty(module, include_buffers)
        finally:
            torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
            torch.utils.deterministic.fill_uninitialized_memory = fill

    return build


@pytest.mark.parametrize("include_buffers", MODES)
def test_empty_under_deterministic_mode_keeps_its_fill(
    deterministic_during_the_build, include_buffers
):
    ref = deterministic_during_the_build(None)
    model = deterministic_during_the_build(include_buffers)
    assert metamode.is_materializable(model)
    metamode.materialize(model)
    bits = {n: t.detach().view(torch.int32) for n, t in tensors(model).items()}
    want = {n: t.detach().view(torch.int32) for n, t in tensors(ref).items()}
    assert all(torch.equal(bits[n], want[n]) for n in want)
