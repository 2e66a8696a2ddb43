"""Concurrent LoRA injection from many threads, stock PEFT vs the metamode shim.

Two kinds of evidence:

* a *forced* interleaving (deterministic): thread X pauses inside PEFT's
  ``low_cpu_mem_usage=True`` context while thread Y injects with
  ``low_cpu_mem_usage=False`` and builds a plain module. Stock PEFT's
  process-wide patch gives Y meta parameters; the shim never does.
* a bounded *stress* run: 8 threads x 200 rounds released by a Barrier each
  round with ``sys.setswitchinterval(1e-6)``, every round checked.

The pause uses torch's official module-registration hook (installed and
removed in the scenario itself), so the stock code runs unmodified.
"""

from __future__ import annotations

import pytest

import metamode
from metamode.lab import scenarios
from tests.conftest import run_python

pytestmark = pytest.mark.slow  # stress rounds and subprocess reproducers

FORCED = """
import json, threading
import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
import peft.utils.integrations
{enable}
from metamode.lab.scenarios import TinyAttentionBlock, _inject, check_injected

x_inside, y_done = threading.Event(), threading.Event()
x_thread = []

def pause_x_inside_its_context(module, name, child):
    # PEFT adds lora_A["default"] inside its low_cpu_mem_usage context.
    in_context = isinstance(module, nn.ModuleDict) and name == "default"
    if in_context and threading.current_thread() in x_thread and not x_inside.is_set():
        x_inside.set()
        assert y_done.wait(30), "Y never finished"

handle = register_module_module_registration_hook(pause_x_inside_its_context)
result = {{}}

def x():
    model = TinyAttentionBlock()
    _inject(model, low_cpu_mem_usage=True)
    result["x"] = check_injected(model, low_cpu_mem_usage=True)

def y():
    assert x_inside.wait(30), "X never entered its context"
    try:
        model = TinyAttentionBlock()
        _inject(model, low_cpu_mem_usage=False)
        result["y"] = check_injected(model, low_cpu_mem_usage=False)
        result["y_plain_linear"] = nn.Linear(2, 2).weight.device.type
    finally:
        y_done.set()

threads = [threading.Thread(target=x), threading.Thread(target=y)]
x_thread.append(threads[0])
for t in threads: t.start()
for t in threads: t.join()
handle.remove()
print(json.dumps(result))
"""


@pytest.mark.per_interpreter
def test_stock_peft_forced_interleaving_puts_other_threads_params_on_meta():
    result = run_python(FORCED.format(enable=""))
    assert result["y_plain_linear"] == "meta"
    assert result["y"], "stock PEFT must corrupt the low_cpu_mem_usage=False thread"
    assert all("on meta, expected cpu" in problem for problem in result["y"])


@pytest.mark.per_interpreter
def test_shim_forced_interleaving_keeps_threads_apart():
    result = run_python(FORCED.format(enable="import metamode; metamode.enable_for_peft()"))
    assert result == {"x": [], "y": [], "y_plain_linear": "cpu"}


def test_stock_peft_stress_corrupts():
    result = run_python(
        "from metamode.lab.scenarios import main; "
        "main(['inject', 'stock-peft', '--threads', '8', '--rounds', '200', "
        "'--stop-at-first-corruption'])"
    )
    assert result["corrupted_rounds"] >= 1, result


def test_shim_stress_8_threads_200_rounds():
    try:
        result = scenarios.inject("peft-shim", threads=8, rounds=200)
    finally:
        metamode.disable_for_peft()
    assert result["rounds_run"] == 200
    assert result["corrupted_rounds"] == 0, result["first_problems"]
    assert result["register_parameter_is_torchs_at_end"]
