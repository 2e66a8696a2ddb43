"""``python -m metamode bench-record``: what a replayable build costs against a plain one.

Each cell of the table is one model built in two fresh processes, one under
``empty_weights(include_buffers=..., replayable=False)`` and one under the same
context with ``replayable=True``; the ratio is replayable / plain.

* ``--mode callgrind`` counts instructions. The process re-executes itself under
  ``valgrind --tool=callgrind --instr-atstart=no``, so nothing is counted until the
  measured build: a tiny C shim over ``valgrind/callgrind.h`` (compiled with the
  system ``cc`` on first use into a cache directory, loaded with ctypes) switches
  instrumentation on and zeroes the counters right before the ``with`` block, and
  switches it off and dumps them right after. The cell is that dump's total ``Ir``:
  deterministic to a fraction of a percent, and free of machine load.
* ``--mode wall`` times the same block with ``time.perf_counter`` (best of
  ``--reps`` fresh processes, plain and replayable interleaved). It is what the
  command runs when valgrind, ``cc`` or ``callgrind.h`` is missing, and it says so
  above its table.

Every process first builds the tiny shape of the model plain, replayable (and
materializes it) and under the cell's own context, so lazy imports and first-use
costs stay outside the measured block; it measures with one intra-op thread and
``PYTHONHASHSEED=0``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["main", "measure", "parse_callgrind_total"]

# The C shim: each function is one client request sequence, a no-op outside valgrind.
SHIM_SOURCE = """\
#include <valgrind/callgrind.h>

int metamode_on_valgrind(void) { return RUNNING_ON_VALGRIND; }

void metamode_callgrind_start(void) {
    CALLGRIND_START_INSTRUMENTATION;
    CALLGRIND_ZERO_STATS;
}

void metamode_callgrind_stop(void) {
    CALLGRIND_STOP_INSTRUMENTATION;
    CALLGRIND_DUMP_STATS;
}
"""
_INSTALL_HINT = (
    "install valgrind (Debian/Ubuntu: `apt-get install valgrind`, which also provides "
    "valgrind/callgrind.h) and a C compiler (`apt-get install gcc`), or run with --mode wall"
)
_MODES = {False: "params-only", True: "include_buffers=True"}
_RESULT = "bench-record result: "


class CallgrindUnavailable(RuntimeError):
    """valgrind, a C compiler or ``valgrind/callgrind.h`` is missing; the message says which."""


# -- the shim -------------------------------------------------------------------------


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "metamode"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("cc")


def callgrind_problems() -> list[str]:
    """What stops ``--mode callgrind`` on this machine (empty when it can run)."""
    valgrind = [] if shutil.which("valgrind") else ["`valgrind` is not on PATH"]
    return valgrind + _shim_problems()


def _shim_problems() -> list[str]:
    problems = []
    compiler = _compiler()
    if compiler is None:
        problems.append("no C compiler (`cc`) on PATH")
    else:
        probe = subprocess.run(
            [compiler, "-E", "-x", "c", "-", "-o", os.devnull],
            input="#include <valgrind/callgrind.h>\n",
            capture_output=True,
            text=True,
        )
        if probe.returncode:
            problems.append(f"`{compiler}` cannot find valgrind/callgrind.h")
    return problems


def shim_path() -> Path:
    """The compiled shim, built into the cache directory on first use.

    Raises :class:`CallgrindUnavailable` naming what is missing and how to install it.
    """
    problems = _shim_problems()
    if problems:
        raise CallgrindUnavailable(f"{'; '.join(problems)}: {_INSTALL_HINT}")
    digest = hashlib.sha256(SHIM_SOURCE.encode()).hexdigest()[:16]
    target = _cache_dir() / f"callgrind-shim-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        source = Path(scratch) / "shim.c"
        source.write_text(SHIM_SOURCE)
        built = Path(scratch) / target.name
        done = subprocess.run(
            [str(_compiler()), "-shared", "-fPIC", "-O1", "-o", str(built), str(source)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise CallgrindUnavailable(f"compiling the callgrind shim failed:\n{done.stderr}")
        os.replace(built, target)  # atomic: concurrent first uses each install a whole file
    return target


class _Callgrind:
    """The shim, loaded with ctypes."""

    def __init__(self, path: str) -> None:
        import ctypes

        self._lib = ctypes.CDLL(path)
        self._start = self._lib.metamode_callgrind_start
        self._stop = self._lib.metamode_callgrind_stop

    def on_valgrind(self) -> bool:
        return bool(self._lib.metamode_on_valgrind())

    def start(self) -> None:
        self._start()

    def stop(self) -> None:
        self._stop()


def parse_callgrind_total(text: str) -> int:
    """The total ``Ir`` of one callgrind output file (its ``totals:`` or ``summary:`` line)."""
    events = re.search(r"^events:\s*(.+)$", text, re.M)
    names = events.group(1).split() if events else ["Ir"]
    if "Ir" not in names:
        raise ValueError(f"callgrind output has no Ir event (events: {' '.join(names)})")
    for key in ("totals", "summary"):
        line = re.search(rf"^{key}:\s*(.+)$", text, re.M)
        if line:
            return int(line.group(1).split()[names.index("Ir")])
    raise ValueError("callgrind output has neither a totals: nor a summary: line")


# -- one measurement, in this process -------------------------------------------------


def measure(
    model: str,
    include_buffers: bool,
    replayable: bool,
    tiny: bool,
    shim: str | None,
    floor: str | None = None,
    without: Sequence[str] = (),
) -> dict[str, Any]:
    """Build ``model`` once under the cell's context and report what was measured.

    With ``shim`` (the compiled shim's path), callgrind's instrumentation is on only
    around the ``with`` block; the caller reads the instruction count from the dump.
    ``floor`` names a reduced recorder (:data:`FLOORS`) the replayable builds use instead
    of the whole one: ``"log-only"`` only appends each call to a list, the floor of any
    recorder that sees the same calls; ``"call-time"`` does only what a recorder that
    analyses later must do when each call happens. ``without`` names parts of the
    recorder (:data:`PARTS`) the measured build runs without, after the warm-up.
    """
    import gc

    import torch

    import metamode
    from metamode.lab import workloads

    callgrind = _Callgrind(shim) if shim else None
    torch.set_num_threads(1)
    workloads.build(model, tiny=True)  # warm-up: lazy imports, first kernels
    if floor is not None:
        FLOORS[floor][0]()
    with metamode.empty_weights(replayable=True):  # metamode's first use imports its
        warm = workloads.build(model, tiny=True)  # integrations
    if floor is None:
        metamode.materialize(warm)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=replayable):
        workloads.build(model, tiny=True)
    del warm
    gc.collect()
    _knock_out(without)
    torch.manual_seed(0)
    if callgrind:
        callgrind.start()
    start = time.perf_counter()
    with metamode.empty_weights(include_buffers=include_buffers, replayable=replayable):
        built = workloads.build(model, tiny=tiny)
    seconds = time.perf_counter() - start
    if callgrind:
        callgrind.stop()
    tensors = [*built.parameters(), *built.buffers()]
    return {
        "seconds": seconds,
        "tensors": len(tensors),
        "on_meta": sum(t.is_meta for t in tensors),
        "on_valgrind": callgrind.on_valgrind() if callgrind else False,
    }


def _log_only() -> None:
    """Make this process's recorders append each call and registration to a list and do
    nothing else (nothing is left to materialize: the warm-up does not)."""
    from metamode._core.recording import recorder

    def record(
        self: Any,
        func: Any,
        args: tuple,
        kwargs: dict,
        runner: Any,
        fact: Any = None,
        flights: Any = None,
    ) -> Any:
        result, _ = runner.placed_call(func, args, kwargs)
        self.__dict__.setdefault("log", []).append((func, args, kwargs, result))
        return result

    def registered(self: Any, original: Any, placed: Any, module: Any = None, name: Any = None):
        self.__dict__.setdefault("log", []).append((original, placed, module, name))

    recorder.Recorder.record = record  # type: ignore[method-assign]
    recorder.Recorder.registered = registered  # type: ignore[method-assign]
    recorder.Recorder.close = lambda self: None  # type: ignore[method-assign]


def _call_time_only() -> None:
    """Make this process's recorders do, for each call and registration, only what a
    recorder that analyses its log later (at materialize) must still do when it happens,
    and append the rest to a list: the skip and placement decisions; each tensor
    argument's version, storage and geometry before the call and its version after;
    the thread's dispatch state and, for a call that computes from tensors, the process
    settings; a read of metadata that is meta, with its frame; a skipped draw's
    generator state read and marker. Nothing is analysed, so nothing can be
    materialized."""
    import torch

    from metamode._core.facts import _FACTS, fact_of
    from metamode._core.recording import recorder, settings, thread_state
    from metamode._core.recording.streams import DRAWING, mark

    def seen(tensor: torch.Tensor) -> tuple:
        storage = tensor.untyped_storage()._cdata
        geometry = (tensor.shape, tensor.stride(), tensor.storage_offset())
        return tensor._version, storage, geometry

    def marked(self: Any, draws: list) -> None:
        for track, _ in draws:
            if track is not None:
                mark(track, self.program, len(self.log))

    def record(
        self: Any,
        func: Any,
        args: tuple,
        kwargs: dict,
        runner: Any,
        fact: Any = None,
        flights: Any = None,
    ) -> Any:
        log = self.__dict__.setdefault("log", [])
        fact = fact or _FACTS.get(func) or fact_of(func)
        if fact.query:
            result = func(*args, **kwargs)
            if (
                (fact.is_meta and result is True)
                or (fact.device and result.type == "meta")
                or (fact.placement and not fact.is_meta and args[0].is_meta)
            ):
                frame = sys._getframe(1)
                log.append((func, args[0], result, frame, frame.f_lasti))
            return result
        state = thread_state.current()
        target = runner.skips(func, args, kwargs)
        if target is not None:
            if fact.random:
                with DRAWING:
                    marked(self, self._begin_draws(fact, [], [target], kwargs))
            log.append((func, args, kwargs, target, state, seen(target)))
            return target
        tensors: list[torch.Tensor] = []
        generators: list[Any] = []
        recorder._scan(args, tensors, generators)
        if kwargs:
            recorder._scan(tuple(kwargs.values()), tensors, generators)
        before = [seen(t) for t in tensors]
        draws = []
        if fact.random:
            with DRAWING:
                draws = self._begin_draws(fact, generators, tensors, kwargs)
        result, _ = runner.placed_call(func, args, kwargs)
        after = [t._version for t in tensors]
        if draws:
            with DRAWING:
                marked(self, draws)
        process = settings.now() if tensors else None
        log.append((func, args, kwargs, result, state, process, before, after))
        return result

    def registered(self: Any, original: Any, placed: Any, module: Any = None, name: Any = None):
        self.__dict__.setdefault("log", []).append((original, placed, module, name, seen(original)))

    recorder.Recorder.record = record  # type: ignore[method-assign]
    recorder.Recorder.registered = registered  # type: ignore[method-assign]
    recorder.Recorder.close = lambda self: None  # type: ignore[method-assign]


def _common_deferred() -> None:
    """Make this process's recorders defer the events a model build is made of: a call the
    context skips on meta, a factory call from no tensors, a registration (99% of a Llama
    build's recorded events). Each is appended to a list with what ``--call-time-only``
    reads for it (a registration also notes its tensor's id against the recorder, where a
    later lookup would find its program); every other call is recorded and analysed as now.
    Nothing deferred is analysed, so nothing can be materialized."""
    import torch

    from metamode._core.recording import recorder, thread_state
    from metamode._core.recording.streams import DRAWING, mark

    pending: dict[int, Any] = {}

    def seen(tensor: torch.Tensor) -> tuple:
        geometry = (tensor.shape, tensor.stride(), tensor.storage_offset())
        return tensor._version, tensor.untyped_storage()._cdata, geometry

    def made(self: Any, func: Any, fact: Any, args: tuple, kwargs: dict, runner: Any) -> Any:
        result, _ = runner.placed_call(func, args, kwargs)
        state = thread_state.current()
        log = self.__dict__.setdefault("log", [])
        log.append((func, args, kwargs, result, state, seen(result)))
        return result

    def skipped(self: Any, func: Any, fact: Any, args: tuple, kwargs: dict, target: Any) -> Any:
        log = self.__dict__.setdefault("log", [])
        state = thread_state.current()
        if fact.random:
            with DRAWING:
                for track, _ in self._begin_draws(fact, [], [target], kwargs):
                    if track is not None:
                        mark(track, self.program, len(log))
        log.append((func, args, kwargs, target, state, seen(target)))
        return target

    def registered(self: Any, original: Any, placed: Any, module: Any = None, name: Any = None):
        target = original if placed is None else placed
        pending[id(target)] = self
        log = self.__dict__.setdefault("log", [])
        log.append((original, placed, module, name, seen(original)))

    recorder.Recorder._made = made  # type: ignore[method-assign]
    recorder.Recorder._skipped = skipped  # type: ignore[method-assign]
    recorder.Recorder.registered = registered  # type: ignore[method-assign]
    recorder.Recorder.close = lambda self: None  # type: ignore[method-assign]


# recorders the replayable column can be reduced to (their builds cannot be materialized):
# name -> (what installs it, what the table's header line says, its option)
FLOORS = {
    "log-only": (
        _log_only,
        "a recorder that only appends each call to a list (--log-only)",
        "--log-only",
    ),
    "call-time": (
        _call_time_only,
        "a recorder that reads at call time only what a later analysis could not, and "
        "analyses nothing (--call-time-only)",
        "--call-time-only",
    ),
    "common-deferred": (
        _common_deferred,
        "a recorder that defers the skipped calls, tensorless factory calls and "
        "registrations, reading at call time what a later analysis could not, and analyses "
        "the other calls as they happen (--common-deferred)",
        "--common-deferred",
    ),
}


PARTS = {
    "markers": "the generator marker work of each draw (state read, marker seed)",
    "thread-state": "the dispatch-state read of each recorded call",
    "registrations": "the bookkeeping of each registered parameter and buffer",
}


def _knock_out(parts: Sequence[str]) -> None:
    """Make this process's recorders skip ``parts`` (names in :data:`PARTS`): the cost of
    each part is the difference it makes. The builds cannot be materialized."""
    from metamode._core.recording import recorder, streams, thread_state

    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown recorder parts {unknown}; known: {sorted(PARTS)}")
    if "markers" in parts:

        def before_draw(track: Any, _program: Any, last_call: Any, keywords: Any) -> Any:
            return streams._continue(track.stream, keywords)  # what a continued stream gets

        def mark(track: Any, _program: Any, call: int) -> None:
            track.marker = call

        recorder.before_draw = before_draw  # type: ignore[assignment]
        recorder.mark = mark  # type: ignore[assignment]
    if "thread-state" in parts:
        thread_state.current = lambda: None
    if "registrations" in parts:
        recorder.Recorder.registered = lambda self, *args, **kwargs: None  # type: ignore[method-assign]


def _child_command(
    model: str,
    include_buffers: bool,
    replayable: bool,
    tiny: bool,
    shim: str | None,
    floor: str | None = None,
    without: Sequence[str] = (),
) -> list[str]:
    arguments = (
        f"{model!r}, {include_buffers!r}, {replayable!r}, {tiny!r}, {shim!r}, {floor!r}, "
        f"{tuple(without)!r}"
    )
    call = f"b.measure({arguments})"
    code = f"import json, metamode.lab.bench_record as b; print({_RESULT!r} + json.dumps({call}))"
    return [sys.executable, "-c", code]


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


def _result(done: subprocess.CompletedProcess[str], what: str) -> dict[str, Any]:
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
    if done.returncode or not lines:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len(_RESULT) :])
    return result


@dataclass
class Cell:
    model: str
    include_buffers: bool
    plain: float
    replayable: float

    @property
    def ratio(self) -> float:
        return self.replayable / max(self.plain, 1e-12)


def _callgrind_run(
    model: str,
    include_buffers: bool,
    replayable: bool,
    tiny: bool,
    shim: str,
    keep: Path | None,
    floor: str | None = None,
    without: Sequence[str] = (),
) -> int:
    what = f"{model} {_MODES[include_buffers]} {'replayable' if replayable else 'plain'}"
    with tempfile.TemporaryDirectory(prefix="metamode-callgrind-") as scratch:
        out = Path(scratch) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}.%p",
            *_child_command(model, include_buffers, replayable, tiny, shim, floor, without),
        ]
        done = subprocess.run(command, capture_output=True, text=True, env=_child_env())
        result = _result(done, f"{what} under callgrind")
        if not result["on_valgrind"]:
            raise RuntimeError(f"{what}: the child did not run under valgrind")
        dumps = sorted(Path(scratch).glob("callgrind.out.*.*"))  # <pid>.<dump number>
        if len(dumps) != 1:
            raise RuntimeError(f"{what}: expected one callgrind dump, found {len(dumps)}")
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            name = f"callgrind.{model}.{'buffers' if include_buffers else 'params'}"
            shutil.copy(dumps[0], keep / f"{name}.{'replayable' if replayable else 'plain'}")
        return parse_callgrind_total(dumps[0].read_text())


def _wall_run(
    model: str,
    include_buffers: bool,
    replayable: bool,
    tiny: bool,
    floor: str | None = None,
    without: Sequence[str] = (),
) -> float:
    what = f"{model} {_MODES[include_buffers]} {'replayable' if replayable else 'plain'}"
    command = _child_command(model, include_buffers, replayable, tiny, None, floor, without)
    done = subprocess.run(command, capture_output=True, text=True, env=_child_env())
    return float(_result(done, what)["seconds"])


# -- the command ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from metamode.lab.workloads import MODELS

    parser = argparse.ArgumentParser(
        prog="python -m metamode bench-record",
        description=(
            "Instructions (callgrind) or wall time of a replayable build, "
            "empty_weights(replayable=True), against a plain empty_weights() build "
            "of the same model, each in a fresh process."
        ),
    )
    parser.add_argument(
        "--model",
        default="llama-small",
        choices=sorted(MODELS),
        help="the workload (default llama-small; llama-7b is the Llama-2-7B skeleton)",
    )
    parser.add_argument(
        "--include-buffers",
        choices=("false", "true", "both"),
        default="both",
        help="params-only (false), include_buffers=True (true) or both rows (default)",
    )
    parser.add_argument(
        "--mode",
        choices=("auto", "callgrind", "wall"),
        default="auto",
        help="callgrind: instructions; wall: seconds, best of --reps; "
        "auto (default): callgrind where valgrind and cc are installed, else wall",
    )
    parser.add_argument("--reps", type=int, default=5, help="wall mode: runs per cell, best kept")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (a smoke test)")
    floors = parser.add_mutually_exclusive_group()
    floors.add_argument(
        "--log-only",
        dest="floor",
        action="store_const",
        const="log-only",
        help="the replayable column's recorder only appends each call to a list: the floor "
        "of any recorder (its builds cannot be materialized)",
    )
    floors.add_argument(
        "--call-time-only",
        dest="floor",
        action="store_const",
        const="call-time",
        help="the replayable column's recorder does only what a recorder that analyses "
        "each call later must read when the call happens (versions, storages and geometry "
        "of its tensors, the thread's dispatch state, a skipped draw's marker) and "
        "analyses nothing: the floor of such a recorder (its builds cannot be materialized)",
    )
    floors.add_argument(
        "--common-deferred",
        dest="floor",
        action="store_const",
        const="common-deferred",
        help="the replayable column's recorder defers the events a model build is made of "
        "(calls skipped on meta, factory calls from no tensors, registrations) with what "
        "--call-time-only reads for them, and analyses the other calls as they happen (its "
        "builds cannot be materialized)",
    )
    parser.add_argument(
        "--without",
        type=_parts,
        default=(),
        metavar="PART[,PART]",
        help="the replayable column's recorder skips these parts of its work, to show what "
        f"each costs (its builds cannot be materialized): {', '.join(PARTS)}",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="callgrind mode: copy each cell's callgrind dump into DIR (for callgrind_annotate)",
    )
    return parser


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(
            f"expected parts of {', '.join(PARTS)} (comma-separated), got {text!r}"
        )
    return parts


def render(cells: Sequence[Cell], mode: str) -> str:
    """The table: model, mode, plain, replayable, ratio."""
    if mode == "callgrind":
        heads = ("plain Ir", "replayable Ir")

        def fmt(value: float) -> str:
            return f"{int(value):,}"
    else:
        heads = ("plain ms", "replayable ms")

        def fmt(value: float) -> str:
            return f"{value * 1e3:.2f}"

    rows = [
        (c.model, _MODES[c.include_buffers], fmt(c.plain), fmt(c.replayable), f"{c.ratio:.3f}x")
        for c in cells
    ]
    header = ("model", "mode", *heads, "ratio")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        left = [row[i].ljust(widths[i]) for i in range(2)]
        right = [row[i].rjust(widths[i]) for i in range(2, len(header))]
        lines.append("  ".join(left + right).rstrip())
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"argument --reps: must be at least 1, got {args.reps}")
    modes = {"false": [False], "true": [True], "both": [False, True]}[args.include_buffers]
    mode = args.mode
    fallback = None
    if mode in ("auto", "callgrind"):
        problems = callgrind_problems()
        if problems and mode == "callgrind":
            parser.exit(
                2,
                f"{parser.prog}: error: --mode callgrind: {'; '.join(problems)}: {_INSTALL_HINT}\n",
            )
        if problems:
            fallback = "; ".join(problems)
            mode = "wall"
        else:
            mode = "callgrind"
    shape = f"{args.model}{' (tiny)' if args.tiny else ''}"
    if args.floor and args.without:
        option = FLOORS[args.floor][2]
        parser.error(f"argument --without: not allowed with {option} (which has no such parts)")
    if args.floor:
        print(f"replayable: {FLOORS[args.floor][1]}")
    for part in args.without:
        print(f"replayable: without {PARTS[part]} (--without {part})")
    cells = []
    if mode == "callgrind":
        try:
            shim = str(shim_path())
        except CallgrindUnavailable as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        print(
            f"{shape}: instructions executed by the build (callgrind Ir, instrumentation "
            "on around the `with` block only; one fresh process per number)"
        )
        for include_buffers in modes:
            plain, replayable = (
                _callgrind_run(
                    args.model,
                    include_buffers,
                    r,
                    args.tiny,
                    shim,
                    args.keep,
                    args.floor,
                    args.without if r else (),
                )
                for r in (False, True)
            )
            cells.append(Cell(args.model, include_buffers, plain, replayable))
    else:
        if fallback:
            print(f"callgrind unavailable ({fallback}): WALL TIME, not instructions")
        print(
            f"{shape}: wall time of the build (seconds, not instructions; best of "
            f"{args.reps} fresh processes, plain and replayable interleaved)"
        )
        for include_buffers in modes:
            runs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.reps):
                for replayable in (False, True):
                    without = args.without if replayable else ()
                    runs[replayable].append(
                        _wall_run(
                            args.model,
                            include_buffers,
                            replayable,
                            args.tiny,
                            args.floor,
                            without,
                        )
                    )
            cells.append(Cell(args.model, include_buffers, min(runs[False]), min(runs[True])))
    print(render(cells, mode))
    return 0
