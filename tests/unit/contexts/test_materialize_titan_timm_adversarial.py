"""A break-it pass against ``materialize`` with construction and init idioms of timm,
torchtitan, transformers, diffusers and PEFT, re-implemented in plain torch (each builder
names the upstream function it mirrors), and varied the way real code varies them: the
submodules materialized one at a time in a chosen order, seeds other than 0, the whole build
inside ``torch.no_grad()``, a process default dtype other than float32, ``torch.device``
blocks inside the build, and ``materialize`` called under contexts of the caller's own.

Each case is built eagerly and in ``empty_weights(replayable=True)`` (params-only and
``include_buffers=True``) under one seed, then must either materialize to eager's tensors bit
for bit (values, dtype, strides, ties, storage sharing; the default generator untouched) or be
refused upfront with ``is_materializable`` agreeing, nothing changed, and a reason naming the
real cause. A case that breaks the promise today is a strict xfail saying what happens."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from math import comb

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    EITHER,
    EXACT,
    MODES,
    REFUSED,
    assert_exact_or_refused,
    assert_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    default_dtype,
    materialize_exactly,
    tensors,
)

pytestmark = pytest.mark.filterwarnings("ignore")

BUILD_RAISES = "build raises"  # the build itself raises, as any empty-weights scheme would


# == shared helpers copied from the libraries ===============================================


def named_apply(
    fn: Callable,
    module: nn.Module,
    name: str = "",
    depth_first: bool = True,
    include_root: bool = False,
) -> nn.Module:
    """timm/models/_manipulate.py ``named_apply``."""
    if not depth_first and include_root:
        fn(module=module, name=name)
    for child_name, child_module in module.named_children():
        child_name = ".".join((name, child_name)) if name else child_name
        named_apply(fn, child_module, child_name, depth_first, include_root=True)
    if depth_first and include_root:
        fn(module=module, name=name)
    return module


def _timm_trunc_normal_impl(tensor, mean, std, a, b):
    """timm/layers/weight_init.py ``_trunc_normal_`` (inverse-CDF, no rejection loop)."""

    def norm_cdf(x):
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    lo = norm_cdf((a - mean) / std)
    up = norm_cdf((b - mean) / std)
    tensor.uniform_(2 * lo - 1, 2 * up - 1)
    tensor.erfinv_()
    tensor.mul_(std * math.sqrt(2.0))
    tensor.add_(mean)
    tensor.clamp_(min=a, max=b)
    return tensor


def timm_trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0):
    """timm/layers/weight_init.py ``trunc_normal_``."""
    with torch.no_grad():
        return _timm_trunc_normal_impl(tensor, mean, std, a, b)


def timm_trunc_normal_tf_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0):
    """timm/layers/weight_init.py ``trunc_normal_tf_``."""
    with torch.no_grad():
        _timm_trunc_normal_impl(tensor, 0, 1.0, a, b)
        tensor.mul_(std).add_(mean)
    return tensor


def timm_variance_scaling_(tensor, scale=1.0, mode="fan_in", distribution="normal"):
    """timm/layers/weight_init.py ``variance_scaling_``."""
    fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(tensor)
    denom = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
    variance = scale / denom
    if distribution == "truncated_normal":
        timm_trunc_normal_tf_(tensor, std=math.sqrt(variance) / 0.87962566103423978)
    elif distribution == "normal":
        with torch.no_grad():
            tensor.normal_(std=math.sqrt(variance))
    else:
        bound = math.sqrt(3 * variance)
        with torch.no_grad():
            tensor.uniform_(-bound, bound)


def timm_lecun_normal_(tensor):
    """timm/layers/weight_init.py ``lecun_normal_``."""
    timm_variance_scaling_(tensor, mode="fan_in", distribution="truncated_normal")


# == timm ===================================================================================


class _LayerScale(nn.Module):
    """timm/layers/layer_scale.py ``LayerScale``: ``torch.empty`` then ``reset_parameters``."""

    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.constant_(self.gamma, self.init_values)


class _VitAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)


class _VitMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)


class _VitBlock(nn.Module):
    """timm/models/vision_transformer.py ``Block`` with LayerScale."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _VitAttention(dim)
        self.ls1 = _LayerScale(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = _VitMlp(dim, dim * 2)
        self.ls2 = _LayerScale(dim)


def _init_weights_vit_timm(module: nn.Module, name: str = "", needs_reset: bool = True) -> None:
    """timm/models/vision_transformer.py ``init_weights_vit_timm``."""
    if isinstance(module, nn.Linear):
        timm_trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "init_weights"):
        module.init_weights()
    elif needs_reset and hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _init_weights_vit_jax(
    module: nn.Module, name: str = "", head_bias: float = 0.0, needs_reset: bool = True
) -> None:
    """timm/models/vision_transformer.py ``init_weights_vit_jax``."""
    if isinstance(module, nn.Linear):
        if name.startswith("head"):
            nn.init.zeros_(module.weight)
            nn.init.constant_(module.bias, head_bias)
        else:
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                if "mlp" in name:
                    nn.init.normal_(module.bias, std=1e-6)
                else:
                    nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Conv2d):
        timm_lecun_normal_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "init_weights"):
        module.init_weights()
    elif needs_reset and hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _init_weights_vit_moco(module: nn.Module, name: str = "", needs_reset: bool = True) -> None:
    """timm/models/vision_transformer.py ``init_weights_vit_moco``."""
    if isinstance(module, nn.Linear):
        if "qkv" in name:
            val = math.sqrt(6.0 / float(module.weight.shape[0] // 3 + module.weight.shape[1]))
            nn.init.uniform_(module.weight, -val, val)
        else:
            nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "init_weights"):
        module.init_weights()
    elif needs_reset and hasattr(module, "reset_parameters"):
        module.reset_parameters()


class _TimmViT(nn.Module):
    """timm/models/vision_transformer.py ``VisionTransformer.__init__`` + ``init_weights`` +
    ``fix_init_weight``: cls / reg tokens, ``randn * .02`` pos_embed, ``named_apply`` of the
    mode's init, ``needs_reset=False`` (modules self-initialised in ``__init__``)."""

    def __init__(self, mode: str = "", fix_init: bool = False, dim: int = 8) -> None:
        super().__init__()
        self.num_classes = 3
        self.patch_embed = nn.Conv2d(3, dim, 2, stride=2)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.reg_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.blocks = nn.Sequential(*[_VitBlock(dim) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, self.num_classes)
        self.fix_init = fix_init
        self.init_weights(mode, needs_reset=False)

    def fix_init_weight(self) -> None:
        with torch.no_grad():
            for layer_id, layer in enumerate(self.blocks):
                scale = math.sqrt(2.0 * (layer_id + 1))
                layer.attn.proj.weight.div_(scale)
                layer.mlp.fc2.weight.div_(scale)

    def init_weights(self, mode: str = "", needs_reset: bool = True) -> None:
        head_bias = -math.log(self.num_classes) if "nlhb" in mode else 0.0
        timm_trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        nn.init.normal_(self.reg_token, std=1e-6)
        if mode.startswith("jax"):
            fn = partial(_init_weights_vit_jax, head_bias=head_bias, needs_reset=needs_reset)
        elif mode.startswith("moco"):
            fn = partial(_init_weights_vit_moco, needs_reset=needs_reset)
        else:
            fn = partial(_init_weights_vit_timm, needs_reset=needs_reset)
        named_apply(fn, self)
        if self.fix_init:
            self.fix_init_weight()


class _BlurPool2d(nn.Module):
    """timm/layers/blur_pool.py ``BlurPool2d``: an empty non-persistent buffer filled by
    ``copy_`` of an outer product of ``torch.tensor(..., device='cpu')`` binomial coeffs."""

    def __init__(self, channels: int = 3, filt_size: int = 3) -> None:
        super().__init__()
        self.channels, self.filt_size = channels, filt_size
        self.register_buffer(
            "filt", torch.empty((channels, 1, filt_size, filt_size)), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self._init_buffers()

    def _init_buffers(self) -> None:
        coeffs = torch.tensor(
            [comb(self.filt_size - 1, k) for k in range(self.filt_size)],
            device="cpu",
            dtype=torch.float32,
        ) / (2 ** (self.filt_size - 1))
        blur_filter = (coeffs[:, None] * coeffs[None, :])[None, None, :, :]
        blur_filter = blur_filter.repeat(self.channels, 1, 1, 1)
        self.filt.copy_(blur_filter)

    def init_non_persistent_buffers(self) -> None:
        self._init_buffers()


def _freq_buffer_dtype(dtype: torch.dtype | None) -> torch.dtype:
    """timm/layers/pos_embed_sincos.py ``_freq_buffer_dtype``: reads the default dtype."""
    if dtype is None:
        dtype = torch.get_default_dtype()
    if dtype.is_floating_point and torch.finfo(dtype).bits < 32:
        return torch.float32
    return dtype


class _TimmRotaryEmbedding(nn.Module):
    """timm/layers/pos_embed_sincos.py ``RotaryEmbedding`` (pixel bands, cached sin/cos):
    ``torch.empty`` buffers, CPU bands ``copy_``-ed in, ``_apply`` overridden to rebuild
    ``bands`` when a cast drops it below float32."""

    def __init__(self, dim: int = 8, feat_shape=(2, 3), max_res: int = 224) -> None:
        super().__init__()
        self.dim, self.feat_shape, self.max_res = dim, list(feat_shape), max_res
        self.register_buffer(
            "bands", torch.empty(dim // 4, dtype=_freq_buffer_dtype(None)), persistent=False
        )
        num_pos = math.prod(self.feat_shape)
        self.register_buffer("pos_embed_sin", torch.empty(num_pos, dim), persistent=False)
        self.register_buffer("pos_embed_cos", torch.empty(num_pos, dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self._init_buffers()

    def _compute_bands(self, device=None, dtype=None) -> torch.Tensor:
        bands = 2 ** torch.linspace(
            0, math.log(self.max_res, 2) - 1, self.dim // 4, dtype=torch.float32
        )
        return (bands * torch.pi).to(device=device, dtype=dtype)

    def _init_buffers(self) -> None:
        bands = self._compute_bands()
        self.bands.copy_(bands)
        t = [torch.linspace(-1.0, 1.0, steps=s, dtype=torch.float32) for s in self.feat_shape]
        grid = torch.stack(torch.meshgrid(t, indexing="ij"), dim=-1).to(dtype=torch.float32)
        pos = grid.unsqueeze(-1) * bands
        sin, cos = pos.sin().to(dtype=torch.float32), pos.cos().to(dtype=torch.float32)
        sin = sin.flatten(-2).flatten(0, -2).repeat_interleave(2, -1)
        cos = cos.flatten(-2).flatten(0, -2).repeat_interleave(2, -1)
        self.pos_embed_sin.copy_(sin)
        self.pos_embed_cos.copy_(cos)

    def init_non_persistent_buffers(self) -> None:
        self._init_buffers()

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        if _freq_buffer_dtype(self.bands.dtype) != self.bands.dtype:
            self.register_buffer(
                "bands", self._compute_bands(device=self.bands.device), persistent=False
            )
        return module


def _timm_rel_pos_indices(size, device=None):
    """timm/layers/lambda_layer.py ``rel_pos_indices``."""
    pos = torch.stack(
        torch.meshgrid(
            torch.arange(size[0], device=device, dtype=torch.long),
            torch.arange(size[1], device=device, dtype=torch.long),
            indexing="ij",
        )
    ).flatten(1)
    rel_pos = pos[:, None, :] - pos[:, :, None]
    rel_pos[0] += size[0] - 1
    rel_pos[1] += size[1] - 1
    return rel_pos


class _TimmLambdaLayer(nn.Module):
    """timm/layers/lambda_layer.py ``LambdaLayer``: trunc_normal_ by fan-in, a pos_emb, an
    int64 ``rel_pos_indices`` buffer ``copy_``-ed on its own device."""

    def __init__(self, dim: int = 4, feat=(2, 2), dim_qk: int = 2) -> None:
        super().__init__()
        self.feat_size, self.dim_qk = feat, dim_qk
        self.qkv = nn.Conv2d(dim, dim_qk * 2 + dim, 1, bias=False)
        rel_size = [2 * s - 1 for s in feat]
        self.pos_emb = nn.Parameter(torch.empty(rel_size[0], rel_size[1], dim_qk))
        m = feat[0] * feat[1]
        self.register_buffer(
            "rel_pos_indices", torch.empty((2, m, m), dtype=torch.long), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        timm_trunc_normal_(self.qkv.weight, std=self.qkv.weight.shape[1] ** -0.5)
        timm_trunc_normal_(self.pos_emb, std=0.02)
        self.rel_pos_indices.copy_(
            _timm_rel_pos_indices(self.feat_size, device=self.rel_pos_indices.device)
        )


class _TimmGluMlp(nn.Module):
    """timm/layers/mlp.py ``GluMlp.init_weights``: ``ones_`` / ``normal_`` into the second
    half of fc1's bias and weight (slices of Parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(4, 4)
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.ones_(self.fc1.bias[self.fc1.bias.shape[0] // 2 :])
        nn.init.normal_(self.fc1.weight[self.fc1.weight.shape[0] // 2 :], std=1e-6)


class _TimmCondConv2d(nn.Module):
    """timm/layers/cond_conv2d.py ``CondConv2d.reset_parameters``: per-expert
    ``kaiming_uniform_`` / ``uniform_`` through ``weight[i].view(expert_shape)``."""

    def __init__(self, cin: int = 2, cout: int = 3, k: int = 3, num_experts: int = 3) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.weight_shape = (cout, cin, k, k)
        self.weight = nn.Parameter(torch.empty(num_experts, math.prod(self.weight_shape)))
        self.bias_shape = (cout,)
        self.bias = nn.Parameter(torch.empty(num_experts, cout))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        def initializer(init, shape):
            def condconv_initializer(weight):
                for i in range(self.num_experts):
                    init(weight[i].view(shape))

            return condconv_initializer

        initializer(partial(nn.init.kaiming_uniform_, a=math.sqrt(5)), self.weight_shape)(
            self.weight
        )
        bound = 1 / math.sqrt(math.prod(self.weight_shape[1:]))
        initializer(partial(nn.init.uniform_, a=-bound, b=bound), self.bias_shape)(self.bias)


class _ConvNormAct(nn.Module):
    def __init__(self, cin: int, cout: int, k: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)


class _TimmMobileOneBlock(nn.Module):
    """timm/models/fastvit.py ``MobileOneBlock.reparameterize``: branches fused through
    their BN statistics (an identity kernel written element by element), the fused conv's
    ``.data =`` assigned, every other parameter ``detach_()``-ed, branches deleted."""

    def __init__(self, chs: int = 2, k: int = 3) -> None:
        super().__init__()
        self.in_chs, self.kernel_size = chs, k
        self.identity = nn.BatchNorm2d(chs)
        self.conv_kxk = nn.ModuleList([_ConvNormAct(chs, chs, k) for _ in range(2)])
        self.conv_scale = _ConvNormAct(chs, chs, 1)
        self.reparam_conv = None
        with torch.no_grad():  # a warm-up statistics pass, as a trained checkpoint would have
            for bn in (self.identity, self.conv_scale.bn, *(b.bn for b in self.conv_kxk)):
                bn.running_mean.uniform_(-0.1, 0.1)
                bn.running_var.uniform_(0.5, 1.5)
                nn.init.normal_(bn.weight, 1.0, 0.1)

    def _fuse_bn_tensor(self, branch):
        if isinstance(branch, _ConvNormAct):
            kernel = branch.conv.weight
            bn = branch.bn
        else:
            if not hasattr(self, "id_tensor"):
                kernel_value = torch.zeros(
                    (self.in_chs, self.in_chs, self.kernel_size, self.kernel_size),
                    dtype=branch.weight.dtype,
                    device=branch.weight.device,
                )
                for i in range(self.in_chs):
                    kernel_value[i, i, self.kernel_size // 2, self.kernel_size // 2] = 1
                self.id_tensor = kernel_value
            kernel, bn = self.id_tensor, branch
        std = (bn.running_var + bn.eps).sqrt()
        t = (bn.weight / std).reshape(-1, 1, 1, 1)
        return kernel * t, bn.bias - bn.running_mean * bn.weight / std

    def reparameterize(self) -> None:
        kernel_scale, bias_scale = self._fuse_bn_tensor(self.conv_scale)
        pad = self.kernel_size // 2
        kernel_scale = F.pad(kernel_scale, [pad, pad, pad, pad])
        kernel_identity, bias_identity = self._fuse_bn_tensor(self.identity)
        kernel_conv, bias_conv = 0, 0
        for branch in self.conv_kxk:
            _kernel, _bias = self._fuse_bn_tensor(branch)
            kernel_conv += _kernel
            bias_conv += _bias
        kernel = kernel_conv + kernel_scale + kernel_identity
        bias = bias_conv + bias_scale + bias_identity
        self.reparam_conv = nn.Conv2d(
            self.in_chs, self.in_chs, self.kernel_size, padding=pad, bias=True
        )
        self.reparam_conv.weight.data = kernel
        self.reparam_conv.bias.data = bias
        for name, para in self.named_parameters():
            if "reparam_conv" in name:
                continue
            para.detach_()
        self.__delattr__("conv_kxk")
        self.__delattr__("conv_scale")
        self.__delattr__("identity")


def _timm_mobileone_reparameterized() -> nn.Module:
    block = _TimmMobileOneBlock()
    block.reparameterize()
    return block


class _TimmDiffAttention(nn.Module):
    """timm/models/vision_transformer.py diff-attention ``reset_parameters``: lambda
    vectors ``normal_(std=0.1)`` and ``lambda_init`` from the depth."""

    def __init__(self, dim: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.lambda_q1 = nn.Parameter(torch.empty(dim // 2))
        self.lambda_k1 = nn.Parameter(torch.empty(dim // 2))
        self.lambda_q2 = nn.Parameter(torch.empty(dim // 2))
        self.lambda_k2 = nn.Parameter(torch.empty(dim // 2))
        self.sub_norm = nn.RMSNorm(dim)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, mean=0, std=0.1)


class _TimmConvNeXtHead(nn.Module):
    """timm/models/convnext.py ``_init_weights`` + ``head_init_scale``: trunc_normal_ on
    conv / linear, then ``head.fc.weight.data.mul_(scale)`` and the bias likewise."""

    def __init__(self, head_init_scale: float = 0.5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 2, stride=2)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.gamma = nn.Parameter(1e-6 * torch.ones(4))
        self.head = nn.Sequential()
        self.head.add_module("fc", nn.Linear(4, 3))
        named_apply(partial(self._init_weights, head_init_scale=head_init_scale), self)

    @staticmethod
    def _init_weights(module, name=None, head_init_scale=1.0):
        if isinstance(module, nn.Conv2d):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
            if name and "head." in name:
                module.weight.data.mul_(head_init_scale)
                module.bias.data.mul_(head_init_scale)


class _TimmGlobalContext(nn.Module):
    """timm/layers/global_context.py ``GlobalContext.reset_parameters``: kaiming_normal_
    (fan_in, relu) on the attention conv, ``zeros_`` on the last MLP layer."""

    def __init__(self, chs: int = 4) -> None:
        super().__init__()
        self.conv_attn = nn.Conv2d(chs, 1, 1, bias=True)
        self.fc1 = nn.Conv2d(chs, 2, 1)
        self.fc2 = nn.Conv2d(2, chs, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.conv_attn.weight, mode="fan_in", nonlinearity="relu")
        nn.init.zeros_(self.fc2.weight)


def _timm_variance_scaling_mix() -> nn.Module:
    """timm/layers/weight_init.py ``variance_scaling_`` in every mode / distribution."""
    m = nn.ModuleDict(
        {
            "a": nn.Linear(6, 4),
            "b": nn.Conv2d(2, 4, 3),
            "c": nn.Linear(4, 4),
            "d": nn.Conv2d(4, 2, 1),
        }
    )
    timm_variance_scaling_(m["a"].weight, mode="fan_avg", distribution="uniform")
    timm_variance_scaling_(m["b"].weight, scale=2.0, mode="fan_out", distribution="normal")
    timm_variance_scaling_(m["c"].weight, mode="fan_in", distribution="truncated_normal")
    timm_lecun_normal_(m["d"].weight)
    return m


class _TimmMaeNumpyPosEmbed(nn.Module):
    """timm/layers/pos_embed.py / MAE ``get_2d_sincos_pos_embed`` (NumPy) copied under
    ``torch.no_grad()`` into a frozen Parameter with ``param.copy_`` (not ``.data``)."""

    def __init__(self, dim: int = 8, grid: int = 2) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(1, grid * grid + 1, dim), requires_grad=False)
        omega = np.arange(dim // 4, dtype=np.float64) / (dim / 4.0)
        omega = 1.0 / 10000**omega
        gh, gw = np.meshgrid(np.arange(grid, dtype=np.float32), np.arange(grid, dtype=np.float32))
        embs = []
        for g in (gh, gw):
            out = np.einsum("m,d->md", g.reshape(-1), omega)
            embs.append(np.concatenate([np.sin(out), np.cos(out)], axis=1))
        emb = np.concatenate([np.zeros([1, dim]), np.concatenate(embs, axis=1)], axis=0)
        with torch.no_grad():
            self.pos_embed.copy_(torch.from_numpy(emb).float().unsqueeze(0))
        self.proj = nn.Linear(dim, dim)
        w = self.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))


class _TimmReinitBuffers(nn.Module):
    """timm/models/_manipulate.py ``reinit_non_persistent_buffers`` called inside the build
    after construction (as a loader does after a checkpoint), on rope, blur and lambda."""

    def __init__(self) -> None:
        super().__init__()
        self.rope = _TimmRotaryEmbedding()
        self.blur = _BlurPool2d()
        self.fc = nn.Linear(4, 4)
        for _name, module in self.named_modules():
            if hasattr(module, "init_non_persistent_buffers"):
                module.init_non_persistent_buffers()


def _timm_rope_half() -> nn.Module:
    """``RotaryEmbedding(...).half()`` inside the build: timm's ``_apply`` override re-registers
    ``bands`` from ``_compute_bands(device=self.bands.device)`` after the cast."""
    m = nn.Module()
    m.rope = _TimmRotaryEmbedding()
    m.fc = nn.Linear(4, 4)
    m.half()
    return m


# == torchtitan =============================================================================


class _TitanModule(nn.Module):
    """torchtitan/protocols/module.py ``Module.init_states``: children first (a queue of
    direct children, plain ``nn.Module``s looked into), then ``_init_self_parameters`` (the
    ``_param_init`` dict, else ``reset_parameters``), then ``_init_self_buffers``."""

    _param_init: dict[str, Callable] | None = None

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        queue = list(self.children())
        while queue:
            child = queue.pop(0)
            if isinstance(child, _TitanModule):
                child.init_states(buffer_device=buffer_device)
            else:
                queue.extend(child.children())
                # torchtitan wraps nn layers in its own Module subclasses; a plain layer is
                # initialised by its own reset_parameters here
                reset = getattr(child, "reset_parameters", None)
                if callable(reset) and getattr(child, "_param_init", None) is None:
                    reset()
                elif getattr(child, "_param_init", None) is not None:
                    for name, param in child.named_parameters(recurse=False):
                        child._param_init[name](param)
        self._init_self_parameters()
        self._init_self_buffers(buffer_device=buffer_device)

    def _init_self_parameters(self) -> None:
        if self._param_init is not None:
            for name, param in self.named_parameters(recurse=False):
                self._param_init[name](param)

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        pass


def _skip_param_init(param: nn.Parameter) -> None:
    """torchtitan/models/common/param_init.py ``skip_param_init``."""


def _depth_scaled_std(base_std: float, layer_id: int) -> float:
    """torchtitan/models/common/param_init.py ``depth_scaled_std``."""
    return base_std / (2 * (layer_id + 1)) ** 0.5


class _TitanComplexRoPE(_TitanModule):
    """torchtitan/models/common/rope.py ``ComplexRoPE`` with llama scaling: the cache is
    registered in ``__init__`` and recomputed in ``_init_self_buffers`` under
    ``torch.device(buffer_device or self.cache.device)``."""

    def __init__(self, dim: int = 8, max_seq_len: int = 6, theta: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.end, self.theta = dim, max_seq_len, theta
        self.register_buffer("cache", self._precompute_cache(), persistent=False)

    def _precompute_cache(self) -> torch.Tensor:
        dim, theta = self.dim, self.theta
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        scaling_factor, low_freq_factor, high_freq_factor, orig = 8.0, 1.0, 4.0, 64
        wavelen = 2 * math.pi / freqs
        high_freq_wavelen = orig / high_freq_factor
        low_freq_wavelen = orig / low_freq_factor
        freqs = torch.where(wavelen > low_freq_wavelen, freqs / scaling_factor, freqs)
        smooth_factor = (orig / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth_factor) * freqs / scaling_factor + smooth_factor * freqs
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        freqs = torch.where(is_medium, smoothed, freqs)
        t = torch.arange(self.end, device=freqs.device)
        freqs = torch.outer(t, freqs).float()
        return torch.polar(torch.ones_like(freqs), freqs)

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        if buffer_device is None:
            buffer_device = self.cache.device
        with torch.device(buffer_device):
            self.cache = self._precompute_cache()


class _TitanLinear(nn.Linear):
    def __init__(self, i: int, o: int, param_init: dict, bias: bool = False) -> None:
        super().__init__(i, o, bias=bias)
        self._param_init = param_init


class _TitanAttention(_TitanModule):
    def __init__(self, dim: int, layer_id: int) -> None:
        super().__init__()
        std = _depth_scaled_std(0.02, layer_id)
        init = {"weight": partial(nn.init.trunc_normal_, std=0.02)}
        self.wq = _TitanLinear(dim, dim, init)
        self.wk = _TitanLinear(dim, dim // 2, init)
        self.wv = _TitanLinear(dim, dim // 2, init)
        self.wo = _TitanLinear(dim, dim, {"weight": partial(nn.init.trunc_normal_, std=std)})


class _TitanFeedForward(_TitanModule):
    def __init__(self, dim: int, hidden: int, layer_id: int) -> None:
        super().__init__()
        std = _depth_scaled_std(0.02, layer_id)
        self.w1 = _TitanLinear(dim, hidden, {"weight": partial(nn.init.trunc_normal_, std=0.02)})
        self.w2 = _TitanLinear(hidden, dim, {"weight": partial(nn.init.trunc_normal_, std=std)})
        self.w3 = _TitanLinear(dim, hidden, {"weight": partial(nn.init.trunc_normal_, std=std)})


class _TitanBlock(_TitanModule):
    def __init__(self, dim: int, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = _TitanAttention(dim, layer_id)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = _TitanFeedForward(dim, dim * 2, layer_id)


class _TitanDecoder(_TitanModule):
    """torchtitan/models/common/decoder.py ``Decoder``: ``ModuleDict`` of layers keyed by
    str(i), output tied by ``tok_embeddings.weight = lm_head.weight`` in ``__init__`` and again
    in ``init_states``; ``lm_head`` ``trunc_normal_(std=dim**-0.5, a=-3*std, b=3*std)``, the
    embedding skipped (``skip_param_init``); the rope cache recomputed on its device."""

    def __init__(
        self,
        dim: int = 8,
        vocab: int = 11,
        n_layers: int = 2,
        tie: bool = True,
        buffer_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.tok_embeddings._param_init = {
            "weight": _skip_param_init if tie else partial(nn.init.normal_, std=1.0)
        }
        self.rope = _TitanComplexRoPE(dim // 2)
        self.layers = nn.ModuleDict({str(i): _TitanBlock(dim, i) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        s = dim**-0.5
        self.lm_head = _TitanLinear(
            dim, vocab, {"weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s)}
        )
        self.tie = tie
        if tie:
            self.tok_embeddings.weight = self.lm_head.weight
        with torch.no_grad():
            self.init_states(buffer_device=buffer_device)

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        if self.tie:
            self.tok_embeddings.weight = self.lm_head.weight
        super().init_states(buffer_device=buffer_device)


class _TitanGroupedExperts(_TitanModule):
    """torchtitan/models/common/moe.py ``GroupedExperts``: 3D ``torch.empty`` weights,
    ``trunc_normal_`` per weight (std 0.02 for w1, depth-scaled for w2 / w3)."""

    def __init__(self, dim: int = 4, hidden: int = 6, num_experts: int = 3) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        std = _depth_scaled_std(0.02, 2)
        self._param_init = {
            "w1": partial(nn.init.trunc_normal_, mean=0.0, std=0.02),
            "w2": partial(nn.init.trunc_normal_, mean=0.0, std=std),
            "w3": partial(nn.init.trunc_normal_, mean=0.0, std=std),
        }


class _TitanMoE(_TitanModule):
    """torchtitan/models/common/moe.py ``MoE._init_self_buffers``: counters re-created with
    ``torch.zeros`` under ``torch.device(buffer_device or tokens_per_expert_E.device)``."""

    def __init__(self, dim: int = 4, num_experts: int = 3) -> None:
        super().__init__()
        self.experts = _TitanGroupedExperts(dim, 6, num_experts)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.router._param_init = {"weight": partial(nn.init.trunc_normal_, std=0.02)}
        self.shared_experts = _TitanFeedForward(dim, 4, 1)
        self.num_experts = num_experts
        self.register_buffer("tokens_per_expert_E", torch.zeros(num_experts), persistent=False)
        self.register_buffer("expert_bias_E", torch.zeros(num_experts), persistent=True)
        with torch.no_grad():
            self.init_states()

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        if buffer_device is None:
            buffer_device = self.tokens_per_expert_E.device
        with torch.device(buffer_device):
            self.tokens_per_expert_E = torch.zeros(self.num_experts, dtype=torch.float32)
            self.expert_bias_E = torch.zeros(self.num_experts, dtype=torch.float32)


def _titan_seeded_mid_build() -> nn.Module:
    """torchtitan/distributed/utils.py ``set_determinism``: ``torch.manual_seed(seed)`` between
    building the skeleton (which draws) and ``init_weights`` (which draws again)."""
    m = nn.Module()
    m.early = nn.Linear(4, 4)  # draws from the outer seed
    torch.manual_seed(42)
    m.late = nn.Linear(4, 4)
    with torch.no_grad():
        nn.init.trunc_normal_(m.late.weight, std=0.02, a=-0.04, b=0.04)
    return m


def _titan_per_layer_fork_rng() -> nn.Module:
    """torchtitan / Megatron per-layer seeding: each layer's init under
    ``torch.random.fork_rng(devices=[])`` with ``torch.manual_seed(base + layer_id)``, the
    main stream going on between layers."""
    m = nn.Module()
    m.layers = nn.ModuleList()
    for layer_id in range(3):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1000 + layer_id)
            layer = nn.Linear(4, 4)
            nn.init.trunc_normal_(layer.weight, std=0.02)
        m.layers.append(layer)
        m.register_parameter(f"noise{layer_id}", nn.Parameter(torch.randn(2)))
    return m


class _TitanMetaSkeleton(nn.Module):
    """torchtitan/trainer.py: ``with torch.device("meta"): model = Model(args)`` then
    ``model.to_empty(device="cpu")`` and ``init_weights`` (normal_ / ones_ only), all inside the
    recorded build."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.inner = nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4), nn.Linear(4, 2))
            self.inner.register_buffer("freqs", torch.empty(3))
        self.inner.to_empty(device="cpu")
        with torch.no_grad():
            nn.init.normal_(self.inner[0].weight, std=0.02)
            nn.init.zeros_(self.inner[0].bias)
            nn.init.ones_(self.inner[1].weight)
            nn.init.normal_(self.inner[2].weight, std=0.02)
            nn.init.zeros_(self.inner[2].bias)
            self.inner.freqs.fill_(0.5)
        self.outer = nn.Linear(4, 4)


def _titan_meta_probe_then_layer() -> nn.Module:
    """torchtitan/components/... ``get_nparams_and_flops`` style: a throwaway model built under
    ``torch.device("meta")`` to count parameters / FLOPs, then the real layers. Eager's meta
    ``kaiming_uniform_`` draws nothing from the CPU generator."""
    with torch.device("meta"):
        probe = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    nparams = sum(p.numel() for p in probe.parameters())
    m = nn.Module()
    m.layer = nn.Linear(4, 4)
    m.register_buffer("nparams", torch.tensor(nparams))
    return m


def _titan_meta_submodule_kept() -> nn.Module:
    """A submodule built under ``torch.device("meta")`` (to be loaded later, torchtitan's
    float8 / pipeline-stage skeletons) kept in the model next to layers built normally."""
    m = nn.Module()
    with torch.device("meta"):
        m.stage = nn.Linear(4, 4)
    m.layer = nn.Linear(4, 4)
    return m


def _timm_meta_dd_probe() -> nn.Module:
    """timm's ``dd = {'device': device, 'dtype': dtype}`` factory kwargs: a classifier head
    built with ``device='meta'`` only to read its output shape (``feature_info``-style),
    then the real head; eager's meta ``reset_parameters`` draws nothing."""
    dd = {"device": "meta", "dtype": None}
    probe = nn.Linear(8, 5, **dd)
    m = nn.Module()
    m.head = nn.Linear(8, probe.out_features)
    return m


# a random init into a tensor the build itself put on meta draws nothing in eager, and a
# device="meta" cannot be told from one read off a tensor the context placed (str(w.device)):
# the draw's start is unknown, so it and every later draw on its stream are refused
_ASKED_META = "the build asked for itself"


class _TitanMetaPlaceholderBuffer(nn.Module):
    """A torchtitan-style placeholder: a ``freqs_cis`` buffer made under ``torch.device("meta")``
    in ``__init__``, replaced in ``init_weights`` by the real table on ``buffer_device``."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.register_buffer(
                "freqs_cis", torch.empty(4, 2, dtype=torch.complex64), persistent=False
            )
        self.proj = nn.Linear(4, 4)
        self.init_weights(buffer_device=torch.device("cpu"))

    def init_weights(self, buffer_device: torch.device) -> None:
        with torch.device(buffer_device):
            freqs = 1.0 / (10000.0 ** (torch.arange(0, 4, 2)[:2].float() / 4))
            t = torch.arange(4, device=freqs.device)
            freqs = torch.outer(t, freqs).float()
            self.freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
        with torch.no_grad():
            nn.init.trunc_normal_(self.proj.weight, std=0.02)


def _titan_freqs_cis_module_to(dtype_cast: str) -> Callable[[], nn.Module]:
    """torchtitan ``precompute_freqs_cis`` in a complex64 buffer, then the model cast to
    bfloat16 inside the build (``model.to(torch.bfloat16)``, which casts complex buffers too,
    or ``model.bfloat16()``, which leaves them)."""

    def build() -> nn.Module:
        m = _TitanMetaPlaceholderBuffer.__new__(_TitanMetaPlaceholderBuffer)
        nn.Module.__init__(m)
        m.proj = nn.Linear(4, 4)
        m.init_weights(buffer_device=torch.device("cpu"))
        if dtype_cast == "to":
            m.to(torch.bfloat16)
        else:
            m.bfloat16()
        return m

    return build


# == transformers ===========================================================================


class _HfClip(nn.Module):
    """transformers/models/clip/modeling_clip.py: ``class_embedding`` from ``torch.randn``,
    ``position_ids`` ``arange(n).expand((1, -1))`` non-persistent, ``logit_scale`` from
    ``torch.tensor(config.logit_scale_init_value)``; ``_init_weights`` with ``factor``."""

    def __init__(self, dim: int = 8, factor: float = 1.0) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.randn(dim))
        self.patch_embedding = nn.Conv2d(3, dim, 2, stride=2, bias=False)
        self.position_embedding = nn.Embedding(5, dim)
        self.register_buffer("position_ids", torch.arange(5).expand((1, -1)), persistent=False)
        self.visual_projection = nn.Linear(dim, 4, bias=False)
        self.text_projection = nn.Linear(dim, 4, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))
        self.ln = nn.LayerNorm(dim)
        self.factor, self.dim = factor, dim
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        factor = self.factor
        if module is self:
            nn.init.normal_(self.class_embedding, mean=0.0, std=self.dim**-0.5 * factor)
            nn.init.normal_(self.patch_embedding.weight, std=0.02 * factor)
            nn.init.normal_(self.position_embedding.weight, std=0.02 * factor)
            nn.init.normal_(self.visual_projection.weight, std=self.dim**-0.5 * factor)
            nn.init.normal_(self.text_projection.weight, std=self.dim**-0.5 * factor)
        if isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)


class _HfTiedLM(nn.Module):
    """transformers ``PreTrainedModel.post_init`` -> ``init_weights`` -> ``self.apply(
    _init_weights)`` (``weight.data.normal_``, ``padding_idx`` row zeroed) ->
    ``tie_weights`` (``output_embeddings.weight = input_embeddings.weight``, bias padded
    with ``nn.functional.pad(bias.data, ...)``)."""

    def __init__(self, vocab: int = 7, dim: int = 4) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim, padding_idx=0)
        self.layer = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab - 2, bias=True)
        self.apply(self._init_weights)
        self.tie_weights()

    def _init_weights(self, module: nn.Module) -> None:
        std = 0.02
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()

    def tie_weights(self) -> None:
        output_embeddings, input_embeddings = self.lm_head, self.embed_tokens
        output_embeddings.weight = input_embeddings.weight
        if getattr(output_embeddings, "bias", None) is not None:
            output_embeddings.bias.data = nn.functional.pad(
                output_embeddings.bias.data,
                (0, output_embeddings.weight.shape[0] - output_embeddings.bias.shape[0]),
                "constant",
                0,
            )
        output_embeddings.out_features = input_embeddings.num_embeddings


class _HfMixtralExperts(nn.Module):
    """transformers 5 ``MixtralExperts``: 3D ``nn.Parameter(torch.empty(...))`` gate_up /
    down projections, initialised by ``_init_weights`` with ``init.normal_``; the router a
    ``nn.Linear`` whose ``weight.data.normal_`` runs too."""

    def __init__(self, e: int = 2, h: int = 4, i: int = 6) -> None:
        super().__init__()
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.experts.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.gate = nn.Linear(h, e, bias=False)
        for module in self.modules():
            if module is self.experts:
                nn.init.normal_(module.gate_up_proj, mean=0.0, std=0.02)
                nn.init.normal_(module.down_proj, mean=0.0, std=0.02)
            elif isinstance(module, nn.Linear):
                module.weight.data.normal_(mean=0.0, std=0.02)


class _HfMamba2Params(nn.Module):
    """transformers/models/mamba2/modeling_mamba2.py + ``_init_weights``: ``dt_bias`` from an
    inverse softplus of a log-uniform ``torch.rand`` draw ``copy_``-ed under no_grad, ``A_log``
    from ``torch.log(torch.arange(1, n + 1))``, ``D`` ones, ``_no_reinit`` /
    ``_no_weight_decay`` flags on the Parameters."""

    def __init__(self, heads: int = 4, dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4) -> None:
        super().__init__()
        self.dt_bias = nn.Parameter(torch.ones(heads))
        A = torch.arange(1, heads + 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(heads))
        self.D._no_weight_decay = True
        self.in_proj = nn.Linear(4, 8, bias=False)
        dt = torch.exp(
            torch.rand(heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        ).clamp(min=dt_init_floor)
        inv_dt = dt + torch.log(-torch.expm1(-dt))
        with torch.no_grad():
            self.dt_bias.copy_(inv_dt)
        self.dt_bias._no_reinit = True
        nn.init.kaiming_uniform_(self.in_proj.weight, a=math.sqrt(5))
        with torch.no_grad():
            self.in_proj.weight /= math.sqrt(2)


class _HfLlama3Rotary(nn.Module):
    """transformers ``_compute_llama3_parameters`` + ``LlamaRotaryEmbedding``:
    ``inv_freq`` from an int64 arange, the where-chains, ``register_buffer`` and
    ``self.original_inv_freq = inv_freq`` (the same tensor, a plain attribute)."""

    def __init__(self, dim: int = 8, base: float = 500000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        factor, low_freq_factor, high_freq_factor, old_context_len = 8.0, 1.0, 4.0, 64
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq_llama = torch.where(is_medium, smoothed, inv_freq_llama)
        self.register_buffer("inv_freq", inv_freq_llama, persistent=False)
        self.original_inv_freq = inv_freq_llama
        self.attention_scaling = 1.0


def _hf_llama_with_rotary() -> nn.Module:
    m = nn.Module()
    m.embed_tokens = nn.Embedding(9, 8)
    m.rotary_emb = _HfLlama3Rotary()
    m.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    for module in m.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.data.zero_()
    return m


class _HfWav2Vec2PosConv(nn.Module):
    """transformers wav2vec2 ``Wav2Vec2PositionalConvEmbedding`` with
    ``parametrizations.weight_norm(dim=2)``, then ``_init_weights`` calling
    ``nn.init.normal_(module.conv.weight, ...)`` on the *computed* weight (a temporary:
    no effect in eager) and ``constant_(module.conv.bias, 0)``."""

    def __init__(self, dim: int = 4, k: int = 3, groups: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, k, padding=k // 2, groups=groups)
        self.conv = nn.utils.parametrizations.weight_norm(self.conv, name="weight", dim=2)
        nn.init.normal_(self.conv.weight, mean=0, std=2 * math.sqrt(1 / (k * dim)))
        nn.init.constant_(self.conv.bias, 0)


class _HfMha(nn.Module):
    """An HF-style ``_init_weights`` over a torch ``nn.MultiheadAttention`` (CLIP / Whisper
    style): ``in_proj_weight`` normal_, ``out_proj`` normal_ + zero bias."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.fc = nn.Linear(dim, dim)
        in_proj_std = (dim**-0.5) * ((2 * 2) ** -0.5)
        nn.init.normal_(self.attn.in_proj_weight, std=in_proj_std)
        nn.init.normal_(self.attn.out_proj.weight, std=dim**-0.5)
        self.attn.out_proj.bias.data.zero_()


# == diffusers ==============================================================================


class _DiffusersDiT(nn.Module):
    """diffusers / DiT ``initialize_weights``: ``_basic_init`` (xavier_uniform_ + zero bias)
    by ``self.apply``, the patch conv's ``weight.data`` seen as 2D through ``.view``, timestep
    MLP ``normal_(std=0.02)``, adaLN-Zero ``constant_(…, 0)`` per block and a zero final."""

    def __init__(self, dim: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.x_embedder = nn.Conv2d(3, dim, 2, stride=2)
        self.t_embedder = nn.Sequential(nn.Linear(8, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "attn": nn.Linear(dim, dim),
                    "adaLN_modulation": nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim)),
                }
            )
            for _ in range(depth)
        )
        self.final_layer = nn.ModuleDict(
            {"linear": nn.Linear(dim, 4), "adaLN": nn.Sequential(nn.SiLU(), nn.Linear(dim, 2))}
        )

        def _basic_init(module):
            if isinstance(module, nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)

        self.apply(_basic_init)
        w = self.x_embedder.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.constant_(self.x_embedder.bias, 0)
        nn.init.normal_(self.t_embedder[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.constant_(block["adaLN_modulation"][-1].weight, 0)
            nn.init.constant_(block["adaLN_modulation"][-1].bias, 0)
        nn.init.constant_(self.final_layer["adaLN"][-1].weight, 0)
        nn.init.constant_(self.final_layer["adaLN"][-1].bias, 0)
        nn.init.constant_(self.final_layer["linear"].weight, 0)
        nn.init.constant_(self.final_layer["linear"].bias, 0)


class _DiffusersLoRALinearLayer(nn.Module):
    """diffusers/models/lora.py ``LoRALinearLayer``: ``normal_(down, std=1/rank)``,
    ``zeros_(up)``, built for every projection of an attention processor."""

    def __init__(self, fin: int = 4, fout: int = 4, rank: int = 2) -> None:
        super().__init__()
        self.down = nn.Linear(fin, rank, bias=False)
        self.up = nn.Linear(rank, fout, bias=False)
        self.network_alpha, self.rank = None, rank
        nn.init.normal_(self.down.weight, std=1 / rank)
        nn.init.zeros_(self.up.weight)


def _diffusers_attn_lora_procs() -> nn.Module:
    m = nn.Module()
    m.to_q = nn.Linear(4, 4)
    m.to_k = nn.Linear(4, 4)
    m.procs = nn.ModuleDict({n: _DiffusersLoRALinearLayer() for n in ("q", "k", "v", "out")})
    return m


def _diffusers_timestep_scale_shift() -> nn.Module:
    """diffusers/models/embeddings.py ``get_timestep_embedding(flip_sin_to_cos=True,
    downscale_freq_shift=1, scale=2.0)`` for an odd dim into a buffer, and
    ``GaussianFourierProjection`` ``torch.randn(...) * scale`` with ``requires_grad=False``."""
    m = nn.Module()
    timesteps = torch.arange(4)
    embedding_dim, max_period, shift, scale = 7, 10000, 1, 2.0
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(start=0, end=half_dim, dtype=torch.float32)
    exponent = exponent / (half_dim - shift)
    emb = torch.exp(exponent)
    emb = timesteps[:, None].float() * emb[None, :]
    emb = scale * emb
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    emb = torch.nn.functional.pad(emb, (0, 1, 0, 0))
    m.register_buffer("table", emb, persistent=False)
    m.weight = nn.Parameter(torch.randn(3) * 16.0, requires_grad=False)
    m.linear_1 = nn.Linear(7, 4)
    return m


# == PEFT ===================================================================================


class _PeftLoHaLayer(nn.Module):
    """peft/tuners/loha/layer.py ``update_layer`` + ``reset_adapter_parameters``:
    ``nn.ParameterDict`` entries per adapter name, ``kaiming_uniform_(a=sqrt(5))`` on three,
    ``zeros_`` on ``hada_w2_b`` (the default init); a real base layer made earlier."""

    def __init__(self, base: nn.Linear, r: int = 2, adapters=("default",)) -> None:
        super().__init__()
        self.base_layer = base
        out_f, in_f = base.weight.shape
        self.hada_w1_a = nn.ParameterDict({})
        self.hada_w1_b = nn.ParameterDict({})
        self.hada_w2_a = nn.ParameterDict({})
        self.hada_w2_b = nn.ParameterDict({})
        for name in adapters:
            self.hada_w1_a[name] = nn.Parameter(torch.empty(out_f, r))
            self.hada_w1_b[name] = nn.Parameter(torch.empty(r, in_f))
            self.hada_w2_a[name] = nn.Parameter(torch.empty(out_f, r))
            self.hada_w2_b[name] = nn.Parameter(torch.empty(r, in_f))
            nn.init.kaiming_uniform_(self.hada_w1_a[name], a=math.sqrt(5))
            nn.init.kaiming_uniform_(self.hada_w1_b[name], a=math.sqrt(5))
            nn.init.kaiming_uniform_(self.hada_w2_a[name], a=math.sqrt(5))
            nn.init.zeros_(self.hada_w2_b[name])


class _PeftIA3AdaLoRA(nn.Module):
    """peft/tuners/ia3/layer.py ``update_layer``: ``nn.Parameter(torch.randn(...))`` then
    ``constant_(…, 1.0)`` (the randn draws still advance the stream); peft/tuners/adalora
    ``update_layer``: ``lora_E`` / ``lora_A`` / ``lora_B`` from ``torch.randn``, a frozen
    ``ranknum`` whose ``.data.fill_(float(r))`` sets it, then zeros_ / normal_(0.02)."""

    def __init__(self, base: nn.Linear, r: int = 2) -> None:
        super().__init__()
        self.base_layer = base
        out_f, in_f = base.weight.shape
        self.ia3_l = nn.ParameterDict({"default": nn.Parameter(torch.randn((out_f, 1)))})
        nn.init.constant_(self.ia3_l["default"], 1.0)
        self.lora_A = nn.ParameterDict({"default": nn.Parameter(torch.randn(r, in_f))})
        self.lora_E = nn.ParameterDict({"default": nn.Parameter(torch.randn(r, 1))})
        self.lora_B = nn.ParameterDict({"default": nn.Parameter(torch.randn(out_f, r))})
        self.ranknum = nn.ParameterDict(
            {"default": nn.Parameter(torch.randn(1), requires_grad=False)}
        )
        self.ranknum["default"].data.fill_(float(r))
        self.ranknum["default"].requires_grad = False
        nn.init.zeros_(self.lora_E["default"])
        nn.init.normal_(self.lora_A["default"], mean=0.0, std=0.02)
        nn.init.normal_(self.lora_B["default"], mean=0.0, std=0.02)


class _PeftPromptEmbedding(nn.Module):
    """peft/tuners/prompt_tuning/model.py ``PromptEmbedding`` with ``init=TEXT``: rows of the
    model's word embeddings looked up by ``torch.LongTensor(init_token_ids)``, detached,
    cloned and made the new embedding's Parameter ``.to(torch.float32)``."""

    def __init__(self, word_embeddings: nn.Embedding, num_virtual_tokens: int = 5) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_virtual_tokens, word_embeddings.embedding_dim)
        init_token_ids = [3, 1, 4]
        num_text_tokens = len(init_token_ids)
        if num_text_tokens > num_virtual_tokens:
            init_token_ids = init_token_ids[:num_virtual_tokens]
        elif num_text_tokens < num_virtual_tokens:
            num_reps = math.ceil(num_virtual_tokens / num_text_tokens)
            init_token_ids = init_token_ids * num_reps
        init_token_ids = init_token_ids[:num_virtual_tokens]
        init_token_ids = torch.LongTensor(init_token_ids).to(word_embeddings.weight.device)
        with torch.no_grad():
            word_embedding_weights = word_embeddings(init_token_ids).detach().clone()
        word_embedding_weights = word_embedding_weights.to(torch.float32)
        self.embedding.weight = nn.Parameter(word_embedding_weights)


def _peft_prompt_tuning() -> nn.Module:
    m = nn.Module()
    m.word_embeddings = nn.Embedding(6, 4)
    m.prompt = _PeftPromptEmbedding(m.word_embeddings)
    return m


_REAL_BASE: dict[str, nn.Linear] = {}


def _real_base() -> nn.Linear:
    """A base layer loaded before the block (built once, outside any recording)."""
    if "base" not in _REAL_BASE:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(123)
            _REAL_BASE["base"] = nn.Linear(4, 3)
    return _REAL_BASE["base"]


_real_base()  # before the global-state guard's first snapshot


def _with_stem(layer: Callable[[], nn.Module]) -> nn.Module:
    """``layer`` (buffers only) after a conv stem, as in a timm model."""
    m = nn.Module()
    m.stem = nn.Conv2d(3, 3, 1)
    m.layer = layer()
    return m


# == the cases ==============================================================================


@dataclass
class Case:
    build: Callable[[], nn.Module]
    seed: int = 0
    dtype: torch.dtype | None = None  # the process default dtype for all three steps
    order: tuple[str, ...] = ()  # submodules materialized one at a time before the whole
    no_grad: bool = False  # eager and replayable builds inside torch.no_grad()
    outcome: dict[bool, str] | str = EXACT
    because: str | None = None
    xfail: dict[bool, str] | str | None = None

    def kind(self, include_buffers: bool) -> str:
        if isinstance(self.outcome, dict):
            return self.outcome.get(include_buffers, EXACT)
        return self.outcome

    def broken(self, include_buffers: bool) -> str | None:
        if isinstance(self.xfail, dict):
            return self.xfail.get(include_buffers)
        return self.xfail


CASES: dict[str, Case] = {
    # -- timm
    "timm ViT init_weights '' (trunc_normal_, LayerScale, needs_reset=False)": Case(
        lambda: _TimmViT(""), order=("blocks.1", "blocks.0.ls2")
    ),
    "timm ViT init_weights jax_nlhb (lecun_normal_, head_bias)": Case(
        lambda: _TimmViT("jax_nlhb"), seed=7, order=("head", "patch_embed")
    ),
    "timm ViT moco + fix_init_weight div_ under float64 default": Case(
        lambda: _TimmViT("moco", fix_init=True),
        seed=3,
        dtype=torch.float64,
        order=("blocks.0.attn",),
    ),
    "timm ViT built under torch.no_grad(), seed 2**31": Case(
        lambda: _TimmViT("", fix_init=True), seed=2**31, no_grad=True, order=("blocks.1.mlp",)
    ),
    "timm BlurPool2d torch.tensor(device='cpu') copy_ into empty buffer": Case(
        lambda: _with_stem(_BlurPool2d), order=("stem",)
    ),
    "timm RotaryEmbedding _freq_buffer_dtype under float64 default": Case(
        lambda: _with_stem(_TimmRotaryEmbedding), dtype=torch.float64, order=("layer",)
    ),
    "timm RotaryEmbedding .half() re-registers bands in _apply": Case(
        _timm_rope_half, order=("rope",)
    ),
    "timm reinit_non_persistent_buffers in the build": Case(
        _TimmReinitBuffers, seed=5, order=("blur", "rope")
    ),
    "timm LambdaLayer rel_pos_indices copy_ on its device": Case(_TimmLambdaLayer, seed=9),
    "timm GluMlp init_weights into halves of fc1": Case(_TimmGluMlp, order=("fc2", "fc1")),
    "timm CondConv2d per-expert weight[i].view init": Case(_TimmCondConv2d, seed=17),
    # params-only: the BN statistics stay real while gamma is on meta, and ``gamma / std``
    # mixes a meta and a CPU tensor: torch raises in the build (accelerate's
    # ``init_empty_weights(include_buffers=False)`` raises the same); not a replay question
    "timm MobileOne reparameterize (.data =, detach_, delattr)": Case(
        _timm_mobileone_reparameterized,
        outcome={False: BUILD_RAISES},
        because="is not on the expected device meta",
    ),
    "timm diff-attention lambda normal_": Case(_TimmDiffAttention, seed=21, dtype=torch.float64),
    "timm ConvNeXt head_init_scale data.mul_": Case(_TimmConvNeXtHead, order=("head.fc",)),
    "timm GlobalContext kaiming_normal_ + zeros_": Case(_TimmGlobalContext, order=("fc2",)),
    "timm variance_scaling_ every mode": Case(_timm_variance_scaling_mix, order=("d", "b")),
    "timm MAE numpy sincos copy_ under no_grad into frozen Parameter": Case(
        _TimmMaeNumpyPosEmbed, order=("proj",)
    ),
    # -- torchtitan
    "torchtitan Decoder init_states tied, rope on cache.device": Case(
        _TitanDecoder, seed=3, order=("layers.1", "rope", "lm_head")
    ),
    "torchtitan Decoder init_states(buffer_device=cpu), float64 default": Case(
        lambda: _TitanDecoder(buffer_device=torch.device("cpu")),
        dtype=torch.float64,
        order=("tok_embeddings",),
    ),
    "torchtitan Decoder untied, embedding normal_, built under no_grad": Case(
        lambda: _TitanDecoder(tie=False),
        seed=11,
        no_grad=True,
        order=("tok_embeddings", "layers.0.feed_forward"),
    ),
    "torchtitan Decoder tied, tok_embeddings then lm_head (one tensor, two owners)": Case(
        _TitanDecoder, seed=19, order=("tok_embeddings", "lm_head", "layers.0.attention.wo")
    ),
    "torchtitan Decoder under bfloat16 default dtype": Case(
        _TitanDecoder, dtype=torch.bfloat16, order=("layers.0",)
    ),
    "timm ViT jax under bfloat16 default dtype": Case(
        lambda: _TimmViT("jax"), dtype=torch.bfloat16, seed=5
    ),
    "torchtitan torch.device('meta') submodule kept in the model": Case(
        _titan_meta_submodule_kept,
        outcome=REFUSED,
        because=_ASKED_META,
    ),
    "timm dd kwargs device='meta' probe head, then the real head": Case(
        _timm_meta_dd_probe, outcome=REFUSED, because=_ASKED_META
    ),
    "torchtitan MoE experts / router / counters, experts first": Case(
        _TitanMoE, seed=13, order=("experts", "shared_experts.w2")
    ),
    "torchtitan set_determinism manual_seed mid-build": Case(
        _titan_seeded_mid_build, seed=1, order=("late", "early")
    ),
    "torchtitan per-layer fork_rng + manual_seed(base + id)": Case(
        _titan_per_layer_fork_rng, order=("layers.2", "layers.0")
    ),
    "torchtitan torch.device('meta') skeleton discarded, then a real layer": Case(
        _titan_meta_probe_then_layer, outcome=REFUSED, because=_ASKED_META
    ),
    "torchtitan torch.device('meta') skeleton, to_empty(cpu), init in the build": Case(
        _TitanMetaSkeleton, outcome=REFUSED, because=_ASKED_META
    ),
    "torchtitan meta placeholder buffer replaced on buffer_device": Case(
        _TitanMetaPlaceholderBuffer
    ),
    "torchtitan complex freqs_cis then model.to(bfloat16)": Case(_titan_freqs_cis_module_to("to")),
    "torchtitan complex freqs_cis then model.bfloat16()": Case(
        _titan_freqs_cis_module_to("bfloat16")
    ),
    # -- transformers
    "transformers CLIP init (torch.tensor logit_scale) under float64 default": Case(
        _HfClip, dtype=torch.float64, order=("position_embedding",)
    ),
    "transformers CLIP init factor 2, seed 99": Case(lambda: _HfClip(factor=2.0), seed=99),
    "transformers post_init tie + padded bias, lm_head first": Case(
        _HfTiedLM, order=("lm_head", "layer")
    ),
    "transformers Mixtral 3D experts + router, experts first": Case(
        _HfMixtralExperts, seed=4, order=("experts",)
    ),
    "transformers Mamba2 dt_bias inverse softplus copy_": Case(
        _HfMamba2Params, seed=8, dtype=torch.float64
    ),
    "transformers llama3 rotary (original_inv_freq alias), rotary first": Case(
        _hf_llama_with_rotary, order=("rotary_emb", "layers.1")
    ),
    "transformers wav2vec2 weight_norm pos conv + init of computed weight": Case(
        _HfWav2Vec2PosConv
    ),
    "transformers MultiheadAttention in_proj normal_": Case(_HfMha, seed=6, order=("attn",)),
    # -- diffusers
    "diffusers DiT initialize_weights, blocks one at a time": Case(
        _DiffusersDiT, seed=12, order=("blocks.1", "x_embedder", "blocks.0")
    ),
    "diffusers LoRALinearLayer per projection, under no_grad": Case(
        _diffusers_attn_lora_procs, no_grad=True, order=("procs.v", "procs.q")
    ),
    "diffusers timestep embedding flip/shift/scale + Gaussian Fourier": Case(
        _diffusers_timestep_scale_shift, seed=2
    ),
    # -- PEFT
    "peft LoHa ParameterDict adapters on a real base": Case(
        lambda: _PeftLoHaLayer(_real_base(), adapters=("default", "other")),
        order=("hada_w2_a",),
    ),
    "peft IA3 randn-then-constant + AdaLoRA ranknum data.fill_": Case(
        lambda: _PeftIA3AdaLoRA(_real_base()), seed=31, order=("lora_B", "ranknum")
    ),
    "peft prompt tuning from word embeddings built in the block": Case(
        _peft_prompt_tuning, order=("prompt",)
    ),
}


def _cases() -> list:
    params = []
    for name, case in CASES.items():
        for mode in MODES:
            broken = case.broken(mode)
            marks = [pytest.mark.xfail(strict=True, reason=broken)] if broken else []
            params.append(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}"))
    return params


def _under(case: Case):
    return default_dtype(case.dtype) if case.dtype is not None else contextlib.nullcontext()


def _build_fn(case: Case) -> Callable[[], nn.Module]:
    if not case.no_grad:
        return case.build

    def build() -> nn.Module:
        with torch.no_grad():
            return case.build()

    return build


@pytest.mark.parametrize(("name", "include_buffers"), _cases())
def test_library_idioms_exact_or_refused_upfront(name: str, include_buffers: bool) -> None:
    case = CASES[name]
    build = _build_fn(case)
    with _under(case):
        ref = build_eagerly(build, case.seed)
        kind = case.kind(include_buffers)
        if kind == BUILD_RAISES:
            with pytest.raises(RuntimeError, match=case.because):
                build_empty(build, include_buffers, case.seed)
            return
        model = build_empty(build, include_buffers, case.seed)
        if kind == REFUSED:
            assert_refused(model, because=case.because)
            return
        if kind == EITHER:
            assert_exact_or_refused(model, ref, because=case.because)
            return
        assert any(t.is_meta for t in tensors(model).values()), "nothing was built on meta"
        for sub in case.order:
            materialize_exactly(model.get_submodule(sub), ref.get_submodule(sub))
        materialize_exactly(model, ref)


# == materialize called under the caller's own contexts =====================================


@contextlib.contextmanager
def _inside_other_empty_weights(include_buffers: bool):
    """A second, non-replayable ``empty_weights`` block around ``materialize`` (building the
    next model on meta while materializing this one)."""
    with metamode.empty_weights(include_buffers=include_buffers):
        yield


CALLER_CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "torch.no_grad()": torch.no_grad,
    "torch.inference_mode()": torch.inference_mode,
    "torch.device('cpu')": lambda: torch.device("cpu"),
    "torch.device('meta')": lambda: torch.device("meta"),
    "torch.autocast('cpu', bfloat16)": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "empty_weights()": lambda: _inside_other_empty_weights(False),
    "empty_weights(include_buffers=True)": lambda: _inside_other_empty_weights(True),
}

CALLER_BROKEN: dict[str, str] = {}


def _caller_cases() -> list:
    params = []
    for name in CALLER_CONTEXTS:
        for mode in MODES:
            marks = []
            if name in CALLER_BROKEN:
                marks = [pytest.mark.xfail(strict=True, reason=CALLER_BROKEN[name])]
            params.append(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}"))
    return params


@pytest.mark.parametrize(("context", "include_buffers"), _caller_cases())
def test_materialize_under_the_callers_contexts(context: str, include_buffers: bool) -> None:
    """torchtitan's decoder (tied, complex rope cache, trunc_normal_) materialized a block at a
    time, then whole, inside a context the caller has open: replay runs each call under its
    own recorded state, whatever the caller's."""
    ref = build_eagerly(_TitanDecoder, 3)
    model = build_empty(_TitanDecoder, include_buffers, 3)
    with CALLER_CONTEXTS[context]():
        state = torch.default_generator.get_state()
        metamode.materialize(model.get_submodule("layers.1"))
        metamode.materialize(model)
        assert torch.equal(torch.default_generator.get_state(), state)
    assert_same_tensors(model, ref)


# == the process default dtype at materialize time ==========================================


def _explicit_dtypes() -> nn.Module:
    """torchtitan / timm with ``dtype=`` passed everywhere (``factory_kwargs``): nothing
    reads the process default."""
    m = nn.Module()
    m.lin = nn.Linear(4, 4, dtype=torch.float32)
    m.emb = nn.Embedding(5, 4, dtype=torch.float32)
    with torch.no_grad():
        nn.init.trunc_normal_(m.lin.weight, std=0.02, a=-0.04, b=0.04)
    m.register_buffer("inv", 1.0 / (10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4)))
    return m


def _default_dtyped() -> nn.Module:
    """The same layers without ``dtype=``: factories whose dtype is the process default (the
    recording keeps the dtype they got) and CLIP's ``torch.tensor(logit_scale_init_value)``."""
    m = nn.Module()
    m.lin = nn.Linear(4, 4)
    m.emb = nn.Embedding(5, 4)
    m.logit_scale = nn.Parameter(torch.tensor(2.6592))
    return m


def _promoted() -> nn.Module:
    """A value whose dtype comes from type promotion with a Python float (timm's
    ``torch.arange(n) * scale`` grids, diffusers' ``arange(...) / half_dim``)."""
    m = _default_dtyped()
    m.register_buffer("grid", torch.arange(4) * 0.5, persistent=False)
    return m


@pytest.mark.parametrize("include_buffers", MODES)
def test_explicit_dtypes_built_under_float64_materialize_under_float32(include_buffers):
    """Built (and eager) under a float64 default but with every dtype explicit: nothing
    depends on the default, so materialize under float32 is exact (not over-refused)."""
    with default_dtype(torch.float64):
        ref = build_eagerly(_explicit_dtypes, 4)
        model = build_empty(_explicit_dtypes, include_buffers, 4)
    materialize_exactly(model.get_submodule("emb"), ref.get_submodule("emb"))
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_default_dtyped_factories_under_another_default_keep_their_dtype(include_buffers):
    """Factories built under a float64 default keep the float64 eager gave them when
    materialized under float32: exact (the recording holds their dtype)."""
    with default_dtype(torch.float64):
        ref = build_eagerly(_default_dtyped, 4)
        model = build_empty(_default_dtyped, include_buffers, 4)
    materialize_exactly(model, ref)


def test_a_promoted_dtype_under_another_default_is_refused_naming_it():
    """A value computed by type promotion under a float64 default, materialized under float32:
    the documented refusal names it and the default dtype, before anything changes."""
    with default_dtype(torch.float64):
        model = build_empty(_promoted, True, 4)
    assert_refused(model, "grid", because=r"default dtype torch\.float64")


@pytest.mark.parametrize("include_buffers", MODES)
def test_reseeding_between_submodule_materializes_changes_nothing(include_buffers):
    """``torch.manual_seed`` between materializing blocks (a training script seeding its data
    loader): replay uses private generators, so each block is eager's of the build's seed."""
    ref = build_eagerly(lambda: _TimmViT("jax"), 1234)
    model = build_empty(lambda: _TimmViT("jax"), include_buffers, 1234)
    for seed, sub in ((7, "blocks.1"), (8, "head"), (9, "blocks.0")):
        torch.manual_seed(seed)
        materialize_exactly(model.get_submodule(sub), ref.get_submodule(sub))
    torch.manual_seed(0)
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_base_overwritten_after_its_materialize_does_not_leak_into_the_prompt(include_buffers):
    """PEFT prompt tuning: the word embeddings are materialized first, then a checkpoint is
    copied into them; the prompt embedding (computed in the build from the word embeddings)
    still gets eager's value, and the overwritten base is kept as loaded."""
    ref = build_eagerly(_peft_prompt_tuning, 2)
    model = build_empty(_peft_prompt_tuning, include_buffers, 2)
    materialize_exactly(model.word_embeddings, ref.word_embeddings)
    loaded = torch.full((6, 4), 7.0)
    with torch.no_grad():
        model.word_embeddings.weight.copy_(loaded)
    materialize_exactly(model.prompt, ref.prompt)
    metamode.materialize(model)
    assert torch.equal(model.word_embeddings.weight, loaded)


# == draws into a tensor on meta the build asked for itself ===================================


def _draws_then_a_layer(draw: Callable[[], object]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        draw()
        return nn.Sequential(nn.Linear(3, 3))

    return build


_OUTSIDE_META: list[nn.Module] = []


def _outside_meta_layer() -> nn.Module:
    if not _OUTSIDE_META:
        with torch.device("meta"):
            _OUTSIDE_META.append(nn.Linear(4, 4))
    return _OUTSIDE_META[0]


ASKED_META_DRAWS = {
    "torch.randn(device='meta')": lambda: torch.randn(4, device="meta"),
    "torch.rand(device=torch.device('meta'))": lambda: torch.rand(4, device=torch.device("meta")),
    "normal_ on torch.empty(device='meta')": lambda: torch.empty(4, device="meta").normal_(),
    "nn.init on .to('meta')": lambda: nn.init.uniform_(torch.zeros(4).to("meta")),
    "rand_like of a tensor made on meta": lambda: torch.rand_like(torch.empty(4, device="meta")),
    "reset_parameters of a layer made on meta outside the block": lambda: (
        _outside_meta_layer().reset_parameters()
    ),
}


@pytest.mark.parametrize(
    ("idiom", "include_buffers"),
    [(idiom, mode) for idiom in sorted(ASKED_META_DRAWS) for mode in MODES],
)
def test_a_draw_into_meta_the_build_asked_for_refuses_the_draws_after_it(idiom, include_buffers):
    """Eager draws nothing there (a meta kernel), or something, if the device was read off a
    tensor the context placed and turned into a string: the draws after it are refused."""
    build = _draws_then_a_layer(ASKED_META_DRAWS[idiom])
    _outside_meta_layer()  # made before either build
    model = build_empty(build, include_buffers)
    assert_refused(model, "0.weight", "0.bias", because=_ASKED_META)


def _draw_on_a_placed_device() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 3))
    model.register_buffer("noise", torch.randn(3, device=model[0].weight.device))
    return model


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_draw_on_the_device_read_off_a_placed_tensor_is_exact(include_buffers):
    ref = build_eagerly(_draw_on_a_placed_device)
    model = build_empty(_draw_on_a_placed_device, include_buffers)
    materialize_exactly(model, ref)
