"""The one list of intended global changes that torch and the libraries make.

Some libraries change ``torch.nn.Module`` on purpose and for good, and rely on
the change staying: ``torch.compile`` wraps ``Module.__init__`` and
``__setstate__`` once per process to tag new modules (and marks the class so
it never wraps them again), transformers 5 adds ``Module.smart_apply`` on the
first ``initialize_weights``. They are not leaks. :func:`metamode.doctor`
does not report them and its repair never undoes them, and
:func:`metamode._diagnostics.invariants.snapshot` (used by ``hammer``, the pytest plugin
and the test suite's guard) sees through them. Every entry has a test in
``tests/unit/diagnostics/test_known_changes.py`` that makes the real library perform it.

An entry is recognised by *where the replacement was compiled*: the module
that defines it (its ``__globals__`` is that module's dict) and its qualified
name, like :class:`metamode._diagnostics.originals.FunctionSlot` recognises torch's own.
A wrapper counts only if what it wraps (the named closure variable) is itself
torch's own or another recognised change.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import torch

__all__ = [
    "KNOWN_CHANGES",
    "KnownChange",
    "innermost_wrapper",
    "intended",
    "is_marker",
    "rewrap",
    "underlying",
]


@dataclass(frozen=True)
class KnownChange:
    """One intended change to an attribute of ``owner``.

    Attributes:
        what: what the change is for.
        who: who makes it (the function that assigns it).
        owner: the dotted name of the changed class or module.
        names: the attributes it assigns.
        module: the module whose code the new value is compiled in.
        qualname: the new value's ``__qualname__``.
        wraps: the closure variable holding the value it replaced, or None
            when the attribute is new (nothing wrapped).
        markers: attributes it also sets on ``owner`` as "already done" flags.
    """

    what: str
    who: str
    owner: str
    names: tuple[str, ...]
    module: str
    qualname: str
    wraps: str | None
    markers: tuple[str, ...] = ()

    def matches(self, value: object) -> bool:
        if not isinstance(value, types.FunctionType) or value.__qualname__ != self.qualname:
            return False
        home = sys.modules.get(self.module)
        return home is not None and value.__globals__ is vars(home)

    def wrapped(self, value: types.FunctionType) -> object:
        """What ``value`` wraps (``_NOTHING`` for an added attribute or an empty cell)."""
        if self.wraps is None:
            return _NOTHING
        cells = dict(zip(value.__code__.co_freevars, value.__closure__ or (), strict=True))
        try:
            return cells[self.wraps].cell_contents
        except (KeyError, ValueError):
            return _NOTHING


_NOTHING = object()
# The flag install_generation_tagging_init sets on Module once it has wrapped it: torch 2.13
# sets ___needs_generation_tag_patch = False, torch 2.15 ___has_generation_tag_patch = True.
_GENERATION_TAG_MARKERS = ("___needs_generation_tag_patch", "___has_generation_tag_patch")

KNOWN_CHANGES: tuple[KnownChange, ...] = (
    KnownChange(
        what="tags every new module with dynamo's generation counter (dynamic-module detection)",
        who="torch.compile: torch._dynamo.mutation_guard.install_generation_tagging_init",
        owner="torch.nn.Module",
        names=("__init__",),
        module="torch._dynamo.mutation_guard",
        qualname="install_generation_tagging_init.<locals>.patched_init",
        wraps="init",
        markers=_GENERATION_TAG_MARKERS,
    ),
    KnownChange(
        what="tags every unpickled module with dynamo's generation counter",
        who="torch.compile: torch._dynamo.mutation_guard.install_generation_tagging_init",
        owner="torch.nn.Module",
        names=("__setstate__",),
        module="torch._dynamo.mutation_guard",
        qualname="install_generation_tagging_init.<locals>.patched_setstate",
        wraps="setstate",
        markers=_GENERATION_TAG_MARKERS,
    ),
    KnownChange(
        what="adds Module.smart_apply, transformers' apply() for composite models' init",
        who="transformers 5: PreTrainedModel.initialize_weights (first call in the process)",
        owner="torch.nn.Module",
        names=("smart_apply",),
        module="transformers.modeling_utils",
        qualname="PreTrainedModel.initialize_weights.<locals>.smart_apply",
        wraps=None,
    ),
)

_OWNERS = {"torch.nn.Module": lambda: torch.nn.Module}


def _owner_label(owner: object) -> str | None:
    for label, get in _OWNERS.items():
        if get() is owner:
            return label
    return None


def intended(owner: object, name: str, value: object) -> KnownChange | None:
    """The entry that explains ``owner.name == value``, or None.

    A wrapper is explained only when what it wraps is torch's own or is
    itself explained (checked by the caller through :func:`underlying`).
    """
    label = _owner_label(owner)
    if label is None:
        return None
    for change in KNOWN_CHANGES:
        if change.owner == label and name in change.names and change.matches(value):
            return change
    return None


def underlying(owner: object, name: str, value: object) -> object:
    """``value`` with every recognised wrapper peeled off.

    For an added attribute (nothing wrapped) this is ``None``: the attribute
    is as if absent. Otherwise it is what the innermost recognised wrapper
    wraps -- torch's own function when only known changes were made.
    """
    seen = 0
    while seen < 8:
        change = intended(owner, name, value)
        if change is None:
            return value
        inner = change.wrapped(value)  # type: ignore[arg-type]
        if inner is _NOTHING:
            return None if change.wraps is None else value
        value, seen = inner, seen + 1
    return value


def innermost_wrapper(owner: object, name: str, value: object) -> tuple[KnownChange, object]:
    """The innermost recognised wrapper around ``owner.name``'s value, with its entry.

    Raises LookupError when ``value`` is not a recognised wrapper.
    """
    found = None
    for _ in range(8):
        change = intended(owner, name, value)
        if change is None or change.wraps is None:
            break
        found = (change, value)
        value = change.wrapped(value)  # type: ignore[arg-type]
    if found is None:
        raise LookupError(f"{name} is not wrapped by a known change")
    return found


def rewrap(change: KnownChange, wrapper: object, original: object) -> None:
    """Make the recognised ``wrapper`` wrap ``original``, keeping the wrapper itself."""
    code = wrapper.__code__  # type: ignore[attr-defined]
    cells = dict(zip(code.co_freevars, wrapper.__closure__ or (), strict=True))  # type: ignore[attr-defined]
    cells[change.wraps].cell_contents = original


def is_marker(owner: object, name: str) -> bool:
    """Whether ``name`` is a flag a known change sets on ``owner`` (never a finding)."""
    label = _owner_label(owner)
    return any(change.owner == label and name in change.markers for change in KNOWN_CHANGES)
