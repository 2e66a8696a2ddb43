"""Toggling shims while stock contexts are in flight, reloads, ``include_buffers`` checking,
and the public ``is_enabled`` / ``enabled`` API."""

from __future__ import annotations

import importlib
import sys
import threading
import types
from collections.abc import Callable

import pytest
import torch

import metamode
from tests.conftest import run_python

peft_integrations = pytest.importorskip("peft.utils.integrations")
STOCK_SKIP = peft_integrations._skip_init_on_device  # PEFT's own: bound before any toggle
STOCK_BLOCK = peft_integrations.init_empty_weights
STOCK_INIT_ON_DEVICE = peft_integrations._init_on_device


def _flag() -> object:
    return vars(STOCK_INIT_ON_DEVICE).get("_skip", False)


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


class _Worker:
    """Runs ``body(pause)`` in a thread, up to its first ``pause()``; each :meth:`advance`
    lets it run to its next ``pause()`` or its end (none once it has ended), so the test
    sets every interleaving."""

    def __init__(self, body: Callable[[Callable[[], None]], object]) -> None:
        self.result: object = None
        self.errors: list[BaseException] = []
        self._finished = False
        self._go, self._arrived = threading.Semaphore(0), threading.Semaphore(0)
        self._thread = threading.Thread(target=self._run, args=(body,))
        self._thread.start()
        assert self._arrived.acquire(timeout=60)

    def _pause(self) -> None:
        self._arrived.release()
        assert self._go.acquire(timeout=60)

    def _run(self, body) -> None:
        try:
            self.result = body(self._pause)
        except BaseException as error:
            self.errors.append(error)
        finally:
            self._finished = True
            self._arrived.release()

    def advance(self) -> None:
        if self._finished:
            return
        self._go.release()
        assert self._arrived.acquire(timeout=60)

    def join(self) -> None:
        self._thread.join(60)
        assert not self._thread.is_alive()


class _PausingModule(types.ModuleType):
    """A PEFT module whose next rebinding, once armed, waits: a toggle caught half done."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        vars(self).update(armed=False, arrived=threading.Event(), resume=threading.Event())

    def __setattr__(self, name: str, value: object) -> None:
        if vars(self)["armed"]:
            vars(self)["armed"] = False
            self.arrived.set()
            assert self.resume.wait(60)
        super().__setattr__(name, value)


class _HalfDoneToggle:
    """``toggle`` run in a thread until it rebinds ``module``; :meth:`finish` lets it end."""

    def __init__(self, module: _PausingModule, toggle: Callable[[], object]) -> None:
        self.errors: list[BaseException] = []
        self._module = module
        vars(module)["armed"] = True
        self._thread = threading.Thread(target=self._run, args=(toggle,))
        self._thread.start()
        assert module.arrived.wait(60), "the toggle never reached the pausing module"

    def _run(self, toggle) -> None:
        try:
            toggle()
        except BaseException as error:
            self.errors.append(error)

    def finish(self) -> None:
        self._module.resume.set()
        self._thread.join(60)
        assert not self._thread.is_alive() and not self.errors


@pytest.fixture
def pausing_module():
    """Makes a ``peft.`` module holding the given PEFT originals (rebound by the shim),
    inserted after every other PEFT module and followed by a plain one holding them too,
    so that a toggle paused there has rebound some modules and not others. The shim is off
    again at the end."""
    made: list[types.ModuleType] = []

    def make(**held: object) -> _PausingModule:
        module = _PausingModule(f"peft.zzz_metamode_pausing_{len(made)}")
        follower = types.ModuleType(f"{module.__name__}_follower")
        for new in (module, follower):
            vars(new).update(held)
            sys.modules[new.__name__] = new
            made.append(new)
        return module

    yield make
    for module in made:
        if isinstance(module, _PausingModule):
            module.resume.set()
    metamode.disable_for_peft()
    for module in made:
        del sys.modules[module.__name__]
    assert _flag() is False


def _adalora_builder(r: int = 2) -> Callable[[], torch.nn.Module]:
    """Builds, when called, an AdaLoRA layer by PEFT's own code (its ``ranknum`` registered
    inside ``_skip_init_on_device``) around a real base layer made now."""
    from peft import AdaLoraConfig
    from peft.tuners.adalora.layer import SVDLinear

    base = torch.nn.Linear(4, 4)
    config = AdaLoraConfig(init_r=r, target_modules=["x"], total_step=10)
    return lambda: SVDLinear(base, "default", config, r=r)


def _placement(layer) -> dict[str, object]:
    return {
        "ranknum": layer.ranknum["default"].device.type,
        "ranknum value": layer.ranknum["default"].item()
        if not layer.ranknum["default"].is_meta
        else None,
        "lora": {layer.lora_A["default"].device.type, layer.lora_B["default"].device.type},
    }


STOCK_PLACEMENT = {"ranknum": "cpu", "ranknum value": 2.0, "lora": {"meta"}}


@pytest.mark.parametrize("toggle", ["enable mid-block", "disable mid-block"])
def test_toggling_peft_shim_while_stock_skip_context_is_open_leaves_no_stuck_flag(toggle):
    """Another thread really inside the stock context across the toggle."""
    stock_skip = STOCK_SKIP
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
    from metamode.integrations import _registry
    from metamode.integrations import peft as _peft

    originals = {n: vars(peft_integrations)[n] for n in _peft._PEFT.replacements}
    # Put back afterwards: other test modules hold the module's classes and functions.
    namespace, registered = dict(vars(_peft)), _registry._REGISTERED["peft"]
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
        vars(_peft).update(namespace)
        _registry.register(registered)
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
    import transformers.modeling_utils as modeling_utils

    from metamode.integrations import _registry

    monkeypatch.delattr(initialization, "meta_device_safe_creation_ops")
    monkeypatch.delattr(initialization, "no_tie_weights")
    monkeypatch.delattr(initialization, "guard_torch_init_functions")
    monkeypatch.delattr(modeling_utils, "local_torch_dtype")
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


# -- PEFT: stock code running while a toggle is half done ------------------------------


def _stock_skip_exits(pause):
    with STOCK_SKIP():
        pause()  # entered before the toggle; exits in its middle


def _stock_skip_enters(pause):
    pause()
    with STOCK_SKIP():  # entered in the toggle's middle
        pause()  # exits after the toggle
        return _flag()


def _stock_block_registers(pause):
    with STOCK_BLOCK():  # opened before the toggle
        pause()
        return torch.nn.Linear(2, 2).weight.device.type  # registered in its middle


STOCK_RESULT = {_stock_skip_exits: None, _stock_skip_enters: True, _stock_block_registers: "meta"}


@pytest.mark.parametrize("body", list(STOCK_RESULT), ids=lambda body: body.__name__[1:])
@pytest.mark.parametrize("toggle", ["enable", "disable"])
def test_stock_peft_code_running_while_a_toggle_is_half_done(
    pausing_module, monkeypatch, toggle, body
):
    """Nothing raises, stock code sees its own flag, and the flag ends where it started."""
    from metamode.integrations import _rebind
    from metamode.integrations import peft as _peft

    # As in the first enable of a process: nothing recorded about PEFT yet.
    monkeypatch.delitem(_rebind.SHARED, _peft._PEFT_FUNCTION, raising=False)
    pausing = pausing_module(held=STOCK_INIT_ON_DEVICE)
    if toggle == "disable":
        metamode.enable_for_peft()
    worker = _Worker(body)
    half_done = _HalfDoneToggle(
        pausing, metamode.enable_for_peft if toggle == "enable" else metamode.disable_for_peft
    )
    worker.advance()
    half_done.finish()
    worker.advance()
    worker.join()
    assert not worker.errors, worker.errors
    assert worker.result == STOCK_RESULT[body]
    assert _flag() is False, "PEFT's _init_on_device._skip stuck"


def test_a_half_done_disable_keeps_the_home_module_routed_until_the_last_binding(
    pausing_module,
):
    """A module the disable has not reached yet still hands out metamode's skip; PEFT's
    patch (a stock block opened before enable) must then find metamode's flag in
    peft.utils.integrations, which therefore is restored last."""
    pausing = pausing_module(skip=STOCK_SKIP)

    def body(pause):
        with STOCK_BLOCK():
            pause()  # the shim is enabled, then half disabled
            with pausing.skip():  # metamode's: the disable has not rebound this module yet
                return torch.nn.Linear(2, 2).weight.device.type

    worker = _Worker(body)
    metamode.enable_for_peft()
    half_done = _HalfDoneToggle(pausing, metamode.disable_for_peft)
    routed = vars(peft_integrations)["_init_on_device"] is not STOCK_INIT_ON_DEVICE
    worker.advance()
    half_done.finish()
    worker.join()
    assert routed, "peft.utils.integrations was restored before a module still routed"
    assert not worker.errors and worker.result == "cpu", (worker.errors, worker.result)


def test_the_shims_flag_never_raises_even_before_any_enable(monkeypatch):
    from metamode.integrations import _rebind
    from metamode.integrations import peft as _peft

    monkeypatch.delitem(_rebind.SHARED, _peft._PEFT_FUNCTION, raising=False)
    replacement = _peft._init_on_device
    assert replacement._skip is False
    replacement._skip = True
    try:
        assert _flag() is True and replacement._skip is True
    finally:
        del replacement._skip
    assert "_skip" not in vars(STOCK_INIT_ON_DEVICE)


def test_replacements_held_across_disable_keep_working():
    metamode.enable_for_peft()
    held_init_on_device = peft_integrations._init_on_device
    held_block, held_skip = (
        peft_integrations.init_empty_weights,
        peft_integrations._skip_init_on_device,
    )
    metamode.disable_for_peft()
    assert peft_integrations._init_on_device is STOCK_INIT_ON_DEVICE
    held_init_on_device._skip = True
    try:
        assert _flag() is True and held_init_on_device._skip is True
    finally:
        del held_init_on_device._skip
    assert _flag() is False
    with held_block():
        weight = torch.nn.Linear(2, 2).weight
        with held_skip():
            real = torch.nn.Linear(2, 2).weight
    with held_init_on_device(torch.device("meta")):
        other = torch.nn.Linear(2, 2).weight
    assert weight.is_meta and not real.is_meta and other.is_meta


# -- PEFT: blocks open across a toggle, in one thread -----------------------------------


def test_a_stock_block_open_across_enable_keeps_adalora_ranknum_real():
    """Inside PEFT's block opened before enable, AdaLoRA's skip is metamode's: PEFT's own
    patch still leaves ranknum real (the calling thread is inside metamode's skip)."""
    build = _adalora_builder()
    try:
        with STOCK_BLOCK():
            metamode.enable_for_peft()
            layer = build()
    finally:
        metamode.disable_for_peft()
    assert _placement(layer) == STOCK_PLACEMENT


def test_a_shim_block_open_across_disable_keeps_adalora_ranknum_real():
    """Inside the shim's block still open after disable, AdaLoRA's skip is stock's again:
    the block honours PEFT's flag, as the stock block it replaced would."""
    build = _adalora_builder()
    metamode.enable_for_peft()
    block = peft_integrations.init_empty_weights
    try:
        with block():
            metamode.disable_for_peft()
            layer = build()
    finally:
        metamode.disable_for_peft()
    assert _placement(layer) == STOCK_PLACEMENT
    assert _flag() is False


def test_a_shim_block_honours_a_stock_skip_open_across_a_re_enable():
    metamode.enable_for_peft()
    try:
        with peft_integrations.init_empty_weights():
            metamode.disable_for_peft()
            with STOCK_SKIP():
                metamode.enable_for_peft()
                real = torch.nn.Linear(2, 2).weight
            meta = torch.nn.Linear(2, 2).weight
    finally:
        metamode.disable_for_peft()
    assert not real.is_meta and meta.is_meta and _flag() is False


# -- PEFT: what stays thread-scoped while the shim is on ------------------------------------


def test_a_stock_skip_in_another_thread_does_not_reach_the_shims_blocks():
    """PEFT's flag is process-wide; the shim's block, on since it was entered, ignores it."""
    metamode.enable_for_peft()
    try:
        worker = _Worker(_stock_skip_exits)  # holds PEFT's flag True
        try:
            assert _flag() is True
            with peft_integrations.init_empty_weights():
                weight = torch.nn.Linear(2, 2).weight
        finally:
            worker.advance()
            worker.join()
    finally:
        metamode.disable_for_peft()
    assert weight.is_meta and not worker.errors and _flag() is False


def test_metamode_skip_in_one_thread_does_not_reach_a_stock_block_in_another():
    """While the other thread's stock block patches ``register_parameter`` for every thread,
    a registration in this thread's metamode skip stays real and the other thread's own
    registration still goes to meta."""
    worker = _Worker(_stock_block_registers)  # opened before enable
    metamode.enable_for_peft()
    try:
        with peft_integrations._skip_init_on_device():
            mine = torch.nn.Linear(2, 2).weight  # through the other thread's patch
            worker.advance()  # registers in the other thread's stock block
    finally:
        metamode.disable_for_peft()
    worker.join()
    assert not worker.errors and worker.result == "meta"
    assert not mine.is_meta and _flag() is False


# -- PEFT: free-running toggles -------------------------------------------------------------


@pytest.mark.slow
def test_toggling_the_peft_shim_while_another_thread_injects_adalora():
    """The reported workload, bounded: every injection finishes and the flag ends False."""
    result = run_python(
        """
import json, sys, threading
import torch
from torch import nn
import metamode
import peft.utils.integrations as integrations
from peft import AdaLoraConfig, get_peft_model

class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

stock = integrations._init_on_device
running, stop, errors, injections = threading.Event(), threading.Event(), [], [0]

def inject():
    while not stop.is_set():
        config = AdaLoraConfig(init_r=4, target_modules=["a", "b"], total_step=10)
        try:
            get_peft_model(TwoLinear(), config, low_cpu_mem_usage=True)
            injections[0] += 1
        except Exception as error:
            errors.append(repr(error))
        running.set()

thread = threading.Thread(target=inject)
thread.start()
assert running.wait(120)  # the first toggles meet injections under way, not imports
sys.setswitchinterval(1e-6)
for _ in range(200):
    metamode.enable_for_peft()
    metamode.disable_for_peft()
stop.set()
thread.join()
with integrations.init_empty_weights():
    meta_after = nn.Linear(2, 2).weight.is_meta
print(json.dumps({"errors": errors[:3], "injections": injections[0],
                  "flag": vars(stock).get("_skip", False), "meta_after": meta_after}))
"""
    )
    assert result["errors"] == [] and result["injections"] > 0, result
    assert result["flag"] is False and result["meta_after"] is True, result
