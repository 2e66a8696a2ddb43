"""accelerate's ``init_empty_weights`` unties tied weights (accelerate#3668) and mutates the
original parameter; metamode's keeps ties and leaves the original alone. Stock accelerate
runs in a subprocess: its context patches ``nn.Module.register_parameter`` while open."""

from __future__ import annotations

from tests.conftest import run_python

_TIES = """
import json
import torch
from torch import nn
{context_import}


class SharedEmbeddingLM(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Parameter(torch.empty(10, 4))
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.embed.weight = shared
        self.head.weight = shared


shared = nn.Parameter(torch.empty(3))
a, b = nn.Module(), nn.Module()
with init_empty_weights():
    model = SharedEmbeddingLM()
    a.w = shared
    b.w = shared
print(json.dumps({{
    "model_tied": model.head.weight is model.embed.weight,
    "model_on_meta": model.head.weight.is_meta and model.embed.weight.is_meta,
    "twice_registered_tied": a.w is b.w,
    "original_dict_mutated": "requires_grad" in shared.__dict__,
}}))
"""


def test_stock_accelerate_unties_what_metamode_keeps_tied():
    stock = run_python(_TIES.format(context_import="from accelerate import init_empty_weights"))
    assert stock == {
        "model_tied": False,
        "model_on_meta": True,
        "twice_registered_tied": False,
        "original_dict_mutated": True,
    }
    ours = run_python(_TIES.format(context_import="from metamode import init_empty_weights"))
    assert ours == {
        "model_tied": True,
        "model_on_meta": True,
        "twice_registered_tied": True,
        "original_dict_mutated": False,
    }
