"""The replacements two shims share to hold a library's default dtype in dtype windows
(:mod:`metamode._core.dtype_windows`): diffusers' ``ModelMixin`` and transformers 4's
``PreTrainedModel`` set the default in a classmethod and restore it inline, around a load
that a classmethod wraps."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from metamode._core import dtype_windows

__all__ = ["closing_windows", "requested_dtype", "set_default_in_a_window"]


def set_default_in_a_window(stock_set: Callable[..., Any], home_module: str) -> classmethod:
    """A library's ``_set_default_*dtype(cls, dtype)`` (check the dtype, log, capture the
    default, set ``dtype``, return what it captured) that opens a window in ``dtype``
    instead and returns the window's dtype, so the library's inline restore changes
    nothing. Outside :func:`closing_windows` (a load that began before ``enable()``)
    nothing would close the window: stock's ``stock_set`` runs."""

    def set_default(cls: type, dtype: torch.dtype) -> torch.dtype:
        if not dtype_windows.inside_closing_call():
            return stock_set(cls, dtype)
        if not dtype.is_floating_point:
            raise ValueError(
                f"Can't instantiate {cls.__name__} model under dtype={dtype} since it is not "
                f"a floating point dtype"
            )
        sys.modules[home_module].logger.info(
            f"Instantiating {cls.__name__} model under default dtype {dtype}."
        )
        dtype_windows.open_window(dtype)
        return dtype

    return classmethod(set_default)


def closing_windows(
    load: Callable[..., Any], builds_in_the_default: Callable[..., bool]
) -> classmethod:
    """A load classmethod that closes the windows its call opened when it returns or
    raises; a call for which ``builds_in_the_default(*args, **kwargs)`` holds runs in a
    window of the default a lone load sees (:func:`dtype_windows.default_for_this_thread`)."""

    @functools.wraps(load)
    def method(cls: type, *args: Any, **kwargs: Any) -> Any:
        with dtype_windows.closing_call():
            if builds_in_the_default(*args, **kwargs):
                dtype_windows.open_window(dtype_windows.default_for_this_thread())
            return load(cls, *args, **kwargs)

    return classmethod(method)


def requested_dtype(*args: Any, **kwargs: Any) -> Any:
    """The dtype a ``from_pretrained`` call asks for (``dtype=``, else ``torch_dtype=``)."""
    dtype = kwargs.get("dtype")
    return dtype if dtype is not None else kwargs.get("torch_dtype")
