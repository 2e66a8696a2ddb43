"""Route what transformers' model-building contexts can safely give up through metamode.

``PreTrainedModel.from_pretrained`` (transformers 5) builds the model inside
the contexts listed by ``get_init_context``, and every one of them changes
process-global state. Only one can be made thread-scoped without changing
what the model comes out as:

* ``transformers.initialization.meta_device_safe_creation_ops()`` assigns a
  wrapper to ``torch.linspace`` (every thread's ``linspace`` defaults to cpu
  meanwhile, and overlapping loads can leave the wrapper in place). The shim
  rebinds it -- transformers looks it up at call time -- to a mode doing the
  same for the calling thread only.

The others stay as they are (README, "Limitations"):

* ``modeling_utils.local_torch_dtype(dtype)`` calls
  ``torch.set_default_dtype``. :func:`metamode.default_dtype` could replace it
  for the factory functions, but 23 modeling files of transformers 5.23 call
  ``torch.get_default_dtype()``, which no mode can reach, and several build a
  buffer with it in ``__init__`` (XGLM, M2M100, Musicgen...): loaded with
  ``dtype=torch.float16`` they would keep a float32 buffer and fail in
  ``forward`` (``tests/test_integrations_hf.py`` shows the buffer on XGLM). A
  per-thread default dtype needs torch's help (pytorch#120819, #144673).
* ``initialization.no_tie_weights`` assigns ``PreTrainedModel.tie_weights``,
  and ``no_init_weights`` (DeepSpeed ZeRO-3 only) ``PreTrainedModel.init_weights``:
  class attributes, which metamode never assigns.
* ``guard_torch_init_functions`` assigns ``torch.nn.init`` functions in ten
  torch modules around ``initialize_weights``; it was bound by a decorator
  when ``PreTrainedModel`` was defined, so there is no name to rebind.
* ``torch.device("meta")`` sets torch's process-global ``CURRENT_DEVICE``.

So concurrent ``from_pretrained`` calls are still not safe with transformers.
"""

from __future__ import annotations

import torch

from metamode._modes import ThreadScopedMode
from metamode.integrations._rebind import Rebinding

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
        return "metamode.integrations._transformers.LinspaceOnCpu()"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
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


def enable_for_transformers() -> tuple[str, ...]:
    """Make transformers' ``torch.linspace`` patch thread-scoped.

    Rebinds ``transformers.initialization.meta_device_safe_creation_ops``
    (entered by ``from_pretrained`` while it builds the model) to a context
    that sends this thread's device-less ``torch.linspace`` calls to cpu
    instead of assigning a wrapper to ``torch.linspace``; atomic, under a
    lock; idempotent.

    This does **not** make concurrent ``from_pretrained`` calls safe: the
    default dtype, ``PreTrainedModel.tie_weights`` and ``torch.nn.init`` are
    still set process-wide by transformers, for the reasons in
    :mod:`metamode.integrations._transformers`.

    Returns the rebound ``module.name`` bindings.

    Raises:
        ImportError: transformers is not installed.
        metamode.IncompatibleLibraryError: this transformers lacks the name;
            nothing was changed.
    """
    return _TRANSFORMERS.enable()


def disable_for_transformers() -> tuple[str, ...]:
    """Restore transformers' function everywhere the shim put its own.

    Returns the restored bindings (empty if the shim was not enabled).
    """
    return _TRANSFORMERS.disable()


def transformers_enabled() -> bool:
    return _TRANSFORMERS.enabled
