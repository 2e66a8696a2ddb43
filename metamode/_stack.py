"""Reading and repairing the calling thread's torch-function mode stack.

PyTorch keeps one stack of ``TorchFunctionMode`` objects per thread. metamode
keeps *all* of its state there: a context is active in a thread exactly when
its mode object sits on that thread's stack. These helpers are the only place
that walks the stack, so the rest of the package never touches torch's private
stack API directly.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch._C import _get_function_stack_at, _len_torch_function_stack
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode

__all__ = ["innermost", "modes_innermost_first", "remove", "stack_depth", "top"]

stack_depth = _len_torch_function_stack


def modes_innermost_first() -> Iterator[TorchFunctionMode]:
    """Yield this thread's modes from the most recently entered one down."""
    for index in range(_len_torch_function_stack() - 1, -1, -1):
        yield _get_function_stack_at(index)


def innermost(kinds: type | tuple[type, ...], skip_inert: bool = False) -> TorchFunctionMode | None:
    """The most recently entered mode of one of ``kinds`` in this thread, or None.

    With ``skip_inert``, modes whose ``_inert`` is true (a context whose exit
    was refused, still on its owner's stack) are passed over.

    This runs on every parameter registration while any mode is active, so the
    common case -- an empty stack -- costs one C call.
    """
    depth = _len_torch_function_stack()
    for index in range(depth - 1, -1, -1):
        mode = _get_function_stack_at(index)
        if isinstance(mode, kinds) and not (skip_inert and mode._inert):
            return mode
    return None


def top() -> TorchFunctionMode | None:
    depth = _len_torch_function_stack()
    return _get_function_stack_at(depth - 1) if depth else None


def remove(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` out of this thread's stack, keeping every other mode in order.

    Used only to recover from an out-of-order exit: the offending context is
    removed (so it cannot leak) and the contexts above it stay active.
    Returns False if ``mode`` was not on the stack.
    """
    above: list[TorchFunctionMode] = []
    found = False
    while _len_torch_function_stack():
        popped = _pop_mode()
        if popped is mode:
            found = True
            break
        above.append(popped)
    for popped in reversed(above):
        _push_mode(popped)
    return found
