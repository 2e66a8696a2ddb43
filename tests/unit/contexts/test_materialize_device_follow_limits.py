"""A break-it pass on the newest reaches of the ``.device`` follow (``recording/branches.py``,
``recording/source.py``): iteration over displays, ``global``/``nonlocal`` names, ``self.x``
read in other methods, ``table[key]`` read back, ``match`` captures, a helper's locals
evaluated as written, lambdas sharing a line, the helper and return-frame limits, attribute
reads that must run none of the build's code, and the follow's own termination.

The contract: eager construction sees ``cpu`` where the replayable build sees ``meta``. A build
whose code branches on that difference is refused upfront; ``materialize`` is never silently
different from eager construction under the same seed. Following a read changes nothing: it
runs none of the build's code (each probe here counts the program's own calls into a buffer,
``calls_seen``, so a follow that runs them makes ``materialize`` differ from eager), and it
never makes a build raise that a plain meta build does not.

Three tables, each run in both modes (``include_buffers`` False and True):

* ``BRANCHING``: the device reaches a branch that tells the CPU apart. Each must be exact or
  refused.
* ``SIDE_EFFECTS``: the device is compared with, or passed beside, an object of the program's
  whose methods count their calls; meta and the CPU answer alike. Each must be exact (the
  count as eager's) or refused.
* ``PLACING``: the device only places, or is compared so that meta and the CPU agree, beside
  objects whose methods raise for a device the build never sees, or through long chains. Each
  must be exact.

A case that breaks the promise is a strict xfail saying what happens (silently wrong, or an
over-refusal); a crash is left failing. Every interpreter runs them, since the follow maps the
reading instruction to the source position each Python version compiles its own way.
"""

from __future__ import annotations

import collections
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

_CPU_NAME = "cpu"


class Probe(nn.Module):
    """A layer, a buffer, a layer, then ``probe(self)``, then the program's call count as a
    buffer, then a tail layer (whose values an extra random draw in the probe shifts)."""

    def __init__(self, probe: Callable[[nn.Module], object]) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("buf", torch.randn(3))
        self.out = nn.Linear(3, 3)
        self.calls = 0
        probe(self)
        self.register_buffer("calls_seen", torch.tensor(float(self.calls)))
        self.tail = nn.Linear(3, 3)


def _double(m: nn.Module) -> None:
    with torch.no_grad():
        m.fc.weight.mul_(2.0)


def _accelerator() -> torch.device:
    return torch.device("cuda")


# -- 1. iteration over displays ----------------------------------------------------------------


def _for_enumerate(m: nn.Module) -> None:
    for _, device in enumerate((m.fc.weight.device,)):
        if device.type == "cpu":
            _double(m)


def _for_over_a_set_display(m: nn.Module) -> None:
    for device in {m.fc.weight.device}:
        if device.type == "cpu":
            _double(m)


def _for_over_a_display_with_a_call(m: nn.Module) -> None:
    for device in (m.fc.weight.device, _accelerator()):
        if device.type == "cpu":
            _double(m)


def _generator_over_a_display(m: nn.Module) -> None:
    if any(device.type == "cpu" for device in (m.fc.weight.device,)):
        _double(m)


def _list_comprehension_filter(m: nn.Module) -> None:
    if [device for device in (m.fc.weight.device,) if device.type == "cpu"]:
        _double(m)


def _for_unpacking_pairs(m: nn.Module) -> None:
    for device, dtype in ((m.fc.weight.device, m.fc.weight.dtype),):
        if device.type == "cpu" and dtype == torch.float32:
            _double(m)


def _nested_for(m: nn.Module) -> None:
    for pair in ((m.fc.weight.device,),):
        for device in pair:
            if device.type == "cpu":
                _double(m)


# -- 2. global and nonlocal names ------------------------------------------------------------


def _nonlocal_two_scopes_up(m: nn.Module) -> None:
    device = None

    def middle() -> None:
        def inner() -> None:
            nonlocal device
            device = m.fc.weight.device

        inner()

    middle()
    if device.type == "cpu":
        _double(m)


_STORED: torch.device | None = None


def _global_then_local_of_that_name(m: nn.Module) -> None:
    """Stores a global; another function, run after, compares a local spelt alike."""
    global _STORED
    _STORED = m.fc.weight.device
    m.register_buffer("z", torch.zeros(3, device=_STORED))
    _STORED = None
    _own_local_compared(m)


def _own_local_compared(m: nn.Module) -> None:
    _STORED = torch.device("cpu")
    if _STORED.type == "cpu":
        m.register_buffer("w", torch.ones(2))


# -- 3. self.x read in other methods ----------------------------------------------------------


class _Checks(nn.Module):
    """A mixin whose method compares what its subclass stored."""

    def _scale_if_on_cpu(self) -> None:
        if self.where.type == "cpu":
            _double(self)


def _front(module: nn.Module) -> None:
    module.fc = nn.Linear(3, 3)
    module.register_buffer("buf", torch.randn(3))
    module.out = nn.Linear(3, 3)


class _ReadByTheBase(_Checks):
    def __init__(self) -> None:
        super().__init__()
        _front(self)
        self.where = self.fc.weight.device
        self._scale_if_on_cpu()
        self.tail = nn.Linear(3, 3)


class _Stored(nn.Module):
    """Stores ``self.where``, then leaves its use to a subclass."""

    def __init__(self) -> None:
        super().__init__()
        _front(self)
        self.where = self.fc.weight.device
        self.use()
        self.tail = nn.Linear(3, 3)

    def use(self) -> None:
        pass


class _ReadByASubclass(_Stored):
    def use(self) -> None:
        if self.where.type == "cpu":
            _double(self)


class _ReadByAProperty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        _front(self)
        self.where = self.fc.weight.device
        if self.on_cpu:
            _double(self)
        self.tail = nn.Linear(3, 3)

    @property
    def on_cpu(self) -> bool:
        return self.where.type == "cpu"


class _ReadByGetattr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        _front(self)
        self.where = self.fc.weight.device
        if getattr(self, "where").type == "cpu":  # noqa: B009
            _double(self)
        self.tail = nn.Linear(3, 3)


class _ReadFromATable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        _front(self)
        self.cfg = {"device": self.fc.weight.device}
        self._compare_cfg()
        self.tail = nn.Linear(3, 3)

    def _compare_cfg(self) -> None:
        if self.cfg["device"].type == "cpu":
            _double(self)


# -- 4. table[key] read back ------------------------------------------------------------------


def _key_in_a_variable(m: nn.Module) -> None:
    config: dict = {}
    key = "device"
    config[key] = m.fc.weight.device
    if config["device"].type == "cpu":
        _double(m)


def _read_back_by_get(m: nn.Module) -> None:
    config: dict = {}
    config["device"] = m.fc.weight.device
    if config.get("device").type == "cpu":
        _double(m)


def _device_type_as_a_key(m: nn.Module) -> None:
    scales = {"cpu": 2.0, "meta": 1.0, "cuda": 1.0}
    with torch.no_grad():
        m.fc.weight.mul_(scales[m.fc.weight.device.type])


def _ordered_dict_lookup(m: nn.Module) -> None:
    scales = collections.OrderedDict(cpu=2.0, meta=1.0, cuda=1.0)
    scale = scales.get(m.fc.weight.device.type, 1.0)
    with torch.no_grad():
        m.fc.weight.mul_(scale)


# -- 5. match captures -------------------------------------------------------------------------


def _class_pattern_keyword_capture(m: nn.Module) -> None:
    match m.fc.weight.device:
        case torch.device(type=kind):
            if kind == "cpu":
                _double(m)


def _guarded_case(device: torch.device) -> bool:
    match device:
        case d if d.type == "cpu":
            return True
        case _:
            return False


def _captured_in_a_helper(device: torch.device) -> bool:
    match device.type:
        case "cuda":
            return False
        case kind:
            return kind == "cpu"


def _as_capture_compared(m: nn.Module) -> None:
    match m.fc.weight.device.type:
        case str() as kind:
            if kind == "cpu":
                _double(m)


# -- 6. a helper's locals, evaluated as written -------------------------------------------------

_KIND = "cuda"
_TARGET = "cpu"


def _type_is(device: torch.device, kind: str) -> bool:
    return device.type == kind


def _kind_set_in_branches(device: torch.device) -> bool:
    if device.index is None:  # noqa: SIM108
        kind = "cpu"
    else:
        kind = "cpu:0"
    return device.type == kind


def _annotated_local_shadows_a_global(device: torch.device) -> bool:
    _KIND: str = "cpu"
    return device.type == _KIND


def _parameter_shadows_a_global(device: torch.device, _KIND: str = "cpu") -> bool:
    return device.type == _KIND


def _nested_local_shadows_a_global(device: torch.device) -> bool:
    def unused() -> str:
        _TARGET = "cuda"
        return _TARGET

    return device.type == _TARGET


def _local_from_a_parameter(device: torch.device, expected: str = "cpu") -> bool:
    target = expected
    return device.type == target


def _cyclic_locals(device: torch.device) -> bool:
    kind = "cpu"
    if device is None:  # never taken
        first = second  # noqa: F821
        second = first  # noqa: F841
        return device.type == first
    return device.type == kind


def _chained_locals(device: torch.device) -> bool:
    first = _CPU_NAME
    second = first
    return device.type == second


def _default_with_a_local(m: nn.Module) -> None:
    def on_cpu(device: torch.device = m.fc.weight.device) -> bool:
        kind = "cpu"
        return device.type == kind

    if on_cpu():
        _double(m)


# -- 7. lambdas on one line, limits, the follow's bookkeeping --------------------------------

_is_cpu_nested = lambda d: (lambda e: e.type == "cpu")(d)  # noqa: E731
_is_cuda_p, _is_cpu_p = (lambda d: d.type == "cuda"), (lambda d: d.type == "cpu")


def _returned_through(m: nn.Module, frames: int) -> torch.device:
    """The weight's device, returned through ``frames`` calls of this function."""
    return m.fc.weight.device if frames == 1 else _returned_through(m, frames - 1)


def _lower(value: object) -> str:
    return str(value).lower()


def _normalised_twice(m: nn.Module) -> None:
    device = m.fc.weight.device
    m.index_name = _lower(device.index)
    if _lower(device.type) == "cpu":
        _double(m)


def _name_rebound_from_the_device(m: nn.Module) -> None:
    device = m.fc.weight.device
    kind = str(device.index)
    m.index_name = kind
    kind = device.type
    if kind == "cpu":
        _double(m)


def _returned_by_a_lambda_not_running(m: nn.Module) -> None:
    device = m.fc.weight.device
    get = lambda: device  # noqa: E731
    if get().type == "cpu":
        _double(m)


def _for_over_a_repeated_list(m: nn.Module) -> None:
    for device in [m.fc.weight.device] * 2:
        if device.type == "cpu":
            _double(m)


def _even(device: torch.device, n: int) -> bool:
    return device.type == "cpu" if n == 0 else _odd(device, n - 1)


def _odd(device: torch.device, n: int) -> bool:
    return _even(device, n - 1)


BRANCHING: dict[str, Callable[[], nn.Module]] = {
    # 1. iteration
    "for _, d in enumerate((w.device,))": lambda: Probe(_for_enumerate),
    "for d in {w.device} (a set display)": lambda: Probe(_for_over_a_set_display),
    "for d in (w.device, a call)": lambda: Probe(_for_over_a_display_with_a_call),
    "any(d.type == 'cpu' for d in (w.device,))": lambda: Probe(_generator_over_a_display),
    "[d for d in (w.device,) if d.type == 'cpu']": lambda: Probe(_list_comprehension_filter),
    "for d, dtype in ((w.device, w.dtype),)": lambda: Probe(_for_unpacking_pairs),
    "for d in pair, pair from a display": lambda: Probe(_nested_for),
    # 2. global / nonlocal
    "nonlocal two scopes up": lambda: Probe(_nonlocal_two_scopes_up),
    # 3. self.x
    "self.where read by a base class's method": _ReadByTheBase,
    "self.where stored by the base, read by a subclass": _ReadByASubclass,
    "self.where read by a property": _ReadByAProperty,
    "self.where read by getattr(self, 'where')": _ReadByGetattr,
    "self.cfg = {'device': w.device}, read in another method": _ReadFromATable,
    # 4. table[key]
    "config[key] stored, config['device'] read": lambda: Probe(_key_in_a_variable),
    "config['device'] stored, config.get('device') read": lambda: Probe(_read_back_by_get),
    "scales[w.device.type] (the type as a key)": lambda: Probe(_device_type_as_a_key),
    "OrderedDict.get(w.device.type)": lambda: Probe(_ordered_dict_lookup),
    # 5. match captures
    "case torch.device(type=kind): kind == 'cpu'": lambda: Probe(_class_pattern_keyword_capture),
    "case d if d.type == 'cpu', in a helper": lambda: Probe(
        lambda m: _double(m) if _guarded_case(m.fc.weight.device) else None
    ),
    "case kind: kind == 'cpu', in a helper": lambda: Probe(
        lambda m: _double(m) if _captured_in_a_helper(m.fc.weight.device) else None
    ),
    "case str() as kind: kind == 'cpu'": lambda: Probe(_as_capture_compared),
    # 6. a helper's locals
    "helper compares with an argument of the call": lambda: Probe(
        lambda m: _double(m) if _type_is(m.fc.weight.device, "cpu") else None
    ),
    "helper local assigned in both branches": lambda: Probe(
        lambda m: _double(m) if _kind_set_in_branches(m.fc.weight.device) else None
    ),
    "helper annotated local shadows a global": lambda: Probe(
        lambda m: _double(m) if _annotated_local_shadows_a_global(m.fc.weight.device) else None
    ),
    "helper parameter default shadows a global": lambda: Probe(
        lambda m: _double(m) if _parameter_shadows_a_global(m.fc.weight.device) else None
    ),
    "helper's nested function assigns a global's name": lambda: Probe(
        lambda m: _double(m) if _nested_local_shadows_a_global(m.fc.weight.device) else None
    ),
    "helper local assigned from a parameter": lambda: Probe(
        lambda m: _double(m) if _local_from_a_parameter(m.fc.weight.device) else None
    ),
    "helper locals in a cycle (a branch never taken)": lambda: Probe(
        lambda m: _double(m) if _cyclic_locals(m.fc.weight.device) else None
    ),
    "helper locals chained to a module constant": lambda: Probe(
        lambda m: _double(m) if _chained_locals(m.fc.weight.device) else None
    ),
    "default-argument function with its own local": lambda: Probe(_default_with_a_local),
    # 7. lambdas, limits, bookkeeping
    "nested lambdas on one line": lambda: Probe(
        lambda m: _double(m) if _is_cpu_nested(m.fc.weight.device) else None
    ),
    "the second of two lambdas on one line": lambda: Probe(
        lambda m: _double(m) if _is_cpu_p(m.fc.weight.device) else None
    ),
    "returned through eight functions": lambda: Probe(
        lambda m: _double(m) if _returned_through(m, 8).type == "cpu" else None
    ),
    "one helper called twice, the second call compares": lambda: Probe(_normalised_twice),
    "a name rebound from another use of the device": lambda: Probe(_name_rebound_from_the_device),
    "a lambda, not running, returns the device": lambda: Probe(_returned_by_a_lambda_not_running),
    "for d in [w.device] * 2": lambda: Probe(_for_over_a_repeated_list),
    "mutually recursive helpers": lambda: Probe(
        lambda m: _double(m) if _even(m.fc.weight.device, 2) else None
    ),
}

_WRONG = "silently wrong: accepted, "
_DOUBLING = "; fc.weight lacks eager's doubling"


def _missed(what: str) -> str:
    return _WRONG + what + _DOUBLING


BRANCHING_BROKEN: dict[str, str] = {
    "for _, d in enumerate((w.device,))": _missed(
        "enumerate() is not followed: only a display is iterated (_iterated via a For's iter)"
    ),
    "self.where read by a base class's method": _missed(
        "Source.owner is the storing class only; a base class's method is not searched"
    ),
    "self.where stored by the base, read by a subclass": _missed(
        "Source.owner is the storing class only; a subclass's method is not searched"
    ),
    "self.where read by getattr(self, 'where')": _missed(
        "a stored attribute is read back only by the same spelling"
    ),
    "config[key] stored, config['device'] read": _missed(
        "a subscript is read back only by the same spelling (config[key] vs config['device'])"
    ),
    "config['device'] stored, config.get('device') read": _missed(
        "a subscript is read back only by the same spelling, not by .get"
    ),
    "OrderedDict.get(w.device.type)": _missed(
        "a dict subclass's lookup is not pure (_pure wants the exact builtin type), so the "
        "scale it picks is not followed into mul_"
    ),
    "case torch.device(type=kind): kind == 'cpu'": _missed(
        "only a whole-subject capture (case d / case ... as d) is followed, not one nested in "
        "a class pattern's keyword"
    ),
    "case d if d.type == 'cpu', in a helper": _missed(
        "a guarded case inside a helper ends the follow unrefused (_matched, frame None)"
    ),
    "helper local assigned in both branches": _missed(
        "a local stored twice is not evaluated (_assigned_once), so the comparison is unknown "
        "and not refused in a helper"
    ),
    "nested lambdas on one line": _missed(
        "Source.definition finds both lambdas on the line and the outer one's first "
        "instruction lies within both, so neither is entered"
    ),
    "a lambda, not running, returns the device": _missed(
        "a return is followed only into a running frame of that name"
    ),
}


@pytest.mark.parametrize(("branch", "include_buffers"), mode_cases(BRANCHING, BRANCHING_BROKEN))
def test_a_device_branch_is_exact_or_refused(branch, include_buffers):
    build = BRANCHING[branch]
    ref = build_eagerly(build)
    assert_exact_or_refused(build_empty(build, include_buffers), ref)


# -- 8. objects of the program's the follow meets: their code must not run ----------------------


class _Counted:
    """Counts its calls into the module that owns it."""

    def __init__(self, owner: nn.Module) -> None:
        object.__setattr__(self, "_owner", owner)

    def _count(self) -> None:
        self._owner.calls += 1


class _Marker(_Counted):
    def __eq__(self, other: object) -> bool:
        self._count()
        return False

    def __hash__(self) -> int:
        self._count()
        return 1


class _Kind(str):
    """A str whose equality counts (a str subclass: its ``__eq__`` runs first)."""

    owner: nn.Module

    def __eq__(self, other: object) -> bool:
        self.owner.calls += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


class _Kinds(_Counted):
    def __contains__(self, item: object) -> bool:
        self._count()
        return item == "cuda"


class _Tag(_Counted):
    def __str__(self) -> str:
        self._count()
        return "cuda"


class _Flag(_Counted):
    def __bool__(self) -> bool:
        self._count()
        return True


class _Suffix(_Counted):
    def __radd__(self, other: object) -> str:
        self._count()
        return f"{other}:0"


class _Checked(type):
    """A metaclass whose instance check counts."""

    owner: nn.Module | None = None

    def __instancecheck__(cls, instance: object) -> bool:
        if cls.owner is not None:
            cls.owner.calls += 1
        return False


class _NeverAnInstance(metaclass=_Checked):
    pass


class _CountedCall(_Counted):
    """A callable with ``__getattr__`` (a proxy's): counts the names it is asked for."""

    def __getattr__(self, name: str) -> object:
        self._count()
        return None

    def __call__(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(3, device=device)


class _Registry:
    """A callable whose ``__getattr__`` looks names up in a table, raising ``KeyError``."""

    def __init__(self) -> None:
        self.__dict__["_table"] = {}

    def __getattr__(self, name: str) -> object:
        return self.__dict__["_table"][name]

    def __call__(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(3, device=device)


class _Unhashable:
    """A callable whose hash refuses (a mutable value object)."""

    def __hash__(self) -> int:
        raise ValueError("not hashable while mutable")

    def __call__(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(3, device=device)


class _Known:
    """A constant whose equality refuses device types it does not know."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        if other not in ("cpu", "meta"):
            raise ValueError(f"unknown device type {other!r}")
        return other == self.name

    __hash__ = None  # type: ignore[assignment]


class _Types:
    CUDA = _Known("cuda")


class _Formatted(_Counted):
    def __format__(self, spec: str) -> str:
        self._count()
        return "cuda"


class _Described(_Counted):
    """A descriptor of the program's own (a lazy attribute)."""

    def __get__(self, instance: object, owner: type | None = None) -> str:
        if instance is not None:
            instance.calls += 1
        return "cuda"


class _DescribedProbe(Probe):
    kind = _Described(None)


class _ForwardingProbe(Probe):
    """A module forwarding unknown names (PEFT's wrappers), counting them."""

    def __getattr__(self, name: str) -> object:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "kind":
                raise
            self.__dict__["calls"] += 1
            return "cuda"


class _CountingAttributes(Probe):
    """A module whose ``__getattribute__`` counts reads of ``kind``."""

    def __getattribute__(self, name: str) -> object:
        if name == "kind":
            object.__getattribute__(self, "__dict__")["calls"] += 1
        return super().__getattribute__(name)


class _ClassProperty(Probe):
    """A class-level property (``classmethod`` over ``property``, Python 3.11-3.12) that
    counts."""

    reads = 0

    @classmethod  # type: ignore[misc]
    @property
    def kind(cls) -> str:
        cls.reads += 1
        return "cuda"


class _ScaledProbe(Probe):
    """Per-device scales as properties that count."""

    @property
    def scale_cpu(self) -> float:
        self.calls += 1
        return 1.0

    @property
    def scale_cuda(self) -> float:
        self.calls += 1
        return 1.0

    @property
    def scale_meta(self) -> float:
        self.calls += 1
        return 1.0


def _in_a_list_holding_a_marker(m: nn.Module) -> None:
    kinds = [_Marker(m), "cuda"]
    if m.fc.weight.device.type in kinds:
        _double(m)


def _looked_up_in_a_table_keyed_by_a_marker(m: nn.Module) -> None:
    table = {_Marker(m): 2.0, "cuda": 3.0}
    scale = table.get(m.fc.weight.device.type, 1.0)
    with torch.no_grad():
        m.fc.weight.mul_(scale)


def _marker_compared(m: nn.Module) -> None:
    marker = _Marker(m)
    if m.fc.weight.device == marker:
        _double(m)


def _kind_compared(m: nn.Module) -> None:
    kind = _Kind("cuda")
    kind.owner = m
    if m.fc.weight.device.type == kind:
        _double(m)


def _contained_in_kinds(m: nn.Module) -> None:
    kinds = _Kinds(m)
    if m.fc.weight.device.type in kinds:
        _double(m)


def _compared_with_str_of_a_tag(m: nn.Module) -> None:
    tag = _Tag(m)
    if m.fc.weight.device.type == str(tag):
        _double(m)


def _picked_by_a_flag(m: nn.Module) -> None:
    m.flag = _Flag(m)
    m.register_buffer("z", torch.zeros(3, device=m.fc.weight.device if m.flag else None))


def _in_a_set_of_markers(m: nn.Module) -> None:
    marker = _Marker(m)
    if m.fc.weight.device in {marker}:
        _double(m)


def _added_a_suffix(m: nn.Module) -> None:
    suffix = _Suffix(m)
    if m.fc.weight.device.type + suffix == "cuda:0":
        _double(m)


def _formatted_beside(m: nn.Module) -> None:
    tag = _Formatted(m)
    if f"{m.fc.weight.device.type}-{tag}" == "cuda-cuda":
        _double(m)


def _compared_with_m_kind(m: nn.Module) -> None:
    if m.fc.weight.device.type == m.kind:
        _double(m)


def _isinstance_checked(m: nn.Module) -> None:
    _Checked.owner = m
    try:
        if isinstance(m.fc.weight.device, _NeverAnInstance):
            _double(m)
    finally:
        _Checked.owner = None


def _kind_read_through_getattribute(m: nn.Module) -> None:
    m.kind = "cuda"
    if m.fc.weight.device.type == m.kind:
        _double(m)


def _class_property_compared(m: nn.Module) -> None:
    before = type(m).reads
    if m.fc.weight.device.type == m.kind:
        _double(m)
    m.calls += type(m).reads - before


def _scale_by_name(m: nn.Module) -> None:
    scale = getattr(m, "scale_" + m.fc.weight.device.type, 1.0)
    m.register_buffer("s", torch.tensor(scale))


def _made_by_a_proxy(m: nn.Module) -> None:
    make = _CountedCall(m)
    m.register_buffer("z", make(m.fc.weight.device))


SIDE_EFFECTS: dict[str, Callable[[], nn.Module]] = {
    "device == an object whose __eq__ counts": lambda: Probe(_marker_compared),
    "type in a list holding an object whose __eq__ counts": lambda: Probe(
        _in_a_list_holding_a_marker
    ),
    "table.get(type), a key whose __eq__ and __hash__ count": lambda: Probe(
        _looked_up_in_a_table_keyed_by_a_marker
    ),
    "type == a str subclass whose __eq__ counts": lambda: Probe(_kind_compared),
    "type in a container whose __contains__ counts": lambda: Probe(_contained_in_kinds),
    "type == str(an object whose __str__ counts)": lambda: Probe(_compared_with_str_of_a_tag),
    "device if m.flag else None, whose __bool__ counts": lambda: Probe(_picked_by_a_flag),
    "device in {an object whose __hash__ counts}": lambda: Probe(_in_a_set_of_markers),
    "type + an object whose __radd__ counts": lambda: Probe(_added_a_suffix),
    "isinstance(device, a class whose metaclass counts)": lambda: Probe(_isinstance_checked),
    "type == m.kind, the module's __getattribute__ counts": lambda: _CountingAttributes(
        _kind_read_through_getattribute
    ),
    "type == a classmethod property that counts": lambda: _ClassProperty(_class_property_compared),
    "getattr(m, 'scale_' + type, 1.0), properties that count": lambda: _ScaledProbe(_scale_by_name),
    "the device passed to a proxy whose __getattr__ counts": lambda: Probe(_made_by_a_proxy),
    "f-string of the type and an object whose __format__ counts": lambda: Probe(_formatted_beside),
    "type == m.kind, a descriptor of the program's": lambda: _DescribedProbe(_compared_with_m_kind),
    "type == m.kind, the module's __getattr__ forwards": lambda: _ForwardingProbe(
        _compared_with_m_kind
    ),
}

_RAN = "silently wrong: the follow runs the program's "
_COUNT = ", so calls_seen differs from eager's"

SIDE_EFFECTS_BROKEN: dict[str, str] = {}


@pytest.mark.parametrize(
    ("idiom", "include_buffers"), mode_cases(SIDE_EFFECTS, SIDE_EFFECTS_BROKEN)
)
def test_the_follow_runs_none_of_the_programs_code(idiom, include_buffers):
    build = SIDE_EFFECTS[idiom]
    ref = build_eagerly(build)
    assert_exact_or_refused(build_empty(build, include_buffers), ref)


# -- 9. placing: meta and the CPU answer alike -------------------------------------------------


def _made_by_a_registry(m: nn.Module) -> None:
    make = _Registry()
    m.register_buffer("z", make(m.fc.weight.device))


def _made_by_an_unhashable(m: nn.Module) -> None:
    make = _Unhashable()
    m.register_buffer("z", make(m.fc.weight.device))


def _match_known(m: nn.Module) -> None:
    match m.fc.weight.device.type:
        case _Types.CUDA:
            _double(m)
        case _:
            m.register_buffer("z", torch.zeros(3, device=m.fc.weight.device))


def _renamed(path: Path, times: int) -> Callable[[nn.Module], object]:
    """The device renamed ``times`` times, then placing a buffer."""
    lines = ["import torch", "", "def probe(m):", "    d0 = m.fc.weight.device"]
    lines += [f"    d{i + 1} = d{i}" for i in range(times)]
    lines += [f"    m.register_buffer('z', torch.zeros(3, device=d{times}))"]
    path.write_text("\n".join(lines) + "\n")
    return load_probe(path)


def _fanned_out(path: Path, uses: int) -> Callable[[nn.Module], object]:
    """The device placing ``uses`` tensors."""
    lines = ["import torch", "", "def probe(m):", "    device = m.fc.weight.device"]
    lines += [f"    t{i} = torch.zeros(1, device=device)" for i in range(uses)]
    path.write_text("\n".join(lines) + "\n")
    return load_probe(path)


PLACING: dict[str, Callable[[nn.Module], object] | Callable[[Path], object]] = {
    "a global stored, a local of its name compared elsewhere": _global_then_local_of_that_name,
    "the device passed to a proxy whose __getattr__ raises KeyError": _made_by_a_registry,
    "the device passed to a callable whose __hash__ raises": _made_by_an_unhashable,
    "match type: case a constant whose __eq__ refuses unknown types": _match_known,
    "the device renamed 150 times, then placing": lambda path: _renamed(path, 150),
    "the device placing 300 tensors": lambda path: _fanned_out(path, 300),
}


_GENERATED = {"the device renamed 150 times, then placing", "the device placing 300 tensors"}

OVER_REFUSED: dict[str, str] = {
    "the device placing 300 tensors": "over-refusal: refused, used it in more than 256 places "
    "(_BUDGET), though each only places",
    "the device renamed 150 times, then placing": "over-refusal: refused, the follow recurses "
    "once per name and runs out of stack (RecursionError), though the device only places",
    "match type: case a constant whose __eq__ refuses unknown types": "over-refusal: refused, "
    "the case's constant is not a plain value, so the match is not evaluated where the device "
    "is read",
}


@pytest.mark.parametrize(("place", "include_buffers"), mode_cases(PLACING, OVER_REFUSED))
def test_a_device_used_to_place_is_exact(place, include_buffers, tmp_path):
    probe = PLACING[place]
    if place in _GENERATED:
        probe = probe(tmp_path / "generated_follow_probe.py")
    assert_eager_equal(lambda: Probe(probe), include_buffers)
