"""materialize against the results of torch factory calls made from no tensors (``torch.empty``,
``zeros``, ``full``, ``arange``, ``linspace``, ``tensor([...])``, ``empty_strided``, ``eye``,
``tril_indices``, ``asarray(list)``, ``scalar_tensor``, windows, ``fft.fftfreq``...): results
whose geometry, dtype or bits are unusual (complex and their ``conj`` / ``imag`` views,
unusual strides, ``memory_format``, zero-size, 0-dim, ``requires_grad``, inference tensors,
``out=``, sparse ``layout=``), results wrapped in ``nn.Parameter`` or registered as buffers
straight away or through a view, factories under changed global settings (default dtype,
default device, deterministic fill, denormal flushing), factories inside a
``TorchFunctionMode`` or a tensor subclass's classmethod, and ids reused after a result is
freed. The idioms are those of transformers, timm, diffusers and torchtitan.

Each idiom is built eagerly and in ``empty_weights(replayable=True)`` (params-only and
``include_buffers=True``) under one seed, then must materialize to eager's tensors bit for
bit (values, dtype, strides, bits, ties, storage sharing) or be refused upfront for an
accurate reason, with ``is_materializable`` agreeing. An idiom that breaks that promise (a
silently wrong value, stride or tie, a refusal for a wrong reason, a crash in the build that
plain ``empty_weights()`` does not have) is a strict xfail whose reason says what happens,
and whose body asserts what the promise allows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import metamode
from tests.unit.contexts.materialize_checks import (
    EITHER,
    EXACT,
    MODES,
    REFUSED,
    Built,
    Outcome,
    assert_refused,
    build_eagerly,
    build_empty,
    check_idiom,
    default_dtype,
    deterministic,
    idiom_cases,
    materialize_exactly,
    tensors,
)

pytestmark = pytest.mark.filterwarnings("ignore")

# a refusal that blames code run after the block, for a tensor the block itself made so
_NOT_AFTER = r"(?s)^(?!.*after its empty_weights block)"


@contextmanager
def default_device(device: str) -> Iterator[None]:
    """``torch.set_default_device(device)`` for the block, unset after (it is unset before)."""
    assert torch.get_default_device() == torch.device("cpu")
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


# == results whose geometry, dtype or bits are unusual =======================================


def _complex_conj_views(m: nn.Module) -> None:
    """A complex factory's ``conj()`` registered (conjugate bit), and ``real`` / ``imag``
    views of a complex ``full`` as buffers."""
    m.register_buffer("conj", torch.ones(3, dtype=torch.complex64).conj())
    z = torch.full((2, 3), 1 + 2j)
    m.register_buffer("imag", z.imag)
    m.register_buffer("real", z.real)


def _complex_neg_view(m: nn.Module) -> None:
    """``torch.tensor`` of Python complex numbers; ``conj().imag`` (negative bit) and
    ``view_as_real`` of a complex ``full`` registered."""
    z = torch.tensor([1 + 2j, 3 - 4j])
    m.register_buffer("z", z)
    m.register_buffer("neg_imag", z.conj().imag)
    m.register_buffer("as_real", torch.view_as_real(torch.full((2,), 2 + 3j)))
    m.register_buffer("c", torch.tensor([0, 1, 2], dtype=torch.complex64).conj())


def _complex_parameters(m: nn.Module) -> None:
    """Complex parameters: ``Parameter(zeros(complex).conj())`` and ``Parameter(full.imag)``;
    a conjugate view written in place (the write goes through the conjugate bit)."""
    m.p = nn.Parameter(torch.zeros(3, dtype=torch.complex64).conj())
    m.q = nn.Parameter(torch.full((2, 2), 1 - 1j).imag)
    z = torch.ones(2, dtype=torch.complex128).conj()
    z.mul_(1j)
    m.register_buffer("z", z)


def _empty_strided_unusual(m: nn.Module) -> None:
    """``empty_strided`` column-major, with a stride-0 dimension, and with gaps between rows,
    each filled in place."""
    m.register_buffer("fortran", torch.empty_strided((2, 3), (1, 2)).fill_(2.0))
    m.register_buffer("stride0", torch.empty_strided((2, 3), (0, 1)).fill_(3.0))
    m.register_buffer("gaps", torch.empty_strided((2, 3), (5, 1)).fill_(4.0))
    m.p = nn.Parameter(torch.empty_strided((3, 4), (1, 3)).fill_(1.0))


def _memory_formats(m: nn.Module) -> None:
    """``torch.empty(..., memory_format=channels_last / channels_last_3d)`` filled, as a
    buffer and as parameters; ``empty_permuted``."""
    m.register_buffer("cl", torch.empty(2, 3, 4, 5, memory_format=torch.channels_last).fill_(1))
    m.p = nn.Parameter(torch.empty(2, 3, 4, 5, memory_format=torch.channels_last).zero_())
    m.q = nn.Parameter(torch.empty(1, 2, 2, 3, 2, memory_format=torch.channels_last_3d).zero_())
    m.register_buffer("perm", torch.empty_permuted((2, 3, 4), (2, 0, 1)).fill_(1.0))


def _zero_size(m: nn.Module) -> None:
    """Zero-size factory results: ``empty(0)``, ``zeros(0, 3)``, ``Parameter(empty(3, 0))``,
    ``tensor([])``."""
    m.register_buffer("empty0", torch.empty(0))
    m.register_buffer("zeros03", torch.zeros(0, 3))
    m.register_buffer("listless", torch.tensor([]))
    m.p = nn.Parameter(torch.empty(3, 0))
    m.q = nn.Parameter(torch.zeros(0, 4))


def _zero_dim(m: nn.Module) -> None:
    """0-dim results: ``tensor(3.0)``, ``scalar_tensor(2, dtype=int64)``, ``Parameter(tensor(
    0.5))`` (a temperature / logit scale)."""
    m.register_buffer("scalar", torch.tensor(3.0))
    m.register_buffer("scalar_int", torch.scalar_tensor(2, dtype=torch.int64))
    m.logit_scale = nn.Parameter(torch.tensor(0.5))


def _dtypes_inferred(m: nn.Module) -> None:
    """Dtypes a factory infers from its Python arguments: bool and int ``full``, float
    ``arange``, ``tensor`` of bools, of a ``torch.Size``, of a ``range``; explicit int8,
    bfloat16, float8 (viewed as bytes) and a transposed float16 ``zeros``."""
    m.register_buffer("full_bool", torch.full((2,), True))
    m.register_buffer("full_int", torch.full((2,), 1))
    m.register_buffer("arange_float", torch.arange(0.0, 1.0, 0.1))
    m.register_buffer("bools", torch.tensor([True, False]))
    m.register_buffer("size", torch.tensor(torch.Size([2, 3])))
    m.register_buffer("range", torch.tensor(range(4)))
    m.register_buffer("int8", torch.tensor([[1, 2]], dtype=torch.int8))
    m.register_buffer("bf16", torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    m.register_buffer("fp8", torch.zeros(4, dtype=torch.float8_e4m3fn).view(torch.uint8))
    m.register_buffer("fp16_t", torch.zeros(2, 3, dtype=torch.float16).t())


def _index_and_grid_factories(m: nn.Module) -> None:
    """``tril_indices`` / ``triu_indices`` (Swin / ALiBi index tables), ``eye``, ``linspace``,
    ``logspace``, windows (audio front ends) and ``fft.fftfreq`` / ``rfftfreq``."""
    m.register_buffer("tril", torch.tril_indices(4, 4, offset=-1))
    m.register_buffer("triu", torch.triu_indices(3, 4))
    m.register_buffer("eye", torch.eye(3, 4, dtype=torch.float64))
    m.register_buffer("lin", torch.linspace(0, 1, 7))
    m.register_buffer("log", torch.logspace(0, 2, 5, base=2.0))
    m.register_buffer("hann", torch.hann_window(8, periodic=False))
    m.register_buffer("kaiser", torch.kaiser_window(6))
    m.register_buffer("freq", torch.fft.fftfreq(8, d=0.5))
    m.register_buffer("rfreq", torch.fft.rfftfreq(8))


def _asarray_and_as_tensor(m: nn.Module) -> None:
    """``asarray`` / ``as_tensor`` of Python lists, of a list of 0-dim tensors, of ``bytes``
    (memory torch did not allocate), and ``torch.tensor`` of a tensor."""
    m.register_buffer("from_list", torch.asarray([1, 2, 3], dtype=torch.float16))
    m.register_buffer("as_tensor", torch.as_tensor([[1.0, 2.0]]))
    m.register_buffer("from_tensors", torch.asarray([torch.tensor(1.0), torch.tensor(2.0)]))
    m.register_buffer("from_bytes", torch.asarray(b"\x01\x02\x03\x04", dtype=torch.uint8))
    m.register_buffer("copied", torch.tensor(torch.arange(3.0)))


def _causal_mask(m: nn.Module) -> None:
    """transformers' causal mask: ``full((L, L), float("-inf")).triu(1)``, and a float16
    ``full`` of ``finfo.min``."""
    mask = torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)
    m.register_buffer("mask", mask, persistent=False)
    m.register_buffer("fmin", torch.full((2,), torch.finfo(torch.float16).min, dtype=torch.half))


def _grad_and_pinning_keywords(m: nn.Module) -> None:
    """``requires_grad=True`` results as a buffer, as a Parameter, through an op (a buffer
    with a grad_fn), written under ``no_grad``; ``pin_memory=False``; ``requires_grad_()``."""
    m.register_buffer("leaf", torch.zeros(3, requires_grad=True))
    m.register_buffer("computed", torch.ones(3, requires_grad=True) * 2)
    m.p = nn.Parameter(torch.tensor([1.0, 2.0], requires_grad=True))
    t = torch.zeros(3, requires_grad=True)
    with torch.no_grad():
        t[0] = 1.0
    m.q = nn.Parameter(t)
    m.r = nn.Parameter(torch.zeros(2).requires_grad_())
    m.register_buffer("unpinned", torch.zeros(3, pin_memory=False))
    m.s = nn.Parameter(torch.empty(3, pin_memory=False).fill_(1))


def _views_registered(m: nn.Module) -> None:
    """Views of factory results registered: a row slice, a step slice, a transpose and a
    column slice as Parameters, dtype reinterpretations (``view(float32)`` of int32)."""
    t = torch.arange(12.0)
    m.register_buffer("rows", t.view(3, 4)[1:])
    m.register_buffer("steps", t[::2])
    w = torch.zeros(4, 4)
    m.cols = nn.Parameter(w[:, :2])
    m.t = nn.Parameter(w.t())
    m.register_buffer("bits", torch.arange(4, dtype=torch.int32).view(torch.float32))
    m.register_buffer("bytes", torch.ones(4, dtype=torch.float32).view(torch.uint8))


def _wrapped_straight_away(m: nn.Module) -> None:
    """Results wrapped at once: ``Parameter(empty)`` then ``init.zeros_``,
    ``Parameter(zeros, requires_grad=False)``, ``nn.Buffer(zeros)``,
    ``nn.Buffer(arange, persistent=False)``."""
    m.p = nn.Parameter(torch.empty(3, 4))
    nn.init.zeros_(m.p)
    m.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    m.b = nn.Buffer(torch.zeros(3))
    m.c = nn.Buffer(torch.arange(4), persistent=False)


def _legacy_constructors(m: nn.Module) -> None:
    """Old model code: ``torch.Tensor([...])``, ``torch.LongTensor([...])``,
    ``Parameter(torch.Tensor(out, in))`` then ``init.uniform_``, ``FloatTensor(n).zero_()``."""
    m.register_buffer("a", torch.Tensor([0.5, 1.5]))
    m.register_buffer("ids", torch.LongTensor([1, 2, 3]))
    m.w = nn.Parameter(torch.Tensor(3, 4))
    nn.init.uniform_(m.w, -0.1, 0.1)
    m.b = nn.Parameter(torch.FloatTensor(3).zero_())


def _inference_mode_factory(m: nn.Module) -> None:
    """A factory under ``torch.inference_mode()`` (an inference tensor) registered."""
    with torch.inference_mode():
        t = torch.zeros(3)
    m.register_buffer("cache", t)


def _ids_reused(m: nn.Module) -> None:
    """Factory results written and freed in a loop (their ids and memory reused), then fresh
    factory results registered."""
    for i in range(4):
        scratch = torch.zeros(3)
        scratch.add_(i)
        del scratch
    m.register_buffer("kept", torch.full((3,), 7.0))
    m.p = nn.Parameter(torch.ones(3))
    for _ in range(3):
        scratch = torch.arange(3.0)
        del scratch
    m.register_buffer("last", torch.arange(3.0) * 2)


class _Tagged(torch.Tensor):
    """A tensor subclass with factory classmethods."""

    @classmethod
    def zeros(cls, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape).as_subclass(cls)

    @classmethod
    def ramp(cls, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32).as_subclass(cls) / n


def _subclass_classmethods(m: nn.Module) -> None:
    """A tensor subclass's classmethods make the results: registered as they are (a
    subclass buffer and Parameter) and converted back to plain tensors."""
    m.register_buffer("z", _Tagged.zeros(3).as_subclass(torch.Tensor))
    m.register_buffer("ramp", _Tagged.ramp(4).as_subclass(torch.Tensor))
    m.register_buffer("tagged", _Tagged.zeros(2))
    m.p = nn.Parameter(_Tagged.ramp(4))


def _explicit_cpu(m: nn.Module) -> None:
    """``device=torch.device("cpu")`` / ``"cpu"`` passed explicitly (a real tensor even with
    ``include_buffers=True``), written in place, then registered."""
    m.register_buffer("idx", torch.arange(4, device=torch.device("cpu")))
    t = torch.zeros(4, device=torch.device("cpu"))
    t[1] = 5.0
    m.register_buffer("written", t)
    m.register_buffer("scaled", torch.ones(2, device="cpu") * 3)
    m.p = nn.Parameter(torch.ones(3, device="cpu"))


def _default_float64(m: nn.Module) -> None:
    """Factories with ``dtype`` left out or ``None`` under ``set_default_dtype(float64)``:
    ``zeros``, float ``arange``, ``tensor`` of floats and of complex numbers, ``linspace``,
    ``scalar_tensor``, ``eye``, ``hann_window``."""
    with default_dtype(torch.float64):
        m.register_buffer("zeros", torch.zeros(3, dtype=None))
        m.register_buffer("arange", torch.arange(0, 1, 0.25))
        m.register_buffer("floats", torch.tensor([1.0, 2.0]))
        m.register_buffer("complex", torch.tensor([1 + 1j]))
        m.register_buffer("full_complex", torch.full((2,), 1 + 1j))
        m.register_buffer("scalar", torch.scalar_tensor(1.5))
        m.register_buffer("eye", torch.eye(2))
        m.register_buffer("hann", torch.hann_window(4))
        m.p = nn.Parameter(torch.linspace(0, 1, 3))


def _default_half(m: nn.Module) -> None:
    """transformers' ``_set_default_torch_dtype(float16 / bfloat16)`` around the build:
    factories and a Linear under a half default dtype."""
    with default_dtype(torch.float16):
        m.register_buffer("arange", torch.arange(0, 1, 0.25))
        m.register_buffer("floats", torch.tensor([1.0, 2.0]))
        m.register_buffer("full", torch.full((2,), 0.1))
        m.lin = nn.Linear(2, 2)
    with default_dtype(torch.bfloat16):
        m.register_buffer("lin_bf16", torch.linspace(0, 1, 5))
        m.p = nn.Parameter(torch.ones(3) / 3)
        m.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))


def _deterministic_empty(m: nn.Module) -> None:
    """``torch.empty`` / ``empty_strided`` / ``empty_permuted`` under
    ``use_deterministic_algorithms(True)`` (torch fills them with the dtype's largest
    value), registered unwritten."""
    with deterministic():
        m.register_buffer("i32", torch.empty(3, dtype=torch.int32))
        m.register_buffer("i16", torch.empty_strided((2, 2), (1, 2), dtype=torch.int16))
        m.register_buffer("i64", torch.empty_permuted((2, 3), (1, 0), dtype=torch.int64))
        m.register_buffer("b", torch.empty(2, dtype=torch.bool))


def _out_same_size(m: nn.Module) -> None:
    """``torch.arange(5, out=buf)`` into a buffer of the right size; ``torch.empty(...,
    out=)`` into an empty tensor (resized) then filled, and into a zeroed one (kept)."""
    buf = torch.empty(5)
    torch.arange(5, out=buf)
    m.register_buffer("o", buf)
    grown = torch.empty(0)
    torch.empty(2, 2, out=grown)
    grown.fill_(1.0)
    m.register_buffer("grown", grown)
    kept = torch.zeros(3)
    torch.empty(3, out=kept)
    m.register_buffer("kept", kept)


def _out_resizes_buffer(m: nn.Module) -> None:
    """``torch.zeros(3, out=torch.empty(0))`` and ``torch.linspace(..., out=)`` into a
    buffer of the wrong size: torch resizes ``out``."""
    buf = torch.empty(0)
    torch.zeros(3, out=buf)
    m.register_buffer("zeros", buf)
    grid = torch.empty(2)
    torch.linspace(0, 1, 5, out=grid)
    m.register_buffer("grid", grid)


def _out_resizes_parameter(m: nn.Module) -> None:
    """``torch.ones(4, out=param)`` under ``no_grad`` into an empty Parameter."""
    m.p = nn.Parameter(torch.empty(0))
    with torch.no_grad():
        torch.ones(4, out=m.p)


def _nested_padded(m: nn.Module) -> None:
    """A ragged table through ``torch.nested.nested_tensor`` of Python lists, padded into a
    dense buffer."""
    nested = torch.nested.nested_tensor([[1.0, 2.0], [3.0]])
    m.register_buffer("padded", nested.to_padded_tensor(0.0))


def _written_unseen(m: nn.Module) -> None:
    """A fresh ``torch.zeros`` written with torch functions disabled (as a C++ extension
    writes it), then registered and used for a Parameter."""
    t = torch.zeros(3)
    with torch._C.DisableTorchFunction():
        t.fill_(1.0)
    m.register_buffer("b", t)
    m.p = nn.Parameter(t * 2)


def _written_unseen_after_a_recorded_write(m: nn.Module) -> None:
    """The same, with a recorded write between the factory and the unseen one."""
    t = torch.zeros(3)
    t.add_(0.0)
    with torch._C.DisableTorchFunction():
        t.fill_(1.0)
    m.register_buffer("b", t)
    m.p = nn.Parameter(t * 2)


IDIOMS: dict[str, Callable[[nn.Module], None]] = {
    "complex conj / real / imag views": _complex_conj_views,
    "complex tensor(), conj().imag, view_as_real": _complex_neg_view,
    "complex parameters": _complex_parameters,
    "empty_strided unusual strides": _empty_strided_unusual,
    "memory_format / empty_permuted": _memory_formats,
    "zero-size results": _zero_size,
    "0-dim results": _zero_dim,
    "inferred and explicit dtypes": _dtypes_inferred,
    "index and grid factories": _index_and_grid_factories,
    "asarray / as_tensor": _asarray_and_as_tensor,
    "causal mask": _causal_mask,
    "requires_grad / pin_memory keywords": _grad_and_pinning_keywords,
    "views registered": _views_registered,
    "wrapped straight away": _wrapped_straight_away,
    "legacy constructors": _legacy_constructors,
    "inference_mode factory": _inference_mode_factory,
    "ids reused": _ids_reused,
    "tensor subclass classmethods": _subclass_classmethods,
    "explicit device cpu": _explicit_cpu,
    "default dtype float64": _default_float64,
    "default dtype float16 / bfloat16": _default_half,
    "deterministic empty": _deterministic_empty,
    "out= of the right size": _out_same_size,
    "out= resizes a buffer": _out_resizes_buffer,
    "out= resizes a parameter": _out_resizes_parameter,
    "nested_tensor padded": _nested_padded,
    "unseen write after a factory": _written_unseen,
    "unseen write after a recorded write": _written_unseen_after_a_recorded_write,
}

_UNSEEN = r"did not record"
OUTCOMES: dict[str, dict[bool, Outcome]] = {
    "nested_tensor padded": {mode: Outcome(EITHER, "nested") for mode in MODES},
    "unseen write after a factory": {mode: Outcome(REFUSED, _UNSEEN) for mode in MODES},
    "unseen write after a recorded write": {
        # params-only: the buffer stays the real tensor eager has; the Parameter is refused
        mode: Outcome(REFUSED, _UNSEEN)
        for mode in MODES
    },
}


@pytest.mark.parametrize(("idiom", "include_buffers", "outcome"), idiom_cases(IDIOMS, OUTCOMES))
def test_factory_results_are_exact_or_refused_upfront(
    idiom: str, include_buffers: bool, outcome: Outcome
) -> None:
    check_idiom(IDIOMS[idiom], include_buffers, outcome)


# == quantized results as a Parameter's source (params-only) ================================


def _quantized_factory_dequantized(m: nn.Module) -> None:
    """``torch._empty_affine_quantized`` filled by ``copy_`` of a quantized tensor, kept as a
    buffer; a Parameter from its ``dequantize()``."""
    q = torch._empty_affine_quantized([4], scale=0.5, zero_point=2, dtype=torch.quint8)
    q.copy_(torch.quantize_per_tensor(torch.tensor([0.5, 1.0, 1.5, 2.0]), 0.5, 2, torch.quint8))
    m.register_buffer("q", q)
    m.p = nn.Parameter(q.dequantize())


def _quantize_per_tensor_dequantized(m: nn.Module) -> None:
    """A Parameter from ``quantize_per_tensor(torch.tensor([...])).dequantize()`` (a
    fake-quantised initial value)."""
    q = torch.quantize_per_tensor(torch.tensor([0.5, 1.0, 1.5, 2.0]), 0.5, 2, torch.quint8)
    m.p = nn.Parameter(q.dequantize())


@pytest.mark.parametrize(
    "init",
    [_quantized_factory_dequantized, _quantize_per_tensor_dequantized],
    ids=["_empty_affine_quantized", "quantize_per_tensor"],
)
def test_a_parameter_from_a_quantized_tensor_is_exact_or_refused_upfront(
    init: Callable[[nn.Module], None],
) -> None:
    """With ``include_buffers=False`` the quantized tensor is real in the build; the Parameter
    computed from it is replayed from it, or refused upfront (``include_buffers=True`` cannot
    make a quantized tensor on meta: plain ``empty_weights`` fails the same way)."""
    check_idiom(init, False, Outcome(EITHER, r"quantiz"))


# == factories the build itself sends to meta ===============================================


def _meta_by_keyword(m: nn.Module, device: str | None) -> None:
    m.register_buffer("b", torch.zeros(3, device=device))
    m.p = nn.Parameter(torch.ones(3, device=None if device is None else torch.device(device)))
    m.register_buffer("r", torch.arange(4.0, device=device) * 2)


def _meta_by_default_device(m: nn.Module, device: str | None) -> None:
    if device is None:
        _meta_by_keyword(m, None)
        return
    with default_device(device):
        _meta_by_keyword(m, None)


def _meta_by_device_context(m: nn.Module, device: str | None) -> None:
    if device is None:
        _meta_by_keyword(m, None)
        return
    with torch.device(device):
        _meta_by_keyword(m, None)


META_PLACEMENTS: dict[str, Callable[[nn.Module, str | None], None]] = {
    "device='meta'": _meta_by_keyword,
    "set_default_device('meta')": _meta_by_default_device,
    "with torch.device('meta')": _meta_by_device_context,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("placement", sorted(META_PLACEMENTS))
def test_factories_sent_to_meta_in_the_build_replay_on_the_cpu(
    placement: str, include_buffers: bool
) -> None:
    """A factory the build places on meta itself (``device="meta"``, the default device, a
    ``torch.device`` context) makes what the context stands in for: materialize replays it
    on the CPU and gives what the same code gives there (``set_default_device`` restored)."""
    place = META_PLACEMENTS[placement]
    ref = build_eagerly(lambda: Built(lambda m: place(m, None)))
    model = build_empty(lambda: Built(lambda m: place(m, "meta")), include_buffers)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    materialize_exactly(model, ref)


# == sparse layouts asked for by keyword ====================================================


def _sparse_by_layout(m: nn.Module) -> None:
    m.lin = nn.Linear(2, 2)
    m.register_buffer("coo", torch.zeros(2, 3, layout=torch.sparse_coo))
    m.register_buffer("csr", torch.empty(2, 3, layout=torch.sparse_csr))


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_factory_with_a_sparse_layout_keyword_is_kept_or_refused(include_buffers: bool) -> None:
    """``zeros(..., layout=torch.sparse_coo)`` / ``empty(..., layout=torch.sparse_csr)``:
    params-only keeps the real sparse buffers eager has; with ``include_buffers`` they are
    refused by name for their layout."""
    ref = build_eagerly(lambda: Built(_sparse_by_layout))
    model = build_empty(lambda: Built(_sparse_by_layout), include_buffers)
    if include_buffers:
        assert_refused(model, "coo", "csr", because=r"layout torch\.sparse_c(oo|sr)")
        return
    assert metamode.is_materializable(model)
    metamode.materialize(model)
    got = dict([*model.named_parameters(), *model.named_buffers()])
    for name, tensor in [*ref.named_parameters(), *ref.named_buffers()]:
        assert got[name].layout == tensor.layout, name
        assert torch.equal(got[name].to_dense(), tensor.to_dense()), name


# == a TorchFunctionMode around the factories ================================================


class _OffsetViews(TorchFunctionMode):
    """Hands ``torch.arange(n)`` results out as views two elements into ``arange(n + 2)``
    (a mode that carves factory results out of a larger allocation)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.arange and len(args) == 1 and type(args[0]) is int:
            return func(args[0] + 2, **kwargs)[2:]
        return func(*args, **kwargs)


class _ConjugateComplex(TorchFunctionMode):
    """Hands complex ``torch.full`` results out as conjugate views."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        if func is torch.full and result.is_complex():
            return result.conj()
        return result


class _ChannelsLast(TorchFunctionMode):
    """Hands 4-d ``torch.ones`` results out channels_last."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        if func is torch.ones and result.dim() == 4:
            return result.contiguous(memory_format=torch.channels_last)
        return result


class _CachedArange(TorchFunctionMode):
    """Caches ``torch.arange`` results: one call's arguments give one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[Any, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.arange:
            key = (tuple((type(a), a) for a in args), tuple(sorted(kwargs.items(), key=str)))
            if key not in self.cache:
                self.cache[key] = func(*args, **kwargs)
            return self.cache[key]
        return func(*args, **kwargs)


class _DefaultBfloat16(TorchFunctionMode):
    """Gives ``zeros`` / ``ones`` called without ``dtype=`` bfloat16 (a mixed-precision build)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in (torch.zeros, torch.ones) and kwargs.get("dtype") is None:
            kwargs = {**kwargs, "dtype": torch.bfloat16}
        return func(*args, **kwargs)


class _SideTables(TorchFunctionMode):
    """Makes factories of its own inside its handler (a side table per ``torch.ones``)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        if func is torch.ones:
            self.made.append(torch.arange(3.0) + torch.zeros(3))
        return result


def _mode_body(m: nn.Module) -> None:
    m.lin = nn.Linear(2, 2)
    m.register_buffer("a", torch.zeros(3))
    m.p = nn.Parameter(torch.zeros(4))
    m.register_buffer("c", torch.full((2,), 1 + 2j))
    m.register_buffer("cl", torch.ones(1, 2, 3, 3))
    m.register_buffer("r1", torch.arange(4.0))
    m.r1.add_(1)
    m.register_buffer("r2", torch.arange(4.0))
    m.register_buffer("idx", torch.arange(4))
    m.ramp = nn.Parameter(torch.arange(4, dtype=torch.float32))


MODE_CLASSES: dict[str, Callable[[], TorchFunctionMode]] = {
    "offset views": _OffsetViews,
    "conjugate complex": _ConjugateComplex,
    "channels_last": _ChannelsLast,
    "cached arange": _CachedArange,
    "default bfloat16": _DefaultBfloat16,
    "side tables": _SideTables,
}


def _inside_mode(name: str) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        with MODE_CLASSES[name]():
            _mode_body(m)

    return init


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("mode", sorted(MODE_CLASSES))
def test_factories_under_a_mode_entered_in_the_build(mode: str, include_buffers: bool) -> None:
    """A ``TorchFunctionMode`` entered inside the build runs above the recording: what its
    handler does to a factory's result is recorded as torch calls, so materialize is exact."""
    check_idiom(_inside_mode(mode), include_buffers, Outcome(EXACT))


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("mode", sorted(MODE_CLASSES))
def test_factories_under_a_mode_entered_before_the_build(mode: str, include_buffers: bool) -> None:
    """A ``TorchFunctionMode`` entered before ``empty_weights`` runs below the recording:
    every torch call of the build goes through it, and what its handler does is not seen
    (handing out offset or conjugate views, other layouts, cached tensors), so the build is
    refused upfront, naming the mode."""
    with MODE_CLASSES[mode]():
        check_idiom(
            _mode_body,
            include_buffers,
            Outcome(
                REFUSED, f"built inside {MODE_CLASSES[mode].__qualname__}, a torch function mode"
            ),
        )


# == process-wide settings a factory's result depends on ====================================


def _denormal_grid(m: nn.Module) -> None:
    m.register_buffer("grid", torch.linspace(0, 1e-39, 4))
    m.register_buffer("tiny", torch.full((2,), 1e-39))
    m.p = nn.Parameter(torch.tensor([1e-39, 1.0]))


@pytest.mark.parametrize("include_buffers", MODES)
def test_factories_built_with_denormals_flushed(include_buffers: bool) -> None:
    """Denormal flushing changes what ``linspace`` / ``full`` / ``tensor`` store: a build made
    under ``set_flush_denormal(True)`` is refused once the setting is off again, and
    materializes exactly with it on."""
    assert torch.set_flush_denormal(True), "this CPU cannot flush denormals"
    try:
        ref = build_eagerly(lambda: Built(_denormal_grid))
        model = build_empty(lambda: Built(_denormal_grid), include_buffers)
    finally:
        torch.set_flush_denormal(False)
    assert ref.p[0].item() == 0.0  # eager flushed it
    meta = [name for name, tensor in tensors(model).items() if tensor.is_meta]
    assert_refused(model, *meta, because=r"set_flush_denormal\(True\)")
    assert torch.set_flush_denormal(True)
    try:
        materialize_exactly(model, ref)
    finally:
        torch.set_flush_denormal(False)
