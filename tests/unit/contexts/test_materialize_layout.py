"""materialize and memory layout: random fills into non-contiguous targets (channels_last,
transposed, strided, permuted) fill memory in the order eager does, keep eager's strides, and
leave the stream right for the inits after them. Targets of 16+ elements, where torch's CPU
kernels take different paths for contiguous and strided tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import MODES, assert_eager_equal


def _conv_channels_last(init) -> nn.Module:
    conv = nn.Conv2d(4, 8, 3)
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
    init(conv.weight)
    return nn.Sequential(conv, nn.Linear(6, 6))


def _module_to_channels_last(init) -> nn.Module:
    conv = nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
    init(conv.weight)
    return nn.Sequential(conv, nn.Linear(6, 6))


def _transposed_view(init) -> nn.Module:
    lin = nn.Linear(8, 6)
    with torch.no_grad():
        init(lin.weight.t())
    return nn.Sequential(lin, nn.Linear(6, 6))


def _data_transposed(init) -> nn.Module:
    lin = nn.Linear(8, 6)
    init(lin.weight.data.t())
    return nn.Sequential(lin, nn.Linear(6, 6))


def _every_other_column(init) -> nn.Module:
    lin = nn.Linear(8, 6)
    with torch.no_grad():
        init(lin.weight[:, ::2])
    return nn.Sequential(lin, nn.Linear(6, 6))


class _Strided(nn.Module):
    def __init__(self, init) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.empty(8, 6).t())
        init(self.t)
        self.p = nn.Parameter(torch.empty(2, 4, 6).permute(2, 0, 1))
        init(self.p)
        self.after = nn.Linear(6, 6)


def _normal(t: torch.Tensor) -> None:
    nn.init.normal_(t)


def _kaiming_uniform(t: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(t, a=math.sqrt(5))


def _method_normal(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.normal_(0, 0.02)


def _method_uniform(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.uniform_(-1, 1)


def _trunc_normal(t: torch.Tensor) -> None:
    nn.init.trunc_normal_(t, std=0.02)


def _bernoulli(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.bernoulli_(0.5)


INITS = {
    "nn.init.normal_": _normal,
    "kaiming_uniform_": _kaiming_uniform,
    "normal_": _method_normal,
    "uniform_": _method_uniform,
    "trunc_normal_": _trunc_normal,
    "bernoulli_": _bernoulli,
}
TARGETS = {
    "conv_channels_last": _conv_channels_last,
    "module.to(channels_last)": _module_to_channels_last,
    "w.t()": _transposed_view,
    "w.data.t()": _data_transposed,
    "w[:,::2]": _every_other_column,
    "Parameter(empty.t()/permute)": _Strided,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("init", sorted(INITS))
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_random_fills_into_non_contiguous_targets(target, init, include_buffers):
    assert_eager_equal(lambda: TARGETS[target](INITS[init]), include_buffers)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_channels_last_buffer_filled_at_random(include_buffers):
    class Noise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            noise = torch.empty(2, 3, 4, 4, memory_format=torch.channels_last)
            self.register_buffer("noise", noise.normal_())
            self.after = nn.Linear(4, 4)

    assert_eager_equal(Noise, include_buffers)
