"""Forwards in the build through torch modules with a fused fast path
(``facts.FUSED_FAST_PATHS``): eager construction takes the fused kernel where the recording,
a torch function mode, takes the slow path, so what they compute is refused upfront; where
eager runs the slow path too (training, grad enabled, cross-attention, not batch-first), it
is exact."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    Built,
    assert_refused,
    build_eagerly,
    build_empty,
    materialize_exactly,
)


def _attention_probe(
    batch_first: bool = True, training: bool = False, grad: bool = False, cross: bool = False
) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        m.attn = nn.MultiheadAttention(32, 4, batch_first=batch_first, dropout=0.0)
        m.attn.train(training)
        x = torch.randn(2, 5, 32, device=m.attn.in_proj_weight.device)
        key = x + 1 if cross else x
        with torch.set_grad_enabled(grad):
            out, _ = m.attn(x, key, key)
        m.register_buffer("probe", out.detach().contiguous())
        m.after = nn.Linear(4, 4)

    return init


def _encoder_layer_probe(m: nn.Module) -> None:
    m.layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    x = torch.randn(2, 5, 32, device=m.layer.linear1.weight.device)
    with torch.no_grad():
        m.register_buffer("probe", m.layer(x))
    m.after = nn.Linear(4, 4)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize(
    ("init", "forward"),
    [
        pytest.param(_attention_probe(), "MultiheadAttention.forward", id="attention"),
        pytest.param(_encoder_layer_probe, "TransformerEncoderLayer.forward", id="encoder layer"),
    ],
)
def test_a_value_eager_computes_with_a_fused_kernel_is_refused(init, forward, include_buffers):
    model = build_empty(lambda: Built(init), include_buffers)
    message = assert_refused(model, "probe", because=forward)
    assert "has_torch_function" in message


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize(
    "init",
    [
        pytest.param(_attention_probe(batch_first=False), id="not batch-first"),
        pytest.param(_attention_probe(training=True), id="training"),
        pytest.param(_attention_probe(grad=True), id="grad enabled"),
        pytest.param(_attention_probe(cross=True), id="cross-attention"),
    ],
)
def test_a_forward_eager_runs_on_its_slow_path_too_is_exact(init, include_buffers):
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_the_layers_around_a_refused_probe_stay_exact(include_buffers):
    """Only what the fused forward computed is refused: the weights it read are exact."""
    init = _attention_probe()
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    materialize_exactly(model.attn, ref.attn)
    materialize_exactly(model.after, ref.after)
