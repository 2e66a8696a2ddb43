"""Reads of a meta tensor's ``.device`` in the build, in the forms real construction code
writes them.

The contract: eager construction sees ``cpu`` where the replayable build sees ``meta``. A read
whose answer may tell the CPU apart from other devices, and that the build branches on, is
refused upfront; ``materialize`` is never silently different from eager construction under
the same seed. A read used only to place new tensors beside a meta one, or compared so that
meta and the CPU answer alike, changes nothing, and the build stays exact.

Two tables, each run in both modes (``include_buffers`` False and True):

* ``BRANCHING``: the build reads a device and branches on it, so that eager construction does
  something to the values (doubles a weight, draws an extra random number, initialises a
  layer otherwise, picks another dtype, names a buffer otherwise) that the meta build does
  not. Each is exact or refused, never silently wrong.
* ``PLACING``: the device only places new tensors, or is compared where meta and the CPU
  answer alike. Each is exact or refused (a refusal there is an over-refusal, not a broken
  promise); ``OVER_REFUSED`` lists those refused, the rest must be exact.

A case that breaks the promise is a strict xfail saying what happens. The follow maps the
reading instruction to its source position, which each Python version compiles its own way,
so every interpreter runs them; pytest leaves this module's ``assert`` statements as the
interpreter compiles them (PYTEST_DONT_REWRITE).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_exact_or_refused,
    assert_refused,
    build_eagerly,
    build_empty,
    mode_cases,
)

pytestmark = pytest.mark.per_interpreter

CPU = "cpu"  # a module-level constant some code compares device types with
CPU_TYPES = frozenset({"cpu"})
_CPU = torch.device("cpu")
_CUDA = torch.device("cuda")


class Probe(nn.Module):
    """A layer, a buffer, a layer, then ``probe(self)``, then a tail layer (whose values an
    extra random draw in the probe shifts). ``device`` is transformers' property
    (``next(param.device for param in self.parameters())``)."""

    def __init__(self, probe: Callable[[nn.Module], object]) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("buf", torch.randn(3))
        self.out = nn.Linear(3, 3)
        probe(self)
        self.tail = nn.Linear(3, 3)

    @property
    def device(self) -> torch.device:
        return next(param.device for param in self.parameters())


# -- what eager construction does on its branch ---------------------------------------------


def _double(m: nn.Module) -> None:
    with torch.no_grad():
        m.fc.weight.mul_(2.0)


def _draw(m: nn.Module) -> None:
    """An extra random number: every tensor drawn after it (``tail``) is shifted."""
    torch.rand(1)


def _reinit(m: nn.Module) -> None:
    nn.init.constant_(m.out.bias, 0.5)


# -- helpers real code routes a device through ----------------------------------------------


def _type_is_cpu(device: torch.device) -> bool:
    return device.type == "cpu"


def _is_cpu_two_deep(device: torch.device) -> bool:
    return _type_is_cpu(device)


def _parameter_device(module: nn.Module) -> torch.device:
    """diffusers' ``get_parameter_device``: the first parameter's or buffer's device."""
    return next(itertools.chain(module.parameters(), module.buffers())).device


def _target_device_dtype(weight: torch.Tensor) -> tuple[torch.device, torch.dtype]:
    """PEFT's ``_get_adapter_target_device_dtype`` (peft/tuners/frod/layer.py:401): off the
    CPU, the weight's own device and dtype; on it, another (here float64)."""
    if weight.device.type != "cpu":
        return weight.device, weight.dtype
    return weight.device, torch.float64


class _CpuInitLinear(nn.Linear):
    """A layer whose ``reset_parameters`` scales its weight when built on the CPU."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        device = self.weight.device
        if device.type == "cpu":
            with torch.no_grad():
                self.weight.mul_(2.0)


# -- 1. branching: eager construction does something else to the values ----------------------


def _local_compared_in_a_loop(m: nn.Module) -> None:
    device = m.fc.weight.device
    for _ in range(2):
        if device.type == "cpu":
            _double(m)


def _loop_over_parameters(m: nn.Module) -> None:
    for p in m.parameters():
        if p.device.type == "cpu":
            _draw(m)
            break


def _devices_collected_in_a_loop(m: nn.Module) -> None:
    devices = []
    for p in m.parameters():
        devices.append(p.device)
    if devices[0].type == "cpu":
        _double(m)


def _ternary_then_compared(m: nn.Module) -> None:
    device = m.fc.weight.device if m.training else _CUDA
    if device.type == "cpu":
        _double(m)


def _ternary_compared_inline(m: nn.Module) -> None:
    if (m.fc.weight.device if m.training else _CUDA).type == "cpu":
        _double(m)


def _default_argument(m: nn.Module) -> None:
    def on_cpu(device: torch.device = m.fc.weight.device) -> bool:
        return device.type == "cpu"

    if on_cpu():
        _reinit(m)


def _property_compared(m: nn.Module) -> None:
    if m.device.type == "cpu":
        _double(m)


def _property_equal_to_cpu(m: nn.Module) -> None:
    if m.device == _CPU:
        _draw(m)


def _next_of_a_generator(m: nn.Module) -> None:
    if next(p.device for p in m.parameters()).type == "cpu":
        _double(m)


def _parameter_device_compared(m: nn.Module) -> None:
    if _parameter_device(m).type == "cpu":
        _double(m)


def _stored_on_self(m: nn.Module) -> None:
    m.where = m.fc.weight.device
    m.scale = 1.0
    if m.where.type == "cpu":
        _double(m)


def _stored_in_a_config_dict(m: nn.Module) -> None:
    m.config = {"device": m.fc.weight.device, "dim": 3}
    if m.config["device"].type == "cpu":
        _reinit(m)


def _unpacked_from_a_pair(m: nn.Module) -> None:
    device, dtype = m.fc.weight.device, m.fc.weight.dtype
    if device.type == "cpu" and dtype == torch.float32:
        _double(m)


def _closure(m: nn.Module) -> None:
    device = m.fc.weight.device

    def on_cpu() -> bool:
        return device.type == "cpu"

    if on_cpu():
        _double(m)


def _try_assert(m: nn.Module) -> None:
    try:
        assert m.fc.weight.device.type == "cpu"
    except AssertionError:
        pass
    else:
        _double(m)


def _match_a_class_pattern(m: nn.Module) -> None:
    match m.fc.weight.device:
        case torch.device(type="cpu"):
            _double(m)
        case _:
            pass


def _match_str(m: nn.Module) -> None:
    match str(m.fc.weight.device):
        case "cpu":
            _draw(m)
        case _:
            pass


def _isinstance_then_type(m: nn.Module) -> None:
    if isinstance(device := m.fc.weight.device, torch.device) and device.type == "cpu":
        _double(m)


def _module_to_otherwise(m: nn.Module) -> None:
    target = m.fc.weight.device
    if target != _CPU:
        m.out.to(target)
    else:
        m.out.double()


def _init_weights_applied(m: nn.Module) -> None:
    """A transformers-style ``_init_weights`` run through ``apply``, its std by device."""

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            device = module.weight.device
            std = 0.5 if device.type == "cpu" else 0.02
            nn.init.normal_(module.weight, std=std)

    m.apply(init)


def _peft_cast_to_fp32(m: nn.Module) -> None:
    """PEFT's ``get_delta_weight`` (peft/tuners/lora/layer.py:1056-1061): device and dtype
    read into locals, then ``cast_to_fp32 = device.type == "cpu" and (dtype ...)``."""
    device = m.fc.weight.device
    dtype = m.fc.weight.dtype
    cast_to_fp32 = device.type == "cpu" and dtype in (torch.float32, torch.float16)
    if cast_to_fp32:
        _double(m)


def _transformers_single_cpu_device(m: nn.Module) -> None:
    """transformers' flash-attention check (transformers/modeling_utils.py:1629-1630)."""
    param_devices = list({param.device for param in m.parameters()})
    if len(param_devices) == 1 and param_devices[0].type == "cpu":
        _double(m)


def _peft_target_device_dtype(m: nn.Module) -> None:
    device, dtype = _target_device_dtype(m.fc.weight)
    m.register_buffer("scale", torch.full((3,), 0.1, dtype=dtype, device=device))


def _reset_parameters_override(m: nn.Module) -> None:
    m.extra = _CpuInitLinear(3, 3)


def _any_over_a_set_of_devices(m: nn.Module) -> None:
    if any(d.type == "cpu" for d in {p.device for p in m.parameters()}):
        _double(m)


def _dispatch_by_type(m: nn.Module) -> None:
    inits = {"cpu": _double, "cuda": _reinit}
    inits.get(m.fc.weight.device.type, lambda _: None)(m)


def _flag_then_branch(m: nn.Module) -> None:
    on_cpu = m.fc.weight.device.type == "cpu"
    _reinit(m) if on_cpu else None


BRANCHING: dict[str, Callable[[nn.Module], object]] = {
    # where the device travels before it is compared
    "local compared in a loop": _local_compared_in_a_loop,
    "for p in parameters(): p.device.type == 'cpu'": _loop_over_parameters,
    "devices collected in a loop, [0].type": _devices_collected_in_a_loop,
    "ternary into a local, then compared": _ternary_then_compared,
    "ternary compared inline": _ternary_compared_inline,
    "default argument def f(device=w.device)": _default_argument,
    "self.device property (transformers), .type == 'cpu'": _property_compared,
    "self.device property == torch.device('cpu')": _property_equal_to_cpu,
    "next(p.device for p in parameters()).type": _next_of_a_generator,
    "diffusers' get_parameter_device(...).type": _parameter_device_compared,
    "helper comparing, two levels deep": lambda m: (
        _double(m) if _is_cpu_two_deep(m.fc.weight.device) else None
    ),
    "helper comparing, keyword argument": lambda m: (
        _reinit(m) if _type_is_cpu(device=m.fc.weight.device) else None
    ),
    "stored on self, compared later": _stored_on_self,
    "stored in a config dict": _stored_in_a_config_dict,
    "unpacked from a (device, dtype) pair": _unpacked_from_a_pair,
    "list of one device, [0] == cpu": lambda m: (
        _double(m) if [m.fc.weight.device][0] == _CPU else None
    ),
    "cpu in a tuple of devices": lambda m: (
        _double(m) if _CPU in (m.fc.weight.device, m.out.weight.device) else None
    ),
    "closure over a local device": _closure,
    "lambda applied to the device": lambda m: (
        _double(m) if (lambda d: d.type == "cpu")(m.fc.weight.device) else None
    ),
    "functools.partial(operator.eq, 'cpu')": lambda m: (
        _double(m) if functools.partial(operator.eq, "cpu")(m.fc.weight.device.type) else None
    ),
    "operator.eq(type, 'cpu')": lambda m: (
        _draw(m) if operator.eq(m.fc.weight.device.type, "cpu") else None
    ),
    "getattr(device, 'type') == 'cpu'": lambda m: (
        _double(m) if getattr(m.fc.weight.device, "type") == "cpu" else None  # noqa: B009
    ),
    # how it is compared
    "repr(device) == ...": lambda m: (
        _double(m) if repr(m.fc.weight.device) == "device(type='cpu')" else None
    ),
    "'cpu' in str(device)": lambda m: _double(m) if "cpu" in str(m.fc.weight.device) else None,
    "type.upper() == 'CPU'": lambda m: (
        _double(m) if m.fc.weight.device.type.upper() == "CPU" else None
    ),
    "type.endswith('pu')": lambda m: _double(m) if m.fc.weight.device.type.endswith("pu") else None,
    "type.__eq__('cpu')": lambda m: _double(m) if m.fc.weight.device.type.__eq__("cpu") else None,
    "type in {'cpu'} (a set literal)": lambda m: (
        _double(m) if m.fc.weight.device.type in {"cpu"} else None
    ),
    "type in 'cpu mps' (a substring)": lambda m: (
        _double(m) if m.fc.weight.device.type in "cpu mps" else None
    ),
    "type < 'cq' (ordered)": lambda m: _double(m) if m.fc.weight.device.type < "cq" else None,
    "len(type) == 3": lambda m: _double(m) if len(m.fc.weight.device.type) == 3 else None,
    "type[:3] == 'cpu'": lambda m: _double(m) if m.fc.weight.device.type[:3] == "cpu" else None,
    "torch.device(w.device).type (peft/tuners/adamss/utils.py:48)": lambda m: (
        _draw(m) if torch.device(m.fc.weight.device).type == "cpu" else None
    ),
    "type == a module-level constant": lambda m: (
        _double(m) if m.fc.weight.device.type == CPU else None
    ),
    "type in a module-level frozenset": lambda m: (
        _double(m) if m.fc.weight.device.type in CPU_TYPES else None
    ),
    "torch.device('cpu') == device (device on the right)": lambda m: (
        _double(m) if _CPU == m.fc.weight.device else None  # noqa: SIM300
    ),
    "'cpu' == type == 'cpu' (chained)": lambda m: (
        _double(m) if "cpu" == m.fc.weight.device.type == "cpu" else None
    ),
    "type == 'cpu' or a false flag": lambda m: (
        _double(m) if m.fc.weight.device.type == "cpu" or not m.training else None
    ),
    "comparison kept in a flag, branched later": _flag_then_branch,
    "try: assert type == 'cpu' / else": _try_assert,
    "match device: case torch.device(type='cpu')": _match_a_class_pattern,
    "match str(device): case 'cpu'": _match_str,
    "isinstance(device, torch.device) and .type": _isinstance_then_type,
    "hash(device) == hash(cpu)": lambda m: (
        _double(m) if hash(m.fc.weight.device) == hash(_CPU) else None
    ),
    "sorted({device, cuda}, key=str)[0] == cpu": lambda m: (
        _double(m) if sorted({m.fc.weight.device, _CUDA}, key=str)[0] == _CPU else None
    ),
    "any(...) over a set of devices": _any_over_a_set_of_devices,
    "dispatch table keyed by device type": _dispatch_by_type,
    # what else the device is read from, and what the branch changes
    "a buffer's device": lambda m: _double(m) if m.buf.device.type == "cpu" else None,
    "a computed tensor's device": lambda m: (
        _double(m) if (m.fc.weight * 2).device.type == "cpu" else None
    ),
    "w.data.device": lambda m: _double(m) if m.fc.weight.data.device.type == "cpu" else None,
    "module.to(device) or .double()": _module_to_otherwise,
    "_init_weights through apply, std by device": _init_weights_applied,
    "reset_parameters override": _reset_parameters_override,
    "PEFT cast_to_fp32 (peft/tuners/lora/layer.py:1061)": _peft_cast_to_fp32,
    "transformers single CPU device (modeling_utils.py:1630)": _transformers_single_cpu_device,
    "PEFT target device/dtype helper (frod/layer.py:402)": _peft_target_device_dtype,
    "device type in a buffer's name": lambda m: m.register_buffer(
        f"cache_{m.fc.weight.device.type}", torch.zeros(2)
    ),
    "len(str(device)) into a buffer": lambda m: m.register_buffer(
        "n", torch.tensor(len(str(m.fc.weight.device)))
    ),
}

_DOUBLING = "accepted, fc.weight lacks eager's doubling"
_NOT_ENTERED = "silently wrong: the follow does not enter "

# the forms the follow misses, and what each does
BRANCHING_BROKEN: dict[str, str] = {
    "devices collected in a loop, [0].type": _NOT_ENTERED + "a method of another object "
    "(list.append) the device is passed to; " + _DOUBLING,
    "functools.partial(operator.eq, 'cpu')": _NOT_ENTERED + "a functools.partial; " + _DOUBLING,
    "sorted({device, cuda}, key=str)[0] == cpu": _NOT_ENTERED + "a call with keywords "
    "(sorted(..., key=str)); " + _DOUBLING,
    "any(...) over a set of devices": _NOT_ENTERED + "a set comprehension; " + _DOUBLING,
    "transformers single CPU device (modeling_utils.py:1630)": _NOT_ENTERED + "a set "
    "comprehension; " + _DOUBLING,
}


@pytest.mark.parametrize(("branch", "include_buffers"), mode_cases(BRANCHING, BRANCHING_BROKEN))
def test_a_device_branch_is_exact_or_refused(branch, include_buffers):
    def build() -> nn.Module:
        return Probe(BRANCHING[branch])

    ref = build_eagerly(build)
    assert_exact_or_refused(build_empty(build, include_buffers), ref, "fc.weight")


# -- 2. placing: the device puts new tensors beside a meta one -------------------------------


def _ones_on(device: torch.device) -> torch.Tensor:
    return torch.ones(3, device=device)


def _ones_two_deep(device: torch.device) -> torch.Tensor:
    return _ones_on(device) * 2


_DTYPE_UNSUPPORTED_DEVICES = {torch.float64: {"mps"}}
_DTYPE_DOWNCAST = {torch.float64: torch.float32}


def _maybe_adjust_dtype_for_device(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """diffusers' ``maybe_adjust_dtype_for_device`` (diffusers/utils/torch_utils.py:56)."""
    unsupported = _DTYPE_UNSUPPORTED_DEVICES.get(dtype)
    return _DTYPE_DOWNCAST[dtype] if unsupported and device.type in unsupported else dtype


def _rope_inv_freq(m: nn.Module) -> None:
    """transformers' default RoPE (transformers/modeling_rope_utils.py:185)."""
    device = m.fc.weight.device
    inv_freq = 1.0 / (
        10000 ** (torch.arange(0, 6, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / 6)
    )
    m.register_buffer("inv_freq", inv_freq, persistent=False)


def _rotary_cache(m: nn.Module) -> None:
    """transformers' rotary forward (models/llama/modeling_llama.py, utils/generic.py:248):
    an autocast device type that is never "mps", and no autocast at all on meta."""
    x = m.fc.weight
    device_type = (
        x.device.type if isinstance(x.device.type, str) and x.device.type != "mps" else "cpu"
    )
    autocast = (
        contextlib.nullcontext()
        if device_type == "meta"
        else torch.autocast(device_type=device_type, enabled=False)
    )
    with autocast:
        freqs = torch.outer(torch.arange(4.0, device=x.device), torch.ones(3, device=x.device) / 7)
    m.register_buffer("cos", freqs.cos(), persistent=False)


def _diffusers_dtype(m: nn.Module) -> None:
    dtype = _maybe_adjust_dtype_for_device(torch.float64, m.fc.weight.device)
    m.register_buffer("grid", torch.linspace(0, 1, 5, dtype=dtype))


def _fused_only_on_cuda(m: nn.Module) -> None:
    use_fused = m.fc.weight.device.type in ("cuda", "xpu")
    m.register_buffer("table", torch.arange(3.0) * (3.0 if use_fused else 0.5))


def _default_argument_places(m: nn.Module) -> None:
    def make(n: int, device: torch.device = m.fc.weight.device) -> torch.Tensor:
        return torch.ones(n, device=device)

    m.register_buffer("z", make(3))


def _cache_keyed_by_device(m: nn.Module) -> None:
    cache: dict = {}
    key = (m.fc.weight.device, m.fc.weight.dtype)
    if key not in cache:
        cache[key] = torch.arange(3, device=key[0], dtype=key[1])
    m.register_buffer("cached", cache[key])


def _compared_with_a_stored_meta_device(m: nn.Module) -> None:
    m.first = m.fc.weight.device
    if m.out.weight.device != m.first:
        _double(m)


PLACING: dict[str, Callable[[nn.Module], object]] = {
    "RoPE inv_freq .to(device=w.device)": _rope_inv_freq,
    "rotary cache under a no-op autocast": _rotary_cache,
    "zeros(device=str(w.device))": lambda m: m.register_buffer(
        "z", torch.zeros(3, device=str(m.fc.weight.device))
    ),
    "zeros(device=torch.device(type, index))": lambda m: m.register_buffer(
        "z", torch.zeros(3, device=torch.device(m.fc.weight.device.type, m.fc.weight.device.index))
    ),
    "nn.Linear(3, 3, device=w.device)": lambda m: setattr(
        m, "extra", nn.Linear(3, 3, device=m.fc.weight.device)
    ),
    "nn.Linear(3, 3).to(w.device)": lambda m: setattr(
        m, "extra", nn.Linear(3, 3).to(m.fc.weight.device)
    ),
    "module.to(device=w.device, dtype=w.dtype)": lambda m: m.out.to(
        device=m.fc.weight.device, dtype=m.fc.weight.dtype
    ),
    "helper placing with the device": lambda m: m.register_buffer(
        "z", _ones_on(m.fc.weight.device)
    ),
    "helper placing, two levels deep": lambda m: m.register_buffer(
        "z", _ones_two_deep(m.fc.weight.device)
    ),
    "get_parameter_device(...) places": lambda m: m.register_buffer(
        "z", torch.ones(3, device=_parameter_device(m))
    ),
    "self.device property places": lambda m: m.register_buffer(
        "z", torch.arange(3.0, device=m.device)
    ),
    "default argument places": _default_argument_places,
    "diffusers maybe_adjust_dtype_for_device": _diffusers_dtype,
    "type == 'cuda' picks a dtype": lambda m: m.register_buffer(
        "z",
        torch.full(
            (3,),
            0.1,
            dtype=torch.bfloat16 if m.fc.weight.device.type == "cuda" else torch.float32,
        ),
    ),
    "type in ('cuda', 'xpu') kept in a flag": _fused_only_on_cuda,
    "device.index or 0": lambda m: m.register_buffer(
        "z", torch.full((2,), float(m.fc.weight.device.index or 0))
    ),
    "isinstance(device, torch.device)": lambda m: (
        _double(m) if isinstance(m.fc.weight.device, torch.device) else None
    ),
    "hasattr(device, 'type')": lambda m: (
        _double(m) if hasattr(m.fc.weight.device, "type") else None
    ),
    "device formatted into an attribute": lambda m: setattr(
        m, "placement", f"built on {m.fc.weight.device!r}"
    ),
    "cache keyed by (device, dtype)": _cache_keyed_by_device,
    "uniform_ into empty(device=w.device)": lambda m: setattr(
        m,
        "gate",
        nn.Parameter(nn.init.uniform_(torch.empty(3, device=m.fc.weight.device), -0.1, 0.1)),
    ),
    "new_tensor(device=w.device)": lambda m: m.register_buffer(
        "z", m.fc.weight.new_tensor([1.0, 2.0], device=m.fc.weight.device)
    ),
    "compared with a meta device stored on self": _compared_with_a_stored_meta_device,
}

# placing idioms metamode refuses (an over-refusal: exact is what they should be)
OVER_REFUSED: dict[str, str] = {}


@pytest.mark.parametrize(("place", "include_buffers"), mode_cases(PLACING, {}))
def test_a_device_used_to_place_is_exact_or_refused(place, include_buffers):
    def build() -> nn.Module:
        return Probe(PLACING[place])

    ref = build_eagerly(build)
    assert_exact_or_refused(build_empty(build, include_buffers), ref)


@pytest.mark.parametrize(("place", "include_buffers"), mode_cases(PLACING, OVER_REFUSED))
def test_a_device_used_to_place_is_exact(place, include_buffers):
    assert_eager_equal(lambda: Probe(PLACING[place]), include_buffers)


class _LazyRead(nn.Module):
    """A lazy layer's uninitialised weight, whose device the build branches on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.lazy = nn.LazyLinear(3)
        if self.lazy.weight.device.type == "cpu":
            _double(self)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_branch_on_a_lazy_weights_device_is_refused_naming_it(include_buffers):
    model = build_empty(_LazyRead, include_buffers)
    assert_refused(model, "fc.weight", because=r"lazy module's uninitialised tensor.*compared")
