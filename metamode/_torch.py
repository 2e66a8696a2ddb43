"""Every private torch name metamode uses, and nothing else.

A torch upgrade is checked here: no other module in the package imports or
reads a private torch name. Each entry names the public alternative that
would replace it, or says that there is none yet.

===============================================  ==========================================
private name                                     public alternative
===============================================  ==========================================
``torch.overrides._push_mode`` / ``_pop_mode``   ``TorchFunctionMode.__enter__/__exit__``
                                                 (they must nest like ``with``; metamode's
                                                 contexts check ownership and order first)
``torch._C._len_torch_function_stack``           none: no public read of the mode stack
``torch._C._get_function_stack_at``              none (``torch.overrides._get_current_
                                                 function_mode_stack`` is private too)
``torch._C.DisableTorchFunction``                ``torch._C.DisableTorchFunctionSubclass``
                                                 is also private; none public
``torch._C._disabled_torch_function_impl``       none: the default ``__torch_function__``
``torch._C._VariableFunctions``                  none: where torch's C functions live
``torch.utils._device._device_constructors``     none: the factories ``torch.device(...)``
                                                 redirects
``torch.utils._device.DeviceContext``            ``torch.device`` as a context manager
``torch.utils._device.CURRENT_DEVICE``           ``torch.get_default_device()`` (reads only)
``torch._GLOBAL_DEVICE_CONTEXT``                 ``torch.set_default_device`` /
                                                 ``torch.get_default_device()``
``torch.nn.modules.module._global_*_``         ``register_module_*_registration_hook``
``registration_hooks``                           (adds only: no public read)
``torch.Tensor._make_subclass``                  ``torch.Tensor.as_subclass`` (shares the
                                                 autograd graph; metamode needs a leaf)
``torch.distributed.tensor._utils.``             ``distribute_tensor`` (a collective: every
``compute_local_shape_and_global_offset``        rank would need the full tensor at once)
``torch.nn.parameter.UninitializedTensorMixin``  ``torch.nn.parameter.is_lazy`` (tensors only)
``Tensor._use_count``                            none: what ``swap_tensors`` checks (materialize
                                                 checks it first, to refuse before installing)
``torch._neg_view``                              none: ``x.conj().imag`` makes one, from a
                                                 complex tensor only
``torch._C._dispatch_tls_local_include_set`` /   none: ``torch.is_autocast_enabled(device)``
``_exclude_set``, ``DispatchKey``,               and ``torch.is_inference_mode_enabled()``
``DispatchKeySet``                               read parts of them
``torch._C._dispatch_has_kernel_for_``         none: whether an op has a kernel of its own
``dispatch_key``                                 for a key (autocast's casting ops)
``torch.UntypedStorage._new_with_weak_ptr``     none: a storage from torch's weak reference
                                                 to it, while it lives
``torch.UntypedStorage._weak_ref`` /             ``torch.multiprocessing.reductions.``
``_expired`` / ``_free_weak_ref``                ``StorageWeakRef``, which adds two Python
                                                 frames to each question (``StorageRef``)
``torch._C._ForceDispatchKeyGuard``              ``torch.autocast(device, enabled=...)`` per
                                                 device type, which sets parts of them
``torch._ops.OpOverload``                        none: the type of ``torch.ops.aten.<op>.<x>``
``torch._ops.OpOverloadPacket``                  none: the type of ``torch.ops.aten.<op>``
``torch._utils._rebuild_meta_tensor_no_storage`` none: what unpickling a meta tensor calls
``torch._C._get_nnpack_enabled``                 none: ``torch.backends.nnpack.flags`` sets it
``torch._C._get_fp32_precision_getter``,         ``torch.backends.mkldnn.matmul.fp32_precision``
``_get_mkldnn_enabled``,                         and the like, which add Python frames to
``_get_mkldnn_deterministic``                    each read (the recorder reads them per call)
``torch.utils._python_dispatch.``                none: a ``TorchDispatchMode``'s
``_disable_current_modes``, ``torch._ops.``      ``__exit__`` must nest like ``with`` (the
``_len_torch_dispatch_stack_pre_dispatch``       caller's modes are set aside for a while)
``torch._C._nn._parse_to``                       none: how ``Tensor.to`` and ``Module.to``
                                                 parse their arguments (a new device object)
``torch._has_compatible_shallow_copy_type``      none: what ``Module._apply`` asks before it
                                                 gives a parameter another tensor's memory
``torch._functorch.pyfunctorch.``                none: the transforms (``torch.func.grad``,
``temporarily_clear_interpreter_stack``,         ``vmap``) the thread is inside
``torch._C._functorch.peek_interpreter_stack``
``torch._C._functorch.``                         none: whether a tensor is a transform's
``is_functorch_wrapped_tensor``, ``get_unwrapped`` wrapper, which has no storage to read,
                                                 and the tensor it wraps
===============================================  ==========================================

Used in place, where the object is at hand (hot paths, or one call site), and
listed here so a torch upgrade checks them too: ``Module._parameters`` /
``_buffers`` / ``_non_persistent_buffers_set`` (the registration hooks, the
materialize install; public alternative: ``register_parameter``, which would
run the hooks again), ``Module._load_from_state_dict`` (the hook's
``load_state_dict(assign=True)`` warning), ``RNNBase._flat_weight_refs`` /
``_init_flat_weights`` and FSDP2's ``_get_fsdp_state()`` (materialize),
``untyped_storage()._cdata`` (the recorder's storage identity; public:
``data_ptr()``, which is 0 on meta), ``Tensor._cdata`` (a tensor's implementation,
which ``swap_tensors`` exchanges; ``recording/held.py``; public: none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._device as _device
from torch._C import (
    DisableTorchFunction,
    _disabled_torch_function_impl,
    _get_function_stack_at,
    _len_torch_function_stack,
    _VariableFunctions,
)
from torch.nn.modules import module as _torch_module
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode
from torch.utils._device import DeviceContext, _device_constructors

__all__ = [
    "DispatchKey",
    "DispatchKeySet",
    "all_registration_hooks",
    "dispatch_exclude_set",
    "dispatch_include_set",
    "dispatch_keys",
    "dispatch_mode_stack_depth",
    "force_dispatch_keys",
    "has_kernel_for",
    "neg_view",
    "DeviceContext",
    "DisableTorchFunction",
    "VariableFunctions",
    "clear_current_device",
    "current_device",
    "default_torch_function",
    "device_constructors",
    "global_device_context",
    "CURRENT_DEVICE_NAME",
    "UninitializedTensorMixin",
    "OpOverload",
    "OpOverloadPacket",
    "VARIABLE_FUNCTIONS_NAME",
    "local_shape_and_offset",
    "make_subclass",
    "mode_at",
    "mode_stack_depth",
    "pop_mode",
    "push_mode",
    "rebuild_meta_tensor_no_storage",
    "parse_to",
    "has_compatible_shallow_copy_type",
    "registration_hooks",
    "StorageRef",
    "storage_of",
    "torch_function_enabled",
    "set_global_device_context",
    "use_count",
]

DispatchKey: Any = torch._C.DispatchKey
DispatchKeySet: Any = torch._C.DispatchKeySet
force_dispatch_keys: Any = torch._C._ForceDispatchKeyGuard
has_kernel_for: Callable[[str, Any], bool] = torch._C._dispatch_has_kernel_for_dispatch_key
neg_view: Callable[[torch.Tensor], torch.Tensor] = torch._neg_view
push_mode = _push_mode
pop_mode = _pop_mode
mode_stack_depth = _len_torch_function_stack
mode_at: Callable[[int], TorchFunctionMode] = _get_function_stack_at
default_torch_function = _disabled_torch_function_impl
VariableFunctions = _VariableFunctions
device_constructors = _device_constructors
# torch builds this table once, from the torch functions of that moment: built while a
# library has replaced one (transformers' meta_device_safe_creation_ops, torch.linspace),
# it would hold the replacement for the life of the process, and torch.device(...) and
# include_buffers=True would no longer place that factory. Build it now, from torch's own.
_device_constructors()
make_subclass = torch.Tensor._make_subclass
UninitializedTensorMixin: type = torch.nn.parameter.UninitializedTensorMixin  # type: ignore[attr-defined]
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
rebuild_meta_tensor_no_storage: Callable[..., torch.Tensor] = (
    torch._utils._rebuild_meta_tensor_no_storage
)
parse_to: Callable[..., tuple] = torch._C._nn._parse_to
has_compatible_shallow_copy_type: Callable[..., bool] = torch._has_compatible_shallow_copy_type
# How doctor names what it reports and repairs.
CURRENT_DEVICE_NAME = "torch.utils._device.CURRENT_DEVICE"
VARIABLE_FUNCTIONS_NAME = "torch._C._VariableFunctions"

_HOOK_KINDS = ("parameter", "buffer", "module")


# The dispatch keys this thread adds to (include set) and removes from (exclude set) every
# call: autocast, inference mode, dispatch modes and functorch live there.
dispatch_include_set: Callable[[], Any] = torch._C._dispatch_tls_local_include_set
dispatch_exclude_set: Callable[[], Any] = torch._C._dispatch_tls_local_exclude_set


# Whether this thread runs torch-function handlers at all (DisableTorchFunction turns them
# off), and how many torch-dispatch modes it has pushed.
torch_function_enabled: Callable[[], bool] = torch._C._is_torch_function_enabled
dispatch_mode_stack_depth: Callable[[], int] = torch._C._len_torch_dispatch_stack


def dispatch_keys() -> tuple[Any, Any]:
    """This thread's (include set, exclude set)."""
    return dispatch_include_set(), dispatch_exclude_set()


class StorageRef:
    """A weak reference to a storage, keeping its address from reuse while it lives."""

    __slots__ = ("cdata",)
    # kept on the class: at interpreter shutdown __del__ may run after torch's globals go
    _expired: Any = staticmethod(torch.UntypedStorage._expired)
    _free: Any = staticmethod(torch.UntypedStorage._free_weak_ref)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.cdata: int = storage._weak_ref()  # type: ignore[assignment]

    def expired(self) -> bool:
        """Whether the storage is gone."""
        return self._expired(self.cdata)

    def __del__(self) -> None:
        self._free(self.cdata)


def storage_of(ref: StorageRef) -> torch.UntypedStorage | None:
    """The storage ``ref`` refers to, or None if it is gone."""
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


def registration_hooks(kind: str) -> dict[Any, Any]:
    """torch's dict of global ``kind`` (parameter, buffer, module) registration hooks."""
    return getattr(_torch_module, f"_global_{kind}_registration_hooks")


def all_registration_hooks() -> dict[str, dict[Any, Any]]:
    """Every global registration hook dict, by its full dotted name."""
    return {
        f"torch.nn.modules.module._global_{kind}_registration_hooks": registration_hooks(kind)
        for kind in _HOOK_KINDS
    }


def use_count(tensor: torch.Tensor) -> int:
    """How many C++ references hold ``tensor``'s implementation (swap_tensors needs 1-2)."""
    return tensor._use_count()  # type: ignore[attr-defined]


def current_device() -> Any:
    """The device a ``with torch.device(...)`` block set process-wide (None if none)."""
    return _device.CURRENT_DEVICE


def clear_current_device() -> None:
    _device.CURRENT_DEVICE = None


def global_device_context() -> DeviceContext | None:
    """The ``DeviceContext`` ``torch.set_default_device`` installed in this thread."""
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def set_global_device_context(context: DeviceContext | None) -> None:
    torch._GLOBAL_DEVICE_CONTEXT.device_context = context


def local_shape_and_offset(dtensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and global offset of this rank's shard of ``dtensor`` (no communication)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements
    )
    return tuple(shape), tuple(offset)


# Process-wide numeric settings (recording/settings.py): NNPACK's convolutions, oneDNN's
# kernels, oneDNN's deterministic mode, and the fp32 precision of a backend's op ("none":
# the next one up decides).
nnpack_enabled: Callable[[], bool] = torch._C._get_nnpack_enabled
mkldnn_enabled: Callable[[], bool] = torch._C._get_mkldnn_enabled
mkldnn_deterministic: Callable[[], bool] = torch._C._get_mkldnn_deterministic
fp32_precision: Callable[[str, str], str] = torch._C._get_fp32_precision_getter


@contextlib.contextmanager
def callers_modes_set_aside() -> Iterator[None]:
    """Run the block outside the thread's dispatch modes (``FakeTensorMode``, a logging
    ``TorchDispatchMode``) and functorch transforms (``torch.func.grad``, ``vmap``), all
    put back after it."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    from torch._ops import _len_torch_dispatch_stack_pre_dispatch
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        if dispatch_mode_stack_depth() or _len_torch_dispatch_stack_pre_dispatch():
            stack.enter_context(_disable_current_modes())
        if torch._C._functorch.peek_interpreter_stack() is not None:
            stack.enter_context(temporarily_clear_interpreter_stack())
        yield


# Whether a tensor is a functorch transform's wrapper (vmap's BatchedTensorImpl, grad's and
# jvp's TensorWrapper), whose storage cannot be read.
is_functorch_wrapped: Callable[[torch.Tensor], bool] = (
    torch._C._functorch.is_functorch_wrapped_tensor
)


def functorch_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a functorch transform's wrapper wraps, through every level."""
    while is_functorch_wrapped(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor
