"""metamode.summary(): its numbers equal a direct count of the model's tensors."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

import metamode


class Mixed(nn.Module):
    """Meta and cpu, two dtypes, tied weights, (non-)persistent buffers, an int buffer."""

    def __init__(self) -> None:
        super().__init__()
        with metamode.empty_weights():
            self.embed = nn.Embedding(50, 8)
            self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.norm = nn.BatchNorm1d(8)  # cpu, float32 + int64 buffers
        self.adapter = nn.Linear(8, 4).to(torch.float16)
        self.register_buffer("position_ids", torch.arange(12), persistent=False)
        with metamode.empty_weights(include_buffers=True):
            self.register_buffer("table", torch.zeros(3, 5, dtype=torch.bfloat16))


def _direct_count(model: nn.Module) -> dict[tuple[str, str, str], tuple[int, int, int]]:
    counts: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for kind, tensors in (("parameter", model.parameters()), ("buffer", model.buffers())):
        for tensor in tensors:
            key = (kind, str(tensor.device), str(tensor.dtype).removeprefix("torch."))
            counts[key][0] += 1
            counts[key][1] += tensor.numel()
            counts[key][2] += tensor.numel() * tensor.element_size()
    return {key: tuple(value) for key, value in counts.items()}


def test_numbers_equal_a_direct_count():
    model = Mixed()
    report = metamode.summary(model)
    rows = {(r.kind, r.device, r.dtype): (r.tensors, r.elements, r.bytes) for r in report.rows}
    assert rows == _direct_count(model)
    assert report.parameters == len(list(model.parameters()))
    assert report.buffers == len(list(model.buffers()))
    assert report.parameter_elements == sum(p.numel() for p in model.parameters())
    assert report.bytes == sum(b for _, _, b in rows.values())
    # the groups this model must have, so the comparison above is not vacuous
    assert {("parameter", "meta", "float32"), ("parameter", "cpu", "float16")} <= rows.keys()
    assert {("buffer", "cpu", "int64"), ("buffer", "meta", "bfloat16")} <= rows.keys()


def test_meta_tensors_are_listed_and_tied_parameters_noted():
    model = Mixed()
    report = metamode.summary(model)
    expected_meta = [n for n, p in model.named_parameters() if p.is_meta]
    expected_meta += [n for n, b in model.named_buffers() if b.is_meta]
    assert list(report.meta) == expected_meta
    assert "table" in report.meta and "embed.weight" in report.meta
    assert report.tied == (("embed.weight", "head.weight"),)
    assert report.meta_bytes == sum(
        t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t.is_meta
    )


def test_prints_as_a_table():
    report = metamode.summary(Mixed())
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "summary of Mixed"
    assert lines[1].split() == ["kind", "device", "dtype", "tensors", "elements", "bytes"]
    for row in report.rows:
        assert any(
            line.split()[:4] == [row.kind, row.device, row.dtype, f"{row.tensors:,}"]
            for line in lines
        ), row
    assert "embed.weight = head.weight" in text
    assert "on meta (" in text


def test_renders_as_html_with_names_escaped():
    model = nn.Module()
    with metamode.empty_weights():
        model.add_module("a<b>", nn.Linear(2, 2))
    html = metamode.summary(model)._repr_html_()
    assert html.startswith("<div") and "<table>" in html and "</table>" in html
    assert "<td>meta</td>" in html
    assert "a&lt;b&gt;.weight" in html and "a<b>" not in html
    assert "nothing on meta" in metamode.summary(nn.Linear(1, 1))._repr_html_()


def test_an_empty_module_and_a_non_module():
    report = metamode.summary(nn.Module())
    assert report.rows == () and report.meta == () and report.bytes == 0
    assert "nothing on meta" in str(report)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        metamode.summary(torch.zeros(2))  # type: ignore[arg-type]
