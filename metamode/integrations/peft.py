"""Shim for PEFT's ``low_cpu_mem_usage`` path: ``init_empty_weights``, ``_init_on_device``
and ``_skip_init_on_device`` of ``peft.utils.integrations`` rebound to thread-scoped
contexts (docs/design.md; why a toggle is safe: docs/design.md, "Shims").
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import CodeType, FrameType
from typing import Any

import torch

from metamode._contexts.empty_weights import empty_weights, skip_empty_weights
from metamode._core.facts import register_meta_branch
from metamode._core.modes import EmptyWeights, SkipEmptyWeights, skipping_empty_weights
from metamode.integrations._rebind import _LOCK, SHARED, Rebinding, _tag_of
from metamode.integrations._registry import Integration, register

__all__ = ["disable_for_peft", "enable_for_peft"]


def init_empty_weights(include_buffers: bool | None = None) -> EmptyWeights:
    """metamode's replacement for ``peft.utils.integrations.init_empty_weights``.

    Records nothing (a load overwrites what it builds), unless it runs inside a
    ``metamode.empty_weights(replayable=True)`` block: then it joins that recording, and
    :func:`metamode.materialize` can give a new adapter the values
    ``low_cpu_mem_usage=False`` gives it.
    """
    return _shim_context(_include_buffers(include_buffers), torch.device("meta"), replayable=False)


def _include_buffers(value: bool | None) -> bool:
    """PEFT's ``include_buffers`` (None is False), checked like :func:`metamode.empty_weights`."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(
            f"include_buffers must be True, False or None, not {value!r} "
            f"({type(value).__name__}); a non-empty string such as 'no' would mean True"
        )
    return value


class _ShimEmptyWeights(EmptyWeights):
    """The context the shim's ``init_empty_weights`` and ``_init_on_device`` return.

    While the shim has stayed on since the block was entered, it is
    :func:`metamode.empty_weights`: the calling thread's only, blind to PEFT's process-wide
    ``_init_on_device._skip``. A block entered while the shim was off, or open across a
    ``disable_for_peft()``, runs around stock PEFT code again: from then on it also leaves
    where it is a parameter registered while PEFT's flag is True, as PEFT's own block would.
    """

    _entered_in: object | None = None  # the shim's on-period at entry; None: it was off

    def _after_enter(self) -> None:
        self._entered_in = SHARED.get(_ON_PERIOD)
        super()._after_enter()

    def _leaves_in_place(self, param: torch.nn.Parameter) -> bool:
        entered_in = self._entered_in
        if entered_in is not None and SHARED.get(_ON_PERIOD) is entered_in:
            return False
        return _peft_flag() is True


def _shim_context(include_buffers: bool, device: torch.device, replayable: bool) -> EmptyWeights:
    checked = empty_weights(include_buffers=include_buffers, device=device, replayable=replayable)
    return _ShimEmptyWeights(checked.device, checked.include_buffers, checked.replayable)


class _InitOnDevice:
    """metamode's replacement for ``peft.utils.integrations._init_on_device``.

    Called like PEFT's. Its ``_skip`` attribute is PEFT's function's: reads, writes and
    deletes go there, so stock code meets one flag whichever of the two functions it looks
    up, before, during and after a toggle, and reading it never raises. One read differs,
    in the reading thread only: PEFT's own parameter patch (a stock block opened before
    ``enable_for_peft()``) reads True while that thread is inside metamode's
    ``skip_empty_weights``, so the parameter stays where it is, as inside PEFT's own skip.
    """

    def __call__(self, device: torch.device, include_buffers: bool | None = None) -> EmptyWeights:
        return _shim_context(_include_buffers(include_buffers), device, replayable=False)

    def __getattr__(self, name: str) -> Any:
        if name != "_skip":
            raise AttributeError(name)
        reader = sys._getframe(1).f_code  # getattr's caller
        patch = any(reader is code for code in SHARED.get(_PATCH_CODE, ()))
        if patch and skipping_empty_weights():
            return True
        return _peft_flag()

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_skip":
            _writable_peft_function()._skip = value
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name == "_skip":
            vars(_writable_peft_function()).pop("_skip", None)
        else:
            object.__delattr__(self, name)

    def __repr__(self) -> str:
        return "<metamode's replacement for peft.utils.integrations._init_on_device>"


_init_on_device = _InitOnDevice()
# SHARED keys (kept in _rebind, so that a reload of this module keeps them):
_PEFT_FUNCTION = "peft: _init_on_device"  # PEFT's own function; never dropped
_PATCH_CODE = "peft: _init_on_device patch code"  # code of the functions defined in it
_ON_PERIOD = "peft: on-period"  # a new object per enable; absent while the shim is off


def _record_peft_function(originals: Mapping[str, Any]) -> None:
    """Before any name is rebound: so the replacement's ``_skip`` works from the moment
    stock code can find it, and keeps working in frames that hold it after a disable."""
    function = originals["_init_on_device"]
    SHARED[_PEFT_FUNCTION] = function
    code = getattr(getattr(function, "__wrapped__", function), "__code__", None)
    SHARED[_PATCH_CODE] = tuple(
        c for c in (code.co_consts if code else ()) if isinstance(c, CodeType)
    )


def _peft_function() -> Any | None:
    """PEFT's own ``_init_on_device``: the one enable recorded or, never enabled, the one
    PEFT's namespace still holds; None while PEFT is not imported."""
    function = SHARED.get(_PEFT_FUNCTION)
    if function is None:
        home = sys.modules.get(_PEFT.home_module)
        function = vars(home).get("_init_on_device") if home is not None else None
        if _tag_of(function) is not None:
            return None
    return function


def _peft_flag() -> Any:
    return getattr(_peft_function(), "_skip", False)


def _writable_peft_function() -> Any:
    function = _peft_function()
    if function is None:
        raise RuntimeError(
            "metamode's replacement for PEFT's _init_on_device cannot set _skip: "
            "peft.utils.integrations is not imported, so there is no PEFT flag to set; "
            "call metamode.enable_for_peft() first."
        )
    return function


def _skip_init_on_device() -> SkipEmptyWeights:
    """metamode's replacement for ``peft.utils.integrations._skip_init_on_device``.

    Suspends the calling thread's metamode contexts; PEFT's process-wide flag is left alone.
    """
    return skip_empty_weights()


_PEFT = Rebinding(
    package="peft",
    extra="peft",
    home_module="peft.utils.integrations",
    replacements={
        "init_empty_weights": init_empty_weights,
        "_init_on_device": _init_on_device,
        "_skip_init_on_device": _skip_init_on_device,
    },
    before_rebinding=_record_peft_function,
)


def enable_for_peft() -> tuple[str, ...]:
    """Make PEFT's ``low_cpu_mem_usage=True`` path thread-safe.

    Rebinds ``init_empty_weights``, ``_init_on_device`` and ``_skip_init_on_device`` in
    ``peft.utils.integrations`` and in every imported PEFT module that bound them by name,
    all at once under a lock. Safe before or after PEFT's submodules are imported, and more
    than once. LoRA weights are still created on ``meta`` and materialised by
    ``set_peft_model_state_dict(..., low_cpu_mem_usage=True)``.

    Toggling while another thread is inside PEFT is safe: no call raises, PEFT's
    ``_init_on_device._skip`` ends where stock PEFT would leave it, and a block open
    across the toggle places parameters as stock PEFT would, except in one case. A
    parameter registered inside a stock PEFT block opened before the enable, inside a
    metamode skip (PEFT's ``_skip_init_on_device`` while the shim is on), after a
    ``disable_for_peft()`` has finished, goes to meta where stock would leave it (AdaLoRA's
    ``ranknum``): PEFT's patch then reads only its own process-wide flag, which metamode's
    skip leaves alone so that it cannot reach other threads.

    Returns the rebound ``module.name`` bindings.

    Raises:
        ImportError: PEFT is not installed (``pip install 'metamode[peft]'``).
        metamode.IncompatibleLibraryError: this PEFT lacks one of those names;
            nothing was changed.
    """
    with _LOCK:
        was_on = _PEFT.enabled
        bound = _PEFT.enable()
        if not was_on:
            SHARED[_ON_PERIOD] = object()
        return bound


def disable_for_peft() -> tuple[str, ...]:
    """Restore PEFT's original functions everywhere the shim put its own.

    A replacement a frame already holds keeps working: its contexts stay metamode's (and
    honour PEFT's flag from now on, as stock's would), its ``_skip`` stays PEFT's flag.
    What a toggle cannot make right: :func:`enable_for_peft`.

    Returns the restored bindings (empty if the shim was not enabled).
    """
    with _LOCK:
        SHARED.pop(_ON_PERIOD, None)
        return _PEFT.disable()


def peft_enabled() -> bool:
    return _PEFT.enabled


register(Integration("peft", enable_for_peft, disable_for_peft, peft_enabled))


def _codes(*sites: tuple[str, str]) -> list[CodeType]:
    """The code of each ``(module, Class.function)`` or ``(module, function)`` of PEFT's
    that is imported."""
    found = []
    for module_name, qualname in sites:
        function: Any = sys.modules.get(module_name)
        for name in qualname.split("."):
            function = getattr(function, name, None)
        code = getattr(function, "__code__", None)
        if code is not None:
            found.append(code)
    return found


def _branching_on_meta() -> list[CodeType]:
    """PEFT functions that build an adapter otherwise when its tensors are on meta."""
    return _codes(
        ("peft.tuners.lora.layer", "LoraLayer.mica_init"),
        ("peft.tuners.lora.layer", "Embedding.mica_init"),
        ("peft.tuners.lora.variants", "MontecloraLinearVariant.init"),
        ("peft.tuners.lora.variants", "KasaLinearVariant.init"),
        ("peft.tuners.delora.layer", "DeloraLayer.reset_delora_parameters"),
    )


register_meta_branch(
    _branching_on_meta,
    "PEFT initialises this adapter otherwise when its tensors are on the meta device "
    "(MiCA and KaSA skip their SVD, MonteCLoRA defers its sampler, DeLoRA takes ones for "
    "the base weight's norms): create it with low_cpu_mem_usage=False",
)


def _eva_loading() -> list[CodeType]:
    """EVA's loader, which makes an adapter again (``update_layer``, drawing its
    initialisation anew) where it changes the adapter's rank or the adapter is on meta."""
    return _codes(("peft.tuners.lora.eva", "_load_eva_state_dict"))


def _eva_rank_kept(frame: FrameType) -> bool:
    """Whether EVA keeps the adapter's rank here, so that only the meta device makes it
    make the adapter again."""
    names = frame.f_locals
    if "new_rank" not in names or "r" not in names:
        return True  # not the code this was written against: refuse
    return bool(names["new_rank"] == names["r"])


register_meta_branch(
    _eva_loading,
    "PEFT's EVA makes an adapter on the meta device again (drawing its initialisation anew, "
    "which shifts every later draw), where eager construction keeps it: call "
    "initialize_lora_eva_weights after materialize",
    _eva_rank_kept,
)


def _moving_to_the_base_layer() -> list[CodeType]:
    """The ``any(p.device == meta ...)`` of PEFT's ``_move_adapter_to_device_of_base_layer``,
    which leaves an adapter on meta where it is, uncast to the base layer's dtype."""
    return [
        const
        for code in _codes(
            ("peft.tuners.tuners_utils", "BaseTunerLayer._move_adapter_to_device_of_base_layer"),
            ("peft.tuners.lora.layer", "ParamWrapper._move_adapter_to_device_of_base_layer"),
        )
        for const in code.co_consts
        if isinstance(const, CodeType) and const.co_name == "<genexpr>"
    ]


def _cast_skipped(frame: FrameType) -> bool:
    """Whether the adapter the move skips on meta is in another floating dtype than eager's
    move would cast it to (the base layer's)."""
    outer = frame.f_back
    names = outer.f_locals if outer is not None else {}
    if "target_dtype" in names:  # BaseTunerLayer's
        dtype = names["target_dtype"]
    else:  # ParamWrapper's: the wrapped parameter's
        param = names.get("param")
        dtype = getattr(param, "dtype", None)
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            dtype = None
    layer, adapter = names.get("adapter_layer"), names.get("adapter_name")
    if layer is None or adapter not in layer:
        return True  # not the code this was written against: refuse
    if dtype is None:
        return False  # eager casts nothing
    item = layer[adapter]
    tensors = [item] if isinstance(item, torch.Tensor) else [*item.parameters(), *item.buffers()]
    return any(
        (t.dtype.is_floating_point or t.dtype.is_complex) and t.dtype != dtype for t in tensors
    )


register_meta_branch(
    _moving_to_the_base_layer,
    "PEFT leaves an adapter on the meta device in the dtype it was made in, where eager "
    "construction casts it to the base layer's dtype (its values rounded to it): create it "
    "with low_cpu_mem_usage=False, or build the base layer in the adapter's dtype and cast "
    "the model after materialize",
    _cast_skipped,
)


def _frod_device_and_dtype() -> list[CodeType]:
    """FRoD's functions that skip its adapter parameters on meta when they choose the device
    and dtype of new adapters, and when they move and cast adapters to the base layer's."""
    return _codes(
        ("peft.tuners.frod.layer", "Linear._get_existing_adapter_device_dtype"),
        ("peft.tuners.frod.layer", "Linear._move_adapter_to_device_of_base_layer"),
    )


def _frod_dtypes_differ(frame: FrameType) -> bool:
    """Whether the FRoD layer's base weight and adapter parameters are in more than one
    floating dtype: with one, skipping those on meta changes no dtype eager would pick or
    cast to."""
    layer = frame.f_locals.get("self")
    names = getattr(layer, "adapter_layer_names", None)
    if layer is None or names is None or not hasattr(layer, "get_base_layer"):
        return True  # not the code this was written against: refuse
    base = getattr(layer.get_base_layer(), "weight", None)
    tensors = [base] if isinstance(base, torch.Tensor) else []
    for name in names:
        table = getattr(layer, name, None)
        if isinstance(table, torch.nn.ParameterDict):
            tensors += table.values()
    return len({t.dtype for t in tensors if t.dtype.is_floating_point or t.dtype.is_complex}) > 1


register_meta_branch(
    _frod_device_and_dtype,
    "FRoD leaves an adapter on the meta device out of its choice of dtype, where eager "
    "construction picks the dtype of an existing adapter and casts to the base layer's: "
    "create it with low_cpu_mem_usage=False, or build the base layer and every adapter in "
    "one dtype and cast the model after materialize",
    _frod_dtypes_differ,
)
