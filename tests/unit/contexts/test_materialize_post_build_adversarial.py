"""What users do to an empty-built model between its ``with`` block and ``materialize``.

Each idiom is run on an eager build and on a replayable build under one seed, then the
replayable one is materialized: the values must be eager's, bitwise (ties, strides,
``requires_grad`` and the default generator included), or ``is_materializable`` says no
and ``materialize`` refuses before changing anything. ``test_materialize_after_the_block.py``
covers ``model.apply`` writes, ``load_state_dict``, dtype casts, ``channels_last`` and
``deepcopy``; this file covers the rest: reparametrisations, pruning, re-registration,
pickling, submodule orders, chained builds, generator games, the caller's context and
threads.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import gc
import io
import pickle
import threading
import weakref

import pytest
import torch
import torch.nn.utils.parametrize as P
import torch.nn.utils.prune
from torch import nn

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    default_dtype,
    materialize_exactly,
    named,
    tensors,
)

_WAIT_S = 60.0  # guards against a hang; never used for ordering
RE = metamode.empty_weights

for _kind in (torch.Tensor, nn.Parameter, nn.Linear, nn.Sequential, nn.BatchNorm1d):
    copyreg._slotnames(_kind)  # type: ignore[attr-defined]  # before the guard's snapshot


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))


def _lin3() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))


def _deep() -> nn.Sequential:
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.Embedding(5, 4), nn.Linear(4, 5))
    model[3].weight = model[2].weight  # a tied head
    return model


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).T


class _Halved(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x / 2


class _Parametrized(nn.Module):
    """A parametrization registered inside the build."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        P.register_parametrization(self.fc, "weight", _Symmetric())


class _Rope(nn.Module):
    """transformers' rotary ``inv_freq``: an integer ``arange`` made float32 by ``.float()``."""

    def __init__(self, dim: int = 8, base: float = 10000.0) -> None:
        super().__init__()
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        self.register_buffer("inv_freq", 1.0 / (base**exponent), persistent=False)
        self.proj = nn.Linear(dim, dim)


def _both(change, build=_net, include_buffers=False):
    """``build`` eagerly and empty under seed 0, ``change`` applied to each."""
    ref = build_eagerly(build)
    change(ref)
    model = build_empty(build, include_buffers)
    change(model)
    return model, ref


# -- changes that write no value: exact -----------------------------------------------


def _freeze_biases(m):  # PEFT-style: freeze by name
    for name, p in m.named_parameters():
        p.requires_grad = not name.endswith("bias")


def _reregister(m):
    w = m[0].weight
    del m[0].weight
    m[0].register_parameter("weight", w)


def _pop(module, name):
    tensor = module._parameters.pop(name)
    setattr(module, name, None)
    return tensor


def _param_to_buffer(how):
    return lambda m: m[1].register_buffer("weight", how(m[1]._parameters.pop("weight")))


def _second_parameter_object(m):
    m.extra = nn.Module()
    m.extra.weight = nn.Parameter(m[0].weight)  # a second object over the same memory


def _reassign_biases(m):
    m[0].bias, m[1].bias = m[1].bias, m[0].bias


def _unparametrize(m):
    P.remove_parametrizations(m.fc, "weight", leave_parametrized=False)


# fmt: off
NO_VALUE_WRITTEN = {  # idiom -> (change, build)
    "requires_grad=False by name": (_freeze_biases, _net),
    "zero_grad()": (lambda m: m.zero_grad(), _net),
    "del weight then register the same object": (_reregister, _net),
    "register_parameter(alias, bias)": (lambda m: m[0].register_parameter("a", m[0].bias), _net),
    "register_module(alias, layer)": (lambda m: m.register_module("alias", m[0]), _net),
    "_parameters.pop(bias)": (lambda m: _pop(m[2], "bias"), _net),
    "a parameter moved to another module":
        (lambda m: m[0].register_parameter("moved", _pop(m[2], "bias")), _net),
    "p.data = p.data": (lambda m: setattr(m[0].weight, "data", m[0].weight.data), _net),
    "swap_tensors of two biases": (lambda m: torch.utils.swap_tensors(m[0].bias, m[1].bias), _net),
    "biases reassigned across modules": (_reassign_biases, _net),
    "parameters_to_vector (a read)": (lambda m: nn.utils.parameters_to_vector(m.parameters()),
                                      _net),
    "torch.save(state_dict())": (lambda m: torch.save(m.state_dict(), io.BytesIO()), _net),
    "buffer = weight.detach()": (lambda m: m[0].register_buffer("w", m[0].weight.detach()), _net),
    "Parameter(other.weight)": (_second_parameter_object, _lin3),
    "Parameter(other.weight[:3])":
        (lambda m: setattr(m[2], "weight", nn.Parameter(m[0].weight[:3])), _net),
    "load_state_dict(own state_dict, assign=True)":
        (lambda m: m.load_state_dict(m.state_dict(), assign=True), _net),
    "param to buffer (the Parameter)": (_param_to_buffer(lambda w: w), _lin3),
    "param to buffer (.data)": (_param_to_buffer(lambda w: w.data), _lin3),
    "param also a later module's buffer": (lambda m: m[2].register_buffer("w", m[0].bias), _lin3),
    "remove_parametrizations(leave_parametrized=False)": (_unparametrize, _Parametrized),
}
# fmt: on


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(NO_VALUE_WRITTEN))
def test_changes_that_write_no_value_after_the_block_are_exact(idiom, include_buffers):
    change, build = NO_VALUE_WRITTEN[idiom]
    model, ref = _both(change, build, include_buffers)
    materialize_exactly(model, ref)
    assert all(p.is_leaf and p.grad_fn is None for p in model.parameters())


# -- changes metamode cannot reproduce: refused before anything changed ----------------


def _write_through_a_view(m):
    with torch.no_grad():
        m[0].weight[0].fill_(1.0)


_ORIGINAL = "0.parametrizations.weight.original"
_SPECTRAL = "0.parametrizations.weight.0._u 0.parametrizations.weight.0._v"
prune = torch.nn.utils.prune
fuse = torch.nn.utils.fusion.fuse_linear_bn_eval
# fmt: off
REFUSED = {  # idiom -> (change, names refused, what the reason says)
    "register_parametrization": (lambda m: P.register_parametrization(m[0], "weight", _Symmetric()),
                                 _ORIGINAL, r"set_ \(as register_parametrization"),
    "register_parametrization with right_inverse":
        (lambda m: P.register_parametrization(m[0], "weight", _Halved()), _ORIGINAL, "inside"),
    "parametrizations.weight_norm":
        (lambda m: nn.utils.parametrizations.weight_norm(m[0]), _ORIGINAL + "0", None),
    "parametrizations.spectral_norm":
        (lambda m: nn.utils.parametrizations.spectral_norm(m[0]), _SPECTRAL, None),
    "prune.l1_unstructured":
        (lambda m: prune.l1_unstructured(m[0], "weight", 0.5), "0.weight_mask", "attribute"),
    "prune.random_unstructured":
        (lambda m: prune.random_unstructured(m[0], "weight", 0.5), "0.weight_mask", "attribute"),
    "prune.identity": (lambda m: prune.identity(m[0], "weight"), "0.weight_mask", None),
    "old nn.utils.weight_norm": (lambda m: nn.utils.weight_norm(m[0]), "0.weight_g", None),
    "old nn.utils.spectral_norm": (lambda m: nn.utils.spectral_norm(m[2]), "2.weight_u", None),
    "fuse_linear_bn_eval": (lambda m: setattr(m, "fused", fuse(m[0].eval(), m[1].eval())),
                            "fused.weight fused.bias", None),
    "untied by a clone": (lambda m: setattr(m[2], "weight", nn.Parameter(m[0].weight[:3].clone())),
                          "2.weight", "replaced after the block"),
    "half() then float()": (lambda m: m[2].half().float(), "2.weight 2.bias", None),
    "vector_to_parameters round trip": (lambda m: nn.utils.vector_to_parameters(
        nn.utils.parameters_to_vector(m.parameters()), m.parameters()), "0.weight 2.bias", None),
    "to_empty(device='meta')": (lambda m: m.to_empty(device="meta"), "0.weight 1.weight", None),
    "model.to('meta') with real buffers": (lambda m: m.to("meta"), "1.running_mean", None),
    "a write through a view": (_write_through_a_view, "0.weight", "written after"),
}
# fmt: on
_ONE_MODE = {"fuse_linear_bn_eval": True, "model.to('meta') with real buffers": False}


_REFUSED_CASES = [
    pytest.param(idiom, mode, id=f"{idiom}-{mode}")
    for idiom in sorted(REFUSED)
    for mode in MODES
    if _ONE_MODE.get(idiom, mode) == mode
]


@pytest.mark.parametrize(("idiom", "include_buffers"), _REFUSED_CASES)
def test_changes_after_the_block_replay_cannot_reproduce_are_refused_upfront(
    idiom, include_buffers
):
    change, names, because = REFUSED[idiom]
    model = build_empty(_net, include_buffers)
    change(model)
    assert_refused(model, *names.split(), because=because)


def test_removing_a_parametrization_leaving_its_value_is_refused():
    model = build_empty(_Parametrized, include_buffers=True)
    P.remove_parametrizations(model.fc, "weight", leave_parametrized=True)
    assert_refused(model, "fc.weight")


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_pickled_copy_is_refused_and_the_original_stays_exact(include_buffers):
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers)
    assert_refused(pickle.loads(pickle.dumps(model)), "0.weight", "2.bias")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert_refused(torch.load(buffer, weights_only=False), "0.weight")
    materialize_exactly(model, ref)


@pytest.mark.parametrize("where", ["empty_weights()", "torch.device('meta')"])
def test_a_submodule_replaced_by_one_built_unrecorded_is_refused_naming_it(where):
    model = build_empty(_lin3, include_buffers=True)
    with metamode.empty_weights() if where == "empty_weights()" else torch.device("meta"):
        model[1] = nn.Linear(4, 4)
    message = assert_refused(model, "1.weight", "1.bias")
    assert not named(message, "0.weight")


def test_a_buffer_a_meta_forward_caches_after_the_block_is_refused():
    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv", torch.arange(0, 4, 2).float() / 4, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = torch.arange(x.shape[0], device=x.device).float()
            self.register_buffer("cos_cached", torch.outer(t, self.inv).cos(), persistent=False)
            return x

    model = build_empty(Cached, include_buffers=True)
    model(torch.ones(3, 4, device="meta"))
    message = assert_refused(model, "cos_cached", because="not registered inside")
    assert not named(message, "inv")


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_shallow_copy_shares_the_tables_and_both_are_exact(include_buffers):
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers)
    shallow = copy.copy(model)
    materialize_exactly(shallow, ref)
    materialize_exactly(model, ref)
    assert shallow[0].weight is model[0].weight


@pytest.mark.parametrize("include_buffers", MODES)
def test_to_empty_on_cpu_puts_tensors_materialize_keeps_as_loaded(include_buffers):
    # to_empty gives new CPU tensors no recording made: loaded ones, as assign=True loads
    model = build_empty(_net, include_buffers)
    model.to_empty(device="cpu")
    kept = {name: t.data_ptr() for name, t in tensors(model).items()}
    assert metamode.is_materializable(model)
    state = torch.default_generator.get_state()
    metamode.materialize(model)
    assert {name: t.data_ptr() for name, t in tensors(model).items()} == kept
    assert torch.equal(torch.default_generator.get_state(), state)


@pytest.mark.parametrize("include_buffers", MODES)
def test_share_memory_failing_on_meta_leaves_the_model_exact(include_buffers):
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers)
    with pytest.raises(RuntimeError, match="only available on CPU"):
        model.share_memory()
    materialize_exactly(model, ref)


def test_a_meta_backward_after_the_block_leaves_exact_values_and_no_meta_grad():
    ref = build_eagerly(_lin3)
    model = build_empty(_lin3, include_buffers=True)
    model(torch.ones(2, 4, device="meta")).sum().backward()
    materialize_exactly(model, ref)
    assert all(p.grad is None for p in model.parameters())


def test_an_optimizer_made_before_materialize_steps_the_materialized_parameters():
    ref = build_eagerly(_net)
    model = build_empty(_net)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    metamode.materialize(model)
    for m, optimizer in zip((model, ref), optimizers, strict=True):
        m(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    assert_same_tensors(model, ref)


# -- what the first pass over these idioms found -----------------------------------------


@pytest.mark.parametrize("include_buffers", MODES)
def test_gradient_hooks_registered_before_materialize_still_fire(include_buffers):
    fired = {"eager": [], "materialized": []}
    ref = build_eagerly(_lin3)
    model = build_empty(_lin3, include_buffers)
    for m, log in ((ref, fired["eager"]), (model, fired["materialized"])):
        m[0].weight.register_hook(lambda g: torch.zeros_like(g))  # gradient clamp idiom
        m[0].bias.register_post_accumulate_grad_hook(lambda p, log=log: log.append("post"))
    materialize_exactly(model, ref)
    for m in (ref, model):
        m(torch.ones(2, 4)).sum().backward()
    assert fired["materialized"] == fired["eager"] == ["post"]
    assert torch.equal(model[0].weight.grad, ref[0].weight.grad)


class _Clamped(nn.Module):
    """Registers a gradient hook in ``__init__``, inside the build."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.weight.register_hook(lambda g: g.clamp(-0.5, 0.5))


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_gradient_hook_registered_inside_the_build_still_fires(include_buffers):
    ref = build_eagerly(_Clamped)
    model = build_empty(_Clamped, include_buffers)
    materialize_exactly(model, ref)
    for m in (ref, model):
        (m.lin(torch.full((2, 4), 3.0)) ** 2).sum().backward()
    assert ref.lin.weight.grad.abs().max() == 0.5  # clamped
    assert torch.equal(model.lin.weight.grad, ref.lin.weight.grad)


HOLDERS = {
    "weakref.ref": lambda m: weakref.ref(m[0].weight),  # a library's cache keyed weakly
    "a view registered as a buffer": lambda m: m[0].register_buffer("wt", m[0].weight.T),
}


@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_a_parameter_torch_cannot_swap_is_replaced_in_its_module_with_a_warning(holder):
    model, ref = _both(HOLDERS[holder])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model[0].weight
    weight.register_hook(lambda g: g * 0)
    kept = HOLDERS[holder](model)  # noqa: F841 (held while materialize runs)
    with pytest.warns(UserWarning, match=r"holds '0\.weight'.*make optimizers after materialize"):
        materialize_exactly(model, ref, replaced=("0.weight",))
    assert model[0].weight is not weight and optimizer.param_groups[0]["params"][0] is weight
    model(torch.ones(2, 4)).sum().backward()  # the replaced parameter keeps its hooks
    assert not model[0].weight.grad.any()


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_parameter_also_registered_as_a_buffer_of_an_earlier_module(include_buffers):
    model, ref = _both(lambda m: m[0].register_buffer("w2", m[2].weight), _lin3, include_buffers)
    materialize_exactly(model, ref)


CALLS = {
    "materialize": metamode.materialize,
    "is_materializable": metamode.is_materializable,
    "summary": metamode.summary,
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_metamode_calls_inside_another_replayable_build_leave_it_exact(call):
    torch.manual_seed(0)
    ref_first, ref_second = _net(), _net()
    torch.manual_seed(0)
    with RE(include_buffers=True, replayable=True):
        first = _net()
    with RE(include_buffers=True, replayable=True):
        second = _net()
        CALLS[call](first)
    materialize_exactly(first, ref_first)
    materialize_exactly(second, ref_second)


def test_an_integer_tensor_made_float_is_exact_under_another_default_dtype():
    ref = build_eagerly(_Rope)
    model = build_empty(_Rope, include_buffers=True)
    with default_dtype(torch.bfloat16):
        materialize_exactly(model, ref)


def test_a_dtype_taken_from_the_default_is_refused_under_another_default():
    class Promoted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("half_steps", torch.arange(6) * 0.5)  # int * float: default

    model = build_empty(Promoted, include_buffers=True)
    with default_dtype(torch.float64):
        assert_refused(model, "half_steps", because="default dtype torch.float32")
    materialize_exactly(model, build_eagerly(Promoted))


# -- submodules in odd orders ------------------------------------------------------------


def _each(*subs):
    for sub in subs:
        metamode.materialize(sub)


ORDERS = {
    "children in reverse": lambda m: _each(*reversed(list(m.children()))),
    "the same submodule twice, then its parent": lambda m: _each(m[1][1], m[1][1], m[1]),
    "a submodule through a second parent": lambda m: _each(nn.Sequential(m[1], nn.ReLU())),
    "the tied head first": lambda m: _each(m[3]),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_submodules_materialized_in_odd_orders_are_exact(order, include_buffers):
    ref = build_eagerly(_deep)
    model = build_empty(_deep, include_buffers)
    ORDERS[order](model)
    materialize_exactly(model, ref)
    assert model[3].weight is model[2].weight


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_submodule_detached_from_a_parent_that_is_gone_is_exact(include_buffers):
    ref = build_eagerly(_deep)
    model = build_empty(_deep, include_buffers)
    inner, last = model[1], model[3]
    del model[1]
    del model
    gc.collect()
    materialize_exactly(inner, ref[1])
    materialize_exactly(last, ref[3])


# -- chained builds (one replayable block per step), generator games between them --------


def _chain(include_buffers, *steps, between=lambda: None):
    """Each step run eagerly, then each in its own replayable block, from seed 0, with
    ``between`` run between the first two steps; the dicts the steps filled."""
    results = []
    for blocks in (False, True):
        torch.manual_seed(0)
        found: dict = {}
        for index, step in enumerate(steps):
            if index == 1:
                between()
            with RE(include_buffers=include_buffers, replayable=True) if blocks else _NOTHING:
                step(found)
        gc.collect()
        results.append(found)
    return results[1], results[0]


_NOTHING = contextlib.nullcontext()


def _layers(d):
    d["m"] = nn.ModuleList([_net() for _ in range(3)])


def _isolated_draw():
    with torch.random.fork_rng():
        torch.randn(10)  # Lightning's isolate_rng around a sampler


_A, _B = (lambda d: d.update(a=_net())), (lambda d: d.update(b=_net()))
# fmt: off
CHAINS = {  # name -> (steps, between, materialized in this order)
    "a layer replaced by the next build": ([_layers, lambda d: d["m"].__setitem__(0, _net())],
                                           None, ["m"]),
    "insert, extend, append, the last first": ([
        _layers,
        lambda d: d["m"].insert(1, nn.Linear(4, 2)),
        lambda d: d["m"].extend([nn.Linear(2, 2)]),
        lambda d: d.update(x=nn.Linear(2, 3)) or d["m"].append(d["x"]),
    ], None, ["x", "m"]),
    "the second build first": ([_A, _B], None, ["b", "a"]),
    "a draw inside fork_rng between": ([_A, _B], _isolated_draw, ["a", "b"]),
    "manual_seed between": ([_A, _B], lambda: torch.manual_seed(5), ["b", "a"]),
    "the first kept only through a submodule":
        ([lambda d: d.update(a=_net()[2]), _B], None, ["b", "a"]),
}
# fmt: on


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_chained_builds_are_exact(chain, include_buffers):
    steps, between, order = CHAINS[chain]
    built, eager = _chain(include_buffers, *steps, between=between or (lambda: None))
    for name in order:
        materialize_exactly(built[name], eager[name])


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("link", ["tie", "swap_tensors", "load_state_dict(assign=True)"])
def test_tensors_moved_between_two_builds_are_exact(link, include_buffers):
    first, second = (lambda d: d.update(a=_deep())), (lambda d: d.update(b=_deep()))
    built, eager = _chain(include_buffers, first, second)
    for d in (built, eager):
        if link == "tie":
            d["b"][0].weight = d["a"][0].weight
        elif link == "swap_tensors":
            torch.utils.swap_tensors(d["a"][0].weight, d["b"][0].weight)
        else:
            d["a"].load_state_dict(d["b"].state_dict(), assign=True)
    materialize_exactly(built["b"], eager["b"])
    materialize_exactly(built["a"], eager["a"])


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_chained_build_after_an_unrecorded_draw_is_refused_upfront(include_buffers):
    torch.manual_seed(0)
    with RE(include_buffers=include_buffers, replayable=True):
        model = nn.ModuleList([_net()])
    torch.randn(3)  # continues the marker state: eager's stream is unknowable now
    with RE(include_buffers=include_buffers, replayable=True):
        model.append(_net())
    message = assert_refused(model, "1.0.weight", because="did not record")
    assert not named(message, "0.0.weight")
    materialize_exactly(model[0], build_eagerly(_net))


def _reseeded(model):
    torch.manual_seed(123)
    metamode.materialize(model)


def _in_fork_rng(model):
    with torch.random.fork_rng():
        torch.randn(7)
        metamode.materialize(model)


def _state_restored_around(model):
    state = torch.get_rng_state()
    torch.randn(100)
    metamode.materialize(model)
    torch.set_rng_state(state)


GAMES = {
    "manual_seed before materialize": _reseeded,
    "inside fork_rng with a draw": _in_fork_rng,
    "get/set_rng_state around, a draw between": _state_restored_around,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("game", sorted(GAMES))
def test_generator_games_around_materialize_leave_values_exact(game, include_buffers):
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers)
    GAMES[game](model)
    assert_same_tensors(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_private_generator_reseeded_and_drawn_after_the_block_is_exact(include_buffers):
    def build():
        m = nn.Linear(4, 4)
        m.g = torch.Generator().manual_seed(5)
        nn.init.normal_(m.weight, generator=m.g)
        return m

    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    model.g.manual_seed(99)
    torch.randn(3, generator=model.g)
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_build_drawing_nothing_leaves_the_generator_where_eager_does(include_buffers):
    def build():
        return nn.Sequential(nn.LayerNorm(4), nn.BatchNorm1d(4))

    ref = build_eagerly(build)
    eager_state = torch.default_generator.get_state()
    model = build_empty(build, include_buffers)
    assert torch.equal(torch.default_generator.get_state(), eager_state)
    materialize_exactly(model, ref)
    assert torch.equal(torch.default_generator.get_state(), eager_state)


# -- the caller's context --------------------------------------------------------------------


@contextlib.contextmanager
def _default_device_meta():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


CONTEXTS = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "autocast(cpu)": lambda: torch.autocast("cpu"),
    "autocast(cpu, float16)": lambda: torch.autocast("cpu", dtype=torch.float16),
    "torch.device('meta')": lambda: torch.device("meta"),
    "set_default_device('meta')": _default_device_meta,
    "empty_weights()": metamode.empty_weights,
    "empty_weights(include_buffers=True)": lambda: metamode.empty_weights(include_buffers=True),
    "skip_empty_weights()": metamode.skip_empty_weights,
    "metamode.default_dtype(float64)": lambda: metamode.default_dtype(torch.float64),
}


class _Buffered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.register_buffer("causal", torch.ones(4, 4).tril())
        self.register_buffer("scale", torch.linspace(0, 1, 5))


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("context", sorted(CONTEXTS))
def test_materialize_inside_the_callers_context_is_exact(context, include_buffers):
    ref = build_eagerly(_Buffered)
    model = build_empty(_Buffered, include_buffers)
    with CONTEXTS[context]():
        materialize_exactly(model, ref)
    assert all(not t.is_inference() for t in tensors(model).values())


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_changed_matmul_precision_refuses_only_what_a_matmul_computed(include_buffers):
    class Gram(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            a = torch.randn(4, 4)
            self.register_buffer("gram", a @ a.T)

    ref = build_eagerly(Gram)
    model = build_empty(Gram, include_buffers)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # Lightning's hint, set after the build
    try:
        message = assert_refused(model, "gram", because="float32_matmul_precision")
        assert not named(message, "fc.weight")
        materialize_exactly(model.fc, ref.fc)
    finally:
        torch.set_float32_matmul_precision(precision)
    materialize_exactly(model, ref)


# -- threads -------------------------------------------------------------------------------


class _Paused(nn.Module):
    def __init__(self, pause=lambda: None) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        pause()
        self.b = nn.BatchNorm1d(4)
        self.c = nn.Linear(4, 3)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("while_building", [False, True], ids=["idle", "while-building"])
def test_materialize_from_another_thread_is_exact(while_building, include_buffers):
    """Another thread materializes the first build, here idle or while this thread
    records the next build (paused in its constructor until the other one is done)."""
    torch.manual_seed(0)
    ref_first, ref_second = _net(), _Paused()
    torch.manual_seed(0)
    with RE(include_buffers=include_buffers, replayable=True):
        first = _net()
    inside, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def materialize_first():
        try:
            assert inside.wait(_WAIT_S), "the build did not start"
            metamode.materialize(first)
        except BaseException as error:  # reported in the test's thread
            errors.append(error)
        finally:
            done.set()

    def pause():
        inside.set()
        assert done.wait(_WAIT_S), "the materializing thread did not finish"

    thread = threading.Thread(target=materialize_first)
    thread.start()
    state = torch.default_generator.get_state()
    if while_building:
        with RE(include_buffers=include_buffers, replayable=True):
            second = _Paused(pause)
    else:
        pause()
    thread.join(_WAIT_S)
    assert not thread.is_alive(), "the thread did not finish"
    assert not errors, errors
    assert_same_tensors(first, ref_first)
    if while_building:
        materialize_exactly(second, ref_second)
    else:
        assert torch.equal(torch.default_generator.get_state(), state)
