"""Whether the caller compares a meta tensor's device, just read, so that the comparison
tells the CPU (where eager construction makes the tensor) from other devices: it comes out
otherwise for the CPU than for meta, and the same for meta as for another device (CUDA). A
comparison that tells meta itself from the others (``p.device == torch.device("meta")``,
``.type == "meta"``) is not one: libraries check meta-ness that way to skip a move or an
init, and metamode's registered library branches say which of those build otherwise.

Read from the caller's bytecode at the read: the value is followed through attribute reads
(``.type``, ``.index``) to the instruction that consumes it. A comparison (``==``, ``!=``,
``in``, ``is``) with a constant is evaluated for both values; a comparison with anything
else is taken to differ. A value stored, passed to a call or consumed in any other way is
not followed (``torch.arange(n, device=x.device)`` places a tensor: no branch).
"""

from __future__ import annotations

import dis
import functools
import operator
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch

__all__ = ["compared_otherwise"]

# instructions that only push, and how many values the others in a comparison's operands pop
_PUSH_ONLY = frozenset(
    [
        "LOAD_CONST",
        "LOAD_FAST",
        "LOAD_FAST_CHECK",
        "LOAD_FAST_BORROW",
        "LOAD_FAST_LOAD_FAST",
        "LOAD_FAST_BORROW_LOAD_FAST_BORROW",
        "LOAD_DEREF",
        "LOAD_NAME",
        "LOAD_GLOBAL",
        "LOAD_SMALL_INT",
        "PUSH_NULL",
    ]
)
_NEUTRAL = frozenset(["KW_NAMES", "NOP", "CACHE", "EXTENDED_ARG"])
_ATTRIBUTE = frozenset(["LOAD_ATTR", "LOAD_METHOD"])
_COMPARISONS = frozenset(["COMPARE_OP", "CONTAINS_OP", "IS_OP"])
_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


@functools.lru_cache(maxsize=512)
def _instructions(code: CodeType) -> tuple[tuple[dis.Instruction, ...], dict[int, int]]:
    found = tuple(dis.get_instructions(code))
    return found, {ins.offset: i for i, ins in enumerate(found)}


def _pops(ins: dis.Instruction) -> int | None:
    if ins.opname in _PUSH_ONLY or ins.opname in _NEUTRAL:
        return 0
    if ins.opname in _ATTRIBUTE:
        return 1
    if ins.opname == "PRECALL":  # Python 3.11: pops the arguments, pushes nothing
        return -dis.stack_effect(ins.opcode, ins.arg, jump=False)
    if ins.opname == "CALL":  # pushes the result
        return 1 - dis.stack_effect(ins.opcode, ins.arg, jump=False)
    if ins.opname in _COMPARISONS or ins.opname in ("BINARY_OP", "BINARY_SUBSCR"):
        return 2
    return None  # not followed


def _compare(ins: dis.Instruction, left: Any, right: Any) -> Any:
    if ins.opname == "CONTAINS_OP":
        return (left in right) != bool(ins.arg)
    if ins.opname == "IS_OP":
        return (left is right) != bool(ins.arg)
    symbol = str(ins.argval).removeprefix("bool(").removesuffix(")")
    return _OPERATORS[symbol](left, right)


_NAMES = frozenset(["LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_DEREF", "LOAD_NAME"])
_LOADS = _NAMES | {"LOAD_CONST", "LOAD_GLOBAL"}
_MISSING = object()
_CPU, _ELSEWHERE = torch.device("cpu"), torch.device("cuda")
Expression = list[dis.Instruction]  # a constant or a name, then attribute reads


def _load(frame: FrameType, ins: dis.Instruction) -> Any:
    if ins.opname == "LOAD_CONST":
        return ins.argval
    if ins.opname in _NAMES:
        return frame.f_locals.get(ins.argval, _MISSING)
    if ins.opname == "LOAD_GLOBAL":
        found = frame.f_globals.get(ins.argval, _MISSING)
        return frame.f_builtins.get(ins.argval, _MISSING) if found is _MISSING else found
    return _MISSING


def _attribute(value: Any, name: str) -> tuple[Any, Any, Any]:
    """``value.name`` here, in eager construction (a meta tensor's device is the CPU), and
    were the tensor on another device."""
    here = getattr(value, name)
    if name == "device" and isinstance(value, torch.Tensor) and here.type == "meta":
        return here, _CPU, _ELSEWHERE
    return here, here, here


def _evaluate(frame: FrameType, expression: Expression | None) -> list[Any] | None:
    """An operand's value here, in eager construction and elsewhere, if it is a constant or
    a name followed by attribute reads (``torch.device`` calls and the like are not
    followed)."""
    if not expression or expression[0].opname not in _LOADS:
        return None
    value = _load(frame, expression[0])
    if value is _MISSING:
        return None
    values = [value, value, value]
    try:
        for ins in expression[1:]:
            if ins.opname != "LOAD_ATTR" or dis.stack_effect(ins.opcode, ins.arg, jump=False):
                return None
            if values[0] is values[1]:
                values = list(_attribute(values[0], ins.argval))
            else:
                values = [getattr(v, ins.argval) for v in values]
    except Exception:
        return None
    return values


def _before(instructions: tuple[dis.Instruction, ...], end: int) -> Expression | None:
    """The constant or name with attribute reads that ends at index ``end``."""
    start = end
    while start >= 0 and instructions[start].opname == "LOAD_ATTR":
        start -= 1
    if start < 0 or instructions[start].opname not in _LOADS:
        return None
    return list(instructions[start : end + 1])


def compared_otherwise(frame: FrameType, here: torch.device) -> bool:
    """Whether the meta device the caller's current instruction reads (``here``) is compared
    so that the comparison tells the CPU from other devices."""
    values = [here, _CPU, _ELSEWHERE]
    instructions, index = _instructions(frame.f_code)
    at = index.get(frame.f_lasti)
    if at is None:
        return False
    receiver = _before(instructions, at - 1)
    depth = 1  # where the value is, counted from the top of the stack
    above: list[Expression | None] = []  # the expressions pushed over it since
    for ins in instructions[at + 1 :]:
        pops = _pops(ins)
        if pops is None:
            return False
        if pops < depth:
            pushes = dis.stack_effect(ins.opcode, ins.arg, jump=False) + pops
            if ins.opname == "LOAD_ATTR" and pops == 1 and pushes == 1 and above:
                top = above[-1]
                above[-1] = [*top, ins] if top is not None else None
            else:
                if pops:
                    del above[len(above) - pops :]
                above += [[ins] if ins.opname in _LOADS and pushes == 1 else None] * pushes
            depth += pushes - pops
            continue
        if ins.opname in _ATTRIBUTE and depth == 1:  # x.device.type: follow the attribute
            try:
                values = [getattr(v, ins.argval) for v in values]
            except AttributeError:
                return False
            if dis.stack_effect(ins.opcode, ins.arg, jump=False) != 0:
                return False  # a method call on it
            continue
        if ins.opname not in _COMPARISONS:
            return False
        if depth == 2 and len(above) == 1:  # x.device == other
            other = _evaluate(frame, above[0])
            left = True
        elif depth == 1 and receiver is not None:  # other == x.device
            start = at - len(receiver)
            other = _evaluate(frame, _before(instructions, start - 1)) if start > 0 else None
            left = False
        else:
            other = None
        if other is None:
            return True  # compared with a value not followed: it may differ
        try:
            if left:
                found = [_compare(ins, v, o) for v, o in zip(values, other, strict=True)]
            else:
                found = [_compare(ins, o, v) for v, o in zip(values, other, strict=True)]
            return bool(found[0] != found[1] and found[0] == found[2])
        except Exception:
            return True
    return False
