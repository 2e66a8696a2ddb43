"""materialize and every random op torch has, not only the common ones: each draw replayed
from the generator it drew from, the stream after it right, the default generator untouched.

Random calls that take no ``generator=`` (dropout) make what depends on them unreproducible:
refused, with ``is_materializable`` agreeing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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

# Ops without a meta kernel, and distributions (whose argument checks read values), get
# real inputs in both include_buffers modes.
CPU = "cpu"


def _counts() -> torch.Tensor:
    return torch.full((6,), 10.0, device=CPU)


def _probs() -> torch.Tensor:
    return torch.linspace(0.1, 0.9, 6, device=CPU)


DRAWS = {
    "binomial": lambda: torch.binomial(_counts(), _probs()),
    "binomial_generator": lambda: torch.binomial(
        _counts(), _probs(), generator=torch.Generator().manual_seed(3)
    ),
    "_standard_gamma": lambda: torch._standard_gamma(_counts()),
    "_sample_dirichlet": lambda: torch._sample_dirichlet(_counts()),
    "Gamma.sample": lambda: torch.distributions.Gamma(_counts(), _probs()).sample(),
    "Gamma.rsample": lambda: torch.distributions.Gamma(_counts(), _probs()).rsample(),
    "Dirichlet.sample": lambda: torch.distributions.Dirichlet(_counts()).sample(),
    "Beta.sample": lambda: torch.distributions.Beta(_counts(), _probs()).sample(),
    "Binomial.sample": lambda: torch.distributions.Binomial(10, _probs()).sample(),
    "Poisson.sample": lambda: torch.distributions.Poisson(_counts()).sample(),
    "StudentT.sample": lambda: torch.distributions.StudentT(_counts()).sample(),
    "Chi2.sample": lambda: torch.distributions.Chi2(_counts()).sample(),
    "poisson": lambda: torch.poisson(_counts()),
    "random_(a,b)": lambda: torch.empty(6).random_(2, 9),
    "random_(b)": lambda: torch.empty(6).random_(5),
    "random_()": lambda: torch.empty(6, dtype=torch.int16).random_(),
    "normal(tensor,tensor)": lambda: torch.normal(torch.zeros(6), torch.ones(6)),
    "normal(tensor,float)": lambda: torch.normal(torch.arange(6.0), 0.5),
    "normal(float,tensor)": lambda: torch.normal(1.0, torch.full((6,), 2.0)),
    "bernoulli(tensor)": lambda: torch.bernoulli(torch.full((6,), 0.5)),
    "bernoulli_(float)": lambda: torch.empty(6).bernoulli_(0.3),
    "multinomial": lambda: torch.multinomial(torch.ones(6), 4, replacement=True),
    "exponential_": lambda: torch.empty(6).exponential_(),
    "geometric_": lambda: torch.empty(6).geometric_(0.3),
    "log_normal_": lambda: torch.empty(6).log_normal_(),
    "cauchy_": lambda: torch.empty(6).cauchy_(),
    "randint_like": lambda: torch.randint_like(torch.empty(6), 0, 7),
    "rand_like": lambda: torch.rand_like(torch.empty(6)),
    "randperm": lambda: torch.randperm(6),
    "Normal.sample": lambda: torch.distributions.Normal(torch.zeros(6, device=CPU), 1.0).sample(),
    "Exponential.sample": lambda: torch.distributions.Exponential(
        torch.ones(6, device=CPU)
    ).sample(),
    "Laplace.sample": lambda: torch.distributions.Laplace(torch.zeros(6, device=CPU), 1.0).sample(),
    "Categorical.sample": lambda: torch.distributions.Categorical(torch.ones(4, device=CPU)).sample(
        (6,)
    ),
}


class Drawn(nn.Module):
    """A buffer and a parameter from the draw, with random inits before and after it."""

    def __init__(self, draw) -> None:
        super().__init__()
        self.before = nn.Linear(3, 3)
        self.register_buffer("drawn", draw())
        self.param = nn.Parameter(draw().to(torch.float32))
        self.after = nn.Linear(3, 3)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("op", sorted(DRAWS))
def test_every_random_op_is_replayed_exactly(op, include_buffers):
    # Beta draws through a Dirichlet whose meta kernel lays the sample out otherwise than
    # its CPU kernel: the values are eager's, the strides of a view of it the meta build's
    ref = build_eagerly(lambda: Drawn(DRAWS[op]))
    model = build_empty(lambda: Drawn(DRAWS[op]), include_buffers)
    materialize_exactly(model, ref, strides=op != "Beta.sample")


@pytest.mark.parametrize("op", ["binomial", "_standard_gamma", "Gamma.sample"])
def test_what_follows_an_untagged_random_op_alone(op):
    ref = build_eagerly(lambda: Drawn(DRAWS[op]))
    model = build_empty(lambda: Drawn(DRAWS[op]))
    materialize_exactly(model.after)
    assert_same_tensors(model.after, ref.after)


# -- random calls without generator= -------------------------------------------------------


def _dropout() -> torch.Tensor:
    return F.dropout(torch.ones(8), 0.5)


def _dropout_module() -> torch.Tensor:
    return nn.Dropout(0.5)(torch.ones(8))


def _torch_dropout() -> torch.Tensor:
    return torch.dropout(torch.ones(8), 0.5, True)


def _alpha_dropout() -> torch.Tensor:
    return F.alpha_dropout(torch.ones(8), 0.5, training=True)


UNSEEDABLE = {
    "F.dropout": _dropout,
    "nn.Dropout": _dropout_module,
    "torch.dropout": _torch_dropout,
    "F.alpha_dropout": _alpha_dropout,
}


class Dropped(nn.Module):
    def __init__(self, draw) -> None:
        super().__init__()
        self.before = nn.Linear(3, 3)
        self.register_buffer("mask", draw())
        self.scaled = nn.Parameter(self.mask * 2)
        self.after = nn.Linear(3, 3)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("op", sorted(UNSEEDABLE))
def test_a_dropout_in_the_build_refuses_what_depends_on_it(op, include_buffers):
    build = lambda: Dropped(UNSEEDABLE[op])  # noqa: E731
    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    message = assert_refused(model, "mask", "scaled")
    assert not named(message, "before.weight") and not named(message, "before.bias")
    materialize_exactly(model.before)
    assert_same_tensors(model.before, ref.before)


def _sdpa_with_dropout() -> torch.Tensor:
    q = torch.ones(1, 2, 4, 4)
    return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)


def _fractional_max_pool() -> torch.Tensor:
    x = torch.arange(64.0).reshape(1, 1, 8, 8)
    return F.fractional_max_pool2d(x, 2, output_size=(5, 5))


def _rrelu() -> torch.Tensor:
    return F.rrelu(-torch.ones(8), training=True)


def _gumbel() -> torch.Tensor:
    return F.gumbel_softmax(torch.zeros(2, 4), tau=1.0)


HIDDEN_DRAWS = {
    "sdpa(dropout_p)": _sdpa_with_dropout,
    "fractional_max_pool2d": _fractional_max_pool,
    "rrelu": _rrelu,
    "gumbel_softmax": _gumbel,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("op", sorted(HIDDEN_DRAWS))
def test_calls_that_draw_from_the_default_generator_inside_are_exact_or_refused(
    op, include_buffers
):
    # Python-level functions whose draws torch makes inside them (no generator=):
    # exact if the replay can prove it, else refused -- never replayed against the
    # process's default generator.
    class Hidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.before = nn.Linear(3, 3)
            self.register_buffer("out", HIDDEN_DRAWS[op]())

    ref = build_eagerly(Hidden)
    model = build_empty(Hidden, include_buffers)
    assert_exact_or_refused(model, ref, "out")
