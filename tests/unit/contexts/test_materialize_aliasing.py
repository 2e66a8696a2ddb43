"""materialize and writes through aliases: ``.data``, views, ``detach()``, ``__setitem__``,
``out=``, storage shared by ``.data`` assignment, and real tensors made outside the context.

An outside tensor the build read is read again at materialize when nothing changed it since
(its version counter says so); if something did, the tensors made from it are refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_exact_or_refused,
    assert_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    materialize_exactly,
    named,
)

# -- real tensors made outside the context ----------------------------------------------


def _copy_data(lin: nn.Linear, source: torch.Tensor) -> str:
    lin.weight.data.copy_(source)
    return "weight"


def _copy_prefix(lin: nn.Linear, source: torch.Tensor) -> str:
    with torch.no_grad():
        lin.weight[:2].copy_(source[:2])
    return "weight"


def _copy_no_grad(lin: nn.Linear, source: torch.Tensor) -> str:
    with torch.no_grad():
        lin.weight.copy_(source)
    return "weight"


def _setitem_data(lin: nn.Linear, source: torch.Tensor) -> str:
    lin.weight.data[1:] = source[1:]
    return "weight"


def _parameter_from(lin: nn.Linear, source: torch.Tensor) -> str:
    lin.weight = nn.Parameter(source.clone())
    return "weight"


def _add_into(lin: nn.Linear, source: torch.Tensor) -> str:
    with torch.no_grad():
        lin.weight.add_(source, alpha=0.5)
    return "weight"


def _buffer_from(lin: nn.Linear, source: torch.Tensor) -> str:
    lin.register_buffer("scaled", source * 2)
    return "scaled"


OUTSIDE_WRITES = {
    "data.copy_": _copy_data,
    "slice.copy_": _copy_prefix,
    "no_grad.copy_": _copy_no_grad,
    "data.__setitem__": _setitem_data,
    "Parameter(source.clone())": _parameter_from,
    "add_(source)": _add_into,
    "register_buffer(source*2)": _buffer_from,
}


def _reads(source: torch.Tensor, write):
    def build() -> nn.Sequential:
        first = nn.Linear(4, 3)
        write(first, source)
        return nn.Sequential(first, nn.Linear(3, 3))

    return build


def _written(write) -> str:
    """The name of the tensor ``write`` puts the outside tensor's values in."""
    return "0." + write(nn.Linear(4, 3), torch.zeros(3, 4))


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("write", sorted(OUTSIDE_WRITES))
def test_an_unchanged_outside_tensor_is_read_at_materialize(write, include_buffers):
    source = torch.arange(12.0).reshape(3, 4) / 7
    assert_eager_equal(_reads(source, OUTSIDE_WRITES[write]), include_buffers)


def _add_one(t: torch.Tensor) -> None:
    t.add_(1)


def _set_row(t: torch.Tensor) -> None:
    t[0] = 5.0


def _zero_no_grad(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.zero_()


def _copy_over(t: torch.Tensor) -> None:
    t.copy_(torch.ones_like(t))


CHANGES = {"add_": _add_one, "__setitem__": _set_row, "zero_": _zero_no_grad, "copy_": _copy_over}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("write", sorted(OUTSIDE_WRITES))
def test_an_outside_tensor_changed_after_the_block_refuses_what_was_made_from_it(
    write, change, include_buffers
):
    source = torch.arange(12.0).reshape(3, 4) / 7
    ref = build_eagerly(_reads(source, OUTSIDE_WRITES[write]))
    model = build_empty(_reads(source, OUTSIDE_WRITES[write]), include_buffers)
    CHANGES[change](source)
    if write == "register_buffer(source*2)" and not include_buffers:
        # a real buffer the build computed from it before the change: already eager's
        materialize_exactly(model, ref)
        return
    message = assert_refused(model, _written(OUTSIDE_WRITES[write]))
    assert not named(message, "1.weight") and not named(message, "0.bias")


def test_an_outside_tensor_dropped_after_the_block_is_exact_or_refused():
    source = torch.arange(12.0).reshape(3, 4) / 7
    build = _reads(source, _copy_data)
    ref = build_eagerly(build)
    model = build_empty(build)
    del source, build
    assert_exact_or_refused(model, ref, "0.weight")


# -- storage shared through .data assignment ------------------------------------------------


class TiedByData(nn.Module):
    """An output head that shares the embedding's storage without being the same Parameter."""

    def __init__(self, init: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4, padding_idx=0)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight.data = self.emb.weight.data
        if init == "nn.init.normal_":
            nn.init.normal_(self.emb.weight)
        elif init == "data.normal_":  # transformers' _init_weights
            self.emb.weight.data.normal_(mean=0.0, std=0.02)
            self.emb.weight.data[self.emb.padding_idx].zero_()
        elif init == "head.no_grad.uniform_":  # written through the other alias
            with torch.no_grad():
                self.head.weight.uniform_(-1, 1)
        self.after = nn.Linear(4, 4)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("init", ["nn.init.normal_", "data.normal_", "head.no_grad.uniform_"])
def test_storage_shared_by_data_assignment_is_written_once_for_both(init, include_buffers):
    model = assert_eager_equal(lambda: TiedByData(init), include_buffers)
    assert torch.equal(model.emb.weight, model.head.weight)


@pytest.mark.parametrize("include_buffers", MODES)
def test_either_alias_of_shared_storage_alone_is_exact(include_buffers):
    ref = build_eagerly(lambda: TiedByData("nn.init.normal_"))
    model = build_empty(lambda: TiedByData("nn.init.normal_"), include_buffers)
    materialize_exactly(model.head)
    assert torch.equal(model.head.weight, ref.head.weight)
    materialize_exactly(model, ref)


# -- writes through aliases inside the block ------------------------------------------------


class Aliased(nn.Module):
    """The alias idioms of real init code, on parameters and buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.emb = nn.Embedding(5, 4, padding_idx=1)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("table", torch.zeros(4, 4))
        self.register_buffer("top", self.table[:2])  # a view of another buffer
        w = self.lin.weight
        w.data.mul_(2.0)
        w.data[0] = 1.0
        w.data.view(-1)[:3].fill_(-1.0)
        w.data.view(-1)[::2][:4].zero_()
        detached = w.detach()
        detached[1].add_(0.5)
        nn.init.normal_(self.emb.weight)
        with torch.no_grad():
            self.emb.weight[self.emb.padding_idx].fill_(0)
            self.lin.bias.view(2, 3)[:, 1].copy_(self.lin.bias[:2])
            self.lin.weight[2].copy_(self.lin.weight[3])
            torch.mul(self.emb.weight[0], 3.0, out=self.emb.weight[4])
        self.norm.running_var.data.fill_(2.0)
        self.norm.weight.data.t_()
        self.table.diagonal().fill_(1.0)
        self.top[:, 3] = 7.0  # writes the table too
        alias = self.lin.weight.detach()
        nn.init.uniform_(self.lin.weight)
        alias.mul_(3.0)  # after the random fill: must land on the uniform values


@pytest.mark.parametrize("include_buffers", MODES)
def test_writes_through_data_views_detach_setitem_and_out_are_exact(include_buffers):
    model = assert_eager_equal(Aliased, include_buffers)
    assert torch.equal(model.top, model.table[:2])


def _hf_init_weights(module: nn.Module) -> None:
    """transformers' classic ``_init_weights``, as models apply it in ``post_init``."""
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.bias is not None:
            module.bias.data.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.padding_idx is not None:
            module.weight.data[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        module.bias.data.zero_()
        module.weight.data.fill_(1.0)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8, padding_idx=3)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
        self.lm_head = nn.Linear(8, 11, bias=False)
        self.apply(_hf_init_weights)
        self.lm_head.weight = self.embed.weight


@pytest.mark.parametrize("include_buffers", MODES)
def test_hf_style_init_weights_through_data_is_exact(include_buffers):
    assert_eager_equal(TinyLM, include_buffers)


class DetachedThenRandom(nn.Module):
    """A detached alias taken before a random refill and written after it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(5, 4))
        view = self.weight.detach().t()
        nn.init.kaiming_uniform_(self.weight)
        view[0].mul_(-1)
        self.other = nn.Parameter(torch.empty(3, 3))
        nn.init.normal_(self.other)


@pytest.mark.parametrize("include_buffers", MODES)
def test_an_alias_taken_before_a_random_fill_writes_after_it(include_buffers):
    assert_eager_equal(DetachedThenRandom, include_buffers)


class SharedBuffer(nn.Module):
    """One buffer tensor registered on two modules (a shared table, position ids)."""

    def __init__(self) -> None:
        super().__init__()
        table = torch.arange(6.0).reshape(2, 3)
        self.left, self.right = nn.Module(), nn.Module()
        self.left.register_buffer("table", table)
        self.right.register_buffer("table", table)
        self.right.lin = nn.Linear(3, 3)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_buffer_shared_by_two_modules_materialized_one_at_a_time(include_buffers):
    ref = build_eagerly(SharedBuffer)
    model = build_empty(SharedBuffer, include_buffers)
    materialize_exactly(model.left)
    materialize_exactly(model.right)
    assert_same_tensors(model, ref)
