"""materialize when Python and torch reuse what identifies a tensor.

metamode knows a tensor by its Python ``id``, the address of its implementation and its
storage; a tensor that dies frees the first two, and the next tensor made may take them,
whether it happens depends on the garbage collector and the allocator. The guarantee
holds whatever they do: a module built in ``metamode.empty_weights(replayable=True)`` is
given eager construction's values exactly, or refused upfront for what was done to it,
never for what another tensor, dead since, was. Each case forces the reuse it is about (a
freed tensor's id and implementation given to the tensor the case needs, and collections
run where the case says), so none depends on luck.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import metamode
from metamode._torch import DisableTorchFunction
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_exact_or_refused,
    assert_refused,
    build_eagerly,
    build_empty,
    materialize_exactly,
    warm_pickling,
)

warm_pickling()  # swap_tensors caches __slotnames__ the first time


class _Filler:
    """An object laid out as a tensor is (its size, a managed ``__dict__``, a weak reference
    slot): Python's allocator gives a tensor the memory one leaves, and the other way."""

    __slots__ = ("__dict__", "__weakref__", "a", "b", "c")


assert _Filler.__basicsize__ == torch.Tensor.__basicsize__ == nn.Parameter.__basicsize__


def _taking(last: list[torch.Tensor], make: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """Drop ``last``'s tensor (its last reference) and return a tensor ``make()`` makes
    with its Python id; None where something else (a recording holding a meta tensor)
    keeps it alive. Everything runs where no mode sees it. Objects of a tensor's size are
    made until one has the id, which is freed just before ``make()``: Python's allocator
    gives that memory to the next object of the size."""
    held: list[object] = []
    with DisableTorchFunction():
        victim = last.pop()
        gone = id(victim)
        alive = weakref.ref(victim)
        del victim
        if alive() is not None:
            assert alive().is_meta, "a real tensor outlived its last reference"
            return None
        while True:
            filler = _Filler()
            while id(filler) != gone:
                held.append(filler)
                filler = _Filler()
                assert len(held) < 100000, "the freed id went to another object"
            del filler
            tensor = make()
            if id(tensor) == gone:
                return tensor
            held.append(tensor)  # something else took the memory first: again


def _reborn(last: list[torch.Tensor], make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``last``'s tensor dropped, and a tensor ``make()`` makes at its Python id and its
    implementation address, as the allocators may give them (done with ``swap_tensors``,
    so that no allocator's state decides it): the old object takes a new tensor's
    implementation, the old implementation is freed, and tensors are made until one has
    its address, which the old object then takes."""
    with DisableTorchFunction():
        victim = last.pop()
        gone_impl = victim._cdata
        first = make()
        torch.utils.swap_tensors(victim, first)
        del first  # the old implementation goes with it
        held = []
        while True:
            assert len(held) < 10000, "no later tensor took the freed implementation"
            tensor = make()
            if tensor._cdata == gone_impl:
                break
            held.append(tensor)
        torch.utils.swap_tensors(victim, tensor)
    return victim


class _Collected:
    """The collector as a case needs it: off (objects in reference cycles stay until
    ``collect``), restored after."""

    def __enter__(self) -> _Collected:
        self.was = gc.isenabled()
        gc.collect()
        gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


@pytest.fixture
def collector() -> Iterator[_Collected]:
    with _Collected() as state:
        yield state


# -- a dead registered tensor's id and implementation, taken after the block --------------


class _Twins(nn.Module):
    """Two buffers over one storage (a 2x2 tensor and a flat ``.detach()`` of it), written
    in place after registration, beside a parameter drawn before them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        base = torch.empty(2, 2)
        self.register_buffer("a", base)
        self.register_buffer("b", base.detach().view(4))
        nn.init.normal_(self.a)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor over ``tensor``'s storage, flat, with a version counter of its own."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), 0, (tensor.numel(),), (1,)
    )


REREGISTER: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    ".data": lambda t: t.data,
    ".detach()": lambda t: t.detach(),
    "set_ (flat)": _flat,
}
_STALE = (
    "wrong reason: b's new tensor, at the dead a's id and implementation address over the "
    "same storage, is taken for a; refused as 'changed after its empty_weights block (now "
    "float32[4], built as float32[2, 2])', where b was built float32[4] and the same "
    "tensor at another address is exact"
)
_DATA = (
    "over-refusal: a .data alias has a version counter of its own, at 0, where the build's "
    "tensors of the storage reached 1 (after normal_); nothing says whether something wrote "
    "the memory through another counter, so a and b are refused, the reason naming both"
)
# (how, include_buffers, reuse) -> what happens instead of exact
REREGISTER_BROKEN = {
    (".data", False, False): _DATA,
    (".data", False, True): f"{_DATA}; and {_STALE}",
    **{(how, mode, True): _STALE for how in REREGISTER for mode in MODES if how != ".data"},
    (".data", True, True): _STALE,
}


def _reregistered(model: nn.Module, how: str, reuse: bool) -> None:
    """``register_buffer(n, f(old))`` for ``a`` then ``b``; with ``reuse``, ``b``'s new
    tensor takes the id and implementation of ``a``'s old one (over the same storage)."""
    make = REREGISTER[how]
    last = [model.a]
    model.register_buffer("a", make(model.a))
    gc.collect()
    new = _reborn(last, lambda: make(model.b)) if reuse else make(model.b)
    assert new is not None
    model.register_buffer("b", new)


def _reregister_cases() -> list:
    cases = []
    for how in REREGISTER:
        for mode in MODES:
            for reuse in (False, True):
                broken = REREGISTER_BROKEN.get((how, mode, reuse))
                marks = (
                    [pytest.mark.xfail(strict=True, raises=AssertionError, reason=broken)]
                    if broken
                    else []
                )
                name = f"{how}-{mode}-{'reused' if reuse else 'fresh'}"
                cases.append(pytest.param(how, mode, reuse, marks=marks, id=name))
    return cases


@pytest.mark.parametrize(("how", "include_buffers", "reuse"), _reregister_cases())
def test_buffers_reregistered_after_the_block_are_judged_by_themselves_not_a_dead_ones_id(
    how, include_buffers, reuse
):
    ref = build_eagerly(_Twins)
    _reregistered(ref, how, reuse=False)
    model = build_empty(_Twins, include_buffers)
    _reregistered(model, how, reuse)
    materialize_exactly(model, ref)


class _SharedParameters(nn.Module):
    """Two parameters over one tensor (``nn.Parameter(w)`` twice), initialised in place."""

    def __init__(self) -> None:
        super().__init__()
        weight = torch.empty(3, 3)
        self.a = nn.Parameter(weight)
        self.b = nn.Parameter(weight)
        nn.init.normal_(self.a)


def _rewrapped(model: nn.Module, reuse: bool) -> None:
    """``p = nn.Parameter(p.data)`` for each, as code that resets parameters does; with
    ``reuse``, ``b``'s new parameter takes ``a``'s old one's id and implementation."""
    data = model.b.data
    last = [model.a]
    model.a = nn.Parameter(model.a.data)
    gc.collect()
    new = _reborn(last, lambda: nn.Parameter(data)) if reuse else nn.Parameter(data)
    assert new is not None
    model.b = new


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reused"])
def test_parameters_rewrapped_after_the_block_are_exact_whatever_ids_they_take(
    include_buffers, reuse
):
    ref = build_eagerly(_SharedParameters)
    _rewrapped(ref, reuse=False)
    model = build_empty(_SharedParameters, include_buffers)
    _rewrapped(model, reuse)
    materialize_exactly(model, ref)


# -- a dead temporary's id, taken inside the build ------------------------------------


def _reuse_in_build(last: list[torch.Tensor]) -> None:
    """The build drops ``last``'s temporary and a tensor it reads next takes its id (a real
    one dies then; the recording holds a meta one, whose id nothing can take)."""
    later = _taking(last, lambda: torch.zeros(1))
    if later is not None:
        torch.neg(later)


def _parameter_of_temporary(m: nn.Module) -> None:
    """``nn.Parameter(t)`` of a temporary written twice (its version counter at 2)."""
    t = torch.empty(3).uniform_()
    t.mul_(2.0)
    m._parameters["p"] = nn.Parameter(t)  # no registration hook
    last = [t]
    del t
    _reuse_in_build(last)


def _buffer_of_detached_temporary(m: nn.Module) -> None:
    t = torch.empty(3).uniform_()
    t.add_(1.0)
    m._buffers["b"] = t.detach()
    last = [t]
    del t
    _reuse_in_build(last)


def _attribute_of_temporary(m: nn.Module) -> None:
    """A plain attribute over a temporary's ``.detach()``, as a cache a module keeps."""
    t = torch.randn(3)
    t.clamp_(-1.0, 1.0)
    m.cache = [t.detach()]
    last = [t]
    del t
    _reuse_in_build(last)


def _registered_temporary(m: nn.Module) -> None:
    t = torch.randn(3)
    t.abs_()
    m.register_buffer("b", t.detach())
    last = [t]
    del t
    _reuse_in_build(last)


def _temporary_filled_through_data(m: nn.Module) -> None:
    """A temporary filled through ``.data`` (its own counter), wrapped, then dropped."""
    t = torch.empty(3)
    t.data.normal_()
    t.add_(0.5)
    m.p = nn.Parameter(t)
    last = [t]
    del t
    _reuse_in_build(last)


def _temporary_set_elsewhere(m: nn.Module) -> None:
    """A buffer given another tensor's memory with ``set_`` while the tensor it had dies."""
    old = torch.randn(4)
    new = torch.randn(4)
    new.mul_(3.0)
    m._buffers["b"] = old
    old.set_(new)
    last = [new]
    del new
    _reuse_in_build(last)


TEMPORARIES: dict[str, Callable[[nn.Module], None]] = {
    "nn.Parameter(temporary) in _parameters": _parameter_of_temporary,
    "_buffers[k] = temporary.detach()": _buffer_of_detached_temporary,
    "attribute list of temporary.detach()": _attribute_of_temporary,
    "register_buffer(temporary.detach())": _registered_temporary,
    "temporary filled through .data": _temporary_filled_through_data,
    "set_ to a temporary": _temporary_set_elsewhere,
}


class _Temporary(nn.Module):
    """A parameter drawn on meta, then ``init`` over real temporaries (a skipped stretch
    with ``skip``), then a parameter drawn after."""

    def __init__(self, init: Callable[[nn.Module], None], skip: bool) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        if skip:
            with metamode.skip_empty_weights():
                init(self)
        else:
            init(self)
        self.last = nn.Linear(3, 2)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("skip", [False, True], ids=["", "skipped"])
@pytest.mark.parametrize("idiom", sorted(TEMPORARIES))
def test_a_temporary_whose_id_a_later_tensor_takes_in_the_build_is_exact(
    idiom, skip, include_buffers
):
    init = TEMPORARIES[idiom]
    ref = build_eagerly(lambda: _Temporary(init, skip=False))
    model = build_empty(lambda: _Temporary(init, skip), include_buffers)
    materialize_exactly(model, ref)


# -- copies made after the block -----------------------------------------------------


class _Noisy(nn.Module):
    """A parameter drawn first, then a submodule with a buffer drawn from the stream the
    meta draws shifted (real without ``include_buffers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.noise = nn.Module()
        self.noise.register_buffer("value", torch.randn(4))


COPIES: dict[str, Callable[[nn.Module], object]] = {
    "deepcopy of a submodule": lambda m: setattr(m, "noise", copy.deepcopy(m.noise)),
    "buffer.clone()": lambda m: setattr(m.noise, "value", m.noise.value.clone()),
    "submodule.double()": lambda m: m.noise.double(),
    "buffer.detach()": lambda m: setattr(m.noise, "value", m.noise.value.detach()),
    "buffer.data": lambda m: setattr(m.noise, "value", m.noise.value.data),
}
_KEEPS_THE_SHIFTED_DRAW = (
    "silently wrong: the real buffer, drawn from the shifted stream, is copied into new "
    "memory no recording knows; materialize keeps it (is_materializable says yes) where "
    "eager's copy holds eager's draw"
)
COPY_BROKEN = {
    "deepcopy of a submodule": _KEEPS_THE_SHIFTED_DRAW,
    "buffer.clone()": _KEEPS_THE_SHIFTED_DRAW,
    "submodule.double()": _KEEPS_THE_SHIFTED_DRAW,
}


def _copy_cases() -> list:
    cases = []
    for name in COPIES:
        for mode in MODES:
            broken = COPY_BROKEN.get(name) if not mode else None
            marks = (
                [pytest.mark.xfail(strict=True, raises=AssertionError, reason=broken)]
                if broken
                else []
            )
            cases.append(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}"))
    return cases


@pytest.mark.parametrize(("copied", "include_buffers"), _copy_cases())
def test_a_buffer_copied_after_the_block_is_exact_or_refused(copied, include_buffers):
    ref = build_eagerly(_Noisy)
    COPIES[copied](ref)
    model = build_empty(_Noisy, include_buffers)
    COPIES[copied](model)
    assert_exact_or_refused(model.noise, ref.noise, "value")


# -- builds one after another, and the collector between them --------------------------


class _Cyclic(nn.Module):
    """A module in a reference cycle (it holds itself), with a buffer over a temporary:
    only a collection frees it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("noise", torch.randn(3).detach())
        self.me = [self]


WHEN = ["never", "before the second build", "inside the second build", "before materialize"]


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("keep_first", [False, True], ids=["first dropped", "first kept"])
def test_a_build_after_another_is_exact_wherever_the_first_is_collected(
    collector, keep_first, when, include_buffers
):
    ref = build_eagerly(_Cyclic, seed=1)
    first_ref = build_eagerly(_Cyclic, seed=0)
    first = build_empty(_Cyclic, include_buffers, seed=0)
    kept = first if keep_first else None
    del first
    if when == "before the second build":
        gc.collect()
    torch.manual_seed(1)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        if when == "inside the second build":
            gc.collect()
        model = _Cyclic()
    if when == "before materialize":
        gc.collect()
    materialize_exactly(model, ref)
    if kept is not None:
        materialize_exactly(kept, first_ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_build_repeated_in_one_process_is_exact_each_time(collector, include_buffers):
    ref = build_eagerly(_Twins)
    for _ in range(3):
        model = build_empty(_Twins, include_buffers)
        gc.collect()
        materialize_exactly(model, ref)
        del model


# -- a submodule materialized alone, then another sharing its memory -------------------


class _Halves(nn.Module):
    """Two submodules whose buffers share one storage (a tensor and its ``.detach()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        base = torch.randn(3)
        self.x = nn.Module()
        self.x.register_buffer("v", base)
        self.y = nn.Module()
        self.y.register_buffer("v", base.detach())


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("first", ["kept", "dropped in a cycle", "dropped and collected"])
def test_a_submodule_sharing_memory_with_one_materialized_before_is_exact_or_refused(
    collector, first, include_buffers
):
    ref = build_eagerly(_Halves)
    model = build_empty(_Halves, include_buffers)
    metamode.materialize(model.x)
    if first != "kept":
        dropped = model.x
        dropped.me = [dropped]  # only a collection frees it
        model.x = nn.Module()
        ref.x = nn.Module()
        del dropped
        if first == "dropped and collected":
            gc.collect()
    if first == "dropped and collected":
        assert_refused(model.y, "v", because="freed")
    else:
        materialize_exactly(model.y, ref.y)
    if first == "kept":
        assert model.x.v.untyped_storage().data_ptr() == model.y.v.untyped_storage().data_ptr()


# -- weak references the user holds ---------------------------------------------------


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("collected", [False, True], ids=["weakref alive", "weakref collected"])
def test_a_parameter_someone_holds_weakly_is_exact_whether_or_not_the_holder_is_collected(
    collector, collected, include_buffers
):
    ref = build_eagerly(lambda: nn.Linear(3, 3))
    model = build_empty(lambda: nn.Linear(3, 3), include_buffers)
    holder = [weakref.ref(model.weight)]
    holder.append(holder)  # a cycle: the weak reference goes at a collection only
    del holder
    if collected:
        gc.collect()
    materialize_exactly(model, ref, replaced=() if collected else ("weight",))


# -- parametrizations ---------------------------------------------------------------


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _parametrized(reuse: bool) -> nn.Module:
    """A layer whose weight, ``nn.Parameter`` of a temporary, is parametrized inside the
    build; with ``reuse``, the temporary's id goes to a later tensor the build reads."""
    layer = nn.Linear(3, 3)
    weight = torch.randn(3, 3)
    layer.weight = nn.Parameter(weight)
    last = [weight]
    del weight
    if reuse:
        _reuse_in_build(last)
    parametrize.register_parametrization(layer, "weight", _Symmetric())
    gc.collect()
    layer.register_buffer("after", torch.randn(3))
    return layer


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("reuse", [False, True], ids=["", "id reused"])
def test_a_parametrized_weight_is_exact_whatever_ids_python_reuses(
    collector, reuse, include_buffers
):
    ref = build_eagerly(lambda: _parametrized(reuse=False))
    model = build_empty(lambda: _parametrized(reuse), include_buffers)
    materialize_exactly(model, ref)
