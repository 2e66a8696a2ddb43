"""Record a build, plan a replay, run it: the home of everything ``materialize`` needs.

:mod:`.program` is the format, :mod:`.recorder` writes it while a replayable context
is active, :mod:`.streams` keeps track of generator states, :mod:`.registry` says which
program a registered tensor comes from, :mod:`.plan` picks the calls a set of tensors
needs and what is refused, and :mod:`.execute` runs them. Nothing outside this package
reads a program.
"""

from metamode._core.recording.execute import ProcessChanged, ReplayError, execute, with_bits
from metamode._core.recording.plan import Key, Plan, plan
from metamode._core.recording.program import Program, ProgramState, TensorRef
from metamode._core.recording.recorder import Recorder
from metamode._core.recording.registry import (
    Entry,
    closed_programs,
    entry,
    forget,
    home,
    homes_holding,
    remember,
    weakly_held_elsewhere,
)

__all__ = [
    "Entry",
    "Key",
    "Plan",
    "Program",
    "ProcessChanged",
    "ProgramState",
    "Recorder",
    "ReplayError",
    "TensorRef",
    "closed_programs",
    "entry",
    "execute",
    "forget",
    "home",
    "homes_holding",
    "plan",
    "remember",
    "weakly_held_elsewhere",
    "with_bits",
]
