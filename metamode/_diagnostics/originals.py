"""Recognising torch's own functions by where they are defined, and getting them back once
replaced; used by :func:`metamode.doctor`. How and why: docs/design.md, "doctor and originals".
"""

from __future__ import annotations

import ast
import functools
import gc
import inspect
import os
import sys
import types
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import FunctionType, ModuleType
from typing import Any

import torch

from metamode._torch import VariableFunctions

__all__ = [
    "FunctionSlot",
    "builtin_original",
    "class_layout",
    "defined_in_torch",
    "describe",
    "imported_from",
    "public_functions",
    "recover_all",
]

_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
_WALK_DEPTH = 8


@functools.lru_cache(maxsize=4096)
def _in_torch_dir(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_TORCH_DIR)


def defined_in_torch(obj: object) -> bool:
    """Whether ``obj`` was defined by torch (code in torch's package, or a torch C object)."""
    code = getattr(obj, "__code__", None)
    if isinstance(code, types.CodeType):
        return _in_torch_dir(code.co_filename)
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        module = getattr(type(obj), "__module__", "") or ""
    return module == "torch" or module.startswith("torch.")


def describe(obj: object) -> str:
    """``module.qualname (file:line)`` of a function, or the type of anything else.

    This is how the doctor names a culprit: a replacement's own module and
    qualified name say who defined it (``peft.utils.integrations.
    _init_on_device.<locals>.register_empty_parameter``).
    """
    if isinstance(obj, functools.partial):
        return f"functools.partial({describe(obj.func)})"
    if isinstance(obj, types.MethodType):
        return f"bound method {describe(obj.__func__)}"
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if isinstance(qualname, str) and (isinstance(obj, type) or callable(obj)):
        name = f"{module}.{qualname}" if module else qualname
        code = getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType):
            name += f" ({code.co_filename}:{code.co_firstlineno})"
        return name
    kind = type(obj)
    return f"a {kind.__module__}.{kind.__qualname__} object"


def builtin_original(name: str) -> object | None:
    """torch's own C function ``torch.<name>``, from its C function table."""
    return getattr(VariableFunctions, name, None)


# -- Python functions ---------------------------------------------------------


@dataclass(frozen=True)
class FunctionSlot:
    """A Python function as torch defines it: home module and qualified name.

    ``qualname`` is ``"Module.register_parameter"`` for a method of class ``Module``
    defined in ``home``, ``"uniform_"`` for a module-level function. An object is the
    original when it is a function of that qualified name compiled in ``home``'s namespace
    (or torch's own decorator around one).
    """

    home: ModuleType
    qualname: str

    @property
    def label(self) -> str:
        return f"{self.home.__name__}.{self.qualname}"

    def is_original(self, obj: object) -> bool:
        if not isinstance(obj, FunctionType) or obj.__qualname__ != self.qualname:
            return False
        if obj.__globals__ is vars(self.home):
            return True
        # Decorated by torch itself: the outer function is torch's code and
        # what it wraps was compiled in the home module.
        if not _in_torch_dir(obj.__code__.co_filename):
            return False
        inner = inspect.unwrap(obj)
        return isinstance(inner, FunctionType) and inner.__globals__ is vars(self.home)


def recover_all(
    slots: Iterable[FunctionSlot], currents: dict[FunctionSlot, object] | None = None
) -> dict[FunctionSlot, tuple[FunctionType, str]]:
    """Recover several originals with at most one pass over the heap.

    Returns slot -> (function, how it was found), tried in this order: inside the
    replacement (closures, defaults, partials, ``__wrapped__``), anywhere still referenced
    in the process (both give the original object), recompiled from torch's source file
    when it still matches the loaded code (a new, equivalent object). Slots not recovered
    are absent.
    """
    currents = currents or {}
    found: dict[FunctionSlot, tuple[FunctionType, str]] = {}
    slots = list(dict.fromkeys(slots))
    for slot in slots:
        original = _walk_for(slot, currents.get(slot))
        if original is not None:
            found[slot] = (original, "found inside the replacement")
    missing = [slot for slot in slots if slot not in found]
    if missing:
        for slot, original in _search_heap(missing).items():
            found[slot] = (original, "found still referenced elsewhere in the process")
    for slot in slots:
        if slot not in found:
            rebuilt = _rebuild_from_source(slot)
            if rebuilt is not None:
                found[slot] = (
                    rebuilt,
                    f"recompiled from {rebuilt.__code__.co_filename}: nothing referenced the "
                    f"original any more",
                )
    return found


def _held_by(obj: object) -> Iterator[object]:
    """What a wrapper keeps a reference to: the places a patch stores the original."""
    if isinstance(obj, FunctionType):
        for cell in obj.__closure__ or ():
            try:
                yield cell.cell_contents
            except ValueError:  # empty cell
                continue
        yield from obj.__defaults__ or ()
        yield from (obj.__kwdefaults__ or {}).values()
    elif isinstance(obj, types.MethodType):
        yield obj.__func__
    elif isinstance(obj, functools.partial):
        yield obj.func
        yield from obj.args
        yield from obj.keywords.values()
    elif isinstance(obj, (tuple, list, set, frozenset)):
        yield from obj
    elif isinstance(obj, dict):
        yield from obj.values()
    namespace = getattr(obj, "__dict__", None)
    if isinstance(namespace, dict) and "__wrapped__" in namespace:
        yield namespace["__wrapped__"]


def _walk_for(slot: FunctionSlot, start: object) -> FunctionType | None:
    if start is None:
        return None
    seen: set[int] = set()
    queue: deque[tuple[object, int]] = deque([(start, 0)])
    while queue:
        obj, depth = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if slot.is_original(obj):
            return obj  # type: ignore[return-value]
        if depth < _WALK_DEPTH:
            queue.extend((held, depth + 1) for held in _held_by(obj))
    return None


def _search_heap(slots: list[FunctionSlot]) -> dict[FunctionSlot, FunctionType]:
    # Keyed on (globals, qualname): a cheap filter, confirmed by is_original.
    wanted = {(id(vars(slot.home)), slot.qualname): slot for slot in slots}
    found: dict[FunctionSlot, FunctionType] = {}
    for obj in gc.get_objects():
        if type(obj) is FunctionType:
            slot = wanted.get((id(obj.__globals__), obj.__qualname__))
            if slot is not None and slot not in found and slot.is_original(obj):
                found[slot] = obj
                if len(found) == len(wanted):
                    break
    return found


# -- torch's source -----------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _parsed(filename: str) -> ast.Module | None:
    try:
        with open(filename, encoding="utf-8") as source:
            return ast.parse(source.read(), filename)
    except (OSError, SyntaxError, ValueError):
        return None


def _source_tree(module: ModuleType) -> ast.Module | None:
    filename = getattr(module, "__file__", None)
    if not filename or not filename.endswith(".py"):
        return None
    return _parsed(filename)


def _defs(body: list[ast.stmt]) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    # Later definitions win, as when the body runs (``@overload`` stubs first).
    return {
        node.name: node
        for node in body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _class_node(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def class_layout(cls: type) -> dict[str, FunctionSlot] | None:
    """Attribute name -> the function torch binds there, read from ``cls``'s source.

    Covers methods (``register_parameter`` -> ``Module.register_parameter``)
    and names bound to another function in the class body (``__call__ =
    _wrapped_call_impl``, ``forward = _forward_unimplemented``). None when the
    source is unavailable.
    """
    home = sys.modules.get(cls.__module__)
    tree = None if home is None else _source_tree(home)
    node = None if tree is None else _class_node(tree, cls.__name__)
    if home is None or tree is None or node is None:
        return None
    module_defs = _defs(tree.body)
    class_defs = _defs(node.body)
    layout = {name: FunctionSlot(home, f"{cls.__qualname__}.{name}") for name in class_defs}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            targets, value = [stmt.target], stmt.value
        elif isinstance(stmt, ast.Assign):
            targets, value = [t for t in stmt.targets if isinstance(t, ast.Name)], stmt.value
        else:
            continue
        if not isinstance(value, ast.Name):
            continue
        if value.id in class_defs:
            slot = FunctionSlot(home, f"{cls.__qualname__}.{value.id}")
        elif value.id in module_defs:
            slot = FunctionSlot(home, value.id)
        else:
            continue
        for target in targets:
            layout[target.id] = slot
    return layout


def public_functions(module: ModuleType) -> list[str] | None:
    """Names of the public functions ``module``'s source defines at top level."""
    tree = _source_tree(module)
    if tree is None:
        return None
    return [name for name in _defs(tree.body) if not name.startswith("_")]


def imported_from(module: ModuleType, name: str) -> tuple[str, str] | None:
    """``(source module, source name)`` if ``module`` does ``from X import name``.

    Relative imports are resolved. None if it does not, or the source is
    unavailable.
    """
    tree = _source_tree(module)
    if tree is None:
        return None
    package = module.__name__ if hasattr(module, "__path__") else module.__name__.rpartition(".")[0]
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            source = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, source] if source else base)
            return source, alias.name
    return None


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _source_matches(slot: FunctionSlot, tree: ast.Module) -> bool:
    """Whether the file on disk is the one the module was loaded from.

    Checked on the functions of the same module (or class) that are still
    torch's own: their first lines must be where the file defines them. An
    upgrade of torch in place, under a running process, fails this.
    """
    outer, _, _ = slot.qualname.rpartition(".")
    values: Mapping[str, Any]
    if outer:
        node = _class_node(tree, outer)
        namespace = getattr(slot.home, outer, None)
        if node is None or not isinstance(namespace, type):
            return False
        defs, values, prefix = _defs(node.body), vars(namespace), f"{outer}."
    else:
        defs, values, prefix = _defs(tree.body), vars(slot.home), ""
    checked = 0
    for name, definition in defs.items():
        value = values.get(name)
        sibling = FunctionSlot(slot.home, prefix + name)
        if value is None or sibling == slot or not sibling.is_original(value):
            continue
        if inspect.unwrap(value).__code__.co_firstlineno != _first_line(definition):
            return False
        checked += 1
    return checked > 0


def _rebuild_from_source(slot: FunctionSlot) -> FunctionType | None:
    tree = _source_tree(slot.home)
    if tree is None or not _source_matches(slot, tree):
        return None
    outer, _, name = slot.qualname.rpartition(".")
    if outer and "." in outer:
        return None  # nested classes: not needed for anything torch's patchers touch
    container = _class_node(tree, outer) if outer else tree
    node = None if container is None else _defs(container.body).get(name)
    if node is None:
        return None
    body: list[ast.stmt] = [node]
    if outer:
        body = [ast.ClassDef(name=outer, bases=[], keywords=[], body=body, decorator_list=[])]
    module_ast = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    flags = 0
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            for alias in stmt.names:
                feature = getattr(__import__("__future__"), alias.name, None)
                flags |= getattr(feature, "compiler_flag", 0)
    filename = slot.home.__file__ or f"<{slot.home.__name__}>"
    code = compile(module_ast, filename, "exec", flags=flags, dont_inherit=True)
    scratch: dict[str, object] = {}
    # Globals are the module's own dict, so the function resolves names
    # exactly like the original; locals are a scratch dict, so nothing in the
    # module is rebound.
    exec(code, vars(slot.home), scratch)
    func = vars(scratch[outer])[name] if outer else scratch[name]
    if not isinstance(func, FunctionType):
        return None
    if outer and "__class__" in func.__code__.co_freevars:
        # ``super()`` must see the real class, not the stand-in.
        real = getattr(slot.home, outer)
        cells = tuple(
            types.CellType(real) if free == "__class__" else cell
            for free, cell in zip(func.__code__.co_freevars, func.__closure__ or (), strict=True)
        )
        rebuilt = FunctionType(
            func.__code__, func.__globals__, func.__name__, func.__defaults__, cells
        )
        rebuilt.__kwdefaults__ = func.__kwdefaults__
        rebuilt.__dict__.update(func.__dict__)
        rebuilt.__qualname__ = func.__qualname__
        rebuilt.__annotations__ = func.__annotations__
        func = rebuilt
    return func if slot.is_original(func) else None
