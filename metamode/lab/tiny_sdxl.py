"""Tiny, hub-free SDXL pipeline and synthetic LoRA for end-to-end tests and benchmarks.

Why this exists: the bug metamode fixes is only convincing when reproduced through the
real user-facing path, ``StableDiffusionXLPipeline.load_lora_weights`` (diffusers ->
PEFT ``inject_adapter_in_model`` under ``init_empty_weights`` -> ``load_state_dict(...,
assign=True)``). Real SDXL checkpoints are gigabytes and need the network, so this module
builds an architecturally faithful SDXL pipeline (``addition_embed_type="text_time"``
UNet, KL VAE, Euler scheduler) from in-code configs with random weights, small enough
that a denoising step takes milliseconds on a CPU.

Text encoders and tokenizers are deliberately ``None``: the SDXL pipeline accepts that
when ``prompt_embeds``/``pooled_prompt_embeds`` (and the negative ones) are passed
directly, and ``load_lora_weights`` simply skips text-encoder loading when the state
dict has no text-encoder keys. That avoids tokenizer files, which cannot be built
without a download.

This module is private: it is imported only by tests, benchmarks and notebooks, never
by ``metamode/__init__.py``, so metamode itself does not depend on diffusers. It also
has no metamode imports, so it can be loaded by file path into a process that must
run against *stock* PEFT.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from metamode.lab.threads import wait

if TYPE_CHECKING:
    from diffusers import StableDiffusionXLPipeline

# Architecture constants, shared by the builder, the LoRA generator and run_latents.
_CROSS_ATTENTION_DIM = 16
_POOLED_DIM = 8  # stands in for text_encoder_2.config.projection_dim (1280 in real SDXL)
_ADDITION_TIME_EMBED_DIM = 4
# SDXL's add_time_ids are 6 numbers (original size, crop top-left, target size), each
# Fourier-embedded to addition_time_embed_dim, then concatenated with the pooled text
# embedding. The UNet's add_embedding input width must match exactly.
_PROJECTION_INPUT_DIM = 6 * _ADDITION_TIME_EMBED_DIM + _POOLED_DIM
_SEQ_LEN = 4
_LATENT_CHANNELS = 4
_LATENT_SIZE = 8
_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def _reinit_from_generator(model: nn.Module, generator: torch.Generator) -> None:
    """Overwrite every randomly-initialised parameter using a private generator.

    Why: module constructors draw from torch's *global* RNG, so two builds with the same
    seed would differ if anything else (another thread, a test) consumed global random
    numbers in between. Re-drawing the Linear/Conv weights from a local generator, in a
    fixed (named_modules) order, makes the result a pure function of ``seed``. The
    remaining parameters (GroupNorm/LayerNorm affine) are constant-initialised by torch
    and therefore already deterministic. The distribution mimics torch's default
    kaiming-uniform bound 1/sqrt(fan_in) so activations stay in a sane range.
    """
    with torch.no_grad():
        for _name, module in model.named_modules():
            if not isinstance(module, (nn.Linear, nn.Conv2d)):
                continue
            fan_in = module.weight[0].numel()
            bound = 1.0 / fan_in**0.5
            for param in (module.weight, module.bias):
                if param is not None:
                    fresh = torch.rand(param.shape, generator=generator, dtype=param.dtype)
                    param.copy_(fresh * (2 * bound) - bound)


def build_tiny_sdxl_pipeline(seed: int = 0) -> StableDiffusionXLPipeline:
    """Build a tiny SDXL pipeline (random weights, no text encoders) deterministically.

    Why deterministic: the e2e tests compare latents from pipelines whose LoRAs were loaded
    concurrently against freshly built reference pipelines loaded sequentially, with
    ``torch.equal``. That only works if the same ``seed`` always yields bit-identical
    weights, regardless of the global RNG state or the thread that builds it.

    Note: if ``torch.nn.Module.register_parameter`` is currently patched (e.g. by a leaked
    PEFT ``init_empty_weights``), the pipeline's parameters end up on ``meta`` and the
    re-initialisation below fails loudly -- which is the desired signal.
    """
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )

    generator = torch.Generator().manual_seed(seed)

    unet = UNet2DConditionModel(
        sample_size=_LATENT_SIZE,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 1),
        use_linear_projection=True,
        cross_attention_dim=_CROSS_ATTENTION_DIM,
        norm_num_groups=4,
        # SDXL-specific micro-conditioning: time ids + pooled text embedding.
        addition_embed_type="text_time",
        addition_time_embed_dim=_ADDITION_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=_PROJECTION_INPUT_DIM,
    )
    # One block -> vae_scale_factor == 1; the VAE is never run (output_type="latent")
    # but the pipeline requires one for its config.
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=2,
        sample_size=_LATENT_SIZE,
    )
    _reinit_from_generator(unet, generator)
    _reinit_from_generator(vae, generator)
    unet.eval()
    vae.eval()

    scheduler = EulerDiscreteScheduler.from_config(
        {
            "num_train_timesteps": 1000,
            "beta_start": 0.00085,
            "beta_end": 0.012,
            "beta_schedule": "scaled_linear",
            "prediction_type": "epsilon",
            "timestep_spacing": "leading",
            "steps_offset": 1,
        }
    )
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=None,
        text_encoder_2=None,
        tokenizer=None,
        tokenizer_2=None,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def lora_target_module_names(pipe: StableDiffusionXLPipeline) -> list[str]:
    """Names (relative to ``pipe.unet``) of the attention projections a LoRA targets.

    Why: both the LoRA generator and test assertions (e.g. "no LoRA param on meta") need the
    same, deterministically ordered list of target layers.
    """
    names: list[str] = []
    for name, module in pipe.unet.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if ".attn1." not in name and ".attn2." not in name:
            continue
        if name.endswith(tuple("." + t for t in _LORA_TARGETS)):
            names.append(name)
    return names


def synthetic_lora_state_dict(
    pipe: StableDiffusionXLPipeline, rank: int = 4, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Make a random LoRA for the UNet attention projections, in diffusers/PEFT key format.

    Keys are ``unet.<module>.lora_A.weight`` (rank x in) and ``unet.<module>.lora_B.weight``
    (out x rank), which ``pipe.load_lora_weights(sd, adapter_name=...)`` accepts as-is.
    Why lora_B is non-zero: a freshly-initialised LoRA has B == 0 and would not change the
    output, so a corrupted (meta / garbage) adapter could go unnoticed; random B makes the
    adapter's contribution visible in the latents. Must be called on a pipeline that has
    no adapters yet (it reads ``nn.Linear`` shapes, which PEFT wraps after loading).
    """
    generator = torch.Generator().manual_seed(10_000 + seed)
    state_dict: dict[str, torch.Tensor] = {}
    modules = dict(pipe.unet.named_modules())
    for name in lora_target_module_names(pipe):
        linear = modules[name]
        assert isinstance(linear, nn.Linear)
        fan_in, fan_out = linear.in_features, linear.out_features
        lora_a = torch.randn((rank, fan_in), generator=generator) / fan_in**0.5
        lora_b = torch.randn((fan_out, rank), generator=generator) * (0.5 / rank**0.5)
        state_dict[f"unet.{name}.lora_A.weight"] = lora_a
        state_dict[f"unet.{name}.lora_B.weight"] = lora_b
    if not state_dict:
        raise RuntimeError("no LoRA targets found; was the pipeline already wrapped by PEFT?")
    return state_dict


def run_latents(pipe: StableDiffusionXLPipeline, seed: int = 0, steps: int = 2) -> torch.Tensor:
    """Run ``steps`` denoising steps with fixed random prompt embeddings; return latents.

    Why latents: decoding through the VAE adds nothing to the bug under test (it lives in
    the UNet's LoRA layers) and costs time. Embeddings and initial noise come from a
    private generator, so the output is a pure function of (weights, adapters, seed).
    """
    generator = torch.Generator().manual_seed(seed)

    def _randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    prompt_embeds = _randn(1, _SEQ_LEN, _CROSS_ATTENTION_DIM)
    negative_prompt_embeds = _randn(1, _SEQ_LEN, _CROSS_ATTENTION_DIM)
    pooled_prompt_embeds = _randn(1, _POOLED_DIM)
    negative_pooled_prompt_embeds = _randn(1, _POOLED_DIM)
    with torch.no_grad():
        out = pipe(
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            height=_LATENT_SIZE,
            width=_LATENT_SIZE,
            num_inference_steps=steps,
            guidance_scale=5.0,
            generator=generator,
            output_type="latent",
        )
    return out.images


class _ForcedOverlap:
    """Wraps PEFT's current ``init_empty_weights`` to force the interleaving that leaks.

    Why: with only a Barrier, whether two threads' contexts overlap in the fatal order is
    up to the scheduler (measured on 2 cores with a 1 us switch interval: 86 of 100
    rounds leaked). This wrapper makes it certain without modifying the context it wraps:
    on each thread's *first* entry, thread A enters, then B enters (stock PEFT: B captures
    A's patch as "the original"), then A exits (restores torch's function), then B exits
    (re-installs A's patch for good), and only then does A continue. Every other entry
    passes straight through. The wrapped context is whatever PEFT is bound to -- stock
    PEFT, or metamode's after ``metamode.enable_for_peft()`` -- so the same choreography
    both breaks stock and proves the fix.
    """

    def __init__(self, wrapped: Callable[..., AbstractContextManager[Any]], a: str, b: str):
        self.wrapped = wrapped
        self._roles = {a: "A", b: "B"}
        self._a_in = threading.Event()
        self._b_in = threading.Event()
        self._a_out = threading.Event()
        self._b_out = threading.Event()

    @contextmanager
    def __call__(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        role = self._roles.pop(threading.current_thread().name, None)
        if role == "B":
            wait(self._a_in, "A to enter")
        try:
            with self.wrapped(*args, **kwargs):
                if role == "A":
                    self._a_in.set()
                    wait(self._b_in, "B to enter")
                elif role == "B":
                    self._b_in.set()
                yield
                if role == "B":
                    wait(self._a_out, "A to exit")
        finally:
            if role == "A":
                self._a_out.set()
            elif role == "B":
                self._b_out.set()
        if role == "A":
            # Hold A until B has exited too: otherwise A could open its next context
            # before B's exit and, on stock PEFT, capture and later restore torch's
            # function, undoing the leak at random. After this point no open context
            # holds torch's original, so on stock the leak is permanent.
            wait(self._b_out, "B to exit")


def load_lora_concurrently(
    pipes: Sequence[StableDiffusionXLPipeline],
    state_dicts: Sequence[dict[str, torch.Tensor]],
    adapter_name: str,
    force_overlap: bool = False,
) -> None:
    """Call ``pipes[i].load_lora_weights(state_dicts[i], adapter_name=...)`` in parallel threads.

    This is the real-world trigger: independent pipelines (e.g. one per request-serving
    thread) loading LoRAs at the same time with diffusers' default
    ``low_cpu_mem_usage=True``. A Barrier releases all threads together and the GIL
    switch interval is cut to 1 microsecond so the threads interleave finely. With
    ``force_overlap`` (needs >= 2 pipes) the first two threads' first PEFT
    ``init_empty_weights`` contexts are additionally forced to overlap in the leaking
    order (see ``_ForcedOverlap``). Re-raises the first exception from any thread.
    """
    import peft.tuners.tuners_utils as tuners_utils

    if len(pipes) != len(state_dicts):
        raise ValueError("need one state dict per pipeline")
    names = [f"lora-loader-{i}" for i in range(len(pipes))]
    barrier = threading.Barrier(len(pipes))
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            barrier.wait()
            pipes[index].load_lora_weights(state_dicts[index], adapter_name=adapter_name)
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,), name=name) for i, name in enumerate(names)]
    bound = tuners_utils.init_empty_weights
    old_interval = sys.getswitchinterval()
    if force_overlap:
        if len(pipes) < 2:
            raise ValueError("force_overlap needs at least two pipelines")
        tuners_utils.init_empty_weights = _ForcedOverlap(bound, names[0], names[1])
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old_interval)
        tuners_utils.init_empty_weights = bound
    if errors:
        raise errors[0]


def lora_parameters_on_meta(pipe: StableDiffusionXLPipeline) -> tuple[int, int]:
    """(meta, total) counts of the UNet's LoRA parameters.

    Why: a LoRA weight left on ``meta`` is the silent failure mode -- ``F.linear`` with a
    meta weight and a CPU input returns uninitialised memory instead of raising.
    """
    lora = [p for n, p in pipe.unet.named_parameters() if ".lora_" in n]
    return sum(p.is_meta for p in lora), len(lora)
