"""metamode.doctor(): finds and repairs what other libraries leave in torch.

The corrupting runs happen in one subprocess (they corrupt its interpreter):
first stock PEFT's overlap reproducer, run before metamode's core is imported,
so the doctor must recognise torch's originals by where they are defined,
not by a snapshot; then one leftover of every other kind. The in-process
tests corrupt only what they restore themselves, and the suite's guard
(tests/conftest.py) checks that the repair put back the very same objects.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metamode
from metamode._diagnostics import doctor as _doctor
from tests.conftest import run_python

CORRUPT_THEN_DOCTOR = r"""
import json, sys, threading, types

def as_json(report):
    return {
        "ok": report.ok,
        "text": str(report),
        "findings": [
            {"target": f.target, "problem": f.problem, "culprit": f.culprit,
             "action": f.action, "repaired": f.repaired}
            for f in report.findings
        ],
        "remaining": [f.target for f in report.remaining],
    }

def linear_devices():
    from torch import nn
    other = {}
    thread = threading.Thread(target=lambda: other.update(d=str(nn.Linear(2, 2).weight.device)))
    thread.start(); thread.join()
    return [str(nn.Linear(2, 2).weight.device), other["d"]]

# --- 1. stock PEFT's overlap reproducer, metamode's core not imported ------------
from metamode.lab import core_imported, scenarios as stock
overlap = stock.overlap("stock-peft")
out = {"overlap": overlap, "metamode_imported_before": core_imported()}
torch_register_parameter = stock._TORCH_REGISTER_PARAMETER  # only to verify the repair

import metamode
out["stock_found"] = as_json(metamode.doctor())
out["stock_repair"] = as_json(metamode.doctor(repair=True))
out["stock_after"] = as_json(metamode.doctor())
import torch
from torch import nn
out["stock_register_parameter_is_torchs"] = (
    vars(nn.Module)["register_parameter"] is torch_register_parameter)
out["stock_linears_after_repair"] = linear_devices()

# --- 2. one leftover of every kind ------------------------------------------------
import peft.utils.integrations as peft_integrations
import transformers.initialization as hf_init

originals = {
    "register_buffer": vars(nn.Module)["register_buffer"],
    "kaiming_uniform_": torch.nn.init.kaiming_uniform_,
    "xavier_uniform_": torch.nn.init.xavier_uniform_,
    "empty": torch.empty,
    "linspace": torch.linspace,
}
leaky = types.ModuleType("leaky_lib")
exec("def fake_linspace(*args, **kwargs):\n    raise RuntimeError('patched')\n", vars(leaky))

class LeakyMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

# Entered, never exited; kept referenced so no finaliser restores anything.
left_open = [
    peft_integrations._init_on_device(torch.device("meta"), include_buffers=True),
    peft_integrations._skip_init_on_device(),
    hf_init.guard_torch_init_functions(),  # rebinds init functions in torch modules too
    LeakyMode(),
    metamode.empty_weights(),
]
for context in left_open:
    context.__enter__()
torch.linspace = leaky.fake_linspace
nn.Module.register_module = lambda self, name, module: None  # no reference to torch's survives
torch.set_default_dtype(torch.float64)
torch.set_default_device("meta")

out["sink_found"] = as_json(metamode.doctor())
out["sink_repair"] = as_json(metamode.doctor(repair=True))
out["sink_after"] = as_json(metamode.doctor())

holder = nn.Module()
holder.register_module("child", nn.Linear(2, 2))
out["sink_checks"] = {
    "identities": {
        "register_buffer": vars(nn.Module)["register_buffer"] is originals["register_buffer"],
        "kaiming_uniform_": torch.nn.init.kaiming_uniform_ is originals["kaiming_uniform_"],
        "xavier_uniform_": torch.nn.init.xavier_uniform_ is originals["xavier_uniform_"],
        "activation.xavier_uniform_":
            torch.nn.modules.activation.xavier_uniform_ is originals["xavier_uniform_"],
        "empty": torch.empty is originals["empty"],
        "linspace": torch.linspace is originals["linspace"],
    },
    "register_module_works": isinstance(getattr(holder, "child", None), nn.Linear),
    "register_module_qualname": vars(nn.Module)["register_module"].__qualname__,
    "linears": linear_devices(),
    "buffer_device": str(nn.BatchNorm1d(2).running_mean.device),
    "dtype": str(torch.get_default_dtype()),
    "peft_skip": vars(peft_integrations._init_on_device).get("_skip"),
    "stack_depth": metamode._core.stack.stack_depth(),
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def corrupted() -> dict:
    return run_python(CORRUPT_THEN_DOCTOR)


def _targets(report: dict) -> set[str]:
    return {finding["target"] for finding in report["findings"]}


def _finding(report: dict, target: str) -> dict:
    [finding] = [f for f in report["findings"] if f["target"] == target]
    return finding


# -- stock PEFT's leak, diagnosed by a metamode imported afterwards -------------------


# `corrupted` leaves transformers.initialization (5.x only) among its leftovers.
@pytest.mark.requires_transformers_5
@pytest.mark.slow
def test_stock_peft_reproducer_corrupts_the_process_before_metamode_is_imported(corrupted):
    assert corrupted["metamode_imported_before"] is False
    assert corrupted["overlap"]["corrupted"] is True
    assert corrupted["overlap"]["register_parameter_is_torchs"] is False


@pytest.mark.requires_transformers_5
@pytest.mark.slow
def test_doctor_finds_the_leaked_patch_and_names_peft(corrupted):
    found = corrupted["stock_found"]
    assert found["ok"] is False
    assert _targets(found) == {"torch.nn.Module.register_parameter"}
    finding = found["findings"][0]
    assert finding["culprit"].startswith(
        "peft.utils.integrations._init_on_device.<locals>.register_empty_parameter"
    )
    assert "register_empty_parameter" in found["text"]
    assert finding["repaired"] is None  # nothing is touched without repair=True


@pytest.mark.requires_transformers_5
@pytest.mark.slow
def test_doctor_repair_restores_torchs_own_register_parameter(corrupted):
    repair = corrupted["stock_repair"]
    assert [f["repaired"] for f in repair["findings"]] == [True]
    assert "found inside the replacement" in repair["findings"][0]["action"]
    assert repair["remaining"] == []
    assert corrupted["stock_after"]["ok"] is True
    assert corrupted["stock_register_parameter_is_torchs"] is True
    assert corrupted["stock_linears_after_repair"] == ["cpu", "cpu"]


# -- every other kind of leftover -----------------------------------------------------


@pytest.mark.requires_transformers_5
@pytest.mark.slow
def test_doctor_finds_every_kind_of_leftover(corrupted):
    targets = _targets(corrupted["sink_found"])
    expected = {
        "torch.nn.Module.register_parameter",
        "torch.nn.Module.register_buffer",
        "torch.nn.Module.register_module",
        "torch.nn.init.kaiming_uniform_",
        "torch.nn.init.xavier_uniform_",
        "torch.nn.init.normal_",
        "torch.nn.modules.activation.xavier_uniform_",  # bound by name in torch
        "torch.nn.modules.transformer.xavier_uniform_",
        "torch.empty",
        "torch.zeros",
        "torch.ones",
        "torch.full",
        "torch.linspace",
        "peft.utils.integrations._init_on_device._skip",
        "default dtype",
        "default device (this thread)",
        "torch-function mode stack (this thread)",
    }
    assert expected <= targets, expected - targets


@pytest.mark.requires_transformers_5
@pytest.mark.slow
def test_each_finding_names_its_culprit(corrupted):
    found = corrupted["sink_found"]
    culprits = {
        "torch.nn.Module.register_buffer": "peft.utils.integrations._init_on_device.<locals>.",
        "torch.nn.init.kaiming_uniform_": "transformers.initialization.kaiming_uniform_",
        "torch.nn.modules.activation.xavier_uniform_": "transformers.initialization.",
        "torch.empty": "peft.utils.integrations._init_on_device.<locals>.patch_tensor_constructor",
        "torch.linspace": "leaky_lib.fake_linspace",
        "torch.nn.Module.register_module": "__main__.<lambda>",
        "peft.utils.integrations._init_on_device._skip": "peft.utils.integrations.",
    }
    for target, culprit in culprits.items():
        assert _finding(found, target)["culprit"].startswith(culprit), target
    modes = [f["culprit"] for f in found["findings"] if f["target"].startswith("torch-function")]
    assert sorted(modes) == ["__main__.LeakyMode", "metamode._core.modes.EmptyWeights"]


@pytest.mark.requires_transformers_5
@pytest.mark.slow
def test_repair_fixes_everything_and_a_second_look_finds_nothing(corrupted):
    repair = corrupted["sink_repair"]
    assert [f["target"] for f in repair["findings"] if not f["repaired"]] == []
    assert repair["remaining"] == []
    assert corrupted["sink_after"]["ok"] is True
    checks = corrupted["sink_checks"]
    assert checks["linears"] == ["cpu", "cpu"]
    assert checks["buffer_device"] == "cpu"
    assert checks["dtype"] == "torch.float32"
    assert checks["peft_skip"] is None
    assert checks["stack_depth"] == 0


@pytest.mark.requires_transformers_5
@pytest.mark.slow
def test_repair_puts_back_the_original_objects_where_they_survive(corrupted):
    assert corrupted["sink_checks"]["identities"] == dict.fromkeys(
        corrupted["sink_checks"]["identities"], True
    )
    # transformers kept the init originals in a dict: found in the heap
    action = _finding(corrupted["sink_repair"], "torch.nn.init.kaiming_uniform_")["action"]
    assert "found still referenced elsewhere" in action


@pytest.mark.requires_transformers_5
@pytest.mark.slow
def test_repair_recompiles_a_method_nothing_references_any_more(corrupted):
    action = _finding(corrupted["sink_repair"], "torch.nn.Module.register_module")["action"]
    assert "recompiled from" in action and "module.py" in action
    assert corrupted["sink_checks"]["register_module_works"] is True
    assert corrupted["sink_checks"]["register_module_qualname"] == "Module.register_module"


# -- in this process ------------------------------------------------------------------


def test_clean_process_reports_nothing():
    report = metamode.doctor()
    assert report.ok and report.findings == () and report.remaining == ()
    assert "clean" in str(report)
    repaired = metamode.doctor(repair=True)
    assert repaired.ok and repaired.findings == ()


def test_replaced_init_function_is_found_and_the_same_object_restored():
    original = torch.nn.init.zeros_
    bound = torch.nn.modules.activation.xavier_uniform_

    def skip_init(tensor, *args, **kwargs):
        return tensor

    torch.nn.init.zeros_ = skip_init
    torch.nn.modules.activation.xavier_uniform_ = skip_init
    try:
        report = metamode.doctor()
        assert _doctor_targets(report) == {
            "torch.nn.init.zeros_",
            "torch.nn.modules.activation.xavier_uniform_",
        }
        assert all("skip_init" in f.culprit for f in report.findings)
        repaired = metamode.doctor(repair=True)
        assert all(f.repaired for f in repaired.findings) and repaired.remaining == ()
        assert torch.nn.init.zeros_ is original
        assert torch.nn.modules.activation.xavier_uniform_ is bound
    finally:
        torch.nn.init.zeros_ = original
        torch.nn.modules.activation.xavier_uniform_ = bound


def test_a_device_table_built_while_a_factory_was_replaced_is_found_and_rebuilt():
    from torch.utils._device import _device_constructors

    original = torch.linspace

    def safe_linspace(*args, **kwargs):  # as transformers' meta_device_safe_creation_ops
        return original(*args, **kwargs)

    torch.linspace = safe_linspace
    _device_constructors.cache_clear()
    _device_constructors()  # built now, it holds safe_linspace
    torch.linspace = original
    try:
        with torch.device("meta"):
            assert torch.linspace(0, 1, 3).device.type == "cpu"  # what the finding is about
        report = metamode.doctor()
        [finding] = report.findings
        assert finding.target == "torch.utils._device._device_constructors()"
        assert "safe_linspace" in finding.culprit
        repaired = metamode.doctor(repair=True)
        assert repaired.findings[0].repaired and repaired.remaining == ()
        with torch.device("meta"):
            assert torch.linspace(0, 1, 3).device.type == "meta"
    finally:
        torch.linspace = original
        _device_constructors.cache_clear()
        _device_constructors()


def test_the_device_table_is_not_rebuilt_while_its_factory_is_still_replaced():
    from torch.utils._device import _device_constructors

    original = torch.linspace

    def safe_linspace(*args, **kwargs):
        return original(*args, **kwargs)

    torch.linspace = safe_linspace
    _device_constructors.cache_clear()
    _device_constructors()
    try:
        rebuilt = _doctor._rebuild_device_table
        with pytest.raises(_doctor._CannotRepair, match="is still replaced"):
            rebuilt(None)  # type: ignore[arg-type]
        assert safe_linspace in _device_constructors()
    finally:
        torch.linspace = original
        _device_constructors.cache_clear()
        _device_constructors()


def test_mode_left_on_this_thread_is_reported_and_removed():
    leftover = metamode.empty_weights()
    leftover.__enter__()
    try:
        report = metamode.doctor()
        [finding] = report.findings
        assert finding.culprit == "metamode._core.modes.EmptyWeights"
        repaired = metamode.doctor(repair=True)
        assert repaired.findings[0].repaired and repaired.remaining == ()
        assert nn.Linear(1, 1).weight.device.type == "cpu"
    finally:
        metamode._core.stack.remove(leftover)


def test_cli_exit_status_and_repair(capsys):
    assert _doctor.main([]) == 0
    assert "clean" in capsys.readouterr().out
    torch.set_default_dtype(torch.float64)
    try:
        assert _doctor.main([]) == 1
        assert "default dtype: is torch.float64" in capsys.readouterr().out
        assert _doctor.main(["--repair"]) == 1  # the process *was* corrupted
        assert "torch.set_default_dtype(torch.float32)" in capsys.readouterr().out
        assert torch.get_default_dtype() is torch.float32
    finally:
        torch.set_default_dtype(torch.float32)


def test_python_m_metamode_doctor_dispatches_here(capsys):
    from metamode.__main__ import main

    assert main(["doctor", "--import", "json"]) == 0
    assert "clean" in capsys.readouterr().out


def _doctor_targets(report: _doctor.DoctorReport) -> set[str]:
    return {finding.target for finding in report.findings}


# -- the default dtype and the loads that set it ------------------------------------------


def test_a_left_default_dtype_names_the_loading_paths_that_set_it():
    import diffusers.models.modeling_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    torch.set_default_dtype(torch.float16)
    try:
        [finding] = metamode.doctor().findings
        assert finding.target == "default dtype"
        assert "ModelMixin.from_pretrained(torch_dtype=...)" in finding.culprit
        assert "transformers' from_pretrained(dtype=...)" in finding.culprit
        with metamode.enabled():  # routed paths are no longer suspects
            [finding] = metamode.doctor().findings
            assert finding.culprit.startswith("unknown")
        repaired = metamode.doctor(repair=True)
        assert repaired.findings[0].repaired and torch.get_default_dtype() is torch.float32
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_loads_open_dtype_window_is_a_note_and_blocks_the_dtype_repair():
    from metamode._core.dtype_windows import dtype_window

    with dtype_window(torch.float16):
        report = metamode.doctor()
        assert report.ok
        assert any("dtype window" in note for note in report.notes)
        assert "note: thread" in str(report)
        torch.set_default_dtype(torch.float64)  # someone else's, inside the window
        repaired = metamode.doctor(repair=True)
        [finding] = repaired.findings
        assert not finding.repaired and "window is open" in finding.action
        assert torch.get_default_dtype() is torch.float64
        torch.set_default_dtype(torch.float16)
    assert torch.get_default_dtype() is torch.float32


def test_transformers_smart_apply_is_a_note_not_a_finding():
    added = "smart_apply" not in vars(nn.Module)
    if added:
        nn.Module.smart_apply = lambda module, fn: module  # what transformers adds
    try:
        report = metamode.doctor()
        assert any("smart_apply" in note for note in report.notes)
    finally:
        if added:
            del nn.Module.smart_apply
