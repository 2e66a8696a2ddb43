"""materialize and tensors that enter a module without a registration hook.

``module._parameters[k] = p``, ``module._buffers[k] = b`` and ``Module._apply`` (``.double()``,
``.half()``, ``.float()`` inside a params-only block put the cast copy of each buffer straight
into ``_buffers``) bypass torch's registration hooks. Such a tensor stays real; if the build
drew its values from a stream its meta draws had shifted, keeping it would keep wrong values
as if they were loaded. Every real tensor a recorded call made is the build's: materialize
replays it (or refuses it, saying why), and keeps only real tensors the build did not make.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_refused,
    build_eagerly,
    build_empty,
    materialize_exactly,
    named,
)


class IntoParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)  # skipped draws on meta: the stream shifts
        self._parameters["direct"] = nn.Parameter(torch.randn(3))
        self.after = nn.Linear(3, 3)


class IntoBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self._buffers["noise"] = torch.rand(2, 3) * 0.1
        self._buffers["index"] = torch.randperm(5)
        self.after = nn.Linear(3, 3)


class IntoBoth(nn.Module):
    """The same drawn tensor under a buffer and (as a parameter) under a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        drawn = torch.empty(4).normal_()
        self._buffers["drawn"] = drawn
        self._parameters["shared"] = nn.Parameter(drawn)
        self.after = nn.Linear(3, 3)


class CastInside(nn.Module):
    """``Module._apply`` replaces every buffer in ``_buffers`` directly."""

    def __init__(self, cast: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("noise", torch.randn(3))
        self.norm = nn.BatchNorm1d(3)
        getattr(self, cast)()
        self.after = nn.Linear(3, 3)


class SubmoduleCastInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.inner = nn.Module()
        self.inner.register_buffer("table", torch.rand(4))
        self.inner.double()


BUILDS = {
    "_parameters[k]=": IntoParameters,
    "_buffers[k]=": IntoBuffers,
    "both": IntoBoth,
    ".double()": lambda: CastInside("double"),
    ".half()": lambda: CastInside("half"),
    ".float()": lambda: CastInside("float"),
    "submodule.double()": SubmoduleCastInside,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_tensors_put_in_a_module_without_a_hook_get_their_eager_values(build, include_buffers):
    assert_eager_equal(BUILDS[build], include_buffers)


def test_a_real_tensor_made_before_the_block_is_kept_as_loaded():
    loaded = torch.arange(3, dtype=torch.float32)

    class Loads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self._buffers["loaded"] = loaded
            self._parameters["weight"] = nn.Parameter(loaded * 0 + 1)

    ref = build_eagerly(Loads)
    model = build_empty(Loads)
    materialize_exactly(model, ref)
    assert model.loaded is loaded


def test_an_unregistered_tensor_written_after_the_block_is_refused():
    model = build_empty(IntoBuffers)
    with torch.no_grad():
        model.noise.add_(1.0)
    assert_refused(model, "noise", because="written after")


class DrawnInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        noise = torch.empty(2, 3)
        noise.normal_()
        self._buffers["noise"] = noise


def test_a_data_alias_put_in_after_the_block_is_refused_naming_its_own_counter():
    # a counter at 0 where the build's reached 1: unwritten, or written through another
    model = build_empty(DrawnInPlace)
    model._buffers["noise"] = model.noise.data
    assert_refused(model, "noise", because=r"\(0\) is none of those .* \(1\).* \(\.data, set_\)")


def test_a_submodule_with_an_unregistered_tensor_alone():
    ref = build_eagerly(IntoBuffers)
    model = build_empty(IntoBuffers)
    assert metamode.is_materializable(model.after)
    metamode.materialize(model.after)
    assert torch.equal(model.after.weight, ref.after.weight)
    materialize_exactly(model, ref)


# -- tensors a module holds unregistered: plain attributes, list and dict items -------------


def _held_at(model: nn.Module, path: str) -> torch.Tensor:
    """``model``'s tensor at ``path`` (``"sub.name"``, ``"name[0]"``, ``"name['k']"``)."""
    attribute, _, key = path.partition("[")
    *modules, name = attribute.split(".")
    holder = model
    for sub in modules:
        holder = getattr(holder, sub)
    value = vars(holder)[name]
    return value[eval(key[:-1])] if key else value


class HoldsAttributes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)  # params-only: its draws are skipped, the stream shifts
        self.register_buffer("table", torch.arange(3.0))
        self.scaled = self.lin.weight * 2  # computed with autograd from a parameter
        self.alias = self.lin.weight.data  # shares the parameter's memory
        self.same = self.table  # the buffer itself
        self.noise = torch.randn(3)  # drawn after the skipped init
        self.listed = [torch.rand(2), self.lin.bias.detach() + 1, "not a tensor"]
        self.mapped = {"a": torch.randn(2, 2).t(), "b": self.lin.weight.detach()[0]}
        self.inner = nn.Module()
        self.inner.cached = torch.outer(self.table, self.table)
        self.after = nn.Linear(3, 3)


HELD = ["scaled", "alias", "same", "noise", "listed[0]", "listed[1]", "mapped['a']"]
HELD += ["mapped['b']", "inner.cached"]


@pytest.mark.parametrize("include_buffers", MODES)
def test_tensors_held_as_attributes_and_in_lists_get_their_eager_values(include_buffers):
    ref = build_eagerly(HoldsAttributes)
    model = build_empty(HoldsAttributes, include_buffers)
    materialize_exactly(model, ref)
    for path in HELD:
        got, want = _held_at(model, path), _held_at(ref, path)
        assert not got.is_meta, f"{path} is still on meta"
        assert got.dtype == want.dtype and got.stride() == want.stride(), path
        assert torch.equal(got, want), f"{path}: values differ from eager"
        assert got.requires_grad == want.requires_grad, path
    assert model.same is model.table
    assert model.alias.untyped_storage().data_ptr() == model.lin.weight.data_ptr()
    assert model.listed[2] == "not a tensor"


class HoldsATuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.pair = (self.lin.weight * 2, torch.zeros(1))


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_meta_tensor_held_in_a_tuple_is_refused_by_name(include_buffers):
    model = build_empty(HoldsATuple, include_buffers)
    pair = model.pair
    message = assert_refused(model, because="tuple attribute")
    assert named(message, "pair[0]")
    assert model.pair is pair and model.pair[0].is_meta


def test_a_meta_attribute_no_recording_made_is_refused_by_name():
    with torch.device("meta"):
        outside = torch.ones(3)

    class HoldsForeign(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.inner = nn.Module()
            self.inner.foreign = outside

    model = build_empty(HoldsForeign)
    message = assert_refused(model, because="no metamode.empty_weights")
    assert named(message, "inner.foreign")
    assert model.inner.foreign is outside


def test_an_attribute_written_after_the_block_is_refused():
    model = build_empty(HoldsAttributes)
    model.noise.add_(1.0)
    message = assert_refused(model, because="written after")
    assert named(message, "noise")
