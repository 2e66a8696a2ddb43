"""metamode.materialize on transformers and diffusers models: bitwise equal to eager."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from diffusers import (
    AutoencoderKL,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
    UNet2DModel,
)

import metamode
from tests.unit.contexts.materialize_checks import MODES, assert_eager_equal

# the recorder reads frames and source positions: every interpreter cell runs the zoo
pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.per_interpreter]


def _llama_config(**extra):
    return tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )


def _mixtral_config():
    return tf.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )


def _t5_config():
    return tf.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
    )


_GEMMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)

TRANSFORMERS = {
    "llama_rope": lambda: tf.LlamaForCausalLM(_llama_config()),
    "llama_bfloat16_from_config": lambda: tf.AutoModelForCausalLM.from_config(
        _llama_config(), dtype=torch.bfloat16
    ),
    "llama_tied_from_config": lambda: tf.AutoModelForCausalLM.from_config(
        _llama_config(tie_word_embeddings=True)
    ),
    "gpt2_tied": lambda: tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    ),
    "bert_position_ids": lambda: tf.BertModel(
        tf.BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
        )
    ),
    "vit": lambda: tf.ViTModel(
        tf.ViTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=16,
            patch_size=8,
        )
    ),
    "clip_vision_from_config": lambda: tf.AutoModel.from_config(
        tf.CLIPVisionConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=16,
            patch_size=8,
        )
    ),
    "mixtral_moe": lambda: tf.MixtralForCausalLM(_mixtral_config()),
    "mixtral_moe_bfloat16_from_config": lambda: tf.AutoModelForCausalLM.from_config(
        _mixtral_config(), dtype=torch.bfloat16
    ),
    "qwen2_moe_shared_expert": lambda: tf.Qwen2MoeForCausalLM(
        tf.Qwen2MoeConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        )
    ),
    "t5_encoder_decoder_tied": lambda: tf.T5ForConditionalGeneration(_t5_config()),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**_GEMMA)),
    "gemma2_sliding_window": lambda: tf.Gemma2ForCausalLM(
        tf.Gemma2Config(**_GEMMA, sliding_window=16)
    ),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
    ),
    "falcon": lambda: tf.FalconForCausalLM(
        tf.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    ),
    "falcon_new_decoder_architecture": lambda: tf.FalconForCausalLM(
        tf.FalconConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
        )
    ),
}

_UNET2D = dict(
    sample_size=8,
    in_channels=3,
    out_channels=3,
    block_out_channels=(8, 16),
    layers_per_block=1,
    norm_num_groups=4,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D"),
)
_COND_UNET = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(8, 16),
    layers_per_block=1,
    norm_num_groups=4,
    cross_attention_dim=16,
    attention_head_dim=2,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
)
_VAE = dict(
    block_out_channels=(8, 16),
    norm_num_groups=4,
    latent_channels=4,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
)

_FLUX = dict(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=16,
    pooled_projection_dim=8,
    axes_dims_rope=(2, 2, 4),
)
_SD3 = dict(
    sample_size=8,
    patch_size=2,
    in_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=16,
    caption_projection_dim=16,
    pooled_projection_dim=8,
    out_channels=4,
    pos_embed_max_size=8,
)

DIFFUSERS = {
    "unet2d": lambda: UNet2DModel(**_UNET2D),
    "unet2d_condition_from_config": lambda: UNet2DConditionModel.from_config(_COND_UNET),
    "autoencoder_kl": lambda: AutoencoderKL(**_VAE),
    "flux_transformer": lambda: FluxTransformer2DModel(**_FLUX),
    "flux_transformer_guidance_embeds": lambda: FluxTransformer2DModel(
        **_FLUX, guidance_embeds=True
    ),
    "sd3_transformer": lambda: SD3Transformer2DModel(**_SD3),
    "sd35_transformer_dual_attention_qk_norm": lambda: SD3Transformer2DModel(
        **_SD3, dual_attention_layers=(0,), qk_norm="rms_norm"
    ),
}


# transformers adds torch.nn.Module.smart_apply on its first initialize_weights;
# do that before the suite's torch-state guard takes its first snapshot.
for _build in TRANSFORMERS.values():
    _build()


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_transformers_models_equal_eager(name, include_buffers):
    # transformers skips its weight init when it sees the meta device; its shim shows the
    # build what eager construction sees
    with metamode.enabled("transformers"):
        assert_eager_equal(TRANSFORMERS[name], include_buffers)


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_transformers_models_with_buffers_equal_eager_without_the_shim(name):
    """transformers' device probe sees, inside a replayable context, what eager construction
    sees: its weight initialisation runs and is replayed, with no library name rebound."""
    assert not metamode.is_enabled("transformers")
    assert_eager_equal(TRANSFORMERS[name], include_buffers=True)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", sorted(DIFFUSERS))
def test_diffusers_models_equal_eager(name, include_buffers):
    assert_eager_equal(DIFFUSERS[name], include_buffers)


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialized_llama_generates_like_eager(include_buffers):
    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(_llama_config())
    with metamode.enabled("transformers"):
        model = assert_eager_equal(lambda: tf.LlamaForCausalLM(_llama_config()), include_buffers)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialized_mixtral_routes_like_eager(include_buffers):
    torch.manual_seed(0)
    ref = tf.MixtralForCausalLM(_mixtral_config())
    with metamode.enabled("transformers"):
        model = assert_eager_equal(
            lambda: tf.MixtralForCausalLM(_mixtral_config()), include_buffers
        )
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialized_t5_encodes_and_decodes_like_eager(include_buffers):
    torch.manual_seed(0)
    ref = tf.T5ForConditionalGeneration(_t5_config())
    with metamode.enabled("transformers"):
        model = assert_eager_equal(
            lambda: tf.T5ForConditionalGeneration(_t5_config()), include_buffers
        )
    inputs = dict(
        input_ids=torch.tensor([[1, 2, 3, 4]]), decoder_input_ids=torch.tensor([[0, 5, 6]])
    )
    # eval: T5's dropout would draw from the default generator in each forward
    assert torch.equal(model.eval()(**inputs).logits, ref.eval()(**inputs).logits)


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialized_flux_transformer_denoises_like_eager(include_buffers):
    torch.manual_seed(0)
    ref = FluxTransformer2DModel(**_FLUX)
    model = assert_eager_equal(lambda: FluxTransformer2DModel(**_FLUX), include_buffers)
    generator = torch.Generator().manual_seed(2)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 4, generator=generator),
        encoder_hidden_states=torch.randn(1, 3, 16, generator=generator),
        pooled_projections=torch.randn(1, 8, generator=generator),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(4, 3),
        txt_ids=torch.zeros(3, 3),
    )
    assert torch.equal(model(**inputs).sample, ref(**inputs).sample)
