"""Intended global changes by torch and the libraries are not findings.

One test per entry of ``metamode._diagnostics.known_changes.KNOWN_CHANGES``: the real
library makes the change in a fresh interpreter (the change is permanent, so
it must be that process's first), and then ``doctor()`` is clean,
``doctor(repair=True)`` keeps the change, and the global-state snapshot
(``hammer``, the pytest plugin, this suite's guard) sees nothing.
"""

from __future__ import annotations

import textwrap

import pytest

from metamode._diagnostics.known_changes import KNOWN_CHANGES
from tests.conftest import run_python

COMPILE = textwrap.dedent(
    """
    import json
    import torch
    import metamode
    from metamode._diagnostics.invariants import snapshot

    before = snapshot()
    torch_init = vars(torch.nn.Module)["__init__"]
    torch_setstate = vars(torch.nn.Module)["__setstate__"]
    {patch}
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    fn(torch.ones(3))
    module = torch.compile(torch.nn.Linear(3, 3), backend="eager")
    module(torch.ones(3))
    tagged_init = vars(torch.nn.Module)["__init__"]
    tagged_setstate = vars(torch.nn.Module)["__setstate__"]
    found = metamode.doctor()
    repaired = metamode.doctor(repair=True)

    from torch._dynamo.mutation_guard import GenerationTracker

    built_after = torch.nn.Linear(2, 2)
    print(json.dumps(dict(
        dynamo_wrapped=tagged_init is not torch_init and tagged_setstate is not torch_setstate,
        wrapper=tagged_init.__qualname__,
        findings=[str(f) for f in found.findings],
        remaining=[str(f) for f in repaired.remaining],
        actions=[f.action for f in repaired.findings],
        kept_init=vars(torch.nn.Module)["__init__"] is tagged_init,
        kept_setstate=vars(torch.nn.Module)["__setstate__"] is tagged_setstate,
        still_tags=GenerationTracker.get_generation_value(built_after) >= 0,
        inner_is_torchs=tagged_init.__closure__[0].cell_contents is torch_init,
        snapshot_changes=snapshot().changes_since(before),
    )))
    """
)


@pytest.mark.slow
def test_torch_compile_tagging_is_not_a_finding_and_repair_keeps_it():
    out = run_python(COMPILE.format(patch=""))
    assert out["dynamo_wrapped"], "torch.compile no longer wraps Module.__init__: test is moot"
    assert out["wrapper"] == "install_generation_tagging_init.<locals>.patched_init"
    assert out["findings"] == []
    assert out["remaining"] == []
    assert out["kept_init"] and out["kept_setstate"] and out["still_tags"]
    assert out["snapshot_changes"] == []


@pytest.mark.slow
def test_a_patch_under_torch_compiles_wrapper_is_found_and_repaired_beneath_it():
    # Someone patched __init__ before the first torch.compile: dynamo wraps the patch.
    patch = (
        "def leaky_init(self, *a, **k): return torch_init(self, *a, **k)\n"
        "torch.nn.Module.__init__ = leaky_init"
    )
    out = run_python(COMPILE.format(patch=patch))
    assert len(out["findings"]) == 1, out["findings"]
    assert "torch.nn.Module.__init__: is not torch's own" in out["findings"][0]
    assert "__main__.leaky_init" in out["findings"][0]
    assert out["remaining"] == [], out["actions"]
    assert "inside the wrapper of torch.compile" in out["actions"][0]
    # dynamo's wrapper stays (it never re-installs itself) and now wraps torch's own.
    assert out["kept_init"] and out["kept_setstate"] and out["still_tags"]
    assert out["inner_is_torchs"]


GPT2 = textwrap.dedent(
    """
    import json
    import torch
    import metamode
    from metamode.testing import hammer
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    had_it = hasattr(torch.nn.Module, "smart_apply")

    def build():
        model = GPT2LMHeadModel(config)
        assert model.transformer.h[0].attn.c_attn.weight.device.type == "cpu"

    # One worker: concurrent builds race in transformers' own init guard
    # (docs/limitations.md); this is about the permanent smart_apply only.
    report = hammer(build, threads=1, rounds=2)
    found = metamode.doctor()
    repaired = metamode.doctor(repair=True)
    print(json.dumps(dict(
        had_it=had_it,
        has_it=hasattr(torch.nn.Module, "smart_apply"),
        report=str(report),
        ok=report.ok,
        findings=[str(f) for f in found.findings],
        still_there=hasattr(torch.nn.Module, "smart_apply"),
    )))
    """
)


@pytest.mark.slow
def test_transformers_smart_apply_is_not_a_finding_and_hammer_passes_round_0():
    out = run_python(GPT2)
    assert not out["had_it"] and out["has_it"], "transformers no longer adds smart_apply"
    assert out["ok"], out["report"]
    assert out["findings"] == []
    assert out["still_there"]


def test_every_registry_entry_has_a_test_here():
    tested = {
        "install_generation_tagging_init.<locals>.patched_init",
        "install_generation_tagging_init.<locals>.patched_setstate",
        "PreTrainedModel.initialize_weights.<locals>.smart_apply",
    }
    assert {change.qualname for change in KNOWN_CHANGES} == tested
