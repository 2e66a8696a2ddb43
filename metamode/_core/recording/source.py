"""The source a frame runs, read to follow a value: each file's syntax tree (as
``linecache`` holds it), the expression an instruction is at (its ``co_positions()``
entry), the reads of a name, and attribute reads that run none of the program's code."""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import CodeType, FrameType, FunctionType
from typing import Any

import torch

__all__ = [
    "NotRead",
    "Source",
    "assigned_once",
    "loads",
    "local_names",
    "name_of",
    "node_at",
    "read",
    "source_of",
]

# attribute kinds whose reading runs no Python code (a property of torch's aside)
_PASSIVE = (
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.BuiltinFunctionType,
    types.ClassMethodDescriptorType,
    FunctionType,
)
_SLOTS = (types.WrapperDescriptorType, types.MethodDescriptorType, types.BuiltinFunctionType)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module, ast.ClassDef)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


@dataclass
class Source:
    """A file's syntax tree, with each node's parent and the expressions by their span."""

    tree: ast.Module
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    spans: dict[tuple[int, int, int, int], ast.expr] = field(default_factory=dict)
    # where an attribute read ends -> the read (an instruction of one spread over lines
    # spans its last line only)
    ends: dict[tuple[int, int], ast.Attribute] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for parent in ast.walk(self.tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
                if isinstance(child, ast.expr) and child.end_lineno is not None:
                    end = (child.end_lineno, child.end_col_offset or 0)
                    self.spans[(child.lineno, end[0], child.col_offset, end[1])] = child
                    if isinstance(child, ast.Attribute):
                        self.ends[end] = child

    def at(self, span: tuple[Any, ...]) -> ast.expr | None:
        """The expression of ``span`` (lines, then columns), or the attribute read ending
        where it does."""
        return self.spans.get(span) or self.ends.get((span[1], span[3]))

    def scope(self, node: ast.AST) -> ast.AST:
        """The function, lambda, class body or module whose names ``node`` reads."""
        while not isinstance(node, _SCOPES):
            node = self.parents[node]
        return node

    def holder(self, node: ast.AST, name: str) -> ast.AST:
        """Where the name ``name``, stored at ``node``, is read back: the comprehension or
        the function, lambda, class body or module whose name it is (the module for a
        ``global`` one, the enclosing function binding a ``nonlocal`` one)."""
        inner = node
        while not isinstance(inner, _SCOPES):
            if isinstance(inner, _COMPREHENSIONS) and _binds(inner, name):
                return inner
            inner = self.parents[inner]
        scope: ast.AST = inner
        if _declares(scope, name, ast.Global):
            return self.tree
        if _declares(scope, name, ast.Nonlocal):  # the nearest enclosing function binding it
            while scope is not self.tree and not (
                _binds(scope, name) and not _declares(scope, name, ast.Nonlocal)
            ):
                scope = self.scope(self.parents[scope])
        return scope

    def owner(self, node: ast.Attribute | ast.Subscript) -> ast.AST:
        """Where ``self.x`` or ``table[key]``, stored at ``node``, is read back: the class
        for an attribute of a method's first parameter, else the function."""
        root: ast.expr = node
        while isinstance(root, ast.Attribute | ast.Subscript):
            root = root.value
        scope = self.scope(node)
        if (
            isinstance(root, ast.Name)
            and isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef)
            and scope.args.args[:1]
            and scope.args.args[0].arg == root.id
            and isinstance(self.parents.get(scope), ast.ClassDef)
        ):
            return self.parents[scope]
        return scope

    def definition(self, code: CodeType) -> ast.AST | None:
        """The function or lambda node that compiled to ``code``, if exactly one does."""
        found = [
            node
            for node in ast.walk(self.tree)
            if isinstance(node, _FUNCTIONS)
            and name_of(node) == code.co_name
            and code.co_firstlineno in _first_lines(node)
        ]
        if len(found) > 1:  # lambdas on one line: the one whose span holds the code's own
            spans = [p for p in code.co_positions() if None not in p and p[3] > p[2]]  # type: ignore[operator]
            found = [node for node in found if spans and _holds(node, spans[0])]
        return found[0] if len(found) == 1 else None


_SOURCES: dict[str, tuple[list[str], Source | None]] = {}


def source_of(code: CodeType) -> Source | None:
    """The file ``code`` was compiled from, as ``linecache`` holds it now (nothing for
    ``exec``'d strings); None if it does not parse."""
    lines = linecache.getlines(code.co_filename)
    known = _SOURCES.get(code.co_filename)
    if known is not None and known[0] is lines:
        return known[1]
    try:
        source: Source | None = Source(ast.parse("".join(lines)))
    except (SyntaxError, ValueError):
        source = None
    if lines:
        _SOURCES[code.co_filename] = (lines, source)
    return source


@functools.lru_cache(maxsize=512)
def _positions(code: CodeType) -> tuple[tuple[int | None, ...], ...]:
    return tuple(code.co_positions())


def node_at(frame: FrameType) -> tuple[Source, ast.expr] | None:
    """The expression whose instruction ``frame`` is running (or calling from, its
    ``f_lasti`` resting on one of the instruction's cache entries), in its source."""
    source = source_of(frame.f_code)
    positions = _positions(frame.f_code)
    at = positions[frame.f_lasti // 2] if frame.f_lasti // 2 < len(positions) else None
    if source is None or at is None or None in at:
        return None
    node = source.at(at)
    return (source, node) if node is not None else None


def _holds(node: ast.AST, span: tuple[Any, ...]) -> bool:
    start = (node.lineno, node.col_offset)  # type: ignore[attr-defined]
    end = (node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
    return start <= (span[0], span[2]) and (span[1], span[3]) <= end


def name_of(node: ast.AST) -> str:
    return "<lambda>" if isinstance(node, ast.Lambda) else getattr(node, "name", "")


def _first_lines(node: ast.AST) -> set[int]:
    lines = {node.lineno} if isinstance(node, ast.stmt | ast.expr) else set()
    lines.update(d.lineno for d in getattr(node, "decorator_list", ()))
    return lines


def loads(scope: ast.AST, name: str) -> Iterator[ast.Name]:
    """The reads of ``name`` in ``scope``, past nested functions and comprehensions that
    bind a name of their own so spelt."""
    for child in ast.iter_child_nodes(scope):
        if isinstance(child, ast.Name):
            if child.id == name and isinstance(child.ctx, ast.Load):
                yield child
        elif not _binds(child, name):
            yield from loads(child, name)


def _binds(node: ast.AST, name: str) -> bool:
    """Whether ``node`` (a function or comprehension) has a name ``name`` of its own."""
    if isinstance(node, _FUNCTIONS):
        return name in local_names(node) and not _declares(node, name, ast.Global | ast.Nonlocal)
    if isinstance(node, _COMPREHENSIONS):
        return any(
            isinstance(target, ast.Name) and target.id == name
            for generator in node.generators
            for target in ast.walk(generator.target)
        )
    return False


def _declares(scope: ast.AST, name: str, kind: Any) -> bool:
    return any(isinstance(n, kind) and name in n.names for n in _own_nodes(scope))


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope``'s body, not of the functions and classes defined in it."""
    for child in ast.iter_child_nodes(scope):
        yield child
        if not isinstance(child, (*_FUNCTIONS, ast.ClassDef)):
            yield from _own_nodes(child)


def _parameters(function: ast.AST) -> set[str]:
    arguments = function.args  # type: ignore[attr-defined]
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
    return {a.arg for a in every}


def local_names(function: ast.AST) -> set[str]:
    """The parameters of ``function`` and the names its own body stores."""
    stored = (n for n in _own_nodes(function) if isinstance(n, ast.Name))
    return _parameters(function) | {n.id for n in stored if not isinstance(n.ctx, ast.Load)}


def assigned_once(function: ast.AST) -> dict[str, ast.expr]:
    """The locals ``function``'s own body stores once, by ``name = value`` (annotated or
    not), and their value."""
    stores: dict[str, int] = dict.fromkeys(_parameters(function), 2)
    values: dict[str, ast.expr] = {}
    for node in _own_nodes(function):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            stores[node.id] = stores.get(node.id, 0) + 1
        if isinstance(node, ast.Assign) and isinstance(target := node.targets[0], ast.Name):
            values[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            values[node.target.id] = node.value
    return {name: value for name, value in values.items() if stores.get(name) == 1}


class NotRead(Exception):
    """Reading the attribute would run code of the program's own."""


def read(value: Any, name: str) -> Any:
    """``value.name``, where reading it runs none of the build's code: a value of its own or
    its class's, a method, a C attribute, one of torch's properties, or a parameter, buffer
    or submodule of a module."""
    if not isinstance(inspect.getattr_static(type(value), "__getattribute__"), _SLOTS):
        raise NotRead(name)  # a class's own attribute lookup, in Python
    try:
        found = inspect.getattr_static(value, name)
    except AttributeError:
        if isinstance(value, torch.nn.Module) and (
            type(value).__getattr__ is torch.nn.Module.__getattr__
        ):
            return getattr(value, name)
        raise
    if isinstance(found, property):
        if getattr(found.fget, "__module__", "").split(".")[0] != "torch":
            raise NotRead(name)
    elif isinstance(found, classmethod | staticmethod):
        if not isinstance(found.__func__, FunctionType):  # a property wrapped, say
            raise NotRead(name)
    elif hasattr(type(found), "__get__") and not isinstance(found, _PASSIVE):
        raise NotRead(name)
    return getattr(value, name)
