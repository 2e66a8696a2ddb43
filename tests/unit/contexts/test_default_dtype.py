"""metamode.default_dtype(dtype): per-factory semantics, reach, isolation, nesting, arguments.

The specification is "what the call returns after torch.set_default_dtype(dtype)":
every case below is run both ways and compared (the global setting is put
back before each comparison; the suite's guard checks it stays put).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import metamode
from metamode._contexts.default_dtype import DefaultDtype
from metamode.lab.threads import wait

DTYPES = (torch.float16, torch.bfloat16, torch.float64)


# name -> call. Integer/bool inputs must stay integer/bool; floating ones follow.
FACTORIES: dict[str, Callable[[], torch.Tensor]] = {
    "empty": lambda: torch.empty(2),
    "empty_strided": lambda: torch.empty_strided((2,), (1,)),
    "empty_permuted": lambda: torch.empty_permuted((2, 3), (1, 0)),
    "zeros": lambda: torch.zeros(2, 3),
    "zeros dtype=None": lambda: torch.zeros(2, dtype=None),
    "ones": lambda: torch.ones(2),
    "rand": lambda: torch.rand(2),
    "randn": lambda: torch.randn(2),
    "randint": lambda: torch.randint(0, 3, (2,)),
    "randperm": lambda: torch.randperm(3),
    "eye": lambda: torch.eye(2),
    "scalar_tensor(int)": lambda: torch.scalar_tensor(1),
    "normal(float, float, size)": lambda: torch.normal(0.0, 1.0, (2,)),
    "normal(tensor, float)": lambda: torch.normal(torch.zeros(2, dtype=torch.float64), 1.0),
    "hann_window": lambda: torch.hann_window(4),
    "kaiser_window": lambda: torch.kaiser_window(4),
    "fft.fftfreq": lambda: torch.fft.fftfreq(4),
    "full(int)": lambda: torch.full((2,), 1),
    "full(float)": lambda: torch.full((2,), 1.5),
    "full(bool)": lambda: torch.full((2,), True),
    "full(fill_value=float)": lambda: torch.full((2,), fill_value=0.5),
    "full(0-d float64 tensor)": lambda: torch.full((2,), torch.tensor(1.5, dtype=torch.float64)),
    "full(0-d int tensor)": lambda: torch.full((2,), torch.tensor(1)),
    "full(np.float64)": lambda: torch.full((2,), np.float64(1.5)),
    "full(np.int32)": lambda: torch.full((2,), np.int32(1)),
    "arange(int)": lambda: torch.arange(5),
    "arange(int, int, int)": lambda: torch.arange(0, 10, 2),
    "arange(float step)": lambda: torch.arange(0, 1, 0.25),
    "arange(end=float)": lambda: torch.arange(end=3.0),
    "arange(0-d int tensor)": lambda: torch.arange(torch.tensor(5)),
    "arange(0-d float64 tensor)": lambda: torch.arange(torch.tensor(5.0, dtype=torch.float64)),
    "linspace(int, int)": lambda: torch.linspace(0, 10, 5),
    "linspace(0-d int tensor)": lambda: torch.linspace(torch.tensor(0), 1, 3),
    "logspace": lambda: torch.logspace(0, 1, 3),
    "tensor(floats)": lambda: torch.tensor([1.0, 2]),
    "tensor(nested floats)": lambda: torch.tensor([[1, 2], [3, 4.5]]),
    "tensor(float scalar)": lambda: torch.tensor(0.1),
    "tensor(ints)": lambda: torch.tensor([1, 2]),
    "tensor(bools)": lambda: torch.tensor([True, False]),
    "tensor([])": lambda: torch.tensor([]),
    "tensor([[]])": lambda: torch.tensor([[]]),
    "tensor(float32 ndarray)": lambda: torch.tensor(np.zeros(2, dtype=np.float32)),
    "tensor(float64 ndarray)": lambda: torch.tensor(np.zeros(2)),
    "tensor([np.float32])": lambda: torch.tensor([np.float32(1)]),
    "tensor([np.float64, float])": lambda: torch.tensor([np.float64(1), 1.5]),
    "tensor([float64 tensor])": lambda: torch.tensor([torch.tensor(1.0, dtype=torch.float64)]),
    "as_tensor(floats)": lambda: torch.as_tensor([1.5]),
    "as_tensor(float)": lambda: torch.as_tensor(1.5),
    "as_tensor(ints)": lambda: torch.as_tensor([1]),
    "as_tensor(floats, dtype=float64)": lambda: torch.as_tensor([1.5], dtype=torch.float64),
    "as_tensor(int64 tensor)": lambda: torch.as_tensor(torch.tensor([1])),
    "asarray(floats)": lambda: torch.asarray([1.5]),
    "asarray(ints)": lambda: torch.asarray([1]),
    "new_tensor(floats) on int64": lambda: torch.zeros(1, dtype=torch.int64).new_tensor([1.5]),
    "new_tensor(ints) on float64": lambda: torch.ones(1, dtype=torch.float64).new_tensor([1]),
    "Tensor.new_zeros": lambda: torch.zeros(1, dtype=torch.float64).new_zeros(2),
    "zeros_like(int)": lambda: torch.zeros_like(torch.tensor([1])),
    "rand_like(float64)": lambda: torch.rand_like(torch.zeros(1, dtype=torch.float64)),
    "explicit dtype": lambda: torch.ones(2, dtype=torch.float32),
    "explicit int dtype": lambda: torch.zeros(2, dtype=torch.int32),
    "out=": lambda: torch.zeros(2, out=torch.empty(2, dtype=torch.float32)),
    "full(complex) under float64": lambda: torch.full((2,), 1j),
}
COMPLEX = {"full(complex) under float64", "tensor(complex) under float64"}
FACTORIES["tensor(complex) under float64"] = lambda: torch.tensor([1j])


def _under_torchs_default(dtype: torch.dtype, call: Callable[[], torch.Tensor]) -> torch.Tensor:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return call()
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_factory_matches_torch_set_default_dtype(dtype):
    mismatches = []
    for name, call in FACTORIES.items():
        if name in COMPLEX and dtype != torch.float64:
            continue  # torch itself is inconsistent there: see the next test
        expected = _under_torchs_default(dtype, call).dtype
        with metamode.default_dtype(dtype):
            got = call().dtype
        if got != expected:
            mismatches.append(f"{name}: {got}, torch's default gives {expected}")
    assert mismatches == []


def test_integer_and_boolean_results_stay_integer_and_boolean():
    with metamode.default_dtype(torch.float16):
        assert torch.arange(5).dtype == torch.int64
        assert torch.full((2,), 3).dtype == torch.int64
        assert torch.full((2,), False).dtype == torch.bool
        assert torch.tensor([[1, 2], [3, 4]]).dtype == torch.int64
        assert torch.tensor([True]).dtype == torch.bool
        assert torch.randint(0, 5, (3,)).dtype == torch.int64
        assert torch.as_tensor(np.arange(3, dtype=np.int32)).dtype == torch.int32


def test_complex_values_get_a_complex_dtype_of_matching_width():
    with metamode.default_dtype(torch.float64):
        assert torch.full((1,), 1j).dtype == torch.complex128
        assert torch.linspace(0, 1j, 3).dtype == torch.complex128
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        with metamode.default_dtype(dtype):
            assert torch.tensor([1j]).dtype == torch.complex64
            assert torch.full((1,), 1 + 1j).dtype == torch.complex64
            assert torch.linspace(0, 1j, 3).dtype == torch.complex64


def test_values_are_made_in_the_dtype_not_converted_to_it():
    """0.1 in float64 directly, not via float32 (which would lose digits)."""
    with metamode.default_dtype(torch.float64):
        made = torch.tensor([0.1, 1 / 3])
        steps = torch.arange(0, 1, 0.1)
        spaced = torch.linspace(0, 1, 7)
    assert torch.equal(made, torch.tensor([0.1, 1 / 3], dtype=torch.float64))
    assert torch.equal(steps, _under_torchs_default(torch.float64, lambda: torch.arange(0, 1, 0.1)))
    assert torch.equal(spaced, torch.linspace(0, 1, 7, dtype=torch.float64))


def test_modules_are_built_in_the_dtype():
    with metamode.default_dtype(torch.bfloat16):
        linear = nn.Linear(4, 4)
        norm = nn.LayerNorm(4)
        batch_norm = nn.BatchNorm1d(4)
        embedding = nn.Embedding(10, 4)
    for module in (linear, norm, embedding):
        assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert batch_norm.running_var.dtype == torch.bfloat16
    assert batch_norm.num_batches_tracked.dtype == torch.int64


def test_composes_with_empty_weights_and_torch_device():
    with metamode.default_dtype(torch.float16), metamode.empty_weights():
        linear = nn.Linear(4, 4)
    assert linear.weight.is_meta and linear.weight.dtype == torch.float16
    # transformers' construction order: its dtype context, then torch.device("meta").
    with metamode.default_dtype(torch.float16), torch.device("meta"):
        made = torch.zeros(2)
    assert made.is_meta and made.dtype == torch.float16


# -- what a mode cannot reach (documented) ---------------------------------------


class _SinusoidalPositions(nn.Module):
    """The pattern of XGLM, M2M100, Musicgen... (transformers): asks torch for the default."""

    def __init__(self) -> None:
        super().__init__()
        table = torch.arange(4, dtype=torch.int64).float()
        self.register_buffer("weights", table.to(torch.get_default_dtype()), persistent=False)


def test_documented_limits():
    with metamode.default_dtype(torch.float16):
        assert torch.get_default_dtype() == torch.float32, "the process-wide value"
        assert _SinusoidalPositions().weights.dtype == torch.float32
        assert (torch.tensor([1]) * 0.5).dtype == torch.float32  # type promotion
        assert (torch.tensor([1]) / 2).dtype == torch.float32
        assert torch.Tensor(2).dtype == torch.float32  # legacy constructor
        assert torch.from_numpy(np.zeros(1, dtype=np.float64)).dtype == torch.float64


# -- thread isolation ------------------------------------------------------------------


def test_other_threads_keep_their_own_default():
    inside, done = threading.Event(), threading.Event()
    other: dict[str, torch.dtype] = {}

    def bystander() -> None:
        wait(inside)
        try:
            other["plain"] = torch.zeros(1).dtype
            other["linear"] = nn.Linear(2, 2).weight.dtype
            with metamode.default_dtype(torch.float64):
                other["own context"] = torch.ones(1).dtype
        finally:
            done.set()

    thread = threading.Thread(target=bystander)
    thread.start()
    with metamode.default_dtype(torch.float16):
        inside.set()
        wait(done)  # the bystander ran entirely while this context was active
        mine = torch.zeros(1).dtype
    thread.join()
    assert mine == torch.float16
    assert other == {
        "plain": torch.float32,
        "linear": torch.float32,
        "own context": torch.float64,
    }


# -- nesting, arguments --------------------------------------------------------


def test_innermost_context_wins_and_outer_resumes():
    with metamode.default_dtype(torch.float64):
        assert torch.zeros(1).dtype == torch.float64
        with metamode.default_dtype(torch.float16):
            assert torch.zeros(1).dtype == torch.float16
        assert torch.zeros(1).dtype == torch.float64
    assert torch.zeros(1).dtype == torch.float32


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("float16", TypeError),
        (None, TypeError),
        (torch.int32, ValueError),
        (torch.complex64, ValueError),
        (torch.float8_e4m3fn, ValueError),
    ],
    ids=str,
)
def test_invalid_dtypes_are_refused(value, error):
    with pytest.raises(error, match="dtype"):
        metamode.default_dtype(value)


def test_default_dtype_returns_a_default_dtype_context():
    # The ThreadScopedMode contract (single use, refused exits, decorator) is
    # tested for every context class in tests/unit/core/test_mode_contract.py.
    context = metamode.default_dtype(torch.float16)
    assert isinstance(context, DefaultDtype)
    assert repr(context) == "metamode.default_dtype(torch.float16)"


# -- mixed data: Python numbers, NumPy scalars and tensors in one call -------------------------

MIXED_DATA: dict[str, Callable[[], torch.Tensor]] = {
    "tensor([1.5, tensor(2.)])": lambda: torch.tensor([1.5, torch.tensor(2.0)]),
    "tensor([np.float32, float])": lambda: torch.tensor([np.float32(1.5), 2.5]),
    "full(np.bool_)": lambda: torch.full((1,), np.bool_(True)),
    "arange(np.bool_)": lambda: torch.arange(np.bool_(True)),
    "full(np.uint8)": lambda: torch.full((1,), np.uint8(1)),
    "full(np.float16)": lambda: torch.full((1,), np.float16(1)),
    "tensor([np.int32, float])": lambda: torch.tensor([np.int32(1), 2.5]),
    "tensor([np.float16, float])": lambda: torch.tensor([np.float16(1), 2.5]),
    "tensor([np.bool_, float])": lambda: torch.tensor([np.bool_(True), 2.5]),
    "tensor([float, float64 tensor])": lambda: torch.tensor(
        [1.5, torch.tensor(2.0, dtype=torch.float64)]
    ),
    "tensor([float, bfloat16 tensor])": lambda: torch.tensor(
        [1.5, torch.tensor(2.0, dtype=torch.bfloat16)]
    ),
    "tensor([int tensor, float])": lambda: torch.tensor([torch.tensor(2), 1.5]),
    "tensor([[float], [float32 1-d tensor]])": lambda: torch.tensor([[1.5], torch.ones(1)]),
    "as_tensor([float, tensor])": lambda: torch.as_tensor([1.5, torch.tensor(2.0)]),
    "asarray([np.float32, float])": lambda: torch.asarray([np.float32(1.5), 2.5]),
    "tensor([np.uint8])": lambda: torch.tensor([np.uint8(1)]),
    "tensor([[], []])": lambda: torch.tensor([[], []]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_dtype_matches_set_default_dtype_on_mixed_data(dtype):
    # The first three cases are where a rule reading only the Python types goes wrong:
    # torch gives float16 / float64 / float64 under those defaults.
    mismatches = []
    for name, call in MIXED_DATA.items():
        expected = _under_torchs_default(dtype, call).dtype
        with metamode.default_dtype(dtype):
            got = call().dtype
        if got != expected:
            mismatches.append(f"{name}: {got}, torch's default gives {expected}")
    assert mismatches == []
