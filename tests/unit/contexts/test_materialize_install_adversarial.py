"""How ``materialize`` installs values, attacked with real-world idioms.

The rules: gradient hooks survive ``torch.utils.swap_tensors``; a parameter torch cannot swap
(a weak reference, a view or an autograd graph holds it) gets a new Parameter in every module
holding it, with its hooks and one ``UserWarning``; a parameter also registered as a buffer is
a parameter slot; a call whose dtype came from the process default is refused under another
default unless it names the dtype; metamode's own calls inside an open replayable build are not
recorded in it. Each idiom is compared with eager construction under the same seed: values,
dtype, ``requires_grad``, gradients after a backward, and how often each hook fires.
"""

from __future__ import annotations

import copyreg
import re
import warnings
import weakref

import pytest
import torch
import torch.utils.weak
from torch import nn
from torch.overrides import TorchFunctionMode

import metamode
import metamode._contexts.materialize as installing
from metamode._contexts.materialize import unreproducible
from tests.unit.contexts.materialize_checks import (
    MODES,
    Unchanged,
    assert_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    default_dtype,
    materialize_exactly,
    named,
)
from tests.unit.contexts.test_materialize_post_build_adversarial import _lin3, _net

RE = metamode.empty_weights
for _kind in (torch.Tensor, nn.Parameter, nn.Linear, nn.Sequential, nn.Embedding, nn.LSTM):
    copyreg._slotnames(_kind)  # type: ignore[attr-defined]  # before the guard's snapshot


def _tied() -> nn.Sequential:
    """An embedding and a head sharing one weight (``tie_word_embeddings``)."""
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4), nn.Linear(4, 5, bias=False))
    model[2].weight = model[0].weight
    return model


def _both(build=_lin3, include_buffers=False, change=None):
    """``build`` eagerly and empty under seed 0 (``change`` applied to each): (empty, eager)."""
    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    for m in (ref, model) if change is not None else ():
        change(m)
    return model, ref


def _step(*models: nn.Module) -> None:
    """One forward and backward of each model on the same input."""
    for model in models:
        ids = isinstance(model, nn.Sequential) and isinstance(model[0], nn.Embedding)
        x = torch.tensor([[1, 2]]) if ids else torch.ones(2, 4)
        model(x).sum().backward()


def _grads_equal(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), f"{name}: grad differs from eager"


def _counter(log: list, tag: str):
    return lambda *_: log.append(tag)


def _hooks(p: torch.Tensor, log: list) -> tuple:
    """A tensor hook and a post-accumulate hook on ``p``, logging "pre" and "post"."""
    return (
        p.register_hook(_counter(log, "pre")),
        p.register_post_accumulate_grad_hook(_counter(log, "post")),
    )


def _on_both(model, ref, register) -> list[list[str]]:
    """``register(m, log)`` on the empty-built model and on eager's: their two logs."""
    logs: list[list[str]] = [[], []]
    for m, log in zip((model, ref), logs, strict=True):
        register(m, log)
    return logs


def _defect(reason: str):
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)


_SWAP_WARNING = "swap_tensors cannot give it its values in place"


def _replacement_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if _SWAP_WARNING in str(w.message)]


def _held_names(message: str) -> set[str]:
    held = re.search(r"holds (.*?), so torch", message)
    assert held is not None, message
    return set(re.findall(r"'([^']+)'", held.group(1)))


def _materialize_replacing(model, ref, *names, warned=None) -> None:
    """``materialize_exactly`` with the parameters ``names`` replaced, and exactly one warning
    naming ``warned`` (by default ``names``; a parameter goes by every name it has: ties,
    containers), none when ``names`` is empty."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        materialize_exactly(model, ref, replaced=names)
    found = _replacement_warnings(caught)
    assert len(found) == (1 if names else 0), found
    assert not names or _held_names(found[0]) == set(warned or names), found


# -- gradient hooks, swap path ------------------------------------------------------------


class _Tagged(nn.Parameter):
    """A Parameter subclass (as quantization and sharding libraries define)."""


class _HoldsTagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _Tagged(torch.randn(4, 4))
        self.w.role = "scale"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class _GradBuffer(nn.Module):
    """A buffer that requires grad (a learned scale kept out of the state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4, requires_grad=True), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _returning(p, log, tag, change):
    p.register_hook(lambda g: (log.append(tag), change(g))[1])


def _accumulator_hook(m, log):
    accumulator = m[0].weight.expand_as(m[0].weight).grad_fn.next_functions[0][0]
    accumulator.register_hook(_counter(log, "accumulated"))
    m.accumulator = accumulator  # held, as DeepSpeed's self.grad_accs holds them


def _multi(mode):
    return lambda m, log: torch.autograd.graph.register_multi_grad_hook(
        (m[0].weight, m[1].bias), _counter(log, mode), mode=mode
    )


def _module_hooks(m, log):
    for kind in ("forward_pre", "forward", "full_backward"):
        getattr(m[1], f"register_{kind}_hook")(_counter(log, kind))


def _returning_two(m, log):
    _returning(m[0].weight, log, "x2", lambda g: g * 2)
    _returning(m[0].weight, log, "+1", lambda g: g + 1)


def _each(*modules):
    for module in modules:
        metamode.materialize(module)


def _optimizer_in_backward(m, log):
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in m.parameters()}

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)
        log.append("step")

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(step)


def _frozen(m, log):
    _hooks(m[0].weight, log)
    m.requires_grad_(False)


# fmt: off
# idiom -> (build, register hooks on a model, done to the empty one before materialize,
# done to both after it)
HOOK_IDIOMS = {
    "two tensor hooks returning new gradients, in order": (_lin3, _returning_two, None, None),
    "tensor and post-accumulate hooks on every parameter": (
        _net, lambda m, log: [_hooks(p, log) for p in m.parameters()], None, None
    ),
    "a hook on a tied weight, the head materialized first": (
        _tied, lambda m, log: _hooks(m[2].weight, log), lambda m: metamode.materialize(m[2]), None
    ),
    "hooks on a submodule materialized alone, twice": (
        _lin3, lambda m, log: _hooks(m[1].bias, log), lambda m: _each(m[1], m[1]), None
    ),
    "a hook on a Parameter subclass": (
        _HoldsTagged, lambda m, log: _returning(m.w, log, "x3", lambda g: g * 3), None, None
    ),
    "hooks on a parameter frozen while loading, unfrozen after": (
        _lin3, _frozen, None, lambda m: m.requires_grad_(True)
    ),
    "module forward and backward hooks": (_lin3, _module_hooks, None, None),
    "an optimizer stepping in post-accumulate hooks": (_net, _optimizer_in_backward, None, None),
    "register_multi_grad_hook(mode='any')": (_lin3, _multi("any"), None, None),
    "register_multi_grad_hook(mode='all')": (_lin3, _multi("all"), None, None),
    "a hook on the parameter's grad accumulator": (_lin3, _accumulator_hook, None, None),
    "a hook on a buffer that requires grad": (
        _GradBuffer, lambda m, log: m.scale.register_hook(_counter(log, "pre")), None, None
    ),
}
# fmt: on
# torch cannot move what is registered on a node: materialize warns (the test below)
HOOKS_LOST = {
    "register_multi_grad_hook(mode='all')": "it counts the AccumulateGrad nodes it captured; "
    "after swap_tensors the engine runs new ones, so it never fires",
    "a hook on the parameter's grad accumulator": "DeepSpeed's idiom: the hook stays on the meta "
    "implementation's AccumulateGrad node after swap_tensors, so it never fires",
}


@pytest.mark.parametrize(
    "idiom",
    [
        pytest.param(name, marks=[_defect(HOOKS_LOST[name])] if name in HOOKS_LOST else [])
        for name in sorted(HOOK_IDIOMS)
    ],
)
def test_gradient_hooks_fire_as_often_as_eager_after_materialize(idiom):
    build, register, before, after = HOOK_IDIOMS[idiom]
    model, ref = _both(build, include_buffers=True)
    logs = _on_both(model, ref, register)
    if before is not None:
        before(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # for the node hooks: the test below
        materialize_exactly(model, ref)
    for m in (model, ref) if after is not None else ():
        after(m)
    _step(model, ref)
    _step(model, ref)
    assert logs[1], "no hook fired in eager"
    assert logs[0] == logs[1]
    _grads_equal(model, ref)
    assert_same_tensors(model, ref)  # and an optimizer's steps


@pytest.mark.parametrize("idiom", sorted(HOOKS_LOST))
def test_a_hook_on_a_live_grad_accumulator_is_named_in_a_warning(idiom):
    build, register, _, _ = HOOK_IDIOMS[idiom]
    model, ref = _both(build, include_buffers=True)
    _on_both(model, ref, register)
    with pytest.warns(UserWarning, match=r"AccumulateGrad node\) of '0\.weight'"):
        materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("removed", ["before materialize", "after materialize"])
def test_hooks_removed_by_their_handle_are_really_removed(removed, include_buffers):
    model, ref = _both(include_buffers=include_buffers)
    log: list[str] = []
    handles = [*_hooks(model[1].weight, log), *_hooks(ref[1].weight, log)]
    if removed == "before materialize":
        for handle in handles:
            handle.remove()
    materialize_exactly(model, ref)
    for handle in handles:
        handle.remove()
    _step(model, ref)
    assert log == []


@pytest.mark.parametrize("weakly_held", [False, True])
def test_an_lstm_keeps_its_flat_weights_and_hooks(weakly_held):
    model = build_empty(lambda: nn.LSTM(3, 4, num_layers=2))
    ref = build_eagerly(lambda: nn.LSTM(3, 4, num_layers=2))
    logs = _on_both(model, ref, lambda m, log: _hooks(m.weight_hh_l1, log))
    held = weakref.ref(model.weight_ih_l0) if weakly_held else None  # noqa: F841
    _materialize_replacing(
        model,
        ref,
        *(["weight_ih_l0"] if weakly_held else []),
        warned=["weight_ih_l0", "_flat_weights[0]"],
    )
    outputs = [m(torch.ones(2, 1, 3))[0] for m in (model, ref)]
    for output in outputs:
        output.sum().backward()
    assert torch.equal(outputs[0], outputs[1])
    assert logs[0] == logs[1] == ["pre", "post"]
    assert model._flat_weights[0] is model.weight_ih_l0
    _grads_equal(model, ref)


# -- hooks when materialize refuses, or fails and undoes ----------------------------------


def _meta_step(model: nn.Module) -> None:
    model(torch.ones(2, 4, device="meta")).sum().backward()
    model.zero_grad(set_to_none=True)


def test_hooks_fire_once_on_meta_after_a_refusal_and_once_after_materialize():
    model = build_empty(_lin3)
    log: list[str] = []
    _hooks(model[0].weight, log)
    nn.init.zeros_(model[2].bias)  # written after the block: refused
    assert_refused(model, "2.bias")
    _meta_step(model)
    assert log == ["pre", "post"]
    metamode.materialize(model, on_unreproducible="empty")
    _step(model)
    assert log == ["pre", "post"] * 2


class _Boom(Exception):
    pass


def _fail_at_third_put(monkeypatch) -> None:
    put, calls = installing._Installer._put, []

    def failing(self, slot, value):
        calls.append(slot)
        if len(calls) == 3:
            raise _Boom
        return put(self, slot, value)

    monkeypatch.setattr(installing._Installer, "_put", failing)


def test_hooks_survive_a_failed_materialize_undone_after_a_swap_and_a_replacement(monkeypatch):
    model, ref = _both()
    log: list[str] = []
    _hooks(model[0].weight, log)
    model[1].weight.register_hook(_counter(log, "replaced"))
    held = weakref.ref(model[1].weight)  # noqa: F841 (replaced, not swapped)
    _fail_at_third_put(monkeypatch)
    before = Unchanged(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(_Boom):
            metamode.materialize(model)
    assert _replacement_warnings(caught) == []  # nothing stayed replaced
    before.check()
    _meta_step(model)
    assert sorted(log) == ["post", "pre", "replaced"]
    monkeypatch.undo()
    _materialize_replacing(model, ref, "1.weight")
    _step(model, ref)
    assert sorted(log) == ["post", "post", "pre", "pre", "replaced", "replaced"]
    _grads_equal(model, ref)


# -- parameters torch cannot swap ---------------------------------------------------------


_WeakIdKeys = torch.utils.weak.WeakIdKeyDictionary


def _cache(kind, m):
    cache = kind()
    if kind is weakref.WeakValueDictionary:
        cache["w"] = m[1].weight
    else:
        cache[m[1].weight] = "fp8 scale"
    return cache


# what holds the old parameter while materialize runs -> the names that must be replaced
HOLDERS = {
    "WeakKeyDictionary": (lambda m: _cache(weakref.WeakKeyDictionary, m), ("1.weight",)),
    "WeakValueDictionary": (lambda m: _cache(weakref.WeakValueDictionary, m), ("1.weight",)),
    "WeakIdKeyDictionary": (lambda m: _cache(_WeakIdKeys, m), ("1.weight",)),
    "a view in a plain list": (lambda m: [m[1].weight[0]], ("1.weight",)),
    "the graph of a meta forward": (  # saves 1.weight and 2.weight for backward
        lambda m: m(torch.ones(2, 4, device="meta")),
        ("1.weight", "2.weight"),
    ),
}


@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_a_parameter_torch_cannot_swap_is_replaced_with_its_hooks_and_one_warning(holder):
    hold, names = HOLDERS[holder]
    model, ref = _both()
    handles = []
    logs = _on_both(model, ref, lambda m, log: handles.extend(_hooks(m[1].weight, log)))
    kept = hold(model)  # noqa: F841 (held while materialize runs)
    _materialize_replacing(model, ref, *names)
    _step(model, ref)
    assert logs[0] == logs[1] == ["pre", "post"]
    _grads_equal(model, ref)
    for handle in handles:  # the handles still remove the hooks the new parameter carries
        handle.remove()
    _step(model, ref)
    assert logs[0] == logs[1] == ["pre", "post"]


def test_the_warning_names_every_replaced_parameter_and_points_at_the_caller():
    model, ref = _both()
    kept = [weakref.ref(model[0].bias), model[2].weight.T]  # noqa: F841
    with pytest.warns(UserWarning, match=_SWAP_WARNING) as caught:
        metamode.materialize(model)
    found = [w for w in caught if _SWAP_WARNING in str(w.message)]
    assert len(found) == 1 and found[0].filename == __file__
    assert _held_names(str(found[0].message)) == {"0.bias", "2.weight"}
    assert_same_tensors(model, ref)


@pytest.mark.parametrize("build", [_lin3, _net, _tied], ids=["linears", "batchnorm", "tied"])
@pytest.mark.parametrize("include_buffers", MODES)
def test_nothing_replaced_no_warning(build, include_buffers):
    model, ref = _both(build, include_buffers)
    optimizer = torch.optim.AdamW(model.parameters())  # holds them strongly: swapped
    _materialize_replacing(model, ref)
    assert optimizer.param_groups[0]["params"][0] is model[0].weight


@pytest.mark.parametrize("one_by_one", [False, True])
def test_a_weakly_held_tied_parameter_stays_one_object(one_by_one):
    model, ref = _both(_tied)
    logs = _on_both(model, ref, lambda m, log: m[0].weight.register_hook(_counter(log, "tied")))
    held = weakref.ref(model[2].weight)  # noqa: F841 (a weakly keyed cache, say)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for sub in (model[0], model[2]) if one_by_one else ():
            metamode.materialize(sub)
    names = [] if one_by_one else ["0.weight", "2.weight"]
    _materialize_replacing(model, ref, *names, warned=["0.weight", "2.weight"])
    _step(model, ref)
    assert logs[0] == logs[1] == ["tied"]
    _grads_equal(model, ref)


def _also_a_buffer(m):
    m[0].register_buffer("w2", m[2].weight)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("order", ["whole, weakly held", "buffer's module first"])
def test_a_parameter_also_a_buffer_elsewhere_stays_one_object(order, include_buffers):
    model, ref = _both(_lin3, include_buffers, _also_a_buffer)
    weight = model[2].weight
    if order == "whole, weakly held":
        held = weakref.ref(weight)  # noqa: F841
        _materialize_replacing(model, ref, "2.weight", warned=["0.w2", "2.weight"])
    else:
        metamode.materialize(model[0])
        _materialize_replacing(model, ref)  # no warning, the parameter swapped
        assert model[2].weight is weight
    assert model[0]._buffers["w2"] is model[2]._parameters["weight"]
    assert isinstance(model[0].w2, nn.Parameter)


def test_a_weakly_held_parameter_refused_warns_nothing_and_empty_replaces_it_naming_it():
    model, ref = _both()
    nn.init.ones_(model[0].bias)
    held = weakref.ref(model[0].bias)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_refused(model, "0.bias")  # nothing changed
    assert _replacement_warnings(caught) == []
    with pytest.warns(UserWarning, match=r"holds '0\.bias'"):
        metamode.materialize(model, on_unreproducible="empty")
    assert not model[0].bias.is_meta and model[0].bias is not held()
    assert_same_tensors(model, ref, names=["0.weight", "1.weight", "2.weight", "2.bias"])


class _HoldsItsWeights(nn.Module):
    def __init__(self, container=list) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.weights = container([self.lin.weight, self.lin.bias])  # registered, and held


_TUPLE = _defect(
    "conservative: a meta parameter also held in a tuple attribute is refused, though "
    "swap_tensors keeps the tuple right whenever torch lets it swap the parameter in place"
)


@pytest.mark.parametrize(
    ("container", "weakly_held"), [(list, True), pytest.param(tuple, False, marks=_TUPLE)]
)
def test_a_registered_parameter_also_held_in_a_container_attribute_stays_one_object(
    container, weakly_held
):
    model, ref = _both(lambda: _HoldsItsWeights(container))
    held = weakref.ref(model.lin.weight) if weakly_held else None  # noqa: F841
    _materialize_replacing(
        model, ref, *(["lin.weight"] if weakly_held else []), warned=["lin.weight", "weights[0]"]
    )
    assert model.weights[0] is model.lin.weight and model.weights[1] is model.lin.bias


# -- default-dtype uses -------------------------------------------------------------------


def _ints() -> torch.Tensor:
    return torch.arange(6)


# the result's dtype is the process default's: refused under another default
DEFAULT_TAKEN = {
    "torch.where(mask, ints, 0.5)": lambda: torch.where(_ints() > 2, _ints(), 0.5),
    "torch.where(mask, 1.5, 0.5)": lambda: torch.where(_ints() > 2, 1.5, 0.5),
    "torch.div(rounding_mode=None)": lambda: torch.div(_ints(), 4, rounding_mode=None),
    "torch.true_divide": lambda: torch.true_divide(_ints(), 4),
    "1j * arange": lambda: 1j * _ints(),
    "ints.sqrt()": lambda: _ints().sqrt(),
    "10000 ** (ints / 6)": lambda: 10000.0 ** (_ints() / 6),
    "torch.fft.fft(ints)": lambda: torch.fft.fft(_ints()),
    "bools + 0.5": lambda: (_ints() > 2) + 0.5,
    "torch.full(int) / 3": lambda: torch.full((3,), 2) / 3,
    "(ints * 0.5).float()": lambda: (_ints() * 0.5).float(),
    "torch.normal(0., 1., size)": lambda: torch.normal(0.0, 1.0, size=(4,)),
    # an init helper passing its own dtype=None argument on
    "torch.normal(0., 1., size, dtype=None)": lambda: torch.normal(0.0, 1.0, (4,), dtype=None),
}

# the call names the dtype: exact under any default
DTYPE_NAMED = {
    "ints.to(get_default_dtype())": lambda: _ints().to(torch.get_default_dtype()),
    "ints.to(ints.device, float32)": lambda: (lambda t: t.to(t.device, torch.float32))(_ints()),
    "ints.to(dtype=torch.float)": lambda: _ints().to(dtype=torch.float),
    "int32.view(float32)": lambda: _ints().to(torch.int32).view(torch.float32),
    "ints.mean(dtype=float32)": lambda: _ints().mean(dtype=torch.float32).reshape(1),
    "cumsum(ints, dtype=float32) / 3": lambda: torch.cumsum(_ints(), 0, dtype=torch.float32) / 3,
    "ones_like(ints, dtype=float32)": lambda: torch.ones_like(_ints(), dtype=torch.float32),
    "ints.double() / 3": lambda: _ints().double() / 3,
    "ints.half() / 3": lambda: _ints().half() / 3,
    "ints.cfloat() * 1j": lambda: _ints().cfloat() * 1j,
    "randint(...).float() / 5": lambda: torch.randint(0, 5, (3,)).float() / 5,
    "torch.linspace(0, 1, 5)": lambda: torch.linspace(0, 1, 5),
}


class _Holds(nn.Module):
    """A frozen parameter (meta in both modes) and a buffer made by ``make``."""

    def __init__(self, make) -> None:
        super().__init__()
        self.p = nn.Parameter(make(), requires_grad=False)
        self.register_buffer("b", make())


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("call", sorted(DEFAULT_TAKEN))
def test_a_dtype_the_default_decided_is_refused_under_another_default(call, include_buffers):
    model = build_empty(lambda: _Holds(DEFAULT_TAKEN[call]), include_buffers)
    with default_dtype(torch.float64):
        assert_refused(model, "p", because="default dtype torch.float32")
    materialize_exactly(model, build_eagerly(lambda: _Holds(DEFAULT_TAKEN[call])))


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("call", sorted(DTYPE_NAMED))
def test_a_call_naming_its_dtype_is_exact_under_another_default(call, include_buffers):
    ref = build_eagerly(lambda: _Holds(DTYPE_NAMED[call]))
    model = build_empty(lambda: _Holds(DTYPE_NAMED[call]), include_buffers)
    with default_dtype(torch.float64):
        materialize_exactly(model, ref)


def test_type_to_a_named_float_tensor_type_is_exact_under_another_default():
    ref = build_eagerly(lambda: _Holds(lambda: _ints().type("torch.FloatTensor") / 3))
    model = build_empty(lambda: _Holds(lambda: _ints().type("torch.FloatTensor") / 3))
    with default_dtype(torch.float64):
        materialize_exactly(model, ref)


# -- metamode's own calls inside another open replayable build -----------------------------


class _Quiet(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _inside(*contexts):
    def call(first):
        for context in contexts:
            with context():
                metamode.materialize(first[2])
        metamode.materialize(first)

    return call


CALLS_INSIDE = {
    "materialize": metamode.materialize,
    "materialize a submodule in a nested build, then all": _inside(
        lambda: RE(include_buffers=True, replayable=True)
    ),
    "materialize under a user mode entered in the build": _inside(_Quiet),
    "materialize under torch.device('meta')": _inside(lambda: torch.device("meta")),
    "materialize inside skip_empty_weights": _inside(metamode.skip_empty_weights),
    "is_materializable(a tensor)": lambda first: metamode.is_materializable(first[2].weight),
    "unreproducible": unreproducible,
    "str(summary)": lambda first: str(metamode.summary(first)),
    "doctor": lambda first: metamode.doctor(),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("call", sorted(CALLS_INSIDE))
def test_metamode_calls_inside_another_open_build_leave_both_builds_exact(call, include_buffers):
    torch.manual_seed(0)
    ref_first, ref_second, ref_after = _net(), _net(), nn.Linear(4, 4)
    torch.manual_seed(0)
    with RE(include_buffers=include_buffers, replayable=True):
        first = _net()
    with RE(include_buffers=include_buffers, replayable=True):
        second = _net()
        CALLS_INSIDE[call](first)
        after = nn.Linear(4, 4)  # draws after the call continue eager's stream
    materialize_exactly(first, ref_first)
    materialize_exactly(second, ref_second)
    materialize_exactly(after, ref_after)


@pytest.mark.parametrize("include_buffers", MODES)
def test_metamode_calls_on_a_model_of_the_same_open_block_refuse_it_and_change_nothing(
    include_buffers,
):
    torch.manual_seed(0)
    ref_first, ref_second = _net(), _net()
    torch.manual_seed(0)
    with RE(include_buffers=include_buffers, replayable=True):
        first = _net()
        objects = [id(t) for t in first.state_dict(keep_vars=True).values()]  # reads no tensor
        assert not metamode.is_materializable(first)
        assert not metamode.is_materializable(first[0].weight)
        report = metamode.summary(first)
        with pytest.raises(metamode.NotMaterializableError) as refusal:
            metamode.materialize(first)
        assert [id(t) for t in first.state_dict(keep_vars=True).values()] == objects
        second = _net()
    assert all(t.is_meta for t in first.parameters())
    assert report.meta and not report.materializable
    assert named(str(refusal.value), "0.weight") and "still open" in str(refusal.value)
    materialize_exactly(first, ref_first)
    materialize_exactly(second, ref_second)
