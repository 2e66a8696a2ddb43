"""materialize and changes made to an empty-built module after its ``with`` block.

A change the replay cannot reproduce (an in-place write, which bumps a tensor's version
counter; a dtype change) refuses the tensors it touched, upfront, instead of being discarded
or failing half-way. Changes that leave values alone (``requires_grad``, a tie, a conversion
to the dtype a tensor already has, tensors loaded with ``assign=True``) are kept. Writes
through ``.data`` after the block (``w.data.fill_``), and BatchNorm's running-stat updates, do
not bump version counters, so they are not tested here; other memory put in with ``.data =``
is.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_exact_or_refused,
    assert_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    materialize_exactly,
    named,
)


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))


def _normal_(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight)


def _no_grad_fill(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        with torch.no_grad():
            m.weight.fill_(0.5)


def _zeros_(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.zeros_(m.weight)


def _reset(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        m.reset_parameters()


APPLIED = {
    "nn.init.normal_": _normal_,
    "no_grad.fill_": _no_grad_fill,
    "nn.init.zeros_": _zeros_,
    "reset_parameters": _reset,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("fn", sorted(APPLIED))
def test_model_apply_after_the_block_refuses_what_it_wrote(fn, include_buffers):
    model = build_empty(_net, include_buffers)
    model.apply(APPLIED[fn])
    message = assert_refused(model, "0.weight", "2.weight")
    assert not named(message, "1.weight")


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_write_after_the_block_refuses_only_that_tensor(include_buffers):
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers)
    with torch.no_grad():
        model[2].bias.add_(1.0)
    message = assert_refused(model, "2.bias")
    for name in ("0.weight", "0.bias", "2.weight"):
        assert not named(message, name)
    materialize_exactly(model[0])
    assert_same_tensors(model[0], ref[0])


@pytest.mark.parametrize("include_buffers", MODES)
def test_load_state_dict_after_the_block_into_a_buffer_is_kept_or_refused_never_discarded(
    include_buffers,
):
    # include_buffers=False: the running stats are real tensors the build computed exactly,
    # and load_state_dict copies into them: they are the user's, kept as loaded. True: the
    # copy goes into their meta twins (a no-op on meta that moves their version): refused.
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers)
    loaded = {"1.running_mean": torch.full((4,), 3.0), "1.running_var": torch.full((4,), 2.0)}
    model.load_state_dict(loaded, strict=False)
    if include_buffers:
        message = assert_refused(model, "1.running_mean", "1.running_var")
        assert not named(message, "0.weight")
        return
    ref.load_state_dict(loaded, strict=False)
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_whole_state_dict_loaded_after_the_block_is_refused(include_buffers):
    model = build_empty(_net, include_buffers)
    checkpoint = {k: torch.ones_like(v, device="cpu") for k, v in _net().state_dict().items()}
    model.load_state_dict(checkpoint)
    names = ("0.weight", "2.bias", *(("1.running_mean",) if include_buffers else ()))
    message = assert_refused(model, *names)
    if not include_buffers:  # real buffers the build computed: the loaded values stay
        assert not named(message, "1.running_mean")
        assert torch.equal(model[1].running_mean, torch.ones(4))


@pytest.mark.parametrize("include_buffers", MODES)
def test_tensors_loaded_with_assign_after_the_block_are_kept(include_buffers):
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers)
    loaded = {"2.weight": torch.full((3, 4), 0.25), "2.bias": torch.full((3,), -1.0)}
    model.load_state_dict(loaded, strict=False, assign=True)
    kept = model[2].weight
    ref[2].load_state_dict({"weight": loaded["2.weight"], "bias": loaded["2.bias"]}, assign=True)
    materialize_exactly(model, ref)
    assert model[2].weight is kept


def _half(model: nn.Module) -> None:
    model[2].half()


def _to_float64(model: nn.Module) -> None:
    model[2].to(torch.float64)


def _whole_bfloat16(model: nn.Module) -> None:
    model.to(torch.bfloat16)


CASTS = {"half": _half, "to(float64)": _to_float64, "model.to(bfloat16)": _whole_bfloat16}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("cast", sorted(CASTS))
def test_a_dtype_change_after_the_block_is_refused_upfront(cast, include_buffers):
    model = build_empty(_net, include_buffers)
    CASTS[cast](model)
    assert_refused(model, "2.weight", "2.bias")


def _float(model: nn.Module) -> None:
    model.float()


def _to_float32(model: nn.Module) -> None:
    model.to(torch.float32)


def _frozen(model: nn.Module) -> None:
    model[0].requires_grad_(False)


def _tied(model: nn.Module) -> None:
    model[0].bias = model[1].bias


def _eval(model: nn.Module) -> None:
    model.eval()


def _added_real(model: nn.Module) -> None:
    torch.manual_seed(7)
    model.append(nn.Linear(3, 2))


HARMLESS = {
    "float()": _float,
    "to(float32)": _to_float32,
    "requires_grad_(False)": _frozen,
    "tie": _tied,
    "eval()": _eval,
    "append(real)": _added_real,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("change", sorted(HARMLESS))
def test_changes_after_the_block_that_write_no_value_are_kept(change, include_buffers):
    ref = build_eagerly(_net)
    HARMLESS[change](ref)
    model = build_empty(_net, include_buffers)
    HARMLESS[change](model)
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_channels_last_after_the_block_is_exact_or_refused(include_buffers):
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1))

    ref = build_eagerly(build).to(memory_format=torch.channels_last)
    model = build_empty(build, include_buffers).to(memory_format=torch.channels_last)
    assert_exact_or_refused(model, ref, "0.weight", "1.weight")


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_buffer_written_after_the_block_is_kept_if_real_and_refused_if_meta(include_buffers):
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers)
    model[1].running_var.fill_(4.0)
    model[1].num_batches_tracked += 1
    if include_buffers:
        assert_refused(model, "1.running_var", "1.num_batches_tracked")
        return
    ref[1].running_var.fill_(4.0)
    ref[1].num_batches_tracked += 1
    materialize_exactly(model, ref)


def test_a_meta_forward_in_train_mode_after_the_block_refuses_the_step_count():
    # Shape inference with meta inputs. BatchNorm's num_batches_tracked += 1 bumps its
    # version counter; torch updates the running stats without bumping theirs (on CPU
    # too), so what becomes of those is not asserted here.
    model = build_empty(_net, include_buffers=True)
    model(torch.ones(2, 4, device="meta"))
    message = assert_refused(model, "1.num_batches_tracked")
    assert not named(message, "0.weight")


def test_a_meta_forward_in_eval_mode_after_the_block_changes_nothing():
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers=True).eval()
    model(torch.ones(2, 4, device="meta"))
    materialize_exactly(model.train(), ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_deepcopy_after_the_block_is_exact_or_refused_and_the_original_stays_exact(
    include_buffers,
):
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers)
    copied = copy.deepcopy(model)
    assert_exact_or_refused(copied, ref, "0.weight")
    materialize_exactly(model, ref)


class _BufferAfterALayer(nn.Module):
    """A layer whose init draws, then a buffer: params-only, ``steps`` is real and exact,
    ``noise`` real but drawn from the stream the skipped draws shifted."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)
        self.register_buffer("steps", torch.arange(3.0))
        self.register_buffer("noise", torch.randn(3))


def test_a_real_value_given_loaded_memory_in_place_is_kept():
    """``.data =`` keeps the implementation the block registered: where its value was
    eager's, what is put there after the block is a load, kept."""
    ref = build_eagerly(_BufferAfterALayer)
    model = build_empty(_BufferAfterALayer, include_buffers=False)
    for m in (ref, model):
        m.steps.data = torch.full((3,), 7.0)
    materialize_exactly(model, ref)


def test_a_value_not_eagers_given_other_memory_in_place_is_refused():
    """Where the value was not eager's yet (drawn from the shifted stream), or the tensor was
    meta, other memory put in place is refused: it holds no eager value to keep."""
    model = build_empty(_BufferAfterALayer, include_buffers=False)
    model.noise.data = model.noise.data.double()
    model.layer.weight.data = model.layer.weight.data.half()
    message = assert_refused(model, because="memory was replaced")
    assert named(message, "noise") and named(message, "layer.weight")
