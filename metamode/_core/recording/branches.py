"""Whether code that read the ``.device`` of a meta tensor, which eager construction has on
the CPU, used it so that the build may have left eager's path: a comparison, truth test or
``match`` that comes out otherwise for the CPU than for meta, data computed from it passed
to torch, or a function chosen by it called. A check that tells meta from both the CPU and
other devices (``p.device.type == "meta"``) is a library's meta check, left to the branches
the integrations register.

The value is followed in the reader's source (``source.py``), for meta, the CPU and another
device (CUDA) at once, through attributes and methods of it, builtins that only compute
(``str``, ``isinstance``, ``dict.get``...), operators, the names, ``self.x`` attributes and
``table[key]`` items it is stored in, loops over displays, displays, subscripts, f-strings,
conditional expressions, ``match``, returns into the running caller, ``next()`` of a
generator expression, and up to three Python functions it is passed to or is the default of
(their parameters bound to the call's arguments, their locals assigned once evaluated as
written). Only plain values (strings, numbers, devices, builtin containers) are compared,
hashed or passed to a builtin, and only attributes whose reading runs no Python code are
read, so following runs none of the program's code.

Where the reading frame runs, a comparison with an expression not evaluated counts as
telling the CPU apart; inside a helper, whose other locals are unknown, it does not. A use
not followed (a comprehension collecting devices, a method of another object) ends that path
unrefused; an error inside the follow refuses. The design notes list what is not followed.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import operator
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType, FunctionType, MethodType
from typing import Any, TypeGuard

import torch

from metamode._core.recording.source import (
    NotRead,
    Source,
    assigned_once,
    loads,
    local_names,
    name_of,
    node_at,
    read,
    source_of,
)

__all__ = ["diverging_use"]

_CPU, _ELSEWHERE = torch.device("cpu"), torch.device("cuda")
_MISSING = object()
_RETURNS = 8  # calling frames a returned device is followed into
_DEPTH = 3  # Python functions it is followed into, as an argument or a default
_BUDGET = 256  # expressions followed from one read
_COMPARISONS: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_OPERATORS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Mod: operator.mod,
    ast.Mult: operator.mul,
    ast.Sub: operator.sub,
}
# values whose operations run no code of the build's; the first ones cannot be changed either
_IMMUTABLE = frozenset(
    [str, bytes, int, float, bool, type(None), tuple, frozenset, torch.device, torch.dtype]
)
_PLAIN = _IMMUTABLE | {list, dict, set}
# callables whose result depends on their arguments only
_PURE: tuple[Any, ...] = (str, repr, format, hash, len, bool, type, isinstance, hasattr, getattr)
_PURE += (torch.device, operator.eq, operator.ne, operator.contains, operator.getitem, operator.is_)
_LOOKUPS = frozenset(["get", "index", "count", "__getitem__", "__contains__"])
Values = list[Any] | None  # the value for meta, the CPU and another device; None: unknown


def _attribute(value: Any, name: str) -> tuple[Any, Any, Any]:
    """``value.name`` here, in eager construction (a meta tensor's device is the CPU), and
    were the tensor on another device."""
    here = read(value, name)
    if name == "device" and isinstance(value, torch.Tensor) and here.type == "meta":
        return here, _CPU, _ELSEWHERE
    return here, here, here


@dataclass
class _Place:
    """Where a followed expression is: its source, the running frame (None inside a helper
    that has not run), how names are looked up, and where a ``return`` goes."""

    source: Source
    frame: FrameType | None
    lookup: Callable[[str], Any]
    depth: int = 0  # helpers entered
    returns: int = 0  # calling frames entered
    caller: tuple[ast.expr, _Place] | None = None  # a helper's call, in its caller
    # a helper's locals assigned once (``cpu = torch.device("cpu")``): evaluated as written;
    # its other locals and parameters not bound by the call are not known
    assigned: dict[str, ast.expr] = field(default_factory=dict)
    unknown: frozenset[str] = frozenset()
    bound: dict[str, Values] = field(default_factory=dict)  # parameters, from the call
    _done: dict[str, Values] = field(default_factory=dict)

    def evaluate(self, node: ast.expr) -> Values:
        """``node``'s plain value for meta, the CPU and another device, if it is a
        constant, a name, or attributes, displays, pure calls and conditional expressions of
        those."""
        found = self.refer(node)
        return found if _known(found) else None

    def refer(self, node: ast.expr) -> Values:
        """What ``node`` names for each device (a plain value, or an object such as a
        function or a class), where finding it runs none of the program's code."""
        try:
            return self._evaluate(node)
        except Exception:
            return None

    def _evaluate(self, node: ast.expr) -> Values:
        if isinstance(node, ast.Constant):
            return [node.value] * 3
        if isinstance(node, ast.Name):
            return self._named(node.id)
        if isinstance(node, ast.Attribute):
            values = self._evaluate(node.value)
            if values is None:
                return None
            if values[0] is values[1]:
                return list(_attribute(values[0], node.attr))
            return [read(v, node.attr) for v in values]
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return _displayed(node, [self.evaluate(item) for item in node.elts])
        if isinstance(node, ast.IfExp):
            tests = self.evaluate(node.test)
            bodies, others = self._evaluate(node.body), self._evaluate(node.orelse)
            if tests is None or bodies is None or others is None:
                return None
            return [b if t else o for t, b, o in zip(tests, bodies, others, strict=True)]
        if isinstance(node, ast.Call) and not node.keywords:  # torch.device("cpu")
            callees = self._evaluate(node.func)
            if callees is None or not _pure(callees[0]):
                return None
            arguments = [self.argument(callees[0], arg) for arg in node.args]
            if None in arguments:
                return None
            return [callees[0](*(a[i] for a in arguments)) for i in range(3)]  # type: ignore[index]
        return None

    def argument(self, callee: Any, node: ast.expr) -> Values:
        """An argument of a pure call: a plain value, or a class ``isinstance`` checks."""
        if callee is isinstance:
            found = self._evaluate(node)
            return found if found is not None and all(_plain_class(f) for f in found) else None
        return self.evaluate(node)

    def _named(self, name: str) -> Values:
        if name in self._done:
            return self._done[name]
        if name in self.bound:
            return self.bound[name]
        if name in self.assigned:  # a helper's local, as written
            value = self.assigned.pop(name)  # not again inside its own value
            try:
                found = self._done[name] = self._evaluate(value)
                return found
            finally:
                self.assigned[name] = value
        if name in self.unknown:
            return None
        value = self.lookup(name)
        return None if value is _MISSING else [value] * 3


def _frame_lookup(frame: FrameType) -> Callable[[str], Any]:
    def lookup(name: str) -> Any:
        for names in (frame.f_locals, frame.f_globals, frame.f_builtins):
            if name in names:
                return names[name]
        return _MISSING

    return lookup


def _function_lookup(function: FunctionType) -> Callable[[str], Any]:
    """Names a function that has not run yet can be read for: its globals and closure."""
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or (), strict=True))

    def lookup(name: str) -> Any:
        if name in cells:
            try:
                return cells[name].cell_contents
            except ValueError:
                return _MISSING
        for names in (function.__globals__, vars(builtins)):
            if name in names:
                return names[name]
        return _MISSING

    return lookup


# -- the follow -----------------------------------------------------------------------------
def diverging_use(frame: FrameType, here: torch.device) -> str | None:
    """How the code running in ``frame`` uses the meta device ``here`` it is reading so that
    the build may have left eager's path, if it is found to; None if not."""
    try:
        found = node_at(frame)
        if found is None:
            return None
        place = _Place(found[0], frame, _frame_lookup(frame))
        return _Follow().value(found[1], [here, _CPU, _ELSEWHERE], place)
    except Exception as error:  # (RecursionError included) the use is not known
        return f"metamode could not follow how it uses it ({type(error).__name__}: {error})"


class _Follow:
    """One read's follow: each expression at most once, at most ``_BUDGET`` of them."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int, tuple[str, ...] | None]] = set()
        self.places: list[_Place] = []  # alive, so that their ids stay theirs

    def value(self, node: ast.expr, values: Values, place: _Place) -> str | None:
        """Follow the value ``node`` has (``values``) to where it is used."""
        key = (id(node), id(place), tuple(map(repr, values)) if _known(values) else None)
        if key in self.seen:
            return None
        if len(self.seen) >= _BUDGET:
            return f"used it in more than {_BUDGET} places"
        self.seen.add(key)
        self.places.append(place)
        parent = place.source.parents.get(node)
        if isinstance(parent, ast.Attribute):
            grand = place.source.parents.get(parent)
            if isinstance(grand, ast.Call) and grand.func is parent:  # d.type.startswith(..)
                return self._method(grand, parent, values, place)
            return self.value(parent, _attributes(values, parent.attr), place)
        if isinstance(parent, ast.Compare):
            return self._compared(parent, node, values, place)
        if isinstance(parent, ast.Call):
            if node is not parent.func:
                return self._passed(parent, node, None, values, place)
            if values is not None and values[0] is not values[1]:
                here, eager = (_called(v) for v in values[:2])
                return f"called {here}, chosen by it (eager construction calls {eager})"
            return None
        if isinstance(parent, ast.keyword):
            call = place.source.parents[parent]
            if isinstance(call, ast.Call) and parent.arg is not None:
                return self._passed(call, node, parent.arg, values, place)
            return None
        if isinstance(parent, ast.Assign | ast.AnnAssign) and node is parent.value:
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            return _first(self._stored(target, values, place) for target in targets)
        if isinstance(parent, ast.NamedExpr):
            return self._stored(parent.target, values, place) or self.value(parent, values, place)
        if isinstance(parent, ast.Subscript) and node is parent.value:  # type[:3], pair[0]
            return self.value(parent, _indexed(values, parent.slice, place), place)
        if isinstance(parent, ast.Subscript):  # scales[d.type]
            tables = place.evaluate(parent.value)
            return self.value(parent, _indexed_by_each(tables, values), place)
        grand = place.source.parents.get(parent) if parent is not None else None
        if (
            isinstance(grand, ast.For | ast.comprehension)
            and parent is grand.iter
            and isinstance(parent, ast.Tuple | ast.List | ast.Set)
        ):  # for d in (w.device, x): one of the items
            return self._stored(grand.target, values, place)
        if isinstance(parent, ast.Tuple | ast.List | ast.Set | ast.Dict):  # (device, dtype)
            return self.value(parent, _contained(parent, node, values, place), place)
        if isinstance(parent, ast.BinOp):  # type + ":0", "%s" % d
            return self.value(parent, _operated(parent, node, values, place), place)
        if isinstance(parent, ast.FormattedValue):  # f"cache_{d.type}"
            joined = place.source.parents[parent]
            assert isinstance(joined, ast.JoinedStr)
            return self.value(joined, _formatted(joined, parent, values, place), place)
        if isinstance(parent, ast.For | ast.comprehension) and node is parent.iter:
            return self._iterated(parent.target, values, place)
        if isinstance(parent, ast.arguments):  # def f(device=w.device)
            return self._default(parent, node, values, place)
        if isinstance(parent, ast.Match):
            return self._matched(parent, values, place)
        if _tests(parent, node):  # if d.type.startswith("cpu"): ...
            return _branched(values)
        if isinstance(parent, ast.BoolOp):  # its truth chooses, then maybe this value
            return _branched(values) or self.value(parent, values, place)
        if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not):
            return self.value(parent, [not v for v in values] if _known(values) else None, place)
        if isinstance(parent, ast.IfExp):  # this value, where the test is not known to drop it
            tests = place.evaluate(parent.test)
            if tests is not None and all(bool(t) == (node is parent.orelse) for t in tests):
                return None
            return self.value(parent, values, place)
        if isinstance(parent, ast.Return) or (
            isinstance(parent, ast.Lambda) and node is parent.body
        ):
            return self._returned(parent, values, place)
        if isinstance(parent, ast.GeneratorExp) and node is parent.elt:
            consumer = place.source.parents.get(parent)
            if (
                isinstance(consumer, ast.Call)
                and consumer.args[:1] == [parent]
                and (found := place.refer(consumer.func)) is not None
                and found[0] is next
            ):
                return self.value(consumer, values, place)
        return None

    def _compared(
        self, compare: ast.Compare, node: ast.expr, values: Values, place: _Place
    ) -> str | None:
        """``node`` in a comparison, chained or not: the links on either side of it."""
        operands = [compare.left, *compare.comparators]
        at = next(i for i, operand in enumerate(operands) if operand is node)
        links = [i for i in (at - 1, at) if 0 <= i < len(compare.ops)]
        return _first(
            self._link(compare.ops[i], operands[i], operands[i + 1], node, values, place)
            for i in links
        )

    def _link(
        self,
        op: ast.cmpop,
        left: ast.expr,
        right: ast.expr,
        node: ast.expr,
        values: Values,
        place: _Place,
    ) -> str | None:
        other_node = right if left is node else left
        other = place.evaluate(other_node)
        if not _known(values) or other is None:
            if place.frame is None:  # a helper's locals: not known, not refused
                return None
            return f"compared it with {ast.unparse(other_node)}, which metamode does not evaluate"
        compare = _COMPARISONS[type(op)]
        try:
            found = [
                compare(v, o) if left is node else compare(o, v)
                for v, o in zip(values, other, strict=True)
            ]
            differs = bool(found[0] != found[1])
            meta_check = bool(found[0] != found[2]) and _mentions_meta(other[0])
        except Exception:
            return f"compared it with {ast.unparse(other_node)}" if place.frame else None
        if differs and not meta_check:
            return f"compared it with {ast.unparse(other_node)}, which tells the CPU apart"
        return None

    def _matched(self, match: ast.Match, values: Values, place: _Place) -> str | None:
        """``match value:``: the case each device takes, where the patterns up to the last
        that can be taken are values, singletons, captures, classes or ``|`` of those."""
        taken: list[int | None] = [None] * 3
        for index, case in enumerate(match.cases):
            matches = _matches(case.pattern, values, place) if case.guard is None else None
            if matches is None:
                if place.frame is None:
                    return None
                return "matched it against patterns metamode does not evaluate"
            taken = [
                t if t is not None or not m else index for t, m in zip(taken, matches, strict=True)
            ]
        if taken[0] != taken[1] and taken[0] == taken[2]:
            return "matched it so that the CPU takes another case"
        return _first(  # case d: / case ... as d: the whole value, named
            self._named(case.pattern, case.pattern.name, values, place)
            for case in match.cases
            if isinstance(case.pattern, ast.MatchAs) and case.pattern.name
        )

    def _method(
        self, call: ast.Call, method: ast.Attribute, values: Values, place: _Place
    ) -> str | None:
        """``value.method(...)``, followed on for a value that cannot be changed, if the
        arguments are evaluated here."""
        arguments = [place.evaluate(arg) for arg in call.args]
        if (
            not _known(values)
            or any(type(v) not in _IMMUTABLE for v in values)
            or call.keywords
            or None in arguments
        ):
            return None
        try:
            results = [
                getattr(v, method.attr)(*(a[i] for a in arguments))  # type: ignore[index]
                for i, v in enumerate(values)
            ]
        except Exception:
            return None
        return self.value(call, results, place)

    def _passed(
        self, call: ast.Call, node: ast.expr, keyword: str | None, values: Values, place: _Place
    ) -> str | None:
        """``node`` is an argument of ``call`` (``keyword``'s value, if it is one)."""
        if isinstance(call.func, ast.Lambda):  # (lambda d: ...)(w.device)
            return self._into(call, call.func, node, values, place, place.lookup)
        callees = place.refer(call.func)
        if callees is None:
            return None
        callee = callees[0]
        if _pure(callee):  # str(d), isinstance(d, ...), table.get(d.type): computed
            if not _known(values) or call.keywords:
                return None
            arguments = [a if a is node else place.argument(callee, a) for a in call.args]
            if _looks_up(callee):  # table.get(key, default): a default not evaluated is
                arguments = [a or [object()] * 3 for a in arguments]  # one unknown object
            results: Values = None  # what it gives is not known, where an argument is not
            if None not in arguments:
                try:
                    results = [
                        callee(*(v if a is node else a[i] for a in arguments))  # type: ignore[index]
                        for i, v in enumerate(values)
                    ]
                except Exception:
                    results = None
            return self.value(call, results, place)
        if (
            _known(values)
            and values[0] != values[1]
            and keyword not in ("device", "device_type")
            and not all(_names_a_device(v) for v in values)
            and _torchs(callee)
        ):  # data computed from the device, not a place
            return (
                f"passed {values[0]!r} computed from it to {ast.unparse(call.func)}, where "
                f"eager construction passes {values[1]!r}"
            )
        function, bound = _function(callee)
        source = source_of(function.__code__) if function is not None else None
        definition = source.definition(function.__code__) if source is not None else None
        if function is None or definition is None:
            return None
        lookup = _function_lookup(function)
        defaults = _defaults(function)
        return self._into(call, definition, node, values, place, lookup, bound, source, defaults)

    def _into(
        self,
        call: ast.Call,
        definition: ast.AST,
        node: ast.expr,
        values: Values,
        place: _Place,
        lookup: Callable[[str], Any],
        bound: bool = False,
        source: Source | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> str | None:
        """Follow an argument into the Python function ``definition`` that ``call`` runs
        (its parameters' ``defaults`` as they were made)."""
        binding = _binding(definition.args, call, bound)  # type: ignore[attr-defined]
        parameter = next((name for name, argument in binding.items() if argument is node), None)
        if parameter is None or place.depth >= _DEPTH:
            return None
        inside = _helper(source or place.source, definition, lookup, place, (call, place))
        inside.bound = {
            **{name: [v] * 3 for name, v in (defaults or {}).items() if type(v) in _PLAIN},
            **{name: v for name, a in binding.items() if (v := place.evaluate(a)) is not None},
        }
        for load in loads(definition, parameter):
            if found := self.value(load, values, inside):
                return f"passed it to {ast.unparse(call.func)}, which {found}"
        return None

    def _stored(self, target: ast.expr, values: Values, place: _Place) -> str | None:
        """``target = value``: into a name, ``self.x`` or ``table[key]``, or unpacked into
        those."""
        if isinstance(target, ast.Name):
            return self._named(target, target.id, values, place)
        if isinstance(target, ast.Attribute | ast.Subscript) and isinstance(
            _root(target), ast.Name
        ):  # read back by the same spelling
            stored = ast.unparse(target)
            return _first(
                self.value(node, values, place)
                for node in ast.walk(place.source.owner(target))
                if isinstance(node, ast.Attribute | ast.Subscript)
                and isinstance(node.ctx, ast.Load)
                and ast.unparse(node) == stored
            )
        if not isinstance(target, ast.Tuple | ast.List) or any(
            isinstance(item, ast.Starred) for item in target.elts
        ):
            return None
        return _first(
            self._stored(item, _indexed_by(values, i), place) for i, item in enumerate(target.elts)
        )

    def _named(self, at: ast.AST, name: str, values: Values, place: _Place) -> str | None:
        """The name ``name``, stored at ``at``: every read of it where it lives."""
        scope = place.source.holder(at, name)
        return _first(self.value(load, values, place) for load in loads(scope, name))

    def _iterated(self, target: ast.expr, values: Values, place: _Place) -> str | None:
        """``for target in value``: each item, if ``value`` is a display of known length."""
        if not _known(values) or not all(isinstance(v, tuple | list) for v in values):
            return None
        if len({len(v) for v in values}) != 1:
            return None
        return _first(
            self._stored(target, _indexed_by(values, i), place) for i in range(len(values[0]))
        )

    def _default(
        self, arguments: ast.arguments, node: ast.expr, values: Values, place: _Place
    ) -> str | None:
        """A parameter's default: followed into the function, as into a helper."""
        positional = [*arguments.posonlyargs, *arguments.args]
        with_defaults = positional[len(positional) - len(arguments.defaults) :]
        pairs = [
            *zip(with_defaults, arguments.defaults, strict=True),
            *zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True),
        ]
        names = [parameter.arg for parameter, default in pairs if default is node]
        if not names or place.depth >= _DEPTH:
            return None
        function = place.source.parents[arguments]
        inside = _helper(place.source, function, place.lookup, place, None)
        for load in loads(function, names[0]):
            if found := self.value(load, values, inside):
                return f"took it as the default of {names[0]}, then {found}"
        return None

    def _returned(self, at: ast.AST, values: Values, place: _Place) -> str | None:
        if place.caller is not None:  # a helper's return: its caller's call expression
            call, calling = place.caller
            return self.value(call, values, calling)
        function = place.source.scope(at)
        frame = place.frame
        while frame is not None and frame.f_code.co_name != name_of(function):
            frame = frame.f_back
        caller = frame.f_back if frame is not None else None
        if caller is None or place.returns >= _RETURNS:
            return None
        found = node_at(caller)
        if found is None or not isinstance(found[1], ast.Call | ast.Attribute | ast.Subscript):
            return None
        above = _Place(found[0], caller, _frame_lookup(caller), returns=place.returns + 1)
        return self.value(found[1], values, above)


# -- what the follow computes ---------------------------------------------------------------
def _first(found: Iterator[str | None]) -> str | None:
    return next((f for f in found if f is not None), None)


def _helper(
    source: Source,
    definition: ast.AST,
    lookup: Callable[[str], Any],
    place: _Place,
    caller: tuple[ast.expr, _Place] | None,
) -> _Place:
    """The place inside a Python function that has not run: its locals assigned once are
    evaluated as written, its other locals are not known."""
    assigned = assigned_once(definition)
    unknown = frozenset(local_names(definition) - set(assigned))
    return _Place(source, None, lookup, place.depth + 1, place.returns, caller, assigned, unknown)


def _defaults(function: FunctionType) -> dict[str, Any]:
    """The default value of each of ``function``'s parameters that has one."""
    code = function.__code__
    positional = code.co_varnames[: code.co_argcount]
    given = function.__defaults__ or ()
    found = dict(zip(positional[len(positional) - len(given) :], given, strict=True))
    return {**found, **(function.__kwdefaults__ or {})}


def _binding(arguments: ast.arguments, call: ast.Call, bound: bool) -> dict[str, ast.expr]:
    """The argument expression ``call`` gives each parameter it binds (none after a ``*``
    unpacking; the first skipped for a bound method)."""
    positional = [a.arg for a in (*arguments.posonlyargs, *arguments.args)][int(bound) :]
    found: dict[str, ast.expr] = {}
    for name, argument in zip(positional, call.args, strict=False):
        if isinstance(argument, ast.Starred):
            break
        found[name] = argument
    keywords = {a.arg for a in (*arguments.args, *arguments.kwonlyargs)}
    found.update({k.arg: k.value for k in call.keywords if k.arg in keywords})
    return found


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node


def _known(values: Values) -> TypeGuard[list[Any]]:
    """Whether ``values`` are plain: operations on them run none of the build's code."""
    return values is not None and all(_plain(v) for v in values)


def _called(value: Any) -> str:
    """A callable's name, read without running its code."""
    if isinstance(value, FunctionType | types.BuiltinFunctionType | type):
        return value.__qualname__
    return f"a {type(value).__qualname__}"


def _plain(value: Any, room: int = 64) -> bool:
    """Whether ``value`` is plain all through: a builtin container holds plain values only
    (at most ``room`` of them)."""
    kind = type(value)
    if kind not in _PLAIN:
        return False
    if kind is dict:
        items = [*value.keys(), *value.values()]
    elif kind in (list, tuple, set, frozenset):
        items = list(value)
    else:
        return True
    return len(items) <= room and all(_plain(item, room // 2) for item in items)


def _pure(callee: Any) -> bool:
    """Whether ``callee`` computes its result from its arguments only: a builtin that does,
    a method of a value that cannot change, or a lookup in a builtin container."""
    owner = callee.__self__ if isinstance(callee, types.BuiltinMethodType) else None
    if owner is not None and type(owner) in _IMMUTABLE:  # "{}".format, d.type.upper
        return True
    return _looks_up(callee) or any(callee is pure for pure in _PURE)


def _looks_up(callee: Any) -> bool:
    """Whether ``callee`` is a lookup in a builtin container whose keys (items, for a list)
    are plain (``table.get``)."""
    if not isinstance(callee, types.BuiltinMethodType) or callee.__name__ not in _LOOKUPS:
        return False
    owner = callee.__self__
    if type(owner) is dict:
        return _plain(tuple(owner), room=1024)
    return type(owner) in _PLAIN and _plain(owner, room=1024)


def _plain_class(value: Any) -> bool:
    """A class whose instance checks run no Python code (its metaclass is ``type``)."""
    if isinstance(value, tuple):
        return all(_plain_class(v) for v in value)
    return type(value) is type


def _torchs(callee: Any) -> bool:
    """Whether ``callee`` is torch's own."""
    function, _ = _function(callee)
    module = getattr(function or callee, "__module__", None)
    if not isinstance(module, str):
        owner = getattr(callee, "__self__", None)
        module = type(owner).__module__ if owner is not None else ""
    return module.split(".")[0] == "torch"


def _function(callee: Any) -> tuple[Any, bool]:
    """The Python function ``callee`` runs, and whether it is bound to an instance: a
    function, a method, a class's ``__init__``, or what a decorator wraps."""
    if isinstance(callee, MethodType):
        return _function(callee.__func__)[0], True
    if isinstance(callee, type):
        init = inspect.getattr_static(callee, "__init__", None)
        return (init, True) if isinstance(init, FunctionType) else (None, False)
    wrapped = inspect.getattr_static(callee, "__wrapped__", None)
    if isinstance(callee, FunctionType) and wrapped is None:
        return callee, False
    return (wrapped, False) if isinstance(wrapped, FunctionType) else (None, False)


def _names_a_device(value: Any) -> bool:
    """Whether ``value`` is a device, or a string torch reads as one (``"cpu"``, ``"meta"``)."""
    if isinstance(value, torch.device):
        return True
    try:
        return isinstance(value, str) and bool(torch.device(value))
    except RuntimeError:
        return False


def _mentions_meta(value: Any) -> bool:
    """Whether a comparison's other side names meta: a library's meta check."""
    if isinstance(value, tuple | list | set | frozenset):
        return any(_mentions_meta(v) for v in value)
    return value == "meta" or (isinstance(value, torch.device) and value.type == "meta")


def _matches(pattern: ast.pattern, values: Values, place: _Place) -> list[bool] | None:
    """Whether ``pattern`` matches each of ``values``; None if it is not evaluated."""
    if isinstance(pattern, ast.MatchAs):
        return [True] * 3 if pattern.pattern is None else _matches(pattern.pattern, values, place)
    if not _known(values):
        return None
    if isinstance(pattern, ast.MatchSingleton):
        return [v is pattern.value for v in values]
    if isinstance(pattern, ast.MatchValue):
        other = place.evaluate(pattern.value)
        return None if other is None else [v == o for v, o in zip(values, other, strict=True)]
    if isinstance(pattern, ast.MatchOr):
        found = [_matches(p, values, place) for p in pattern.patterns]
        if any(f is None for f in found):
            return None
        return [any(f[i] for f in found) for i in range(3)]  # type: ignore[index]
    if isinstance(pattern, ast.MatchClass) and not pattern.patterns:  # device(type="cpu")
        kinds = place.refer(pattern.cls)
        if kinds is None or not _plain_class(kinds[0]):
            return None
        found = [[isinstance(v, k) for v, k in zip(values, kinds, strict=True)]]
        for name, inner in zip(pattern.kwd_attrs, pattern.kwd_patterns, strict=True):
            found.append(_matches(inner, _attributes(values, name), place))
        if any(f is None for f in found):
            return None
        return [all(f[i] for f in found) for i in range(3)]  # type: ignore[index]
    return None


def _tests(parent: ast.AST | None, node: ast.expr) -> bool:
    """Whether ``parent`` branches on the truth of ``node``."""
    if isinstance(parent, ast.If | ast.While | ast.IfExp | ast.Assert):
        return node is parent.test
    return isinstance(parent, ast.comprehension) and any(node is test for test in parent.ifs)


def _branched(values: Values) -> str | None:
    if not _known(values):
        return None
    truths = [bool(v) for v in values]
    if truths[0] != truths[1] and truths[0] == truths[2]:
        return f"branched on it, {'true' if truths[1] else 'false'} for the CPU only"
    return None


def _attributes(values: Values, name: str) -> Values:
    try:
        return [read(v, name) for v in values] if _known(values) else None
    except (AttributeError, NotRead):
        return None


def _indexed_by(values: Values, key: Any) -> Values:
    try:
        return [v[key] for v in values] if _known(values) else None
    except Exception:
        return None


def _indexed_by_each(tables: Values, keys: Values) -> Values:
    """``table[key]`` for each device, its key being the device's."""
    if not _known(tables) or not _known(keys):
        return None
    try:
        return [t[k] for t, k in zip(tables, keys, strict=True)]
    except Exception:
        return None


def _indexed(values: Values, index: ast.expr, place: _Place) -> Values:
    """``value[index]`` for each device, if ``index`` is evaluated here."""
    if isinstance(index, ast.Slice):
        bounds = [
            place.evaluate(b) if b is not None else [None] * 3
            for b in (index.lower, index.upper, index.step)
        ]
        keys: Values = None
        if None not in bounds:
            keys = [slice(*(b[i] for b in bounds)) for i in range(3)]  # type: ignore[index]
    else:
        keys = place.evaluate(index)
    if not _known(values) or keys is None:
        return None
    try:
        return [v[k] for v, k in zip(values, keys, strict=True)]
    except Exception:
        return None


def _displayed(display: ast.expr, items: list[Values]) -> Values:
    """A tuple, list or set display of ``items`` (each for meta, the CPU and another
    device), for each device."""
    if None in items:
        return None
    kind = {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(display)]
    try:
        return [kind(item[i] for item in items) for i in range(3)]  # type: ignore[index]
    except TypeError:  # unhashable in a set
        return None


def _contained(display: ast.expr, node: ast.expr, values: Values, place: _Place) -> Values:
    """The display holding ``node``, for each device, if its other items are evaluated."""
    if not _known(values) or isinstance(getattr(display, "ctx", None), ast.Store):
        return None
    if not isinstance(display, ast.Dict):
        items = [values if i is node else place.evaluate(i) for i in display.elts]  # type: ignore[attr-defined]
        return _displayed(display, items)
    if any(key is None or key is node for key in display.keys):
        return None  # a ** unpacking, or the value as a key
    keys = [place.evaluate(key) for key in display.keys]  # type: ignore[arg-type]
    items = [values if item is node else place.evaluate(item) for item in display.values]
    if None in keys or None in items:
        return None
    try:
        return [
            {k[i]: item[i] for k, item in zip(keys, items, strict=True)}  # type: ignore[index]
            for i in range(3)
        ]
    except TypeError:
        return None


def _operated(operation: ast.BinOp, node: ast.expr, values: Values, place: _Place) -> Values:
    """``value + other`` (``-``, ``*``, ``%``) for each device, if ``other`` is evaluated."""
    apply = _OPERATORS.get(type(operation.op))
    other = place.evaluate(operation.right if operation.left is node else operation.left)
    if apply is None or not _known(values) or other is None:
        return None
    try:
        if operation.left is node:
            return [apply(v, o) for v, o in zip(values, other, strict=True)]
        return [apply(o, v) for v, o in zip(values, other, strict=True)]
    except Exception:
        return None


def _formatted(
    joined: ast.JoinedStr, part: ast.FormattedValue, values: Values, place: _Place
) -> Values:
    """The f-string ``joined`` for each device, its ``part`` being ``values``, if its other
    parts are evaluated here."""
    texts = ["", "", ""]
    for piece in joined.values:
        if isinstance(piece, ast.Constant):
            texts = [t + str(piece.value) for t in texts]
            continue
        assert isinstance(piece, ast.FormattedValue)
        found = values if piece is part else place.evaluate(piece.value)
        spec = "" if piece.format_spec is None else _constant_text(piece.format_spec)
        if not _known(found) or spec is None:
            return None
        convert = _CONVERSIONS.get(piece.conversion, _unchanged)
        try:
            texts = [t + format(convert(v), spec) for t, v in zip(texts, found, strict=True)]
        except Exception:
            return None
    return texts


def _unchanged(value: Any) -> Any:
    return value


_CONVERSIONS: dict[int, Callable[[Any], Any]] = {ord("s"): str, ord("r"): repr, ord("a"): ascii}


def _constant_text(node: ast.expr) -> str | None:
    """A format spec's text, if it has no replacement fields."""
    if isinstance(node, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in node.values):
        return "".join(str(v.value) for v in node.values)  # type: ignore[attr-defined]
    return None
