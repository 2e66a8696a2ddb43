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

import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from metamode._core.recording.program import Draw, Program, Start

__all__ = ["GeneratorTrack", "before_draw", "mark", "replayed"]


@dataclass(slots=True)
class _Marker:
    program: weakref.ref[Program]
    call: int  # eager's state is the one right after this call's draw on ...
    stream: int  # ... this stream of the program
    state: torch.Tensor | None = None  # that state, once a replay computed it


_MARKERS: dict[int, _Marker] = {}  # marker seed -> marker
_BY_PROGRAM: dict[int, list[int]] = {}  # program serial -> its marker seeds
# Markers of programs that are gone, kept because a replay computed their state (so a
# later build can still continue the stream); the oldest go first beyond _KEEP.
_KEPT: OrderedDict[int, None] = OrderedDict()
_KEEP = 256
_LOCK = threading.RLock()  # a finalizer may run while it is held


@dataclass(slots=True)
class GeneratorTrack:
    """One generator, as one recording sees it."""

    generator: torch.Generator
    stream: int
    marker: int | None = None  # the marker this recording set last
    marked_state: bytes = b""  # the generator's state right after that marker was set


def _state(generator: torch.Generator) -> bytes:
    return generator.get_state().numpy().tobytes()


def _marker_value(program: Program, call: int, stream: int) -> int:
    digest = hashlib.blake2b(f"metamode {program.serial} {call} {stream}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") | (1 << 63)


def before_draw(track: GeneratorTrack, program: Program, last_call: int | None) -> Draw:
    """Where eager's state of ``track``'s generator is now, for a draw about to be recorded;
    ``last_call`` is this program's previous draw on the stream (None if none)."""
    generator = track.generator
    seed = generator.initial_seed()
    if seed == track.marker:
        if _state(generator) == track.marked_state:
            return Draw(track.stream, Start.CONTINUE) if last_call is not None else _after(
                track, program, seed
            )
        return _unknown(track)
    with _LOCK:
        known = seed in _MARKERS
    if not known:
        return Draw(track.stream, Start.ANCHOR, state=generator.get_state())
    marked = torch.Generator().manual_seed(seed).get_state().numpy().tobytes()
    if _state(generator) != marked:
        return _unknown(track)
    return _after(track, program, seed)


def _after(track: GeneratorTrack, program: Program, seed: int) -> Draw:
    with _LOCK:
        marker = _MARKERS.get(seed)
    source = marker.program() if marker is not None else None
    if source is not None and marker is not None:
        return Draw(track.stream, Start.AFTER, after=(source, marker.call, marker.stream))
    if marker is not None and marker.state is not None:
        return Draw(track.stream, Start.ANCHOR, state=marker.state)
    return Draw(
        track.stream,
        Start.UNKNOWN,
        reason="its generator continues a replayable build whose recording is gone",
    )


def _unknown(track: GeneratorTrack) -> Draw:
    return Draw(
        track.stream,
        Start.UNKNOWN,
        reason=(
            "its generator was drawn from by code metamode did not record (outside the "
            "replayable context, or with torch functions disabled) after draws the "
            "recording skipped on meta, so eager construction's state is unknown"
        ),
    )


def mark(track: GeneratorTrack, program: Program, call: int) -> None:
    """Put ``track``'s generator in the marker state naming ``program``'s ``call``."""
    seed = _marker_value(program, call, track.stream)
    with _LOCK:
        seeds = _BY_PROGRAM.get(program.serial)
        if seeds is None:
            seeds = _BY_PROGRAM[program.serial] = []
            serial = program.serial
            program.finalizer = weakref.finalize(program, _forget, serial)
        seeds.append(seed)
        _MARKERS[seed] = _Marker(weakref.ref(program), call, track.stream)
    program.markers[(call, track.stream)] = seed
    track.generator.manual_seed(seed)
    track.marker = seed
    track.marked_state = _state(track.generator)


def replayed(seed: int, state: torch.Tensor) -> None:
    """A replay computed eager's state at marker ``seed``: keep it for later builds."""
    with _LOCK:
        marker = _MARKERS.get(seed)
        if marker is not None:
            marker.state = state


def _forget(serial: int) -> None:
    with _LOCK:
        for seed in _BY_PROGRAM.pop(serial, ()):
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
