"""A break-it pass on this session's materialize rules: draws into meta the build asked for
itself, containers walked by subclass, ``__slots__`` carried to twins, ties across builds,
casts after the block and captured argument types.

Each case is exact against eager construction under the same seed (generator state
included), or refused upfront with a reason naming the cause. A case where materialize breaks
that promise today (silently wrong, an exact idiom refused, a wrong reason, a crash) is a
strict xfail saying what happens.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import types
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._device import DeviceContext

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    Built,
    assert_exact_or_refused,
    assert_refused,
    build_eagerly,
    build_empty,
    materialize_exactly,
    named,
    warm_pickling,
)

warm_pickling()

_ASKED = "the build asked for itself"


def _xfail(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=reason)


def _cases(table: dict, broken: dict[str, str]) -> list:
    """``(name, include_buffers)`` for each entry in both modes; one in ``broken`` is a
    strict xfail with that reason."""
    return [
        pytest.param(
            name,
            mode,
            marks=[_xfail(broken[name])] if name in broken else [],
            id=f"{name}-{mode}",
        )
        for name in table
        for mode in MODES
    ]


# == 1a. draws into meta the build asked for itself: refused, with the draws after ==========


def _lin(m: nn.Module) -> None:
    m.lin = nn.Linear(3, 3)


def _set_default_meta() -> nn.Linear:
    torch.set_default_device("meta")
    try:
        return nn.Linear(3, 3)
    finally:
        torch.set_default_device(None)


def _device_context_meta() -> None:
    with DeviceContext(torch.device("meta")):
        torch.randn(3)


def _trunc_normal_under_device_meta() -> None:
    with torch.device("meta"):
        nn.init.trunc_normal_(torch.empty(3))


def _with_torch_device_meta_linear() -> None:
    with torch.device("meta"):
        nn.Linear(3, 3)


def _module_to_meta() -> None:
    layer = nn.Linear(3, 3)
    layer.to("meta")
    layer.reset_parameters()


def _to_empty_meta() -> None:
    layer = nn.Linear(3, 3)
    layer.to_empty(device="meta")
    layer.reset_parameters()


def _no_grad_zeros_on_a_meta_device() -> None:
    device = torch.device("meta")
    with torch.no_grad():
        torch.zeros(3, device=device).normal_()


ASKED_META_DRAWS: dict[str, Callable[[], object]] = {
    "normal_ of a row view": lambda: torch.empty(4, 4, device="meta")[0].normal_(),
    "kaiming_uniform_ of a .view()": lambda: nn.init.kaiming_uniform_(
        torch.empty(16, device="meta").view(4, 4)
    ),
    "empty_like(meta x) without device, normal_": lambda: torch.empty_like(
        torch.empty(4, device="meta")
    ).normal_(),
    "meta x.new_empty().uniform_()": lambda: torch.empty(4, device="meta").new_empty(3).uniform_(),
    "zeros(device=torch.device('meta')) under no_grad, normal_": _no_grad_zeros_on_a_meta_device,
    "nn.Module.to_empty(device='meta') then reset_parameters": _to_empty_meta,
    "with torch.device('meta'): nn.Linear": _with_torch_device_meta_linear,
    "nn.Linear(device='meta')": lambda: nn.Linear(3, 3, device="meta"),
    "factory_kwargs device='meta', xavier_uniform_": lambda: nn.init.xavier_uniform_(
        torch.empty(3, 3, **{"device": "meta", "dtype": torch.float32})
    ),
    "xavier_normal_ into meta": lambda: nn.init.xavier_normal_(torch.empty(3, 3, device="meta")),
    "normal_(tensor=meta) by keyword": lambda: nn.init.normal_(
        tensor=torch.empty(3, device="meta")
    ),
    "torch.bernoulli(meta, p)": lambda: torch.bernoulli(torch.empty(3, device="meta"), 0.5),
    "F.dropout on meta": lambda: F.dropout(torch.ones(3, device="meta"), 0.5, training=True),
    "randperm(device='meta')": lambda: torch.randperm(5, device="meta"),
    "multinomial of meta probabilities": lambda: torch.multinomial(torch.ones(4, device="meta"), 2),
    "clone of an expanded meta tensor, normal_": lambda: (
        torch.empty(1, device="meta").expand(3).clone().normal_()
    ),
    "randn(device=torch.device(type='meta'))": lambda: torch.randn(
        3, device=torch.device(type="meta")
    ),
    # -- inits that return early on meta, tensors by keyword or out=, device contexts --
    "trunc_normal_ into meta": lambda: nn.init.trunc_normal_(torch.empty(3, device="meta")),
    "orthogonal_ into meta": lambda: nn.init.orthogonal_(torch.empty(3, 3, device="meta")),
    "sparse_ into meta": lambda: nn.init.sparse_(torch.empty(3, 3, device="meta"), 0.5),
    "torch.normal(mean=meta tensor)": lambda: torch.normal(
        mean=torch.zeros(3, device="meta"), std=1.0
    ),
    "torch.randn(out=meta tensor)": lambda: torch.randn(3, out=torch.empty(3, device="meta")),
    "rand_like(input=meta tensor)": lambda: torch.rand_like(input=torch.empty(3, device="meta")),
    "trunc_normal_ under with torch.device('meta')": _trunc_normal_under_device_meta,
    "DeviceContext('meta') entered directly": _device_context_meta,
    "torch.set_default_device('meta') inside the build": _set_default_meta,
    "nn.Module.to('meta') then reset_parameters": _module_to_meta,
}


@pytest.mark.parametrize(("idiom", "include_buffers"), _cases(ASKED_META_DRAWS, {}))
def test_a_draw_into_meta_the_build_asked_for_refuses_the_draws_after_it(idiom, include_buffers):
    def init(m: nn.Module) -> None:
        ASKED_META_DRAWS[idiom]()
        _lin(m)

    model = build_empty(lambda: Built(init), include_buffers)
    assert_refused(model, "lin.weight", "lin.bias", because=_ASKED)


def _buffer_drawn_on_meta(m: nn.Module) -> None:
    m.register_buffer("b", torch.empty(3, device="meta").normal_())
    _lin(m)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_buffer_drawn_on_meta_is_refused_with_the_later_layer(include_buffers):
    model = build_empty(lambda: Built(_buffer_drawn_on_meta), include_buffers)
    assert_refused(model, "b", "lin.weight", "lin.bias", because=_ASKED)


def _titan_skeleton(m: nn.Module) -> None:
    with torch.device("meta"):
        m.sk = nn.Linear(3, 3)
    m.sk.to_empty(device="cpu")
    m.sk.reset_parameters()
    _lin(m)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_torchtitan_skeleton_initialised_after_to_empty_is_refused(include_buffers):
    """Its constructor's draws went into meta the build asked for: eager drew nothing there,
    so nothing after (the init after ``to_empty(device='cpu')`` included) is known."""
    model = build_empty(lambda: Built(_titan_skeleton), include_buffers)
    assert_refused(model, "sk.weight", "sk.bias", "lin.weight", because=_ASKED)


with metamode.empty_weights():  # a non-replayable build: its layer is on meta, unrecorded
    _UNRECORDED = nn.Linear(3, 3)


def _reset_an_unrecorded_layer(m: nn.Module) -> None:
    _UNRECORDED.reset_parameters()  # eager: a real layer, a real draw
    _lin(m)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_draw_into_a_layer_of_a_non_replayable_block_is_refused(include_buffers):
    model = build_empty(lambda: Built(_reset_an_unrecorded_layer), include_buffers)
    assert_refused(model, "lin.weight", "lin.bias", because="made outside the recording")


def _accelerate_inside(m: nn.Module) -> None:
    import accelerate

    with accelerate.init_empty_weights():
        m.skeleton = nn.Linear(3, 3)
    m.lin = nn.Linear(3, 3)


@pytest.mark.parametrize("include_buffers", MODES)
def test_stock_accelerate_init_empty_weights_inside_the_build(include_buffers):
    assert not metamode.is_enabled("accelerate")
    ref = build_eagerly(lambda: Built(_accelerate_inside))
    assert ref.skeleton.weight.is_meta
    model = build_empty(lambda: Built(_accelerate_inside), include_buffers)
    if metamode.is_materializable(model.lin):
        materialize_exactly(model.lin, ref.lin)
    else:
        assert_refused(model.lin, "weight", because=_ASKED)


# == 1b. placing by a placed tensor's device: exact (or refused for a documented reason) ===


def _param_and(m: nn.Module) -> torch.Tensor:
    m.l = nn.Linear(3, 3)
    return m.l.weight


def _torch_device_of(m: nn.Module) -> None:
    w = _param_and(m)
    m.register_buffer("noise", torch.randn(3, device=torch.device(w.device)))


def _with_torch_device_of(m: nn.Module) -> None:
    w = _param_and(m)
    with torch.device(torch.device(w.device)):
        m.p = nn.Parameter(torch.randn(3))


def _with_the_device_itself(m: nn.Module) -> None:
    w = _param_and(m)
    with w.device:
        m.p = nn.Parameter(torch.randn(3))


def _factory_kwargs(m: nn.Module) -> None:
    w = _param_and(m)
    factory_kwargs = {"device": w.device, "dtype": w.dtype}
    m.v = nn.Parameter(torch.empty(3, **factory_kwargs))
    nn.init.normal_(m.v)


def _from_a_set_of_devices(m: nn.Module) -> None:
    _param_and(m)
    (device,) = {p.device for p in m.parameters()}
    m.p = nn.Parameter(torch.randn(3, device=device))


PLACED_DEVICE_IDIOMS: dict[str, Callable[[nn.Module], None]] = {
    ".to(w.device) then init": lambda m: (
        m.register_buffer("noise", torch.randn(3).to(_param_and(m).device)),
        nn.init.normal_(m.l.weight),
    ),
    "factory_kwargs from w.device": _factory_kwargs,
    "w.new_empty then uniform_": lambda m: setattr(
        m, "v", nn.Parameter(nn.init.uniform_(_param_and(m).new_empty(4)))
    ),
    "empty_like(w) then xavier_uniform_": lambda m: setattr(
        m, "v", nn.Parameter(nn.init.xavier_uniform_(torch.empty_like(_param_and(m))))
    ),
    "rand_like(w)": lambda m: m.register_buffer("r", torch.rand_like(_param_and(m))),
    "next(parameters()).device": lambda m: (
        _param_and(m),
        m.register_buffer("r", torch.randn(3, device=next(m.parameters()).device)),
    ),
    "nn.Linear(device=w.device)": lambda m: setattr(
        m, "l2", nn.Linear(3, 3, device=_param_and(m).device)
    ),
    "zeros(device=w.device).normal_(std=0.02)": lambda m: setattr(
        m, "p", nn.Parameter(torch.zeros(3, device=_param_and(m).device).normal_(std=0.02))
    ),
    "nn.Linear().to(device=w.device, dtype=float64)": lambda m: setattr(
        m, "l2", nn.Linear(3, 3).to(device=_param_and(m).device, dtype=torch.float64)
    ),
    "empty(0, device=w.device).new_empty().normal_()": lambda m: setattr(
        m,
        "p",
        nn.Parameter(torch.empty(0, device=_param_and(m).device).new_empty(3).normal_()),
    ),
    "device from a set of parameter devices": _from_a_set_of_devices,
    "with w.device: randn": _with_the_device_itself,
    "torch.device(w.device)": _torch_device_of,
    "with torch.device(torch.device(w.device)): randn": _with_torch_device_of,
}


@pytest.mark.parametrize(("idiom", "include_buffers"), _cases(PLACED_DEVICE_IDIOMS, {}))
def test_placing_by_a_placed_tensors_device_is_exact(idiom, include_buffers):
    init = PLACED_DEVICE_IDIOMS[idiom]
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    materialize_exactly(model, ref)


@pytest.mark.parametrize("spell", ["str(w.device)", "w.device.type"])
@pytest.mark.parametrize("include_buffers", MODES)
def test_a_placed_device_turned_into_a_string_is_refused_as_documented(spell, include_buffers):
    def init(m: nn.Module) -> None:
        w = _param_and(m)
        device = str(w.device) if spell == "str(w.device)" else w.device.type
        m.p = nn.Parameter(torch.randn(3, device=device))

    model = build_empty(lambda: Built(init), include_buffers)
    assert_refused(model, "p", because=_ASKED)


def _trunc_normal_and_orthogonal_on_a_placed_param(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.empty(3, 3))
    nn.init.trunc_normal_(m.w, std=0.02)
    nn.init.orthogonal_(m.w)
    _lin(m)


@pytest.mark.parametrize("include_buffers", MODES)
def test_keyword_inits_into_a_placed_parameter_stay_exact(include_buffers):
    build = lambda: Built(_trunc_normal_and_orthogonal_on_a_placed_param)  # noqa: E731
    materialize_exactly(build_empty(build, include_buffers), build_eagerly(build))


# == 1c. real libraries built from tiny configs ============================================


def _tiny(name: str) -> Callable[[], nn.Module]:
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
        return lambda: transformers.LlamaForCausalLM(config)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32
        )
        return lambda: transformers.GPT2LMHeadModel(config)
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
        return lambda: transformers.BertModel(config)
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2
    )
    return lambda: transformers.T5ForConditionalGeneration(config)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "t5"])
def test_tiny_transformers_models_are_exact(name, include_buffers):
    build = _tiny(name)
    materialize_exactly(build_empty(build, include_buffers), build_eagerly(build))


_LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "bert": ["query", "value"]}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", sorted(_LORA_TARGETS))
def test_lora_on_tiny_transformers_models_inside_the_block_is_exact(name, include_buffers):
    import peft

    base = _tiny(name)
    config = peft.LoraConfig(
        r=2,
        target_modules=_LORA_TARGETS[name],
        init_lora_weights="gaussian",
        use_dora=name == "bert",
        fan_in_fan_out=name == "gpt2",
    )

    def build(low_cpu_mem_usage: bool) -> Callable[[], nn.Module]:
        return lambda: peft.get_peft_model(base(), config, low_cpu_mem_usage=low_cpu_mem_usage)

    with metamode.enabled("peft"):
        ref = build_eagerly(build(False))
        model = build_empty(build(True), include_buffers)
        materialize_exactly(model, ref)


# == 2. containers ===========================================================================


def _check_held(
    init: Callable[[nn.Module], None],
    get: Callable[[nn.Module], list],
    include_buffers: bool,
    because: str | None = None,
) -> None:
    """Exact (registered tensors and the ones ``get`` reads from the module's containers,
    bitwise) or refused upfront."""
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    if assert_exact_or_refused(model, ref, because=because) == "exact":
        for got, want in zip(get(model), get(ref), strict=True):
            if isinstance(want, torch.Tensor):
                assert not got.is_meta, "a held tensor was left on meta"
                assert got.dtype == want.dtype and torch.equal(got, want)
            else:
                assert got == want


class _ClonesOnSet(dict):
    def __setitem__(self, key, value):
        super().__setitem__(key, value.clone() if isinstance(value, torch.Tensor) else value)


class _ComputesOnGet(dict):
    def __getitem__(self, key):
        return super().__getitem__(key) * 1


class _ReadOnly(dict):
    def __setitem__(self, key, value):
        raise TypeError("read-only")


@dataclasses.dataclass(frozen=True)
class _Frozen:
    x: torch.Tensor


@dataclasses.dataclass(slots=True)
class _Slotted:
    x: torch.Tensor


_NT = collections.namedtuple("_NT", "a b")


def _read_only(m: nn.Module) -> None:
    m.l = nn.Linear(3, 3)
    held = _ReadOnly()
    dict.__setitem__(held, "x", torch.randn(3))
    m.d = held


def _computes_on_get(m: nn.Module) -> None:
    m.d = _ComputesOnGet(x=torch.randn(3))
    _lin(m)


def _shared_with_list_and_ordered_dict(m: nn.Module) -> None:
    m.register_buffer("b", torch.randn(3))
    m.lst = [m.b]
    m.od = collections.OrderedDict(k=m.b)


def _parameter_list_and_dict_in_a_dict(m: nn.Module) -> None:
    m.pl = nn.ParameterList([nn.Parameter(torch.randn(2))])
    m.pd = nn.ParameterDict({"a": nn.Parameter(torch.randn(2))})
    m.cache = {"pl0": m.pl[0], "pd": m.pd["a"]}


def _defaultdict(m: nn.Module) -> None:
    m.dd = collections.defaultdict(list)
    m.dd["a"].append(torch.randn(2))


CONTAINERS: dict[str, tuple[Callable[[nn.Module], None], Callable[[nn.Module], list]]] = {
    "dict subclass cloning in __setitem__": (
        lambda m: (setattr(m, "d", _ClonesOnSet()), m.d.__setitem__("x", torch.randn(3))),
        lambda m: [m.d["x"]],
    ),
    "ChainMap": (
        lambda m: setattr(
            m, "c", collections.ChainMap({"x": torch.randn(3)}, {"y": torch.randn(2)})
        ),
        lambda m: [m.c["x"], m.c["y"]],
    ),
    "UserDict and UserList": (
        lambda m: (
            setattr(m, "u", collections.UserDict(x=torch.randn(3))),
            setattr(m, "ul", collections.UserList([torch.randn(2)])),
        ),
        lambda m: [m.u["x"], m.ul[0]],
    ),
    "frozen dataclass": (lambda m: setattr(m, "f", _Frozen(torch.randn(3))), lambda m: [m.f.x]),
    "deque with maxlen": (
        lambda m: setattr(m, "dq", collections.deque([torch.randn(2), torch.randn(3)], maxlen=2)),
        lambda m: [m.dq[0], m.dq[1]],
    ),
    "defaultdict(list)": (_defaultdict, lambda m: [m.dd["a"][0]]),
    "buffer shared with a list and an OrderedDict": (
        _shared_with_list_and_ordered_dict,
        lambda m: [m.lst[0], m.od["k"], m.lst[0] is m.b, m.od["k"] is m.b],
    ),
    "ParameterList and ParameterDict entries in a dict": (
        _parameter_list_and_dict_in_a_dict,
        lambda m: [m.pl[0], m.pd["a"], m.cache["pl0"] is m.pl[0], m.cache["pd"] is m.pd["a"]],
    ),
    "nested namedtuple of computed tensors": (
        lambda m: setattr(m, "n", _NT(_NT(torch.randn(2), 1), torch.randn(3))),
        lambda m: [m.n.a.a, m.n.b],
    ),
    "buffer in a namedtuple in a SimpleNamespace": (
        lambda m: (
            m.register_buffer("b", torch.zeros(2)),
            setattr(m, "ns", types.SimpleNamespace(inner=_NT(m.b, 1))),
        ),
        lambda m: [m.ns.inner.a, m.ns.inner.a is m.b],
    ),
    # -- broken today --
    "dataclass(slots=True)": (
        lambda m: setattr(m, "f", _Slotted(torch.randn(3))),
        lambda m: [m.f.x],
    ),
    "MappingProxyType": (
        lambda m: setattr(m, "p", types.MappingProxyType({"x": torch.randn(3)})),
        lambda m: [m.p["x"]],
    ),
    "set": (lambda m: setattr(m, "s", {torch.randn(3)}), lambda m: list(m.s)),
    "dict subclass computing in __getitem__": (
        _computes_on_get,
        lambda m: [dict.__getitem__(m.d, "x")],
    ),
    "read-only dict subclass": (_read_only, lambda m: [dict.__getitem__(m.d, "x")]),
}

CONTAINERS_BROKEN: dict[str, str] = {}
# the cause a refusal must name, where one may refuse
CONTAINER_CAUSES = {"dict subclass computing in __getitem__": "__getitem__"}
_BROKEN_IN_ONE_MODE: set[str] = set()  # those broken only where the held tensor is on meta


@pytest.mark.parametrize(
    ("idiom", "include_buffers"),
    [
        pytest.param(
            name,
            mode,
            marks=[_xfail(CONTAINERS_BROKEN[name])]
            if name in CONTAINERS_BROKEN and (mode or name not in _BROKEN_IN_ONE_MODE)
            else [],
            id=f"{name}-{mode}",
        )
        for name in CONTAINERS
        for mode in MODES
    ],
)
def test_tensors_held_in_containers_are_exact_or_refused(idiom, include_buffers):
    init, get = CONTAINERS[idiom]
    _check_held(init, get, include_buffers, CONTAINER_CAUSES.get(idiom))


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_namedtuple_holding_a_buffer_that_must_be_replaced_is_refused(include_buffers):
    def init(m: nn.Module) -> None:
        m.register_buffer("b", torch.zeros(2))
        m.nt = _NT(m.b, 0)

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    if include_buffers:  # the tensor alone is materializable: the module's tuple refuses
        assert named(assert_refused(model, because="tuple attribute"), "b")
    else:
        materialize_exactly(model, ref)
        assert model.nt.a is model.b


class _ReadOnlyList(list):
    def __setitem__(self, key, value):
        raise TypeError("read-only")


def test_read_only_container_subclasses_get_the_installed_tensors():
    def init(m: nn.Module) -> None:
        m.l = nn.Linear(3, 3)
        m.register_buffer("b", torch.randn(3))
        held = _ReadOnly()
        dict.__setitem__(held, "x", m.b)
        m.d = held
        m.lst = _ReadOnlyList([torch.randn(2), m.b])

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers=True)
    materialize_exactly(model, ref)
    assert dict.__getitem__(model.d, "x") is model.b
    assert list.__getitem__(model.lst, 1) is model.b
    assert torch.equal(list.__getitem__(model.lst, 0), list.__getitem__(ref.lst, 0))


# == 3. __slots__ of Parameter and tensor subclasses ==========================================


class _DefaultedSlot(nn.Parameter):
    __slots__ = ("tag",)

    def __new__(cls, data=None, requires_grad=True, tag=None):
        param = super().__new__(cls, data, requires_grad)
        param.tag = tag
        return param


class _PropertySlot(nn.Parameter):
    __slots__ = ("_tag",)

    @property
    def tag(self):
        return self._tag

    @tag.setter
    def tag(self, value):
        self._tag = value * 2


class _Mangled(nn.Parameter):
    __slots__ = ("__secret",)

    def put(self, value):
        self.__secret = value

    def get(self):
        return self.__secret


class _BaseSlot(nn.Parameter):
    __slots__ = ("a",)


class _ChildSlot(_BaseSlot):
    __slots__ = ("b",)


class _SlottedBuffer(torch.Tensor):
    __slots__ = ("unit",)


class _MutableSlot(nn.Parameter):
    __slots__ = ("info",)


def _slot_values(tensor: torch.Tensor, names: tuple[str, ...]) -> dict:
    return {name: getattr(tensor, name, "<unset>") for name in names}


def _defaulted(m: nn.Module) -> None:
    m.w = _DefaultedSlot(torch.randn(3), tag="enc")


def _defaulted_then_deleted(m: nn.Module) -> None:
    param = _DefaultedSlot(torch.randn(3), tag="x")
    del param.tag
    m.w = param


def _property(m: nn.Module) -> None:
    param = _PropertySlot(torch.randn(3))
    param.tag = 3
    m.w = param


def _mangled(m: nn.Module) -> None:
    param = _Mangled(torch.randn(3))
    param.put(5)
    m.w = param


def _inherited(m: nn.Module) -> None:
    param = _ChildSlot(torch.randn(3))
    param.a, param.b = 1, 2
    m.w = param


def _buffer_slot(m: nn.Module) -> None:
    buffer = torch.randn(3).as_subclass(_SlottedBuffer)
    buffer.unit = "m"
    m.register_buffer("b", buffer)


def _mutable(m: nn.Module) -> None:
    param = _MutableSlot(torch.randn(3))
    param.info = {"k": [1]}
    m.w = param
    m.info = param.info


SLOTS: dict[str, tuple[Callable[[nn.Module], None], Callable[[nn.Module], dict]]] = {
    "slot behind a property setter": (_property, lambda m: _slot_values(m.w, ("_tag",))),
    "name-mangled slot": (_mangled, lambda m: {"secret": m.w.get()}),
    "inherited slots": (_inherited, lambda m: _slot_values(m.w, ("a", "b"))),
    "buffer subclass slot": (_buffer_slot, lambda m: _slot_values(m.b, ("unit",))),
    "slot holding a shared mutable object": (_mutable, lambda m: {"same": m.w.info is m.info}),
    "slot the constructor sets to a default": (_defaulted, lambda m: _slot_values(m.w, ("tag",))),
    "slot deleted after the constructor set it": (
        _defaulted_then_deleted,
        lambda m: _slot_values(m.w, ("tag",)),
    ),
}
SLOTS_BROKEN: dict[str, str] = {}


@pytest.mark.parametrize(
    ("idiom", "include_buffers"),
    [
        pytest.param(
            name,
            mode,
            marks=[_xfail(SLOTS_BROKEN[name])] if name in SLOTS_BROKEN and not mode else [],
            id=f"{name}-{mode}",
        )
        for name in SLOTS
        for mode in MODES
    ],
)
def test_slots_reach_the_twin_and_the_installed_tensor(idiom, include_buffers):
    init, read = SLOTS[idiom]
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    assert read(model) == read(ref), "the meta twin's slots differ from eager's"
    materialize_exactly(model, ref)
    assert read(model) == read(ref), "the installed tensor's slots differ from eager's"


# == 4. ties across builds =====================================================================


def _two_builds(
    second: Callable[[nn.Module, nn.Linear], None], include_buffers: bool
) -> tuple[tuple[nn.Module, nn.Module], tuple[nn.Module, nn.Module]]:
    torch.manual_seed(0)
    eager_enc = nn.Linear(4, 4)
    eager_dec = nn.Module()
    second(eager_dec, eager_enc)
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        enc = nn.Linear(4, 4)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        dec = nn.Module()
        second(dec, enc)
    return (enc, dec), (eager_enc, eager_dec)


def _tie(dec: nn.Module, enc: nn.Linear) -> None:
    dec.w = enc.weight
    dec.head = nn.Linear(4, 2)


def _tie_write_view(dec: nn.Module, enc: nn.Linear) -> None:
    dec.w = enc.weight
    with torch.no_grad():
        dec.w[0].zero_()


def _tie_write_data(dec: nn.Module, enc: nn.Linear) -> None:
    dec.w = enc.weight
    dec.w.data.mul_(2)


def _tie_copy(dec: nn.Module, enc: nn.Linear) -> None:
    dec.w = enc.weight
    with torch.no_grad():
        dec.w.copy_(torch.ones(4, 4))


def _tie_detach_fill(dec: nn.Module, enc: nn.Linear) -> None:
    dec.w = enc.weight
    dec.w.detach().fill_(1.0)


def _tie_init(dec: nn.Module, enc: nn.Linear) -> None:
    dec.w = enc.weight
    nn.init.normal_(dec.w)


def _init_unregistered(dec: nn.Module, enc: nn.Linear) -> None:
    nn.init.zeros_(enc.bias)
    dec.head = nn.Linear(2, 2)


def _reset_the_first(dec: nn.Module, enc: nn.Linear) -> None:
    enc.reset_parameters()
    dec.head = nn.Linear(2, 2)


def _as_submodule_inited(dec: nn.Module, enc: nn.Linear) -> None:
    dec.enc = enc
    nn.init.ones_(dec.enc.weight)


SECOND_BUILD_WRITES = {
    "through a view": (_tie_write_view, ("weight",), ("w",)),
    "through .data": (_tie_write_data, ("weight",), ("w",)),
    "copy_": (_tie_copy, ("weight",), ("w",)),
    "detach().fill_": (_tie_detach_fill, ("weight",), ("w",)),
    "nn.init.normal_": (_tie_init, ("weight",), ("w",)),
    "as a submodule": (_as_submodule_inited, ("weight",), ("enc.weight",)),
    "unregistered, nn.init.zeros_": (_init_unregistered, ("bias",), ()),
    "unregistered, reset_parameters()": (_reset_the_first, ("weight", "bias"), ()),
}


@pytest.mark.parametrize("first_first", [True, False], ids=["enc-first", "dec-first"])
@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(SECOND_BUILD_WRITES))
def test_a_second_build_writing_the_first_builds_tensor_refuses_it(
    idiom, include_buffers, first_first
):
    second, enc_names, dec_names = SECOND_BUILD_WRITES[idiom]
    (enc, dec), (eager_enc, eager_dec) = _two_builds(second, include_buffers)
    order = [(enc, eager_enc, enc_names), (dec, eager_dec, dec_names)]
    for model, ref, names in order if first_first else order[::-1]:
        if names:
            assert_refused(model, *names, because="a later replayable build wrote it")
        else:
            materialize_exactly(model, ref)


@pytest.mark.parametrize("first_first", [True, False], ids=["enc-first", "dec-first"])
@pytest.mark.parametrize("include_buffers", MODES)
def test_a_tie_across_builds_stays_one_tensor_in_either_order(include_buffers, first_first):
    (enc, dec), (eager_enc, eager_dec) = _two_builds(_tie, include_buffers)
    pairs = [(enc, eager_enc), (dec, eager_dec)]
    for model, ref in pairs if first_first else pairs[::-1]:
        materialize_exactly(model, ref)
    assert dec.w is enc.weight


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_third_build_tying_the_tie_materializes_first(include_buffers):
    (enc, dec), (eager_enc, eager_dec) = _two_builds(_tie, include_buffers)
    torch.manual_seed(1)
    third_ref = nn.Module()
    third_ref.w = eager_dec.w
    third_ref.l = nn.Linear(2, 2)
    torch.manual_seed(1)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        third = nn.Module()
        third.w = dec.w
        third.l = nn.Linear(2, 2)
    for model, ref in [(third, third_ref), (dec, eager_dec), (enc, eager_enc)]:
        materialize_exactly(model, ref)
    assert third.w is enc.weight


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_tie_written_after_both_blocks_is_refused_in_both(include_buffers):
    (enc, dec), _ = _two_builds(_tie, include_buffers)
    with torch.no_grad():
        enc.weight.zero_()
    assert_refused(dec, "w", because="written after its empty_weights block")
    assert_refused(enc, "weight", because="written after its empty_weights block")


# == 5. casts after the block, argument types ===================================================


def _linear_and_norm() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))


def _data_double(m: nn.Module) -> None:
    m[0].weight.data = m[0].weight.data.double()


CASTS = {
    "half()": lambda m: m.half(),
    "to(dtype=float64)": lambda m: m.to(dtype=torch.float64),
    "bfloat16() then float()": lambda m: m.bfloat16().float(),
    "p.data = p.data.double()": _data_double,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("cast", sorted(CASTS))
def test_a_cast_after_the_block_is_refused(cast, include_buffers):
    model = build_empty(_linear_and_norm, include_buffers)
    CASTS[cast](model)
    assert_refused(model, "0.weight", because="memory was replaced after the block, in place")


NO_OP_CASTS = {
    "float()": lambda m: m.float(),
    "to(float32)": lambda m: m.to(torch.float32),
    "requires_grad_(False)": lambda m: m.requires_grad_(False),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("cast", sorted(NO_OP_CASTS))
def test_a_cast_that_changes_nothing_stays_exact(cast, include_buffers):
    ref = build_eagerly(_linear_and_norm)
    NO_OP_CASTS[cast](ref)
    model = build_empty(_linear_and_norm, include_buffers)
    NO_OP_CASTS[cast](model)
    materialize_exactly(model, ref)


class _Dim(enum.IntEnum):
    A = 3
    B = 4


class _Flag(enum.IntFlag):
    X = 2


class _Float(float):
    pass


class _Name(str):
    pass


class _Attributed(int):
    pass


_WITH_ATTRIBUTES = _Attributed(2)
_WITH_ATTRIBUTES.extra = [1]  # type: ignore[attr-defined]
_Shape = collections.namedtuple("_Shape", "h w")


class _SizeTuple(tuple):
    pass


def _int_enum(m: nn.Module) -> None:
    m.register_buffer("z", torch.zeros(_Dim.A, _Dim.B))
    m.p = nn.Parameter(torch.full((_Dim.A,), _Dim.B, dtype=torch.float32))
    m.l = nn.Linear(_Dim.A, _Dim.B)


def _namedtuple_shapes(m: nn.Module) -> None:
    m.register_buffer("z", torch.zeros(_Shape(2, 3)))
    m.q = nn.Parameter(torch.empty(_Shape(2, 2)).normal_())


def _numpy_sizes(m: nn.Module) -> None:
    m.register_buffer("z", torch.zeros(np.int64(3), np.int32(2)))
    m.p = nn.Parameter(torch.empty(np.int64(4)).normal_())
    m.q = nn.Parameter(torch.full((2,), np.float32(0.25)))


ARGUMENTS: dict[str, Callable[[nn.Module], None]] = {
    "IntEnum sizes and fill": _int_enum,
    "IntFlag": lambda m: (
        m.register_buffer("z", torch.arange(_Flag.X * 3)),
        setattr(m, "p", nn.Parameter(torch.randn(_Flag.X))),
    ),
    "float subclass fill": lambda m: m.register_buffer("f", torch.full((2,), _Float(0.5))),
    "str subclass nonlinearity": lambda m: (
        setattr(m, "p", nn.Parameter(torch.empty(3, 3))),
        nn.init.kaiming_uniform_(m.p, nonlinearity=_Name("relu")),
    ),
    "int subclass with attributes": lambda m: m.register_buffer("z", torch.zeros(_WITH_ATTRIBUTES)),
    "namedtuple shapes": _namedtuple_shapes,
    "numpy scalar sizes and fill": _numpy_sizes,
}
ARGUMENTS_BROKEN: dict[str, str] = {}


@pytest.mark.parametrize(
    ("idiom", "include_buffers"),
    [
        pytest.param(
            name,
            mode,
            marks=[_xfail(ARGUMENTS_BROKEN[name])] if name in ARGUMENTS_BROKEN and mode else [],
            id=f"{name}-{mode}",
        )
        for name in ARGUMENTS
        for mode in MODES
    ],
)
def test_captured_argument_types_are_exact(idiom, include_buffers):
    init = ARGUMENTS[idiom]
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_tuple_subclass_size_is_exact_or_refused_naming_its_type(include_buffers):
    def init(m: nn.Module) -> None:
        m.register_buffer("z", torch.zeros(_SizeTuple((2, 2))))

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    assert_exact_or_refused(model, ref, "z", because="_SizeTuple")


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_random_call_with_a_numpy_scalar_size_builds(include_buffers):
    def init(m: nn.Module) -> None:
        m.p = nn.Parameter(torch.randn(np.int64(4)))

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    materialize_exactly(model, ref)
