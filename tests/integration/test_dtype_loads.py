"""Concurrent ``from_pretrained`` loads with a dtype, with ``metamode.enable()``: each model
is the one a lone stock load returns, the process default dtype ends where it was, and no
torch function is reassigned. The scenarios also run in subprocesses against the stock
libraries, to show that they catch the bug they name."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import metamode
from metamode._core import dtype_windows
from metamode.integrations import _registry
from metamode.lab import dtype_loads
from metamode.lab.threads import WAIT_S, run_threads, wait
from tests.conftest import REPO, run_python
from tests.integration.test_integrations_hf import _Gates

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

TRANSFORMERS_MAJOR = int(__import__("transformers").__version__.split(".")[0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    return dtype_loads.save_models(str(tmp_path_factory.mktemp("dtype-loads")))


def _notify_windows() -> None:
    """Wake whoever waits in ``dtype_windows.wait_until`` to re-check its predicate."""
    with dtype_windows._condition:
        dtype_windows._condition.notify_all()


def forced_mixed(paths: dict[str, str], name: str) -> dict[str, Any]:
    """A loads ``name`` in float16; inside its construction it waits until B, loading in
    float32, has started and is either parked on A's dtype window (metamode) or inside its
    own construction (stock). B then waits inside its construction until A's load is done,
    or A is parked on B's window (a pipeline's next component). Each model against a lone
    load of its dtype, and the default dtype afterwards."""
    load = dtype_loads.loader(name, paths[name])
    alone = {dtype: load(dtype) for dtype in (torch.float16, torch.float32)}
    a_done, b_inside = threading.Event(), threading.Event()
    models: dict[torch.dtype, nn.Module] = {}
    errors: list[str] = []
    idents: dict[str, int] = {}

    def load_into_models(who: str, dtype: torch.dtype) -> None:
        try:
            models[dtype] = load(dtype)
        except Exception as error:  # stock's race may leave a model on meta that a load refuses
            errors.append(f"{who}: {type(error).__name__}: {error}")

    def parked(who: str, state: dtype_windows.WindowState) -> bool:
        return who in idents and idents[who] in state.parked

    def a(gates: _Gates) -> None:
        def gate() -> None:
            threads.append(threading.Thread(target=lambda: b_load(gates)))
            threads[0].start()
            if not dtype_windows.wait_until(lambda s: b_inside.is_set() or parked("B", s), WAIT_S):
                raise TimeoutError("deadlocked waiting for B")

        idents["A"] = threading.get_ident()
        gates.arm(gate)
        try:
            load_into_models("A", torch.float16)
        finally:
            a_done.set()
            _notify_windows()

    def b_load(gates: _Gates) -> None:
        def gate() -> None:
            b_inside.set()
            _notify_windows()
            if not dtype_windows.wait_until(lambda s: a_done.is_set() or parked("A", s), WAIT_S):
                raise TimeoutError("deadlocked waiting for A")

        idents["B"] = threading.get_ident()
        _notify_windows()
        gates.arm(gate)
        load_into_models("B", torch.float32)

    threads: list[threading.Thread] = []
    with _Gates() as gates:
        run_threads([lambda: a(gates)])
        for thread in threads:
            thread.join()

    def differs(dtype: torch.dtype) -> list:
        if dtype not in models:
            return ["not loaded"]
        return dtype_loads.differences(models[dtype], alone[dtype])[:2]

    return {
        "float16_differs": differs(torch.float16),
        "float32_differs": differs(torch.float32),
        "errors": errors,
        "default_dtype_after": str(torch.get_default_dtype()),
    }


_STOCK = """
import json, sys, tempfile, warnings
sys.path.insert(0, {repo!r})
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
from metamode.lab import dtype_loads
from tests.integration.test_dtype_loads import {function}
with tempfile.TemporaryDirectory() as directory:
    paths = dtype_loads.save_models(directory)
    print(json.dumps({function}(paths, {name!r})))
"""


def _stock(function: str, name: str) -> dict[str, Any]:
    return run_python(_STOCK.format(repo=str(REPO), function=function, name=name))


_MODELS = ["llama", "unet", "sdxl"]


@pytest.mark.per_interpreter
@pytest.mark.parametrize("name", _MODELS)
def test_forced_float16_and_float32_loads_each_build_a_lone_loads_model(saved, all_shims, name):
    result = forced_mixed(saved, name)
    assert result == {
        "float16_differs": [],
        "float32_differs": [],
        "errors": [],
        "default_dtype_after": "torch.float32",
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", _MODELS)
def test_stock_forced_float16_and_float32_loads_corrupt_the_model_or_the_default(name):
    """The scenario above catches the bug: stock leaves the process in float16, and
    transformers builds A's Llama partly in float32. (Where transformers kernelizes after
    loading, with ``kernels`` installed, a model the race left on meta makes that load raise.)"""
    result = _stock("forced_mixed", name)
    assert result["default_dtype_after"] == "torch.float16"
    if name == "llama":
        assert result["float16_differs"], "A built part of its model in float32"


@pytest.mark.slow
@pytest.mark.per_interpreter
@pytest.mark.parametrize(
    "pairs",
    [
        [("llama", torch.float16), ("llama", torch.float32)],
        [("llama", torch.float32), ("gpt2", torch.float32)],
        [("unet", torch.float16), ("unet", torch.float32)],
        [("llama", torch.bfloat16), ("unet", torch.float16), ("gpt2", torch.float32)],
        [("sdxl", torch.float16), ("sdxl", torch.float32)],
    ],
    ids=["transformers-mixed", "transformers-same", "diffusers-mixed", "three-dtypes", "pipeline"],
)
def test_barrier_rounds_of_concurrent_loads_are_each_exact(saved, all_shims, pairs):
    """Bounded stress: 20 rounds released by a barrier, 1 µs switch interval, a bystander
    building modules throughout."""
    result = dtype_loads.race(saved, pairs, rounds=20)
    assert (result["wrong_rounds"], result["errors"], result["examples"]) == (0, 0, [])
    assert result["default_dtype_after"] == "torch.float32"
    assert result["init_functions_replaced"] == 0


@pytest.mark.parametrize("name", [*_MODELS, "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_lone_load_with_the_shims_is_stocks_bitwise_with_the_generator(saved, name, dtype):
    load = dtype_loads.loader(name, saved[name])
    torch.manual_seed(7)
    stock = load(dtype)
    stock_state = torch.get_rng_state()
    with metamode.enabled():
        torch.manual_seed(7)
        shimmed = load(dtype)
        assert torch.equal(torch.get_rng_state(), stock_state)
    assert dtype_loads.differences(shimmed, stock) == []
    assert [p.dtype for p in shimmed.parameters()] == [p.dtype for p in stock.parameters()]


# -- a load that raises ------------------------------------------------------------------


def failing_load(paths: dict[str, str], name: str) -> dict[str, Any]:
    """A float16 load whose model constructor raises, then the default dtype."""
    from diffusers import UNet2DModel

    class Broken(UNet2DModel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("the constructor failed")

    with contextlib.suppress(RuntimeError):
        Broken.from_pretrained(paths[name], torch_dtype=torch.float16)
    return {"default_dtype_after": str(torch.get_default_dtype())}


def test_a_stock_call_outside_a_routed_load_keeps_stock_behaviour(all_shims):
    """A load that began before ``enable()`` reaches metamode's ``_set_default_torch_dtype``
    from diffusers' own ``from_pretrained``: nothing would close a window, so it sets the
    default as stock does and returns the old one."""
    from diffusers import UNet2DModel

    try:
        assert UNet2DModel._set_default_torch_dtype(torch.float16) == torch.float32
        assert torch.get_default_dtype() == torch.float16
        assert dtype_windows.state().stacks == {}
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_diffusers_load_that_raises_puts_the_default_dtype_back(saved, all_shims):
    assert failing_load(saved, "unet") == {"default_dtype_after": "torch.float32"}
    assert dtype_windows.state().stacks == {}


@pytest.mark.slow
def test_stock_diffusers_load_that_raises_leaves_the_process_in_float16():
    assert _stock("failing_load", "unet") == {"default_dtype_after": "torch.float16"}


# -- transformers 5's guard on torch.nn.init -----------------------------------------------


def _guard_probe_classes() -> tuple[type, type]:
    from transformers import PretrainedConfig, PreTrainedModel

    class GuardProbeConfig(PretrainedConfig):
        model_type = "metamode-guard-probe"

    class GuardProbe(PreTrainedModel):
        """A linear layer whose weight the checkpoint has and whose bias it lacks, and an
        attention whose in-projection weight it has: ``_init_weights`` calls torch's init
        functions on both (the linear's by attribute, the attention's by bare name inside
        ``torch.nn.modules.activation``), and only the missing tensors may change."""

        config_class = GuardProbeConfig
        base_model_prefix = "probe"
        gates: ClassVar[dict[str, Callable[[], None]]] = {}

        def __init__(self, config: PretrainedConfig) -> None:
            gate = type(self).gates.get("construction")
            if gate is not None:
                gate()
            super().__init__(config)
            self.linear = nn.Linear(4, 4)
            self.attention = nn.MultiheadAttention(4, 1)
            self.post_init()

        def _init_weights(self, module: nn.Module) -> None:
            gate = type(self).gates.get("initialize_weights")
            if gate is not None:
                gate()
            if isinstance(module, nn.Linear) and not isinstance(
                module, nn.modules.linear.NonDynamicallyQuantizableLinear
            ):
                torch.nn.init.normal_(module.weight)
                torch.nn.init.uniform_(module.bias)
            if isinstance(module, nn.MultiheadAttention):
                module._reset_parameters()

    return GuardProbeConfig, GuardProbe


def save_guard_probe(directory: str) -> type:
    """Save a GuardProbe without ``linear.bias`` and ``attention.in_proj_bias``."""
    from safetensors.torch import save_file

    config_class, probe = _guard_probe_classes()
    torch.manual_seed(3)
    model = probe(config_class())
    model.save_pretrained(directory)
    weights = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if k not in ("linear.bias", "attention.in_proj_bias")
    }
    save_file(weights, f"{directory}/model.safetensors", metadata={"format": "pt"})
    return probe


@pytest.mark.per_interpreter
@pytest.mark.requires_transformers_5
def test_the_guard_skips_loaded_tensors_exactly_as_stock(tmp_path):
    probe = save_guard_probe(str(tmp_path))
    torch.manual_seed(11)
    stock = probe.from_pretrained(str(tmp_path))
    state = torch.get_rng_state()
    with metamode.enabled("transformers"):
        torch.manual_seed(11)
        shimmed = probe.from_pretrained(str(tmp_path))
        assert torch.equal(torch.get_rng_state(), state)
    assert dtype_loads.differences(shimmed, stock) == []
    saved = load_file(f"{tmp_path}/model.safetensors")  # the loaded tensors kept their values:
    assert torch.equal(shimmed.linear.weight, saved["linear.weight"])
    assert torch.equal(shimmed.attention.in_proj_weight, saved["attention.in_proj_weight"])


def overlapping_loads(directory: str, where: str) -> dict[str, Any]:
    """Two float32 loads of the probe: A, at ``where`` ("construction" or
    "initialize_weights"), waits until B is there too, then A finishes first (the order that
    leaks stock's guard). There, for each: is ``torch.nn.init.normal_`` torch's own, and how
    many threads' dtype windows run; afterwards, which torch functions are replaced."""
    probe = _guard_probe_classes()[1]
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, Any] = {}
    names = {}

    def gate() -> None:
        name = names.get(threading.get_ident())
        if name is None or name in seen:
            return
        seen[name] = {
            "normal_ is torch's": torch.nn.init.normal_.__module__ == "torch.nn.init",
            "windows running": len(dtype_windows.state().running),
        }
        if name == "A":
            a_inside.set()
            wait(b_inside, f"B at {where}")
        else:
            b_inside.set()
            wait(a_done, "A's load")

    def load(name: str) -> None:
        names[threading.get_ident()] = name
        try:
            probe.from_pretrained(directory, dtype=torch.float32)
        finally:
            if name == "A":
                a_done.set()

    def b() -> None:
        wait(a_inside, f"A at {where}")
        load("B")

    probe.gates = {where: gate}
    try:
        run_threads([lambda: load("A"), b])
    finally:
        probe.gates = {}
    seen["replaced after"] = dtype_loads.not_torchs()
    return seen


@pytest.mark.per_interpreter
@pytest.mark.requires_transformers_5
def test_overlapping_same_dtype_loads_reassign_no_torch_function(tmp_path, all_shims):
    save_guard_probe(str(tmp_path))
    seen = overlapping_loads(str(tmp_path), "initialize_weights")
    assert seen["replaced after"] == []
    assert seen["A"]["normal_ is torch's"] and seen["B"]["normal_ is torch's"]


@pytest.mark.per_interpreter
def test_same_dtype_loads_build_at_the_same_time(tmp_path, all_shims):
    """No load lock: B's dtype window opens while A's is open, both constructing."""
    save_guard_probe(str(tmp_path))
    seen = overlapping_loads(str(tmp_path), "construction")
    assert seen["A"]["windows running"] == 1
    assert seen["B"]["windows running"] == 2


_STOCK_GUARDS = """
import json, sys, tempfile, warnings
sys.path.insert(0, {repo!r})
warnings.filterwarnings("ignore")
from tests.integration.test_dtype_loads import overlapping_loads, save_guard_probe
with tempfile.TemporaryDirectory() as directory:
    save_guard_probe(directory)
    print(json.dumps(overlapping_loads(directory, "initialize_weights")))
"""


@pytest.mark.slow
@pytest.mark.requires_transformers_5
def test_stock_overlapping_loads_leave_transformers_guards_in_torch():
    seen = run_python(_STOCK_GUARDS.format(repo=str(REPO)))
    assert "torch.nn.init.normal_" in seen["replaced after"]
    assert not seen["B"]["normal_ is torch's"]


# -- enable and disable ----------------------------------------------------------------------


def _bindings() -> dict[str, object]:
    from diffusers.models import modeling_utils as diffusers_modeling
    from transformers import modeling_utils

    found = {
        f"ModelMixin.{n}": vars(diffusers_modeling.ModelMixin)[n]
        for n in ("from_pretrained", "_set_default_torch_dtype")
    }
    owner = vars(modeling_utils.PreTrainedModel)
    for name in ("initialize_weights", "from_pretrained", "_from_config", "_set_default_dtype"):
        if name in owner:
            found[f"PreTrainedModel.{name}"] = owner[name]
    if "local_torch_dtype" in vars(modeling_utils):
        found["modeling_utils.local_torch_dtype"] = modeling_utils.local_torch_dtype
    return found


def test_enable_routes_every_dtype_binding_and_disable_restores_each():
    before = _bindings()
    result = metamode.enable()
    try:
        during = _bindings()
        routed = [k for k in before if during[k] is not before[k]]
        assert "ModelMixin.from_pretrained" in routed
        assert "ModelMixin._set_default_torch_dtype" in routed
        if TRANSFORMERS_MAJOR >= 5:
            assert {"PreTrainedModel.initialize_weights", "modeling_utils.local_torch_dtype"} <= {
                *routed
            }
            assert (
                "transformers.modeling_utils.PreTrainedModel.initialize_weights"
                in (result["transformers"])
            )
        else:
            assert {
                "PreTrainedModel.from_pretrained",
                "PreTrainedModel._from_config",
                "PreTrainedModel._set_default_dtype",
            } <= {*routed}
        assert metamode.enable() == result  # idempotent
    finally:
        _registry.disable()
    after = _bindings()
    assert [k for k in before if after[k] is not before[k]] == []


def _refused_with_nothing_changed(monkeypatch, name: str) -> None:
    from transformers import modeling_utils

    plain = classmethod(lambda cls, *args, **kwargs: None)
    monkeypatch.setattr(modeling_utils.PreTrainedModel, name, plain)
    before = _bindings()
    with pytest.raises(metamode.IncompatibleLibraryError, match=name):
        metamode.enable_for_transformers()
    assert not metamode.is_enabled("transformers")
    assert _bindings() == before


@pytest.mark.requires_transformers_5
def test_an_initialize_weights_without_the_guard_decorator_is_refused(monkeypatch):
    _refused_with_nothing_changed(monkeypatch, "initialize_weights")


@pytest.mark.requires_transformers_4
def test_a_from_pretrained_without_restore_default_dtype_is_refused(monkeypatch):
    _refused_with_nothing_changed(monkeypatch, "from_pretrained")


def test_differences_sees_non_persistent_buffers_and_their_ties():
    """What a race compares: a buffer ``state_dict`` leaves out (rotary ``inv_freq``, XGLM's
    positions) counts too."""

    def model(positions: torch.Tensor) -> nn.Module:
        module = nn.Linear(2, 2)
        module.register_buffer("positions", positions, persistent=False)
        return module

    torch.manual_seed(0)
    reference = model(torch.arange(3.0))
    same = model(torch.arange(3.0))
    same.load_state_dict(reference.state_dict())
    assert dtype_loads.differences(same, reference) == []
    rounded = model(torch.arange(3.0).half())
    rounded.load_state_dict(reference.state_dict())
    assert dtype_loads.differences(rounded, reference) == [
        "positions is torch.float16 on cpu, expected torch.float32"
    ]
