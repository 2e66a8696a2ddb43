"""materialize on builds that used to be refused for a reason that was not theirs.

Each of these is exact now, or refused naming what really stands in the way:

* a parameter subclass with real data (metamode's own ``untyped_storage()`` read of it, at
  registration, is not the build handing its memory out);
* deterministic values computed with NumPy (sinusoidal position tables,
  ``from_numpy(x).clone()``, ``torch.FloatTensor(ndarray)``): their tensors are made by
  calls no mode sees and are dropped after the build, so the recording keeps them;
* ``register_parametrization(unsafe=True)``, which moves the original parameter to the
  right inverse's memory with ``Tensor.set_`` (no mode sees it) inside the block.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_refused,
    build_empty,
    warm_pickling,
)

# -- parameter subclasses -------------------------------------------------------------


class Tagged(nn.Parameter):
    """A parameter subclass with an attribute, as quantisation libraries define them."""

    def __new__(cls, data=None, requires_grad=True, tag="t"):
        made = super().__new__(cls, data, requires_grad)
        made.tag = tag
        return made


class Plain(nn.Parameter):
    pass


class WithSubclasses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.tagged = Tagged(torch.randn(3, 2), tag="x")
        self.plain = Plain(torch.zeros(2).uniform_(-1, 1))
        self.frozen = Plain(torch.ones(4), requires_grad=False)
        self.after = nn.Linear(3, 3)


@pytest.mark.parametrize("include_buffers", MODES)
def test_parameter_subclasses_with_real_data_are_exact(include_buffers):
    model = assert_eager_equal(WithSubclasses, include_buffers)
    assert model.tagged.tag == "x"


# -- values computed with NumPy --------------------------------------------------------


def _sinusoid(positions: int, dim: int) -> np.ndarray:
    angle = np.arange(positions)[:, None] / np.power(10000, 2 * (np.arange(dim)[None] // 2) / dim)
    table = np.zeros((positions, dim))
    table[:, 0::2] = np.sin(angle[:, 0::2])
    table[:, 1::2] = np.cos(angle[:, 1::2])
    return table


class Sinusoidal(nn.Module):
    """The sinusoidal position tables of fairseq, Marian, XLM and their kin."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.positions = nn.Embedding(8, 4)
        self.positions.weight = nn.Parameter(torch.FloatTensor(_sinusoid(8, 4)))
        self.positions.weight.requires_grad = False
        self.register_buffer("table", torch.from_numpy(_sinusoid(6, 4)).float())
        self.register_buffer("cloned", torch.from_numpy(np.arange(5.0)).clone())
        self.from_pretrained = nn.Embedding.from_pretrained(torch.FloatTensor(_sinusoid(3, 2)))
        self.after = nn.Linear(4, 4)


class NumpyThenTorch(nn.Module):
    """NumPy values combined with torch computations and random draws."""

    def __init__(self) -> None:
        super().__init__()
        freqs = torch.from_numpy(1.0 / (10000 ** (np.arange(0, 4, 2) / 4))).float()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("inv_freq", freqs, persistent=False)
        self.scale = nn.Parameter(freqs * 2.0)
        self.after = nn.Linear(2, 2)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("build", [Sinusoidal, NumpyThenTorch], ids=lambda b: b.__name__)
def test_values_computed_with_numpy_are_exact(build, include_buffers):
    assert_eager_equal(build, include_buffers)


def test_registering_numpy_memory_itself_is_refused_saying_so():
    # from_pretrained(from_numpy(x)): eager's weight shares x's memory; a twin cannot
    class Shares(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.emb = nn.Embedding.from_pretrained(torch.from_numpy(_sinusoid(3, 2)))

    model = build_empty(Shares)
    message = assert_refused(model, "emb.weight", because=r"does not own.*\.clone\(\)")
    assert "no longer exists" not in message


# -- parametrizations -------------------------------------------------------------------


class Double(nn.Module):
    def forward(self, x):
        return x * 2

    def right_inverse(self, x):
        return x / 2


class Rows(nn.Module):
    """``unsafe=True`` lets the right inverse change the shape."""

    def forward(self, x):
        return torch.cat([x, x], dim=0)

    def right_inverse(self, x):
        return x[: x.shape[0] // 2].clone()


class Symmetric(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


def _parametrized(module: nn.Module, unsafe: bool) -> nn.Module:
    def build() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        parametrize.register_parametrization(model[0], "weight", module(), unsafe=unsafe)
        parametrize.register_parametrization(model[1], "bias", Double(), unsafe=unsafe)
        return model

    return build


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("unsafe", [True, False], ids=["unsafe", "safe"])
@pytest.mark.parametrize("module", [Double, Symmetric], ids=lambda m: m.__name__)
def test_parametrizations_are_exact(module, unsafe, include_buffers):
    assert_eager_equal(_parametrized(module, unsafe), include_buffers)


@pytest.mark.parametrize("include_buffers", MODES)
def test_an_unsafe_parametrization_changing_the_shape_is_exact(include_buffers):
    assert_eager_equal(_parametrized(Rows, True), include_buffers)


# -- values that travel through a pickle ------------------------------------------------


warm_pickling()  # before the global-state guard's snapshot


def _pickled_parameter(m: nn.Module) -> None:
    import pickle

    m.a = nn.Linear(3, 3)
    m.b = pickle.loads(pickle.dumps(m.a.weight))


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_parameter_loaded_from_a_pickle_of_a_meta_one_is_refused_saying_so(include_buffers):
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            _pickled_parameter(self)

    model = build_empty(Holder, include_buffers)
    assert_refused(model, "b", because=r"torch\.load")
    assert metamode.is_materializable(model.a)
