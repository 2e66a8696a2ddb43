"""``metamode.materialize``: give an empty-built module the values eager construction gives it."""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from metamode import _torch
from metamode._core import recording
from metamode._core.params import carry_attributes, moved_parameter, slot_names
from metamode._core.recording import Entry, Key, Program, TensorRef

__all__ = [
    "NotMaterializableError",
    "is_materializable",
    "materialize",
    "unreproducible",
]

_CPU = torch.device("cpu")
# program -> {storage index: the memory materialize installed there, weakly}: a later
# materialize of another tensor of that storage shares it, as eager construction's do
_INSTALLED: weakref.WeakKeyDictionary[Program, dict[int, _torch.StorageRef]] = (
    weakref.WeakKeyDictionary()
)
# meta buffer -> the buffer materialize put in its place (a module outside the one
# materialized may still hold the meta one: a later materialize puts the same one there)
_REPLACED = torch.utils.weak.WeakIdKeyDictionary()


class NotMaterializableError(RuntimeError):
    """Some tensors of a module cannot be given their eager values; nothing was changed."""


@dataclass(slots=True)
class _Slot:
    """One tensor of the module, wherever it sits (tied tensors are one slot): registered
    (``homes``), or held as a plain attribute or in a list, tuple or dict attribute
    (``places``: the container and the key there)."""

    tensor: torch.Tensor
    kind: str
    names: list[str] = field(default_factory=list)
    homes: list[tuple[nn.Module, str]] = field(default_factory=list)
    places: list[tuple[Any, Any]] = field(default_factory=list)
    entry: Entry | None = None
    reason: str | None = None  # why it is refused
    wanted: bool = False
    shares: torch.UntypedStorage | None = None  # the memory an earlier materialize gave it

    @property
    def key(self) -> Key:
        assert self.entry is not None and self.entry.ref is not None
        return (self.entry.program.serial, self.entry.ref.storage)


def _slots(module: nn.Module) -> list[_Slot]:
    slots: dict[int, _Slot] = {}
    attributes: list[tuple[torch.Tensor, Any, Any, str]] = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for kind, table in (("parameter", sub._parameters), ("buffer", sub._buffers)):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                slot = slots.get(id(tensor))
                if slot is None:
                    # a Parameter registered as a buffer too (or only) is swapped like one
                    parameter = kind == "parameter" or isinstance(tensor, nn.Parameter)
                    slot = slots[id(tensor)] = _Slot(tensor, "parameter" if parameter else kind)
                elif kind == "parameter":
                    slot.kind = kind
                qualname = f"{prefix}.{name}" if prefix else name
                if qualname not in slot.names:
                    slot.names.append(qualname)
                slot.homes.append((sub, name))
        attributes += _attributes(sub, prefix)
    # after every registered one: a tensor both registered and held is that registration's
    for tensor, container, key, qualname in attributes:
        slot = slots.get(id(tensor))
        if slot is None:
            slot = slots[id(tensor)] = _Slot(tensor, "attribute")
        if qualname not in slot.names:
            slot.names.append(qualname)
        slot.places.append((container, key))
    return list(slots.values())


_REGISTERED = frozenset(["_parameters", "_buffers", "_modules"])


def _attributes(sub: nn.Module, prefix: str) -> list[tuple[torch.Tensor, Any, Any, str]]:
    """The tensors ``sub`` holds outside its parameters and buffers: as plain attributes
    (``module.weight = t`` for a name not registered, as the old ``weight_norm`` and
    ``spectral_norm`` do), and in the lists, tuples, dicts (their subclasses too), deques
    and plain objects (a ``SimpleNamespace``, a dataclass) those hold, up to ``_DEPTH``
    levels down, never into a module; each with its container, its key there and its
    qualified name."""
    found: list[tuple[torch.Tensor, Any, Any, str]] = []
    attributes = vars(sub)
    for name in [name for name in attributes if name not in _REGISTERED]:
        qualname = f"{prefix}.{name}" if prefix else name
        _visit(attributes, name, qualname, found, 0, set())
    return found


_DEPTH = 4
_LEAVES = (nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType)


class _Members(tuple):
    """The members of a set attribute, read in place of it: a place nothing is put into."""

    __slots__ = ()


class _SlotsOf:
    """A plain object's ``__slots__``, read and written like a dict."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getitem__(self, name: str) -> Any:
        return getattr(self.obj, name)

    def __setitem__(self, name: str, value: Any) -> None:
        object.__setattr__(self.obj, name, value)  # as a __dict__ write (frozen dataclasses)


def _builtin(place: Any) -> Any:
    """The builtin container type ``place`` is an instance of (its item access bypasses a
    subclass's own ``__getitem__`` and ``__setitem__``), or None."""
    for kind in (dict, list, collections.deque):
        if isinstance(place, kind):
            return kind
    return None


def _read(place: Any, key: Any) -> Any:
    """``place[key]``, past a container subclass's own ``__getitem__``."""
    kind = _builtin(place)
    return place[key] if kind is None else kind.__getitem__(place, key)


def _write(place: Any, key: Any, value: Any) -> None:
    """``place[key] = value``, past a container subclass's own ``__setitem__``."""
    kind = _builtin(place)
    if kind is None:
        place[key] = value
    else:
        kind.__setitem__(place, key, value)


def _visit(place: Any, key: Any, name: str, found: list, depth: int, seen: set[int]) -> None:
    """Collect the tensors in ``place[key]`` (a container, or a plain object's __dict__ or
    __slots__)."""
    value = _read(place, key)
    if isinstance(value, torch.Tensor):
        if _held(value):
            found.append((value, place, key, name))
        return
    if depth >= _DEPTH or id(value) in seen or isinstance(value, _LEAVES):
        return
    kind = type(value)
    if isinstance(value, list | tuple | collections.deque):  # a namedtuple, a deque too
        seen.add(id(value))
        for index in range(len(value)):
            _visit(value, index, f"{name}[{index}]", found, depth + 1, seen)
    elif isinstance(value, dict | types.MappingProxyType):  # an OrderedDict, a defaultdict
        seen.add(id(value))
        for item in list(value):
            _visit(value, item, f"{name}[{item!r}]", found, depth + 1, seen)
    elif isinstance(value, set | frozenset):
        seen.add(id(value))
        members = _Members(value)
        for index in range(len(members)):
            _visit(members, index, f"{name}{{{index}}}", found, depth + 1, seen)
    elif kind.__module__ != "builtins":
        seen.add(id(value))
        if type(getattr(value, "__dict__", None)) is dict:
            attributes = vars(value)
            for item in list(attributes):
                _visit(attributes, item, f"{name}.{item}", found, depth + 1, seen)
        slots = _SlotsOf(value)
        for item in slot_names(kind):
            if hasattr(value, item):
                _visit(slots, item, f"{name}.{item}", found, depth + 1, seen)


def _held(tensor: torch.Tensor) -> bool:
    """Whether materialize looks after ``tensor`` where a module holds it unregistered."""
    return tensor.layout is torch.strided and not _is_dtensor(tensor) and not _lazy(tensor)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "device_mesh")


def _find_entries(slots: list[_Slot]) -> None:
    programs: dict[int, Program] = {}
    for slot in slots:
        slot.entry = recording.entry(slot.tensor)
        if slot.entry is None and _is_dtensor(slot.tensor):
            # fully_shard put it there: it stands for what was registered in its place
            for home, name in slot.homes:
                slot.entry = slot.entry or recording.home(home, name)
        if slot.entry is not None:
            programs[slot.entry.program.serial] = slot.entry.program
    owners: dict[int, list[Program]] | None = None  # storage address -> programs knowing it
    for slot in slots:
        if (
            slot.entry is None
            and slot.tensor.layout is torch.strided
            and not _is_dtensor(slot.tensor)
            and not _lazy(slot.tensor)
        ):
            # made without registration (copy.deepcopy of a built module, a cast by
            # Module._apply, module._buffers[k] = t, a stretch under skip_empty_weights):
            # known by its storage to a program, first those that recorded this module's
            # other tensors. A real one counts only if a recorded call made its storage
            # (one made before the build is a loaded tensor).
            if owners is None:
                owners = _owners(programs)
            address = slot.tensor.untyped_storage()._cdata
            for program in owners.get(address, ()):
                slot.entry = _unregistered(slot.tensor, program, address)
                if slot.entry is not None:
                    break


def _owners(programs: dict[int, Program]) -> dict[int, list[Program]]:
    """Every live recorded storage's address -> the programs that know it, the module's own
    programs first, then every other closed one."""
    others = [p for p in recording.closed_programs() if p.serial not in programs]
    owners: dict[int, list[Program]] = {}
    for program in [*programs.values(), *others]:
        for address, (_, keep) in program.live.items():
            if not keep.expired():
                owners.setdefault(address, []).append(program)
    return owners


def _unregistered(tensor: torch.Tensor, program: Program, address: int) -> Entry | None:
    """``tensor``'s entry in ``program``, which knows its storage but never saw it
    registered, or None."""
    known = program.live.get(address)
    if known is None or known[1].expired():
        return None
    versions = None
    if not tensor.is_meta:
        made = program.made.get(address)
        if made is None:
            return None
        versions = made[1] or None
    ref = TensorRef(
        known[0],
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        int(tensor.storage_offset()),
        tensor.is_conj(),
        tensor.is_neg(),
    )
    return Entry(program, ref, _version(tensor), versions=versions)


def _lazy(tensor: torch.Tensor) -> bool:
    """A lazy module's uninitialised tensor: eager construction gives it no value either."""
    return isinstance(tensor, _torch.UninitializedTensorMixin)


def _changed(slot: _Slot) -> str | None:
    """Why ``slot``'s tensor is not as its build left it, or None."""
    entry, tensor = slot.entry, slot.tensor
    assert entry is not None and entry.ref is not None
    ref = entry.ref
    if tensor.dtype != ref.dtype or tuple(tensor.shape) != ref.size:
        return (
            f"it was changed after its empty_weights block (now {_describe(tensor)}, built "
            f"as {str(ref.dtype).removeprefix('torch.')}{list(ref.size)}); materialize "
            f"first, then cast or reshape"
        )
    if _is_dtensor(tensor) or tensor.layout is not torch.strided:
        return None  # a layout without storage: the recording refuses it
    known = entry.program.live.get(tensor.untyped_storage()._cdata)
    if (
        known is None
        or known[0] != ref.storage
        or tensor.stride() != ref.stride
        or tensor.storage_offset() != ref.offset
        or (tensor.is_conj(), tensor.is_neg()) != (ref.conj, ref.neg)
    ):
        return "its storage or layout was changed after its empty_weights block"
    if entry.versions is not None and entry.version not in entry.versions:
        return (
            f"its version counter ({entry.version}) is none of those the build's tensors of "
            f"its memory had ({', '.join(map(str, sorted(entry.versions)))}): it was "
            f"written after its empty_weights block, or it was made after the block over "
            f"the build's memory with a counter of its own (.data, set_), whose writes "
            f"cannot be told from none; write it inside the block, or take it after "
            f"materialize"
        )
    if _version(tensor) != entry.version:
        return (
            "it was written after its empty_weights block, or set_ (as "
            "register_parametrization does to the tensor it parametrizes), which its version "
            "counter (moved) cannot tell apart, so its value may not be the build's; write or "
            "parametrize it inside the block, or after materialize"
        )
    return None


def _named(slot: _Slot) -> str:
    """``slot``'s name for a message, with every other name it has (ties, containers)."""
    first, *tied = slot.names
    return f"{first!r} (also {', '.join(map(repr, tied))})" if tied else repr(first)


_FIXED = (tuple, types.MappingProxyType)  # containers nothing can be put into


def _fixed_place(slot: _Slot) -> str | None:
    """Why a new tensor cannot be put where ``slot``'s tensor is held, if so."""
    if slot.kind == "parameter" and not slot.tensor.is_meta:
        return None  # swapped in place: every holder keeps the same object
    if any(isinstance(container, _FIXED) for container, _ in slot.places):
        return (
            "the module holds it in a tuple attribute (or a namedtuple, a set, a "
            "mappingproxy), which materialize cannot put a new tensor into (as it must where "
            "torch cannot swap a parameter in place, or for a buffer); hold it in a list"
        )
    return None


def _shifted_in_place(entry: recording.Entry | None, tensor: torch.Tensor) -> bool:
    """Whether real ``tensor`` is the real tensor ``entry`` registered, given other memory
    in place (a cast) while it held values not eager's (drawn from a shifted stream). A
    meta one cannot be given real memory in place: a real tensor at its address is another
    one, put there after it was gone."""
    if entry is None or entry.ref is None or entry.installed or entry.impl != tensor._cdata:
        return False
    storage = entry.program.storages[entry.ref.storage]
    return storage.device != "meta" and (storage.off or entry.program.diverged is not None)


def _grad_from_the_build(entry: recording.Entry, tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s ``.grad`` cannot be given its eager value, if it has one the build
    set (a meta backward after the block leaves one eager does not have: dropped)."""
    if entry.grad and tensor.grad_fn is None and tensor.grad is not None:
        return (
            "its .grad was set in the build (assigned, or by a backward pass there), which "
            "materialize does not replay; set .grad after materialize"
        )
    return None


def _survey(
    module: nn.Module, elsewhere: Sequence[tuple[Any, str]] = ()
) -> tuple[list[_Slot], recording.Plan | None]:
    """Every slot of ``module`` with why it is refused, and the plan for the wanted ones
    (``elsewhere``: more places its one tensor is held)."""
    slots = _slots(module)
    for slot in slots:
        slot.homes.extend(elsewhere)
    _find_entries(slots)
    for slot in slots:
        entry, tensor = slot.entry, slot.tensor
        if _lazy(tensor):
            continue  # materialize puts an uninitialised one on the device
        if entry is None:
            homes = [recording.home(home, name) for home, name in slot.homes]
            if not tensor.is_meta and not any(_shifted_in_place(e, tensor) for e in homes):
                continue  # put there after the block (a load, a cast of eager's value): kept
            if any(e is not None and e.impl == tensor._cdata for e in homes):
                slot.reason = (
                    "its memory was replaced after the block, in place (.data =, as "
                    "module.half(), .double() or .to(dtype) do to every parameter), so it no "
                    "longer holds what its empty_weights block registered; materialize "
                    "first, then cast"
                )
            elif any(homes):
                slot.reason = (
                    "it is not the tensor its empty_weights block registered there: it was "
                    "replaced after the block (a cast such as module.half() puts a new "
                    "buffer in, and a new parameter under torch.__future__."
                    "set_swap_module_params_on_conversion(True); or an assignment); "
                    "materialize first, then cast"
                )
            elif slot.kind == "attribute":
                slot.reason = (
                    "the module holds this meta tensor as an attribute, and no "
                    "metamode.empty_weights(replayable=True) recording made it (made under "
                    "torch.device('meta') or a non-replayable context, or assigned after "
                    "the context?); make it inside the context, or after materialize"
                )
            else:
                slot.reason = (
                    "it was not registered inside a metamode.empty_weights(replayable=True) "
                    "context (built under torch.device('meta') or a non-replayable context, "
                    "moved with .to('meta'), or assigned after the context?)"
                )
            continue
        if entry.program.abandoned:
            slot.reason = entry.program.abandoned
            continue
        if entry.refused is not None and tensor.is_meta:
            slot.reason = entry.refused
            continue
        if entry.ref is None:
            slot.reason = (
                f"its empty_weights context (thread {entry.program.owner!r}) is still open; "
                f"materialize after the `with` block"
            )
            continue
        real = not tensor.is_meta and not _is_dtensor(tensor)
        storage = entry.program.storages[entry.ref.storage]
        if real and not storage.off and entry.program.diverged is None:
            continue  # the build computed exactly eager's value: keep it
        changed = _changed(slot)
        if changed is not None and entry.program.diverged is not None:
            changed = entry.program.diverged  # the cause, when the build left eager's path
        slot.reason = changed or _fixed_place(slot) or _grad_from_the_build(entry, tensor)
        slot.wanted = slot.reason is None
    for slot in slots:
        if slot.wanted:
            earlier = _INSTALLED.get(slot.entry.program, {}).get(slot.entry.ref.storage)  # type: ignore[union-attr]
            if earlier is None:
                continue
            shares = _torch.storage_of(earlier)
            if shares is None:
                slot.reason, slot.wanted = (
                    (
                        "it shares memory with a tensor an earlier materialize gave its eager "
                        "value, and that memory is gone since (a cast, .data =, or the tensor "
                        "was freed); materialize both together, or before changing it"
                    ),
                    False,
                )
                continue
            slot.shares = shares
    wanted = [s for s in slots if s.wanted and s.shares is None]
    if not wanted:
        return slots, None
    plan = recording.plan(
        dict.fromkeys((s.entry.program, s.entry.ref.storage) for s in wanted)  # type: ignore[union-attr]
    )
    for slot in wanted:
        reason = plan.refused.get(slot.key)
        if reason is not None:
            slot.reason, slot.wanted = reason, False
    if plan.refused:  # replay only what is reproducible
        remaining = [s for s in wanted if s.wanted]
        if not remaining:
            return slots, None
        plan = recording.plan(
            dict.fromkeys((s.entry.program, s.entry.ref.storage) for s in remaining)  # type: ignore[union-attr]
        )
    return slots, plan


def _refusal_message(module: nn.Module, refused: list[_Slot]) -> str:
    lines = "\n".join(
        f"  {', '.join(repr(n) for n in slot.names)} ({slot.kind}): {slot.reason}"
        for slot in refused
    )
    return (
        f"metamode.materialize({type(module).__name__}) in thread "
        f"{threading.current_thread().name!r}: {len(refused)} tensor(s) cannot be given "
        f"their eager values; nothing was changed:\n{lines}\nFix: build them inside "
        f"metamode.empty_weights(replayable=True) from torch calls only, load them from a "
        f"checkpoint (load_state_dict(..., assign=True)), or pass on_unreproducible='empty' "
        f"to leave the meta ones uninitialised."
    )


def unreproducible(module: nn.Module) -> dict[str, str]:
    """``{name: why}`` for every tensor of ``module`` :func:`materialize` would refuse."""
    # metamode's own work: not an open build's, nor the caller's modes' or transforms'
    with _torch.DisableTorchFunction(), _torch.callers_modes_set_aside():
        slots, _ = _survey(module)
    return {slot.names[0]: slot.reason for slot in slots if slot.reason is not None}


def is_materializable(obj: nn.Module | torch.Tensor) -> bool:
    """Whether :func:`materialize` can give ``obj`` (every meta tensor, for a module) its
    eager values: the same checks, nothing allocated. A tensor is judged as materialize of
    the modules holding it judges it."""
    elsewhere: list[tuple[Any, str]] = []
    if isinstance(obj, torch.Tensor):  # judged where the modules holding it hold it
        tensor, obj = obj, nn.Module()
        table = obj._parameters if isinstance(tensor, nn.Parameter) else obj._buffers
        table["tensor"] = tensor  # type: ignore[assignment]
        elsewhere = recording.homes_holding(tensor)
    # metamode's own work: not an open build's, nor the caller's modes' or transforms'
    with _torch.DisableTorchFunction(), _torch.callers_modes_set_aside():
        slots, _ = _survey(obj, elsewhere)
    return all(slot.reason is None for slot in slots)


def materialize(
    module: nn.Module,
    device: torch.device | str | None = None,
    *,
    on_unreproducible: Literal["error", "empty"] = "error",
) -> nn.Module:
    """Give ``module``'s empty-built tensors the values eager construction gives them.

    Every parameter and buffer registered inside ``metamode.empty_weights(replayable=True)``
    gets what ``torch.manual_seed(s); build()`` puts there when the context was entered in
    the generator state ``torch.manual_seed(s)`` leaves -- a submodule's too, replaying
    only the calls its tensors need. Meta tensors are allocated on ``device``; real tensors
    the build computed exactly are kept, those whose random numbers it drew from a shifted
    stream are replaced. Parameters stay the same Python objects
    (``torch.utils.swap_tensors``: ties, classes, attributes, ``requires_grad`` and gradient
    hooks kept); where torch refuses the swap (a weak reference, a view or an autograd graph
    holds the parameter), its modules get a new one and a ``UserWarning`` names it.
    Buffers are replaced in their modules. A parameter that FSDP2's ``fully_shard``
    replaced by a DTensor gets its rank's local shard.

    Values are computed on CPU with private generators, then moved to ``device``, so they
    are the CPU eager values anywhere; the process's default generator is neither drawn
    from nor changed. May run while other threads build or materialize other modules; do
    not materialize one module from two threads.

    Every check happens first: if any tensor cannot be reproduced, nothing is allocated,
    installed or drawn, and the error names each tensor and why. The rule and what is
    refused: the materialize guide in the documentation.

    Args:
        device: where the tensors go; ``"cpu"`` by default (where eager construction puts
            them). Not ``"meta"``.
        on_unreproducible: ``"empty"`` gives meta tensors that cannot be reproduced
            uninitialised memory on ``device`` instead of raising (real ones are left as
            they are).

    Returns ``module`` itself.

    Raises:
        NotMaterializableError: some tensors cannot be reproduced (nothing was changed).
        ValueError: ``device`` is ``"meta"`` or ``on_unreproducible`` is not a choice.
    """
    if on_unreproducible not in ("error", "empty"):
        raise ValueError(f"on_unreproducible must be 'error' or 'empty', not {on_unreproducible!r}")
    device = _CPU if device is None else torch.device(device)
    if device.type == "meta":
        raise ValueError(
            "materialize(device='meta') would compute every value and throw it away; "
            "pass a real device (the default is cpu)"
        )
    # metamode's own work: not an open build's, nor the caller's modes' or transforms'
    with _torch.DisableTorchFunction(), _torch.callers_modes_set_aside():
        return _locked_and_materialized(module, device, on_unreproducible)


def _locked_and_materialized(
    module: nn.Module, device: torch.device, on_unreproducible: str
) -> nn.Module:
    first = _slots(module)
    _find_entries(first)
    locked = _programs(first)
    while True:
        with contextlib.ExitStack() as held:
            for _, program in sorted(locked.items()):  # one order: no deadlock
                held.enter_context(program.installing)
            slots, plan = _survey(module)
            programs = _programs(slots)
            if programs.keys() <= locked.keys():
                return _materialize(module, device, on_unreproducible, slots, plan)
            locked.update(programs)


def _programs(slots: list[_Slot]) -> dict[int, Program]:
    return {s.entry.program.serial: s.entry.program for s in slots if s.entry is not None}


def _materialize(
    module: nn.Module,
    device: torch.device,
    on_unreproducible: str,
    slots: list[_Slot],
    plan: recording.Plan | None,
) -> nn.Module:
    refused = [slot for slot in slots if slot.reason is not None]
    if refused and on_unreproducible == "error":
        raise NotMaterializableError(_refusal_message(module, refused))
    install = _Installer(module, device)
    try:
        with torch.no_grad(), torch.inference_mode(False):
            for slot in refused:
                if slot.tensor.is_meta:
                    install.empty(slot)
            for slot in slots:
                if _lazy(slot.tensor) and slot.tensor.device != device:
                    install.uninitialised(slot)
            for slot in slots:
                if slot.shares is not None and slot.wanted:
                    replaced = _REPLACED.get(slot.tensor)
                    if replaced is not None and slot.kind == "parameter":
                        install.replacement(slot, replaced)
                    elif replaced is not None:
                        install.buffer(slot, replaced)
                    else:
                        install.storage([slot], slot.shares, {})
            if plan is not None:
                by_key: dict[Key, list[_Slot]] = {}
                for slot in slots:
                    if slot.wanted:
                        by_key.setdefault(slot.key, []).append(slot)
                recording.execute(
                    plan,
                    lambda key, storage, relaid: install.storage(
                        by_key.get(key, ()), storage, relaid
                    ),
                )
            install.finish()
    except recording.ProcessChanged as error:
        install.undo()
        raise NotMaterializableError(
            f"metamode.materialize({type(module).__name__}) in thread "
            f"{threading.current_thread().name!r}: {error}; nothing was changed. Fix: keep "
            f"the setting as the build had it until materialize returns"
        ) from None
    except BaseException:
        install.undo()
        raise
    if install.replaced:
        warnings.warn(
            f"metamode.materialize({type(module).__name__}) in thread "
            f"{threading.current_thread().name!r}: a weak reference, a view or an autograd "
            f"graph holds {', '.join(install.replaced)}, so "
            f"torch.utils.swap_tensors cannot give it its values in place: the module now "
            f"holds a new Parameter there, and what held the old one (an optimizer made "
            f"before materialize, a weak reference) still holds the meta one. Fix: make "
            f"optimizers after materialize, or drop those references before it",
            stacklevel=4,
        )
    if install.accumulators:
        warnings.warn(
            f"metamode.materialize({type(module).__name__}) in thread "
            f"{threading.current_thread().name!r}: the gradient accumulator (AccumulateGrad "
            f"node) of {', '.join(install.accumulators)} was alive (an "
            f"autograd graph, torch.autograd.graph.register_multi_grad_hook or your code "
            f"holds it): what is registered on that node stays with the meta tensor, and a "
            f"backward through a graph made before materialize fails. Fix: make graphs and "
            f"register node hooks after materialize",
            stacklevel=4,
        )
    return module


class _Installer:
    """Puts values into the module, keeping what it takes to undo every step."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self._undo: list[Callable[[], object]] = []
        self._sharded: set[int] = set()
        self.replaced: list[str] = []  # parameters put in place as new objects
        # parameters swapped while their AccumulateGrad node was alive
        self.accumulators: list[str] = []

    def storage(
        self, slots: Any, storage: torch.UntypedStorage, relaid: dict[TensorRef, torch.Tensor]
    ) -> None:
        if not slots:
            return
        if self.device != _CPU and storage.device != self.device:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            storage = whole.to(self.device).untyped_storage()
        for slot in slots:
            ref = slot.entry.ref
            # eager's is an inference tensor where the build's is (made under inference mode)
            with torch.inference_mode(slot.tensor.is_inference()):
                value = relaid.get(ref)
                if value is not None:  # eager's layout of this very result
                    value = value.to(self.device)
                else:
                    value = recording.with_bits(
                        torch.empty(0, dtype=ref.dtype, device=self.device).set_(
                            storage, ref.offset, ref.size, ref.stride
                        ),
                        ref,
                    )
                installed = self._put(slot, value)
            shared = _INSTALLED.setdefault(slot.entry.program, {})
            # the memory, weakly: a weak reference to the tensor would stop swap_tensors
            shared[ref.storage] = _torch.StorageRef(installed.untyped_storage())
            self._undo.append(functools.partial(shared.pop, ref.storage, None))

    def buffer(self, slot: _Slot, new: torch.Tensor) -> torch.Tensor:
        """Put ``new`` where ``slot``'s buffer (or unregistered tensor) sits. A module
        outside the one materialized may hold it too: a later materialize puts ``new``
        there as well."""
        for home, name in slot.homes:
            old = home._buffers[name]
            home._buffers[name] = new
            self._undo.append(functools.partial(home._buffers.__setitem__, name, old))
        self._places(slot, new)
        _REPLACED[slot.tensor] = new
        self._undo.append(functools.partial(_REPLACED.pop, slot.tensor, None))
        return new

    def replacement(self, slot: _Slot, new: torch.Tensor) -> None:
        """Put ``new`` everywhere the module holds ``slot``'s parameter, which it replaces
        (a later materialize puts the same one where another module holds the old)."""
        for home, name in slot.homes:
            table = _table(home, name, slot.tensor)
            old = table[name]
            table[name] = new
            self._undo.append(functools.partial(table.__setitem__, name, old))
        self._places(slot, new)
        if slot.tensor not in _REPLACED:
            _REPLACED[slot.tensor] = new
            self._undo.append(functools.partial(_REPLACED.pop, slot.tensor, None))

    def _places(self, slot: _Slot, new: torch.Tensor) -> None:
        """Put ``new`` where the module holds ``slot``'s tensor unregistered."""
        for container, key in slot.places:
            if isinstance(container, _FIXED):
                continue  # refused when wanted; left as it is when emptied
            old = _read(container, key)
            _write(container, key, new)
            self._undo.append(functools.partial(_write, container, key, old))

    def uninitialised(self, slot: _Slot) -> None:
        """A lazy module's uninitialised tensor, recreated on the device (what eager
        construction has there: no value until the module's first forward)."""
        new = moved_parameter(slot.tensor, self.device)  # type: ignore[arg-type]
        for home, name in slot.homes:
            held = _table(home, name, slot.tensor)
            old = held[name]
            held[name] = new
            self._undo.append(functools.partial(held.__setitem__, name, old))

    def empty(self, slot: _Slot) -> None:
        self._put(slot, torch.empty_like(slot.tensor, device=self.device))

    def _put(self, slot: _Slot, value: torch.Tensor) -> torch.Tensor:
        """Install ``value`` for ``slot``; returns the tensor that now holds it."""
        tensor = slot.tensor
        entry = slot.entry
        if entry is not None and not entry.installed:  # what its slots hold now is eager's
            entry.installed = True
            self._undo.append(functools.partial(setattr, entry, "installed", False))
        if slot.kind == "parameter":
            held = recording.forget(tensor)  # swap_tensors refuses a weakly referenced tensor
            if held is not None:
                self._undo.append(functools.partial(recording.remember, tensor, held))
        if _is_dtensor(tensor):
            value = _local_shard(tensor, value)
            self._sharded.add(id(tensor))
        if slot.kind != "parameter" and not _is_dtensor(tensor):
            new_buffer = value.detach()
            if type(tensor) is not torch.Tensor:  # a tensor subclass: keep its class
                new_buffer = _torch.make_subclass(type(tensor), new_buffer, False)
            carry_attributes(tensor, new_buffer)  # Python attributes (a tag, a flag)
            if new_buffer.is_floating_point() or new_buffer.is_complex():
                new_buffer.requires_grad_(tensor.requires_grad)
                _carry_hooks(tensor, new_buffer)
            return self.buffer(slot, new_buffer)
        if _is_dtensor(tensor):
            new: torch.Tensor = nn.Parameter(value, requires_grad=tensor.requires_grad)
        else:
            new = _torch.make_subclass(type(tensor), value.detach(), tensor.requires_grad)
        carry_attributes(tensor, new)
        rnns = [home for home, _ in slot.homes if isinstance(home, nn.RNNBase)]
        for rnn in rnns:  # its weak references would stop swap_tensors; rebuilt below
            rnn._flat_weight_refs = []
        accumulating = _torch.use_count(tensor) == 2  # its AccumulateGrad node is alive
        if _swap(tensor, new):  # the same object: ties and optimizers keep it
            self._undo.append(functools.partial(_swap_back, tensor, new))
            if accumulating:
                self.accumulators.append(_named(slot))
            new = tensor
        else:
            # a weak reference, a view or an autograd graph holds it, so swap_tensors
            # cannot replace it in place: the new parameter goes everywhere the old one was
            _carry_hooks(tensor, new)
            self.replacement(slot, new)
            self.replaced.append(_named(slot))
        for rnn in rnns:
            rnn._init_flat_weights()
        return new

    def finish(self) -> None:
        if self._sharded:
            _reset_fsdp(self.module, self._sharded)

    def undo(self) -> None:
        for step in reversed(self._undo):
            step()
        self._undo = []


def _swap(tensor: torch.Tensor, new: torch.Tensor) -> bool:
    """``torch.utils.swap_tensors(tensor, new)`` where torch allows it (it checks first),
    with each object's gradient hooks kept working."""
    if weakref.getweakrefs(tensor) or _torch.use_count(tensor) > 2:
        return False
    try:
        torch.utils.swap_tensors(tensor, new)
    except RuntimeError:  # a second holder swap_tensors found: nothing was swapped
        return False
    _rehook(tensor)
    _rehook(new)
    return True


def _swap_back(tensor: torch.Tensor, new: torch.Tensor) -> None:
    torch.utils.swap_tensors(tensor, new)
    _rehook(tensor)
    _rehook(new)


# A tensor's gradient hooks live in two places: the Python object's dicts (these
# attributes) and, registered from them, its implementation's autograd metadata.
# swap_tensors gives the object another implementation and leaves the hooks on the old
# one; assigning the dicts again registers them on the new one.
_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _rehook(tensor: torch.Tensor) -> None:
    for attribute in _HOOKS:
        hooks = getattr(tensor, attribute)
        if hooks is not None:
            setattr(tensor, attribute, hooks)


def _carry_hooks(tensor: torch.Tensor, new: torch.Tensor) -> None:
    """Give ``new`` the gradient hooks registered on ``tensor``, which it replaces (the
    same dicts: the handles their registration returned still remove them)."""
    for attribute in _HOOKS:
        hooks = getattr(tensor, attribute)
        if hooks is not None:
            setattr(new, attribute, hooks)


def _table(home: nn.Module, name: str, tensor: torch.Tensor) -> dict[str, Any]:
    """The table of ``home`` (``_parameters`` or ``_buffers``) holding ``tensor`` as
    ``name``."""
    parameters = home._parameters  # a ScriptModule's is a wrapper without .get
    held = parameters[name] if name in parameters else None  # noqa: SIM401
    return parameters if held is tensor else home._buffers


def _local_shard(tensor: Any, value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the full ``value`` of DTensor ``tensor`` (a DTensor)."""
    from torch.distributed.tensor import DTensor

    shape, offset = _torch.local_shape_and_offset(tensor)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    local = value[index].clone(memory_format=torch.contiguous_format)
    return DTensor.from_local(
        local,
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=tensor.shape,
        stride=tensor.stride(),
    )


def _reset_fsdp(module: nn.Module, swapped: set[int]) -> None:
    """FSDP2 keeps its own view of each sharded parameter's local data: refresh it."""
    for sub in module.modules():
        state = getattr(sub, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            if id(fsdp_param.sharded_param) in swapped:
                fsdp_param.reset_sharded_param()


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:
        return -1


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
