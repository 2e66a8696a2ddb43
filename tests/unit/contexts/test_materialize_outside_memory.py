"""materialize and memory torch's version counters do not watch.

A tensor over memory torch did not allocate (``torch.from_numpy``, ``torch.asarray`` of a
Python buffer, ``torch.frombuffer``) changes when its owner writes it, and no version counter
moves. Eager construction reads whatever the memory holds at each read, so the recording keeps
it by value: a snapshot at first sight, and a recorded refill each time a read finds it
changed. Tensor methods torch binds without an operator schema (``apply_``, ``map_``,
``map2_``) run a Python function over the memory, also without a version move: what they
write is refused, naming the method, never replayed as if unwritten.
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
    assert_eager_equal,
    assert_refused,
    build_eagerly,
    build_empty,
    materialize_exactly,
)

# -- memory refilled between reads -----------------------------------------------------


class NumpyStaging(nn.Module):
    """One NumPy staging array wrapped once, refilled for every layer, copied in."""

    def __init__(self) -> None:
        super().__init__()
        stage = np.zeros(4, dtype=np.float32)
        staged = torch.from_numpy(stage)
        self.layers = nn.ModuleList()
        for i in range(3):
            stage[:] = np.arange(4) * (i + 1)
            layer = nn.Linear(4, 4)
            with torch.no_grad():
                layer.bias.copy_(staged)
            self.layers.append(layer)


class PythonBuffer(nn.Module):
    """``torch.asarray`` of an ``array.array`` shares its memory: the array is written
    between the reads."""

    def __init__(self) -> None:
        super().__init__()
        data = array.array("f", [1.0, 2.0, 3.0])
        shared = torch.asarray(data)
        self.lin = nn.Linear(3, 3)
        data[0] = 10.0
        self.register_buffer("doubled", shared * 2)
        data[1] = 20.0
        self.scaled = nn.Parameter(shared + shared * 3)


class ByteBuffer(nn.Module):
    """``torch.frombuffer`` over a ``bytearray`` written through the bytearray."""

    def __init__(self) -> None:
        super().__init__()
        raw = bytearray(np.arange(4, dtype=np.float32).tobytes())
        view = torch.frombuffer(raw, dtype=torch.float32)
        self.first = nn.Parameter(view * 1.0)
        raw[0:4] = np.float32(7.5).tobytes()
        self.lin = nn.Linear(4, 4)
        self.second = nn.Parameter(view + 1.0)


class NumpyWrittenInPlace(nn.Module):
    """A NumPy array written in place by NumPy (``+=``, ufunc ``out=``) between two reads
    through the same ``from_numpy`` tensor, with random draws around them."""

    def __init__(self) -> None:
        super().__init__()
        table = np.linspace(0, 1, 6, dtype=np.float32)
        wrapped = torch.from_numpy(table)
        self.a = nn.Linear(6, 6)
        self.register_buffer("before", wrapped.clone())
        table += 1
        np.sqrt(table, out=table)
        self.b = nn.Linear(6, 6)
        self.after = nn.Parameter(wrapped * 3)


class ChangedAfterTheBlock(nn.Module):
    """The array is written after the block: eager's values are the ones read inside it."""

    def __init__(self, table: np.ndarray) -> None:
        super().__init__()
        wrapped = torch.from_numpy(table)
        self.lin = nn.Linear(3, 3)
        self.register_buffer("read", wrapped.clone())
        self.param = nn.Parameter(wrapped * 3)


REFILLED = {
    "numpy_staging": NumpyStaging,
    "python_buffer": PythonBuffer,
    "bytearray": ByteBuffer,
    "numpy_in_place": NumpyWrittenInPlace,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("build", sorted(REFILLED))
def test_memory_written_outside_torch_between_reads_is_read_as_eager_read_it(
    build, include_buffers
):
    if build == "python_buffer" and include_buffers:  # torch.asarray was sent to meta
        model = build_empty(REFILLED[build], include_buffers)
        assert_refused(model, "doubled", "scaled", because="Python buffer")
        return
    assert_eager_equal(REFILLED[build], include_buffers)


class AsTensorOnMeta(nn.Module):
    """With ``include_buffers=True`` a factory over an array's memory goes to meta, where
    it cannot share that memory as eager's tensor does."""

    def __init__(self, make, change: bool) -> None:
        super().__init__()
        table = np.arange(3, dtype=np.float32)
        shared = make(table)
        self.lin = nn.Linear(3, 3)
        if change:
            table[0] = 5.0
        self.register_buffer("read", shared * 2)
        self.after = nn.Linear(3, 3)


FACTORIES = {
    "asarray(ndarray)": torch.asarray,
    "as_tensor(ndarray)": torch.as_tensor,
    "asarray(array.array)": lambda t: torch.asarray(array.array("f", t.tolist())),
}


@pytest.mark.parametrize("make", sorted(FACTORIES))
def test_a_factory_over_an_arrays_memory_sent_to_meta_is_exact_or_refused(make):
    build = FACTORIES[make]
    # unchanged between the reads: exact
    assert_eager_equal(lambda: AsTensorOnMeta(build, False), include_buffers=True)
    if make == "asarray(array.array)":
        return  # the array is a temporary: nothing can change it
    # changed: eager's tensor, sharing the array, reads the change; on meta it cannot
    model = build_empty(lambda: AsTensorOnMeta(build, True), include_buffers=True)
    message = assert_refused(model, "read", because=r"NumPy array or Python buffer.*copy")
    assert "lin.weight" not in message and "after.weight" not in message


@pytest.mark.parametrize("make", ["asarray(ndarray)", "as_tensor(ndarray)"])
def test_a_factory_over_an_arrays_memory_on_cpu_follows_the_array(make):
    assert_eager_equal(lambda: AsTensorOnMeta(FACTORIES[make], True), include_buffers=False)


@pytest.mark.parametrize("include_buffers", MODES)
def test_an_array_written_after_the_block_does_not_change_the_values(include_buffers):
    table = np.arange(3, dtype=np.float32)
    ref = copy.deepcopy(build_eagerly(lambda: ChangedAfterTheBlock(table.copy())))
    model = build_empty(lambda: ChangedAfterTheBlock(table), include_buffers)
    table[:] = -1
    materialize_exactly(model, ref)


# -- registering memory torch does not own ---------------------------------------------


class RegistersNumpyMemory(nn.Module):
    def __init__(self, table: np.ndarray) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("table", torch.from_numpy(table))
        self.weight = nn.Parameter(torch.from_numpy(table))
        self.after = nn.Linear(3, 3)


def test_a_twin_of_memory_torch_does_not_own_is_refused_saying_why():
    # eager's tensors keep sharing the array's memory; a meta twin cannot
    table = np.arange(3, dtype=np.float32)
    model = build_empty(lambda: RegistersNumpyMemory(table), include_buffers=True)
    message = assert_refused(model, "table", "weight", because=r"does not own.*clone\(\)")
    assert "lin.weight" not in message and "after.weight" not in message


# -- methods without an operator schema -------------------------------------------------


class AppliesPython(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        other = torch.arange(3, dtype=torch.float32)
        with torch.no_grad():
            target = self.lin.bias.detach()
            if how == "apply_":
                target.apply_(lambda x: x * 2)
            elif how == "map_":
                target.map_(other, lambda x, y: x + y)
            else:
                target.map2_(other, other, lambda x, y, z: x + y * z)
        self.after = nn.Linear(3, 3)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("how", ["apply_", "map_", "map2_"])
def test_a_python_function_run_over_a_parameter_is_refused_naming_it(how, include_buffers):
    model = build_empty(lambda: AppliesPython(how), include_buffers)
    message = assert_refused(model, "lin.bias", because=rf"{how}\(\).*without an operator schema")
    assert "after.weight" not in message and "lin.weight" not in message


class AppliesToABuffer(nn.Module):
    """``apply_`` over a real buffer (params-only) that a parameter is computed from."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4, dtype=torch.float32))
        self.table.apply_(lambda x: x * x + 1)
        self.param = nn.Parameter(self.table * 2)
        self.lin = nn.Linear(4, 4)


def test_a_value_computed_after_apply_is_refused_and_the_real_buffer_kept():
    model = build_empty(AppliesToABuffer, include_buffers=False)
    assert not model.table.is_meta
    assert_refused(model, "param", because=r"apply_\(\)")


def test_apply_on_a_meta_buffer_is_refused():
    model = build_empty(AppliesToABuffer, include_buffers=True)
    assert_refused(model, "table", "param", because=r"apply_\(\)")


class RegistersAFactoryResult(nn.Module):
    def __init__(self, make, table: np.ndarray) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("table", make(table))


@pytest.mark.parametrize("make", ["asarray(ndarray)", "as_tensor(ndarray)"])
def test_registering_a_factory_result_sharing_an_array_on_meta_is_refused(make):
    # eager's buffer is the array's memory: it shows what the array holds later
    table = np.arange(3, dtype=np.float32)
    model = build_empty(
        lambda: RegistersAFactoryResult(FACTORIES[make], table), include_buffers=True
    )
    table[:] = 9.0
    message = assert_refused(model, "table", because=r"does not own.*clone\(\)")
    assert "lin.weight" not in message


def test_registering_a_copy_of_an_array_on_meta_is_exact():
    # torch.tensor always copies: eager's buffer does not follow the array
    table = np.arange(3, dtype=np.float32)
    ref = copy.deepcopy(build_eagerly(lambda: RegistersAFactoryResult(torch.tensor, table)))
    model = build_empty(lambda: RegistersAFactoryResult(torch.tensor, table), include_buffers=True)
    table[:] = 9.0
    materialize_exactly(model, ref)
