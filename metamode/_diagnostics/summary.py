"""``metamode.summary(model)``: where a model's tensors live, at a glance.

After building under :func:`metamode.empty_weights` (and loading part of a
checkpoint, or injecting an adapter), the question is always the same: what
is still on ``meta``, what was materialised, in which dtype, and how much
memory does it take. This answers it in one table, grouped by kind
(parameter / buffer), device and dtype, with the meta tensors listed and
tied parameters noted.

Counting rules, so the numbers match a direct count: a tensor registered
under several names (tied weights) is counted once, under its first name, as
``module.parameters()`` does; ``bytes`` is ``numel * element_size`` -- for
meta tensors, what they will take once materialised.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch
from torch import nn

from metamode import _torch
from metamode._contexts.materialize import unreproducible
from metamode._torch import UninitializedTensorMixin

__all__ = ["Summary", "SummaryRow", "summary"]

_LISTED = 20  # meta tensors / tied groups shown in str(); all are in the attributes


@dataclass(frozen=True)
class SummaryRow:
    """One (kind, device, dtype) group."""

    kind: str  # "parameter" or "buffer"
    device: str
    dtype: str
    tensors: int
    elements: int
    bytes: int


@dataclass(frozen=True)
class Summary:
    """Parameters and buffers of a module grouped by device and dtype.

    Attributes:
        rows: one :class:`SummaryRow` per (kind, device, dtype), sorted.
        meta: names of every parameter and buffer on the meta device.
        tied: groups of names that share one parameter (or buffer) object.
        materializable: the names in ``meta`` that :func:`metamode.materialize`
            can give their eager values (built in ``empty_weights(replayable=True)``).
        parameters / buffers: number of distinct tensors of each kind.
        parameter_elements / buffer_elements: their element counts.
        bytes: total bytes, meta tensors included at their materialised size.

    ``str()`` is a terminal table; Jupyter renders ``_repr_html_``.
    """

    module: str
    rows: tuple[SummaryRow, ...]
    meta: tuple[str, ...]
    tied: tuple[tuple[str, ...], ...]
    materializable: tuple[str, ...] = ()

    def _total(self, kind: str | None, attribute: str) -> int:
        return sum(getattr(r, attribute) for r in self.rows if kind is None or r.kind == kind)

    @property
    def parameters(self) -> int:
        return self._total("parameter", "tensors")

    @property
    def buffers(self) -> int:
        return self._total("buffer", "tensors")

    @property
    def parameter_elements(self) -> int:
        return self._total("parameter", "elements")

    @property
    def buffer_elements(self) -> int:
        return self._total("buffer", "elements")

    @property
    def bytes(self) -> int:
        return self._total(None, "bytes")

    @property
    def meta_bytes(self) -> int:
        return sum(r.bytes for r in self.rows if r.device == "meta")

    def _cells(self) -> tuple[list[str], list[list[str]], list[str]]:
        header = ["kind", "device", "dtype", "tensors", "elements", "bytes"]
        body = [
            [r.kind, r.device, r.dtype, f"{r.tensors:,}", f"{r.elements:,}", _human(r.bytes)]
            for r in self.rows
        ]
        total = [
            "total",
            "",
            "",
            f"{self.parameters + self.buffers:,}",
            f"{self.parameter_elements + self.buffer_elements:,}",
            _human(self.bytes),
        ]
        return header, body, total

    def __str__(self) -> str:
        header, body, total = self._cells()
        table = [header, *body, total]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        numeric = {3, 4, 5}

        def line(row: list[str]) -> str:
            cells = (
                cell.rjust(width) if i in numeric else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
            return "  ".join(cells).rstrip()

        rule = "  ".join("-" * w for w in widths)
        lines = [f"summary of {self.module}", line(header), rule]
        lines += [line(row) for row in body]
        lines += [rule, line(total)]
        if self.meta:
            lines.append(
                f"on meta ({len(self.meta)}, {_human(self.meta_bytes)} when materialised; "
                f"{len(self.materializable)} materializable):"
            )
            replayable = set(self.materializable)
            lines += [
                f"  {name}" + ("  [materializable]" if name in replayable else "")
                for name in self.meta[:_LISTED]
            ]
            if len(self.meta) > _LISTED:
                lines.append(f"  ... and {len(self.meta) - _LISTED} more (see .meta)")
        else:
            lines.append("nothing on meta")
        if self.tied:
            lines.append(f"tied ({len(self.tied)}):")
            lines += [f"  {' = '.join(group)}" for group in self.tied[:_LISTED]]
            if len(self.tied) > _LISTED:
                lines.append(f"  ... and {len(self.tied) - _LISTED} more (see .tied)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        header, body, total = self._cells()
        esc = html.escape

        def row(cells: list[str], tag: str = "td") -> str:
            return "<tr>" + "".join(f"<{tag}>{esc(c)}</{tag}>" for c in cells) + "</tr>"

        parts = [
            f"<div class='metamode-summary'><b>summary of {esc(self.module)}</b>",
            "<table><thead>",
            row(header, "th"),
            "</thead><tbody>",
            *(row(cells) for cells in body),
            "</tbody><tfoot>",
            row(total),
            "</tfoot></table>",
        ]
        if self.meta:
            items = "".join(f"<li><code>{esc(n)}</code></li>" for n in self.meta)
            parts.append(
                f"<details><summary>on meta: {len(self.meta)} tensors, "
                f"{esc(_human(self.meta_bytes))} when materialised, "
                f"{len(self.materializable)} materializable</summary><ul>{items}</ul>"
                f"</details>"
            )
        else:
            parts.append("<p>nothing on meta</p>")
        if self.tied:
            items = "".join(
                "<li>" + " = ".join(f"<code>{esc(n)}</code>" for n in group) + "</li>"
                for group in self.tied
            )
            parts.append(f"<details><summary>tied: {len(self.tied)}</summary><ul>{items}</ul>")
            parts.append("</details>")
        parts.append("</div>")
        return "".join(parts)

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(str(self))


def summary(module: nn.Module) -> Summary:
    """Summarise ``module``'s parameters and buffers by kind, device and dtype.

    Print it in a terminal; in Jupyter, leave it as a cell's value to get an
    HTML table.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"summary() takes an nn.Module, not {type(module).__name__}")
    with _torch.DisableTorchFunction():  # metamode's own reads, not an open build's
        return _summary(module)


def _summary(module: nn.Module) -> Summary:
    groups: dict[tuple[str, str, str], list[int]] = {}
    meta: list[str] = []
    materializable: list[str] = []
    refused = unreproducible(module)
    tied: list[tuple[str, ...]] = []
    for kind, named in (
        ("parameter", module.named_parameters(remove_duplicate=False)),
        ("buffer", module.named_buffers(remove_duplicate=False)),
    ):
        names_of: dict[int, list[str]] = {}
        first: dict[int, torch.Tensor] = {}
        for name, tensor in named:
            if id(tensor) not in names_of:
                names_of[id(tensor)] = []
                first[id(tensor)] = tensor
            names_of[id(tensor)].append(name)
        for key, tensor in first.items():
            names = names_of[key]
            if len(names) > 1:
                tied.append(tuple(names))
            if tensor.is_meta:
                meta.append(names[0])
                if not any(name in refused for name in names):
                    materializable.append(names[0])
            group = groups.setdefault((kind, str(tensor.device), _dtype(tensor.dtype)), [0, 0, 0])
            numel = 0 if isinstance(tensor, UninitializedTensorMixin) else tensor.numel()
            group[0] += 1
            group[1] += numel
            group[2] += numel * tensor.dtype.itemsize
    order = {"parameter": 0, "buffer": 1}
    rows = tuple(
        SummaryRow(kind, device, dtype, *counts)
        for (kind, device, dtype), counts in sorted(
            groups.items(), key=lambda item: (order[item[0][0]], item[0][1], item[0][2])
        )
    )
    return Summary(type(module).__qualname__, rows, tuple(meta), tuple(tied), tuple(materializable))


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _human(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
