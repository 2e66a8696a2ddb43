"""materialize and what the build read from outside torch: Python and NumPy data (changed
after the block), and process state at materialize time (the default dtype).

Values are the ones eager construction computed at build time: data the build read is not
read again later, and type promotion follows the default dtype the build ran under -- or the
tensors that depend on it are refused upfront, saying why. Never a silent difference.
"""

from __future__ import annotations

import array
import contextlib
import copy

import numpy as np
import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_exact_or_refused,
    build_eagerly,
    build_empty,
    materialize_exactly,
)


class FromData(nn.Module):
    def __init__(self, data: dict) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("from_ndarray", torch.tensor(data["ndarray"]))
        self.register_buffer("from_list", torch.tensor(data["list"]))
        self.register_buffer("from_nested", torch.tensor(data["nested"]))
        self.register_buffer("as_tensor_list", torch.as_tensor(data["as_tensor_list"]))
        self.register_buffer("from_array_module", torch.tensor(data["array.array"]))
        self.weight = nn.Parameter(torch.tensor(data["param_ndarray"]))
        self.indexed = nn.Parameter(torch.zeros(6))
        with torch.no_grad():
            self.indexed[data["index_ndarray"]] = 1.0
            self.lin.weight[0] = torch.tensor(data["row"])
        self.after = nn.Linear(3, 3)


def _data() -> dict:
    return {
        "ndarray": np.linspace(0.0, 1.0, 5, dtype=np.float32),
        "list": [0.5, 1.5, 2.5],
        "nested": [[1, 2], [3, 4]],
        "as_tensor_list": [4.0, 5.0],
        "array.array": array.array("f", [7.0, 8.0]),
        "param_ndarray": np.ones((2, 2), dtype=np.float32),
        "index_ndarray": np.array([0, 3]),
        "row": np.array([9.0, 8.0, 7.0], dtype=np.float32),
    }


def _mutate(data: dict) -> None:
    data["ndarray"] += 1
    data["list"][0] = -1.0
    data["nested"][1][0] = -3
    data["as_tensor_list"].append(6.0)
    data["as_tensor_list"][0] = -4.0
    data["array.array"][0] = -7.0
    data["param_ndarray"][0, 0] = -1.0
    data["index_ndarray"][:] = [1, 2]
    data["row"][:] = 0.0


@pytest.mark.parametrize("include_buffers", MODES)
def test_data_changed_after_the_block_does_not_change_the_values(include_buffers):
    data = _data()
    ref = copy.deepcopy(build_eagerly(lambda: FromData(data)))
    model = build_empty(lambda: FromData(data), include_buffers)
    _mutate(data)
    materialize_exactly(model, ref)


ALIASING = {
    "as_tensor(ndarray)": torch.as_tensor,
    "from_numpy(ndarray).clone()": lambda a: torch.from_numpy(a).clone(),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("read", sorted(ALIASING))
def test_memory_shared_with_numpy_is_exact_or_refused(read, include_buffers):
    # These alias the array: eager's values are the array's at build time, and the
    # array changes after the block.
    class Shared(nn.Module):
        def __init__(self, values: np.ndarray) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("shared", ALIASING[read](values))

    values = np.arange(4, dtype=np.float32)
    ref = copy.deepcopy(build_eagerly(lambda: Shared(values)))
    model = build_empty(lambda: Shared(values), include_buffers)
    values += 10
    assert_exact_or_refused(model, ref, "shared")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


PROMOTIONS = {
    "arange/8": lambda: torch.arange(8) / 8,
    "int_tensor*0.5": lambda: torch.ones(4, dtype=torch.int64) * 0.5,
    "tensor([0.1,0.2])": lambda: torch.tensor([0.1, 0.2]),
    "ones()": lambda: torch.ones(3),
    "linspace": lambda: torch.linspace(0, 1, 5),
    "where(scalars)": lambda: torch.where(torch.arange(4) > 1, 1.0, 0.0),
    "exp(arange*-0.7).float()": lambda: (torch.arange(8) * -0.7).exp().float(),
    "arange.sqrt()": lambda: torch.arange(5).sqrt(),
    "python_scalar_tensor": lambda: torch.scalar_tensor(3) / 7,
}


class Promoted(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("promoted", make())
        self.param = nn.Parameter(make().float() * 3)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("make", sorted(PROMOTIONS))
def test_materialize_under_another_default_dtype(make, include_buffers):
    def build() -> nn.Module:
        return Promoted(PROMOTIONS[make])

    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    with _default_dtype(torch.float64):
        assert_exact_or_refused(model, ref, "promoted", because="dtype")


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialize_inside_a_device_context_is_exact_or_refused(include_buffers):
    ref = build_eagerly(lambda: Promoted(PROMOTIONS["arange/8"]))
    model = build_empty(lambda: Promoted(PROMOTIONS["arange/8"]), include_buffers)
    with torch.device("meta"):
        assert_exact_or_refused(model, ref, "promoted")
