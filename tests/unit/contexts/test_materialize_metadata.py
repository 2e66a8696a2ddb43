"""materialize and tensor metadata the program must keep besides storage and values: the
conjugate and negative bits torch reads complex tensors through (``x.conj()``, ``.mH``, the
``.imag`` of one), strides the registered tensor has in eager construction (a strided view, a
stride-0 ``expand``), and layouts without strided storage (sparse). Each is replayed exactly
(bits, strides, dtype, layout compared with eager) or refused before anything changes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_exact_or_refused,
    assert_refused,
    build_eagerly,
    build_empty,
    materialize_exactly,
)


class Built(nn.Module):
    def __init__(self, init) -> None:
        super().__init__()
        init(self)
        self.after = nn.Linear(4, 4)  # draws after: the stream must be where eager's is


# -- conjugate and negative bits ---------------------------------------------------------


def _unitary_product(m: nn.Module) -> None:
    q = torch.randn(4, 4, dtype=torch.complex64)
    m.w = nn.Parameter(q @ q.mH)  # a matmul reading a conjugate view


def _conj_times(m: nn.Module) -> None:
    z = torch.randn(6, dtype=torch.complex64)
    m.w = nn.Parameter(z.conj() * z)  # |z|^2, imaginary part 0 only through the bit


def _conj_buffer(m: nn.Module) -> None:
    w = torch.randn(4, dtype=torch.complex64)
    m.register_buffer("b", w.conj())  # the buffer is a conjugate view of w


def _conj_parameter(m: nn.Module) -> None:
    w = torch.randn(4, dtype=torch.complex64)
    m.p = nn.Parameter(w.conj())


def _negative_view(m: nn.Module) -> None:
    w = torch.randn(4, dtype=torch.complex64)
    m.p = nn.Parameter(w.conj().imag * 2)  # computed from a negative view


def _negative_view_registered(m: nn.Module) -> None:
    w = torch.randn(4, dtype=torch.complex64)
    m.register_buffer("b", w.conj().imag)  # a float buffer with the negative bit


def _conj_resolved_then_written(m: nn.Module) -> None:
    w = torch.randn(4, dtype=torch.complex64)
    c = w.conj()
    with torch.no_grad():
        c.mul_(2)  # writes w's memory through the bit
    m.p = nn.Parameter(w.clone())


BITS = {
    "q @ q.mH": _unitary_product,
    "z.conj() * z": _conj_times,
    "buffer w.conj()": _conj_buffer,
    "Parameter(w.conj())": _conj_parameter,
    "w.conj().imag * 2": _negative_view,
    "buffer w.conj().imag": _negative_view_registered,
    "w.conj().mul_()": _conj_resolved_then_written,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(BITS))
def test_conjugate_and_negative_bits_are_replayed(idiom, include_buffers):
    # the old code replayed every view without its bits: values conjugated or negated
    assert_eager_equal(lambda: Built(BITS[idiom]), include_buffers)


# -- strides of a registered view ------------------------------------------------------


def _expanded(m: nn.Module) -> None:
    t = torch.randn(4)
    m.p = nn.Parameter(t.expand(3, 4))  # eager: strides (0, 1)


def _unsqueezed_expanded(m: nn.Module) -> None:
    t = torch.randn(3, 1)
    m.p = nn.Parameter(t.expand(3, 5))  # eager: strides (1, 0)


def _broadcast_to(m: nn.Module) -> None:
    t = torch.randn(1, 4)
    m.p = nn.Parameter(torch.broadcast_to(t, (2, 4)))


STRIDE_0 = {
    "expand(3, 4)": _expanded,
    "[:, None].expand": _unsqueezed_expanded,
    "broadcast_to": _broadcast_to,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(STRIDE_0))
def test_a_stride_0_parameter_keeps_its_strides_or_is_refused(idiom, include_buffers):
    # the old code gave the parameter contiguous strides (include_buffers=False)
    ref = build_eagerly(lambda: Built(STRIDE_0[idiom]))
    model = build_empty(lambda: Built(STRIDE_0[idiom]), include_buffers)
    outcome = assert_exact_or_refused(model, ref, "p", because="stride")
    if not include_buffers:
        assert outcome == "refused"


def _every_other_column(m: nn.Module) -> None:
    t = torch.randn(4, 8)
    m.p = nn.Parameter(t[:, ::2])  # eager: strides (8, 2)


def _a_column(m: nn.Module) -> None:
    t = torch.randn(4, 8)
    m.p = nn.Parameter(t[:, 3])  # eager: strides (8,)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("init", [_every_other_column, _a_column])
def test_a_parameter_registered_as_a_strided_view_keeps_eager_strides(init, include_buffers):
    # the old code gave the twin, and so the parameter, contiguous strides
    assert_eager_equal(lambda: Built(init), include_buffers)


# -- layouts without strided storage ---------------------------------------------------


def _sparse_coo_buffer(m: nn.Module) -> None:
    m.register_buffer("s", torch.eye(3).to_sparse())


def _sparse_coo_tensor(m: nn.Module) -> None:
    indices = torch.tensor([[0, 1, 2], [2, 0, 1]])
    m.register_buffer("s", torch.sparse_coo_tensor(indices, torch.randn(3), (3, 3)))


def _sparse_csr_buffer(m: nn.Module) -> None:
    m.register_buffer("s", torch.randn(3, 3).relu().to_sparse_csr())


def _dense_from_sparse(m: nn.Module) -> None:
    s = torch.eye(3).to_sparse()
    m.register_buffer("s", s)
    m.register_buffer("d", s.to_dense() * 2)


SPARSE = {
    "eye().to_sparse()": _sparse_coo_buffer,
    "sparse_coo_tensor": _sparse_coo_tensor,
    "to_sparse_csr()": _sparse_csr_buffer,
    "to_dense() of sparse": _dense_from_sparse,
}


@pytest.mark.parametrize("idiom", sorted(SPARSE))
def test_a_sparse_buffer_builds_and_materializes_exactly(idiom):
    # the old code crashed in the replayable build (untyped_storage() of a sparse tensor)
    ref = build_eagerly(lambda: Built(SPARSE[idiom]))
    model = build_empty(lambda: Built(SPARSE[idiom]))
    assert model.s.layout == ref.s.layout
    assert metamode.is_materializable(model)
    metamode.materialize(model)
    for name, tensor in [*ref.named_parameters(), *ref.named_buffers()]:
        got = dict([*model.named_parameters(), *model.named_buffers()])[name]
        assert got.layout == tensor.layout, name
        assert torch.equal(got.to_dense(), tensor.to_dense()), name


def test_a_sparse_tensor_made_on_meta_is_refused_by_name():
    # the old code crashed in the replayable build
    def init(m: nn.Module) -> None:
        indices = torch.tensor([[0, 1], [1, 0]])
        values = torch.ones(2, device="meta")
        m.register_buffer(
            "s", torch.sparse_coo_tensor(indices.to("meta"), values, (2, 2), device="meta")
        )

    model = build_empty(lambda: Built(init), include_buffers=True)
    assert_refused(model, "s", because="layout torch.sparse_coo")


# -- a dtype asked for that the meta kernel does not give -------------------------------


def _quantized_per_tensor(m: nn.Module) -> None:
    m.register_buffer("q", torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8))


def _quantized_by_keyword(m: nn.Module) -> None:
    x = torch.randn(2, 3)
    m.register_buffer(
        "q", torch.quantize_per_tensor(x, scale=0.2, zero_point=1, dtype=torch.quint8)
    )


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation")
@pytest.mark.parametrize("init", [_quantized_per_tensor, _quantized_by_keyword])
def test_a_dtype_the_meta_kernel_does_not_give_is_refused_upfront(init):
    model = build_empty(lambda: Built(init), include_buffers=True)
    assert model.q.dtype != build_eagerly(lambda: Built(init)).q.dtype  # torch's meta kernel
    assert_refused(model, "q", because=r"asked for torch\.q\w+ and made torch\.float32 on meta")


def _dtypes_asked_and_given(m: nn.Module) -> None:
    x = torch.randn(3)
    m.register_buffer("halved", x.to(torch.float16))
    m.register_buffer("ids", torch.arange(3, dtype=torch.int32))
    m.register_buffer("total", torch.cumsum(x, 0, dtype=torch.float64))
    m.register_buffer("bits", x.view(torch.int32))


@pytest.mark.parametrize("include_buffers", MODES)
def test_dtypes_asked_for_and_given_on_meta_are_exact(include_buffers):
    ref = build_eagerly(lambda: Built(_dtypes_asked_and_given))
    model = build_empty(lambda: Built(_dtypes_asked_and_given), include_buffers)
    materialize_exactly(model, ref)
