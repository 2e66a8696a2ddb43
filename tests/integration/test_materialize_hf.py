"""metamode.materialize on transformers and diffusers models: bitwise equal to eager."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from diffusers import AutoencoderKL, UNet2DConditionModel, UNet2DModel

import metamode
from tests.unit.contexts.test_materialize import MODES, assert_eager_equal

pytestmark = pytest.mark.filterwarnings("ignore")


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

DIFFUSERS = {
    "unet2d": lambda: UNet2DModel(**_UNET2D),
    "unet2d_condition_from_config": lambda: UNet2DConditionModel.from_config(_COND_UNET),
    "autoencoder_kl": lambda: AutoencoderKL(**_VAE),
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
