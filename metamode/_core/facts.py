"""What metamode knows about the torch functions a torch-function mode is handed.

One table serves the recorder, the skip rule, ``skip_init``, the exact skip of the
shims and the diagnostics. Where torch states a fact, the table reads it: an aten op
tagged ``nondeterministic_seeded`` draws random numbers, a schema with a ``generator``
argument takes ``generator=``, torch's device-constructor list names the factories, the
``inplace_view`` tag marks calls that change a tensor's geometry, and torch's own
``torch.nn.init`` code says which init functions return early on meta. What torch does
not state -- which calls only read metadata, and which overwrite their target without
reading it -- is written out here, once.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import CodeType, FrameType, FunctionType
from typing import Any

import torch
import torch.nn.functional as F

from metamode._torch import (
    OpOverload,
    OpOverloadPacket,
    device_constructors,
    has_compatible_shallow_copy_type,
    parse_to,
    rebuild_meta_tensor_no_storage,
)

__all__ = [
    "INIT_FUNCTION_NAMES",
    "OVERWRITING_METHOD_NAMES",
    "RANDOM_INIT_FUNCTION_NAMES",
    "GROWING_NAMES",
    "UNINITIALISED_FACTORY_NAMES",
    "UNSTATED_WRITES",
    "UNVERSIONED_SELF_WRITES",
    "VALUE_WRITING_METHOD_NAMES",
    "FUSED_FAST_PATHS",
    "Fact",
    "MetaShortcut",
    "UnversionedWrites",
    "fact_of",
    "fused_fast_path",
    "meta_branch",
    "meta_shortcut",
    "reads_meta_only_to_warn",
    "is_device_probe",
    "register_device_probe",
    "register_meta_branch",
    "register_stand_in",
    "rebuilds_without_values",
    "stand_in_rule",
    "stand_in_for",
]

# -- written out: torch states no such facts -------------------------------------------

# The torch.nn.init functions that draw random numbers ...
RANDOM_INIT_FUNCTION_NAMES = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)
# ... and all that only write values (each overwrites its whole argument).
INIT_FUNCTION_NAMES = (
    *RANDOM_INIT_FUNCTION_NAMES,
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
)
# In-place methods whose result does not depend on the tensor's current values.
OVERWRITING_METHOD_NAMES = (
    "uniform_",
    "normal_",
    "fill_",
    "zero_",
    "random_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "bernoulli_",
)
# In-place methods that only compute values: on a meta tensor they compute nothing.
VALUE_WRITING_METHOD_NAMES = (
    *OVERWRITING_METHOD_NAMES,
    "erfinv_",
    "clamp_",
    "mul_",
    "add_",
    "sub_",
    "div_",
)
# Calls that read a tensor's metadata, never its values, and return no tensor.
_QUERY_METHODS = frozenset(
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
        "get_device",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "is_inference",
        "is_pinned",
        "is_shared",
        "has_names",
        "is_same_size",
        "dim_order",
        "requires_grad_",
        "retain_grad",
        "__len__",
        "__hash__",
    ]
)
# Tensor methods that hand out the tensor's memory to code metamode cannot follow
# (NumPy, DLPack consumers, raw pointers, storage objects): writes through what they
# return move no version counter.
_MEMORY_HANDING_METHODS = frozenset(
    ["numpy", "__array__", "__dlpack__", "data_ptr", "untyped_storage", "storage", "_storage"]
)
# ... of which those that tell where the memory is: every meta tensor's address is 0, so a
# build comparing addresses (``a.data_ptr() == b.data_ptr()``, ``untyped_storage().data_ptr()``)
# finds shared memory where eager construction finds none.
_ADDRESS_METHODS = frozenset(["data_ptr", "untyped_storage", "storage", "_storage"])
# Properties of a tensor's placement whose answer on meta differs from the CPU's, where eager
# construction makes the tensor (``is_meta``, and ``is_cpu``; ``is_cuda``, ``is_mps``... say
# False on both).
_PLACEMENT_PROPERTIES = frozenset(["is_meta", "is_cpu"])
# torch functions of the same kind (read metadata or process state, no tensor values)
_QUERY_FUNCTIONS = frozenset(
    [
        "is_same_size",
        "is_floating_point",
        "is_complex",
        "is_conj",
        "is_neg",
        "is_signed",
        "is_inference",
        "numel",
        "result_type",
        "is_tensor",
        "is_storage",
        "get_device",
        "_set_grad_enabled",
        "is_grad_enabled",
        "is_inference_mode_enabled",
    ]
)
_QUERY_PROPERTIES = frozenset(
    [
        "shape",
        "dtype",
        "device",
        "layout",
        "ndim",
        "names",
        "itemsize",
        "nbytes",
        "requires_grad",
        "is_leaf",
        "grad_fn",
        "_version",
        "is_cuda",
        "is_cpu",
        "is_sparse",
        "is_quantized",
        "is_mkldnn",
        "is_nested",
        "is_xla",
        "is_mps",
        "output_nr",
        "_cdata",
        "_base",
        "grad",
        "retains_grad",
    ]
)
# Calls that may give a tensor another storage or geometry in place.
_GEOMETRY_CHANGING = frozenset(["set_", "resize_", "resize_as_", "data"])
# Factories whose result is uninitialised memory, which torch fills (NaN, or an integer
# dtype's largest value) under torch.use_deterministic_algorithms(True) with
# torch.utils.deterministic.fill_uninitialized_memory on.
UNINITIALISED_FACTORY_NAMES = (
    "empty",
    "empty_like",
    "empty_strided",
    "empty_permuted",
    "new_empty",
    "new_empty_strided",
)
# In-place calls that may grow their first argument's storage: torch fills the memory they
# add as it fills a factory's, under the same two flags.
GROWING_NAMES = ("resize_", "resize_as_")
# torch functions (Python functions of torch's and aten ops, by name) that update running
# statistics in place although their schema marks no argument written (``Tensor?``, not
# ``Tensor(a!)``) and that move no version counter doing it: name -> (the argument that must
# be true for the update, None when it always updates; the arguments updated). Each
# function's own signature or schema says where the arguments are.
# ``instance_norm`` is not here: it updates its running statistics with ``copy_``, which
# moves their version counters.
UNSTATED_WRITES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    # torch.nn.functional.batch_norm and torch.batch_norm
    "batch_norm": ("training", ("running_mean", "running_var")),
    "native_batch_norm": ("training", ("running_mean", "running_var")),
    "_batch_norm_impl_index": ("training", ("running_mean", "running_var")),
    "cudnn_batch_norm": ("training", ("running_mean", "running_var")),
    "miopen_batch_norm": ("training", ("running_mean", "running_var")),
    "batch_norm_update_stats": (None, ("running_mean", "running_var")),
    "batch_norm_gather_stats": (None, ("running_mean", "running_var")),
    "batch_norm_gather_stats_with_counts": (None, ("running_mean", "running_var")),
}

# aten ops whose schema marks ``self`` written (``Tensor(a!) self``) and whose CPU kernel
# writes it without moving its version counter (SobolEngine's state: torch.quasirandom)
UNVERSIONED_SELF_WRITES = (
    "_sobol_engine_scramble_",
    "_sobol_engine_ff_",
    "_sobol_engine_initialize_state_",
)

# torch's functions that make a tensor from what a pickle of a meta tensor holds: its
# metadata, no values (``torch.load``, ``pickle.loads``)
_VALUELESS_REBUILDS = frozenset([rebuild_meta_tensor_no_storage.__code__])


def rebuilds_without_values(code: CodeType) -> bool:
    """Whether ``code`` rebuilds a pickled meta tensor, which carries no values."""
    return code in _VALUELESS_REBUILDS


# -- the table ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fact:
    """What one torch function is.

    ``query``: reads only metadata and returns no tensor (never recorded). ``random``:
    draws random numbers. ``generator``: takes ``generator=``. ``factory``: makes a tensor
    from arguments that are not tensors (torch's device-constructor list). ``overwrites``:
    writes its first argument without reading its values. ``init``: a ``torch.nn.init``
    function. ``changes_geometry``: may give a tensor argument another storage, shape or
    strides in place. ``is_meta``, ``device``: a read of that property; ``placement``: a read
    of a property that answers otherwise on meta than on the CPU (``is_meta``, ``is_cpu``).
    ``hands_out_memory``: returns the tensor's memory to code outside torch's dispatch
    (``numpy()``); ``addresses``: tells where that memory is (``data_ptr()``).
    ``unstated``: an in-place tensor method torch binds without an operator schema
    (``apply_``, ``map_``, ``map2_``: they run a Python function over the memory and move
    no version counter), so nothing states what it writes. ``derives_device``: answers a
    device made from its arguments (``torch.device(d)``, and ``_torch.parse_to``, which
    ``Tensor.to`` and ``Module.to`` parse theirs with). ``compares_types``: answers whether
    two tensors' implementations are alike (``_torch.has_compatible_shallow_copy_type``,
    which ``Module._apply`` asks before it gives a parameter the memory of the tensor it made
    instead of a new parameter holding it). ``uninitialised``: its result
    is uninitialised memory (``UNINITIALISED_FACTORY_NAMES``); ``grows``: the memory it adds
    to its first argument's storage is (``GROWING_NAMES``). ``writes_positional``: it may
    write a tensor passed positionally (False only where torch's schemas say no overload
    does: an out-of-place aten op, whose ``out=`` is keyword-only). ``unversioned``: the
    tensor arguments it writes in place without moving their version counters (running
    statistics), or None. ``gradient``: a read of ``.grad``, which hands out what
    autograd's engine made, which no torch call makes. ``draws_when``: for a random
    function that draws only for some arguments (dropout in eval mode or with ``p=0``),
    whether a call with these ``(args, kwargs)`` may draw (:data:`CONDITIONAL_DRAWS`).
    ``custom``: the namespace of an op registered outside torch (``torch.library``), whose
    kernel may draw random numbers without saying so: random, with an unknown start.
    """

    name: str
    query: bool = False
    random: bool = False
    generator: bool = False
    factory: bool = False
    overwrites: bool = False
    init: bool = False
    changes_geometry: bool = False
    is_meta: bool = False
    device: bool = False
    derives_device: bool = False
    compares_types: bool = False
    placement: bool = False
    hands_out_memory: bool = False
    addresses: bool = False
    unstated: bool = False
    uninitialised: bool = False
    grows: bool = False
    writes_positional: bool = True
    unversioned: UnversionedWrites | None = None
    gradient: bool = False
    custom: str | None = None
    draws_when: Callable[[tuple, dict], bool] | None = None


@dataclass(frozen=True, slots=True)
class UnversionedWrites:
    """Where the tensor arguments a call writes without moving their version counters are:
    ``written`` as (position, name) pairs, and ``flag``, (position, name, default) of the
    argument that must be true for the write, or None when the call always writes."""

    written: tuple[tuple[int, str], ...]
    flag: tuple[int, str, Any] | None = None

    def tensors(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors a call with ``args`` and ``kwargs`` writes so."""
        if self.flag is not None:
            position, name, default = self.flag
            value = args[position] if position < len(args) else kwargs.get(name, default)
            if value is False:  # anything else (a tensor, a SymBool) may be true
                return []
        found: list[torch.Tensor] = []
        for position, name in self.written:
            value = args[position] if position < len(args) else kwargs.get(name)
            for each in value if isinstance(value, list | tuple) else (value,):
                if isinstance(each, torch.Tensor):
                    found.append(each)
        return found


_QUERY_FACT = Fact("query", query=True)
_FACTS: dict[Any, Fact] = {}
_INIT = vars(torch.nn.init)
_TENSOR_OBJCLASSES = torch.Tensor.__mro__[:-1]  # Tensor and the C class its methods live on


def fact_of(func: Any) -> Fact:
    """The :class:`Fact` of ``func`` (any callable a torch-function mode is handed)."""
    fact = _FACTS.get(func)
    if fact is None:
        fact = _classify(func)
        rule = _conditional_draws().get(func)
        if rule is not None and fact.random:
            fact = replace(fact, draws_when=rule)
        _FACTS[func] = fact
    return fact


# Random functions that draw only for some arguments: (function, its dropout probability's
# parameter, its training flag's parameter). Each may draw only when the flag is set (or
# there is none) and 0 < p < 1 (ATen's dropout returns its input at p = 0 or outside
# training, and zeros at p = 1, drawing nothing; an RNN's dropout runs between layers), or,
# with no probability, when the flag is set (rrelu's noise, for its negative elements).
# Positions and defaults come from each function's signature, or for a C function from its
# aten op's schema.
CONDITIONAL_DRAWS: tuple[tuple[Callable[..., Any], str | None, str | None], ...] = (
    (F.dropout, "p", "training"),
    (F.dropout1d, "p", "training"),
    (F.dropout2d, "p", "training"),
    (F.dropout3d, "p", "training"),
    (F.alpha_dropout, "p", "training"),
    (F.feature_alpha_dropout, "p", "training"),
    (torch.dropout, "p", "train"),
    (torch.dropout_, "p", "train"),
    (torch.feature_dropout, "p", "train"),
    (torch.feature_dropout_, "p", "train"),
    (torch.alpha_dropout, "p", "train"),
    (torch.alpha_dropout_, "p", "train"),
    (torch.feature_alpha_dropout, "p", "train"),
    (torch.feature_alpha_dropout_, "p", "train"),
    (F.scaled_dot_product_attention, "dropout_p", None),
    (F.multi_head_attention_forward, "dropout_p", "training"),
    (torch.lstm, "dropout", "train"),  # between layers: only with num_layers > 1
    (torch.gru, "dropout", "train"),
    (torch.rnn_tanh, "dropout", "train"),
    (torch.rnn_relu, "dropout", "train"),
    (F.rrelu, None, "training"),
    (torch.rrelu, None, "training"),
    (F.rrelu_, None, "training"),
    (torch.rrelu_, None, "training"),
)


# torch modules whose forward takes a fused kernel (eager's path for CPU tensors in eval
# mode) only where torch.overrides.has_torch_function finds no torch-function behaviour in
# its arguments, which any TorchFunctionMode on the thread's stack, the recorder's among
# them, turns True: (forward, the local in which it keeps its reason for the slow path, the
# attributes of the module its fused call needs besides). The slow path's result differs
# from the fused one in its last bits.
FUSED_FAST_PATHS: tuple[tuple[Callable[..., Any], str, tuple[str, ...]], ...] = (
    (torch.nn.MultiheadAttention.forward, "why_not_fast_path", ("in_proj_bias", "in_proj_weight")),
    (torch.nn.TransformerEncoderLayer.forward, "why_not_sparsity_fast_path", ()),
    (torch.nn.TransformerEncoder.forward, "why_not_sparsity_fast_path", ()),
)
_HAS_TORCH_FUNCTION = "some Tensor argument has_torch_function"


@functools.cache
def _fused_fast_paths() -> dict[CodeType, tuple[str, tuple[str, ...]]]:
    return {forward.__code__: (reason, needs) for forward, reason, needs in FUSED_FAST_PATHS}


def fused_fast_path(frame: FrameType | None) -> str | None:
    """The name of a :data:`FUSED_FAST_PATHS` forward running on the stack from ``frame``
    that took its slow path because ``has_torch_function`` said so, where eager
    construction, with no torch function mode, takes the fused kernel (its later check,
    grad enabled with an argument requiring it, and the attributes its fused call needs,
    not stopping it), if any."""
    paths = _fused_fast_paths()
    while frame is not None:
        path = paths.get(frame.f_code)
        if path is not None and _takes_fused_kernel(frame.f_locals, *path):
            return frame.f_code.co_qualname
        frame = frame.f_back
    return None


def _takes_fused_kernel(values: Any, reason: str, needs: tuple[str, ...]) -> bool:
    if values.get(reason) != _HAS_TORCH_FUNCTION:
        return False
    module = values.get("self")
    if any(getattr(module, name, None) is None for name in needs):
        return False
    arguments = values.get("tensor_args")
    return not (
        arguments is not None
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in arguments)
    )


def _number(value: Any) -> float | None:
    """``value`` as a float where it is a real number (a NumPy scalar, a real tensor of one
    element), else None."""
    if isinstance(value, torch.Tensor):
        if value.is_meta or value.numel() != 1 or value.is_complex():
            return None
        return float(value)
    return float(value) if isinstance(value, numbers.Real) else None


_DRAWLESS: dict[int, Fact] = {}


def drawless(fact: Fact) -> Fact:
    """``fact`` of a call its ``draws_when`` says draws nothing: not random."""
    found = _DRAWLESS.get(id(fact))
    if found is None:
        found = _DRAWLESS[id(fact)] = replace(fact, random=False, draws_when=None)
    return found


@functools.cache
def _conditional_draws() -> dict[Any, Callable[[tuple, dict], bool]]:
    return {func: _draw_rule(func, p, flag) for func, p, flag in CONDITIONAL_DRAWS}


def _draw_rule(
    func: Callable[..., Any], p: str | None, flag: str | None
) -> Callable[[tuple, dict], bool]:
    """Whether a call of ``func`` with ``(args, kwargs)`` may draw (:data:`CONDITIONAL_DRAWS`)."""
    overloads: list[tuple[list[bool], dict[str, tuple[int, Any]]]] = []
    if type(func) is FunctionType:
        parameters = list(inspect.signature(func).parameters.values())
        overloads.append(([], {q.name: (i, q.default) for i, q in enumerate(parameters)}))
    else:  # an overload per schema: which positions take a Tensor tells them apart
        for op in _aten_overloads(func.__name__):
            arguments = op._schema.arguments
            tensors = [str(a.type) == "Tensor" for a in arguments]
            defaults = {
                a.name: (i, a.default_value if a.has_default_value() else None)
                for i, a in enumerate(arguments)
            }
            overloads.append((tensors, defaults))

    def value(name: str | None, args: tuple, kwargs: dict, absent: Any) -> Any:
        if name is None:
            return absent
        positions = next(
            (
                positions
                for tensors, positions in overloads
                if all(
                    isinstance(arg, torch.Tensor) == takes
                    for arg, takes in zip(args, tensors, strict=False)
                )
            ),
            overloads[0][1],
        )
        index, default = positions[name]
        if name in kwargs:
            return kwargs[name]
        return args[index] if index < len(args) else default

    layered = any("num_layers" in positions for _, positions in overloads)

    def draws(args: tuple, kwargs: dict) -> bool:
        if not value(flag, args, kwargs, True):
            return False
        if layered and value("num_layers", args, kwargs, 2) == 1:
            return False
        probability = _number(value(p, args, kwargs, 0.5))
        return probability is None or 0 < probability < 1

    return draws


def _classify(func: Any) -> Fact:
    name = getattr(func, "__name__", "") or ""
    if func is torch.device or func is parse_to:
        return Fact(name, query=True, derives_device=True)
    if func is has_compatible_shallow_copy_type:
        return Fact(name, query=True, compares_types=True)
    if isinstance(func, type) and not issubclass(func, torch.Tensor):
        return _QUERY_FACT  # torch.device(...), torch.Size(...)
    if name in ("__get__", "__set__"):
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        if name == "__get__" and prop in _PLACEMENT_PROPERTIES:
            return Fact(prop, query=True, is_meta=prop == "is_meta", placement=True)
        if name == "__get__" and prop == "grad":
            return Fact("grad", query=True, gradient=True)
        if name == "__get__" and prop == "device":
            return Fact("device", query=True, device=True)
        if name == "__get__" and prop in _QUERY_PROPERTIES:
            return _QUERY_FACT
        return Fact(f"{prop}.{name}", changes_geometry=prop in _GEOMETRY_CHANGING)
    if name in _QUERY_METHODS and _is_tensor_method(func):
        return _QUERY_FACT
    if name in _MEMORY_HANDING_METHODS and (
        _is_tensor_method(func) or getattr(torch.Tensor, name, None) is func
    ):
        return Fact(name, query=True, hands_out_memory=True, addresses=name in _ADDRESS_METHODS)
    if name in _QUERY_FUNCTIONS and type(func) is not FunctionType:
        return _QUERY_FACT
    if (
        name.endswith("_")
        and not name.startswith("_")
        and _is_tensor_method(func)
        and not _aten_overloads(name)
    ):
        return Fact(name, unstated=True)
    if type(func) is FunctionType:
        return _python_fact(func, name)
    if isinstance(func, OpOverload):  # torch.ops.aten.resize_.default: its op's own name
        ops, name = [func], func._schema.name.removeprefix("aten::")
    elif isinstance(func, OpOverloadPacket):  # torch.ops.aten.normal_, torch.ops.mylib.f
        ops = [getattr(func, overload) for overload in func.overloads()]
        name = func._qualified_op_name.removeprefix("aten::")
    else:
        ops = _aten_overloads(name)
    custom = next((op.namespace for op in ops if op.namespace not in _TORCH_NAMESPACES), None)
    return Fact(
        name,
        unversioned=_unversioned_writes(func, name, [op._schema for op in ops]),
        random=custom is not None
        or any(torch.Tag.nondeterministic_seeded in op.tags for op in ops),
        custom=custom,
        generator=any(a.name == "generator" for op in ops for a in op._schema.arguments),
        factory=func in _factories(),
        uninitialised=name in UNINITIALISED_FACTORY_NAMES and bool(ops),
        grows=name in GROWING_NAMES,
        overwrites=name in OVERWRITING_METHOD_NAMES and _is_tensor_method(func),
        changes_geometry=name in _GEOMETRY_CHANGING
        or any(torch.Tag.inplace_view in op.tags for op in ops),
        writes_positional=not ops
        or name.endswith("_")
        or any(_written(a) and not a.kwarg_only for op in ops for a in op._schema.arguments),
    )


# The namespaces of torch's own operators, whose schemas and tags state what they do; an op
# of any other was registered through torch.library (torch._library.utils.is_builtin).
_TORCH_NAMESPACES = frozenset(["aten", "prim", "prims"])


def _written(argument: Any) -> bool:
    """Whether an op's schema marks ``argument`` written (``Tensor(a!)``)."""
    return argument.alias_info is not None and argument.alias_info.is_write


def _python_fact(func: FunctionType, name: str) -> Fact:
    code = func.__code__
    parameters = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    init = _INIT.get(name) is func
    return Fact(
        name,
        random=_calls_random_op(func),
        generator="generator" in parameters,
        overwrites=init and name in INIT_FUNCTION_NAMES,
        init=init,
        unversioned=_unversioned_writes(func, name, []),
    )


def _unversioned_writes(func: Any, name: str, schemas: list[Any]) -> UnversionedWrites | None:
    """Where ``func`` writes tensor arguments that torch's version counters do not show:
    the running statistics of :data:`UNSTATED_WRITES`, and the arguments other than ``self``
    an aten op's schema marks written (``Tensor(a!) running_mean`` of
    ``_native_batch_norm_legit``), which its kernel need not version either (``self`` too
    for :data:`UNVERSIONED_SELF_WRITES`)."""
    if isinstance(func, OpOverload):
        schemas, name = [func._schema], func._schema.name.removeprefix("aten::")
    flag, written = UNSTATED_WRITES.get(name, (None, ()))
    if type(func) is FunctionType:
        if not func.__module__.startswith("torch.") or not written:
            return None
        parameters = list(inspect.signature(func).parameters.values())
        positions = {p.name: (i, p.default) for i, p in enumerate(parameters)}
    else:
        positions = {}
        stated: list[str] = []
        for schema in schemas:
            for i, argument in enumerate(schema.arguments):
                if not argument.kwarg_only:
                    default = argument.default_value if argument.has_default_value() else None
                    positions.setdefault(argument.name, (i, default))
                alias = argument.alias_info
                if (
                    alias is not None
                    and alias.is_write
                    and (argument.name != "self" or name in UNVERSIONED_SELF_WRITES)
                    and not argument.kwarg_only
                    and "Tensor" in str(argument.type)
                ):
                    stated.append(argument.name)
        if stated and not written:
            flag, written = None, tuple(dict.fromkeys(stated))
    found = tuple((positions[n][0], n) for n in written if n in positions)
    if not found:
        return None
    where = (positions[flag][0], flag, positions[flag][1]) if flag in positions else None
    return UnversionedWrites(found, where)


# torch's own torch.nn.init functions, as torch defined them (libraries rebind the names)
_TORCH_INIT_FUNCTIONS = {
    name: function
    for name, function in _INIT.items()
    if type(function) is FunctionType and function.__globals__ is _INIT
}


def stand_in_for(func: Any) -> Callable[..., Any] | None:
    """torch's ``torch.nn.init`` function that ``func`` stands in for right now (a
    library's function bound in ``torch.nn.init`` under its name), or None."""
    if type(func) is not FunctionType or func.__globals__ is _INIT:
        return None
    original = _TORCH_INIT_FUNCTIONS.get(func.__name__)
    return original if original is not None and _INIT.get(func.__name__) is func else None


# Libraries' stand-ins whose behaviour their library states: (is it one of theirs?, does
# this call run torch's function?), registered by metamode.integrations.
_STAND_IN_RULES: list[tuple[Callable[[Any], bool], Callable[[tuple, dict], bool]]] = []


def register_stand_in(
    ours: Callable[[Any], bool], runs_original: Callable[[tuple, dict], bool]
) -> None:
    """Say that a stand-in ``ours(func)`` recognises runs torch's function exactly when
    ``runs_original(args, kwargs)``, and otherwise returns its tensor untouched."""
    if all(registered is not ours for registered, _ in _STAND_IN_RULES):
        _STAND_IN_RULES.append((ours, runs_original))


def stand_in_rule(func: Any) -> Callable[[tuple, dict], bool] | None:
    for ours, runs_original in _STAND_IN_RULES:
        if ours(func):
            return runs_original
    return None


def _is_tensor_method(func: Any) -> bool:
    return getattr(func, "__objclass__", None) in _TENSOR_OBJCLASSES


@functools.cache
def _factories() -> frozenset[Any]:
    return frozenset(device_constructors())


def relearn_factories() -> None:
    """torch's table of the factories ``torch.device(...)`` places was rebuilt (a repair):
    what was learned from it is learned again."""
    _factories.cache_clear()
    _FACTS.clear()


def _aten_overloads(name: str) -> list[Any]:
    """torch's aten ops bound under ``name`` (a C binding's name is its op's name)."""
    packet = getattr(torch.ops.aten, name, None) if name and name.isidentifier() else None
    if packet is None or not hasattr(packet, "overloads"):
        return []
    return [getattr(packet, overload) for overload in packet.overloads()]


@functools.cache
def _random_op(name: str) -> bool:
    """Whether torch's aten op ``name`` draws random numbers: its ``nondeterministic_seeded``
    tag."""
    return any(torch.Tag.nondeterministic_seeded in op.tags for op in _aten_overloads(name))


def _calls_random_op(func: FunctionType, seen: frozenset[CodeType] = frozenset()) -> bool:
    """Whether a Python-level torch function names a random op, directly or through the
    Python functions of torch it names or closes over (conservative: a name, not a call)."""
    code = func.__code__
    if code in seen:
        return False
    seen = seen | {code}
    callees = [func.__globals__.get(name) for name in _all_names(code)]
    callees += [cell.cell_contents for cell in func.__closure__ or () if _filled(cell)]
    if any(_random_op(name) for name in _all_names(code)):
        return True
    return any(
        type(callee) is FunctionType
        and callee.__module__.startswith("torch")
        and _calls_random_op(callee, seen)
        for callee in callees
    )


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


def _all_names(code: CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, CodeType):  # nested functions and comprehensions
            names |= _all_names(constant)
    return names


# -- torch.nn.init functions that return early on meta -----------------------------------


@dataclass(frozen=True, slots=True)
class MetaShortcut:
    """A ``torch.nn.init`` function that returns early for a meta tensor: the only call a
    mode sees from it is the ``is_meta`` read in ``reader``. Replay runs ``replay`` with the
    reader's arguments, which are ``function``'s public ones."""

    function: Callable[..., Any]
    replay: Callable[..., Any]
    parameters: tuple[str, ...]
    random: bool


def _sparse_(tensor, sparsity, std=0.01, generator=None, default_generator=None):
    """``torch.nn.init.sparse_`` with its ``randperm`` draws, which torch takes from the
    default generator whatever ``generator`` is, taken from ``default_generator``."""
    rows, cols = tensor.shape
    num_zeros = math.ceil(sparsity * rows)
    with torch.no_grad():
        tensor.normal_(0, std, generator=generator)
        for col_idx in range(cols):
            row_indices = torch.randperm(rows, generator=default_generator)
            tensor[row_indices[:num_zeros], col_idx] = 0
    return tensor


# torch functions whose draws do not all honour ``generator=``, with a faithful copy that
# takes the stray draws from ``default_generator``.
_REPLAYS: dict[str, Callable[..., Any]] = {"sparse_": _sparse_}


@functools.cache
def _meta_shortcuts() -> dict[CodeType, MetaShortcut]:
    table: dict[CodeType, MetaShortcut] = {}
    for name, function in _TORCH_INIT_FUNCTIONS.items():
        if name.startswith("_"):
            continue
        parameters = tuple(inspect.signature(function).parameters)
        readers = [function.__code__] if "is_meta" in function.__code__.co_names else []
        for helper_name in function.__code__.co_names:
            helper = _TORCH_INIT_FUNCTIONS.get(helper_name)
            if (
                helper_name.startswith("_")
                and type(helper) is FunctionType
                and "is_meta" in helper.__code__.co_names
            ):
                readers.append(helper.__code__)
        for code in readers:
            own = code.co_varnames[: code.co_argcount]
            if set(own) <= set(parameters):
                table[code] = MetaShortcut(
                    function,
                    _REPLAYS.get(name, function),
                    own,
                    "generator" in parameters,
                )
    return table


def meta_shortcut(code: CodeType) -> MetaShortcut | None:
    """The init function that returns early on meta after reading ``is_meta`` in ``code``."""
    return _meta_shortcuts().get(code)


# torch functions whose reads of ``.is_meta`` decide only whether to warn, so what they
# build is eager construction's: ``Module._load_from_state_dict`` warns that copying a real
# tensor into a meta one does nothing (tests pin the source each row rests on)
_WARNING_ONLY_META_READS = frozenset([torch.nn.Module._load_from_state_dict.__code__])


def reads_meta_only_to_warn(code: CodeType) -> bool:
    """Whether ``code`` reads ``.is_meta`` only to decide a warning."""
    return code in _WARNING_ONLY_META_READS


# -- libraries' branches on meta-ness -----------------------------------------------------

# Where a library's code asks whether a tensor is on meta (``.is_meta`` or ``.device``) and
# then builds something else than eager construction does. Registered by
# metamode.integrations: (code objects, found lazily, why it diverges, where it does).
_Where = Callable[[FrameType], bool] | None
_META_BRANCHES: list[tuple[Callable[[], list[CodeType]], str, _Where]] = []


def register_meta_branch(
    codes: Callable[[], list[CodeType]],
    why: str,
    when: _Where = None,
) -> None:
    """Say that the functions whose code ``codes()`` returns branch on a tensor being on
    meta, away from eager construction (``why`` says what they do); with ``when``, only
    where ``when(frame)`` says so of the frame that read it (the rest builds as eager)."""
    if all(registered is not codes for registered, _, _ in _META_BRANCHES):
        _META_BRANCHES.append((codes, why, when))
        _KNOWN_FOR[0] = -1


_KNOWN_BRANCHES: dict[CodeType, tuple[str, _Where]] = {}
_KNOWN_FOR = [-1]  # the size of sys.modules when _KNOWN_BRANCHES was gathered


def meta_branch(frame: FrameType) -> tuple[bool, str | None]:
    """Whether the library code ``frame`` runs, which read where a tensor is, is a registered
    branch on meta, and if so why it builds otherwise there (None: it builds as eager does
    here, as its ``when`` says)."""
    if _KNOWN_FOR[0] != len(sys.modules):  # a library was imported since: ask again
        _KNOWN_BRANCHES.clear()
        for codes, why, when in _META_BRANCHES:
            _KNOWN_BRANCHES.update(dict.fromkeys(codes(), (why, when)))
        _KNOWN_FOR[0] = len(sys.modules)
    known = _KNOWN_BRANCHES.get(frame.f_code)
    if known is None:
        return False, None
    why, when = known
    return True, why if when is None or when(frame) else None


# -- libraries' device probes -------------------------------------------------------------

# Library functions that make a tensor without ``device=`` only to learn the device a model
# is being built on (transformers' ``get_torch_context_manager_or_global_device``, which
# skips the weight initialisation when it sees meta). Registered by metamode.integrations.
_DEVICE_PROBES: list[Callable[[], list[CodeType]]] = []
_PROBE_CODES: set[CodeType] = set()
_PROBES_FOR = [-1]  # the size of sys.modules when _PROBE_CODES was gathered


def register_device_probe(codes: Callable[[], list[CodeType]]) -> None:
    """Say that the functions whose code ``codes()`` returns probe the default device
    with a factory call, and build otherwise when it answers meta."""
    if all(registered is not codes for registered in _DEVICE_PROBES):
        _DEVICE_PROBES.append(codes)
        _PROBES_FOR[0] = -1


def is_device_probe(code: CodeType) -> bool:
    """True if ``code`` is a registered device probe's."""
    if _PROBES_FOR[0] != len(sys.modules):  # a library was imported since: ask again
        _PROBE_CODES.clear()
        for codes in _DEVICE_PROBES:
            _PROBE_CODES.update(codes())
        _PROBES_FOR[0] = len(sys.modules)
    return code in _PROBE_CODES
