"""Recording an empty-weights context's torch calls, so :func:`metamode.materialize` can
replay them. How replay comes out bitwise: docs/design.md, "materialize".
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from metamode._core.skip_rule import RANDOM_INIT_FUNCTIONS
from metamode._torch import device_constructors

__all__ = ["Trace", "registry_entry"]

_TENSOR = torch.Tensor
_SERIALS = itertools.count()
_LAST = threading.local()
_META = torch.device("meta")

# Random calls that take ``generator=``: replay injects its private generator.
_RANDOM_FUNCS = frozenset(
    [
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.normal,
        torch.bernoulli,
        torch.multinomial,
        torch.poisson,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        _TENSOR.uniform_,
        _TENSOR.normal_,
        _TENSOR.random_,
        _TENSOR.bernoulli_,
        _TENSOR.exponential_,
        _TENSOR.geometric_,
        _TENSOR.log_normal_,
        _TENSOR.cauchy_,
        _TENSOR.bernoulli,
        _TENSOR.multinomial,
    ]
)
_RANDOM_INIT_NAMES = frozenset(RANDOM_INIT_FUNCTIONS)
# Random calls that cannot take a generator: everything drawn after them is refused.
_UNSEEDABLE = frozenset(
    [
        torch.nn.functional.dropout,
        torch.nn.functional.alpha_dropout,
        torch.nn.functional.feature_alpha_dropout,
        torch.nn.functional.dropout1d,
        torch.nn.functional.dropout2d,
        torch.nn.functional.dropout3d,
        torch.nn.functional.rrelu,
        torch.nn.functional.gumbel_softmax,
        torch.dropout,
        torch.rrelu,
    ]
)
# Calls that wrap foreign memory: not replayable.
_FOREIGN = frozenset(
    f for f in (torch.from_numpy, torch.frombuffer, getattr(torch, "from_dlpack", None)) if f
)
_OVERWRITING = _RANDOM_INIT_NAMES | {
    "random_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
}
_MUTATING_DUNDERS = frozenset(["__setitem__", "__set__", "__delitem__"])
_IS_META = torch.Tensor.is_meta
# Calls that only read metadata: never recorded.
_QUERIES = frozenset(
    [
        "size",
        "dim",
        "numel",
        "stride",
        "storage_offset",
        "is_contiguous",
        "element_size",
        "nelement",
        "ndimension",
        "data_ptr",
        "get_device",
        "is_floating_point",
        "is_complex",
        "__len__",
        "__format__",
        "__repr__",
        "__hash__",
        "__bool__",
        "item",
        "tolist",
        "untyped_storage",
    ]
)
_PLAIN_GETTERS = frozenset(
    [
        "shape",
        "dtype",
        "device",
        "is_meta",
        "is_cuda",
        "is_cpu",
        "is_sparse",
        "is_quantized",
        "layout",
        "ndim",
        "requires_grad",
        "is_leaf",
        "names",
        "itemsize",
        "nbytes",
        "grad_fn",
        "_version",
    ]
)


def _sparse_(tensor, sparsity, std=0.01, generator=None, default_generator=None):
    """``torch.nn.init.sparse_``, with the generator its ``randperm`` takes from
    the default one made explicit (the recorded build drew it from there)."""
    rows, cols = tensor.shape
    num_zeros = math.ceil(sparsity * rows)
    with torch.no_grad():
        tensor.normal_(0, std, generator=generator)
        for col_idx in range(cols):
            row_indices = torch.randperm(rows, generator=default_generator)
            tensor[row_indices[:num_zeros], col_idx] = 0
    return tensor


def _init_on_meta_table() -> dict:
    # torch.nn.init functions that do not dispatch to modes and return at once
    # for a meta tensor: the only call a mode sees is their ``tensor.is_meta``.
    # code object -> (function to replay, its argument names, random?)
    init = torch.nn.init
    table = {}
    for holder, replay, names, random in (
        ("_no_grad_trunc_normal_", init.trunc_normal_, ("mean", "std", "a", "b"), True),
        ("dirac_", init.dirac_, ("groups",), False),
        ("orthogonal_", init.orthogonal_, ("gain",), True),
        ("sparse_", _sparse_, ("sparsity", "std"), True),
    ):
        code = getattr(getattr(init, holder, None), "__code__", None)
        if code is not None:
            table[code] = (replay, names, random)
    return table


_INIT_ON_META = _init_on_meta_table()


def _is_random(func: Any) -> bool:
    if func in _RANDOM_FUNCS:
        return True
    name = getattr(func, "__name__", None)
    return (
        name in _RANDOM_INIT_NAMES
        and getattr(func, "__module__", "") in ("torch.nn.init", "transformers.initialization")
    ) or (name in _RANDOM_INIT_NAMES and vars(torch.nn.init).get(name) is func)


_FACTORIES = frozenset(device_constructors())
_SCALARS = frozenset([int, float, bool, str, type(None), torch.dtype, torch.Size])
_TENSOR_TYPES: dict[type, bool] = {torch.Tensor: True, torch.nn.Parameter: True}


def _is_tensor_type(kind: type) -> bool:
    known = _TENSOR_TYPES.get(kind)
    if known is None:
        known = _TENSOR_TYPES[kind] = issubclass(kind, torch.Tensor)
    return known


class _IdMap:
    """tensor -> value, by identity, holding only plain weak references.

    A stale entry (its tensor died and the id was reused) fails the ``ref() is tensor``
    check. Why not ``WeakIdKeyDictionary``: docs/design.md, "Hot paths".
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, tensor: torch.Tensor) -> Any:
        entry = self._entries.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        return None

    def __setitem__(self, tensor: torch.Tensor, value: Any) -> None:
        self._entries[id(tensor)] = (weakref.ref(tensor), value)


class _Ref:
    """A tensor argument or result, by value id."""

    __slots__ = ("vid",)

    def __init__(self, vid: int) -> None:
        self.vid = vid


class _MetaDevice:
    """``device='meta'`` in a recorded call: replayed as the replay device."""


class _Gen:
    """A ``generator=`` the build passed itself: replayed from its state at first use."""

    __slots__ = ("key",)

    def __init__(self, key: int) -> None:
        self.key = key


class Op:
    __slots__ = (
        "args",
        "func",
        "ins",
        "kwargs",
        "mutated",
        "out_spec",
        "outs",
        "random",
        "scratch",
    )

    def __init__(self, func, args, kwargs, ins, out_spec, outs, mutated, random):
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.ins = ins  # value ids read
        self.out_spec = out_spec  # result with tensors as _Ref
        self.outs = outs  # value ids written (results + mutated argument)
        self.mutated = mutated  # value id written in place, or None
        self.random = random
        # (shape, dtype) when the call overwrites its one tensor argument with
        # random numbers: replayable into a scratch tensor just for its draws.
        self.scratch: tuple | None = None


class Trace:
    """The recorded build of one empty-weights context.

    Each top-level torch call of the owner thread, with its non-tensor arguments and every
    tensor replaced by a value id; the default CPU generator's state at entry; parameters
    tied by storage to the value they were made from. Holds no tensor (the tensor -> id map
    is weak and dropped at exit). Tensors it cannot explain, what is computed from them and
    everything after a random call without ``generator=`` get a tainted id.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ops: list[Op] = []
        self.entry_state = torch.default_generator.get_state()
        # The context this thread closed last, if nothing drew from the default
        # generator since: eager construction would have entered this one in
        # the state that context's *replay* ends in (PEFT enters one context
        # per adapted layer).
        self.parent: Trace | None = None
        last = getattr(_LAST, "trace", None)
        last = last() if last is not None else None
        if last is not None and torch.equal(last.exit_state, self.entry_state):
            self.parent = last
        self.exit_state: torch.Tensor | None = None
        self.replayed_exit: torch.Tensor | None = None  # set by the first replay
        self.generators: dict[int, torch.Tensor] = {}  # _Gen key -> state at first use
        self.taint: dict[int, str] = {}  # value id -> why it cannot be reproduced
        self.root: dict[int, int] = {}  # value id -> id of the storage it lives in
        self.recording = True
        self.abandoned: str | None = None  # why the recording is incomplete
        self.serial = next(_SERIALS)
        self.owner = threading.get_ident()
        self._next = 0
        self._ids: _IdMap = _IdMap()
        # storage pointer -> [(weakref to tensor, value id)], to find nn.Parameter(t)'s t
        self._storage: dict[int, list] = {}
        self._vid_storage: dict[int, int] = {}
        self._gen_keys: dict[int, tuple] = {}

    # -- recording --------------------------------------------------------
    def _new_vid(self) -> int:
        self._next += 1
        return self._next

    def _index(self, tensor: torch.Tensor, vid: int) -> None:
        try:
            ref = StorageWeakRef(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return
        # A weak reference keeps the storage's address from being reused.
        self._vid_storage[vid] = ref.cdata
        key = (tensor.dtype, tensor.shape, tensor.storage_offset(), tensor.stride())
        self._storage.setdefault(ref.cdata, []).append((ref, key, vid))

    def lookup(self, tensor: torch.Tensor) -> int | None:
        """The value id of a tensor sharing storage and layout with a recorded one.

        ``nn.Parameter(t)`` and ``deepcopy`` make tensor objects no mode sees;
        they share the storage of a recorded result.
        """
        ptr = _storage_ptr(tensor)
        entries = self._storage.get(ptr) if ptr is not None else None
        if not entries:
            return None
        key = (tensor.dtype, tensor.shape, tensor.storage_offset(), tensor.stride())
        for ref, other, vid in reversed(entries):
            if other == key and not ref.expired():
                return vid
        return None

    def vid_of(self, tensor: torch.Tensor, why: str = "") -> int:
        """The value id of ``tensor``; a tainted new one if the trace cannot explain it."""
        ids = self._ids
        vid = ids.get(tensor)
        if vid is not None:
            return vid
        vid = self.lookup(tensor)
        if vid is None:
            vid = self._new_vid()
            self.root[vid] = vid
            entry = registry_entry(tensor)
            where = "another metamode.empty_weights context" if entry else "outside the recording"
            self.taint[vid] = (
                f"computed from a {tensor.device.type} {_describe(tensor)} tensor made {where}{why}"
            )
            self._index(tensor, vid)
        ids[tensor] = vid
        return vid

    def _encode(self, value: Any, ins: list) -> Any:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if _is_tensor_type(kind):
            vid = self.vid_of(value)
            ins.append((vid, value))
            return _Ref(vid)
        if kind is tuple or kind is list:
            return kind(self._encode(v, ins) for v in value)
        if kind is dict:
            return {k: self._encode(v, ins) for k, v in value.items()}
        if kind is torch.device and value.type == "meta":
            return _MetaDevice
        if kind is torch.Generator:
            return self._generator(value)
        return value

    def _generator(self, gen: torch.Generator) -> Any:
        if gen is torch.default_generator:
            return None  # the replay generator itself
        key = id(gen)
        if key not in self._gen_keys:
            self._gen_keys[key] = (gen,)  # keeps id() unique while recording
            self.generators[key] = gen.get_state()
        return _Gen(key)

    def record(self, func: Any, args: tuple, kwargs: dict, run: Any) -> Any:
        """Run ``run(func, args, kwargs)`` and record the call if it can change a value."""
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(func, "__self__", None) is _IS_META:
            result = run(func, args, kwargs)
            if result is True:
                self._record_init_on_meta(args[0], sys._getframe(2))
            return result
        if name in _QUERIES or (name == "__get__" and func.__self__.__name__ in _PLAIN_GETTERS):
            return run(func, args, kwargs)
        if func is torch.tensor and _asks_for_the_default_device(sys._getframe(2)):
            # transformers' post_init skips init_weights when the default device
            # is meta; eager construction runs it, so the replay must see it.
            return func(*args, **kwargs)
        mutating = (
            (name.endswith("_") and not name.endswith("__"))
            or name in _MUTATING_DUNDERS
            or "out" in kwargs
        )
        ins: list = []
        enc_args = self._encode(args, ins)
        enc_kwargs = self._encode(kwargs, ins)
        if kwargs.get("device") == "meta":
            enc_kwargs["device"] = _MetaDevice
        if func is _TENSOR.to and args[1:2] == ("meta",):
            enc_args = (enc_args[0], _MetaDevice, *enc_args[2:])
        result = run(func, args, kwargs)
        if func in _FACTORIES and kwargs.get("dtype") is None and isinstance(result, torch.Tensor):
            # The dtype came from outside the call (the default dtype, or a
            # default_dtype context below this mode): the replay must not guess it.
            enc_kwargs = {**enc_kwargs, "dtype": result.dtype}
        outs: list[int] = []
        out_spec = self._encode_result(result, outs, ins)
        if not outs and not mutating:
            return result
        mutated = ins[0][0] if mutating and ins else None
        ins = [vid for vid, _ in ins]
        if mutated is not None and mutated not in outs:
            outs.append(mutated)
        random = _is_random(func)
        op = Op(func, enc_args, enc_kwargs, ins, out_spec, outs, mutated, random)
        if random and mutated is not None and len(set(ins)) == 1 and name in _OVERWRITING:
            target: Any = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            op.scratch = (tuple(target.shape), target.dtype)
        self._taint_op(op, func)
        self.ops.append(op)
        return result

    def _record_init_on_meta(self, tensor: torch.Tensor, frame: Any) -> None:
        for _ in range(3):
            if frame is None:
                return
            entry = _INIT_ON_META.get(frame.f_code)
            if entry is not None:
                break
            frame = frame.f_back
        else:
            return
        replay, names, random = entry
        local = frame.f_locals
        if local.get("tensor") is not tensor:
            return
        ins: list = []
        kwargs = {name: local[name] for name in names}
        if random:
            kwargs["generator"] = local.get("generator")
        if replay is _sparse_:
            kwargs["default_generator"] = None
        enc_args = self._encode((tensor,), ins)
        enc_kwargs = self._encode(kwargs, ins)
        vid = ins[0][0]
        op = Op(replay, enc_args, enc_kwargs, [v for v, _ in ins], _Ref(vid), [vid], vid, random)
        if random and len({v for v, _ in ins}) == 1:
            op.scratch = (tuple(tensor.shape), tensor.dtype)
        self._taint_op(op, replay)
        self.ops.append(op)

    def _encode_result(self, value: Any, outs: list[int], ins: list) -> Any:
        if _is_tensor_type(type(value)):
            ids = self._ids
            vid = ids.get(value)
            if vid is None:
                vid = self._new_vid()
                ids[value] = vid
                self._index(value, vid)
                ptr = self._vid_storage.get(vid)
                self.root[vid] = vid
                # A view of an argument lives in the argument's storage.
                for other, tensor in ins:
                    if ptr is not None and _storage_ptr(tensor) == ptr:
                        self.root[vid] = self.root.get(other, other)
                        break
            outs.append(vid)
            return _Ref(vid)
        kind = type(value)
        if kind is tuple or kind is list:
            if not any(_is_tensor_type(type(v)) or type(v) in (tuple, list) for v in value):
                return value
            return kind(self._encode_result(v, outs, ins) for v in value)
        return value

    def _taint_op(self, op: Op, func: Any) -> None:
        taint = self.taint
        reason = None
        if func in _FOREIGN:
            reason = f"made by {_name(func)} from memory the recording cannot copy"
        elif func in _UNSEEDABLE:
            reason = f"{_name(func)} draws random numbers and takes no generator="
            self.taint[0] = reason  # id 0: the random stream itself
        elif op.random and 0 in taint:
            reason = f"drawn after {taint[0].split(' draws')[0]} shifted the random stream"
        else:
            for vid in op.ins:
                if vid in taint:
                    reason = taint[vid]
                    break
        if reason is not None:
            if op.random:
                taint.setdefault(0, f"{_name(func)} drew from a tensor that is not reproducible")
            for vid in op.outs:
                taint.setdefault(vid, reason)
            if op.mutated is not None:
                taint.setdefault(op.mutated, reason)

    def note_registered(
        self,
        original: torch.Tensor,
        placed: torch.Tensor | None,
        module: Any = None,
        name: str | None = None,
    ) -> None:
        """``original`` was registered on a module, as ``placed`` (its twin) if moved."""
        why = " (registered as a parameter or buffer)"
        vid = self.vid_of(original, why)
        if module is not None and name is not None:
            _note_home(module, name, self, vid)
        _register(original, self, vid)
        if placed is not None:
            self._ids[placed] = vid
            _register(placed, self, vid)

    def abandon(self, why: str) -> None:
        """Stop recording for good; nothing recorded here can be materialized."""
        self.abandoned = why
        self.recording = False

    def close(self) -> None:
        """The context exited: drop every reference to the build's tensors."""
        self.recording = False
        self.exit_state = torch.default_generator.get_state()
        if self.owner == threading.get_ident():
            _LAST.trace = weakref.ref(self)
        self._ids = _IdMap()
        self._vid_storage = {}
        self._storage = {
            ptr: live
            for ptr, entries in self._storage.items()
            if (live := [e for e in entries if not e[0].expired()])
        }
        self._gen_keys = {}


def _asks_for_the_default_device(frame: Any) -> bool:
    modeling = sys.modules.get("transformers.modeling_utils")
    probe = getattr(modeling, "get_torch_context_manager_or_global_device", None)
    return frame is not None and frame.f_code is getattr(probe, "__code__", None)


def _storage_ptr(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _describe(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}{list(tensor.shape)}"


def _name(func: Any) -> str:
    module = getattr(func, "__module__", None) or "torch"
    return f"{module}.{getattr(func, '__qualname__', func)}"


# registered tensor -> (trace, value id); weak, so it keeps no tensor alive.
_REGISTRY: dict[int, tuple[weakref.ref, Trace, int]] = {}
_REGISTRY_LOCK = threading.RLock()  # RLock: a weakref callback may fire while held


def _drop(key: int, ref: weakref.ref) -> None:
    with _REGISTRY_LOCK:
        entry = _REGISTRY.get(key)
        if entry is not None and entry[0] is ref:
            del _REGISTRY[key]


def _register(tensor: torch.Tensor, trace: Trace, vid: int) -> None:
    key = id(tensor)
    ref = weakref.ref(tensor, lambda ref: _drop(key, ref))
    with _REGISTRY_LOCK:
        _REGISTRY[key] = (ref, trace, vid)


def registry_entry(tensor: torch.Tensor) -> tuple[Trace, int] | None:
    with _REGISTRY_LOCK:
        entry = _REGISTRY.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    return entry[1], entry[2]


def forget(tensor: torch.Tensor) -> None:
    """Drop ``tensor``'s entry (and with it metamode's weak reference to it)."""
    with _REGISTRY_LOCK:
        entry = _REGISTRY.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            del _REGISTRY[id(tensor)]


# module -> {parameter name: (trace, value id)}: FSDP2's fully_shard replaces a
# module's parameters by new DTensor parameters; their place says what they are.
_HOMES: dict[int, tuple[weakref.ref, dict[str, tuple[Trace, int]]]] = {}


def _drop_home(key: int, ref: weakref.ref) -> None:
    with _REGISTRY_LOCK:
        entry = _HOMES.get(key)
        if entry is not None and entry[0] is ref:
            del _HOMES[key]


def _note_home(module: Any, name: str, trace: Trace, vid: int) -> None:
    key = id(module)
    with _REGISTRY_LOCK:
        entry = _HOMES.get(key)
        if entry is None or entry[0]() is not module:
            entry = _HOMES[key] = (weakref.ref(module, lambda ref: _drop_home(key, ref)), {})
        entry[1][name] = (trace, vid)


def home_entry(module: Any, name: str) -> tuple[Trace, int] | None:
    """What the parameter registered as ``module.<name>`` in a replayable context was."""
    with _REGISTRY_LOCK:
        entry = _HOMES.get(id(module))
    if entry is None or entry[0]() is not module:
        return None
    return entry[1].get(name)
