"""Shim for diffusers: ``ModelMixin.from_pretrained``'s ``no_init_weights`` made thread-scoped
(exact skip, :mod:`metamode.integrations._exact_skip`), its ``torch_dtype=`` held as a dtype
window (:mod:`metamode._core.dtype_windows`), plus the accelerate shim for its
``low_cpu_mem_usage`` path. What stock does: docs/design.md, "Shims" and "Dtype windows".
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from typing import Any

from metamode._core import dtype_windows
from metamode.integrations import accelerate as _accelerate
from metamode.integrations._dtype_windows import (
    closing_windows,
    requested_dtype,
    set_default_in_a_window,
)
from metamode.integrations._exact_skip import SkipLibraryInit, library_init_names
from metamode.integrations._rebind import (
    _LOCK,
    SHARED,
    ClassAttributeRebinding,
    IncompatibleLibraryError,
    Rebinding,
)
from metamode.integrations._registry import Integration, register

__all__ = ["disable_for_diffusers", "enable_for_diffusers"]


def no_init_weights() -> SkipLibraryInit:
    """metamode's replacement for ``diffusers.models.modeling_utils.no_init_weights``."""
    # diffusers' own list, read from the installed diffusers (checked by enable).
    return SkipLibraryInit(library_init_names(sys.modules[_DIFFUSERS.home_module]))


_DIFFUSERS = Rebinding(
    package="diffusers",
    extra="diffusers",
    home_module="diffusers.models.modeling_utils",
    replacements={"no_init_weights": no_init_weights},
)


def _dtype_window_methods(originals: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelMixin``'s ``_set_default_torch_dtype`` and ``from_pretrained``, with the
    process default dtype set in a dtype window (:mod:`metamode._core.dtype_windows`) that
    ``from_pretrained`` closes when it returns or raises. A load given no dtype it can set
    (none, or float8) builds in the process default: it runs in a window of the default a
    lone load sees."""
    return {
        "_set_default_torch_dtype": set_default_in_a_window(
            originals["_set_default_torch_dtype"].__func__, _DIFFUSERS.home_module
        ),
        "from_pretrained": closing_windows(
            originals["from_pretrained"].__func__,
            lambda *args, **kwargs: not dtype_windows.settable(requested_dtype(**kwargs)),
        ),
    }


_DIFFUSERS_DTYPE = ClassAttributeRebinding(
    package="diffusers",
    extra="diffusers",
    home_module="diffusers.models.modeling_utils",
    class_name="ModelMixin",
    names=("_set_default_torch_dtype", "from_pretrained"),
    make_replacements=_dtype_window_methods,
)

# SHARED["diffusers turned accelerate on"]: whether enable_for_diffusers() is what
# turned the accelerate shim on, so that disable_for_diffusers() undoes exactly
# what it did (kept in _rebind so that a reload of this module keeps it).
_TURNED_ON = "diffusers turned accelerate on"


def enable_for_diffusers() -> tuple[str, ...]:
    """Make diffusers' ``ModelMixin.from_pretrained`` build models thread-scoped.

    Rebinds ``no_init_weights`` (by identity, wherever diffusers bound it) to a
    thread-scoped context that skips exactly the ``torch.nn.init`` calls diffusers' own
    skips (its ``TORCH_INIT_FUNCTIONS``, read now), so models come out bitwise as stock;
    sets ``ModelMixin._set_default_torch_dtype`` and ``ModelMixin.from_pretrained`` to
    versions that hold ``torch_dtype=`` as a dtype window (loads needing different dtypes
    take turns, the process default is put back after the last; docs/design.md, "Dtype
    windows"); and, if accelerate is installed, enables
    :func:`metamode.enable_for_accelerate`. All or nothing, under a lock; idempotent; safe
    before or after diffusers' submodules are imported.

    Returns the rebound ``module.name`` bindings (accelerate's included).

    Raises:
        ImportError: diffusers is not installed.
        metamode.IncompatibleLibraryError: this diffusers (or accelerate) lacks
            a name the shim replaces; nothing was changed.
    """
    with _LOCK:
        _diffusers_init_names()
        bound: list[str] = []
        turned_on = False
        if importlib.util.find_spec("accelerate") is not None:
            turned_on = not _accelerate.accelerate_enabled()
            bound.extend(_accelerate.enable_for_accelerate())
        try:
            bound.extend(_DIFFUSERS.enable())
            try:
                bound.extend(_DIFFUSERS_DTYPE.enable())
            except BaseException:
                _DIFFUSERS.disable()
                raise
        except BaseException:
            if turned_on:
                _accelerate.disable_for_accelerate()
            raise
        SHARED[_TURNED_ON] = SHARED.get(_TURNED_ON, False) or turned_on
        return tuple(sorted(bound))


def _diffusers_init_names() -> frozenset[str]:
    home = _DIFFUSERS._import_home()
    try:
        return library_init_names(home)
    except AttributeError:
        raise IncompatibleLibraryError(
            f"diffusers {_DIFFUSERS._version()} has no TORCH_INIT_FUNCTIONS in "
            f"{_DIFFUSERS.home_module}, so metamode cannot know which torch.nn.init calls "
            f"its no_init_weights skips; nothing was changed."
        ) from None


def disable_for_diffusers() -> tuple[str, ...]:
    """Undo :func:`enable_for_diffusers`: restore diffusers' ``no_init_weights``,
    and accelerate's functions if ``enable_for_diffusers`` is what rebound them.

    Returns the restored bindings (empty if the shim was not enabled).
    """
    with _LOCK:
        restored = [*_DIFFUSERS.disable(), *_DIFFUSERS_DTYPE.disable()]
        if SHARED.pop(_TURNED_ON, False):
            restored.extend(_accelerate.disable_for_accelerate())
        return tuple(sorted(restored))


def diffusers_enabled() -> bool:
    return _DIFFUSERS.enabled or _DIFFUSERS_DTYPE.enabled


register(
    Integration(
        "diffusers",
        enable_for_diffusers,
        disable_for_diffusers,
        diffusers_enabled,
        after=("accelerate",),
    )
)
