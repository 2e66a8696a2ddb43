"""The thread state torch consults for a call's result: kept with each recorded call,
put back around each replayed one.

torch states a thread's dispatch state as two key sets, the keys it adds to every call
(the local include set) and those it takes out (the local exclude set). ``torch.autocast``
is a device's autocast key taken out of the exclude set, with a dtype per device beside
it; inference mode, dispatch modes (``TorchDispatchMode``) and functorch transforms are
keys too. A recorded call keeps the state it ran under when it is not torch's default
(a fresh thread's), and replay runs every call under its own recorded state, whatever the
state of the thread that materializes (``materialize`` inside ``torch.autocast``).
Inference mode changes no value, only the kind of tensor a call makes: a call recorded
under it is replayed under ``torch.inference_mode()``, so its results are inference
tensors as eager's are (an inference tensor has no version counter: the recorder pins one
that a call under inference mode takes as an argument it may write unseen, which is any
but an aten op's positional argument its schemas mark unwritten). Any other key a call
ran under (a dispatch mode, a functorch transform) refuses the call: replay cannot do what
that code did.

``torch.set_flush_denormal`` is thread state of another kind: the CPU's own flags (MXCSR
on x86, FPCR on ARM), set for the calling thread and copied into the threads it starts,
its intra-op workers among them, which keep the flags they started with. torch has no
getter for it, but Python's float arithmetic runs under the same flags, so multiplying the
smallest subnormal float by one shows it. A call keeps it with the rest of its state, and
its value is refused when the materializing thread flushes otherwise: setting the flags
for a replay would set them for the workers that thread starts during it, for good.

Grad mode changes no value and replay runs under ``torch.no_grad()``; the default dtype
is process-wide, so a call whose result's dtype it decided keeps it and is refused when
the process's default differs at materialize time (``Call.default_dtype``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from metamode._torch import (
    DispatchKey,
    DispatchKeySet,
    dispatch_exclude_set,
    dispatch_include_set,
    dispatch_keys,
    force_dispatch_keys,
    has_kernel_for,
)

__all__ = ["ThreadState", "autocast_on_meta", "current", "flushes_denormals", "replaying"]

# device type -> its autocast dispatch key, for those this torch has
_AUTOCAST_KEYS: dict[str, Any] = {
    device: getattr(DispatchKey, key)
    for device, key in (
        ("cpu", "AutocastCPU"),
        ("cuda", "AutocastCUDA"),
        ("xpu", "AutocastXPU"),
        ("mps", "AutocastMPS"),
        ("hpu", "AutocastHPU"),
        ("ipu", "AutocastIPU"),
        ("xla", "AutocastXLA"),
        ("mtia", "AutocastMTIA"),
        ("maia", "AutocastMAIA"),
        ("privateuseone", "AutocastPrivateUse1"),
    )
    if hasattr(DispatchKey, key)
}


@dataclass(frozen=True, slots=True)
class ThreadState:
    """A thread state other than torch's default: the devices with autocast on, each with
    its autocast dtype, whether inference mode is on, whether subnormal floats are flushed
    to zero, and why the state cannot be replayed (if so)."""

    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    refused: str | None = None
    inference: bool = False
    flush_denormal: bool = False

    def __repr__(self) -> str:
        if self.refused:
            return f"<refused: {self.refused}>"
        on = [f"{device}:{str(dtype).removeprefix('torch.')}" for device, dtype in self.autocast]
        if self.inference:
            on.append("inference mode")
        if self.flush_denormal:
            on.append("flush-denormal")
        return f"<{', '.join(on)}>"


_DEFAULTS: tuple[int, int, int, int] | None = None


def _defaults() -> tuple[int, int, int, int]:
    """The raw include and exclude sets of a fresh thread, then of one in inference mode."""
    global _DEFAULTS
    if _DEFAULTS is not None:
        return _DEFAULTS
    found: list[int] = []

    def read() -> None:
        include, exclude = dispatch_keys()
        with torch.inference_mode():
            inference_include, inference_exclude = dispatch_keys()
        found.extend(
            [
                include.raw_repr(),
                exclude.raw_repr(),
                inference_include.raw_repr(),
                inference_exclude.raw_repr(),
            ]
        )

    thread = threading.Thread(target=read, name="metamode-dispatch-defaults")
    thread.start()
    thread.join()
    _DEFAULTS = found[0], found[1], found[2], found[3]
    return _DEFAULTS


_SUBNORMAL = float.fromhex("0x1p-1074")  # the smallest subnormal float
_FLUSHING = ThreadState(flush_denormal=True)


def flushes_denormals() -> bool:
    """Whether this thread flushes subnormal floats to zero (``torch.set_flush_denormal``)."""
    return _SUBNORMAL * 1.0 == 0.0


def current() -> ThreadState | None:
    """The state this thread's next torch call runs under; None for torch's default."""
    include, exclude = dispatch_include_set(), dispatch_exclude_set()
    included = include.raw_repr()
    defaults = _DEFAULTS or _defaults()
    if included == defaults[0] and exclude.raw_repr() == defaults[1]:
        return _FLUSHING if flushes_denormals() else None
    autocast = []
    default_exclude = DispatchKeySet.from_raw_repr(defaults[1])
    for device, key in _AUTOCAST_KEYS.items():
        if default_exclude.has(key) and not exclude.has(key):
            autocast.append((device, torch.get_autocast_dtype(device)))
            exclude = exclude.add(key)
    rest = (included, exclude.raw_repr())
    refused = None
    inference = rest == (defaults[2], defaults[3])
    if not inference and rest != (defaults[0], defaults[1]):
        added = DispatchKeySet.from_raw_repr(included & ~defaults[0])
        removed = DispatchKeySet.from_raw_repr(rest[1] & ~defaults[1])
        refused = (
            f"it ran with the thread's dispatch keys changed (added {added}, excluded "
            f"{removed}: a TorchDispatchMode or a functorch transform?), whose effect on "
            f"its result replay cannot reproduce; build outside it"
        )
    return ThreadState(tuple(autocast), refused, inference, flushes_denormals())


def autocast_on_meta(state: ThreadState, func: Any, tensors: list[torch.Tensor]) -> str | None:
    """Why ``func``'s new result cannot be eager's, if so: CPU autocast casts CPU tensors
    only, so on meta tensors an op with an autocast kernel (``torch.matmul``, ``F.linear``)
    computes in another dtype than eager construction does."""
    if not any(device == "cpu" for device, _ in state.autocast):
        return None
    if not any(tensor.is_meta for tensor in tensors):
        return None
    name = getattr(func, "__name__", "") or ""
    if not _autocast_cpu_op(name):
        return None
    return (
        f"{name} ran under torch.autocast('cpu') on meta tensors, which autocast does not "
        f"cast: eager construction computes it in another dtype; build outside autocast"
    )


@functools.cache
def _autocast_cpu_op(name: str) -> bool:
    """Whether torch's op ``name`` has a CPU autocast kernel (True when no op is ``name``:
    a Python function may call one)."""
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    if packet is None or not hasattr(packet, "overloads"):
        return True
    key = _AUTOCAST_KEYS["cpu"]
    for overload in packet.overloads():
        qualified = f"aten::{name}" if overload == "default" else f"aten::{name}.{overload}"
        try:
            if has_kernel_for(qualified, key):
                return True
        except RuntimeError:  # an overload torch lists but does not register
            continue
    return False


@contextlib.contextmanager
def replaying(state: ThreadState | None) -> Iterator[None]:
    """Run the block under ``state`` (torch's default for None), whatever this thread's,
    but for its flush-denormal flags, which are left alone (the plan refuses a value whose
    call flushed otherwise). Under a state with inference mode on, torch's inference mode
    is entered too: it, not the dispatch keys, makes new tensors inference tensors. (Grad
    mode is each call's own: ``torch.inference_mode(False)`` turns it on.)"""
    defaults = _defaults()
    inference = state is not None and state.inference
    include = DispatchKeySet.from_raw_repr(defaults[2] if inference else defaults[0])
    exclude = DispatchKeySet.from_raw_repr(defaults[3] if inference else defaults[1])
    previous: list[tuple[str, torch.dtype]] = []
    try:
        for device, dtype in state.autocast if state is not None else ():
            exclude = exclude.remove(_AUTOCAST_KEYS[device])
            previous.append((device, torch.get_autocast_dtype(device)))
            torch.set_autocast_dtype(device, dtype)
        with torch.inference_mode(inference), force_dispatch_keys(include, exclude):
            yield
    finally:
        for device, dtype in reversed(previous):
            torch.set_autocast_dtype(device, dtype)
