"""Shim for transformers' model-building contexts, 4.x and 5.x.

5.x: rebinds ``transformers.initialization.meta_device_safe_creation_ops`` and
``no_tie_weights``, whichever exist, the device probe, and holds the default dtype in dtype
windows (``modeling_utils.local_torch_dtype`` and ``_get_dtype``,
``PreTrainedModel._from_config``, and ``_initialize_missing_keys``, which a load runs after its
build); sets ``PreTrainedModel.initialize_weights`` to run under a thread-scoped guard. 4.x (no
``initialization`` module): rebinds ``modeling_utils.no_init_weights`` and ``_init_weights``,
``integrations.accelerate.init_empty_weights``/``init_on_device``, and sets
``PreTrainedModel``'s ``_set_default_dtype``, ``from_pretrained`` and ``_from_config`` to hold
the dtype as a dtype window. What each stock context does and why these names:
docs/design.md, "transformers versions" and "Dtype windows"; what stays process-global:
docs/limitations.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
import weakref
from collections.abc import Iterator, Mapping
from types import CodeType, FrameType, FunctionType
from typing import Any

import torch

from metamode._contexts.empty_weights import init_on_device as _init_on_device
from metamode._contexts.empty_weights import skip_empty_weights
from metamode._core import dtype_windows
from metamode._core import stack as _stack
from metamode._core.facts import (
    register_device_probe,
    register_meta_branch,
    register_stand_in,
)
from metamode._core.modes import (
    EmptyWeights,
    KeepRegistered,
    ThreadScopedMode,
    active_empty_weights,
)
from metamode.integrations._dtype_windows import (
    closing_windows,
    requested_dtype,
    set_default_in_a_window,
)
from metamode.integrations._exact_skip import (
    GuardLoadedTensors,
    SkipLibraryInit,
    library_init_names,
)
from metamode.integrations._rebind import (
    _LOCK,
    SHARED,
    ClassAttributeRebinding,
    IncompatibleLibraryError,
    Rebinding,
)
from metamode.integrations._registry import Integration, register

_MODELING_UTILS = "transformers.modeling_utils"
__all__ = ["disable_for_transformers", "enable_for_transformers"]


class LinspaceOnCpu(ThreadScopedMode):
    """``torch.linspace`` without ``device=`` makes cpu tensors, in this thread.

    transformers' ``meta_device_safe_creation_ops`` (same rule: only when ``device`` is not
    passed at all) without assigning ``torch.linspace``.
    """

    def __repr__(self) -> str:
        return "metamode.integrations.transformers.LinspaceOnCpu()"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._inert:
            return func(*args, **kwargs)
        if func is torch.linspace and "device" not in kwargs:
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def meta_device_safe_creation_ops() -> LinspaceOnCpu:
    """metamode's replacement for ``transformers.initialization.meta_device_safe_creation_ops``."""
    return LinspaceOnCpu()


_TRANSFORMERS = Rebinding(
    package="transformers",
    extra="transformers",
    home_module="transformers.initialization",
    replacements={"meta_device_safe_creation_ops": meta_device_safe_creation_ops},
)


class NoTieWeights(KeepRegistered):
    """transformers' ``no_tie_weights``, in the calling thread only.

    While this mode is on the thread's stack, an assignment made by the body of
    ``PreTrainedModel.tie_weights`` (a frame running ``code``, the code object modeling_utils
    defined it with, is on the calling stack) keeps the parameter or buffer the module
    already holds, so every tie is undone as it is made and the model keeps the separate
    parameters stock's no-op leaves it. Overrides of ``tie_weights`` in model classes run as
    under stock: ties they make themselves are kept, their ``super().tie_weights()`` is not.
    With ``code`` None nothing is kept. Remaining differences from stock's no-op:
    docs/limitations.md.
    """

    def __init__(self, code: CodeType | None) -> None:
        super().__init__()
        self.code = code

    def _settings(self) -> tuple:
        return (self.code,)

    def __repr__(self) -> str:
        return "metamode.integrations.transformers.NoTieWeights()"

    def keeps(self, module, name, value) -> bool:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code is self.code:
                return True
            frame = frame.f_back
        return False


# PreTrainedModel -> the code of the tie_weights modeling_utils defined on it, taken the
# first time the class held that function (a stock no_tie_weights puts its no-op there).
_TIE_WEIGHTS_CODE: weakref.WeakKeyDictionary[type, CodeType] = weakref.WeakKeyDictionary()


def _tie_weights_code() -> CodeType | None:
    """The code object of modeling_utils' ``PreTrainedModel.tie_weights``; None while
    modeling_utils is not imported, or while its class has held another function every
    time this was asked."""
    pretrained = getattr(sys.modules.get(_MODELING_UTILS), "PreTrainedModel", None)
    if not isinstance(pretrained, type):
        return None
    function = vars(pretrained).get("tie_weights")
    if callable(function):
        function = inspect.unwrap(function)
    if (
        isinstance(function, FunctionType)
        and function.__module__ == _MODELING_UTILS
        and function.__qualname__ == "PreTrainedModel.tie_weights"
    ):
        _TIE_WEIGHTS_CODE.setdefault(pretrained, function.__code__)
    return _TIE_WEIGHTS_CODE.get(pretrained)


def no_tie_weights() -> NoTieWeights:
    """metamode's replacement for ``transformers.initialization.no_tie_weights``."""
    return NoTieWeights(_tie_weights_code())


_TRANSFORMERS_TIES = Rebinding(
    package="transformers",
    extra="transformers",
    home_module="transformers.initialization",
    replacements={"no_tie_weights": no_tie_weights},
)


class InitWeightsFlag:
    """transformers 4.x's ``modeling_utils._init_weights``, one value per thread.

    ``if _init_weights:`` is False while this thread's stack holds an active
    :class:`NoInitWeights`, else ``default`` (the value the module held when
    the shim was enabled). Derived from the stack, so no exit order can leave
    it wrong.
    """

    def __init__(self, default: bool) -> None:
        self.default = default

    def __bool__(self) -> bool:
        return self.default and _stack.innermost(NoInitWeights, skip_inert=True) is None

    def __repr__(self) -> str:
        return f"<metamode per-thread transformers _init_weights: {bool(self)} in this thread>"


class NoInitWeights(SkipLibraryInit):
    """transformers 4.x's ``no_init_weights``, in the calling thread only
    (``_init_weights`` reads False meanwhile: :class:`InitWeightsFlag`)."""

    def __repr__(self) -> str:
        return "metamode.integrations.transformers.NoInitWeights()"


def init_empty_weights(include_buffers: bool = False) -> EmptyWeights:
    """Replaces transformers 4.x ``integrations.accelerate.init_empty_weights``."""
    return _init_on_device(torch.device("meta"), include_buffers)


def init_on_device(device: torch.device, include_buffers: bool = False) -> EmptyWeights:
    """metamode's replacement for transformers 4.x ``integrations.accelerate.init_on_device``."""
    return _init_on_device(device, include_buffers)


_TRANSFORMERS_4_EMPTY = Rebinding(
    package="transformers",
    extra="transformers",
    home_module="transformers.integrations.accelerate",
    replacements={"init_empty_weights": init_empty_weights, "init_on_device": init_on_device},
)

_LEFT_ALONE = "left alone: transformers"  # SHARED key: why enable returned ()
_FLAG = "transformers: _init_weights flag"  # SHARED key


def no_init_weights() -> NoInitWeights:
    """metamode's replacement for transformers 4.x ``modeling_utils.no_init_weights``."""
    return NoInitWeights(library_init_names(sys.modules[_MODELING_UTILS]))


_TRANSFORMERS_4 = Rebinding(
    package="transformers",
    extra="transformers",
    home_module=_MODELING_UTILS,
    replacements={"no_init_weights": no_init_weights},
)


@contextlib.contextmanager
def local_torch_dtype(dtype: torch.dtype, model_class_name: str | None = None) -> Iterator[None]:
    """metamode's replacement for ``transformers.modeling_utils.local_torch_dtype``: the
    same check, then ``dtype`` as the process default in a dtype window
    (:mod:`metamode._core.dtype_windows`) instead of a capture and restore."""
    if not dtype.is_floating_point:
        if model_class_name is not None:
            message = (
                f"{model_class_name} cannot be instantiated under `dtype={dtype}` as it's not "
                f"a floating-point dtype"
            )
        else:
            message = f"Cannot set `{dtype}` as torch's default as it's not a floating-point dtype"
        raise ValueError(message)
    with dtype_windows.dtype_window(dtype):
        yield


_TRANSFORMERS_DTYPE = Rebinding(
    package="transformers",
    extra="transformers",
    home_module=_MODELING_UTILS,
    replacements={"local_torch_dtype": local_torch_dtype},
)


_GET_DTYPE_ORIGINAL = "transformers: _get_dtype"  # SHARED key: transformers' own function


def _get_dtype(dtype: Any, *args: Any, **kwargs: Any) -> Any:
    """metamode's replacement for ``transformers.modeling_utils._get_dtype``: transformers'
    function, given the default a lone load sees (:func:`dtype_windows.default_for_this_thread`)
    where it would read ``torch.get_default_dtype()`` outside any window of the loading
    thread: for ``dtype=None`` and for a dict without the ``""`` key."""
    if dtype is None:
        dtype = dtype_windows.default_for_this_thread()
    elif isinstance(dtype, dict) and "" not in dtype:
        dtype = {**dtype, "": dtype_windows.default_for_this_thread()}
    return SHARED[_GET_DTYPE_ORIGINAL](dtype, *args, **kwargs)


def _keep_get_dtype(originals: Mapping[str, Any]) -> None:
    SHARED[_GET_DTYPE_ORIGINAL] = originals["_get_dtype"]


_TRANSFORMERS_GET_DTYPE = Rebinding(
    package="transformers",
    extra="transformers",
    home_module=_MODELING_UTILS,
    replacements={"_get_dtype": _get_dtype},
    before_rebinding=_keep_get_dtype,
)


def _from_config_in_a_window(originals: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5 ``PreTrainedModel._from_config``: a call given no dtype (none passed,
    none on the config) builds in the process default, so it runs in a window of the
    default a lone call sees."""
    method = originals["_from_config"]
    raw = getattr(method, "__func__", None)
    if not isinstance(method, classmethod) or not isinstance(raw, FunctionType):
        raise IncompatibleLibraryError(
            f"transformers {_TRANSFORMERS._version()}: PreTrainedModel._from_config is not a "
            f"classmethod, so metamode cannot hold its dtype as a window; nothing was changed. "
            f"Please report this with the version."
        )

    return {
        "_from_config": closing_windows(
            raw, lambda *args, **kwargs: _requested_config_dtype(*args, **kwargs) is None
        )
    }


_TRANSFORMERS_FROM_CONFIG = ClassAttributeRebinding(
    package="transformers",
    extra="transformers",
    home_module=_MODELING_UTILS,
    class_name="PreTrainedModel",
    names=("_from_config",),
    make_replacements=_from_config_in_a_window,
)


def _unguarded(initialize_weights: Any) -> Any:
    """The function ``@torch.no_grad()`` and ``@init.guard_torch_init_functions()`` wrap
    in ``PreTrainedModel.initialize_weights``; ``IncompatibleLibraryError`` if the
    attribute is not built that way."""
    initialization = sys.modules["transformers.initialization"]
    guard = inspect.unwrap(vars(initialization)["guard_torch_init_functions"])
    guarded = getattr(initialize_weights, "__wrapped__", None)
    raw = getattr(guarded, "__wrapped__", None)
    cells = [c.cell_contents for c in getattr(guarded, "__closure__", None) or ()]
    outer = [c.cell_contents for c in getattr(initialize_weights, "__closure__", None) or ()]
    if not (
        isinstance(raw, FunctionType)
        and any(getattr(c, "func", None) is guard for c in cells)
        and any(isinstance(getattr(c, "__self__", None), torch.no_grad) for c in outer)
    ):
        raise IncompatibleLibraryError(
            f"transformers {_TRANSFORMERS._version()}: PreTrainedModel.initialize_weights is "
            f"not @torch.no_grad() over @init.guard_torch_init_functions(), so metamode "
            f"cannot run it with a thread-scoped guard; nothing was changed. Please report "
            f"this with the version."
        )
    return raw


def _thread_scoped_guard(originals: Mapping[str, Any]) -> dict[str, Any]:
    raw = _unguarded(originals["initialize_weights"])
    initialization = sys.modules["transformers.initialization"]
    names = library_init_names(initialization)
    modules = tuple(initialization.TORCH_MODULES_TO_PATCH)

    @functools.wraps(raw)
    def initialize_weights(self: Any) -> Any:
        with torch.no_grad(), GuardLoadedTensors(names, modules):
            return raw(self)

    return {"initialize_weights": initialize_weights}


def _initialization_in_a_window(originals: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5 ``PreTrainedModel._initialize_missing_keys``: ``from_pretrained``
    initialises what the checkpoint lacks after its build's window closed, where a lone load
    sees the default restored (XGLM's, M2M100's and NLLB-MoE's ``_init_weights`` read it), so
    it runs in a window of that default."""
    method = originals["_initialize_missing_keys"]
    if not isinstance(method, FunctionType):
        raise IncompatibleLibraryError(
            f"transformers {_TRANSFORMERS._version()}: PreTrainedModel._initialize_missing_keys "
            f"is not a plain method, so metamode cannot hold its dtype as a window; nothing was "
            f"changed. Please report this with the version."
        )

    @functools.wraps(method)
    def _initialize_missing_keys(self: Any, *args: Any, **kwargs: Any) -> Any:
        with dtype_windows.dtype_window(dtype_windows.default_for_this_thread()):
            return method(self, *args, **kwargs)

    return {"_initialize_missing_keys": _initialize_missing_keys}


_TRANSFORMERS_INITIALIZATION = ClassAttributeRebinding(
    package="transformers",
    extra="transformers",
    home_module=_MODELING_UTILS,
    class_name="PreTrainedModel",
    names=("_initialize_missing_keys",),
    make_replacements=_initialization_in_a_window,
)


_TRANSFORMERS_GUARD = ClassAttributeRebinding(
    package="transformers",
    extra="transformers",
    home_module=_MODELING_UTILS,
    class_name="PreTrainedModel",
    names=("initialize_weights",),
    make_replacements=_thread_scoped_guard,
)


def _initializes_after_the_build() -> bool:
    modeling_utils = importlib.import_module(_MODELING_UTILS)
    return "_initialize_missing_keys" in vars(modeling_utils.PreTrainedModel)


def _guards_torch_init() -> bool:
    initialization = importlib.import_module("transformers.initialization")
    return "guard_torch_init_functions" in vars(initialization)


def _without_restore(method: Any, name: str) -> FunctionType:
    """The function transformers 4.x's ``@restore_default_dtype`` wraps in ``method``
    (a classmethod); ``IncompatibleLibraryError`` if it does not."""
    restore = vars(sys.modules[_MODELING_UTILS]).get("restore_default_dtype")
    wrapper = getattr(method, "__func__", None)
    raw = getattr(wrapper, "__wrapped__", None)
    if not (
        callable(restore)
        and isinstance(raw, FunctionType)
        and getattr(wrapper, "__code__", None) is getattr(restore(raw), "__code__", ())
    ):
        raise IncompatibleLibraryError(
            f"transformers {_TRANSFORMERS._version()}: PreTrainedModel.{name} is not a "
            f"classmethod over @restore_default_dtype, so metamode cannot hold its "
            f"dtype as a window; nothing was changed. Please report this with the version."
        )
    return raw


def _dtype_window_methods_4(originals: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 4.x ``PreTrainedModel``: ``_set_default_dtype`` opens a dtype window;
    ``from_pretrained`` and ``_from_config`` close the windows they opened when they return
    or raise (instead of ``@restore_default_dtype``'s capture and restore). A call given no
    dtype builds in the process default: it runs in a window of the default a lone load
    sees."""
    return {
        "_set_default_dtype": set_default_in_a_window(
            originals["_set_default_dtype"].__func__, _MODELING_UTILS
        ),
        "from_pretrained": closing_windows(
            _without_restore(originals["from_pretrained"], "from_pretrained"),
            lambda *args, **kwargs: requested_dtype(**kwargs) is None,
        ),
        "_from_config": closing_windows(
            _without_restore(originals["_from_config"], "_from_config"),
            lambda *args, **kwargs: _requested_config_dtype(*args, **kwargs) is None,
        ),
    }


def _requested_config_dtype(config: Any = None, **kwargs: Any) -> Any:
    """The dtype ``_from_config(config, **kwargs)`` builds in, None for the process default
    (stock's resolution: ``dtype=``, else the config's, overridden by ``torch_dtype=``)."""
    config_dtype = getattr(config, "dtype", None)
    dtype = kwargs.get("dtype", config_dtype)
    torch_dtype = kwargs.get("torch_dtype")
    if torch_dtype is not None and dtype == config_dtype:
        dtype = torch_dtype
    return dtype


_TRANSFORMERS_4_DTYPE = ClassAttributeRebinding(
    package="transformers",
    extra="transformers",
    home_module=_MODELING_UTILS,
    class_name="PreTrainedModel",
    names=("_set_default_dtype", "from_pretrained", "_from_config"),
    make_replacements=_dtype_window_methods_4,
)


_PROBE = "get_torch_context_manager_or_global_device"
_PROBE_ORIGINAL = "transformers: device probe"  # SHARED key: transformers' own function


def get_torch_context_manager_or_global_device() -> torch.device | None:
    """metamode's replacement for ``transformers.modeling_utils.``
    ``get_torch_context_manager_or_global_device``: transformers' answer, except in a
    replayable ``empty_weights(include_buffers=True)`` context, where it is the answer
    eager construction gets (no meta device), so the build runs transformers' weight
    initialisation as eager construction does and ``materialize`` can replay it."""
    original = SHARED[_PROBE_ORIGINAL]
    context = active_empty_weights()
    if context is not None and context.replayable and context.include_buffers:
        with skip_empty_weights():
            return original()
    return original()


_TRANSFORMERS_PROBE = Rebinding(
    package="transformers",
    extra="transformers",
    home_module=_MODELING_UTILS,
    replacements={_PROBE: get_torch_context_manager_or_global_device},
)

# transformers 5: each is enabled when its names exist in its home module.
_REBINDINGS_5 = (
    _TRANSFORMERS,
    _TRANSFORMERS_TIES,
    _TRANSFORMERS_PROBE,
    _TRANSFORMERS_DTYPE,
    _TRANSFORMERS_GET_DTYPE,
)


def _has_initialization_module() -> bool:
    try:
        return importlib.util.find_spec("transformers.initialization") is not None
    except ModuleNotFoundError:
        return False


def _enable_4() -> tuple[str, ...]:
    module = _TRANSFORMERS_4._import_home()
    missing = [n for n in ("TORCH_INIT_FUNCTIONS", "_init_weights") if n not in vars(module)]
    if missing:
        raise IncompatibleLibraryError(
            f"transformers {_TRANSFORMERS_4._version()} has neither transformers.initialization "
            f"nor {', '.join(missing)} in {_MODELING_UTILS}; metamode's shim cannot route "
            f"its model-building contexts safely, so nothing was changed."
        )
    if vars(module)["_init_weights"] is False:
        raise RuntimeError(
            f"transformers' own no_init_weights() is open in some thread "
            f"({_MODELING_UTILS}._init_weights is False): its exit would put a plain bool back "
            f"over metamode's per-thread flag. Enable metamode at start-up, before any model "
            f"is loaded, or when no load is in progress; nothing was changed."
        )
    bound = _TRANSFORMERS_4.enable()
    try:
        bound += _TRANSFORMERS_4_EMPTY.enable()
        try:
            bound += _TRANSFORMERS_4_DTYPE.enable()
        except BaseException:
            _TRANSFORMERS_4_EMPTY.disable()
            raise
    except BaseException:
        _TRANSFORMERS_4.disable()
        raise
    namespace = vars(module)
    current = namespace["_init_weights"]
    if not isinstance(current, InitWeightsFlag):
        flag = InitWeightsFlag(bool(current))  # True: refused above while a stock block is open
        SHARED[_FLAG] = flag
        namespace["_init_weights"] = flag
    return (*bound, f"{_MODELING_UTILS}._init_weights")


def _disable_4() -> tuple[str, ...]:
    restored = [
        *_TRANSFORMERS_4.disable(),
        *_TRANSFORMERS_4_EMPTY.disable(),
        *_TRANSFORMERS_4_DTYPE.disable(),
    ]
    module = sys.modules.get(_MODELING_UTILS)
    flag = SHARED.pop(_FLAG, None)
    if module is not None and isinstance(vars(module).get("_init_weights"), InitWeightsFlag):
        vars(module)["_init_weights"] = flag.default if flag is not None else True
        restored.append(f"{_MODELING_UTILS}._init_weights")
    return tuple(sorted(restored))


def enable_for_transformers() -> tuple[str, ...]:
    """Make transformers' model-building contexts thread-scoped where they can be.

    transformers 5: rebinds ``transformers.initialization.meta_device_safe_creation_ops``
    and ``no_tie_weights``, where they exist, to contexts acting in the calling thread only
    (device-less ``torch.linspace`` calls go to cpu; ``PreTrainedModel.tie_weights`` does
    not tie); ``modeling_utils.local_torch_dtype`` to a dtype window (loads in one dtype
    share the process default, loads in another wait their turn) and ``_get_dtype`` (a
    per-module dtype dict without ``""`` gets the default a lone load sees);
    ``get_torch_context_manager_or_global_device`` to answer as eager construction does
    inside a replayable ``include_buffers=True`` context; and sets the attributes
    ``PreTrainedModel.initialize_weights`` to transformers' own function run under
    ``torch.no_grad()`` and a thread-scoped guard that leaves loaded tensors as stock's
    ``guard_torch_init_functions`` does, without reassigning ``torch.nn.init``, and
    ``_from_config`` and ``_initialize_missing_keys`` to run in a dtype window. A 5.x with
    none of the context names, ``local_torch_dtype`` and ``guard_torch_init_functions`` is
    left alone: returns ``()`` and says why in ``EnableResult.left_alone``.

    transformers 4.x: rebinds ``modeling_utils.no_init_weights`` and ``_init_weights`` and
    ``integrations.accelerate.init_empty_weights``/``init_on_device`` to thread-scoped
    equivalents that build exactly the stock model, and sets ``PreTrainedModel``'s
    ``_set_default_dtype``, ``from_pretrained`` and ``_from_config`` to hold the dtype as a
    dtype window.

    Either way, with the accelerate shim, concurrent ``from_pretrained`` calls in any mix
    of dtypes each build the model a lone load builds (docs/design.md, "Dtype windows").

    Atomic, under a lock; idempotent. Returns the rebound ``module.name`` bindings.

    Raises:
        ImportError: transformers is not installed.
        metamode.IncompatibleLibraryError: this transformers lacks the names
            for either major version, or its ``initialize_weights``,
            ``from_pretrained``, ``_from_config`` or ``_initialize_missing_keys`` is not
            built as the shim expects; nothing was changed.
    """
    with _LOCK:
        SHARED.pop(_LEFT_ALONE, None)
        if _TRANSFORMERS_4.enabled or not _has_initialization_module():
            return _enable_4()
        rebindings = [
            r for r in _REBINDINGS_5 if set(r.replacements) <= set(vars(r._import_home()))
        ]
        routing = [r for r in rebindings if r not in (_TRANSFORMERS_PROBE, _TRANSFORMERS_GET_DTYPE)]
        if not routing and not _guards_torch_init():
            # A 5.x release with none of the patches: nothing to route, not an error.
            SHARED[_LEFT_ALONE] = (
                f"transformers {_TRANSFORMERS._version()} has none of "
                f"initialization.meta_device_safe_creation_ops (no torch.linspace patch), "
                f"initialization.no_tie_weights, initialization.guard_torch_init_functions "
                f"and modeling_utils.local_torch_dtype, and no 4.x no_init_weights: "
                f"nothing for metamode to route"
            )
            return ()
        bound: list[str] = []
        done: list[Rebinding] = []
        if _TRANSFORMERS_PROBE in rebindings and not _TRANSFORMERS_PROBE.enabled:
            SHARED[_PROBE_ORIGINAL] = vars(_TRANSFORMERS_PROBE._import_home())[_PROBE]
        try:
            for rebinding in rebindings:
                bound += rebinding.enable()
                done.append(rebinding)
            if _TRANSFORMERS_DTYPE in rebindings:
                bound += _TRANSFORMERS_FROM_CONFIG.enable()
                if _initializes_after_the_build():
                    bound += _TRANSFORMERS_INITIALIZATION.enable()
            if _guards_torch_init():
                bound += _TRANSFORMERS_GUARD.enable()
        except BaseException:
            _TRANSFORMERS_INITIALIZATION.disable()
            _TRANSFORMERS_FROM_CONFIG.disable()
            for rebinding in reversed(done):
                rebinding.disable()
            raise
        return tuple(sorted(bound))


def disable_for_transformers() -> tuple[str, ...]:
    """Restore transformers' function everywhere the shim put its own.

    Returns the restored bindings (empty if the shim was not enabled).
    """
    with _LOCK:
        restored = [
            r.disable()
            for r in (
                *_REBINDINGS_5,
                _TRANSFORMERS_FROM_CONFIG,
                _TRANSFORMERS_INITIALIZATION,
                _TRANSFORMERS_GUARD,
            )
        ]
        return tuple(sorted((*(b for r in restored for b in r), *_disable_4())))


def transformers_enabled() -> bool:
    return (
        any(r.enabled for r in _REBINDINGS_5)
        or _TRANSFORMERS_GUARD.enabled
        or _TRANSFORMERS_FROM_CONFIG.enabled
        or _TRANSFORMERS_INITIALIZATION.enabled
        or _TRANSFORMERS_4.enabled
    )


register(
    Integration(
        "transformers", enable_for_transformers, disable_for_transformers, transformers_enabled
    )
)


def _device_probe() -> list[CodeType]:
    probe = getattr(sys.modules.get(_MODELING_UTILS), _PROBE, None)
    if _TRANSFORMERS_PROBE.enabled:  # the shim's replacement shows it eager's device
        probe = SHARED.get(_PROBE_ORIGINAL, probe)
    code = getattr(probe, "__code__", None)
    return [code] if code is not None else []


register_device_probe(_device_probe)
register_meta_branch(
    _device_probe,
    "transformers skipped its weight initialisation because it saw the meta device, which "
    "eager construction does not; build in empty_weights(replayable=True), where its device "
    "probe sees what eager construction sees",
)


def _init_wrapper(func: object) -> bool:
    return getattr(func, "__module__", None) == "transformers.initialization"


def _runs_torch_init(args: tuple, kwargs: dict) -> bool:
    """transformers' init functions skip a tensor marked ``_is_hf_initialized``."""
    tensor = args[0] if args else kwargs.get("tensor")
    return not getattr(tensor, "_is_hf_initialized", False)


register_stand_in(_init_wrapper, _runs_torch_init)
