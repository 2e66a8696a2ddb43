"""Which recorded program each registered tensor comes from. Weak: it keeps no tensor and
no module alive, only the programs their tensors belong to."""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from metamode._core.recording.held import Named
from metamode._core.recording.program import Program, TensorRef
from metamode._torch import DisableTorchFunction

__all__ = [
    "Entry",
    "add",
    "entry",
    "forget",
    "home",
    "homes_holding",
    "sweep",
    "weakly_held_elsewhere",
]


@dataclass(slots=True)
class Entry:
    """A tensor registered in a replayable context: its program, and, once the context
    exited, its view of the program's storages and its version counter then."""

    program: Program
    ref: TensorRef | None = None
    version: int = -1
    refused: str | None = None  # why its registration cannot be reproduced, if so
    # a real tensor never registered, found by its storage: the version counters the
    # build's tensors of that storage had (which of them it shares, torch does not say)
    versions: frozenset[int] | None = None
    impl: int = 0  # the address of the registered tensor's implementation
    grad: bool = False  # whether it had a .grad when its context exited
    installed: bool = False  # a materialize put its eager value where it was registered


# id(tensor) -> (what names it, entry). A strided tensor is named without a weak
# reference (swap_tensors refuses those): entries of tensors gone are swept as it grows.
_ENTRIES: dict[int, tuple[Any, Entry]] = {}
_SWEEP_AT = [1024]
# module -> {name: entry}: FSDP2's fully_shard puts new DTensor parameters in place of the
# registered ones; where they sit says what they stand for.
_HOMES: dict[int, tuple[weakref.ref, dict[str, Entry]]] = {}
_LOCK = threading.RLock()  # a weak-reference callback may run while it is held


def add(
    tensor: torch.Tensor,
    program: Program,
    module: Any = None,
    name: str | None = None,
    named: Named | None = None,
) -> Entry:
    """Note that ``tensor`` was registered while ``program`` recorded (``named``: what
    names it, if the caller has made it)."""
    found = Entry(program, impl=tensor._cdata)
    if named is None:
        named = _name(tensor)
    with _LOCK:  # a sweep may run in another thread
        _ENTRIES[id(tensor)] = (named, found)
    if len(_ENTRIES) >= _SWEEP_AT[0]:
        sweep()
    if module is not None and name is not None:
        home_key = id(module)
        homes = _HOMES.get(home_key)
        if homes is None or homes[0]() is not module:
            with _LOCK:
                homes = _HOMES.get(home_key)
                if homes is None or homes[0]() is not module:
                    module_ref = weakref.ref(module, lambda r: _drop(_HOMES, home_key, r))
                    homes = _HOMES[home_key] = (module_ref, {})
        homes[1][name] = found  # atomic
    return found


def _name(tensor: torch.Tensor) -> Any:
    with DisableTorchFunction():  # metamode's own read, not the build's
        strided = tensor.layout is torch.strided
    if strided:
        return Named(tensor)
    key = id(tensor)
    return _Weak(tensor, lambda r: _drop(_ENTRIES, key, r))


class _Weak(weakref.ref):
    """A weak reference answering like :class:`Named` (a tensor without strided storage)."""

    __slots__ = ()

    def of(self, tensor: torch.Tensor) -> bool:
        return self() is tensor

    def expired(self) -> bool:
        return self() is None


def sweep() -> None:
    """Drop the entries of tensors that are gone (a strided tensor is named without a weak
    reference, so nothing drops them as it dies), and the closed programs none of whose
    storages is alive, and with them what only they kept alive."""
    with _LOCK:
        for key, held in list(_ENTRIES.items()):
            if held[0].expired():
                _ENTRIES.pop(key, None)  # under the lock: no add in between
        _SWEEP_AT[0] = max(1024, 2 * len(_ENTRIES))
        for serial, program in list(_CLOSED.items()):
            if not any(not keep.expired() for _, keep in program.live.values()):
                del _CLOSED[serial]


def _drop(table: dict | None, key: int, ref: weakref.ref) -> None:
    if table is None or _LOCK is None:  # interpreter shutdown: the module's globals are gone
        return
    with _LOCK:
        held = table.get(key)
        if held is not None and held[0] is ref:
            del table[key]


def entry(tensor: torch.Tensor) -> Entry | None:
    with _LOCK:
        held = _ENTRIES.get(id(tensor))
    return held[1] if held is not None and held[0].of(tensor) else None


def home(module: Any, name: str) -> Entry | None:
    """The entry of the tensor registered as ``module.<name>``."""
    with _LOCK:
        held = _HOMES.get(id(module))
    if held is None or held[0]() is not module:
        return None
    return held[1].get(name)


def homes_holding(tensor: torch.Tensor) -> list[tuple[Any, str]]:
    """``(module, name)`` of each module that holds ``tensor`` as a parameter or buffer under
    a name a replayable block registered a tensor there."""
    with _LOCK:
        homes = list(_HOMES.values())
    found = []
    for module_ref, names in homes:
        module = module_ref()
        if module is None:
            continue
        for name in list(names):
            held = module._parameters.get(name, module._buffers.get(name))
            if held is tensor:
                found.append((module, name))
    return found


def weakly_held_elsewhere(tensor: torch.Tensor) -> bool:
    """Whether something besides this registry holds a weak reference to ``tensor``."""
    with _LOCK:
        held = _ENTRIES.get(id(tensor))
    ours = held[0] if held is not None and held[0].of(tensor) else None
    return any(ref is not ours for ref in weakref.getweakrefs(tensor))


# serial -> a program whose recording ended, held while a storage it knows is alive: a
# tensor made in the build and never registered (a deep copy of a built module) still
# needs it when the tensors registered with it are gone
_CLOSED: dict[int, Program] = {}


def closed(program: Program) -> None:
    """``program``'s recording ended; it may hold storages of tensors never registered."""
    with _LOCK:
        _CLOSED[program.serial] = program


def closed_programs() -> list[Program]:
    """Every program whose recording ended and that is still needed (after a
    :func:`sweep`: one some storage it knows or some registered tensor keeps alive)."""
    sweep()
    with _LOCK:
        return list(_CLOSED.values())


def forget(tensor: torch.Tensor) -> Entry | None:
    """``tensor`` was materialized: it stands for no recording any more. Returns the entry
    it had, for :func:`remember`."""
    with _LOCK:
        held = _ENTRIES.get(id(tensor))
        if held is not None and held[0].of(tensor):
            del _ENTRIES[id(tensor)]
            return held[1]
    return None


def remember(tensor: torch.Tensor, found: Entry) -> None:
    """Undo :func:`forget`: ``tensor`` stands for ``found`` again."""
    with _LOCK:
        _ENTRIES[id(tensor)] = (_name(tensor), found)


def _after_fork_in_child() -> None:
    # a thread of the parent that held one of these does not exist in the child
    _LOCK._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_after_fork_in_child)
