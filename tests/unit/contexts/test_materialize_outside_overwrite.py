"""materialize and tensors from outside the recording that the build overwrites.

Legacy constructors (``torch.Tensor(n)``, ``torch.FloatTensor(n, m)``) are no torch functions a
mode sees: their results come from outside the recording, and the build then overwrites them
(``nn.Parameter(torch.Tensor(n).uniform_())``: every transformers ``Wav2Vec2Model`` has one).
Their first value is never read, so replay writes into memory of its own -- never into the
outside tensor, which may be gone or still someone's -- and a partial overwrite, which keeps
part of that first value, is refused upfront.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_refused,
    build_eagerly,
    build_empty,
    materialize_exactly,
)


class Wav2Vec2Style(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.masked_spec_embed = nn.Parameter(torch.Tensor(4).uniform_())


class LegacyOverwrites(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.normal = nn.Parameter(torch.Tensor(2, 3).normal_(0, 0.02))
        self.filled = nn.Parameter(torch.FloatTensor(3, 2).fill_(0.5))
        self.zeroed = nn.Parameter(torch.Tensor(5).zero_())
        table = torch.Tensor(4, 4)
        nn.init.xavier_uniform_(table)
        self.register_buffer("table", table)
        self.after = nn.Linear(3, 3)


class OverwrittenThenComputed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        scratch = torch.Tensor(3).uniform_(-1, 1)
        self.scaled = nn.Parameter(scratch * 2 + self.lin.bias.detach().shape[0])


BUILDS = {
    "wav2vec2": Wav2Vec2Style,
    "legacy_overwrites": LegacyOverwrites,
    "computed": OverwrittenThenComputed,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_an_overwritten_tensor_from_outside_is_exact(build, include_buffers):
    assert_eager_equal(BUILDS[build], include_buffers)


@pytest.mark.parametrize("include_buffers", MODES)
def test_replay_never_writes_a_live_tensor_from_outside(include_buffers):
    held = torch.zeros(4)

    class Overwrites(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            held.uniform_()
            self.param = nn.Parameter(held * 1.0)

    ref = build_eagerly(Overwrites)
    held.zero_()
    model = build_empty(Overwrites, include_buffers)
    after_build = held.clone()
    version = held._version
    materialize_exactly(model, ref)
    assert torch.equal(held, after_build) and held._version == version


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_partly_overwritten_tensor_from_outside_is_refused_upfront(include_buffers):
    class Partly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            raw = torch.Tensor(4)  # uninitialised memory, half of which is kept
            raw[:2].uniform_()
            self.param = nn.Parameter(raw * 1.0)

    model = build_empty(Partly, include_buffers)
    message = assert_refused(model, "param", because="first value is gone")
    assert "lin.weight" not in message


def test_the_outside_tensor_is_not_kept_alive_once_overwritten():
    import gc
    import weakref

    made: list[weakref.ref] = []

    class Tracks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            raw = torch.Tensor(1000)
            made.append(weakref.ref(raw))
            self.param = nn.Parameter(raw.uniform_())

    model = build_empty(Tracks)
    gc.collect()
    assert made[0]() is None
    materialize_exactly(model, build_eagerly(Tracks))


def test_a_transformers_wav2vec2_model_is_exact():
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8, 8),
        conv_stride=(2, 2),
        conv_kernel=(3, 3),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
    )
    assert_eager_equal(lambda: transformers.Wav2Vec2Model(config), include_buffers=False)
