"""The recorded program: plain, typed data, printable and buildable by hand.

A program is what one replayable ``empty_weights`` context (and every replayable context
entered inside it) saw its thread do: the calls that created or wrote tensor storage, in
order, with every argument captured by value. Tensors are named by *storage* and view
(dtype, size, strides, offset), the way torch itself keeps them, so writes through views,
``.data`` and aliases need no special case: replay writes the same bytes of the same
storage. Random calls say which generator stream they draw from and how its state is
known (:class:`Draw`).
"""

from __future__ import annotations

import enum
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from metamode._torch import OpOverload, OpOverloadPacket

__all__ = [
    "Call",
    "Draw",
    "Fill",
    "Origin",
    "Outside",
    "Program",
    "ProgramState",
    "Start",
    "Storage",
    "Stream",
    "TensorRef",
]

_SERIALS = itertools.count()
_SEQUENCE = itertools.count()  # orders calls across programs (threads, chained builds)


@dataclass(slots=True, unsafe_hash=True)
class TensorRef:
    """A tensor argument or result: a view of storage ``storage`` of its program, with the
    conjugate and negative bits torch reads its values through (``x.conj()``, ``.imag``
    of one: views that compute nothing until read). A value: never changed once made
    (not frozen, which would cost every recorded tensor a slower constructor)."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    conj: bool = False
    neg: bool = False

    def __repr__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        layout = "" if self.offset == 0 and _contiguous(self) else f" {self.stride}+{self.offset}"
        bits = (" conj" if self.conj else "") + (" neg" if self.neg else "")
        return f"s{self.storage}:{dtype}{list(self.size)}{layout}{bits}"


def _contiguous(ref: TensorRef) -> bool:
    expected = 1
    for size, stride in zip(reversed(ref.size), reversed(ref.stride), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class Origin(enum.Enum):
    """Where a storage's first value comes from."""

    CREATED = "created by a recorded call"
    OUTSIDE = "a real tensor made outside the recording"
    UNKNOWN = "a meta tensor made outside the recording"


@dataclass(slots=True)
class Outside:
    """A real tensor made outside the recording that the build read: replay reads it at
    materialize time if its version counter and storage prove it unchanged, or, for memory
    torch does not own, the snapshot taken when the build first read it."""

    tensor: Callable[[], torch.Tensor | None]  # the tensor (held), or None once not needed
    version: int
    storage: int  # the storage's address, kept from reuse by the weak reference below
    keep: Any  # a StorageRef to that storage
    written: bool = False  # the build wrote it: its value at first use is gone
    snapshot: Any = None  # memory.Bytes: its value at first read (memory torch does not own)


class Storage:
    """One storage the build touched. The fields after ``outside`` keep their class
    defaults until the recorder learns otherwise (most storages never need them)."""

    # the build left different values in it than eager construction would (a real
    # storage drawn from a generator state eager would not have been in)
    off: bool = False
    refused: str | None = None  # why its value cannot be known
    # why its value cannot be known, whatever the build writes to it later (its memory
    # was handed out, or a registered twin cannot share it)
    pinned: str | None = None
    # made on meta because the build asked for meta itself (device="meta",
    # torch.device("meta")), not through a tensor the context put there: eager
    # construction may hold it on meta too, where a random call into it draws nothing
    asked_meta: bool = False

    def __init__(
        self,
        origin: Origin,
        device: str,
        nbytes: int,
        call: int | None = None,  # the creating call, for CREATED
        outside: Outside | None = None,
    ) -> None:
        self.origin = origin
        self.device = device
        self.nbytes = nbytes
        self.call = call
        self.outside = outside

    def __repr__(self) -> str:
        return f"Storage({self.origin.name}, {self.device}, {self.nbytes} bytes)"


class Start(enum.Enum):
    """How a draw's generator state is known."""

    CONTINUE = "continues the stream"  # after the previous draw of this stream
    ANCHOR = "an absolute state"  # ``Draw.state``: eager was in exactly this state
    AFTER = "after an earlier draw"  # ``Draw.after``: fork_rng, set_rng_state, a chain
    UNKNOWN = "unknowable"  # ``Draw.reason`` says why


@dataclass(frozen=True, slots=True)
class Stream:
    """A generator a program draws from: the default CPU generator, or a user's."""

    index: int
    default: bool
    device: str = "cpu"


@dataclass(slots=True)
class Draw:
    """One random call's use of one stream."""

    stream: int
    start: Start
    state: torch.Tensor | None = None  # ANCHOR
    after: tuple[Program, int, int] | None = None  # AFTER: (program, call index, stream)
    reason: str = ""  # UNKNOWN
    keywords: tuple[str, ...] = ("generator",)  # where replay passes it (none: it can't)


class Call:
    """One recorded call that created or wrote storage, or drew random numbers.

    ``args``/``kwargs`` hold captured values, with :class:`TensorRef` for tensors and
    ``GENERATOR`` where a draw's generator goes. ``writes`` are storages written in place
    (seen by version counters), ``creates`` storages born here, ``result`` the result's
    structure. ``target`` is the storage of a first argument the call overwrites without
    reading its values, ``covers`` that storage when the argument is all of it.
    ``refused`` says why the call cannot be replayed. The fields after ``result`` keep
    their class defaults unless the recorder sets them (most calls need none).
    """

    draws: tuple[Draw, ...] = ()
    target: int | None = None
    covers: int | None = None
    refused: str | None = None
    default_dtype: torch.dtype | None = None  # the result's dtype came from the default
    fills: Fill | None = None  # memory torch filled (deterministic algorithms, fill on)
    grows: bool = False  # it may grow its first argument's storage (resize_)
    # the process-wide settings it computed from tensor values under (a ProcessSettings)
    settings: Any = None
    state: Any = None  # the thread state it ran under (a ThreadState), None: torch's default
    # grad mode was off when it computed from tensor values (some CPU kernels choose their
    # implementation by it: LSTM's oneDNN one runs only without grad)
    no_grad: bool = False
    # the arguments that required grad then, for a call that wrote none (matmul folds its
    # batch dimensions only when its second argument does not)
    requires_grad: tuple[TensorRef, ...] = ()

    def __init__(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reads: tuple[int, ...],
        writes: tuple[int, ...],
        creates: tuple[int, ...],
        result: Any,
    ) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.reads = reads
        self.writes = writes
        self.creates = creates
        self.result = result
        self.seq = next(_SEQUENCE)  # orders calls across programs (threads, chained builds)

    def __repr__(self) -> str:
        name = getattr(func := self.func, "__qualname__", None) or repr(func)
        args = ", ".join([*map(repr, self.args), *(f"{k}={v!r}" for k, v in self.kwargs.items())])
        notes = []
        if self.writes:
            notes.append("writes " + ", ".join(f"s{s}" for s in self.writes))
        for draw in self.draws:
            notes.append(f"draws stream {draw.stream} ({draw.start.name.lower()})")
        if self.refused:
            notes.append(f"refused: {self.refused}")
        note = f"  # {'; '.join(notes)}" if notes else ""
        return f"{self.result!r} = {name}({args}){note}"


class Fill(enum.Enum):
    """Memory a call left uninitialised that torch filled (NaN, or an integer dtype's
    largest value) under ``torch.use_deterministic_algorithms(True)`` with
    ``torch.utils.deterministic.fill_uninitialized_memory`` on."""

    RESULT = "all of its result"  # torch.empty, empty_like, empty(out=)...
    ADDED = "what it added to its first argument's storage"  # resize_, resize_as_


class ProgramState(enum.Enum):
    RECORDING = "recording"
    CLOSED = "closed"
    ABANDONED = "abandoned"


@dataclass(eq=False, slots=True, weakref_slot=True)
class Program:
    """A recorded build. ``diverged`` says why none of it can be replayed, if so."""

    calls: list[Call] = field(default_factory=list)
    storages: list[Storage] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    state: ProgramState = ProgramState.RECORDING
    diverged: str | None = None
    abandoned: str | None = None
    owner: str = field(default_factory=lambda: threading.current_thread().name)
    serial: int = field(default_factory=lambda: next(_SERIALS))
    default_dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    # (call index, stream) -> the marker seed its draw left the generator in
    markers: dict[tuple[int, int], int] = field(default_factory=dict)
    # (call index, stream) -> eager's generator state after that draw, as a replay computed
    # it: a later plan starts there instead of replaying the draws before it
    states: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    finalizer: Any = None  # drops the program's markers when it is gone
    reference: Any = None  # a weak reference to the program, shared by its markers
    # after the recording: storage address -> (index, weak reference), for tensors that
    # share a recorded storage but were never handed to a mode (``copy.deepcopy``)
    live: dict[int, tuple[int, Any]] = field(default_factory=dict)
    # after the recording: address -> (index, version counters seen) of each real storage a
    # recorded call created that was alive then (a tensor of it the build left in a module
    # without registering it is the build's, never a loaded one)
    made: dict[int, tuple[int, frozenset[int]]] = field(default_factory=dict)
    # held by a materialize installing values of this program's storages, so two threads
    # materializing modules that share one see each other's installs
    installing: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        _PROGRAMS.add(self)

    def __repr__(self) -> str:
        return f"<metamode program {self.serial}: {len(self.calls)} calls, {self.state.value}>"

    def listing(self) -> str:
        """The program as text, one call per line."""
        return "\n".join(self._lines())

    def _lines(self) -> Iterator[str]:
        yield repr(self)
        for index, storage in enumerate(self.storages):
            if storage.origin is not Origin.CREATED:
                yield f"  s{index}: {storage.origin.value} ({storage.device})"
        for index, call in enumerate(self.calls):
            yield f"  {index:4d}  {call!r}"
        if self.diverged:
            yield f"  diverged: {self.diverged}"


_PROGRAMS: weakref.WeakSet[Program] = weakref.WeakSet()  # every program alive


def _after_fork_in_child() -> None:
    # a thread of the parent that held an install lock does not exist in the child
    for program in list(_PROGRAMS):
        program.installing._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_after_fork_in_child)


def function_name(func: Any) -> str:
    """``func`` as a message names it (``torch.nn.functional.dropout``,
    ``torch.ops.mylib.scale``)."""
    if isinstance(func, OpOverload | OpOverloadPacket):
        return f"torch.ops.{func}"
    return f"{getattr(func, '__module__', None) or 'torch'}.{getattr(func, '__qualname__', func)}"
