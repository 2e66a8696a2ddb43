"""Toggling shims while stock contexts are in flight, reloads, ``include_buffers``
checking, and the public ``is_enabled`` / ``enabled`` API."""

from __future__ import annotations

import importlib
import threading

import pytest
import torch

import metamode

peft_integrations = pytest.importorskip("peft.utils.integrations")


def _flag() -> object:
    return vars(peft_integrations._init_on_device).get("_skip", False)


def _stock_peft_moves_to_meta() -> bool:
    with peft_integrations.init_empty_weights():
        return torch.nn.Linear(2, 2).weight.is_meta


def _hold_open(context, entered: threading.Event, release: threading.Event, errors: list):
    def run():
        try:
            with context:
                entered.set()
                release.wait()
        except BaseException as error:  # pragma: no cover - reported by the test
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("toggle", ["enable mid-block", "disable mid-block"])
def test_toggling_peft_shim_while_stock_skip_context_is_open_leaves_no_stuck_flag(toggle):
    """A toggle while another thread is really inside the stock context."""
    stock_skip = peft_integrations._skip_init_on_device  # bound before any toggle
    assert not metamode.is_enabled("peft")
    if toggle == "disable mid-block":
        metamode.enable_for_peft()
    entered, release, errors = threading.Event(), threading.Event(), []
    try:
        thread = _hold_open(stock_skip(), entered, release, errors)
        assert entered.wait(60)
        if toggle == "enable mid-block":
            metamode.enable_for_peft()
        else:
            metamode.disable_for_peft()
        release.set()
        thread.join(60)
        assert not errors
    finally:
        release.set()
        metamode.disable_for_peft()
    assert _flag() is False, "stock _init_on_device._skip stuck: PEFT's low_cpu_mem_usage is off"
    assert _stock_peft_moves_to_meta()
    assert not [f for f in metamode.doctor().findings if "_skip" in f.target]


def test_doctor_names_an_open_stock_skip_block_truthfully():
    entered, release, errors = threading.Event(), threading.Event(), []
    thread = _hold_open(peft_integrations._skip_init_on_device(), entered, release, errors)
    try:
        assert entered.wait(60)
        (finding,) = [f for f in metamode.doctor().findings if "_skip" in f.target]
        assert "still open in another thread" in finding.culprit
        assert "swapped" in finding.culprit
    finally:
        release.set()
        thread.join(60)
    assert not errors and _flag() is False


def test_disable_after_reload_restores_the_librarys_functions():
    from metamode.integrations import peft as _peft

    originals = {n: vars(peft_integrations)[n] for n in _peft._PEFT.replacements}
    metamode.enable_for_peft()
    try:
        importlib.reload(_peft)
        assert _peft.peft_enabled()
        restored = _peft.disable_for_peft()
        assert "peft.utils.integrations._init_on_device" in restored
        for name, original in originals.items():
            assert vars(peft_integrations)[name] is original, name
    finally:
        metamode.disable_for_peft()
        for name, original in originals.items():
            assert vars(peft_integrations)[name] is original, name


@pytest.mark.parametrize(
    "make",
    [
        lambda v: metamode.init_empty_weights(include_buffers=v),
        lambda v: metamode.init_on_device("meta", include_buffers=v),
    ],
)
def test_include_buffers_rejects_non_bools_naming_the_value(make):
    with pytest.raises(TypeError, match="'no'"):
        make("no")
    assert make(None) is not None


def test_peft_shim_include_buffers_rejects_non_bools():
    with metamode.enabled("peft"):
        with pytest.raises(TypeError, match="'no'"):
            peft_integrations.init_empty_weights(include_buffers="no")
        with peft_integrations.init_empty_weights(include_buffers=None):
            assert torch.nn.Linear(2, 2).weight.is_meta


def test_is_enabled_and_scoped_enabled():
    assert not metamode.is_enabled("peft")
    with metamode.enabled("peft"):
        assert metamode.is_enabled("peft")
        with metamode.enabled("peft"):
            pass
        assert metamode.is_enabled("peft"), "an inner block leaves an outer one's shim on"
    assert not metamode.is_enabled("peft")
    metamode.enable_for_peft()
    try:
        with metamode.enabled("peft"):
            pass
        assert metamode.is_enabled("peft"), "a shim on before the block stays on"
    finally:
        metamode.disable_for_peft()
    with pytest.raises(ValueError, match="'torchvision'"):
        metamode.is_enabled("torchvision")


def test_enable_reports_a_library_with_nothing_to_route_instead_of_failing(monkeypatch):
    """A version with nothing to route is not an error; enable() says why."""
    import transformers.initialization as initialization

    from metamode.integrations import _registry

    monkeypatch.delattr(initialization, "meta_device_safe_creation_ops")
    monkeypatch.delattr(initialization, "no_tie_weights")
    real_installed = _registry._installed
    monkeypatch.setattr(
        _registry, "_installed", lambda lib: lib != "accelerate" and real_installed(lib)
    )
    result = metamode.enable()
    try:
        assert isinstance(result, metamode.EnableResult)
        assert result["transformers"] == ()
        assert "meta_device_safe_creation_ops" in result.left_alone["transformers"]
        assert result.left_alone["accelerate"] == "not installed"
        assert "peft.utils.integrations._init_on_device" in result["peft"]
        assert metamode.is_enabled("peft") and not metamode.is_enabled("transformers")
        assert metamode.enable_for_transformers() == ()
    finally:
        metamode.disable()
    assert not any(metamode.is_enabled(lib) for lib in ("peft", "diffusers", "transformers"))
