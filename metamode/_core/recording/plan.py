"""Planning a replay: which recorded calls the wanted tensors need, and what is refused.

A call is needed for its values when it writes or creates a storage some wanted tensor
(or a later needed call) reads; a random call is also needed, for its draws only, when a
needed draw continues from it. Draw-only calls run into scratch memory of the same
layout, so the generator advances exactly as it did in eager construction. Nothing after
a wanted tensor's last needed call runs.

A tensor is refused when something its value depends on cannot be known: a storage from
outside the recording that changed or is gone, a call that cannot be replayed, a draw
whose generator state is unknowable or that cannot be given a generator, a default dtype
that differs from the build's, or a build that left eager construction's path.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from metamode._core.recording import settings, thread_state
from metamode._core.recording.program import (
    Call,
    Origin,
    Program,
    ProgramState,
    Start,
    function_name,
)

__all__ = ["Key", "Plan", "Step", "Use", "plan"]

Key = tuple[int, int]  # (program serial, storage index)
DrawKey = tuple[int, int, int]  # (program serial, call index, stream)


class Use(enum.Enum):
    VALUES = "values"  # its results are needed
    DRAWS = "draws"  # only its draws are: it runs into scratch memory


@dataclass(slots=True)
class Step:
    program: Program
    index: int
    call: Call
    use: Use
    # stream -> the draw whose end state this step's draw starts from (None: an anchor)
    starts: dict[int, DrawKey | None] = field(default_factory=dict)
    # streams whose state after this step more than one needed draw starts from
    keep: tuple[int, ...] = ()


@dataclass(slots=True)
class Plan:
    steps: list[Step] = field(default_factory=list)
    wanted: list[Key] = field(default_factory=list)
    refused: dict[Key, str] = field(default_factory=dict)  # wanted storage -> why
    done_after: dict[Key, int] = field(default_factory=dict)  # wanted storage -> last step
    last_use: dict[Key, int] = field(default_factory=dict)  # storage -> last step using it
    programs: dict[int, Program] = field(default_factory=dict)  # serial -> program


def _key(program: Program, storage: int) -> Key:
    return (program.serial, storage)


def _program_reason(program: Program) -> str | None:
    if program.abandoned:
        return program.abandoned
    if program.state is ProgramState.RECORDING:
        return (
            f"its empty_weights context (thread {program.owner!r}) is still open; "
            f"materialize after the `with` block"
        )
    return program.diverged


def _previous_draws(program: Program) -> dict[tuple[int, int], int]:
    """(call index, stream) -> the index of the previous call drawing on that stream."""
    previous: dict[tuple[int, int], int] = {}
    last: dict[int, int] = {}
    for index, call in enumerate(program.calls):
        for draw in call.draws:
            if draw.stream in last:
                previous[(index, draw.stream)] = last[draw.stream]
            last[draw.stream] = index
    return previous


def _predecessors(
    program: Program, index: int, call: Call, previous: dict[tuple[int, int], int]
) -> dict[int, tuple[Program, int, int]]:
    """stream -> the draw each of ``call``'s draws continues from."""
    found = {}
    for draw in call.draws:
        if draw.start is Start.CONTINUE and (index, draw.stream) in previous:
            found[draw.stream] = (program, previous[(index, draw.stream)], draw.stream)
        elif draw.start is Start.AFTER and draw.after is not None:
            found[draw.stream] = draw.after
    return found


def plan(wanted: Iterable[tuple[Program, int]]) -> Plan:
    """The replay of the storages in ``wanted`` ((program, storage index) pairs)."""
    result = Plan()
    wanted = list(wanted)
    live: set[Key] = set()
    for program, storage in wanted:
        result.programs[program.serial] = program
        live.add(_key(program, storage))
        result.wanted.append(_key(program, storage))
    # every program a needed draw may continue from
    pending = list(result.programs.values())
    while pending:
        program = pending.pop()
        for call in program.calls:
            for draw in call.draws:
                if draw.after is not None and draw.after[0].serial not in result.programs:
                    result.programs[draw.after[0].serial] = draw.after[0]
                    pending.append(draw.after[0])
    previous = {serial: _previous_draws(p) for serial, p in result.programs.items()}
    calls = sorted(
        ((p, i, c) for p in result.programs.values() for i, c in enumerate(p.calls)),
        key=lambda item: item[2].seq,
    )
    # backwards: which calls are needed, for values or for draws only
    draws_needed: dict[DrawKey, int] = {}  # draw -> how many needed draws continue from it
    chosen: list[tuple[Program, int, Call, Use]] = []
    for program, index, call in reversed(calls):
        serial = program.serial
        outs = {(serial, s) for s in (*call.writes, *call.creates)}
        for_values = bool(outs & live)
        for_draws = any((serial, index, d.stream) in draws_needed for d in call.draws)
        if not (for_values or for_draws):
            continue
        chosen.append((program, index, call, Use.VALUES if for_values else Use.DRAWS))
        for source, at, stream in _predecessors(program, index, call, previous[serial]).values():
            if (at, stream) in source.states:
                continue  # an earlier replay computed the state it starts from
            key = (source.serial, at, stream)
            draws_needed[key] = draws_needed.get(key, 0) + 1
        reads = {(serial, s) for s in call.reads}
        if for_values:
            if call.covers is not None:
                live.discard((serial, call.covers))
                reads.discard((serial, call.covers))
            live -= {(serial, s) for s in call.creates}
        elif call.target is not None:
            reads.discard((serial, call.target))
        live |= reads
    chosen.reverse()
    for position, (program, index, call, use) in enumerate(chosen):
        keep = tuple(
            d.stream
            for d in call.draws
            if draws_needed.get((program.serial, index, d.stream), 0) > 1
        )
        starts: dict[int, DrawKey | None] = {
            stream: (p.serial, i, st)
            for stream, (p, i, st) in _predecessors(
                program, index, call, previous[program.serial]
            ).items()
        }
        result.steps.append(Step(program, index, call, use, starts, keep))
        for storage in (*call.reads, *call.writes, *call.creates):
            result.last_use[_key(program, storage)] = position
        if use is Use.VALUES:
            for storage in (*call.writes, *call.creates):
                result.done_after[_key(program, storage)] = position
    _refusals(result, wanted)
    return result


def _refusals(result: Plan, wanted: list[tuple[Program, int]]) -> None:
    """Forward over the plan: why each storage's value, or each draw's state, is unknown."""
    tainted: dict[Key, str] = {}
    fixed: dict[Key, str] = {}  # refused whatever is written to them later
    states: dict[DrawKey, str] = {}  # draws after which the generator state is unknown
    default_dtype = torch.get_default_dtype()
    current = settings.now()
    flushing = thread_state.flushes_denormals()
    for program in result.programs.values():
        for index, storage in enumerate(program.storages):
            if storage.pinned is not None:
                fixed[_key(program, index)] = storage.pinned
            reason = storage.pinned or storage.refused or _origin_reason(storage)
            if reason is not None:
                tainted[_key(program, index)] = reason
    for step in result.steps:
        program, call, serial = step.program, step.call, step.program.serial
        reason = call.refused or _program_reason(program)
        reads = [s for s in call.reads if s != call.target]
        if reason is None:
            reason = next((tainted[(serial, s)] for s in reads if (serial, s) in tainted), None)
        if (
            reason is None
            and call.default_dtype is not None
            and call.default_dtype != default_dtype
        ):
            reason = (
                f"the build computed it under the default dtype {call.default_dtype}, and the "
                f"process default is {default_dtype} now (torch.set_default_dtype elsewhere?)"
            )
        if reason is None and reads and call.settings is not None and call.settings != current:
            reason = _settings_reason(call.settings, current)
        for draw in call.draws:
            before = step.starts.get(draw.stream)
            why = reason
            if why is None and draw.start is Start.UNKNOWN:
                why = f"{_name(call)} draws random numbers, and {draw.reason}"
            if why is None and not draw.keywords:
                why = f"{_name(call)} draws random numbers and takes no generator="
            if why is None and before is not None:
                why = states.get(before)
                if why is not None and before[0] != serial:
                    why = _continued(call, result.programs[before[0]], why)
            if why is not None:
                states[(serial, step.index, draw.stream)] = why
                reason = reason or why
        if reason is None and step.use is Use.VALUES:
            flushed = call.state is not None and call.state.flush_denormal
            if flushed != flushing:
                reason = _flush_reason(flushed)
        if step.use is Use.VALUES:
            for written in (*call.writes, *call.creates):
                key = (serial, written)
                if (written == call.covers or written in call.creates) and key not in fixed:
                    tainted.pop(key, None)  # all of it is this call's result now
                if reason is not None:
                    tainted.setdefault(key, reason)
    for program, index in wanted:
        key = _key(program, index)
        reason = _program_reason(program) or tainted.get(key)
        if reason is not None:
            result.refused[key] = reason


def _continued(call: Call, source: Program, why: str) -> str:
    """Why a draw continuing ``source``'s stream is refused: ``source``'s draw is."""
    if _CONTINUED in why:
        return why  # named at the first link of the chain
    return (
        f"{_name(call)} {_CONTINUED} (thread {source.owner!r}), where eager's state is "
        f"unknown because {why}"
    )


_CONTINUED = "continues the generator stream of another replayable build"


def _settings_reason(then: settings.ProcessSettings, current: settings.ProcessSettings) -> str:
    """Why a call that computed from tensor values under ``then`` cannot be replayed now."""
    changed = ", ".join(then.differences(current))
    return (
        f"it was computed from tensor values under process-wide settings that differ now "
        f"({changed}); replay does not change them, which would change other threads' "
        f"results too: set them back around materialize"
    )


def _flush_reason(flushed: bool) -> str:
    """Why a call the build ran with denormals ``flushed`` (or not) is not replayed in a
    thread that does the other."""
    then, now = ("flushed", "keeps") if flushed else ("kept", "flushes")
    return (
        f"the build computed it with subnormal floats {then} "
        f"(torch.set_flush_denormal({flushed})), and this thread {now} them: call "
        f"torch.set_flush_denormal({flushed}) in it before materialize"
    )


def _origin_reason(storage) -> str | None:
    if storage.origin is Origin.UNKNOWN:
        return (
            "it was made outside the recording on meta (under torch.device('meta'), a "
            "non-replayable context, or another replayable context)"
        )
    outside = storage.outside
    if outside is None:
        return None
    tensor = outside.tensor()
    if outside.snapshot is not None:
        return None  # its value when the build first read it
    if outside.written:
        return "the build wrote a tensor made outside the recording, so its first value is gone"
    if tensor is None:
        return "it was computed from a tensor made outside the recording that no longer exists"
    if tensor.untyped_storage()._cdata != outside.storage or tensor._version != outside.version:
        return "it was computed from a tensor made outside the recording that changed since"
    return None


def _name(call: Call) -> str:
    return function_name(call.func)
