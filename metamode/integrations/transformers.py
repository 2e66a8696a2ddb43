"""Route what transformers' model-building contexts can safely give up through metamode.

``PreTrainedModel.from_pretrained`` (transformers 5) builds the model inside
the contexts listed by ``get_init_context``, and every one of them changes
process-global state. Two can be made thread-scoped without changing what
the model comes out as; transformers looks both up at call time
(``init.meta_device_safe_creation_ops()``, ``init.no_tie_weights()``), so the
shim rebinds the names in ``transformers.initialization``:

* ``meta_device_safe_creation_ops()`` assigns a wrapper to ``torch.linspace``
  (every thread's ``linspace`` defaults to cpu meanwhile, and overlapping
  loads can leave the wrapper in place). Rebound to a mode doing the same for
  the calling thread only.
* ``no_tie_weights()`` assigns ``PreTrainedModel.tie_weights`` a no-op and
  restores what it captured: two overlapping loads (A enters, B enters, A
  exits, B exits) leave the no-op on the class, and every tied model loaded
  afterwards keeps ``lm_head.weight`` on meta, untied. Rebound to
  :class:`NoTieWeights`: ``PreTrainedModel.tie_weights`` ties by
  ``setattr(parent, name, source_param)``, which registers the parameter
  through torch's global registration hooks; while the mode is on the calling
  thread's stack, metamode's hooks keep the tensor the module already holds
  when the assignment comes from ``tie_weights``'s body. The model is built
  exactly as stock's no-op leaves it (``tests/unit/integrations/test_transformers_ties.py``
  compares both, and ``from_pretrained`` with and without the shim); after
  loading, transformers ties again, outside the context.

The shim rebinds whichever of the two names the installed 5.x has (5.23 and
5.24 have both, with the same code) and leaves transformers alone, saying so
in ``EnableResult.left_alone``, when it has neither. The others stay as they
are (README, "Limitations"):

* ``modeling_utils.local_torch_dtype(dtype)`` calls
  ``torch.set_default_dtype``. :func:`metamode.default_dtype` could replace it
  for the factory functions, but 23 modeling files of transformers 5.23 call
  ``torch.get_default_dtype()``, which no mode can reach, and several build a
  buffer with it in ``__init__`` (XGLM, M2M100, Musicgen...): loaded with
  ``dtype=torch.float16`` they would keep a float32 buffer and fail in
  ``forward`` (``tests/integration/test_integrations_hf.py`` shows the buffer on XGLM). A
  per-thread default dtype needs torch's help (pytorch#120819, #144673).
* ``initialization.no_init_weights`` (DeepSpeed ZeRO-3 only) assigns
  ``PreTrainedModel.init_weights`` and ``torch.nn.init`` functions: a class
  attribute, which metamode never assigns.
* ``guard_torch_init_functions`` assigns ``torch.nn.init`` functions in ten
  torch modules around ``initialize_weights``; it was bound by a decorator
  when ``PreTrainedModel`` was defined, so there is no name to rebind.
* ``torch.device("meta")`` sets torch's process-global ``CURRENT_DEVICE``.

So concurrent ``from_pretrained`` calls are still not safe with transformers 5.

transformers 4.x (``modeling_utils``, no ``initialization`` module) builds the
model inside ``no_init_weights()`` and, when not under DeepSpeed, its *own*
copy of accelerate's ``init_empty_weights()``
(``transformers.integrations.accelerate``; it assigns
``nn.Module.register_parameter`` like accelerate's and is not accelerate's
function, so the accelerate shim does not reach it): the shim rebinds that
copy and ``init_on_device`` to :func:`metamode.empty_weights` contexts (same
arguments; ``include_buffers`` defaults to False as there). ``no_init_weights`` assigns a no-op
to the ``torch.nn.init`` functions in ``TORCH_INIT_FUNCTIONS`` and sets the
module-global ``_init_weights = False``, which ``PreTrainedModel.init_weights``
reads to skip ``initialize_weights()``/``tie_weights()`` while the model is
built (so that modules are not marked ``_is_hf_initialized`` and missing keys
get initialised after loading). Both are process-wide. The shim rebinds
``no_init_weights`` to a context that skips exactly the calls stock skips, in
the calling thread (:mod:`metamode.integrations._exact_skip`), and rebinds
``_init_weights`` -- a module-level name -- to an object whose truth value is
per thread (``True`` outside such a context, like stock's default). What stays
process-global in 4.x: ``torch_dtype=`` (``cls._set_default_dtype``, a
classmethod, and ``restore_default_dtype``) and, under DeepSpeed ZeRO-3,
``deepspeed.zero.Init``.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from types import FrameType

import torch

from metamode._contexts.empty_weights import init_on_device as _init_on_device
from metamode._core.modes import EmptyWeights, KeepRegistered, ThreadScopedMode
from metamode.integrations._exact_skip import SkipLibraryInit, library_init_names
from metamode.integrations._rebind import _LOCK, SHARED, IncompatibleLibraryError, Rebinding
from metamode.integrations._registry import Integration, register

_MODELING_UTILS = "transformers.modeling_utils"
__all__ = ["disable_for_transformers", "enable_for_transformers"]


class LinspaceOnCpu(ThreadScopedMode):
    """``torch.linspace`` without ``device=`` makes cpu tensors, in this thread.

    transformers builds models under ``torch.device("meta")``; remote-code
    models call ``.item()`` on ``linspace`` results in ``__init__``, which
    fails on meta. This is transformers' ``meta_device_safe_creation_ops``
    (same rule: only when ``device`` is not passed at all) without the
    process-wide assignment to ``torch.linspace``. ``torch.device("meta")``
    keeps its own mode at the bottom of the stack, so this one sees the call
    first, as transformers' wrapper did.
    """

    def _fresh(self) -> LinspaceOnCpu:
        return LinspaceOnCpu()

    def _settings(self) -> tuple:
        return ()

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

_TIE_WEIGHTS = "tie_weights"  # PreTrainedModel's method, found by its code's name and file


class NoTieWeights(KeepRegistered):
    """transformers' ``no_tie_weights``, in the calling thread only.

    Stock replaces ``PreTrainedModel.tie_weights`` with a no-op for every
    thread. ``PreTrainedModel.tie_weights`` ties by assignment -- for each
    ``{target: source}`` pair, ``setattr(parent, name, source_param)`` --
    which registers ``source_param`` under ``name`` through torch's global
    registration hooks. Here, while this mode is on this thread's stack, the
    hooks keep the parameter (or buffer) the module already holds whenever the
    assignment comes from ``PreTrainedModel.tie_weights``'s body (a frame
    running its code is on the calling stack). Every tie it makes is undone
    at the moment it is made, so the model keeps the separate parameters
    stock's no-op leaves it. Overrides of ``tie_weights`` in model classes
    run as they do under stock (stock only replaces ``PreTrainedModel``'s);
    ties they make themselves are kept, their ``super().tie_weights()`` is not.

    What still runs that stock's no-op skips: the body's reads (the tied-keys
    mapping, ``get_parameter_or_buffer``) and ``_adjust_bias``, which pads the
    output layer's bias to the rows of its weight -- its own weight, as the
    tie did not happen, so a ``Linear``'s bias is re-set to an equal copy.
    """

    def __init__(self, filename: str | None) -> None:
        super().__init__()
        self.filename = filename

    def _fresh(self) -> NoTieWeights:
        return NoTieWeights(self.filename)

    def __repr__(self) -> str:
        return "metamode.integrations.transformers.NoTieWeights()"

    def keeps(self, module, name, value) -> bool:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_name == _TIE_WEIGHTS and code.co_filename == self.filename:
                return True
            frame = frame.f_back
        return False


def _modeling_utils_file() -> str | None:
    module = sys.modules.get(_MODELING_UTILS)
    return getattr(module, "__file__", None)


def no_tie_weights() -> NoTieWeights:
    """metamode's replacement for ``transformers.initialization.no_tie_weights``."""
    return NoTieWeights(_modeling_utils_file())


_TRANSFORMERS_TIES = Rebinding(
    package="transformers",
    extra="transformers",
    home_module="transformers.initialization",
    replacements={"no_tie_weights": no_tie_weights},
)


class InitWeightsFlag:
    """transformers 4.x's ``modeling_utils._init_weights``, one value per thread.

    ``if _init_weights:`` reads this thread's value: ``False`` inside
    metamode's ``no_init_weights`` in this thread, the default (the value
    the module held when the shim was enabled) everywhere else.
    """

    def __init__(self, default: bool) -> None:
        self.default = default
        self._local = threading.local()

    def __bool__(self) -> bool:
        return getattr(self._local, "value", self.default)

    def set(self, value: bool) -> bool:
        """Set this thread's value; returns the previous one."""
        previous = bool(self)
        self._local.value = value
        return previous

    def __repr__(self) -> str:
        return f"<metamode per-thread transformers _init_weights: {bool(self)} in this thread>"


class NoInitWeights(SkipLibraryInit):
    """transformers 4.x's ``no_init_weights``, in the calling thread only."""

    def __init__(self, names: frozenset[str], flag: InitWeightsFlag) -> None:
        super().__init__(names)
        self._flag = flag
        self._previous = True

    def _fresh(self) -> NoInitWeights:
        return NoInitWeights(self.names, self._flag)

    def _after_enter(self) -> None:
        self._previous = self._flag.set(False)

    def _before_exit(self) -> None:
        self._flag.set(self._previous)

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
    flag = SHARED.get(_FLAG)
    if flag is None:  # the shim was disabled while a caller held this function
        flag = InitWeightsFlag(True)
    names = library_init_names(sys.modules[_MODELING_UTILS])
    return NoInitWeights(names, flag)


_TRANSFORMERS_4 = Rebinding(
    package="transformers",
    extra="transformers",
    home_module=_MODELING_UTILS,
    replacements={"no_init_weights": no_init_weights},
)


# transformers 5: each is enabled when its name exists in transformers.initialization.
_REBINDINGS_5 = (_TRANSFORMERS, _TRANSFORMERS_TIES)


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
    bound = _TRANSFORMERS_4.enable()
    try:
        bound += _TRANSFORMERS_4_EMPTY.enable()
    except BaseException:
        _TRANSFORMERS_4.disable()
        raise
    namespace = vars(module)
    current = namespace["_init_weights"]
    if not isinstance(current, InitWeightsFlag):
        flag = InitWeightsFlag(bool(current))
        SHARED[_FLAG] = flag
        namespace["_init_weights"] = flag
    return (*bound, f"{_MODELING_UTILS}._init_weights")


def _disable_4() -> tuple[str, ...]:
    restored = [*_TRANSFORMERS_4.disable(), *_TRANSFORMERS_4_EMPTY.disable()]
    module = sys.modules.get(_MODELING_UTILS)
    flag = SHARED.pop(_FLAG, None)
    if module is not None and isinstance(vars(module).get("_init_weights"), InitWeightsFlag):
        vars(module)["_init_weights"] = flag.default if flag is not None else True
        restored.append(f"{_MODELING_UTILS}._init_weights")
    return tuple(sorted(restored))


def enable_for_transformers() -> tuple[str, ...]:
    """Make transformers' ``torch.linspace`` and ``tie_weights`` patches thread-scoped.

    Rebinds ``transformers.initialization.meta_device_safe_creation_ops``
    and ``no_tie_weights`` (entered by ``from_pretrained`` while it builds
    the model), where they exist, to contexts that send this thread's
    device-less ``torch.linspace`` calls to cpu and stop
    ``PreTrainedModel.tie_weights`` from tying in this thread, instead of
    assigning ``torch.linspace`` and ``PreTrainedModel.tie_weights``; atomic,
    under a lock; idempotent.

    This does **not** make concurrent ``from_pretrained`` calls safe: the
    default dtype and ``torch.nn.init`` are still set process-wide by
    transformers, for the reasons in :mod:`metamode.integrations.transformers`.

    On transformers 4.x (no ``transformers.initialization``) it instead
    rebinds ``modeling_utils.no_init_weights`` and ``_init_weights`` to
    thread-scoped equivalents that build exactly the stock model; with the
    accelerate shim that makes concurrent same-dtype ``from_pretrained`` calls
    safe on 4.x (see the module docstring for what stays global).

    Returns the rebound ``module.name`` bindings.

    Raises:
        ImportError: transformers is not installed.
        metamode.IncompatibleLibraryError: this transformers lacks the names
            for either major version; nothing was changed.
    """
    with _LOCK:
        SHARED.pop(_LEFT_ALONE, None)
        if _TRANSFORMERS_4.enabled or not _has_initialization_module():
            return _enable_4()
        home = _TRANSFORMERS._import_home()
        rebindings = [r for r in _REBINDINGS_5 if set(r.replacements) <= set(vars(home))]
        if not rebindings:
            # A 5.x release without either patch: nothing to route, not an error.
            SHARED[_LEFT_ALONE] = (
                f"transformers {_TRANSFORMERS._version()} has neither "
                f"initialization.meta_device_safe_creation_ops (no torch.linspace patch) "
                f"nor initialization.no_tie_weights, and no 4.x no_init_weights: "
                f"nothing for metamode to route"
            )
            return ()
        bound: list[str] = []
        done: list[Rebinding] = []
        try:
            for rebinding in rebindings:
                bound += rebinding.enable()
                done.append(rebinding)
        except BaseException:
            for rebinding in reversed(done):
                rebinding.disable()
            raise
        return tuple(sorted(bound))


def disable_for_transformers() -> tuple[str, ...]:
    """Restore transformers' function everywhere the shim put its own.

    Returns the restored bindings (empty if the shim was not enabled).
    """
    with _LOCK:
        restored = [r.disable() for r in _REBINDINGS_5]
        return tuple(sorted((*(b for r in restored for b in r), *_disable_4())))


def transformers_enabled() -> bool:
    return any(r.enabled for r in _REBINDINGS_5) or _TRANSFORMERS_4.enabled


register(
    Integration(
        "transformers", enable_for_transformers, disable_for_transformers, transformers_enabled
    )
)
