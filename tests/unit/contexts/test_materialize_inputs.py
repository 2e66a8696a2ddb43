"""materialize and what the build read from outside torch: Python and NumPy data (changed
after the block), and process state at materialize time (the default dtype).

Values are the ones eager construction computed at build time: data the build read is not
read again later, and type promotion follows the default dtype the build ran under -- or the
tensors that depend on it are refused upfront, saying why. Never a silent difference.
"""

from __future__ import annotations

import array
import copy

import numpy as np
import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_exact_or_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    default_dtype,
    materialize_exactly,
)


def _tensor_ndarray(data: np.ndarray) -> torch.Tensor:
    return torch.tensor(data)


def _tensor_list(data: list) -> torch.Tensor:
    return torch.tensor(data)


def _as_tensor_list(data: list) -> torch.Tensor:
    return torch.as_tensor(data)


def _index_ndarray(data: np.ndarray) -> torch.Tensor:
    filled = torch.zeros(6)
    filled[data] = 1.0
    return filled


def _row_from_ndarray(data: np.ndarray) -> torch.Tensor:
    rows = torch.zeros(2, 3)
    rows[0] = torch.tensor(data)
    return rows


def _bump_ndarray(data: np.ndarray) -> None:
    data += 1


def _bump_first(data: list) -> None:
    data[0] = -1.0


def _bump_nested(data: list) -> None:
    data[1][0] = -3


def _grow(data: list) -> None:
    data[0] = -4.0
    data.append(6.0)


def _move_index(data: np.ndarray) -> None:
    data[:] = [1, 2]


READ_DATA = {
    "tensor(ndarray)": (
        _tensor_ndarray,
        lambda: np.linspace(0, 1, 5, dtype=np.float32),
        _bump_ndarray,
    ),
    "tensor(list)": (_tensor_list, lambda: [0.5, 1.5, 2.5], _bump_first),
    "tensor(nested_list)": (_tensor_list, lambda: [[1, 2], [3, 4]], _bump_nested),
    "as_tensor(list)": (_as_tensor_list, lambda: [4.0, 5.0], _grow),
    "tensor(array.array)": (_tensor_list, lambda: array.array("f", [7.0, 8.0]), _bump_first),
    "index_with_ndarray": (_index_ndarray, lambda: np.array([0, 3]), _move_index),
    "row=tensor(ndarray)": (_row_from_ndarray, lambda: np.ones(3, dtype=np.float32), _bump_ndarray),
}


class FromData(nn.Module):
    def __init__(self, read, data) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("buffer", read(data))
        self.param = nn.Parameter(read(data).float())
        self.after = nn.Linear(3, 3)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("source", sorted(READ_DATA))
def test_data_changed_after_the_block_does_not_change_the_values(source, include_buffers):
    read, make, change = READ_DATA[source]
    data = make()
    ref = copy.deepcopy(build_eagerly(lambda: FromData(read, data)))
    model = build_empty(lambda: FromData(read, data), include_buffers)
    change(data)
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
    if read == "as_tensor(ndarray)" and not include_buffers:
        # a real buffer: eager construction's own tensor, still sharing the array as
        # eager's does, so materialize keeps it as it is
        materialize_exactly(model)
        assert np.shares_memory(model.shared.numpy(), values)
        assert_same_tensors(model, ref, ["lin.weight", "lin.bias"])
        return
    assert_exact_or_refused(model, ref, "shared")


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
def test_materialize_under_anotherdefault_dtype(make, include_buffers):
    def build() -> nn.Module:
        return Promoted(PROMOTIONS[make])

    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    # include_buffers=False: ``promoted`` is a real buffer the build computed exactly; the
    # parameter computed the same way is on meta and needs the replay
    with default_dtype(torch.float64):
        assert_exact_or_refused(
            model, ref, "promoted" if include_buffers else "param", because="dtype"
        )


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialize_inside_a_device_context_is_exact_or_refused(include_buffers):
    ref = build_eagerly(lambda: Promoted(PROMOTIONS["arange/8"]))
    model = build_empty(lambda: Promoted(PROMOTIONS["arange/8"]), include_buffers)
    with torch.device("meta"):
        assert_exact_or_refused(model, ref, "promoted")


@pytest.mark.parametrize("include_buffers", MODES)
def test_materialize_under_inference_mode_gives_ordinary_trainable_tensors(include_buffers):
    ref = build_eagerly(lambda: Promoted(PROMOTIONS["ones()"]))
    model = build_empty(lambda: Promoted(PROMOTIONS["ones()"]), include_buffers)
    with torch.inference_mode():
        assert_exact_or_refused(model, ref, "lin.weight")
    if not any(t.is_meta for t in model.parameters()):
        with torch.no_grad():
            model.lin.weight.add_(1.0)  # what an optimizer step does
