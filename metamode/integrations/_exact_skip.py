"""A thread-scoped ``no_init_weights`` that skips exactly what the library's own skips
(diffusers, transformers 4.x). Why: docs/design.md, "Shims".
"""

from __future__ import annotations

import dis
import sys
import weakref
from types import CodeType, FrameType, FunctionType
from typing import Any

import torch
import torch.overrides

from metamode._core.modes import ThreadScopedMode
from metamode._core.facts import VALUE_WRITING_METHOD_NAMES
from metamode._core.skip_rule import split_target

__all__ = ["SkipLibraryInit", "library_init_names"]

_INIT_DICT = vars(torch.nn.init)
_OVERRIDES_DICT = vars(torch.overrides)
# In-place methods the torch.nn.init functions write values with.
_WRITING_METHODS = frozenset(
    getattr(torch.Tensor, name) for name in (*VALUE_WRITING_METHOD_NAMES, "copy_")
)
_CALLS = frozenset(("CALL", "CALL_FUNCTION_EX", "CALL_KW"))
_ATTRIBUTE_LOADS = frozenset(("LOAD_ATTR", "LOAD_METHOD"))
# code object -> {offset of a call: the attribute name its callee ends with, or None}
_CALLEE_NAMES: weakref.WeakKeyDictionary[CodeType, dict[int, str | None]] = (
    weakref.WeakKeyDictionary()
)


def library_init_names(module: Any) -> frozenset[str]:
    """The ``torch.nn.init`` names a library's ``no_init_weights`` replaces.

    Read from its ``TORCH_INIT_FUNCTIONS``; raises ``AttributeError`` if absent.
    """
    return frozenset(str(name) for name in module.TORCH_INIT_FUNCTIONS)


def _callee_names(code: CodeType) -> dict[int, str | None]:
    names = _CALLEE_NAMES.get(code)
    if names is None:
        names = {}
        instructions = list(dis.get_instructions(code))
        for index, call in enumerate(instructions):
            if call.opname not in _CALLS or call.positions is None:
                continue
            start = (call.positions.lineno, call.positions.col_offset)
            best: tuple[Any, str | None] = ((-1, -1), None)
            for load in instructions[:index]:
                pos = load.positions
                if (
                    not load.opname.startswith("LOAD_")
                    or pos is None
                    or (pos.lineno, pos.col_offset) != start
                ):
                    continue
                end = (pos.end_lineno or -1, pos.end_col_offset or -1)
                if end > best[0]:
                    name = load.argval if load.opname in _ATTRIBUTE_LOADS else None
                    best = (end, name)
            # f_lasti is the call's own offset or (3.11+) its last inline cache entry.
            names[call.offset] = best[1]
            if index + 1 < len(instructions):
                names[instructions[index + 1].offset - 2] = best[1]
        _CALLEE_NAMES[code] = names
    return names


def _is_dispatch(frame: FrameType) -> bool:
    return frame.f_globals is _OVERRIDES_DICT or frame.f_code.co_name == "__torch_function__"


def _called_by_name(frame: FrameType | None, names: frozenset[str]) -> bool:
    """True if the innermost ``torch.nn.init`` call around ``frame`` was made as
    ``<expr>.NAME(...)`` with ``NAME`` in ``names``."""
    entry = None
    while frame is not None:
        if frame.f_globals is _INIT_DICT:
            entry = frame
        elif not _is_dispatch(frame):
            break
        frame = frame.f_back
    if entry is None or frame is None:
        return False
    name = _callee_names(frame.f_code).get(frame.f_lasti)
    if name is None or name not in names:
        return False
    function = _INIT_DICT.get(name)
    return getattr(function, "__code__", None) is entry.f_code


class SkipLibraryInit(ThreadScopedMode):
    """``no_init_weights`` for one library, in the calling thread only.

    A call is skipped when its call site's expression was ``<something>.NAME(...)`` with
    ``NAME`` in ``names`` and ``torch.nn.init.NAME`` the function being run, read from the
    site's bytecode positions; the frames are inspected only for the candidate calls
    (``uniform_``, ``normal_``, ``constant_``, ``kaiming_uniform_``, and the in-place
    methods the other init functions run). A skipped call returns its tensor unchanged,
    writes nothing and draws no random numbers; everything else runs. Differences from
    stock: README, "Limitations"; also, another torch-function mode's helper frames between
    the call site and ``torch.nn.init`` hide the site, and the call then runs.
    """

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__()
        self.names = names

    def _settings(self) -> tuple:
        return (self.names,)

    def __repr__(self) -> str:
        return f"metamode.integrations._exact_skip.SkipLibraryInit({sorted(self.names)})"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._inert:
            return func(*args, **kwargs)
        candidate = func in _WRITING_METHODS or (
            type(func) is FunctionType and func.__globals__ is _INIT_DICT
        )
        if candidate and _called_by_name(sys._getframe(1), self.names):
            target, _ = split_target(args, kwargs)
            return target
        return func(*args, **kwargs)
