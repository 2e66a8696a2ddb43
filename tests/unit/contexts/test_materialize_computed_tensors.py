"""materialize and tensors computed in the build: buffers computed from parameters keep the
autograd flag eager gives them, and ops with several results (``torch.return_types``
structseqs, plain tuples) are replayed like any other.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    build_eagerly,
    build_empty,
    materialize_exactly,
)

COMPUTED = {
    "weight*2": lambda w: w * 2,
    "weight.t()": lambda w: w.t(),
    "weight.norm(dim=1)": lambda w: w.norm(dim=1),
    "no_grad(weight*3)": lambda w: _no_grad(lambda: w * 3),
    "weight.detach().clone()": lambda w: w.detach().clone(),
}


def _no_grad(compute):
    with torch.no_grad():
        return compute()


class FromParameter(nn.Module):
    def __init__(self, compute) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("computed", compute(self.weight))
        self.after = nn.Linear(4, 4)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("compute", sorted(COMPUTED))
def test_a_buffer_computed_from_a_parameter_keeps_requires_grad(compute, include_buffers):
    # A buffer computed with grad enabled holds its parameter (a view, or an autograd graph
    # saving it): swap_tensors cannot replace that parameter in place, so a new one takes
    # its place in every module holding it.
    held = compute in ("weight.t()", "weight.norm(dim=1)")
    ref = build_eagerly(lambda: FromParameter(COMPUTED[compute]))
    model = build_empty(lambda: FromParameter(COMPUTED[compute]), include_buffers)
    materialize_exactly(model, ref, replaced=("weight",) if held else ())


class MultiResult(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        q, r = torch.linalg.qr(torch.randn(4, 4))
        self.q = nn.Parameter(q)
        self.register_buffer("r", r)
        values, indices = torch.topk(torch.randn(8), 3)
        self.register_buffer("top_values", values)
        self.register_buffer("top_indices", indices)
        result = torch.sort(torch.randn(5), descending=True)
        self.register_buffer("sorted", result.values)
        self.register_buffer("order", result.indices)
        self.register_buffer("col_max", torch.max(torch.randn(3, 4), dim=0).values)
        u, s, vh = torch.linalg.svd(torch.randn(4, 3), full_matrices=False)
        self.u = nn.Parameter(u * s)
        self.register_buffer("vh", vh)
        std, mean = torch.std_mean(torch.randn(6))
        self.register_buffer("std_mean", torch.stack([std, mean]))
        first, second = torch.randn(6).chunk(2)
        self.register_buffer("chunked", second - first)
        self.after = nn.Linear(4, 4)


@pytest.mark.parametrize("include_buffers", MODES)
def test_ops_with_several_results_are_replayed(include_buffers):
    assert_eager_equal(MultiResult, include_buffers)
