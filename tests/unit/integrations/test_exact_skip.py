"""With a shim on, a library builds exactly the model it builds stock.

Single-threaded, under the same seed, every tensor whose stock value is
deterministic is ``torch.equal`` with the shim on, complete checkpoint or
not, and the random-number state after the load is the same (so the shim
skipped no more and no fewer random draws than stock).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import metamode
from metamode.integrations._exact_skip import SkipLibraryInit

diffusers = pytest.importorskip("diffusers")
from diffusers.models import modeling_utils  # noqa: E402

pytestmark = pytest.mark.per_interpreter


def _unet2d():
    return diffusers.UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(8, 8),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )


def _unet2d_condition():
    return diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        cross_attention_dim=8,
        attention_head_dim=2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )


def _autoencoder():
    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 8),
        norm_num_groups=4,
        latent_channels=2,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )


MODELS = {
    "UNet2DModel": _unet2d,
    "UNet2DCondition": _unet2d_condition,
    "AutoencoderKL": _autoencoder,
}


def _save(directory, build, drop_norms: bool) -> set[str]:
    """Save the model, maybe without some keys; returns the keys whose stock value
    after loading is arbitrary memory (skipped init, not in the checkpoint)."""
    torch.manual_seed(0)
    build().save_pretrained(directory)
    if drop_norms:
        path = directory / "diffusion_pytorch_model.safetensors"
        state = load_file(path)
        # GroupNorm/LayerNorm weights and biases (ones_/zeros_, which stock runs) and one
        # conv weight (kaiming_uniform_, which stock skips: arbitrary memory, not compared).
        dropped = [k for k in state if "norm" in k][:6]
        dropped += [next(k for k in state if k.endswith("conv.weight") or "conv_in.weight" in k)]
        for key in dropped:
            del state[key]
        save_file(state, path, metadata={"format": "pt"})
        return {dropped[-1]}
    return set()


def _load(cls, directory, low_cpu_mem_usage: bool):
    torch.manual_seed(1234)
    model = cls.from_pretrained(directory, low_cpu_mem_usage=low_cpu_mem_usage)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return tensors, torch.get_rng_state()


def _assert_same_model(stock_runs, shimmed, arbitrary: set[str]) -> None:
    (stock, stock_rng), (again, again_rng) = stock_runs
    tensors, rng = shimmed
    assert torch.equal(stock_rng, again_rng)
    assert torch.equal(rng, stock_rng), "the shim drew a different amount of random numbers"
    assert tensors.keys() == stock.keys()
    for key in stock.keys() - arbitrary:
        if stock[key].is_meta:  # missing with low_cpu_mem_usage=True: left on meta, stock
            assert tensors[key].is_meta and tensors[key].shape == stock[key].shape, key
            continue
        assert torch.equal(stock[key], again[key]), key  # deterministic, stock
        assert torch.equal(tensors[key], stock[key]), key


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
@pytest.mark.parametrize("drop_norms", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_diffusers_shim_loads_exactly_the_stock_model(
    tmp_path, name, drop_norms, low_cpu_mem_usage
):
    build = MODELS[name]
    arbitrary = _save(tmp_path, build, drop_norms)
    cls = type(build())
    assert not metamode.is_enabled("diffusers")
    try:
        stock_runs = tuple(_load(cls, tmp_path, low_cpu_mem_usage) for _ in range(2))
    except Exception as stock_error:  # e.g. missing keys with low_cpu_mem_usage=True
        with metamode.enabled("diffusers"), pytest.raises(type(stock_error)) as error:
            _load(cls, tmp_path, low_cpu_mem_usage)
        assert str(error.value) == str(stock_error)
        return
    with metamode.enabled("diffusers"):
        shimmed = _load(cls, tmp_path, low_cpu_mem_usage)
    _assert_same_model(stock_runs, shimmed, arbitrary)


def test_missing_group_norm_weight_is_one_as_stock(tmp_path):
    """A checkpoint without a GroupNorm weight: stock leaves it at ones_'s 1.0, and so does the
    shim (a rule that skipped every init would leave uninitialised memory)."""
    _save(tmp_path, _unet2d, drop_norms=False)
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    state = load_file(path)
    del state["conv_norm_out.weight"]
    save_file(state, path, metadata={"format": "pt"})
    with metamode.enabled("diffusers"):
        model = diffusers.UNet2DModel.from_pretrained(tmp_path, low_cpu_mem_usage=False)
    assert torch.equal(model.conv_norm_out.weight, torch.ones(8))


def _calls():
    """Init calls as models make them: by attribute, by bound name, as methods."""
    from torch.nn.init import constant_, xavier_uniform_

    init = torch.nn.init
    return {
        "nn.init.uniform_": lambda t: init.uniform_(t, -1, 1),
        "nn.init.normal_": lambda t: init.normal_(t),
        "nn.init.trunc_normal_": lambda t: init.trunc_normal_(t, std=0.02),
        "nn.init.constant_": lambda t: init.constant_(t, 3.0),
        "nn.init.xavier_uniform_": lambda t: init.xavier_uniform_(t),
        "nn.init.xavier_normal_": lambda t: init.xavier_normal_(t),
        "nn.init.kaiming_uniform_": lambda t: init.kaiming_uniform_(t, a=5**0.5),
        "nn.init.kaiming_normal_": lambda t: init.kaiming_normal_(t),
        "torch.nn.init.normal (deprecated)": lambda t: torch.nn.init.normal(t),
        "nn.init.ones_": lambda t: init.ones_(t),
        "nn.init.zeros_": lambda t: init.zeros_(t),
        "nn.init.orthogonal_": lambda t: init.orthogonal_(t),
        "bound constant_": lambda t: constant_(t, 2.0),
        "bound xavier_uniform_": lambda t: xavier_uniform_(t),
        "param.normal_()": lambda t: t.data.normal_(),
        "param.fill_()": lambda t: t.data.fill_(7.0),
        "MultiheadAttention": lambda t: torch.nn.MultiheadAttention(4, 2),
        "Linear": lambda t: torch.nn.Linear(4, 4),
    }


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("call", list(_calls()))
def test_skips_exactly_the_calls_diffusers_no_init_weights_skips(call):
    fn = _calls()[call]
    names = frozenset(modeling_utils.TORCH_INIT_FUNCTIONS)

    def run(context):
        torch.manual_seed(7)
        tensor = torch.nn.Parameter(torch.full((4, 4), -5.0))
        with context:
            made = fn(tensor)
        after = torch.randn(3)
        return tensor.detach(), made, after

    stock_tensor, stock_made, stock_after = run(modeling_utils.no_init_weights())
    tensor, made, after = run(SkipLibraryInit(names))
    assert torch.equal(tensor, stock_tensor)
    assert torch.equal(after, stock_after)
    if isinstance(stock_made, torch.nn.Module):
        stock_state, state = stock_made.state_dict(), made.state_dict()
        for key in ("in_proj_weight", "in_proj_bias", "out_proj.bias"):
            if key in stock_state:  # deterministic or drawn from the (shared) seed
                assert torch.equal(state[key], stock_state[key]), key
