"""``metamode.doctor()``: find, and on request repair, global torch state that others left
changed. Why it works this way: docs/design.md, "doctor and originals".
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import FunctionType, ModuleType

import torch
import torch.nn.init
from torch.nn.modules import module as _torch_module

from metamode import _torch
from metamode._core import dtype_windows
from metamode._core import facts as _facts
from metamode._core import hooks as _hooks
from metamode._core import stack as _stack
from metamode._diagnostics import known_changes as _known_changes
from metamode._diagnostics import originals as _originals
from metamode._diagnostics.invariants import FACTORY_NAMES
from metamode._diagnostics.originals import FunctionSlot

__all__ = ["DoctorReport", "Finding", "doctor", "main"]

_MISSING = object()

# Used only when torch's source files are not installed (zipped / .pyc-only).
_FALLBACK_INIT_FUNCTIONS = (
    "calculate_gain", "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
    "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
    "orthogonal_", "sparse_",
)  # fmt: skip
_FALLBACK_MODULE_METHODS = (
    "register_parameter", "register_buffer", "register_module", "add_module", "__setattr__",
    "__getattr__", "to", "to_empty", "apply", "_apply", "load_state_dict", "state_dict",
)  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """One thing that is not as torch leaves it.

    Attributes:
        target: what is affected, e.g. ``"torch.nn.Module.register_parameter"``.
        problem: what is wrong with it.
        culprit: who probably left it: the replacement's ``module.qualname``
            (and file:line), or None when the state carries no trace of it.
        action: after ``repair=True``, what was done (or why nothing could be).
        repaired: True/False after a repair attempt, None without one.
    """

    target: str
    problem: str
    culprit: str | None = None
    action: str | None = None
    repaired: bool | None = None
    _repair: Callable[[_Recovered], str] | None = field(default=None, repr=False, compare=False)
    _slot: FunctionSlot | None = field(default=None, repr=False, compare=False)
    _current: object = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        lines = [f"{self.target}: {self.problem}"]
        if self.culprit:
            lines.append(f"    left by: {self.culprit}")
        if self.action:
            lines.append(f"    {'repaired' if self.repaired else 'NOT repaired'}: {self.action}")
        return "\n".join(lines)


@dataclass(frozen=True)
class DoctorReport:
    """What :func:`doctor` found and, with ``repair=True``, did.

    ``ok`` is True when nothing was found. After a repair, ``remaining`` lists
    what a fresh check still finds (empty when the repair fully worked).
    Prints as a readable report; ``python -m metamode doctor`` exits 1 unless
    ``ok``.
    """

    findings: tuple[Finding, ...]
    repair_attempted: bool = False
    remaining: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()  # global changes that are intended or in progress, not findings

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def repaired(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.repaired)

    def __str__(self) -> str:
        notes = "".join(f"\n- note: {note}" for note in self.notes)
        if self.ok:
            return f"metamode doctor: torch's global state is clean (nothing found).{notes}"
        count = len(self.findings)
        head = f"metamode doctor: {count} finding{'s' if count != 1 else ''}"
        if self.repair_attempted:
            head += f"; repaired {len(self.repaired)}, {len(self.remaining)} remain"
            if self.remaining:
                head += " (restart the process to recover fully)"
        else:
            head += "; run metamode.doctor(repair=True) to restore torch's originals"
        body = "\n".join(f"- {finding}".replace("\n", "\n  ") for finding in self.findings)
        return f"{head}\n{body}{notes}"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(str(self))


def doctor(repair: bool = False) -> DoctorReport:
    """Inspect this process for global torch patches and leftovers.

    Checks that ``torch.nn.Module``'s methods, ``torch.nn.init``'s functions and torch's
    factories (``torch.empty``, ``zeros``, ``full``, ``linspace``...) are torch's own, also
    where a torch module bound them by name and in torch's table of the factories
    ``torch.device(...)`` places; that the default dtype is ``float32`` (or the
    dtype of a load's open dtype window), naming the loading paths that most likely left
    it; that no default device is set; that PEFT's ``_init_on_device._skip`` is not left
    set; that no torch-function mode is left on the calling thread's stack; and that
    metamode's registration hooks are installed. ``notes`` lists global changes that are
    not findings: open dtype windows, and transformers' ``nn.Module.smart_apply``. Originals
    are recognised by where they are defined, so this holds even if metamode was imported
    after the damage. The intended changes in
    :mod:`metamode._diagnostics.known_changes` are not findings, and repair keeps them.

    Args:
        repair: restore torch's originals (functions, default dtype/device),
            rebuild torch's table of the factories ``torch.device(...)`` places,
            clear PEFT's stale flag and pop modes left on the calling thread's
            stack, then check again. The default dtype is not repaired while a load's
            dtype window is open (the finding says so). The only place metamode assigns torch
            attributes, and only to put torch's own objects back.

    Returns a :class:`DoctorReport`; ``print`` it to read it. Per-thread
    state (the mode stack, ``torch.set_default_device``) is the calling
    thread's. Do not call ``repair=True`` inside a ``with`` block of any
    torch-function mode: it would be popped. Repair while no other thread is
    inside a patching context: such a context puts back, on exit, whatever it
    captured on entry -- possibly another thread's patch.
    """
    findings = _examine()
    if not repair:
        return DoctorReport(findings, repair_attempted=False, remaining=findings, notes=_notes())
    originals = _Recovered(findings)
    done = tuple(_apply_repair(finding, originals) for finding in findings)
    return DoctorReport(done, repair_attempted=True, remaining=_examine(), notes=_notes())


class _Recovered:
    """torch's originals for every replaced Python function, recovered together.

    One walk of the heap serves all findings (it is the slow step: a pass
    over every object the garbage collector tracks).
    """

    def __init__(self, findings: tuple[Finding, ...]) -> None:
        self._wanted = {f._slot: f._current for f in findings if f._slot is not None}
        self._found: dict[FunctionSlot, tuple[FunctionType, str]] | None = None

    def get(self, slot: FunctionSlot) -> tuple[object, str] | None:
        if self._found is None:
            currents = {k: None if v is _MISSING else v for k, v in self._wanted.items()}
            self._found = _originals.recover_all(self._wanted, currents)
        return self._found.get(slot)


def _apply_repair(finding: Finding, originals: _Recovered) -> Finding:
    if finding._repair is None:
        return replace(finding, action="no automatic repair", repaired=False)
    try:
        action = finding._repair(originals)
    except _CannotRepair as error:
        return replace(finding, action=str(error), repaired=False)
    except Exception as error:  # a repair must never take the report down with it
        return replace(finding, action=f"failed: {type(error).__name__}: {error}", repaired=False)
    return replace(finding, action=action, repaired=True)


class _CannotRepair(Exception):
    pass


def _examine() -> tuple[Finding, ...]:
    module_slots = _module_layout()
    init_slots = {name: FunctionSlot(torch.nn.init, name) for name in _init_names()}
    findings: list[Finding] = []
    findings += _check_slots(torch.nn.Module, "torch.nn.Module", module_slots)
    findings += _check_slots(torch.nn.init, "torch.nn.init", init_slots)
    findings += _check_factories(torch, "torch")
    findings += _check_device_table()
    findings += _check_bound_by_name(init_slots)
    findings += _check_hooks()
    findings += _check_peft_skip()
    findings += _check_default_dtype()
    findings += _check_default_device()
    findings += _check_modes()
    return tuple(findings)


# -- torch functions ----------------------------------------------------------


def _module_layout() -> dict[str, FunctionSlot]:
    layout = _originals.class_layout(torch.nn.Module)
    if layout is None:
        layout = {n: FunctionSlot(_torch_module, f"Module.{n}") for n in _FALLBACK_MODULE_METHODS}
    return layout


def _init_names() -> list[str]:
    return _originals.public_functions(torch.nn.init) or list(_FALLBACK_INIT_FUNCTIONS)


def _factory_names() -> list[str]:
    return [name for name in FACTORY_NAMES if _originals.builtin_original(name) is not None]


def _restore_function(owner: object, name: str, slot: FunctionSlot, originals: _Recovered) -> str:
    found = originals.get(slot)
    if found is None:
        raise _CannotRepair(
            f"torch's {slot.label} could not be found (no reference survives and the "
            f"source file is unavailable or differs)"
        )
    original, how = found
    current = vars(owner).get(name)
    try:
        change, wrapper = _known_changes.innermost_wrapper(owner, name, current)
    except LookupError:
        setattr(owner, name, original)
        return f"restored {slot.label} ({how})"
    # Never undo an intended change: put torch's own back *under* its wrapper.
    _known_changes.rewrap(change, wrapper, original)
    return f"restored {slot.label} ({how}) inside the wrapper of {change.who}"


def _check_slots(owner: object, label: str, slots: dict[str, FunctionSlot]) -> list[Finding]:
    findings = []
    namespace = vars(owner)
    for name, slot in slots.items():
        current = namespace.get(name, _MISSING)
        if current is not _MISSING:
            # Intended changes (metamode._diagnostics.known_changes) are not findings:
            # judge what a recognised wrapper wraps.
            current = _known_changes.underlying(owner, name, current)
        if current is not _MISSING and slot.is_original(current):
            continue
        if current is _MISSING:
            problem, culprit = "missing (deleted from the namespace)", None
        else:
            problem, culprit = "is not torch's own", _originals.describe(current)
        findings.append(
            Finding(
                f"{label}.{name}",
                problem,
                culprit,
                _repair=functools.partial(_restore_function, owner, name, slot),
                _slot=slot,
                _current=current,
            )
        )
    return findings


def _check_factories(
    owner: ModuleType, label: str, names: list[str] | None = None
) -> list[Finding]:
    findings = []
    for name in names if names is not None else _factory_names():
        current = vars(owner).get(name, _MISSING)
        original = _originals.builtin_original(name)
        if current is original:
            continue
        findings.append(
            Finding(
                f"{label}.{name}",
                "missing" if current is _MISSING else "is not torch's own",
                None if current is _MISSING else _originals.describe(current),
                _repair=lambda _, o=owner, n=name, v=original: _set(  # type: ignore[misc]
                    o, n, v, f"restored {_torch.VARIABLE_FUNCTIONS_NAME}.{n}"
                ),
            )
        )
    return findings


_DEVICE_TABLE = "torch.utils._device._device_constructors()"


def _check_device_table() -> list[Finding]:
    """torch builds its table of the factories ``torch.device(...)`` places once, from the
    torch functions of that moment: built while one was replaced, it holds the replacement."""
    return [
        Finding(
            _DEVICE_TABLE,
            "holds a replacement where torch's own factory belongs, so torch.device(...), "
            "torch.set_default_device and include_buffers=True no longer place that factory "
            "(the table was built while the replacement was in place)",
            _originals.describe(entry),
            _repair=_rebuild_device_table,
        )
        for entry in sorted(_torch.device_constructors(), key=repr)
        if not _originals.defined_in_torch(entry)
    ]


def _rebuild_device_table(_: _Recovered) -> str:
    _torch.device_constructors.cache_clear()
    _torch.device_constructors()
    _facts.relearn_factories()
    if _check_device_table():
        raise _CannotRepair(
            "rebuilt it, but a factory it is built from is still replaced: repair that "
            "factory, then the table"
        )
    return "rebuilt it from torch's own functions"


def _set(owner: object, name: str, value: object, action: str) -> str:
    setattr(owner, name, value)
    return action


def _check_bound_by_name(init_slots: dict[str, FunctionSlot]) -> list[Finding]:
    """torch modules that did ``from torch.nn.init import f`` / ``from torch import empty``.

    A patcher that wants to catch every caller (transformers'
    ``guard_torch_init_functions``) replaces those bindings too. Only values
    that are not torch's own are looked at, and a module counts as binding
    the name only if its source imports it from there, so a module's own
    function of the same name (``torch._refs.zeros``) is never reported.
    """
    factory_names = _factory_names()
    findings: list[Finding] = []
    for module_name, module in sorted(sys.modules.items()):
        if (
            not isinstance(module, ModuleType)
            or not module_name.startswith("torch.")
            or module is torch.nn.init
        ):
            continue
        namespace = vars(module)
        for name, slot in init_slots.items():
            value = namespace.get(name, _MISSING)
            if value is _MISSING or slot.is_original(value) or _originals.defined_in_torch(value):
                continue
            if _binds(module, name, "torch.nn.init"):
                findings += _check_slots(module, module_name, {name: slot})
        for name in factory_names:
            value = namespace.get(name, _MISSING)
            if value is _MISSING or value is _originals.builtin_original(name):
                continue
            if not _originals.defined_in_torch(value) and _binds(module, name, "torch"):
                findings += _check_factories(module, module_name, [name])
    return findings


def _binds(module: ModuleType, name: str, source: str) -> bool:
    # Without the module's source we cannot tell a binding from a namesake,
    # and a false alarm is worse than a miss here: say nothing.
    return _originals.imported_from(module, name) == (source, name)


# -- other global state ---------------------------------------------------------


def _check_hooks() -> list[Finding]:
    if _hooks.installed():
        return []

    def reinstall(_: object) -> str:
        _hooks._install()
        return "re-registered metamode's parameter and buffer registration hooks"

    return [
        Finding(
            "torch.nn.modules.module global registration hooks",
            "metamode's hooks are missing (were torch's global hook dicts cleared?); "
            "metamode contexts will not move parameters",
            _repair=reinstall,
        )
    ]


def _peft_init_on_device_functions() -> list[object]:
    integrations = sys.modules.get("peft.utils.integrations")
    if integrations is None:
        return []
    functions = [vars(integrations).get("_init_on_device")]
    from metamode.integrations import peft as _peft

    functions.append(_peft._PEFT._originals.get("_init_on_device"))
    return [f for f in dict.fromkeys(functions) if f is not None]


def _check_peft_skip() -> list[Finding]:
    findings = []
    for function in _peft_init_on_device_functions():
        flag = vars(function).get("_skip", False) if hasattr(function, "__dict__") else False
        if flag is False:
            continue

        def clear(_: object, f=function) -> str:
            vars(f).pop("_skip", None)
            return "cleared the flag"

        findings.append(
            Finding(
                f"{_originals.describe(function).split(' (')[0]}._skip",
                f"is {flag!r}: PEFT will not move any parameter to meta in any thread "
                f"(stale unless another thread is inside skip_init_on_device right now)",
                "peft.utils.integrations._skip_init_on_device: a stock skip_init_on_device "
                "block that is still open in another thread, or was abandoned without "
                "exiting, or exited after a tool other than metamode's PEFT shim swapped "
                "_init_on_device under it",
                _repair=clear,
            )
        )
    return findings


def _check_default_dtype() -> list[Finding]:
    dtype = torch.get_default_dtype()
    windows = dtype_windows.state()
    if dtype is torch.float32 or dtype in windows.running.values():
        return []  # float32, or the dtype of a load's open window (see _notes)

    def restore(_: object) -> str:
        if dtype_windows.state().stacks:
            raise _CannotRepair(
                "a load's dtype window is open: setting the default now would change the "
                "dtype it builds in; repair when no load is in progress"
            )
        torch.set_default_dtype(torch.float32)
        return "torch.set_default_dtype(torch.float32)"

    return [
        Finding(
            "default dtype",
            f"is {dtype}, not torch.float32: every later factory call in every thread "
            f"(torch.randn, nn.Linear) makes {dtype} tensors",
            _dtype_culprit(),
            _repair=restore,
        )
    ]


# The loading paths that set torch's default dtype themselves: (module imported when the
# library is in use, what sets it, the rebinding that routes it through dtype windows).
_DTYPE_SETTERS = (
    (
        "diffusers.models.modeling_utils",
        "diffusers' ModelMixin.from_pretrained(torch_dtype=...): it restores the default "
        "without try/finally, and concurrent loads restore each other's",
        "metamode.integrations.diffusers:_DIFFUSERS_DTYPE",
    ),
    (
        "transformers.modeling_utils",
        "transformers' from_pretrained(dtype=...) (local_torch_dtype, or 4.x "
        "_set_default_dtype): concurrent loads restore each other's",
        "metamode.integrations.transformers:_TRANSFORMERS_DTYPE,_TRANSFORMERS_4_DTYPE",
    ),
)


def _dtype_culprit() -> str:
    suspects = []
    for module, what, routing in _DTYPE_SETTERS:
        if module not in sys.modules:
            continue
        home, names = routing.split(":")
        rebindings = [getattr(sys.modules.get(home), name, None) for name in names.split(",")]
        if not any(getattr(r, "enabled", False) for r in rebindings):
            suspects.append(what)
    if not suspects:
        return "unknown: something called torch.set_default_dtype() and did not restore it"
    return "most likely " + "; or ".join(suspects) + " (metamode.enable() routes these)"


def _notes() -> tuple[str, ...]:
    notes = []
    windows = dtype_windows.state()
    for thread, dtype in windows.running.items():
        notes.append(
            f"thread {thread} is loading in a dtype window: the process default is {dtype} "
            f"until the last window closes, then {windows.baseline}"
        )
    if "smart_apply" in vars(torch.nn.Module):
        notes.append(
            "torch.nn.Module.smart_apply was added by transformers' "
            "PreTrainedModel.initialize_weights on its first call and stays for the process "
            "(intended by transformers; repair keeps it: a load in progress calls it)"
        )
    return tuple(notes)


def _device_contexts_on_stack() -> list[_torch.DeviceContext]:
    return [m for m in _stack.modes_innermost_first() if isinstance(m, _torch.DeviceContext)]


def _check_default_device() -> list[Finding]:
    findings = []
    global_context = _torch.global_device_context()
    if global_context is not None:
        findings.append(
            Finding(
                "default device (this thread)",
                f"torch.set_default_device({str(global_context.device)!r}) is in force",
                "unknown: something called torch.set_default_device() and did not reset it",
                _repair=_reset_default_device,
            )
        )
    for mode in _device_contexts_on_stack():
        if mode is global_context:
            continue
        findings.append(
            Finding(
                "default device (this thread)",
                f"a `with torch.device({str(mode.device)!r})` block was never exited",
                _originals.describe(type(mode)),
                _repair=_reset_default_device,
            )
        )
    current = _torch.current_device()
    if current is not None and not findings:
        findings.append(
            Finding(
                _torch.CURRENT_DEVICE_NAME,
                f"is {current} with no device context in this thread (a torch.device "
                f"context exited out of order, or another thread is inside one now)",
                None,
                _repair=_reset_default_device,
            )
        )
    return findings


def _reset_default_device(_: object) -> str:
    # Several findings share this repair; the first call does the work.
    done = []
    if _torch.global_device_context() is not None:
        try:
            torch.set_default_device(None)
        except AssertionError:  # torch's own exit found a stack it did not expect
            _torch.set_global_device_context(None)
        done.append("torch.set_default_device(None)")
    for mode in _device_contexts_on_stack():
        _stack.remove(mode)
        done.append(f"removed torch.device({str(mode.device)!r}) from this thread's mode stack")
    if _torch.current_device() is not None:
        _torch.clear_current_device()
        done.append(f"reset {_torch.CURRENT_DEVICE_NAME} to None")
    return "; ".join(done) or "already reset by the repair above"


def _check_modes() -> list[Finding]:
    findings = []
    for mode in _stack.modes_innermost_first():
        if isinstance(mode, _torch.DeviceContext):
            continue  # reported as a default device

        def pop(_: object, m=mode) -> str:
            if not _stack.remove(m):
                return "already gone"
            return f"removed {m!r} from this thread's torch-function mode stack"

        findings.append(
            Finding(
                "torch-function mode stack (this thread)",
                f"{mode!r} is active (left behind, unless doctor() was called inside its block)",
                _originals.describe(type(mode)),
                _repair=pop,
            )
        )
    return findings


# -- command line ---------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m metamode doctor [--repair] [--import MODULE ...]``.

    Exit status 0 when nothing was found, 1 otherwise (also after a repair:
    the process *was* corrupted), 2 when a ``--import`` module cannot be
    imported (one line on stderr; nothing is checked) or the arguments are
    wrong. ``--import`` imports modules first, to check that importing a
    library leaves torch alone.
    """
    parser = argparse.ArgumentParser(
        prog="python -m metamode doctor",
        description="Find (and optionally repair) global patches left in torch.",
        epilog="Exit status: 0 nothing found; 1 findings (also after --repair); "
        "2 a --import module could not be imported, or bad arguments.",
    )
    parser.add_argument("--repair", action="store_true", help="restore torch's originals")
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE before checking (repeatable)",
    )
    args = parser.parse_args(argv)
    for name in args.imports:
        try:
            importlib.import_module(name)
        except Exception as error:
            message = str(error).splitlines()[0] if str(error) else ""
            print(
                f"{parser.prog}: error: --import {name}: {type(error).__name__}: {message}",
                file=sys.stderr,
            )
            return 2
    report = doctor(repair=args.repair)
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
