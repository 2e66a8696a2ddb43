"""Which recorded program each registered tensor comes from. Weak: it keeps no tensor and
no module alive, only the programs their tensors belong to."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from metamode._core.recording.program import Program, TensorRef

__all__ = ["Entry", "add", "entry", "forget", "home", "weakly_held_elsewhere"]


@dataclass(slots=True)
class Entry:
    """A tensor registered in a replayable context: its program, and, once the context
    exited, its view of the program's storages and its version counter then."""

    program: Program
    ref: TensorRef | None = None
    version: int = -1
    refused: str | None = None  # why its registration cannot be reproduced, if so


_ENTRIES: dict[int, tuple[weakref.ref, Entry]] = {}
# module -> {name: entry}: FSDP2's fully_shard puts new DTensor parameters in place of the
# registered ones; where they sit says what they stand for.
_HOMES: dict[int, tuple[weakref.ref, dict[str, Entry]]] = {}
_LOCK = threading.RLock()  # a weak-reference callback may run while it is held


def add(
    tensor: torch.Tensor, program: Program, module: Any = None, name: str | None = None
) -> Entry:
    """Note that ``tensor`` was registered while ``program`` recorded."""
    found = Entry(program)
    key = id(tensor)
    _ENTRIES[key] = (weakref.ref(tensor, lambda r: _drop(_ENTRIES, key, r)), found)  # atomic
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
    return held[1] if held is not None and held[0]() is tensor else None


def home(module: Any, name: str) -> Entry | None:
    """The entry of the tensor registered as ``module.<name>``."""
    with _LOCK:
        held = _HOMES.get(id(module))
    if held is None or held[0]() is not module:
        return None
    return held[1].get(name)


def weakly_held_elsewhere(tensor: torch.Tensor) -> bool:
    """Whether something besides this registry holds a weak reference to ``tensor``."""
    with _LOCK:
        held = _ENTRIES.get(id(tensor))
    ours = held[0] if held is not None and held[0]() is tensor else None
    return any(ref is not ours for ref in weakref.getweakrefs(tensor))


_CLOSED: weakref.WeakSet[Program] = weakref.WeakSet()


def closed(program: Program) -> None:
    """``program``'s recording ended; it may hold storages of tensors never registered."""
    with _LOCK:
        _CLOSED.add(program)


def closed_programs() -> list[Program]:
    """Every program whose recording ended and that is still alive."""
    with _LOCK:
        return list(_CLOSED)


def forget(tensor: torch.Tensor) -> Entry | None:
    """``tensor`` was materialized: it stands for no recording any more. Returns the entry
    it had, for :func:`remember`."""
    with _LOCK:
        held = _ENTRIES.get(id(tensor))
        if held is not None and held[0]() is tensor:
            del _ENTRIES[id(tensor)]
            return held[1]
    return None


def remember(tensor: torch.Tensor, found: Entry) -> None:
    """Undo :func:`forget`: ``tensor`` stands for ``found`` again."""
    key = id(tensor)
    ref = weakref.ref(tensor, lambda r: _drop(_ENTRIES, key, r))
    with _LOCK:
        _ENTRIES[key] = (ref, found)
