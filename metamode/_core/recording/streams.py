"""How a recording knows the state eager construction's generators were in.

A draw on a meta tensor draws nothing, so after one the real generator is no longer where
eager construction would have left it. From then on the recorder keeps the generator in
a *marker* state: ``manual_seed`` of a value that names the program and the call after
which eager's state is known. The generator itself then carries the fact, whatever
happens between recorded calls:

* still on the marker the recorder set: the stream continues;
* on another marker: eager's state is the one after that call (``torch.set_rng_state``
  to a saved state, ``fork_rng`` leaving, or a later context continuing an earlier one);
* advanced from a marker by draws nobody recorded: eager's state is unknowable;
* anything else: a state no skipped draw shifted (the entry state, ``manual_seed``),
  which is eager's state exactly.

So the generator a replayable build leaves behind is in a marker state when the build
skipped draws: deterministic, and not the state eager construction leaves.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from metamode._core.recording.program import Draw, Program, Start

__all__ = [
    "DRAWING",
    "Flight",
    "GeneratorTrack",
    "before_draw",
    "drawn_from_marker",
    "land",
    "mark",
    "replayed",
    "take_off",
]


class _Marker:
    __slots__ = ("call", "program", "state", "stream")

    def __init__(self, program: weakref.ref[Program], call: int, stream: int) -> None:
        self.program = program
        self.call = call  # eager's state is the one right after this call's draw on ...
        self.stream = stream  # ... this stream of the program
        self.state: torch.Tensor | None = None  # that state, once a replay computed it


_MARKERS: dict[int, _Marker] = {}  # marker seed -> marker
# program serial -> its marker seeds, the last one naming its latest marked call
_BY_PROGRAM: dict[int, list[int]] = {}
_LAST_CALL: dict[int, int] = {}  # program serial -> the latest call it set a marker after
# Markers of programs that are gone, kept because a replay computed their state (so a
# later build can still continue the stream); the oldest go first beyond _KEEP.
_KEPT: OrderedDict[int, None] = OrderedDict()
_KEEP = 256
# program serial (as a marker packs it) -> the last call it set a marker after, for every
# program that set markers and is gone: a generator still in one of those marker states
# (the build was dropped before materialize computed that state) continues a stream
# nobody can replay. A few bytes per program; kept for the life of the process.
_DEAD: dict[int, int] = {}
_LOCK = threading.RLock()  # a finalizer may run while it is held
# Held by a recorder from reading a generator's state before a draw (before_draw) to
# setting the marker after it (mark): for other threads recording draws, one step, as
# each of eager's draws is. Not held while a call that draws for real runs (it may run
# code that waits for another thread): that call is a Flight, and a draw from its
# generator that another thread's recorder starts meanwhile makes both unknown.
DRAWING = threading.RLock()


@dataclass(slots=True)
class GeneratorTrack:
    """One generator, as one recording sees it."""

    generator: torch.Generator
    stream: int
    marker: int | None = None  # the marker this recording set last
    # drawn_from_marker when the recording first saw it
    at_start: bytes | None = None


def _state_bytes(generator: torch.Generator, size: int | None = None) -> bytes:
    state = generator.get_state()
    return ctypes.string_at(state.data_ptr(), state.numel() if size is None else size)


def _learn_fresh_header() -> tuple[int, bytes] | None:
    """(n, bytes) such that a CPU generator's state starts with ``bytes`` after its seed's
    8 bytes exactly when no number was drawn since ``manual_seed`` (its mt19937 position),
    if this torch lays the state out so; else None (the whole state is compared)."""
    probe = torch.Generator()
    headers = []
    for seed in (12345, 67890):
        probe.manual_seed(seed)
        headers.append(_state_bytes(probe, 24)[8:])
    torch.rand(3, generator=probe)
    moved = _state_bytes(probe, 24)[8:]
    if headers[0] == headers[1] and moved != headers[0]:
        return 24, headers[0]
    return None


_FRESH_HEADER = _learn_fresh_header()
_HEADER = ctypes.c_char * 16  # the fresh header's bytes, after the seed's 8
_SCRATCH = torch.Generator()


def _fresh(generator: torch.Generator, seed: int) -> bool:
    """Whether ``generator``, seeded with ``seed`` (its ``initial_seed()``), drew nothing
    since."""
    if _FRESH_HEADER is not None:
        state = generator.get_state()
        return _HEADER.from_address(state.data_ptr() + 8).raw == _FRESH_HEADER[1]
    with _LOCK:
        _SCRATCH.manual_seed(seed)
        return _state_bytes(generator) == _state_bytes(_SCRATCH)


_MASK = (1 << 64) - 1
_ODD = 0x9E3779B97F4A7C15  # odd: multiplying by it is a bijection on 64 bits
_ODD_INVERSE = pow(_ODD, -1, 1 << 64)
_OFFSET = 0xD1B54A32D192ED03


def _marker_value(program: Program, call: int, stream: int) -> int:
    """A seed naming (program, call, stream): the three packed into 64 bits, then
    multiplied by an odd constant, offset and xor-shifted (each a bijection), so distinct
    triples give distinct seeds, spread far from the small seeds people pick."""
    packed = (program.serial & 0xFFFFFF) << 40 | (call & 0xFFFFFFFF) << 8 | stream & 0xFF
    value = (packed * _ODD + _OFFSET) & _MASK
    return value ^ (value >> 32)


def _packed(seed: int) -> int:
    """The (serial, call, stream) word whose :func:`_marker_value` is ``seed``."""
    value = seed & _MASK
    return ((value ^ (value >> 32)) - _OFFSET) * _ODD_INVERSE & _MASK


def _dead_marker(seed: int) -> bool:
    """Whether ``seed`` is a marker a program that is gone set (and no replay kept)."""
    if not _DEAD:
        return False
    packed = _packed(seed)
    last = _DEAD.get(packed >> 40)
    return last is not None and (packed >> 8) & 0xFFFFFFFF <= last


def before_draw(
    track: GeneratorTrack, program: Program, last_call: int | None, keywords: tuple[str, ...]
) -> Draw:
    """Where eager's state of ``track``'s generator is now, for a draw about to be recorded
    that replay passes the generator to under ``keywords``; ``last_call`` is this
    program's previous draw on the stream (None if none)."""
    generator = track.generator
    if _FLIGHTS and _overlaps(generator):
        return Draw(track.stream, Start.UNKNOWN, reason=_COLLIDED, keywords=keywords)
    seed = generator.initial_seed()
    if seed == track.marker and last_call is not None:  # the marker it set last
        if _fresh(generator, seed):
            return _continue(track.stream, keywords)
        return _unknown(track, keywords)
    if seed not in _MARKERS:
        if _dead_marker(seed):
            return Draw(track.stream, Start.UNKNOWN, reason=_GONE, keywords=keywords)
        return Draw(track.stream, Start.ANCHOR, state=generator.get_state(), keywords=keywords)
    if not _fresh(generator, seed):
        return _unknown(track, keywords)
    return _after(track, program, seed, keywords)


@functools.cache
def _continue(stream: int, keywords: tuple[str, ...]) -> Draw:
    """A draw that continues its stream (never changed once recorded: shared)."""
    return Draw(stream, Start.CONTINUE, keywords=keywords)


def _after(track: GeneratorTrack, program: Program, seed: int, keywords: tuple[str, ...]) -> Draw:
    with _LOCK:
        marker = _MARKERS.get(seed)
    source = marker.program() if marker is not None else None
    stream = track.stream
    if source is not None and marker is not None:
        after = (source, marker.call, marker.stream)
        return Draw(stream, Start.AFTER, after=after, keywords=keywords)
    if marker is not None and marker.state is not None:
        return Draw(stream, Start.ANCHOR, state=marker.state, keywords=keywords)
    return Draw(stream, Start.UNKNOWN, reason=_GONE, keywords=keywords)


_GONE = (
    "its generator continues an earlier replayable build that was dropped, and no materialize "
    "computed where that build leaves the generator (materialize replays only the draws its "
    "tensors need, so not draws after the last of them, and keeps the last 256 states it "
    "computed), so eager construction's state here is unknown; keep the earlier build until "
    "this one is built, or call torch.manual_seed before this one"
)


def _unknown(track: GeneratorTrack, keywords: tuple[str, ...]) -> Draw:
    return Draw(
        track.stream,
        Start.UNKNOWN,
        keywords=keywords,
        reason=(
            "its generator was drawn from by code metamode did not record (outside the "
            "replayable context, or with torch functions disabled) after draws the "
            "recording skipped on meta, so eager construction's state is unknown"
        ),
    )


class Flight:
    """A recorded call drawing from a generator while it runs, outside ``DRAWING``."""

    __slots__ = ("collided", "generator", "index", "thread")

    def __init__(self, generator: torch.Generator, index: int) -> None:
        self.generator = generator
        self.index = index  # its draw's position in the call's draws
        self.thread = threading.get_ident()
        self.collided = False  # another thread's recorded draw started meanwhile


# id(generator) -> the flights drawing from it now
_FLIGHTS: dict[int, list[Flight]] = {}
_COLLIDED = (
    "another thread's recorded call drew from the same generator while this one ran, so "
    "which drew first is unknown; build in one thread, or give each thread a generator"
)


def take_off(tracks: list[GeneratorTrack | None], flights: list[Flight]) -> None:
    """Note that a call about to run draws from ``tracks``' generators (under ``DRAWING``)."""
    for index, track in enumerate(tracks):
        if track is not None:
            flight = Flight(track.generator, index)
            _FLIGHTS.setdefault(id(track.generator), []).append(flight)
            flights.append(flight)


def land(flights: list[Flight], draws: list | None = None) -> list | None:
    """The call noted by ``flights`` ran, or raised (under ``DRAWING``): its ``draws``, a
    draw that another thread's draw from the same generator overlapped made unknown."""
    for flight in flights:
        flying = _FLIGHTS.get(id(flight.generator), [])
        if flight in flying:
            flying.remove(flight)
        if not flying:
            _FLIGHTS.pop(id(flight.generator), None)
        if flight.collided and draws is not None:
            track, draw = draws[flight.index]
            draws[flight.index] = (
                track,
                Draw(draw.stream, Start.UNKNOWN, reason=_COLLIDED, keywords=draw.keywords),
            )
    flights.clear()
    return draws


def _overlaps(generator: torch.Generator) -> bool:
    """Whether another thread's recorded call is drawing from ``generator`` now (each of
    them is then unknown)."""
    flying = _FLIGHTS.get(id(generator))
    if not flying:
        return False
    me = threading.get_ident()
    others = [f for f in flying if f.thread != me]
    for flight in others:
        flight.collided = True
    return bool(others)


def drawn_from_marker(generator: torch.Generator) -> bytes | None:
    """``generator``'s state if code nobody recorded drew from a marker state (of any build,
    live or gone) since a recorder set it there, else None: compared at a build's end with
    the same read at its start, a change is a draw of the build's that no one recorded."""
    seed = generator.initial_seed()
    if seed not in _MARKERS and not _dead_marker(seed):
        return None
    if _fresh(generator, seed):
        return None
    return _state_bytes(generator)


def mark(track: GeneratorTrack, program: Program, call: int) -> None:
    """Put ``track``'s generator in the marker state naming ``program``'s ``call``."""
    seed = _marker_value(program, call, track.stream)
    seeds = _BY_PROGRAM.get(program.serial)
    if seeds is None:
        with _LOCK:
            seeds = _BY_PROGRAM[program.serial] = []
            program.finalizer = weakref.finalize(program, _forget, program.serial)
            program.reference = weakref.ref(program)
    seeds.append(seed)  # a single step under the GIL, as the ones below
    _LAST_CALL[program.serial] = call
    _MARKERS[seed] = _Marker(program.reference, call, track.stream)
    program.markers[(call, track.stream)] = seed
    track.generator.manual_seed(seed)
    track.marker = seed


def replayed(seed: int, state: torch.Tensor) -> None:
    """A replay computed eager's state at marker ``seed``: keep it for later builds."""
    with _LOCK:
        marker = _MARKERS.get(seed)
        if marker is not None:
            marker.state = state


def _forget(serial: int) -> None:
    with _LOCK:
        seeds = _BY_PROGRAM.pop(serial, ())
        last = _LAST_CALL.pop(serial, None)
        if last is not None:
            key = serial & 0xFFFFFF
            _DEAD[key] = max(last, _DEAD.get(key, 0))
        for seed in seeds:
            marker = _MARKERS.get(seed)
            if marker is None:
                continue
            if marker.state is None:
                del _MARKERS[seed]
            else:
                _KEPT[seed] = None
        while len(_KEPT) > _KEEP:
            seed, _ = _KEPT.popitem(last=False)
            _MARKERS.pop(seed, None)


def _after_fork_in_child() -> None:
    # a thread of the parent that held one of these does not exist in the child
    _LOCK._at_fork_reinit()  # type: ignore[attr-defined]
    DRAWING._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_after_fork_in_child)
