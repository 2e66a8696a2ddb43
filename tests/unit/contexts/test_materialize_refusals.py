"""materialize refuses before anything changes, and says why in words a user can act on.

Builds the replay cannot reproduce (parametrizations included) are either exact or refused
upfront, with ``is_materializable`` saying which first; a device that is no place for values
is an error before any work; ``on_unreproducible="empty"`` gives uninitialised memory only to
meta tensors it cannot reproduce and never touches a real tensor it cannot reproduce.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    Unchanged,
    assert_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    materialize_exactly,
    named,
    tensors,
)


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _old_weight_norm() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return nn.utils.weight_norm(nn.Linear(4, 4))


def _old_spectral_norm() -> nn.Module:
    return nn.utils.spectral_norm(nn.Linear(4, 4))


def _weight_norm() -> nn.Module:
    return nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))


def _spectral_norm() -> nn.Module:
    return nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))


def _symmetric() -> nn.Module:
    layer = nn.Linear(4, 4)
    parametrize.register_parametrization(layer, "weight", Symmetric())
    return layer


REPARAMETRIZED = {
    "utils.weight_norm": _old_weight_norm,
    "utils.spectral_norm": _old_spectral_norm,
    "parametrizations.weight_norm": _weight_norm,
    "parametrizations.spectral_norm": _spectral_norm,
    "register_parametrization": _symmetric,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("wrap", sorted(REPARAMETRIZED))
def test_reparametrized_layers_are_exact_or_refused_upfront(wrap, include_buffers):
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), REPARAMETRIZED[wrap](), nn.Linear(4, 2))

    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    if metamode.is_materializable(model):
        # the old nn.utils.weight_norm keeps a weight computed from weight_g and weight_v:
        # that autograd graph holds them, so new parameters take their places
        held = ("1.weight_g", "1.weight_v") if wrap == "utils.weight_norm" else ()
        materialize_exactly(model, ref, replaced=held)
    else:  # which of the wrapped layer's tensors is the replay's to say
        message = assert_refused(model)
        assert any(named(message, n) for n in tensors(model) if n.startswith("1.")), message


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("device", ["meta", torch.device("meta")], ids=["str", "device"])
def test_materialize_onto_meta_is_an_error_upfront(device, include_buffers):
    model = build_empty(lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), include_buffers)
    before = Unchanged(model)
    with pytest.raises((ValueError, metamode.NotMaterializableError), match="meta"):
        metamode.materialize(model, device=device)
    before.check()
    assert metamode.is_materializable(model)


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_a_real_buffer_changed_after_the_block_is_left_as_it_is():
    # The build computed it exactly (no random numbers in it): it is the user's to change.
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers=False)
    stats = model[1].running_mean
    stats.fill_(3.0)
    ref[1].running_mean.fill_(3.0)
    materialize_exactly(model, ref, on_unreproducible="empty")
    assert model[1].running_mean is stats


class FromNumpy(nn.Module):
    def __init__(self, values: np.ndarray) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("table", torch.from_numpy(values))
        self.after = nn.Linear(3, 3)


def test_a_real_buffer_sharing_an_arrays_memory_is_kept_as_eager_keeps_it():
    # torch.from_numpy is not a torch function a mode sees: the buffer is a real tensor
    # made outside the recording, which materialize leaves as it is (sharing the array's
    # memory, as eager construction's does).
    values = np.arange(5, dtype=np.float32)
    ref = build_eagerly(lambda: FromNumpy(values))
    model = build_empty(lambda: FromNumpy(values), include_buffers=False)
    table = model.table
    materialize_exactly(model, ref, on_unreproducible="empty")
    assert model.table is table


def test_empty_gives_uninitialised_memory_only_to_meta_tensors_it_cannot_reproduce():
    values = np.arange(5, dtype=np.float32)
    ref = build_eagerly(lambda: FromNumpy(values))
    model = build_empty(lambda: FromNumpy(values), include_buffers=True)
    assert model.table.is_meta and not metamode.is_materializable(model)
    state = torch.default_generator.get_state()
    metamode.materialize(model, on_unreproducible="empty")
    assert torch.equal(torch.default_generator.get_state(), state)
    assert not model.table.is_meta
    assert model.table.dtype == torch.float32 and model.table.shape == (5,)
    assert_same_tensors(model, ref, ["lin.weight", "lin.bias", "after.weight", "after.bias"])


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_tensor_from_another_context_is_refused_in_words(include_buffers):
    torch.manual_seed(0)  # not a marker state an earlier test's dropped build left
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        first = nn.Linear(4, 4)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        second = nn.Linear(4, 4)
        second.borrowed = nn.Parameter(first.weight * 2)
    before = Unchanged(second)
    assert not metamode.is_materializable(second)
    with pytest.raises(metamode.NotMaterializableError) as refusal:
        metamode.materialize(second)
    before.check()
    message = str(refusal.value)
    assert named(message, "borrowed") and not named(message, "weight")
    line = next(line for line in message.splitlines() if named(line, "borrowed"))
    assert re.search(r"\bin another\b.*context", line), line
    assert re.search(r"same context|one context|materiali[sz]e\b.*\bfirst", message), message
