"""metamode.materialize: bitwise equality with eager construction, and refusals."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import metamode

MODES = [False, True]


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    found = dict(module.named_parameters(remove_duplicate=False))
    found.update(module.named_buffers(remove_duplicate=False))
    return found


def _ties(module: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, tensor in _tensors(module).items():
        groups.setdefault(id(tensor), []).append(name)
    return sorted(sorted(g) for g in groups.values())


def assert_eager_equal(build, include_buffers: bool, seed: int = 0) -> nn.Module:
    """The bar: seed, build eagerly; seed, build empty, materialize; compare bitwise."""
    torch.manual_seed(seed)
    ref = build()
    torch.manual_seed(seed)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = build()
    assert any(t.is_meta for t in _tensors(model).values())
    assert metamode.is_materializable(model)
    before = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    modules_before = [id(m) for m in model.modules()]
    assert metamode.materialize(model) is model
    got, want = _tensors(model), _tensors(ref)
    assert got.keys() == want.keys()
    for name, expected in want.items():
        actual = got[name]
        assert type(actual) is type(expected), name
        assert actual.dtype == expected.dtype, name
        assert actual.device == expected.device, name
        assert actual.requires_grad == expected.requires_grad, name
        assert torch.equal(actual, expected), name
    assert _ties(model) == _ties(ref)
    after = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    assert after == before
    assert [id(m) for m in model.modules()] == modules_before
    return model


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.cls = nn.Parameter(torch.randn(1, 8) * 0.02)
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("noise", torch.rand(4))
        self.w = nn.Parameter(torch.empty(6, 6))
        nn.init.trunc_normal_(self.w, std=0.02)
        self.o = nn.Parameter(torch.empty(6, 4))
        nn.init.orthogonal_(self.o)
        self.x = nn.Parameter(torch.empty(5, 7))
        nn.init.xavier_uniform_(self.x)
        self.d = nn.Parameter(torch.empty(4, 4, 3))
        nn.init.dirac_(self.d)
        self.s = nn.Parameter(torch.empty(6, 5))
        nn.init.sparse_(self.s, sparsity=0.5)
        with torch.no_grad():
            self.w.view(-1)[:3].fill_(1.0)
            self.w[0, 5] = 2.0
            self.lin.weight[:, 0].mul_(3.0)
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.lin.weight  # tied


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.lin.weight.requires_grad_(False)
        self.emb = nn.Embedding(7, 3, padding_idx=2)


TORCH_LAYERS = {
    "linear": lambda: nn.Linear(4, 5),
    "conv_bn": lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv1d(2, 2, 1)),
    "embedding_padding_idx": lambda: nn.Embedding(10, 4, padding_idx=1),
    "layernorm_groupnorm": lambda: nn.Sequential(nn.LayerNorm(6), nn.GroupNorm(2, 4)),
    "multihead_attention": lambda: nn.MultiheadAttention(8, 2, kdim=4, vdim=4),
    "transformer": lambda: nn.Transformer(16, 2, 1, 1, 32, dropout=0.0),
    "lstm": lambda: nn.LSTM(4, 8, 2, bidirectional=True),
    "gru": lambda: nn.GRU(4, 4),
    "custom": Custom,
    "frozen": Frozen,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", sorted(TORCH_LAYERS))
def test_torch_layers_equal_eager(name, include_buffers):
    assert_eager_equal(TORCH_LAYERS[name], include_buffers)


@pytest.mark.parametrize("include_buffers", MODES)
def test_rnn_still_runs_after_materialize(include_buffers):
    model = assert_eager_equal(lambda: nn.LSTM(4, 8), include_buffers)
    out, _ = model(torch.ones(2, 1, 4))
    assert out.shape == (2, 1, 8)


def test_materialize_leaves_the_default_generator_alone():
    torch.manual_seed(3)
    with metamode.empty_weights(replayable=True):
        model = Custom()
    state = torch.default_generator.get_state()
    metamode.materialize(model)
    assert torch.equal(torch.default_generator.get_state(), state)


def test_user_generator_is_replayed_from_its_state_at_first_use():
    def build(gen):
        layer = nn.Linear(3, 3)
        nn.init.normal_(layer.weight, generator=gen)
        return layer

    torch.manual_seed(0)
    ref = build(torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        model = build(gen)
    metamode.materialize(model)
    assert torch.equal(model.weight, ref.weight)


def _all_meta(module: nn.Module) -> bool:
    return all(t.is_meta for t in _tensors(module).values())


def test_plain_meta_device_is_refused_naming_every_tensor():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert not metamode.is_materializable(model)
    with pytest.raises(metamode.NotMaterializableError) as error:
        metamode.materialize(model)
    for name in _tensors(model):
        assert repr(name) in str(error.value)
    assert _all_meta(model)


class Outside(nn.Module):
    """``external`` is a meta tensor made outside the recording: it has no value."""

    def __init__(self, external: torch.Tensor) -> None:
        super().__init__()
        self.ok = nn.Linear(2, 2)
        self.from_outside = nn.Parameter(external * 2)
        self.from_numpy = nn.Parameter(torch.from_numpy(np.ones(3, dtype=np.float32)))


@pytest.mark.parametrize("include_buffers", MODES)
def test_unrecordable_tensors_are_refused_before_any_allocation(include_buffers):
    external = torch.ones(3, device="meta")
    torch.manual_seed(0)  # not a state an earlier test's dropped build left
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = Outside(external)
    assert metamode.is_materializable(model.ok)
    assert not metamode.is_materializable(model.from_outside)
    with pytest.raises(metamode.NotMaterializableError) as error:
        metamode.materialize(model)
    message = str(error.value)
    assert "'from_outside'" in message and "'from_numpy'" in message
    assert "'ok.weight'" not in message
    assert all(t.is_meta for t in model.ok.parameters())


def test_on_unreproducible_empty_allocates_the_rest_exactly():
    external = torch.ones(3, device="meta")
    torch.manual_seed(0)
    ref = Outside(torch.ones(3))
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        model = Outside(external)
    metamode.materialize(model, on_unreproducible="empty")
    assert not any(t.is_meta for t in _tensors(model).values())
    assert torch.equal(model.ok.weight, ref.ok.weight)
    assert torch.equal(model.ok.bias, ref.ok.bias)


def test_materialize_inside_the_open_context_is_refused():
    with metamode.empty_weights(replayable=True):
        model = nn.Linear(2, 2)
        with pytest.raises(metamode.NotMaterializableError, match="still open"):
            metamode.materialize(model)


def test_unseedable_random_call_refuses_what_is_drawn_after_it():
    class Drops(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.before = nn.Linear(2, 2)
            self.register_buffer("mask", nn.functional.dropout(torch.ones(4), 0.5))
            self.after = nn.Linear(2, 2)

    torch.manual_seed(0)  # not a state an earlier test's dropped build left
    with metamode.empty_weights(replayable=True):
        model = Drops()
    with pytest.raises(metamode.NotMaterializableError) as error:
        metamode.materialize(model)
    assert "'after.weight'" in str(error.value)
    assert "'before.weight'" not in str(error.value)


def test_a_build_without_replayable_is_refused_with_the_fix_named():
    with metamode.empty_weights():
        model = nn.Linear(2, 2)
    assert not metamode.is_materializable(model)
    with pytest.raises(metamode.NotMaterializableError, match=r"replayable=True"):
        metamode.materialize(model)
    assert model.weight.is_meta


def test_replayable_needs_the_meta_device():
    with pytest.raises(ValueError, match="replayable"):
        metamode.empty_weights(device="cpu", replayable=True)


def test_summary_shows_which_meta_tensors_can_be_materialized():
    external = torch.ones(3, device="meta")
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        model = Outside(external)
    report = metamode.summary(model)
    assert set(report.materializable) == {"ok.weight", "ok.bias"}
    assert set(report.meta) == {"ok.weight", "ok.bias", "from_outside", "from_numpy"}
    text = str(report)
    assert "2 materializable" in text
    assert "ok.weight  [materializable]" in text
    assert "from_outside  [materializable]" not in text
    assert "2 materializable" in report._repr_html_()


@pytest.mark.parametrize("include_buffers", MODES)
def test_recording_holds_no_cpu_tensor_alive(include_buffers):
    # Parameters-only mode allocates each parameter on CPU before moving it to meta
    # (and a buffer stays real): the recording must keep none of the originals alive.
    originals: list[weakref.ref] = []

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            weight = nn.Parameter(torch.empty(256, 256))
            originals.append(weakref.ref(weight))
            self.weight = weight  # registered: moved to meta
            self.lin = nn.Linear(256, 256)
            originals.append(weakref.ref(self.lin.weight))

    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = nn.Sequential(Holder(), Holder())
    gc.collect()
    alive = [r() for r in originals if r() is not None and not r().is_meta]
    assert alive == []
    assert metamode.is_materializable(model)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_default_dtype_set_outside_the_context_is_replayed(include_buffers):
    # The replay runs in this thread's default dtype; factories that took theirs from
    # a default_dtype context (or torch.set_default_dtype) must still get it.
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(5, 4))

    torch.manual_seed(0)
    with metamode.default_dtype(torch.float16):
        ref = build()
    torch.manual_seed(0)
    with (
        metamode.default_dtype(torch.float16),
        metamode.empty_weights(include_buffers=include_buffers, replayable=True),
    ):
        model = build()
    metamode.materialize(model)
    for (name, got), want in zip(
        model.state_dict().items(), ref.state_dict().values(), strict=True
    ):
        assert got.dtype == want.dtype == torch.float16, name
        assert torch.equal(got, want), name


def test_a_replayable_context_closed_from_another_thread_is_refused_saying_so():
    context = metamode.empty_weights(replayable=True)
    context.__enter__()
    model = nn.Linear(4, 4)
    refused: list[BaseException] = []

    def close_elsewhere() -> None:
        try:
            context.__exit__(None, None, None)
        except metamode.ContextMisuseError as error:
            refused.append(error)

    elsewhere = threading.Thread(target=close_elsewhere)
    elsewhere.start()
    elsewhere.join()
    assert len(refused) == 1
    context.__exit__(None, None, None)  # the owner finishes the exit quietly
    assert not metamode.is_materializable(model)
    with pytest.raises(metamode.NotMaterializableError, match="exited from another thread"):
        metamode.materialize(model)
    assert model.weight.is_meta
