"""``metamode.default_dtype(dtype)``: a per-thread default floating dtype for factory calls."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from metamode._core.modes import ThreadScopedMode

__all__ = ["DefaultDtype", "default_dtype"]

# The dtypes torch.set_default_dtype accepts.
_ALLOWED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_BOOL, _INT, _FLOAT, _COMPLEX, _OTHER, _DATA = range(6)


def _scalar_kind(value: Any) -> int:
    """Kind of one number-like value as ``full``/``arange`` read it (dtype ignored)."""
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _INT
    if isinstance(value, float):
        return _FLOAT
    if isinstance(value, complex):
        return _COMPLEX
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            return _COMPLEX
        if value.is_floating_point():
            return _FLOAT
        return _BOOL if value.dtype == torch.bool else _INT
    dtype = getattr(value, "dtype", None)  # NumPy scalars
    kind = str(getattr(dtype, "kind", ""))
    # torch reads a NumPy bool as a float here: full((1,), np.bool_(True)) and
    # arange(np.bool_(True)) are of the default floating dtype.
    return {"b": _FLOAT, "i": _INT, "u": _INT, "f": _FLOAT, "c": _COMPLEX}.get(kind, _OTHER)


def _data_dtype(data: Any, dtype: torch.dtype, complex_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype ``torch.tensor(data)`` gets with ``dtype`` as the default, or None.

    torch's own inference (each leaf's dtype, promoted with ``torch.promote_types``), with
    a Python float or empty sequence taking ``dtype`` and a complex ``complex_dtype``. None
    when no leaf takes the default, or a leaf is something else (torch then decides alone).
    """
    result: torch.dtype | None = None
    uses_default = False
    pending = [data]
    leaf: torch.dtype | None
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind is list or kind is tuple:
            if item:
                pending.extend(item)
                continue
            leaf, uses_default = dtype, True
        elif kind is float:
            leaf, uses_default = dtype, True
        elif kind is bool:
            leaf = torch.bool
        elif kind is int:
            leaf = torch.int64
        elif kind is complex:
            leaf, uses_default = complex_dtype, True
        elif isinstance(item, torch.Tensor):
            leaf = item.dtype
        else:
            numpy_dtype = getattr(item, "dtype", None) if kind.__module__ == "numpy" else None
            leaf = None if numpy_dtype is None else _numpy_dtype(numpy_dtype)
            if leaf is None:
                return None
        if leaf is not result:
            result = leaf if result is None else torch.promote_types(result, leaf)
    return result if uses_default else None


@functools.lru_cache(maxsize=64)
def _numpy_dtype(numpy_dtype: Any) -> torch.dtype | None:
    try:
        return torch.from_numpy(sys.modules["numpy"].empty(0, dtype=numpy_dtype)).dtype
    except (TypeError, ValueError, KeyError):
        return None


def _always_floating(args: tuple, kwargs: dict) -> int:
    return _FLOAT


def _normal(args: tuple, kwargs: dict) -> int:
    # normal(mean, std, size) with numbers is a factory; with tensors it
    # follows them (and takes no dtype argument).
    values = [*args, *kwargs.values()]
    return _OTHER if any(isinstance(v, torch.Tensor) for v in values) else _FLOAT


def _full(args: tuple, kwargs: dict) -> int:
    return _scalar_kind(args[1] if len(args) > 1 else kwargs.get("fill_value"))


def _arange(args: tuple, kwargs: dict) -> int:
    values = [*args, *(kwargs[k] for k in ("start", "end", "step") if k in kwargs)]
    return max((_scalar_kind(v) for v in values), default=_OTHER)


def _spaced(args: tuple, kwargs: dict) -> int:
    ends = [*args[:2], *(kwargs[k] for k in ("start", "end") if k in kwargs)]
    return _COMPLEX if any(_scalar_kind(v) == _COMPLEX for v in ends) else _FLOAT


def _data(args: tuple, kwargs: dict) -> int:
    return _DATA  # the dtype itself comes from _data_dtype


def _data_argument(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    for key in ("data", "obj"):
        if key in kwargs:
            return kwargs[key]
    return None


_RULES: dict[Any, Callable[[tuple, dict], int]] = {
    **dict.fromkeys(
        (
            torch.empty,
            torch.empty_strided,
            torch.empty_permuted,
            torch.zeros,
            torch.ones,
            torch.rand,
            torch.randn,
            torch.eye,
            torch.scalar_tensor,
            torch.bartlett_window,
            torch.blackman_window,
            torch.hamming_window,
            torch.hann_window,
            torch.kaiser_window,
            torch.fft.fftfreq,
            torch.fft.rfftfreq,
        ),
        _always_floating,
    ),
    torch.normal: _normal,
    torch.full: _full,
    torch.arange: _arange,
    torch.linspace: _spaced,
    torch.logspace: _spaced,
    torch.tensor: _data,
    torch.as_tensor: _data,
    torch.asarray: _data,
}


class DefaultDtype(ThreadScopedMode):
    """Factory functions in this thread default to ``dtype``: see :func:`default_dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._complex = torch.complex128 if dtype == torch.float64 else torch.complex64

    def _settings(self) -> tuple:
        return (self.dtype,)

    def __repr__(self) -> str:
        return f"metamode.default_dtype({self.dtype})"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._inert:
            return func(*args, **kwargs)
        rule = _RULES.get(func)
        if rule is not None and kwargs.get("dtype") is None and kwargs.get("out") is None:
            kind = rule(args, kwargs)
            if kind == _FLOAT:
                kwargs["dtype"] = self.dtype
            elif kind == _COMPLEX:
                kwargs["dtype"] = self._complex
            elif kind == _DATA:
                data = _data_argument(args, kwargs)
                inferred = _data_dtype(data, self.dtype, self._complex)
                if inferred is not None:
                    kwargs["dtype"] = inferred
        return func(*args, **kwargs)


def default_dtype(dtype: torch.dtype) -> DefaultDtype:
    """Context manager and decorator: a default floating dtype for this thread only.

    While active in the calling thread, a factory call without ``dtype=`` (or with
    ``dtype=None``) and without ``out=`` returns what it would after
    ``torch.set_default_dtype(dtype)``:

    * always floating, so ``dtype``: ``empty``, ``empty_strided``, ``empty_permuted``,
      ``zeros``, ``ones``, ``rand``, ``randn``, ``eye``, ``scalar_tensor``, the window
      functions, ``fft.fftfreq``/``rfftfreq``, ``normal(mean, std, size)`` with numbers;
    * from a value's kind -- ``full`` (the fill value), ``arange`` (start/end/step),
      ``linspace``/``logspace`` (floating unless an endpoint is complex): bool and int stay
      ``bool``/``int64``; a float (Python, NumPy, 0-d tensor, and a NumPy bool, which torch
      reads as a float) gives ``dtype``;
    * from data -- ``tensor``, ``as_tensor``, ``asarray``: torch's leaf-and-promote rule
      with ``dtype`` as the default (``[np.float32(1.5), 2.5]`` is ``float64`` under
      ``float64``); data with no Python float is left to torch;
    * complex results are ``complex128`` under ``float64``, else ``complex64``;
    * ``*_like`` functions and ``Tensor.new_*`` methods keep their input's dtype.

    So the parameters of ``nn.Linear`` come out in ``dtype``. Nothing changes for other
    threads, and ``torch.get_default_dtype()`` keeps the process-wide value; what else the
    context cannot reach: docs/limitations.md. Nested contexts: the innermost wins.

    Args:
        dtype: ``torch.float16``, ``torch.bfloat16``, ``torch.float32`` or
            ``torch.float64`` (the dtypes ``torch.set_default_dtype`` accepts).

    Returns a single-use context; as a decorator, each call gets a fresh one.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype`` (e.g. used as a bare decorator).
        ValueError: ``dtype`` is not one of the floating dtypes above.
    """
    if callable(dtype) and not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"metamode.default_dtype was used as a decorator without a dtype on "
            f"{getattr(dtype, '__qualname__', dtype)!r}: use "
            f"@metamode.default_dtype(torch.float16) (or another dtype)."
        )
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, not {dtype!r}")
    if dtype not in _ALLOWED:
        raise ValueError(
            f"default_dtype needs a floating dtype torch can use as its default "
            f"({', '.join(map(str, _ALLOWED))}), not {dtype}"
        )
    return DefaultDtype(dtype)
