"""Recording a build: the torch calls a replayable ``empty_weights`` context's thread makes.

The recorder sees each top-level torch call once, in the thread's innermost replayable
context, and keeps only what replay needs: calls that create storage, write storage
(a tensor argument's version counter moved, or the context skipped a value-initialising
call on meta) or draw random numbers. Views, queries and calls that change nothing are
not kept: a view's geometry lives in the :class:`TensorRef` of every call that uses it.
Arguments are captured by value when the call is made (Python data copied, NumPy arrays
copied, devices mapped to the CPU replay computes on).
"""

from __future__ import annotations

import array
import functools
import inspect
import math
import sys
import weakref
from collections.abc import Callable
from types import FrameType, FunctionType
from typing import Any, Protocol

import torch
import torch.nn.utils.parametrize
import torch.utils.deterministic
from torch.overrides import TorchFunctionMode

from metamode._core.facts import (
    _FACTS,
    _QUERY_FACT,
    Fact,
    drawless,
    fact_of,
    fused_fast_path,
    meta_branch,
    meta_shortcut,
    reads_meta_only_to_warn,
    rebuilds_without_values,
    stand_in_for,
    stand_in_rule,
)
from metamode._core.recording import registry, settings, thread_state
from metamode._core.recording.branches import diverging_use
from metamode._core.recording.held import Held, Named
from metamode._core.recording.memory import ExternalMemory, Kept, refill
from metamode._core.recording.program import (
    Call,
    Draw,
    Fill,
    Origin,
    Outside,
    Program,
    ProgramState,
    Start,
    Storage,
    Stream,
    TensorRef,
    function_name,
)
from metamode._core.recording.streams import (
    DRAWING,
    Flight,
    GeneratorTrack,
    before_draw,
    drawn_from_marker,
    land,
    mark,
    take_off,
)
from metamode._core.skip_rule import POINTLESS_ON_META, dispatches_plainly
from metamode._core.stack import modes_innermost_first
from metamode._torch import (
    DeviceContext,
    DisableTorchFunction,
    StorageRef,
    UninitializedTensorMixin,
    current_device,
    functorch_base,
    is_functorch_wrapped,
    neg_view,
    pop_mode,
    push_mode,
)

__all__ = ["GENERATOR", "Recorder"]


class _Generator:
    """Where a draw's generator goes in a recorded call's arguments."""

    def __repr__(self) -> str:
        return "<generator>"


GENERATOR = _Generator()
_FOREIGN = object()  # noted while capturing: an argument whose memory a result may share
_CPU = torch.device("cpu")
_IMMUTABLE = frozenset(  # types captured as they are
    [
        int,
        float,
        bool,
        complex,
        str,
        bytes,
        type(None),
        type(...),
        range,
        torch.dtype,
        torch.layout,
        torch.memory_format,
        torch.Size,
    ]
)
_CAPTURED = _IMMUTABLE | {TensorRef}
_TENSOR_TYPES: dict[type, bool] = {torch.Tensor: True, torch.nn.Parameter: True}
_TO = torch.Tensor.to
_DEEPCOPY = torch.Tensor.__deepcopy__
_GENERATOR_KEYWORD: tuple[str, ...] = ("generator",)
# what a call returns when it hands tensor data to Python (item, tolist, __bool__...)
_VALUES = frozenset([int, float, bool, complex, list, str])


class CannotCapture(Exception):
    """An argument recording cannot keep by value."""


class Runner(Protocol):
    def placed_call(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, bool]:
        """Run ``func`` as the context does; True when it skipped the call instead."""
        ...

    def skips(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The tensor the context returns in place of running ``func``, or None."""
        ...


def _copying(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``Tensor.to``'s arguments with ``copy=True`` (positional after ``non_blocking``, or by
    keyword)."""
    flags = [i for i, arg in enumerate(args) if type(arg) is bool]
    if len(flags) == 2:
        return (*args[: flags[1]], True, *args[flags[1] + 1 :]), kwargs
    return args, {**kwargs, "copy": True}


def _is_tensor(kind: type) -> bool:
    known = _TENSOR_TYPES.get(kind)
    if known is None:
        known = _TENSOR_TYPES[kind] = issubclass(kind, torch.Tensor)
    return known


class Recorder:
    """Builds one :class:`Program`; owned by the outermost replayable context of a thread,
    shared by the replayable contexts entered inside it."""

    def __init__(self) -> None:
        # entries of registered tensors gone since the last build go now, and the programs
        # only they kept alive with them: a generator left in a marker state of a build
        # dropped before it was materialized is then known as such
        registry.sweep()
        self.program = Program()
        # storage address -> (storage index, weak reference keeping the address unique)
        self._storages: dict[int, tuple[int, StorageRef]] = {}
        # id(tensor) -> (a weak reference, or a Held meta tensor, its TensorRef, its version,
        # storage epoch then)
        self._tensors: dict[int, tuple[Callable[[], Any], TensorRef, int, int]] = {}
        # (storage, version) of each entry _tensors no longer has: a tensor gone, whose id a
        # later one took, or one seen anew; another tensor may share its version counter
        # (nn.Parameter(t) shares t's)
        self._retired: list[tuple[int, int]] = []
        self._epochs: list[int] = []  # per storage: recorded writes so far
        self._generators: dict[int, GeneratorTrack] = {}
        self._last_draw: dict[int, int] = {}  # stream -> index of its last draw
        # held until the context exits: a weak reference would stop swap_tensors
        self._registered: list[tuple[torch.Tensor, registry.Entry]] = []
        self._default_track: GeneratorTrack | None = None
        # the default generator as the recording found it (see _close)
        self._default_at_start = drawn_from_marker(torch.default_generator)
        # storage -> the storages registered views were cut apart from (or into)
        self._views: dict[int, set[int]] = {}
        self._memory = ExternalMemory()  # storages whose memory torch does not own
        self._real: set[int] = set()  # storages a recorded call created off meta
        self._off = False  # whether any storage is off (Storage.off) yet
        # storages a write needs more than counting for: outside ones, registered views
        self._special: set[int] = set()
        self._grown: dict[int, int] = {}  # storage -> its size, once a resize grew it
        # id -> what holds it, of each tensor registered under an empty twin
        self._twinned: dict[int, Callable[[], Any]] = {}
        # storage -> the registry entry of another build's tensor this one uses
        self._foreign: dict[int, registry.Entry] = {}
        # id -> the meta device a .device read of a tensor the context placed answered
        self._placed_devices: dict[int, torch.device] = {}
        # why every later draw has an unknown start, once code nobody recorded wrote meta
        self._unseen_meta_write: str | None = None
        # storage -> how its value left eager's, where not by a shifted stream
        self._off_why: dict[int, str] = {}

    # -- storages and tensors -----------------------------------------------------------
    def _new_storage(
        self,
        tensor: torch.Tensor,
        origin: Origin,
        call: int | None,
        storage: torch.UntypedStorage,
    ) -> int:
        storages = self.program.storages
        index = len(storages)
        outside = None
        if tensor.is_meta:
            device = "meta"
        else:
            device = "cpu" if tensor.is_cpu else tensor.device.type
            # memory torch did not allocate (NumPy's, a Python buffer's) cannot be resized
            snapshot = None if storage.resizable() else self._memory.watch(index, storage)
            if origin is Origin.OUTSIDE:
                # held (its value is read at materialize time), or copied where torch does
                # not own the memory and so cannot say whether it changed
                kept = Kept(tensor if snapshot is None else None)
                outside = Outside(kept, _version(tensor), storage._cdata, None, snapshot=snapshot)
            elif origin is Origin.CREATED:
                self._real.add(index)
        info = Storage(origin, device, storage.nbytes(), call, outside)
        storages.append(info)
        if tensor.is_inference():
            info.refused = "it is an inference tensor: it has no version counter to show its writes"
        elif origin is Origin.UNKNOWN and (found := registry.entry(tensor)) is not None:
            info.refused = (
                "it was computed from a tensor made in another replayable "
                "metamode.empty_weights context, of which this recording saw only the meta "
                "stand-in; materialize that one first, then build this one (materializing it "
                "afterwards cannot change what this recording saw)"
            )
            self._foreign[index] = found
            self._special.add(index)
        self._epochs.append(0)
        keep = StorageRef(storage)
        self._storages[storage._cdata] = (index, keep)
        if outside is not None:
            outside.keep = keep
            self._special.add(index)
        return index

    def _check_writes(self, tensors: list[torch.Tensor], versions: list[int]) -> None:
        """Record, as writes nobody saw, version moves of known tensors since their last use."""
        for tensor, version in zip(tensors, versions, strict=True):
            seen = self._tensors.get(id(tensor))
            if seen is not None and seen[2] != version:
                self.ref(tensor)

    def ref(
        self, tensor: torch.Tensor, creating_call: int | None = None, check: bool = True
    ) -> TensorRef:
        """``tensor``'s :class:`TensorRef`; a storage first seen here was created by
        ``creating_call`` (a result), or comes from outside the recording (an argument).
        With ``check``, a version move no recorded call explains is recorded as a write
        nobody saw."""
        key = id(tensor)
        seen = self._tensors.get(key)
        if seen is not None and ((held := seen[0]() is tensor) or _set_away(seen[0], tensor)):
            ref = seen[1]
            try:
                version = tensor._version
            except RuntimeError:  # an inference tensor
                version = -1
            if not held:  # Tensor.set_ gave this meta tensor other memory: a new view
                self._retire(key)
                moved = self.ref(tensor, creating_call)
                if check and version - seen[2] > 1:
                    self._unseen_write(moved)
                return moved
            if version != seen[2] and creating_call is None and check:
                if not self._in_place(tensor, ref):
                    # Tensor.set_ (which no mode sees) gave it other memory or geometry:
                    # a new view, written only if more than set_'s own version bump
                    self._retire(key)
                    moved = self.ref(tensor)
                    if version - seen[2] > 1:
                        self._unseen_write(moved)
                    return moved
                if version - seen[2] == 1 and _set_to_itself(tensor):
                    self._tensors[key] = (seen[0], ref, version, seen[3])
                    return ref
                epoch = self._epochs[ref.storage]
                if epoch == seen[3]:  # no recorded write since: someone else wrote it
                    self._unseen_write(ref)
                self._tensors[key] = (seen[0], ref, version, self._epochs[ref.storage])
            return ref
        if _storageless(tensor):
            return self._unstrided(tensor, creating_call)
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError:
            if not is_functorch_wrapped(tensor):
                raise
            # a transform's wrapper (torch.vmap, torch.func.grad): what it wraps
            return self.ref(functorch_base(tensor), creating_call, check)
        known = self._storages.get(storage._cdata)
        if known is not None and not known[1].expired():
            index = known[0]
        elif creating_call is not None:
            index = self._new_storage(tensor, Origin.CREATED, creating_call, storage)
        else:
            origin = Origin.UNKNOWN if tensor.is_meta else Origin.OUTSIDE
            index = self._new_storage(tensor, origin, None, storage)
        offset: int = tensor.storage_offset()  # type: ignore[assignment]  # never symbolic
        ref = TensorRef(
            index,
            tensor.dtype,
            tuple(tensor.shape),
            tensor.stride(),
            offset,
            tensor.is_conj(),
            tensor.is_neg(),
        )
        try:
            version = tensor._version
        except RuntimeError:
            version = -1
        if seen is not None:  # a tensor gone, whose id this one took
            self._retired.append((seen[1].storage, seen[2]))
        self._tensors[key] = (_hold(tensor, storage), ref, version, self._epochs[index])
        return ref

    def _unstrided(self, tensor: torch.Tensor, creating_call: int | None) -> TensorRef:
        """A tensor with no strided storage (sparse, MKL-DNN...) or none to read (a lazy
        module's uninitialised parameter): a storage of its own, whose value is refused."""
        index = len(self.program.storages)
        origin = Origin.CREATED if creating_call is not None else Origin.UNKNOWN
        if creating_call is None and not tensor.is_meta:
            origin = Origin.OUTSIDE
        storage = Storage(origin, "meta" if tensor.is_meta else tensor.device.type, 0)
        storage.call = creating_call
        lazy = isinstance(tensor, UninitializedTensorMixin)  # it has no shape yet
        if lazy:
            storage.pinned = (
                "it is a lazy module's uninitialised parameter or buffer, which has no value"
            )
        else:
            kind = (
                "a nested tensor"
                if tensor.is_nested
                else "a quantized tensor"
                if tensor.is_quantized
                else f"of layout {tensor.layout}"
            )
            storage.pinned = (
                f"it is {kind}: metamode records plain strided tensors only; register it "
                f"dense (.to_dense(), .dequantize(), .to_padded_tensor()) or make it after "
                f"materialize"
            )
        self.program.storages.append(storage)
        self._epochs.append(0)
        shape = () if lazy or tensor.is_nested else tuple(tensor.shape)
        ref = TensorRef(index, tensor.dtype, shape, (), 0)
        self._retire(id(tensor))
        self._tensors[id(tensor)] = (weakref.ref(tensor), ref, _version(tensor), 0)
        return ref

    def _in_place(self, tensor: torch.Tensor, ref: TensorRef) -> bool:
        """Whether ``tensor`` is still the view ``ref`` of the same storage."""
        if _storageless(tensor):
            return True  # no storage to be given another of
        known = self._storages.get(tensor.untyped_storage()._cdata)
        return (
            known is not None
            and known[0] == ref.storage
            and tensor.dtype == ref.dtype
            and tuple(tensor.shape) == ref.size
            and tensor.stride() == ref.stride
            and tensor.storage_offset() == ref.offset
            and (tensor.is_conj(), tensor.is_neg()) == (ref.conj, ref.neg)
        )

    def _unseen_write(self, ref: TensorRef) -> None:
        info = self.program.storages[ref.storage]
        if info.device == "meta" and self._unseen_meta_write is None:
            # eager's code there may have drawn (TorchScript's uniform_) where meta's drew
            # nothing, and nothing says when: draws recorded since the tensor was made are in
            # doubt, and every later one
            self._unseen_meta_write = _UNSEEN_META_WRITE
            made = -1 if info.call is None else info.call
            if any(last > made for last in self._last_draw.values()):
                self.diverge(_UNSEEN_META_WRITE)
        self._epochs[ref.storage] += 1
        if ref.storage in self._views:
            self._apart(ref.storage)
        call = Call(_unseen_write, (ref,), {}, (), (ref.storage,), (), None)
        call.refused = (
            "it was written by code metamode did not record (with torch functions "
            "disabled, or in a C++ extension)"
        )
        self.program.calls.append(call)

    # -- arguments ----------------------------------------------------------------------
    def _capture(self, value: Any, tensors: list, generators: list) -> Any:
        kind = type(value)
        if kind in _IMMUTABLE:
            return value
        if (known := _TENSOR_TYPES.get(kind)) or (known is None and _is_tensor(kind)):
            tensors.append(value)
            return self.ref(value, check=False)
        if kind is tuple:
            if _IMMUTABLE.issuperset(map(type, value)):
                return value
            return tuple([self._capture(v, tensors, generators) for v in value])
        if kind is list:
            return [self._capture(v, tensors, generators) for v in value]
        if kind is dict:
            captured = dict(value)
            if not _IMMUTABLE.issuperset(map(type, value.values())):
                for key, item in value.items():
                    if type(item) not in _IMMUTABLE:
                        captured[key] = self._capture(item, tensors, generators)
            return captured
        if kind is torch.device:
            return _CPU
        if kind is torch.Generator:
            generators.append(value)
            return GENERATOR
        if kind is slice:
            return slice(
                self._capture(value.start, tensors, generators),
                self._capture(value.stop, tensors, generators),
                self._capture(value.step, tensors, generators),
            )
        if kind.__module__ == "numpy":
            copy = getattr(value, "copy", None)
            if callable(copy) and hasattr(value, "shape"):
                return copy()
            return value
        if kind is bytearray:
            return bytearray(value)
        if kind is array.array:
            return array.array(value.typecode, value)
        if issubclass(kind, torch.UntypedStorage | torch.TypedStorage):
            raise CannotCapture(
                f"it was made from raw memory ({kind.__qualname__}: the bytes torch.load "
                f"and safetensors read from a file, for one), which metamode does not copy: "
                f"load files into the module after materialize"
            )
        if isinstance(value, int | float | complex | str | bytes):  # an IntEnum member
            return value
        if isinstance(value, tuple) and hasattr(kind, "_make"):  # a namedtuple
            if _IMMUTABLE.issuperset(map(type, value)):
                return value
            return kind._make([self._capture(v, tensors, generators) for v in value])
        raise CannotCapture(f"an argument of type {kind.__qualname__} metamode cannot copy")

    def _results(self, value: Any, creates: list, call: int) -> Any:
        kind = type(value)
        if (known := _TENSOR_TYPES.get(kind)) or (known is None and _is_tensor(kind)):
            before = len(self.program.storages)
            ref = self.ref(value, creating_call=call)
            if len(self.program.storages) > before:
                creates.append(ref.storage)
            return ref
        if isinstance(value, tuple | list) and value:
            items = [self._results(v, creates, call) for v in value]
            return type(value)(items) if type(value) in (tuple, list) else tuple(items)
        return value

    # -- calls --------------------------------------------------------------------------
    def record(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        runner: Runner,
        fact: Fact | None = None,
        flights: list[Flight] | None = None,
    ) -> Any:
        """Run ``func`` through ``runner`` and record it if it creates, writes or draws
        (``fact``, ``flights``: given for a call that draws, which lands them)."""
        if fact is None:
            fact = _FACTS.get(func) or fact_of(func)
        if fact.query:
            result = func(*args, **kwargs)
            if fact is _QUERY_FACT:  # reads metadata that is the same on meta
                return result
            if fact.derives_device:
                self._derived_device(args, kwargs, result)
                return result
            if fact.compares_types and len(args) == 2:
                return self._alike_in_eager(result, *args)
            if fact.device and result.type == "meta":
                self._placed_device(args[0], result)
            if fact.hands_out_memory and args and _is_tensor(type(args[0])):
                self._handed_out(func, args[0], fact)
            if fact.gradient and result is not None:
                self._gradient(result)
            if self.program.diverged is None and (
                (fact.is_meta and result is True)
                or (fact.device and result.type == "meta")
                or (fact.placement and not fact.is_meta and args[0].is_meta)
            ):
                self._meta_read(args[0], sys._getframe(1), fact, result)
            return result
        if fact.unstated:
            return self._unstated(func, args, kwargs)
        if type(func) is FunctionType:
            original = stand_in_for(func)
            if original is not None:
                return self._stand_in(func, original, args, kwargs, runner)
            target = runner.skips(func, args, kwargs)
        else:  # a C function: skipped only if in the skip rule's table
            target = runner.skips(func, args, kwargs) if func in POINTLESS_ON_META else None
        if target is not None:
            return self._skipped(func, fact, args, kwargs, target)
        if fact.draws_when is not None and not fact.draws_when(args, kwargs):
            fact = drawless(fact)  # dropout in eval mode or with p=0: eager draws nothing
        if fact.random and flights is None:
            flights = []
            try:
                return self.record(func, args, kwargs, runner, fact, flights)
            finally:
                if flights:  # it raised before landing
                    with DRAWING:
                        land(flights)
        tensors: list[torch.Tensor] = []
        generators: list[Any] = []
        _scan(args, tensors, generators)
        if kwargs:
            _scan(tuple(kwargs.values()), tensors, generators)
        if fact.factory and not fact.random and not tensors and not generators:
            return self._made(func, fact, args, kwargs, runner)
        if self._memory.active:
            self._reread(tensors)
        try:
            versions = [t._version for t in tensors]
        except RuntimeError:  # an inference tensor among them
            versions = [_version(t) for t in tensors]
            self._inference_arguments(tensors, fact, args)
        # torch resizes a call's out= tensor as it needs: its geometry may change too
        reshapes = fact.changes_geometry or "out" in kwargs
        before = [self.ref(t) for t in tensors] if reshapes or fact.random else None
        if before is None:
            self._check_writes(tensors, versions)
        draws: list[tuple[GeneratorTrack | None, Draw]] = []
        if flights is not None:
            with DRAWING:
                draws = self._begin_draws(fact, generators, tensors, kwargs)
                why = _custom_op_draw(fact) or self._asked_meta_draw(args, kwargs)
                draws = _unknowable(draws, why)
                take_off([track for track, _ in draws], flights)
        # a call that may change its arguments' geometry is replayed on them as they were
        early = self._captured(func, args, kwargs) if reshapes else None
        try:
            result, skipped = runner.placed_call(func, args, kwargs)
        except NotImplementedError as error:
            if any(t.is_meta for t in tensors):  # a meta kernel missing: eager runs on
                self.diverge(
                    f"{function_name(func)} raised NotImplementedError on meta "
                    f"({_first_line(error)}), where eager construction runs it: code that "
                    f"caught the error may have built otherwise"
                )
            raise
        moved_to_meta = (
            func is _TO and result is args[0] and self._moves_placed_to_meta(result, args, kwargs)
        )
        if moved_to_meta:
            args, kwargs = _copying(args, kwargs)
            result, skipped = runner.placed_call(func, args, kwargs)
        try:
            written = [t for t, v in zip(tensors, versions, strict=True) if t._version != v]
        except RuntimeError:
            written = [t for t, v in zip(tensors, versions, strict=True) if _version(t) != v]
        if skipped:
            written.append(tensors[0])
        if fact.unversioned is not None:  # writes no version counter shows
            written += fact.unversioned.tensors(args, kwargs)
        if reshapes:
            self._reshaped(tensors, before or [])
        ids = {id(t) for t in tensors}
        made = [t for t in _tensors_in(result) if id(t) not in ids]
        fresh = [t for t in made if self._storage_index(t) is None]
        if not written and not fresh and not fact.random:
            if tensors and type(result) in _VALUES:  # Python values read from tensor data
                self._value_read(func, [self.ref(t) for t in tensors])
            return result
        inputs = before if before is not None else [self.ref(t, check=False) for t in tensors]
        index = len(self.program.calls)
        captured_args, captured_kwargs, refused = early or self._captured(func, args, kwargs)
        creates: list[int] = []
        captured_result = self._results(result, creates, index)
        if creates and self._asks_meta(func, args, kwargs, inputs):
            for created in creates:
                self._made_asked_meta(created)
                if moved_to_meta:
                    info = self.program.storages[created]
                    info.pinned = info.pinned or _MOVED_TO_META
        if fact.factory:
            captured_kwargs = {**captured_kwargs, "device": _CPU}
            if kwargs.get("dtype") is None and isinstance(result, torch.Tensor):
                captured_kwargs["dtype"] = result.dtype
        elif func is _TO:
            captured_args = tuple(_CPU if type(a) is str else a for a in captured_args)
        written_ids = {id(t) for t in written}
        writes = {
            ref.storage for t, ref in zip(tensors, inputs, strict=True) if id(t) in written_ids
        }
        call = Call(
            func,
            captured_args,
            captured_kwargs,
            (inputs[0].storage,)
            if len(inputs) == 1
            else tuple(dict.fromkeys(ref.storage for ref in inputs)),
            tuple(sorted(writes)),
            tuple(creates),
            captured_result,
        )
        refused = (
            refused
            or _subclass_refusal(tensors)
            or _meta_dtype_refusal(args, kwargs, made)
            or _GRAPH_CALLS.get(func)
        )
        fused = _fused_fast_path_refusal()
        refused = refused or fused
        if refused is not None:
            call.refused = refused
        if made and not fact.factory:
            call.default_dtype = _default_dtype_use(func, args, kwargs, inputs, made)
        if fact.grows:
            call.grows = True
        if (fact.uninitialised or fact.grows) and _fills_uninitialised():
            call.fills = Fill.ADDED if fact.grows else Fill.RESULT
        if inputs:
            call.settings = settings.now()
            if not torch.is_grad_enabled():
                call.no_grad = True
            if not written:
                grads = tuple([r for t, r in zip(tensors, inputs, strict=True) if t.requires_grad])
                if grads:
                    call.requires_grad = grads
        if fact.overwrites and inputs:
            call.target = inputs[0].storage
            if _covers(inputs[0], self._nbytes(inputs[0].storage)):
                call.covers = call.target
        drew_real = not skipped and any(not t.is_meta for t in (*written, *made))
        if fused is not None and drew_real:  # computed for real, on another path than eager's
            self._not_eagers(call, f"computed on another kernel path than eager's ({fused})")
        if drew_real and _mixes_meta(tensors) and not any(t.is_meta for t in made):
            # torch answers a real result of real and meta inputs (F.linear of a CPU input and
            # a meta weight) with uninitialised memory: not eager's value, which replay
            # computes (a call that also made meta results, pack_padded_sequence's data, made
            # its real ones from its real inputs)
            self._not_eagers(call)
        if flights is not None:
            with DRAWING:
                land(flights, draws)
                self._append(call, tensors, draws, drew_real)
        else:
            self._append(call, tensors, draws, drew_real)
        if _FOREIGN in generators and func is not _COPIES:
            # made from an array or buffer whose memory eager's result may share: a real
            # result that shares it is watched (not resizable); a meta one cannot share it
            for tensor in _tensors_in(result):
                if _storageless(tensor):
                    continue  # refused by its layout
                storage = tensor.untyped_storage()
                index = self._storages[storage._cdata][0]
                if tensor.is_meta and index in creates:
                    self._memory.alias(index, storage, _foreign(args, kwargs))
        return result

    def _not_eagers(self, call: Call, why: str | None = None) -> None:
        """``call``'s real results are not eager's values (``why``: how, if not drawn from
        another stream state)."""
        storages = self.program.storages
        for storage in (*call.creates, *call.writes):
            if storages[storage].device != "meta":
                self._mark_off(storage, why)

    def _mark_off(self, storage: int, why: str | None) -> None:
        """``storage`` holds a value not eager's (``why``: how, if not by a shifted stream)."""
        self.program.storages[storage].off = self._off = True
        if why is not None:
            self._off_why[storage] = why

    def _reshaped(self, tensors: list[torch.Tensor], before: list[TensorRef]) -> None:
        """A call may have given ``tensors`` (seen as ``before``) other geometry: each gets a
        new view when next seen, a storage it grew keeps its new size, and a tensor
        registered under an empty twin is pinned if its own geometry changed (the module
        holds the twin, of the old geometry, where eager holds the tensor itself)."""
        storages = self.program.storages
        for tensor, old in zip(tensors, before, strict=True):
            self._tensors.pop(id(tensor), None)
            self._retired.append((old.storage, _version(tensor)))  # as the call left it
            if _storageless(tensor):
                continue
            storage = tensor.untyped_storage()
            known = self._storages.get(storage._cdata)
            if known is not None and known[0] == old.storage:
                grown = storage.nbytes()
                if grown > self._nbytes(old.storage):
                    self._grown[old.storage] = grown
            twinned = self._twinned.get(id(tensor))
            if twinned is not None and twinned() is tensor and not self._in_place(tensor, old):
                info = storages[old.storage]
                info.pinned = info.pinned or (
                    "its tensor was reshaped in place (t_, unsqueeze_, resize_, .data =) "
                    "after it was registered, where the module holds an empty twin "
                    "of its old shape; reshape the module's own tensor, or register the "
                    "reshaped one"
                )

    def _retire(self, key: int) -> None:
        """Forget the tensor ``key`` names, keeping the version it was seen with."""
        seen = self._tensors.pop(key, None)
        if seen is not None:
            self._retired.append((seen[1].storage, seen[2]))

    def _nbytes(self, storage: int) -> int:
        """Storage ``storage``'s size now (a resize may have grown it since it was made)."""
        grown = self._grown.get(storage)
        return self.program.storages[storage].nbytes if grown is None else grown

    def _captured(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, str | None]:
        """A call's arguments captured by value, or why they cannot be."""
        try:
            if func is _DEEPCOPY:  # its memo holds the objects copied so far: not replayed
                captured_args = (*self._capture(args[:1], [], []), {})
            else:
                captured_args = self._capture(args, [], [])
            return captured_args, self._capture(kwargs, [], []) if kwargs else {}, None
        except CannotCapture as error:
            return (), {}, str(error)

    def _unstated(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A tensor method whose effect on the values torch's schema does not state
        (``apply_``, ``map_``: they run a Python function over the memory and move no
        version counter). It runs on real memory; what it wrote cannot be replayed."""
        tensors: list[torch.Tensor] = []
        _scan(args, tensors, [])
        _scan(tuple(kwargs.values()), tensors, [])
        if not tensors:
            return func(*args, **kwargs)
        target = tensors[0]
        result = target if target.is_meta else func(*args, **kwargs)
        inputs = [self.ref(t) for t in tensors]
        reads = tuple(dict.fromkeys(ref.storage for ref in inputs))
        call = Call(func, (), {}, reads, (inputs[0].storage,), (), None)
        call.refused = (
            f"it was written by {function_name(func)}(), which torch binds without an operator "
            f"schema: what it does to the values (a Python function run over the "
            f"memory, for apply_ and map_) is neither versioned nor replayable; compute "
            f"the values with torch operations"
        )
        self._append(call, tensors, [], False)
        return result

    def _inference_arguments(self, tensors: list[torch.Tensor], fact: Fact, args: tuple) -> None:
        """A call is about to take inference tensors: under inference mode it may write
        them, and an inference tensor has no version counter to show that, so their values
        are unknown from here on (outside inference mode torch refuses to write them),
        unless torch's schemas say the call writes none of those it was given
        positionally."""
        if not torch.is_inference_mode_enabled():
            return
        unwritten = set() if fact.writes_positional else {id(a) for a in args}
        for tensor in tensors:
            if id(tensor) in unwritten:
                continue
            if tensor.is_inference() and tensor.layout is torch.strided:
                info = self.program.storages[self.ref(tensor).storage]
                info.pinned = info.pinned or _INFERENCE_ARGUMENT

    def _reread(self, tensors: list[torch.Tensor]) -> None:
        """Record, as writes of their bytes, changes to memory torch does not own that the
        build is about to read (a NumPy buffer refilled since it was last read)."""
        for index in self._memory.diverged(tensors):
            info = self.program.storages[index]
            info.pinned = info.pinned or (
                "eager construction makes it over the memory of a NumPy array or Python "
                "buffer (torch.asarray, torch.as_tensor), which changed before the build "
                "read it again; on meta it has memory of its own: pass a copy "
                "(np.array(x, copy=True)) or build it from torch calls"
            )
        for index, data in self._memory.changed(tensors):
            storage = self.program.storages[index]
            nbytes = storage.nbytes
            target = TensorRef(index, torch.uint8, (nbytes,), (1,), 0)
            call = Call(refill, (target, data), {}, (), (index,), (), None)
            call.target = call.covers = index
            if storage.off:
                call.refused = (
                    "its memory, which torch does not own (NumPy, a Python buffer), was "
                    "changed outside torch after the build computed it from random numbers "
                    "eager construction draws differently"
                )
            self._append(call, [], [], False)

    def _skipped(self, func: Any, fact: Fact, args: tuple, kwargs: dict, target: Any) -> Any:
        """A value-initialising call the context skipped on meta: it writes ``target``."""
        ref = self.ref(target)
        generators: list[Any] = []
        refused = None
        try:
            if not args:
                captured_args: tuple = ()
            elif args[0] is not target:
                captured_args = self._capture(args, [], generators)
            elif len(args) == 1 or _IMMUTABLE.issuperset(map(type, args[1:])):
                captured_args = (ref, *args[1:])
            else:
                captured_args = (ref, *self._capture(args[1:], [], generators))
            captured_kwargs = kwargs.copy()  # torch.nn.init passes all by keyword
            if kwargs.get("tensor") is target:
                captured_kwargs["tensor"] = ref
            if not _CAPTURED.issuperset(map(type, captured_kwargs.values())):
                for key, value in kwargs.items():
                    if value is target:
                        captured_kwargs[key] = ref
                    elif type(value) not in _IMMUTABLE:
                        captured_kwargs[key] = self._capture(value, [], generators)
        except CannotCapture as error:
            captured_args, captured_kwargs, refused = (), {}, str(error)
        storage = (ref.storage,)
        call = Call(func, captured_args, captured_kwargs, storage, storage, (), ref)
        if refused is not None:
            call.refused = refused
        if fact.overwrites:
            call.target = ref.storage
            if _covers(ref, self._nbytes(ref.storage)):
                call.covers = ref.storage
        if fact.random:
            with DRAWING:
                draws = self._begin_draws(fact, generators, [target], kwargs)
                info = self.program.storages[ref.storage]
                if (info.asked_meta or info.origin is Origin.UNKNOWN) and self._asked_tensor(
                    target, ref.storage
                ):
                    draws = _unknowable(draws, _ASKED_META_DRAW)
                self._append(call, [target], draws)
        else:
            self._append(call, [target], [])
        return target

    def _made(self, func: Any, fact: Fact, args: tuple, kwargs: dict, runner: Runner) -> Any:
        """A factory call from arguments that are no tensors (``torch.empty``...)."""
        result, _ = runner.placed_call(func, args, kwargs)
        if not _is_tensor(type(result)):
            return result
        captured_kwargs = kwargs.copy()
        captured_kwargs.pop("device", None)  # replay makes it on the CPU
        refused = None
        try:
            captured_args = self._capture(args, [], [])
            if not _IMMUTABLE.issuperset(map(type, captured_kwargs.values())):
                captured_kwargs = self._capture(captured_kwargs, [], [])
        except CannotCapture as error:
            captured_args, captured_kwargs, refused = (), {}, str(error)
        captured_kwargs["device"] = _CPU
        if kwargs.get("dtype") is None:
            captured_kwargs["dtype"] = result.dtype
        index = len(self.program.calls)
        if type(result) is torch.Tensor and not _storageless(result):
            ref = self._created(result, index)
        else:
            ref = self.ref(result, creating_call=index)
        device = kwargs.get("device")
        if device is None and current_device() is not None:
            device = _default_device()
        if device is not None and self._asked(device):
            self._made_asked_meta(ref.storage)
        if kwargs.get("device") == "meta":
            caller = _reader(sys._getframe(1))
            if caller is not None and rebuilds_without_values(caller.f_code):
                self.program.storages[ref.storage].pinned = (
                    "torch.load (or pickle) rebuilt it from a tensor the build pickled on "
                    "meta, which holds no values (eager construction's pickle holds them); "
                    "pickle the module after materialize"
                )
        call = Call(func, captured_args, captured_kwargs, (), (), (ref.storage,), ref)
        if refused is not None:
            call.refused = refused
        if fact.uninitialised and _fills_uninitialised():
            call.fills = Fill.RESULT
        self._append(call, [], [], False)
        return result

    def _created(self, tensor: torch.Tensor, call: int) -> TensorRef:
        """What :meth:`ref` gives a plain strided tensor a factory just made: memory of its
        own that torch allocated, at offset 0, with no conjugate or negative bit."""
        storage = tensor.untyped_storage()
        index = self._new_storage(tensor, Origin.CREATED, call, storage)
        ref = TensorRef(index, tensor.dtype, tuple(tensor.shape), tensor.stride(), 0)
        try:
            version = tensor._version
        except RuntimeError:
            version = -1
        key = id(tensor)
        gone = self._tensors.get(key)
        if gone is not None:
            self._retired.append((gone[1].storage, gone[2]))
        self._tensors[key] = (_hold(tensor, storage), ref, version, 0)
        return ref

    def _stand_in(self, func: Any, original: Any, args: tuple, kwargs: dict, runner: Runner) -> Any:
        """A library's stand-in for a ``torch.nn.init`` function (transformers' checks a
        flag on the tensor first). Where its library said what it does, record that;
        otherwise run it and record the torch calls it makes."""
        runs = stand_in_rule(func)
        if runs is not None:
            if runs(args, kwargs):
                target = runner.skips(original, args, kwargs)
                if target is not None:  # torch's function on meta: what record would do
                    fact = _FACTS.get(original) or fact_of(original)
                    return self._skipped(original, fact, args, kwargs, target)
                return self.record(original, args, kwargs, runner)
            return args[0] if args else kwargs.get("tensor")
        inside = _Inside(self, runner, func)
        push_mode(inside)
        try:
            return func(*args, **kwargs)
        finally:
            pop_mode()

    def _storage_index(self, tensor: torch.Tensor) -> int | None:
        """The index of the storage ``tensor`` lives in, if this recording has seen it."""
        seen = self._tensors.get(id(tensor))
        if seen is not None and seen[0]() is tensor:
            return seen[1].storage
        if _storageless(tensor):
            return None
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError:
            if not is_functorch_wrapped(tensor):
                raise
            return self._storage_index(functorch_base(tensor))
        known = self._storages.get(storage._cdata)
        return known[0] if known is not None and not known[1].expired() else None

    def _placed_device(self, tensor: torch.Tensor, device: torch.device) -> None:
        """``device`` is the answer of ``tensor.device``: held, so a ``device=`` that is
        this object is known to stand for where eager construction has ``tensor``."""
        index = self._storage_index(tensor)
        if index is None:
            placed = registry.entry(tensor) is not None  # another build's, or outside's
        else:
            placed = not self.program.storages[index].asked_meta
        if placed:
            self._placed_devices[id(device)] = device

    def _derived_device(self, args: tuple, kwargs: dict, result: Any) -> None:
        """``result`` (a device, or ``_parse_to``'s tuple whose first item is one) was made
        from the device or tensor that ``device=``, ``tensor=`` or ``args`` give first: a new
        object, which stands for the CPU where that one does."""
        device = result[0] if type(result) is tuple else result
        if type(device) is not torch.device or device.type != "meta":
            return
        source: Any = kwargs.get("device", kwargs.get("tensor", args[0] if args else None))
        if _is_tensor(type(source)):
            placed = source.is_meta and not self._asked_tensor(source)
        else:
            placed = type(source) is torch.device and id(source) in self._placed_devices
        if placed:
            self._placed_devices[id(device)] = device

    def _alike_in_eager(self, alike: bool, tensor: Any, other: Any) -> bool:
        """Eager construction's answer to ``_has_compatible_shallow_copy_type(tensor, other)``,
        torch's being ``alike``: a tensor the context placed on meta is a CPU tensor there, one
        the build asked for on meta a meta tensor. Where eager's is True for a placed tensor
        and a real one, which the build cannot follow (``set_data`` refuses meta and real
        tensors), the build is refused."""
        if not (_is_tensor(type(tensor)) and _is_tensor(type(other))):
            return alike
        if tensor.is_meta and other.is_meta:
            return alike and self._asked_tensor(tensor) == self._asked_tensor(other)
        if tensor.is_meta or other.is_meta:
            meta, real = (tensor, other) if tensor.is_meta else (other, tensor)
            if (
                not self._asked_tensor(meta)
                and real.is_cpu
                and real.layout is torch.strided
                and not torch.__future__.get_swap_module_params_on_conversion()
                and not torch.__future__.get_overwrite_module_params_on_conversion()
            ):  # else Module._apply swaps or replaces the parameter, eager's answer aside
                self.diverge(_PLACED_GIVEN_REAL_MEMORY)
        return alike

    def joined(self, device: torch.device) -> None:
        """A context putting factory calls on ``device`` joined the recording: a
        ``device=`` that is this object is where the context, not the build, put it."""
        self._placed_devices[id(device)] = device

    def _asked(self, device: Any) -> bool:
        """Whether ``device`` (a ``device=`` argument) is meta, and not the answer of a
        ``.device`` read of a tensor the context put on meta (eager's answer is the CPU)."""
        return _names_meta(device) and id(device) not in self._placed_devices

    def _asked_meta_draw(self, args: tuple, kwargs: dict) -> str | None:
        """Why eager construction may draw nothing in a random call (its result goes where
        the build asked for meta itself, where a meta kernel draws nothing), if so."""
        device = kwargs.get("device")
        if device is not None:
            return _ASKED_META_DRAW if self._asked(device) else None
        first = kwargs.get("out")
        if not _is_tensor(type(first)):
            values = (*args, *kwargs.values())
            first = next((a for a in values if _is_tensor(type(a))), None)
        if first is None:
            asked = self._asked(_default_device())
        else:
            asked = first.is_meta and self._asked_tensor(first)
        return _ASKED_META_DRAW if asked else None

    def _asked_tensor(self, tensor: torch.Tensor, index: int | None = None) -> bool:
        """Whether meta ``tensor`` (of storage ``index``, if known) is on meta where eager
        construction may have it on meta too: the build asked for it, or it was made on
        meta outside the recording (and not in another replayable build)."""
        if index is None:
            index = self._storage_index(tensor)
        if index is None:
            return registry.entry(tensor) is None
        info = self.program.storages[index]
        return info.asked_meta or (info.origin is Origin.UNKNOWN and registry.entry(tensor) is None)

    def _asks_meta(self, func: Any, args: tuple, kwargs: dict, inputs: list[TensorRef]) -> bool:
        """Whether a call's new result is on meta because the build asked for it: its
        ``device=`` (or ``Tensor.to``'s device or tensor) does, or, naming none, one of its
        tensor arguments is such a tensor."""
        device = kwargs.get("device")
        if device is not None:
            return self._asked(device)
        if not inputs and self._asked(_default_device()):
            return True
        storages = self.program.storages
        if func is _TO:
            asked = self._to_asks_meta(args, kwargs)
            if asked is not None:
                return asked
        return any(storages[ref.storage].asked_meta for ref in inputs)

    def _to_asks_meta(self, args: tuple, kwargs: dict) -> bool | None:
        """Whether ``Tensor.to``'s target, a tensor (positional or ``tensor=``) or a device
        given positionally, is meta the build asked for; None where none of them says."""
        for arg in (*args[1:], kwargs.get("tensor")):
            if _is_tensor(type(arg)):
                return arg.is_meta and self._asked_tensor(arg)
            if self._asked(arg):
                return True
        return None

    def _moves_placed_to_meta(self, tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
        """Whether ``tensor.to(...)`` returned ``tensor``, on meta because the context put it
        there, where the build asked for meta: eager's tensor is on the CPU, so its ``.to``
        is a copy to a new meta tensor, which a later draw into draws nothing."""
        if not tensor.is_meta or self._asked_tensor(tensor):
            return False
        device = kwargs.get("device")
        if device is not None:
            return self._asked(device)
        return bool(self._to_asks_meta(args, kwargs))

    def _made_asked_meta(self, storage: int) -> None:
        info = self.program.storages[storage]
        if info.device == "meta":
            info.asked_meta = True

    def _begin_draws(
        self,
        fact: Fact,
        generators: list[torch.Generator],
        tensors: list[torch.Tensor],
        kwargs: dict,
        keywords: tuple[str, ...] | None = None,
    ) -> list[tuple[GeneratorTrack | None, Draw]]:
        """Where eager's generator states are, before a random call runs (unknown once code
        nobody recorded wrote meta)."""
        if not generators and keywords is None and kwargs.get("device") is None:
            track = self._default_track
            if track is not None and (not tensors or tensors[0].is_meta or tensors[0].is_cpu):
                last = self._last_draw.get(track.stream)
                passed = _GENERATOR_KEYWORD if fact.generator else ()
                first: list[tuple[GeneratorTrack | None, Draw]] = [
                    (track, before_draw(track, self.program, last, passed))
                ]
                return _unknowable(first, self._unseen_meta_write)
        tracks = self._tracks(generators, tensors, kwargs)
        names = keywords or (("generator",) if fact.generator else ("",)) * len(tracks)
        grouped: dict[int, tuple[GeneratorTrack | None, str, list[str]]] = {}
        for (track, unknown), keyword in zip(tracks, names, strict=True):
            key = id(track) if track is not None else -len(grouped) - 1
            grouped.setdefault(key, (track, unknown, []))[2].append(keyword)
        draws: list[tuple[GeneratorTrack | None, Draw]] = []
        for track, unknown, found in grouped.values():
            kept = tuple(k for k in found if k)
            if track is None:
                draws.append((None, Draw(-1, Start.UNKNOWN, reason=unknown, keywords=kept)))
                continue
            draw = before_draw(track, self.program, self._last_draw.get(track.stream), kept)
            draws.append((track, draw))
        return _unknowable(draws, self._unseen_meta_write)

    def _append(
        self,
        call: Call,
        tensors: list[torch.Tensor],
        draws: list[tuple[GeneratorTrack | None, Draw]],
        drew_real: bool = False,
    ) -> None:
        program = self.program
        storages = program.storages
        epochs = self._epochs
        state = thread_state.current()
        if state is not None:  # autocast, inference mode...: replayed under it, or refused
            call.state = state
            call.refused = call.refused or state.refused
            if call.creates and state.autocast:
                call.refused = call.refused or thread_state.autocast_on_meta(
                    state, call.func, tensors
                )
        off = self._off and any(storages[read].off for read in call.reads)
        # how a value read off eager's left it, where not by a shifted stream
        why = None
        if off and self._off_why:
            why = next((self._off_why[r] for r in call.reads if r in self._off_why), None)
        if draws:
            index = len(program.calls)
            for track, draw in draws:
                if track is None:
                    continue
                if not drew_real or draw.start is not Start.ANCHOR:
                    # eager's generator is elsewhere now: say where, in the generator itself
                    mark(track, program, index)
                    off = off or drew_real
                else:  # drawn for real from eager's own state: no marker stands for it
                    track.marker = None
                self._last_draw[track.stream] = index
            call.draws = (draws[0][1],) if len(draws) == 1 else tuple([d for _, d in draws])
        special = self._special
        for storage in call.writes:
            epochs[storage] += 1
            if storage in special:
                self._written(storage)
            if off and storages[storage].device != "meta":
                self._mark_off(storage, why)
        if self._memory.active:
            for storage in call.writes:
                self._memory.written(storage)
        if off:
            for storage in call.creates:
                if storages[storage].device != "meta":
                    self._mark_off(storage, why)
        known = self._tensors
        for tensor in tensors:
            seen = known.get(id(tensor))
            if seen is not None:
                try:
                    version = tensor._version
                except RuntimeError:
                    version = -1
                known[id(tensor)] = (seen[0], seen[1], version, epochs[seen[1].storage])
        program.calls.append(call)

    def _written(self, storage: int) -> None:
        """A recorded call wrote ``storage``, which came from outside the recording or is
        one side of a registered view."""
        if storage in self._views:
            self._apart(storage)
        foreign = self._foreign.get(storage)
        if foreign is not None:  # its own build's recording no longer holds its value
            foreign.refused = foreign.refused or (
                "a later replayable build wrote it (it was registered or used there too, as "
                "a weight tied across builds), which its own build's recording does not "
                "hold; tie and write it in one build, or after materialize"
            )
        outside = self.program.storages[storage].outside
        if outside is not None:
            outside.written = True
            outside.tensor = _NOTHING  # its first value is no longer needed

    def _tracks(
        self, generators: list[torch.Generator], tensors: list[torch.Tensor], kwargs: dict
    ) -> list[tuple[GeneratorTrack | None, str]]:
        if not generators:
            device = kwargs.get("device")
            device = (
                torch.device(device)
                if device is not None
                else (tensors[0].device if tensors else _CPU)
            )
            if device.type not in ("cpu", "meta"):
                return [(None, f"it draws from the {device.type} default generator")]
            generators = [torch.default_generator]
        tracks: list[tuple[GeneratorTrack | None, str]] = []
        for generator in generators:
            if generator.device.type != "cpu":
                tracks.append((None, f"it draws from a {generator.device.type} generator"))
                continue
            track = self._generators.get(id(generator))
            if track is None:
                stream = Stream(len(self.program.streams), generator is torch.default_generator)
                self.program.streams.append(stream)
                track = self._generators[id(generator)] = GeneratorTrack(
                    generator, stream.index, at_start=drawn_from_marker(generator)
                )
                if generator is torch.default_generator:
                    self._default_track = track
            tracks.append((track, ""))
        return tracks

    # -- reads that steer the build -----------------------------------------------------
    def _meta_read(
        self, tensor: torch.Tensor, frame: FrameType | None, fact: Fact, value: Any
    ) -> None:
        """The build asked where ``tensor`` is (``fact``: ``.is_meta``, ``.is_cpu``,
        ``.device``) and heard ``value``, meta's answer: eager construction would hear the
        CPU's."""
        frame = _reader(frame)
        registered, why = meta_branch(frame) if frame is not None else (False, None)
        if why is not None:
            self.diverge(why)
            return
        if registered:  # a library's branch on meta that builds as eager does here
            return
        if frame is not None and fact.is_meta and reads_meta_only_to_warn(frame.f_code):
            return
        where = f"{frame.f_code.co_qualname}" if frame is not None else "code"
        if fact.device:
            # most often read to place a new tensor beside this one
            use = diverging_use(frame, value) if frame is not None else None
            if use is not None:
                self.diverge(
                    f"{where} read .device of a {_describe(tensor)} tensor, which eager "
                    f"construction has on the CPU, and {use}, so it may have taken another "
                    f"branch"
                )
            return
        shortcut = meta_shortcut(frame.f_code) if frame is not None and fact.is_meta else None
        if shortcut is None or frame is None:
            self.diverge(
                f"{where} read .{fact.name} of a {_describe(tensor)} tensor on meta, which "
                f"eager construction has on the CPU, so it may have taken another branch"
            )
            return
        values = inspect.getargvalues(frame).locals
        if values.get(shortcut.parameters[0]) is not tensor:
            self.diverge(f"{shortcut.function.__qualname__} read .is_meta of another tensor")
            return
        tensors: list[torch.Tensor] = []
        generators: list[torch.Generator] = []
        kwargs = {name: values[name] for name in shortcut.parameters[1:]}
        try:
            captured = self._capture(kwargs, tensors, generators)
        except CannotCapture as error:
            self.diverge(str(error))
            return
        ref = self.ref(tensor)
        keywords: tuple[str, ...] = ("generator",)
        if shortcut.replay is not shortcut.function:  # draws from the default one too
            captured["default_generator"] = None
            generators = [*(generators or [torch.default_generator]), torch.default_generator]
            keywords = ("generator", "default_generator")
        storage = (ref.storage,)
        call = Call(shortcut.replay, (ref,), captured, storage, storage, (), ref)
        call.target = ref.storage
        if _covers(ref, self._nbytes(ref.storage)):
            call.covers = ref.storage
        fact = Fact(shortcut.function.__name__, random=shortcut.random, generator=True)
        if fact.random:
            with DRAWING:
                draws = self._begin_draws(fact, generators, [tensor], {}, keywords)
                why = _ASKED_META_DRAW if self._asked_tensor(tensor, ref.storage) else None
                self._append(call, [tensor], _unknowable(draws, why))
        else:
            self._append(call, [tensor], [])

    def _handed_out(self, func: Any, tensor: torch.Tensor, fact: Fact) -> None:
        """``func`` gave ``tensor``'s memory to code that can write it unseen; on meta, told
        where it is (address 0 for every meta tensor, distinct in eager construction)."""
        if tensor.is_meta:
            if fact.addresses and self.program.diverged is None:
                frame = _reader(sys._getframe(2))
                where = f"{frame.f_code.co_qualname}" if frame is not None else "code"
                self.diverge(
                    f"{where} read the memory address of a {_describe(tensor)} tensor on "
                    f"meta through {function_name(func)}(): every meta tensor's is 0 where eager "
                    f"construction's differ, so comparing them (data_ptr() == data_ptr()) "
                    f"may take another branch"
                )
            return  # no memory to write
        ref = self.ref(tensor)
        if not fact.addresses:  # numpy(), __array__, __dlpack__ hand out the values too
            self._value_read(func, [ref])
        storage = self.program.storages[ref.storage]
        if storage.pinned is None:
            storage.pinned = (
                f"the build handed its memory out through {function_name(func)}()"
                f"{_called_by(sys._getframe(2))}, so writes to it through what that returned "
                f"would be invisible to the recording"
            )

    def _gradient(self, tensor: torch.Tensor) -> None:
        """``tensor`` is a ``.grad``: if no recorded call made it, autograd's engine did, in
        a backward pass of the build, and its value cannot be replayed."""
        if self._storage_index(tensor) is not None:
            return  # the build made it (grad = torch.zeros_like(p)) or saw it before
        info = self.program.storages[self.ref(tensor).storage]
        info.pinned = info.pinned or (
            "its value comes from a gradient autograd's engine computed in a backward pass "
            "of the build (read through .grad), which no torch call metamode records made; "
            "run backward passes after materialize"
        )

    def _value_read(self, func: Any, inputs: list[TensorRef]) -> None:
        storages = self.program.storages
        off = [ref.storage for ref in inputs if storages[ref.storage].off]
        if off and self.program.diverged is None:
            how = next((self._off_why[s] for s in off if s in self._off_why), None)
            self.diverge(
                f"{function_name(func)} read the values of a tensor the build "
                + (how or "computed from random numbers eager construction draws differently")
            )

    def diverge(self, why: str) -> None:
        """Nothing of this program can be replayed: the build left eager's path."""
        if self.program.diverged is None:
            self.program.diverged = why

    # -- registrations ------------------------------------------------------------------
    def registered(
        self,
        original: torch.Tensor,
        placed: torch.Tensor | None,
        module: Any = None,
        name: str | None = None,
    ) -> None:
        """``original`` was registered on ``module`` as ``name``; ``placed`` is the meta
        twin the context put there instead (None if it kept ``original``). A lazy
        module's uninitialised tensor has no value to record."""
        if isinstance(original, UninitializedTensorMixin):
            return
        with DisableTorchFunction():  # metamode's own reads are not the build's
            self._registered_now(original, placed, module, name)

    def _registered_now(
        self, original: torch.Tensor, placed: torch.Tensor | None, module: Any, name: str | None
    ) -> None:
        if placed is None:
            found = registry.entry(original)
            if found is not None and found.program is not self.program:
                # another build's tensor registered here too (a weight tied across builds):
                # it stands for that build's recording, which its writes here refuse
                self.ref(original)
                return
        if self._memory.active:
            self._reread([original])
        ref = self.ref(original)
        if ref.storage in self._views:  # the larger tensor a view was cut from, again
            self._apart(ref.storage)
        target = original
        named = None
        if placed is not None and original.layout is not torch.strided:
            target = placed
        elif placed is not None:
            target = placed
            geometry = (
                tuple(placed.shape),
                placed.stride(),
                placed.storage_offset(),
                placed.is_conj(),
                placed.is_neg(),
            )
            if (
                geometry == (ref.size, ref.stride, ref.offset, ref.conj, ref.neg)
                and placed.dtype == ref.dtype
            ):
                # eager construction keeps one tensor: the twin *is* the original
                storage = placed.untyped_storage()
                keep = StorageRef(storage)
                self._storages[storage._cdata] = (ref.storage, keep)
                self._retire(id(placed))
                self._tensors[id(placed)] = (
                    _hold(placed, storage),
                    ref,
                    _version(placed),
                    self._epochs[ref.storage],
                )
                named = Named(placed, storage, keep)
                self._twinned[id(original)] = _hold(original)
            else:
                # a view into part of a larger tensor: its twin has memory of its own, so
                # a later write through either, or another registration of the larger
                # one, would not reach the other as in eager
                twin = self._copy(original, placed).storage
                if placed.stride() != ref.stride:
                    self.program.storages[twin].pinned = (
                        f"it was registered with strides {ref.stride} (a stride-0 or "
                        f"strided view: nn.Parameter(t.expand(...)), t[:, ::2]), which its "
                        f"empty twin does not keep; register a tensor of its own "
                        f"(.contiguous() or .clone())"
                    )
                self._views.setdefault(ref.storage, set()).add(twin)
                self._views.setdefault(twin, set()).add(ref.storage)
                self._special.update((ref.storage, twin))
                if len(self._views[ref.storage]) > 1:  # a second view cut from it
                    self._apart(ref.storage)
        entry = registry.add(target, self.program, module, name, named)
        memory = self._memory
        if memory.active and (
            (placed is not None and memory.owns(ref.storage)) or memory.aliased(target)
        ):
            entry.refused = (
                "eager construction registers memory torch does not own (torch.from_numpy, "
                "torch.asarray or torch.as_tensor of a NumPy array or Python buffer), which "
                "its tensor keeps sharing with that array; on meta it has memory of its own: "
                "register a copy (.clone())"
            )
        self._registered.append((target, entry))

    def _apart(self, storage: int) -> None:
        """``storage`` was written or registered again: the registered views cut from it
        (or it from) can no longer equal eager's."""
        for other in (storage, *self._views.get(storage, ())):
            for each in (other, *self._views.get(other, ())):
                info = self.program.storages[each]
                info.pinned = info.pinned or (
                    "it was registered as a view into part of a larger tensor "
                    "(nn.Parameter(t[...])) and one of the two was written or registered "
                    "again afterwards: on meta the view has memory of its own, so eager's "
                    "sharing cannot be reproduced; register a tensor of its own "
                    "(t[...].clone())"
                )

    def _copy(self, original: torch.Tensor, placed: torch.Tensor) -> TensorRef:
        source = self.ref(original)
        index = len(self.program.calls)
        made = self.ref(placed, creating_call=index)
        geometry = (source, made.size, made.stride, made.conj, made.neg)
        call = Call(_copy_as, geometry, {}, (source.storage,), (), (made.storage,), made)
        self.program.calls.append(call)
        return made

    # -- the end ------------------------------------------------------------------------
    def close(self) -> None:
        """The owning context exited: hand the registered tensors to the registry."""
        with DisableTorchFunction():  # metamode's own reads are not the build's
            self._close()

    def _close(self) -> None:
        program = self.program
        found = {
            id(track.generator): (track.generator, track.at_start)
            for track in self._generators.values()
        }
        found[id(torch.default_generator)] = (torch.default_generator, self._default_at_start)
        if any(
            (now := drawn_from_marker(generator)) is not None and now != at_start
            for generator, at_start in found.values()
        ):
            self.diverge(
                "its generator was drawn from by code metamode did not record (another "
                "thread, or torch functions disabled) after the recording's last look at it, "
                "from a marker state a draw skipped on meta left it in (in this build or an "
                "earlier one), where eager construction's state differs: what that code made "
                "from it is not eager's, and the recording cannot tell which tensors those are"
            )
        for tensor, entry in self._registered:
            entry.ref = self.ref(tensor)
            entry.version = _version(tensor)
            entry.grad = tensor.grad_fn is None and tensor.grad is not None
        versions = _real_versions(self._real, self._tensors, self._retired)
        self._tensors = {}  # what it held: the storages only they kept alive go now
        self._retired = []
        self._registered = []
        program.live = {
            address: (index, keep)
            for address, (index, keep) in self._storages.items()
            if not keep.expired()
        }
        program.made = _made_here(program, self._real, versions)
        if program.state is ProgramState.RECORDING:
            program.state = ProgramState.CLOSED
        registry.closed(program)
        self._storages = {}
        self._generators = {}
        self._memory = ExternalMemory()

    def abandon(self, why: str) -> None:
        """Nothing recorded here can be materialized."""
        self.program.state = ProgramState.ABANDONED
        self.program.abandoned = why


class _Inside(TorchFunctionMode):
    """Pushed while a library's stand-in for a ``torch.nn.init`` function runs, so the
    torch calls it makes are recorded (torch's dispatch names the stand-in again when
    it reaches torch's own function: that is recorded as torch's own)."""

    def __init__(self, recorder: Recorder, runner: Runner, stand_in: Any) -> None:
        super().__init__()
        self.recorder, self.runner, self.stand_in = recorder, runner, stand_in

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is self.stand_in:
            func = stand_in_for(func)
        return self.recorder.record(func, args, kwargs or {}, self.runner)


def _scan(values: tuple | list, tensors: list, generators: list) -> None:
    """The tensors and generators among ``values`` (and in the tuples and lists there)."""
    for value in values:
        kind = type(value)
        if kind in _IMMUTABLE:
            continue
        if (known := _TENSOR_TYPES.get(kind)) or (known is None and _is_tensor(kind)):
            tensors.append(value)
        elif kind is tuple or kind is list:
            _scan(value, tensors, generators)
        elif kind is torch.Generator:
            generators.append(value)
        elif (kind.__module__ == "numpy" and _numpy_array(value)) or kind in _BUFFERS:
            generators.append(_FOREIGN)  # a result may share the array's memory
        elif kind is slice:
            _scan((value.start, value.stop, value.step), tensors, generators)


def _numpy_array(value: Any) -> bool:
    """Whether ``value``, a NumPy object, holds memory (an array; a scalar is a value)."""
    numpy = sys.modules.get("numpy")
    return hasattr(value, "shape") and not (numpy is not None and isinstance(value, numpy.generic))


_PARAMETRIZATION_LIST = torch.nn.utils.parametrize.ParametrizationList.__init__.__code__


_UNSEEN_META_WRITE = (
    "code metamode did not record (TorchScript, a C++ extension, torch functions disabled) "
    "wrote a tensor on meta, where eager construction's code may have drawn random numbers "
    "that meta's did not, and the recording cannot tell when: the draws from its making on "
    "are in doubt; make such code run after materialize"
)


def _mixes_meta(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` are on meta and off it both (``empty_like(w, device="cpu")`` reads
    only a meta tensor's metadata: its result is eager's)."""
    meta = [t.is_meta for t in tensors]
    return any(meta) and not all(meta)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _custom_op_draw(fact: Fact) -> str | None:
    if fact.custom is None:
        return None
    return (
        f"it is an operator registered outside torch (namespace {fact.custom!r}), whose "
        f"kernel torch does not say draws or not (its meta kernel draws nothing where eager's "
        f"may): it and every later draw from that generator are refused; call it after "
        f"materialize"
    )


_PLACED_GIVEN_REAL_MEMORY = (
    "Module._apply made a real CPU tensor for a parameter the context had put on meta "
    "(to_empty(device='cpu'), or a function of its own): eager construction keeps the "
    "parameter object and gives it that memory, which a meta parameter cannot take, so the "
    "build went another way; do it after materialize"
)
_MOVED_TO_META = (
    "Tensor.to moved a tensor the context had put on meta to meta the build asked for itself: "
    "eager construction holds a new meta tensor here, which has no values to give (or, had the "
    "device been read off a tensor the context placed, the CPU tensor itself); move it after "
    "materialize, or build it on a real device"
)
_ASKED_META_DRAW = (
    "it draws into a tensor on meta that the build asked for itself (device='meta', "
    "torch.device('meta'), or made outside the recording), where eager construction may draw "
    "nothing; build it on a real device"
)


def _default_device() -> Any:
    """The device of a ``DeviceContext`` on this thread's mode stack
    (``torch.set_default_device``, or one entered directly): it sits below every mode, so
    a factory reaches the recorder without it."""
    if current_device() is None:  # no DeviceContext entered in any thread
        return None
    for mode in modes_innermost_first():
        if isinstance(mode, DeviceContext):
            return mode.device
    return None


def _names_meta(device: Any) -> bool:
    """Whether ``device`` (a ``device=`` argument) is the meta device."""
    if type(device) is str:
        return device == "meta" or device.startswith("meta:")
    return type(device) is torch.device and device.type == "meta"


def _unknowable(
    draws: list[tuple[GeneratorTrack | None, Draw]], why: str | None
) -> list[tuple[GeneratorTrack | None, Draw]]:
    """``draws``, each with an unknown start when ``why`` says eager may not draw."""
    if why is None:
        return draws
    return [
        (track, Draw(draw.stream, Start.UNKNOWN, reason=why, keywords=draw.keywords))
        for track, draw in draws
    ]


def _set_to_itself(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the original parameter torch's ``ParametrizationList`` is
    registering: it ran ``original.set_(new)`` before, which moves the version counter by
    one and writes nothing when the right inverse gave ``original`` back (none defined)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _PARAMETRIZATION_LIST:
            return frame.f_locals.get("original") is tensor
        frame = frame.f_back
    return False


def _real_versions(
    real: set[int],
    tensors: dict[int, tuple[Callable[[], Any], TensorRef, int, int]],
    retired: list[tuple[int, int]],
) -> dict[int, set[int]]:
    """Storage index -> the version counters seen on the recording's tensors of each of
    the ``real`` storages (those a recorded call created off meta), those gone included."""
    versions: dict[int, set[int]] = {}
    for storage, version in [*((e[1].storage, e[2]) for e in tensors.values()), *retired]:
        if storage in real:
            versions.setdefault(storage, set()).add(version)
    return versions


def _made_here(
    program: Program, real: set[int], versions: dict[int, set[int]]
) -> dict[int, tuple[int, frozenset[int]]]:
    """The ``real`` storages (a recorded call created them off meta) still alive: address
    -> (index, the version counters seen on their tensors, from :func:`_real_versions`), so
    a real tensor a module holds without a registration (``module._buffers[k] = t``) is
    known as the build's."""
    return {
        address: (index, frozenset(versions.get(index, ())))
        for address, (index, _) in program.live.items()
        if index in real
    }


_INFERENCE_ARGUMENT = (
    "it is, or was computed from, an inference tensor that a torch call under "
    "torch.inference_mode() took as an argument: an inference tensor has no version "
    "counter, so whether that call wrote it cannot be known; compute it under "
    "torch.no_grad() instead (the same values), or make it with one call from "
    "non-inference tensors under inference mode"
)
_BUFFERS = frozenset([array.array, bytearray, memoryview])
_COPIES = torch.tensor  # "torch.tensor() always copies data" (torch's documentation)


def _foreign(args: tuple, kwargs: dict) -> list[Any]:
    """The NumPy arrays and Python buffers among a call's arguments."""
    found: list[Any] = []
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind is tuple or kind is list:
            found += _foreign(tuple(value), {})
        elif kind in _BUFFERS or (kind.__module__ == "numpy" and hasattr(value, "shape")):
            found.append(value)
    return found


def _NOTHING() -> None:
    """What an outside tensor no longer needed is held as."""
    return None


def _hold(tensor: torch.Tensor, storage: torch.UntypedStorage | None = None) -> Callable[[], Any]:
    """What names ``tensor`` (of ``storage``, if the caller has it) in the recording: a meta
    tensor is held (no memory, and no weak reference for swap_tensors to refuse), a real
    one weakly. (Called inside the mode's handler or under DisableTorchFunction: these reads
    are metamode's own.)"""
    if tensor.is_meta and tensor.layout is torch.strided:
        return Held(tensor, storage)
    return weakref.ref(tensor)


def _set_away(holder: Callable[[], Any], tensor: torch.Tensor) -> bool:
    """Whether ``holder`` holds ``tensor`` (a meta tensor, :class:`Held`) with the
    implementation it had, given other memory since by ``Tensor.set_``, which no mode sees
    (the holder answers None then)."""
    return type(holder) is Held and holder.tensor is tensor and tensor._cdata == holder.impl


def _unseen_write(tensor: torch.Tensor) -> None:
    """Stands for a write the recording did not see (never replayed: it is refused)."""
    raise RuntimeError("an unseen write cannot be replayed")


def _copy_as(
    source: torch.Tensor, size: tuple, stride: tuple, conj: bool = False, neg: bool = False
) -> torch.Tensor:
    """A copy of ``source`` with the given geometry and conjugate and negative bits (a
    registered tensor's moved twin)."""
    copy = torch.empty_strided(size, stride, dtype=source.dtype)
    if neg:
        copy = neg_view(copy)
    return (copy.conj() if conj else copy).copy_(source)


def _meta_dtype_refusal(args: tuple, kwargs: dict, made: list[torch.Tensor]) -> str | None:
    """Why a call asked for a dtype that its new meta result does not have (torch's meta
    kernel of ``quantize_per_tensor`` gives float32 where its CPU kernel gives qint8)."""
    if not made or not made[0].is_meta:
        return None
    asked = kwargs.get("dtype")
    if type(asked) is not torch.dtype:
        asked = next((a for a in args if type(a) is torch.dtype), None)
    if asked is None or made[0].dtype == asked:
        return None
    return (
        f"it was asked for {asked} and made {made[0].dtype} on meta: torch's meta kernel "
        f"differs from its CPU kernel, so the build's tensor is not eager's; make it after "
        f"materialize"
    )


def _fills_uninitialised() -> bool:
    """Whether torch fills the uninitialised memory its factories return now."""
    return torch.are_deterministic_algorithms_enabled() and bool(
        torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    )


def _storageless(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has no plain strided storage to read (sparse, MKL-DNN...; nested
    and quantized tensors, whose storage needs more than a view to read; a lazy module's
    uninitialised parameter refuses the read)."""
    return (
        tensor.layout is not torch.strided
        or tensor.is_nested
        or tensor.is_quantized
        or isinstance(tensor, UninitializedTensorMixin)
    )


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor: no version counter
        return -1


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _covers(ref: TensorRef, nbytes: int) -> bool:
    """Whether ``ref`` is every byte of its storage (of ``nbytes`` now), each once."""
    size = ref.size
    if ref.offset or math.prod(size) * ref.dtype.itemsize != nbytes:
        return False
    if ref.stride == _contiguous_strides(size):
        return True
    expected = 1
    for extent, stride in sorted(zip(size, ref.stride, strict=True), key=lambda d: d[1]):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    expected = 1
    for extent in reversed(size):
        strides.append(expected)
        expected *= max(extent, 1)
    return tuple(reversed(strides))


def _fused_fast_path_refusal() -> str | None:
    forward = fused_fast_path(sys._getframe())
    if forward is None:
        return None
    return (
        f"it was computed in {forward}, which eager construction runs as torch's fused "
        f"kernel but a torch function mode, the recording's among them, turns to its slow "
        f"path (torch.overrides.has_torch_function), whose last bits differ; run the "
        f"forward after materialize"
    )


# calls whose result comes from the build's autograd graph, which replay (from the recorded
# calls alone) does not build
_GRAPH_CALLS = {
    func: (
        f"it was computed by {function_name(func)}, from the autograd graph of the build, "
        f"which replay does not build; compute it after materialize"
    )
    for func in (
        torch.autograd.grad,
        torch.autograd.functional.jacobian,
        torch.autograd.functional.vjp,
    )
}


def _subclass_refusal(tensors: list[torch.Tensor]) -> str | None:
    for tensor in tensors:
        if not dispatches_plainly(type(tensor)):
            return f"a {type(tensor).__qualname__} argument has its own __torch_function__"
    return None


_TYPE = torch.Tensor.type  # with an argument: the type it names (a dtype, a string)
# Tensor methods whose result has one dtype whatever the default (``.float()``...)
_FIXED_DTYPE_METHODS = frozenset(
    getattr(torch.Tensor, name)
    for name in ("float", "double", "half", "bfloat16", "cfloat", "cdouble", "chalf")
)


def _default_dtype_use(
    func: Any, args: tuple, kwargs: dict, inputs: list[TensorRef], made: list[torch.Tensor]
) -> torch.dtype | None:
    """The default dtype, if it may have decided the dtype of ``made``, a call's new
    results (an integer input promoted, to the default or, by a complex scalar, to its
    complex counterpart); None where the call names the dtype (``dtype=``, a dtype
    argument as in ``.to(torch.float32)``, ``.type("torch.FloatTensor")``, or a method
    such as ``.float()``)."""
    if kwargs.get("dtype") is not None or func in _FIXED_DTYPE_METHODS:
        return None
    if any(type(arg) is torch.dtype for arg in args) or (func is _TYPE and len(args) > 1):
        return None
    default = torch.get_default_dtype()
    if any(ref.dtype.is_floating_point or ref.dtype.is_complex for ref in inputs):
        return None
    counterpart = _complex_counterpart(default)
    return default if any(t.dtype in (default, counterpart) for t in made) else None


@functools.cache
def _complex_counterpart(dtype: torch.dtype) -> torch.dtype:
    """What an integer tensor times a complex scalar gives under default dtype ``dtype``."""
    return (
        torch.promote_types(dtype, torch.complex64) if dtype != torch.float16 else torch.complex32
    )


def _reader(frame: FrameType | None) -> FrameType | None:
    """The frame of the build's code that made a read (past modes and metamode's own)."""
    while frame is not None and (frame.f_code.co_name == "__torch_function__" or _is_ours(frame)):
        frame = frame.f_back
    return frame


def _called_by(frame: FrameType | None) -> str:
    """Who made a call, for a message: the build's code, through torch's own functions
    (``Tensor.__reduce_ex__`` when pickle or torch.save took a tensor's storage)."""
    frame = _reader(frame)
    through = None
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("torch."):
        through, frame = frame, frame.f_back
    named = f"{frame.f_code.co_qualname}()" if frame is not None else "code"
    if through is None:
        return f", called by {named}"
    return f", called by torch's {through.f_code.co_qualname}() from {named}"


def _is_ours(frame: FrameType) -> bool:
    """Whether ``frame`` runs metamode's own code (a mode between the build and the read)."""
    return str(frame.f_globals.get("__name__", "")).startswith("metamode.")


def _describe(tensor: torch.Tensor) -> str:
    if isinstance(tensor, UninitializedTensorMixin):
        return "lazy module's uninitialised"
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
