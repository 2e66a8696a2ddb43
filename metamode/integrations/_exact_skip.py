"""A thread-scoped ``no_init_weights`` that skips exactly what the library's own skips
(diffusers, transformers 4.x). Why: docs/design.md, "Shims".
"""

from __future__ import annotations

import ast
import itertools
import linecache
import sys
import weakref
from types import CodeType, FrameType, FunctionType
from typing import Any, NamedTuple

import torch
import torch.overrides

from metamode._core.facts import VALUE_WRITING_METHOD_NAMES
from metamode._core.modes import ThreadScopedMode
from metamode._core.skip_rule import split_target

__all__ = ["GuardLoadedTensors", "SkipLibraryInit", "library_init_names"]

_INIT_DICT = vars(torch.nn.init)
_OVERRIDES_DICT = vars(torch.overrides)
# In-place methods the torch.nn.init functions write values with.
_WRITING_METHODS = frozenset(
    getattr(torch.Tensor, name) for name in (*VALUE_WRITING_METHOD_NAMES, "copy_")
)


class _AttributeCall(NamedTuple):
    """A call expression ``<expr>.attr(...)`` in a source file (lines from 1, UTF-8 byte
    columns, as ``ast`` and ``co_positions()`` count them)."""

    lineno: int
    col_offset: int
    attr_lineno: int  # the line the attribute name ends on
    attr: str


# source file -> (the lines linecache gave, {end of a call `<expr>.attr(...)`: that call})
_ATTRIBUTE_CALLS: dict[str, tuple[list[str], dict[tuple[int, int], _AttributeCall]]] = {}
# code object -> {(its file, f_lasti of a call site): the attribute name its callee ends
# with, or None}. Keyed by file too: code objects compiled from the same text under two
# file names are equal keys.
_CALLEE_NAMES: weakref.WeakKeyDictionary[CodeType, dict[tuple[str, int], str | None]] = (
    weakref.WeakKeyDictionary()
)


def library_init_names(module: Any) -> frozenset[str]:
    """The ``torch.nn.init`` names a library's ``no_init_weights`` replaces.

    Read from its ``TORCH_INIT_FUNCTIONS``; raises ``AttributeError`` if absent.
    """
    return frozenset(str(name) for name in module.TORCH_INIT_FUNCTIONS)


def _attribute_calls(
    filename: str, module_globals: dict[str, Any]
) -> dict[tuple[int, int], _AttributeCall]:
    """The calls ``<expr>.attr(...)`` in ``filename``'s source, by where each ends; empty
    when there is no source or it does not parse."""
    lines = linecache.getlines(filename, module_globals)
    cached = _ATTRIBUTE_CALLS.get(filename)
    if cached is not None and cached[0] is lines:
        return cached[1]
    calls: dict[tuple[int, int], _AttributeCall] = {}
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        tree = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            end = (node.end_lineno or 0, node.end_col_offset or 0)
            attr_lineno = node.func.end_lineno or 0
            calls[end] = _AttributeCall(node.lineno, node.col_offset, attr_lineno, node.func.attr)
    if lines:
        _ATTRIBUTE_CALLS[filename] = (lines, calls)
    return calls


def _read_callee_name(frame: FrameType) -> str | None:
    code = frame.f_code
    # co_positions() has one entry per 2-byte code unit; f_lasti is a byte offset.
    positions = itertools.islice(code.co_positions(), frame.f_lasti // 2, None)
    lineno, end_lineno, col_offset, end_col_offset = next(positions, (None,) * 4)
    if lineno is None or end_lineno is None or col_offset is None or end_col_offset is None:
        return None
    call = _attribute_calls(code.co_filename, frame.f_globals).get((end_lineno, end_col_offset))
    if call is None or call.attr not in code.co_names:  # no such call, or stale source
        return None
    if (lineno, col_offset) == (call.lineno, call.col_offset):
        return call.attr
    # CPython starts a method call's position on its attribute name's line when that
    # line is not the call's first.
    if lineno == call.attr_lineno != call.lineno:
        return call.attr
    return None


def _callee_name(frame: FrameType) -> str | None:
    """The attribute name the call ``frame`` is making ends with, if it is a call
    expression ``<expr>.NAME(...)`` in ``frame``'s source; else None."""
    code = frame.f_code
    names = _CALLEE_NAMES.get(code)
    if names is None:
        names = _CALLEE_NAMES.setdefault(code, {})
    site = (code.co_filename, frame.f_lasti)
    try:
        return names[site]
    except KeyError:
        name = names[site] = _read_callee_name(frame)
        return name


def _is_dispatch(frame: FrameType) -> bool:
    return frame.f_globals is _OVERRIDES_DICT or frame.f_code.co_name == "__torch_function__"


def _called_by_name(
    frame: FrameType | None, names: frozenset[str], bare_in: tuple[dict, ...] = ()
) -> bool:
    """True if the innermost ``torch.nn.init`` call around ``frame`` was made as
    ``<expr>.NAME(...)`` with ``NAME`` in ``names``, or, from the code of a module whose
    globals are in ``bare_in``, through that module's global ``NAME``."""
    entry = None
    while frame is not None:
        if frame.f_globals is _INIT_DICT:
            entry = frame
        elif not _is_dispatch(frame):
            break
        frame = frame.f_back
    if entry is None or frame is None:
        return False
    name = _callee_name(frame)
    if name is None:
        if not any(frame.f_globals is module_globals for module_globals in bare_in):
            return False
        # A bare-name call: the global NAME of the caller's module that is this function.
        return any(
            getattr(frame.f_globals.get(n), "__code__", None) is entry.f_code
            and frame.f_globals.get(n) is _INIT_DICT.get(n)
            for n in names
        )
    if name not in names:
        return False
    function = _INIT_DICT.get(name)
    return getattr(function, "__code__", None) is entry.f_code


def _is_init_candidate(func: object) -> bool:
    return func in _WRITING_METHODS or (
        type(func) is FunctionType and func.__globals__ is _INIT_DICT
    )


class SkipLibraryInit(ThreadScopedMode):
    """``no_init_weights`` for one library, in the calling thread only.

    A call is skipped when its call site is, in the caller's source, a call expression
    ``<something>.NAME(...)`` with ``NAME`` in ``names`` and ``torch.nn.init.NAME`` the
    function being run. The site is the source position of the caller frame's current
    instruction (``co_positions()``); the expression is the ``ast.Call`` node of the
    caller's source file (``linecache``) that spans it. The frames are inspected only for
    the candidate calls (``uniform_``, ``normal_``, ``constant_``, ``kaiming_uniform_``,
    and the in-place methods the other init functions run). A skipped call returns its
    tensor unchanged, writes nothing and draws no random numbers; everything else runs.

    Where there is no source to read, the call runs (stock would skip it): code compiled
    from a string that ``linecache`` does not hold (``exec``, ``python -c``), files
    without their source (``.pyc`` only), positions without columns
    (``PYTHONNODEBUGRANGES``), and source that no longer matches the code (a call whose
    name the code does not use). An init function applied as a decorator
    (``@nn.init.normal_``) is not a call expression and runs too. Differences from stock:
    docs/limitations.md; also, another torch-function mode's helper frames between the
    call site and ``torch.nn.init`` hide the site, and the call then runs.
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
        if _is_init_candidate(func) and _called_by_name(sys._getframe(1), self.names):
            target, _ = split_target(args, kwargs)
            return target
        return func(*args, **kwargs)


class GuardLoadedTensors(ThreadScopedMode):
    """transformers 5's ``guard_torch_init_functions``, in the calling thread only.

    Stock assigns, for the duration of ``initialize_weights``, its own wrappers to the
    ``torch.nn.init`` functions named in ``names`` in ``torch.nn.init`` and in each module of
    ``modules`` (those imported); a wrapper leaves a tensor marked ``_is_hf_initialized``
    unchanged. This mode leaves such a tensor unchanged for a call that would reach a
    wrapper: a call expression ``<something>.NAME(...)`` running ``torch.nn.init.NAME``
    (the rule and the limits of :class:`SkipLibraryInit`), or a call through the global
    ``NAME`` of one of ``modules``. Everything else runs.
    """

    def __init__(self, names: frozenset[str], modules: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names
        self.modules = modules
        self._bare_in = tuple(vars(sys.modules[m]) for m in modules if m in sys.modules)

    def _settings(self) -> tuple:
        return (self.names, self.modules)

    def __repr__(self) -> str:
        return f"metamode.integrations._exact_skip.GuardLoadedTensors({sorted(self.names)})"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._inert or not _is_init_candidate(func):
            return func(*args, **kwargs)
        target, _ = split_target(args, kwargs)
        if getattr(target, "_is_hf_initialized", False) and _called_by_name(
            sys._getframe(1), self.names, self._bare_in
        ):
            return target
        return func(*args, **kwargs)
