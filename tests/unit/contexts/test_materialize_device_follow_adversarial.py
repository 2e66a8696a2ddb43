"""A break-it pass on the follow of a meta tensor's ``.device`` (``recording/branches.py``):
where the read value goes in the build's source, and whether that use may tell the CPU apart.

The contract: eager construction sees ``cpu`` where the replayable build sees ``meta``. A build
whose code branches on that difference is refused upfront; ``materialize`` is never silently
different from eager construction under the same seed. A read used only to place new tensors,
or compared so that meta and the CPU answer alike, changes nothing: the build stays exact, and
the follow never makes a build raise that a plain meta build does not.

Three tables, each run in both modes (``include_buffers`` False and True):

* ``BRANCHING``: the device reaches a branch the follow may miss or misjudge (a ``for`` target,
  ``global``/``nonlocal``, a class given the device, a decorated or ``*args`` helper, a third
  helper level, a comparison with a value bound after the read, a multi-line attribute chain,
  a comparison whose other side has a side effect...). Each must be exact or refused.
* ``SOURCELESS``: the same branch in code whose source the follow cannot read as it ran
  (``exec``, a module file deleted or edited after import) or reads past its budget (a long
  function). Each must be exact or refused.
* ``PLACING``: the device only places, or is compared so that meta and the CPU agree, in forms
  the follow may over-refuse or crash on. Each must be exact.

A case that breaks the promise is a strict xfail saying what happens (silently wrong, or an
over-refusal); a crash is left failing. Every interpreter runs them, since the follow maps the
reading instruction to the source position each Python version compiles its own way.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    assert_eager_equal,
    assert_exact_or_refused,
    build_eagerly,
    build_empty,
    load_probe,
    mode_cases,
)

pytestmark = pytest.mark.per_interpreter

_CPU = torch.device("cpu")


class Probe(nn.Module):
    """A layer, a buffer, a layer, then ``probe(self)``, then a tail layer (whose values an
    extra random draw in the probe shifts)."""

    def __init__(self, probe: Callable[[nn.Module], object]) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("buf", torch.randn(3))
        self.out = nn.Linear(3, 3)
        self.asked = 0
        probe(self)
        self.tail = nn.Linear(3, 3)

    @property
    def device_type(self) -> str:
        return self.fc.weight.device.type

    @property
    def other_kind(self) -> str:
        """A property with a side effect: counts how often it is read."""
        self.asked += 1
        return "cuda"


def _double(m: nn.Module) -> None:
    with torch.no_grad():
        m.fc.weight.mul_(2.0)


def _draw(m: nn.Module) -> None:
    torch.rand(1)


# -- helpers real code routes a device through ----------------------------------------------


def _is_cpu_with_a_local(device: torch.device) -> bool:
    cpu = torch.device("cpu")
    return device == cpu


def _is_cpu_3(device: torch.device) -> bool:
    return device.type == "cpu"


def _is_cpu_2(device: torch.device) -> bool:
    return _is_cpu_3(device)


def _is_cpu_1(device: torch.device) -> bool:
    return _is_cpu_2(device)


def _is_cpu_0(device: torch.device) -> bool:
    return _is_cpu_1(device)


@functools.lru_cache(maxsize=8)
def _is_cpu_cached(device: torch.device) -> bool:
    return device.type == "cpu"


def _passes_through(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


@_passes_through
def _is_cpu_decorated(device: torch.device) -> bool:
    return device.type == "cpu"


def _any_on_cpu(*devices: torch.device) -> bool:
    return any(d.type == "cpu" for d in devices)


def _on_cpu_by_keyword(**kwargs) -> bool:
    return kwargs["device"].type == "cpu"


# two functions compiled from one line: the follow cannot tell which one runs
_is_cpu_l, _is_cuda_l = (lambda d: d.type == "cpu"), (lambda d: d.type == "cuda")


async def _on_cpu_async(device: torch.device) -> bool:
    return device.type == "cpu"


def _run(coroutine) -> object:
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the coroutine awaited")


def _devices(module: nn.Module):
    for p in module.parameters():
        yield p.device


def _returned_through(m: nn.Module, frames: int) -> torch.device:
    """The weight's device, returned through ``frames`` calls of this function."""
    return m.fc.weight.device if frames == 1 else _returned_through(m, frames - 1)


class _Scales:
    def scale_for(self, device: torch.device) -> float:
        return 2.0 if device.type == "cpu" else 1.0


class _ScalesOnward(_Scales):
    def scale_for(self, device: torch.device) -> float:
        return super().scale_for(device)


class _FactoryKwargsLayer(nn.Module):
    """A layer taking torch's ``device=`` factory keyword, built in fp64 on the CPU."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        on_cpu = device is not None and torch.device(device).type == "cpu"
        dtype = torch.float64 if on_cpu else torch.float32
        self.weight = nn.Parameter(torch.ones(3, device=device, dtype=dtype))


def _compare_where(m: nn.Module) -> None:
    if m.where.type == "cpu":
        _double(m)


_SEEN_DEVICE: torch.device | None = None


def _store_globally(m: nn.Module) -> None:
    global _SEEN_DEVICE
    _SEEN_DEVICE = m.fc.weight.device


def _compare_globally(m: nn.Module) -> None:
    if _SEEN_DEVICE.type == "cpu":
        _double(m)


# -- 1. branching: eager construction does something else -----------------------------------


def _local_equal_to_a_constructed_cpu(m: nn.Module) -> None:
    device = m.fc.weight.device
    if device == torch.device("cpu"):
        _double(m)


def _peft_is_cpu(m: nn.Module) -> None:
    """PEFT's ``dequantize_module_weight`` (peft/utils/integrations.py:107-110)."""
    device = m.fc.weight.device
    is_cpu = device.type == torch.device("cpu").type
    if is_cpu:
        _double(m)


def _compared_with_a_local_bound_after_the_read(m: nn.Module) -> None:
    device = m.fc.weight.device
    target = "cpu"
    if device.type == target:
        _double(m)


def _compared_with_a_local_rebound_after_the_read(m: nn.Module) -> None:
    kind = "cuda"
    device_type = m.fc.weight.device.type
    kind = "cpu"
    if device_type == kind:
        _double(m)


def _compared_with_a_conditional_through_a_local(m: nn.Module) -> None:
    device = m.fc.weight.device
    if device.type == ("cpu" if m.training else "cuda"):
        _double(m)


def _torch_device_of_a_local(m: nn.Module) -> None:
    device = m.fc.weight.device
    if torch.device(device) == torch.device("cpu"):
        _double(m)


def _for_over_a_tuple(m: nn.Module) -> None:
    for device in (m.fc.weight.device,):
        if device.type == "cpu":
            _double(m)


def _subscript_store(m: nn.Module) -> None:
    config: dict = {}
    config["device"] = m.fc.weight.device
    if config["device"].type == "cpu":
        _double(m)


def _attribute_compared_in_another_function(m: nn.Module) -> None:
    m.where = m.fc.weight.device
    _compare_where(m)


def _global_compared_in_another_function(m: nn.Module) -> None:
    global _SEEN_DEVICE
    _store_globally(m)
    _compare_globally(m)
    _SEEN_DEVICE = None


def _nonlocal(m: nn.Module) -> None:
    device = None

    def grab() -> None:
        nonlocal device
        device = m.fc.weight.device

    grab()
    if device.type == "cpu":
        _double(m)


def _match_a_local_against_a_class_pattern(m: nn.Module) -> None:
    device = m.fc.weight.device
    match device:
        case torch.device(type="cpu"):
            _double(m)
        case _:
            pass


def _match_capture_then_compared(m: nn.Module) -> None:
    match m.fc.weight.device.type:
        case "cuda":
            pass
        case other:
            if other == "cpu":
                _double(m)


def _with_statement(m: nn.Module) -> None:
    with contextlib.nullcontext(m.fc.weight.device) as device:
        if device.type == "cpu":
            _double(m)


def _walrus_in_a_comprehension(m: nn.Module) -> None:
    [(device := p.device) for p in m.parameters()]
    if device.type == "cpu":
        _double(m)


def _lambda_default(m: nn.Module) -> None:
    on_cpu = lambda d=m.fc.weight.device: d.type == "cpu"  # noqa: E731
    if on_cpu():
        _double(m)


def _try_except_compares(m: nn.Module) -> None:
    try:
        device = m.fc.weight.device
        raise LookupError
    except LookupError:
        if device.type == "cpu":
            _double(m)


def _named_parameters_loop(m: nn.Module) -> None:
    for name, p in m.named_parameters():
        if name == "fc.weight" and p.device.type == "cpu":
            _double(m)


def _super_call(m: nn.Module) -> None:
    factor = _ScalesOnward().scale_for(m.fc.weight.device)
    with torch.no_grad():
        m.fc.weight.mul_(factor)


def _multi_line_chain(m: nn.Module) -> None:
    # fmt: off
    if (
        m.fc.weight
        .device.type == "cpu"
    ):
        _double(m)
    # fmt: on


def _backslash_continuation(m: nn.Module) -> None:
    # fmt: off
    if m.fc.weight.device.type \
            == "cpu":
        _double(m)
    # fmt: on


def _nested_f_string(m: nn.Module) -> None:
    if f"{f'{m.fc.weight.device}'}" == "cpu":
        _double(m)


def _side_effect_of_the_follow(m: nn.Module) -> None:
    """The comparison reads a property once in eager construction; does the follow read it
    again?"""
    if m.fc.weight.device.type == m.other_kind:
        _draw(m)
    m.register_buffer("asks", torch.tensor(float(m.asked)))


def _follow_calls_a_looked_up_method(m: nn.Module) -> None:
    seen: dict[str, list] = {"meta": [], "cpu": [], "cuda": []}
    seen.get(m.fc.weight.device.type, []).append("fc")
    m.register_buffer("seen", torch.tensor(float(sum(len(names) for names in seen.values()))))


def _membership_in_supported_types(m: nn.Module) -> None:
    """transformers/integrations/moe.py:448 keys on ``.type in ("cpu", "mps")``; one that
    lists the CPU and CUDA both tells meta from both."""
    if m.fc.weight.device.type in ("cpu", "cuda"):
        _double(m)


def _accelerator_module(m: nn.Module) -> None:
    """transformers/integrations/fp_quant.py:53: ``getattr(torch, device.type, ...)``."""
    if getattr(torch, m.fc.weight.device.type, None) is not None:
        _double(m)


def _str_of_a_local_startswith(m: nn.Module) -> None:
    device = m.fc.weight.device
    if str(device).startswith("cpu"):
        _double(m)


BRANCHING: dict[str, Callable[[nn.Module], object]] = {
    # compared with something not evaluated where the device is read
    "local == torch.device('cpu')": _local_equal_to_a_constructed_cpu,
    "PEFT is_cpu = type == torch.device('cpu').type (integrations.py:108)": _peft_is_cpu,
    "compared with a local bound after the read": _compared_with_a_local_bound_after_the_read,
    "compared with a local rebound after the read": (_compared_with_a_local_rebound_after_the_read),
    "local .type == ('cpu' if flag else 'cuda')": _compared_with_a_conditional_through_a_local,
    "torch.device(local) == torch.device('cpu')": _torch_device_of_a_local,
    "torch.device(w.device) == torch.device('cpu')": lambda m: (
        _double(m) if torch.device(m.fc.weight.device) == torch.device("cpu") else None
    ),
    "type == ('cpu' if flag else 'cuda')": lambda m: (
        _double(m) if m.fc.weight.device.type == ("cpu" if m.training else "cuda") else None
    ),
    "helper comparing with its own local": lambda m: (
        _double(m) if _is_cpu_with_a_local(m.fc.weight.device) else None
    ),
    # where the device travels
    "helper comparing, three levels deep": lambda m: (
        _double(m) if _is_cpu_1(m.fc.weight.device) else None
    ),
    "returned through five functions": lambda m: (
        _double(m) if _returned_through(m, 5).type == "cpu" else None
    ),
    "helper comparing, four levels deep": lambda m: (
        _double(m) if _is_cpu_0(m.fc.weight.device) else None
    ),
    "returned through nine functions": lambda m: (
        _double(m) if _returned_through(m, 9).type == "cpu" else None
    ),
    "for over a tuple of one device": _for_over_a_tuple,
    "stored by subscript, config['device']": _subscript_store,
    "self.where compared in another function": _attribute_compared_in_another_function,
    "global, compared in another function": _global_compared_in_another_function,
    "nonlocal": _nonlocal,
    "with nullcontext(device) as device": _with_statement,
    "walrus inside a comprehension": _walrus_in_a_comprehension,
    "lambda default d=w.device": _lambda_default,
    "try/except, compared in the except branch": _try_except_compares,
    "named_parameters() loop": _named_parameters_loop,
    "generator yielding p.device": lambda m: (
        _double(m) if next(_devices(m)).type == "cpu" else None
    ),
    "property on the module, .type returned": lambda m: (
        _double(m) if m.device_type == "cpu" else None
    ),
    "class given device= (factory keyword)": lambda m: setattr(
        m, "extra", _FactoryKwargsLayer(device=m.fc.weight.device)
    ),
    "method calling super() with the device": _super_call,
    "lru_cache'd helper": lambda m: _double(m) if _is_cpu_cached(m.fc.weight.device) else None,
    "decorated (functools.wraps) helper": lambda m: (
        _double(m) if _is_cpu_decorated(m.fc.weight.device) else None
    ),
    "*args helper": lambda m: _double(m) if _any_on_cpu(m.fc.weight.device) else None,
    "**kwargs helper": lambda m: (
        _double(m) if _on_cpu_by_keyword(device=m.fc.weight.device) else None
    ),
    "two lambdas defined on one line": lambda m: (
        _double(m) if _is_cpu_l(m.fc.weight.device) else None
    ),
    # how it is compared
    "match a local against torch.device(type='cpu')": _match_a_local_against_a_class_pattern,
    "match capture, then compared": _match_capture_then_compared,
    "'{}'.format(device) == 'cpu'": lambda m: (
        _double(m) if "{}".format(m.fc.weight.device) == "cpu" else None  # noqa: UP032
    ),
    "'%s' % device == 'cpu'": lambda m: (
        _double(m) if "%s" % m.fc.weight.device == "cpu" else None  # noqa: UP031
    ),
    "type + ':0' == 'cpu:0'": lambda m: (
        _double(m) if m.fc.weight.device.type + ":0" == "cpu:0" else None
    ),
    "str(local).startswith('cpu')": _str_of_a_local_startswith,
    "async helper": lambda m: _double(m) if _run(_on_cpu_async(m.fc.weight.device)) else None,
    "str(device).split(':')[0] == 'cpu'": lambda m: (
        _double(m) if str(m.fc.weight.device).split(":")[0] == "cpu" else None
    ),
    "type in ('cpu', 'cuda')": _membership_in_supported_types,
    "getattr(torch, type, None) is not None (fp_quant.py:53)": _accelerator_module,
    # where the read is written
    "multi-line attribute chain": _multi_line_chain,
    "backslash continuation": _backslash_continuation,
    "nested f-string": _nested_f_string,
    # the follow's own side effects
    "a property the comparison reads": _side_effect_of_the_follow,
    "a method of a looked-up list": _follow_calls_a_looked_up_method,
}

_WRONG = "silently wrong: accepted, "
_DOUBLING = "; fc.weight lacks eager's doubling"
_NO_NODE = "the follow finds no expression for the read"


def _not_entered(what: str) -> str:
    return _WRONG + f"the follow does not go on through {what}" + _DOUBLING


BRANCHING_BROKEN: dict[str, str] = {
    "compared with a local rebound after the read": _WRONG + "the other side is evaluated "
    "when the device is read ('cuda', which meta matches as the CPU does not), and rebound to "
    "'cpu' before the comparison runs" + _DOUBLING,
    "helper comparing, four levels deep": _not_entered("a fourth Python helper"),
    "returned through nine functions": _not_entered(
        "a ninth calling frame a returned device goes back into"
    ),
    "self.where compared in another function": _not_entered(
        "an attribute of a module read in another function than the one that stored it"
    ),
    "with nullcontext(device) as device": _not_entered("a with statement's target"),
    "generator yielding p.device": _not_entered("a yield"),
    "method calling super() with the device": _not_entered("a call through super()"),
    "*args helper": _not_entered("a *args parameter"),
    "**kwargs helper": _not_entered("a **kwargs parameter"),
}


@pytest.mark.parametrize(("branch", "include_buffers"), mode_cases(BRANCHING, BRANCHING_BROKEN))
def test_a_device_branch_is_exact_or_refused(branch, include_buffers):
    def build() -> nn.Module:
        return Probe(BRANCHING[branch])

    ref = build_eagerly(build)
    assert_exact_or_refused(build_empty(build, include_buffers), ref)


# -- code whose source the follow cannot read as it ran ---------------------------------------

_BRANCHING_SOURCE = """\
def probe(m):
    if m.fc.weight.device.type == "cpu":
        double(m)
"""
# the same span (line 2, columns 7-25) holding a read that only places
_EDITED_SOURCE = """\
def probe(m):
    xy(m.fc.weight.device)
"""


def _from_exec() -> Callable[[nn.Module], object]:
    namespace = {"double": _double}
    exec(compile(_BRANCHING_SOURCE, "<generated>", "exec"), namespace)
    return namespace["probe"]


def _deleted(path: Path) -> Callable[[nn.Module], object]:
    path.write_text(_BRANCHING_SOURCE)
    probe = load_probe(path, double=_double)
    path.unlink()
    linecache.checkcache(str(path))
    return probe


def _edited(path: Path) -> Callable[[nn.Module], object]:
    path.write_text(_BRANCHING_SOURCE)
    probe = load_probe(path, double=_double)
    path.write_text(_EDITED_SOURCE)
    linecache.checkcache(str(path))
    return probe


def _long(path: Path) -> Callable[[nn.Module], object]:
    """300 placing uses of the device, then (nested deeper) a branch on it."""
    lines = ["import torch", "", "def probe(m):", "    device = m.fc.weight.device"]
    lines += [f"    t{i} = torch.zeros(1, device=device)" for i in range(300)]
    lines += [
        "    with torch.no_grad():",
        "        if device.type == 'cpu':",
        "            double(m)",
    ]
    path.write_text("\n".join(lines) + "\n")
    return load_probe(path, double=_double)


SOURCELESS: dict[str, Callable[[Path], Callable[[nn.Module], object]]] = {
    "compiled by exec from a string": lambda path: _from_exec(),
    "module source deleted after import": _deleted,
    "module source edited after import": _edited,
    "a long function: the branch after 300 placing uses": _long,
}
SOURCELESS_BROKEN: dict[str, str] = {
    "compiled by exec from a string": _WRONG
    + "linecache has no lines for the code's file, so "
    + _NO_NODE
    + _DOUBLING,
    "module source deleted after import": _WRONG + "the file is gone, so " + _NO_NODE + _DOUBLING,
    "module source edited after import": _WRONG + "the follow parses the file as it is now, "
    "where the read's span holds a call that only places" + _DOUBLING,
}


@pytest.mark.parametrize(("made", "include_buffers"), mode_cases(SOURCELESS, SOURCELESS_BROKEN))
def test_a_device_branch_in_generated_code_is_exact_or_refused(made, include_buffers, tmp_path):
    probe = SOURCELESS[made](tmp_path / "generated_probe.py")

    def build() -> nn.Module:
        return Probe(probe)

    ref = build_eagerly(build)
    assert_exact_or_refused(build_empty(build, include_buffers), ref)


# -- 2. placing: meta and the CPU answer alike -----------------------------------------------


def _maybe_autocast(device_type: str, dtype: torch.dtype | None = None, enabled: bool = True):
    """transformers' ``maybe_autocast`` (transformers/utils/generic.py:227-253)."""
    if device_type == "meta":
        return contextlib.nullcontext()
    if torch.is_autocast_enabled(device_type) or enabled:
        return torch.autocast(device_type, dtype=dtype, enabled=enabled)
    return contextlib.nullcontext()


def _rotary_under_maybe_autocast(m: nn.Module) -> None:
    """transformers' nemotron layer norm (models/nemotron/modeling_nemotron.py:78)."""
    x = m.fc.weight
    with _maybe_autocast(device_type=x.device.type, enabled=False):
        freqs = torch.outer(torch.arange(3.0, device=x.device), torch.ones(3, device=x.device))
    m.register_buffer("cos", freqs.cos(), persistent=False)


def _rotary_under_maybe_autocast_positional(m: nn.Module) -> None:
    """transformers' decision transformer (modeling_decision_transformer.py:116)."""
    x = m.fc.weight
    with _maybe_autocast(x.device.type, enabled=False):
        freqs = torch.outer(torch.arange(3.0, device=x.device), torch.ones(3, device=x.device))
    m.register_buffer("cos", freqs.cos(), persistent=False)


def _shadowed_in_a_nested_function(m: nn.Module) -> None:
    device = m.fc.weight.device
    m.register_buffer("z", torch.zeros(3, device=device))

    def dtype_for(device: torch.device) -> torch.dtype:
        return torch.float64 if device.type == "cpu" else torch.float32

    m.register_buffer("grid", torch.linspace(0, 1, 3, dtype=dtype_for(torch.device("cpu"))))


def _shadowed_in_a_comprehension(m: nn.Module) -> None:
    device = m.fc.weight.device
    m.register_buffer("z", torch.zeros(3, device=device))
    kinds = [device.type for device in (_CPU,) if device.type == "cpu"]
    m.register_buffer("n", torch.tensor(float(len(kinds))))


def _rebound_before_the_comparison(m: nn.Module) -> None:
    device = m.fc.weight.device
    m.register_buffer("z", torch.zeros(3, device=device))
    device = torch.device("cpu")
    if device.type == "cpu":
        _double(m)


def _match_a_class_pattern_alike(m: nn.Module) -> None:
    match m.fc.weight.device:
        case torch.device(type="cuda"):
            _double(m)
        case _:
            pass


def _starred_and_augmented(m: nn.Module) -> None:
    first, *rest = m.fc.weight.device, m.out.weight.device
    count = 0
    count += len(rest)
    names = [str(first)]
    del first
    m.register_buffer("z", torch.zeros(count + len(names), device=rest[0]))


class _Registered:
    def __init_subclass__(cls, device: torch.device | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.device = device


def _class_keyword(m: nn.Module) -> None:
    class Placed(_Registered, device=m.fc.weight.device):
        pass

    m.register_buffer("z", torch.zeros(3, device=Placed.device))


def _format_spec_with_the_device(m: nn.Module) -> None:
    m.label = f"{'fc':>{len(m.fc.weight.device.type) * 0 + 4}}"


def _str_of_a_local_is_not_cuda(m: nn.Module) -> None:
    device = m.fc.weight.device
    if str(device) != "cuda":
        _double(m)


def _accelerator_type() -> str:
    """The accelerator a library would pick (``torch.accelerator`` or a fixed choice)."""
    return "cuda"


def _factory_kwargs(m: nn.Module) -> None:
    """torch's own ``factory_kwargs = {"device": device, "dtype": dtype}`` idiom."""
    factory_kwargs = {"device": m.fc.weight.device, "dtype": m.fc.weight.dtype}
    m.extra = nn.Linear(3, 3, **factory_kwargs)


PLACING: dict[str, Callable[[nn.Module], object]] = {
    "transformers maybe_autocast(device_type=x.device.type)": _rotary_under_maybe_autocast,
    "transformers maybe_autocast(x.device.type) positional": (
        _rotary_under_maybe_autocast_positional
    ),
    "a nested function's parameter shadows the device": _shadowed_in_a_nested_function,
    "a comprehension's variable shadows the device": _shadowed_in_a_comprehension,
    "the local rebound to the CPU before the comparison": _rebound_before_the_comparison,
    "match device: case torch.device(type='cuda')": _match_a_class_pattern_alike,
    "starred, augmented assignments and del": _starred_and_augmented,
    "the device as a class keyword": _class_keyword,
    "the device in a format spec": _format_spec_with_the_device,
    "factory_kwargs dict unpacked into a layer": _factory_kwargs,
    "str(local) != 'cuda'": _str_of_a_local_is_not_cuda,
    "type compared with a call giving 'cuda'": lambda m: (
        _double(m) if m.fc.weight.device.type == _accelerator_type() else None
    ),
}
_OVER = "over-refusal: refused, "
_FLOW = " (names are followed flow-insensitively, by spelling)"

OVER_REFUSED: dict[str, str] = {
    "the local rebound to the CPU before the comparison": _OVER + "the comparison reads the "
    "name after it is rebound to torch.device('cpu')" + _FLOW,
    "type compared with a call giving 'cuda'": _OVER + "a comparison with a call is refused "
    "where the device is read, though meta and the CPU compare alike with 'cuda'",
}


@pytest.mark.parametrize(("place", "include_buffers"), mode_cases(PLACING, OVER_REFUSED))
def test_a_device_used_to_place_is_exact(place, include_buffers):
    assert_eager_equal(lambda: Probe(PLACING[place]), include_buffers)
