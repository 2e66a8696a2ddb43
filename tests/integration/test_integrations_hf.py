"""accelerate, diffusers and transformers shims: rebinding, and concurrent loads.

The headline scenario (``unet_race``): two threads call
``UNet2DConditionModel.from_pretrained(checkpoint, low_cpu_mem_usage=True)``
on a tiny saved UNet while a third thread builds modules. Events hooked into
model construction force the worst interleaving on every round: A is inside
its construction contexts, B enters its own, the bystander builds (both loads
are mid-construction), then one loader finishes while the other is still
inside (alternating which one, so both exit orders are covered). Stock
diffusers + accelerate leak ``register_parameter``'s patch on the first round
and give the bystander meta, uninitialised parameters; after
``metamode.enable()`` nothing leaks in any round, both models equal a
sequential load, and the bystander's modules are always initialised on cpu.

The gate that forces the interleaving is a callback armed by the *loader
thread* before its ``from_pretrained`` call and run at that thread's first
parameter registration -- the model's first parameter, so inside the
library's contexts (each round records that it was). Nothing sleeps to
synchronise. Measured on the stock libraries without the forced order (1 µs
switch interval, 2 cores): the first leak came in round 1-3 of 6 fresh
processes out of 6, and a free-running bystander got no-op init in 62-67% of
its builds during ``low_cpu_mem_usage=False`` loads.

transformers: only ``meta_device_safe_creation_ops`` and ``no_tie_weights``
can be routed through metamode (see ``metamode/integrations/transformers.py``);
the tests show what the shim fixes and, in a subprocess, what stays
process-global.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

import metamode
from metamode._core import dtype_windows
from metamode.integrations import _registry
from metamode.lab.scenarios import run_rounds
from metamode.lab.threads import WAIT_S, run_threads, wait
from tests.conftest import REPO, run_python

_FREE_BUILDS_PER_ROUND = 20
_TORCHS_CONSTANT_ = nn.init.constant_
UNET_CONFIG: dict[str, Any] = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 1,
    "block_out_channels": (8, 16),
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 8,
    "attention_head_dim": 2,
    "norm_num_groups": 4,
}


# -- the scenario (also run in subprocesses against stock libraries) ---------------


class _Gates:
    """Per-thread callbacks, each run at its thread's next parameter registration.

    A registration hook rather than a torch-function mode: a mode's handler
    runs with the modes above it popped, so it could not tell whether the
    loader is inside metamode's contexts. Installed for one race and removed
    after every thread has joined (removing a global hook while another
    thread registers a parameter is not safe).
    """

    def __init__(self) -> None:
        self._pending: dict[int, Callable[[], None]] = {}
        self._handle = None

    def __enter__(self) -> _Gates:
        self._handle = register_module_parameter_registration_hook(self._on_registration)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._handle.remove()

    def arm(self, callback: Callable[[], None]) -> None:
        self._pending[threading.get_ident()] = callback

    def _on_registration(self, module, name, param) -> None:
        callback = self._pending.pop(threading.get_ident(), None)
        if callback is not None:
            callback()


class _Probe(nn.Module):
    """Parameters whose correct initial values are known in advance."""

    def __init__(self, value: float, seed: int) -> None:
        super().__init__()
        self.constant = nn.Parameter(torch.empty(4, 4))
        self.kaiming = nn.Parameter(torch.empty(4, 4))
        nn.init.constant_(self.constant, value)
        nn.init.kaiming_uniform_(
            self.kaiming, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed)
        )


def _expected_kaiming(seed: int) -> torch.Tensor:
    weight = torch.empty(4, 4)
    return nn.init.kaiming_uniform_(
        weight, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed)
    )


class _Bystander:
    """Builds modules; counts those that are not initialised cpu modules.

    The value written by ``constant_`` changes on every build, so a build whose
    init was skipped cannot pass by finding the previous build's memory.
    """

    def __init__(self) -> None:
        self.builds = 0
        self.failed = 0
        self.problems: list[str] = []
        self._kaiming = [_expected_kaiming(seed) for seed in range(4)]

    def build(self) -> None:
        self.builds += 1
        value = 0.25 + self.builds
        probe = _Probe(value, seed=self.builds % 4)
        linear = nn.Linear(4, 4)
        devices = {p.device.type for p in (*probe.parameters(), *linear.parameters())}
        if devices != {"cpu"}:
            self._problem(f"bystander parameters on {sorted(devices)}")
        elif not bool((probe.constant == value).all()):
            self._problem("bystander nn.init.constant_ did nothing")
        elif not torch.equal(probe.kaiming, self._kaiming[self.builds % 4]):
            self._problem("bystander nn.init.kaiming_uniform_ did nothing")

    def _problem(self, text: str) -> None:
        self.failed += 1
        if text not in self.problems:
            self.problems.append(text)


def _differences(model: nn.Module, reference: dict[str, torch.Tensor]) -> list[str]:
    state = model.state_dict()
    if state.keys() != reference.keys():
        return [f"keys differ: {sorted(state.keys() ^ reference.keys())[:3]}"]
    return [
        f"{name} differs ({tensor.device.type}, {tensor.dtype})"
        for name, tensor in state.items()
        if tensor.device.type != "cpu"
        or tensor.dtype != reference[name].dtype
        or not torch.equal(tensor, reference[name])
    ]


def unet_race(
    checkpoint: str,
    rounds: int,
    stop_at_first_corruption: bool,
    low_cpu_mem_usage: bool = True,
    forced: bool = True,
) -> dict[str, Any]:
    """Run the UNet load race ``rounds`` times in this process; summarise it.

    ``forced``: the Events schedule described in the module docstring. Else
    the three threads start together at a Barrier and run freely (callers
    shrink ``sys.setswitchinterval`` for that).

    ``low_cpu_mem_usage=False`` leaves accelerate out: only diffusers'
    ``no_init_weights`` is entered, which restores torch's functions from a
    saved table on exit, so it never leaks -- but bystanders build
    uninitialised modules while any load is running.
    """
    from diffusers import UNet2DConditionModel
    from diffusers.utils import logging

    logging.set_verbosity_error()
    load = functools.partial(
        UNet2DConditionModel.from_pretrained, checkpoint, low_cpu_mem_usage=low_cpu_mem_usage
    )
    sequential = load()
    reference = {k: v.clone() for k, v in sequential.state_dict().items()}
    bystander = _Bystander()
    inside: list[bool] = []

    def one_round(round_index: int) -> list[str]:
        if forced:
            with _Gates() as gates:
                models, errors = _forced_round(load, bystander, round_index, gates, inside)
        else:
            models, errors = _free_round(load, bystander)
        problems = list(errors)
        for name, model in sorted(models.items()):
            problems += [f"{name} model: {text}" for text in _differences(model, reference)[:3]]
        return problems

    summary = run_rounds(rounds, one_round, stop_at_first_corruption)
    return {
        "rounds_run": summary["rounds_run"],
        "corrupted_rounds": summary["corrupted_rounds"],
        "first_problems": summary["first_problems"],
        "gates_inside_load_contexts": f"{sum(inside)}/{len(inside)}",
        "bystander_builds": bystander.builds,
        "bystander_failed_builds": bystander.failed,
        "bystander_problems": bystander.problems,
    }


def _inside_load_contexts() -> bool:
    """Is the calling thread inside diffusers'/accelerate's contexts (stock or metamode)?"""
    from metamode._contexts.skip_init import SkipInit
    from metamode._core.modes import EmptyWeights
    from metamode._core.stack import modes_innermost_first
    from metamode.integrations._exact_skip import SkipLibraryInit

    skips = (EmptyWeights, SkipInit, SkipLibraryInit)
    if any(isinstance(mode, skips) for mode in modes_innermost_first()):
        return True
    return nn.init.constant_ is not _TORCHS_CONSTANT_


def _forced_round(load_model, bystander, round_index, gates, inside):
    first_in, second_in, looked = threading.Event(), threading.Event(), threading.Event()
    first_done, second_done = threading.Event(), threading.Event()
    # Even rounds: the first loader finishes while the second is still inside
    # its contexts (the order that leaks); odd rounds: the reverse.
    first_waits_for = looked if round_index % 2 == 0 else second_done
    second_waits_for = first_done if round_index % 2 == 0 else looked
    models: dict[str, nn.Module] = {}
    errors: list[str] = []

    def load(name: str, entered: threading.Event, waits_for: threading.Event, done) -> None:
        def gate() -> None:
            inside.append(_inside_load_contexts())
            entered.set()
            wait(waits_for, "the other threads")

        try:
            gates.arm(gate)
            models[name] = load_model()
        except BaseException as error:
            errors.append(f"{name}: {type(error).__name__}: {error}")
            for event in (first_in, second_in, looked, first_done, second_done):
                event.set()
        finally:
            done.set()

    def second() -> None:
        wait(first_in, "the first loader to enter")
        load("second", second_in, second_waits_for, second_done)

    def watch() -> None:
        # One build at the forced point (both loads inside their contexts),
        # then free-running builds while the loads finish.
        wait(second_in, "the second loader to enter")
        try:
            bystander.build()
        finally:
            looked.set()
        for _ in range(_FREE_BUILDS_PER_ROUND):
            if first_done.is_set() and second_done.is_set():
                break
            bystander.build()

    run_threads([lambda: load("first", first_in, first_waits_for, first_done), second, watch])
    return models, errors


def _free_round(load_model, bystander):
    start = threading.Barrier(3)
    done = [threading.Event(), threading.Event()]
    models: dict[str, nn.Module] = {}
    errors: list[str] = []

    def load(index: int) -> None:
        try:
            start.wait(WAIT_S)
            models[str(index)] = load_model()
        except BaseException as error:
            errors.append(f"{index}: {type(error).__name__}: {error}")
        finally:
            done[index].set()

    def watch() -> None:
        start.wait(WAIT_S)
        for _ in range(_FREE_BUILDS_PER_ROUND):
            if all(event.is_set() for event in done):
                break
            bystander.build()

    run_threads([lambda: load(0), lambda: load(1), watch])
    return models, errors


_SUBPROCESS = """
import json, sys
sys.path.insert(0, {repo!r})
import torch
torch.set_num_threads(1)
from tests.integration.test_integrations_hf import unet_race
if {enable!r}:
    import metamode
    metamode.enable()
results = {{
    low_cpu_mem_usage: unet_race({checkpoint!r}, {rounds!r}, True, low_cpu_mem_usage)
    for low_cpu_mem_usage in (False, True)  # False never leaks: run it first
}}
print(json.dumps({{"low_cpu_mem_usage=" + str(k): v for k, v in results.items()}}))
"""


# -- fixtures ---------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def unet_checkpoint(tmp_path_factory) -> str:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-unet")
    UNet2DConditionModel(**UNET_CONFIG).save_pretrained(path)
    return str(path)


@pytest.fixture
def all_shims() -> Iterator[dict[str, tuple[str, ...]]]:
    try:
        yield metamode.enable()
    finally:
        _registry.disable()


# -- diffusers ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.per_interpreter
def test_stock_diffusers_concurrent_loads_corrupt_the_process(unet_checkpoint):
    result = run_python(
        _SUBPROCESS.format(repo=str(REPO), enable=False, checkpoint=unet_checkpoint, rounds=5)
    )
    # no_init_weights alone: nothing outlives the loads, but a module built
    # meanwhile in another thread is silently left uninitialised.
    no_accelerate = result["low_cpu_mem_usage=False"]
    assert no_accelerate["first_problems"] == []
    assert no_accelerate["rounds_run"] == 5
    assert no_accelerate["gates_inside_load_contexts"] == "10/10"
    assert "bystander nn.init.constant_ did nothing" in no_accelerate["bystander_problems"]
    # With accelerate's init_empty_weights, the first round leaks its patch.
    leaky = result["low_cpu_mem_usage=True"]
    assert leaky["rounds_run"] == 1, "the forced interleaving corrupts on its first round"
    assert leaky["gates_inside_load_contexts"] == "2/2"
    assert "register_parameter left replaced" in leaky["first_problems"]
    assert "a new Linear in the main thread is on meta" in leaky["first_problems"]
    assert "bystander parameters on ['meta']" in leaky["bystander_problems"]


def _assert_clean(result: dict[str, Any], rounds: int, forced: bool) -> None:
    builds = result["bystander_builds"]
    gated = f"{2 * rounds}/{2 * rounds}" if forced else "0/0"
    assert result == {
        "rounds_run": rounds,
        "corrupted_rounds": 0,
        "first_problems": [],
        "gates_inside_load_contexts": gated,
        "bystander_builds": builds,
        "bystander_failed_builds": 0,
        "bystander_problems": [],
    }
    assert builds >= rounds


@pytest.mark.slow
@pytest.mark.per_interpreter
@pytest.mark.parametrize(("low_cpu_mem_usage", "rounds"), [(True, 50), (False, 10)])
def test_after_metamode_enable_forced_rounds_leak_nothing(
    unet_checkpoint, all_shims, low_cpu_mem_usage, rounds
):
    """Every round: no leak, both models == a sequential load, bystander always initialised."""
    assert {"accelerate", "diffusers"} <= all_shims.keys()
    result = unet_race(unet_checkpoint, rounds, False, low_cpu_mem_usage)
    _assert_clean(result, rounds, forced=True)


@pytest.mark.slow
def test_after_metamode_enable_free_running_rounds_leak_nothing(unet_checkpoint, all_shims):
    """Stress: no forced order, a 1 µs switch interval (stock corrupts ~every round)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        result = unet_race(unet_checkpoint, 10, False, low_cpu_mem_usage=True, forced=False)
    finally:
        sys.setswitchinterval(interval)
    _assert_clean(result, 10, forced=False)


# -- accelerate --------------------------------------------------------------------


def test_accelerate_shim_rebinds_every_import_and_disable_restores(all_shims):
    import accelerate
    import accelerate.big_modeling as big_modeling
    import accelerate.utils.bnb as bnb

    from metamode.integrations import accelerate as _accelerate

    assert {
        "accelerate.init_empty_weights",
        "accelerate.init_on_device",
        "accelerate.big_modeling.init_empty_weights",
        "accelerate.big_modeling.init_on_device",
        "accelerate.utils.bnb.init_empty_weights",
    } <= set(all_shims["accelerate"])
    assert accelerate.init_empty_weights is _accelerate.init_empty_weights
    assert bnb.init_empty_weights is _accelerate.init_empty_weights
    assert metamode.enable_for_accelerate() == all_shims["accelerate"], "idempotent"

    with accelerate.init_empty_weights():
        assert nn.Linear(2, 2).weight.is_meta
    with accelerate.init_on_device(torch.device("meta"), include_buffers=True):
        norm = nn.BatchNorm1d(2)
    assert norm.weight.is_meta and norm.running_mean.is_meta

    restored = metamode.disable_for_accelerate()
    assert set(all_shims["accelerate"]) <= set(restored)
    assert accelerate.init_empty_weights is big_modeling.init_empty_weights
    assert accelerate.init_empty_weights.__module__ == "accelerate.big_modeling"
    assert bnb.init_empty_weights is accelerate.init_empty_weights
    assert metamode.disable_for_accelerate() == ()


def test_modules_imported_after_enable_get_the_replacement_and_lose_it_on_disable(all_shims):
    import types

    import accelerate

    from metamode.integrations import accelerate as _accelerate

    late = types.ModuleType("diffusers._metamode_late_import_probe")
    exec("from accelerate import init_empty_weights", vars(late))  # what a late import does
    sys.modules[late.__name__] = late
    try:
        assert late.init_empty_weights is _accelerate.init_empty_weights
        assert "diffusers._metamode_late_import_probe.init_empty_weights" in (
            metamode.disable_for_accelerate()
        )
        assert late.init_empty_weights is accelerate.init_empty_weights
    finally:
        del sys.modules[late.__name__]


# -- diffusers rebinding -------------------------------------------------------------


def test_diffusers_shim_rebinds_no_init_weights_and_undoes_exactly_what_it_did():
    import accelerate
    import diffusers.models.modeling_utils as modeling_utils

    from metamode.integrations import accelerate as _accelerate
    from metamode.integrations import diffusers as _diffusers

    original = modeling_utils.no_init_weights
    try:
        bound = metamode.enable_for_diffusers()
        assert "diffusers.models.modeling_utils.no_init_weights" in bound
        assert "accelerate.init_empty_weights" in bound, "diffusers' load path needs it"
        assert modeling_utils.no_init_weights is _diffusers.no_init_weights
        with modeling_utils.no_init_weights() as context:
            assert isinstance(context, _diffusers.SkipLibraryInit)
        restored = metamode.disable_for_diffusers()
        assert set(bound) == set(restored)
        assert modeling_utils.no_init_weights is original
        assert accelerate.init_empty_weights.__module__ == "accelerate.big_modeling"

        # accelerate's shim enabled separately stays on.
        metamode.enable_for_accelerate()
        metamode.enable_for_diffusers()
        assert metamode.disable_for_diffusers() == (
            "diffusers.models.modeling_utils.ModelMixin._set_default_torch_dtype",
            "diffusers.models.modeling_utils.ModelMixin.from_pretrained",
            "diffusers.models.modeling_utils.no_init_weights",
        )
        assert accelerate.init_empty_weights is _accelerate.init_empty_weights
    finally:
        _registry.disable()
    assert modeling_utils.no_init_weights is original


@pytest.mark.requires_transformers_5
def test_enable_is_all_or_nothing(monkeypatch):
    import diffusers.models.modeling_utils as modeling_utils
    import peft.utils.integrations as peft_integrations

    original = peft_integrations.init_empty_weights
    monkeypatch.delattr(modeling_utils, "TORCH_INIT_FUNCTIONS")
    with pytest.raises(metamode.IncompatibleLibraryError, match="TORCH_INIT_FUNCTIONS"):
        metamode.enable()
    assert peft_integrations.init_empty_weights is original
    assert _registry.disable() == {}


def test_enable_reports_every_installed_library(all_shims):
    assert set(all_shims) == {"peft", "accelerate", "diffusers", "transformers"}
    assert metamode.enable() == all_shims
    assert set(_registry.disable()) == set(all_shims)


# -- transformers ----------------------------------------------------------------------


_TORCH_DEVICE_TABLE_AFTER_STOCK_LINSPACE = """
import json, threading, torch
{imports}
import transformers.initialization as initialization
from torch.utils._device import _device_constructors

with initialization.meta_device_safe_creation_ops(), torch.device("meta"):
    torch.zeros(1)  # the process's first torch.device(...) call, inside stock's patch
seen = {{}}

def fresh_thread():
    with torch.device("meta"):
        seen["linspace"] = torch.linspace(0, 1, 3).device.type

thread = threading.Thread(target=fresh_thread)
thread.start()
thread.join()
seen["in the table"] = torch.linspace in _device_constructors()
print(json.dumps(seen))
"""


@pytest.mark.requires_transformers_5
@pytest.mark.parametrize("metamode_imported", [False, True], ids=["stock", "metamode-imported"])
def test_a_stock_linspace_patch_cannot_get_into_torchs_device_table(metamode_imported):
    """torch builds the table of factories ``torch.device(...)`` places once, from the torch
    functions of that moment: built inside stock transformers' patch of ``torch.linspace``,
    it holds the patch for good, and ``linspace`` stays on the CPU in every thread (and under
    ``include_buffers=True``). metamode builds it when first used."""
    code = _TORCH_DEVICE_TABLE_AFTER_STOCK_LINSPACE.format(
        imports="import metamode\nmetamode.empty_weights  # its first use loads its core"
        if metamode_imported
        else ""
    )
    seen = run_python(code)
    placed = {"linspace": "meta", "in the table": True}
    if metamode_imported:
        assert seen == placed
    else:
        assert seen == {"linspace": "cpu", "in the table": False}, "stock no longer poisons it"


@pytest.mark.requires_transformers_5
def test_transformers_linspace_context_is_thread_scoped():
    import transformers.initialization as initialization

    from metamode.integrations.transformers import LinspaceOnCpu

    original = initialization.meta_device_safe_creation_ops
    try:
        assert metamode.enable_for_transformers() == (
            "transformers.initialization.meta_device_safe_creation_ops",
            "transformers.initialization.no_tie_weights",
            "transformers.modeling_utils.PreTrainedModel._from_config",
            "transformers.modeling_utils.PreTrainedModel._initialize_missing_keys",
            "transformers.modeling_utils.PreTrainedModel.initialize_weights",
            "transformers.modeling_utils._get_dtype",
            "transformers.modeling_utils.get_torch_context_manager_or_global_device",
            "transformers.modeling_utils.local_torch_dtype",
        )
        linspace = torch.linspace
        inside, other = threading.Event(), threading.Event()
        seen: dict[str, str] = {}

        def elsewhere() -> None:
            wait(inside, "the main thread's context")
            with torch.device("meta"):
                seen["other thread"] = torch.linspace(0, 1, 3).device.type
            other.set()

        thread = threading.Thread(target=elsewhere)
        thread.start()
        with torch.device("meta"), initialization.meta_device_safe_creation_ops() as context:
            assert isinstance(context, LinspaceOnCpu)
            assert torch.linspace is linspace, "torch.linspace is never reassigned"
            inside.set()
            wait(other, "the other thread")
            seen["linspace"] = torch.linspace(0, 1, 3).device.type
            seen["explicit"] = torch.linspace(0, 1, 3, device="meta").device.type
            seen["arange"] = torch.arange(3).device.type
        thread.join()
        assert seen == {
            "other thread": "meta",
            "linspace": "cpu",
            "explicit": "meta",
            "arange": "meta",
        }
    finally:
        metamode.disable_for_transformers()
    assert initialization.meta_device_safe_creation_ops is original


_LLAMA_SUBPROCESS = """
import json, sys, warnings
sys.path.insert(0, {repo!r})
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
from tests.integration.test_integrations_hf import llama_race, xglm_buffer_dtypes
result = {{}}
if {enable!r}:
    import metamode
    metamode.enable()
    result["xglm"] = xglm_buffer_dtypes()
result.update(llama_race({directory!r}))
print(json.dumps(result))
"""


def _differs(model: nn.Module, reference: nn.Module) -> list[str]:
    return _differences(model, {k: v.clone() for k, v in reference.state_dict().items()})


def llama_race(directory: str) -> dict[str, Any]:
    """Two tiny tied-embedding Llamas loaded at once, float16 and float32, forced overlap.

    A (float16) is inside its construction contexts when B (float32) has started (inside
    its own contexts, or parked on A's dtype window); A then finishes while B is still
    inside (the order that leaks).
    Afterwards: both models against sequential loads, what is left of the
    process-global state, and a later load.
    """
    import torch.utils._device
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_utils import PreTrainedModel

    transformers.logging.set_verbosity_error()
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    linspace, tie_weights = torch.linspace, vars(PreTrainedModel)["tie_weights"]
    dtypes = (torch.float16, torch.float32)
    sequential = {
        dtype: LlamaForCausalLM.from_pretrained(directory, dtype=dtype) for dtype in dtypes
    }
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    models: dict[torch.dtype, nn.Module] = {}
    b_thread: list[int] = []

    def b_started(state) -> bool:
        # B inside its construction (stock), or parked on A's dtype window (metamode).
        return b_in.is_set() or (bool(b_thread) and b_thread[0] in state.parked)

    def notify() -> None:
        with dtype_windows._condition:
            dtype_windows._condition.notify_all()

    def load(dtype, gates) -> None:
        def gate() -> None:
            if dtype == torch.float16:
                a_in.set()
                if not dtype_windows.wait_until(b_started, 60):
                    raise TimeoutError("deadlocked waiting for B")
            else:
                b_in.set()
                notify()
                wait(a_done, "A's load")

        gates.arm(gate)
        try:
            models[dtype] = LlamaForCausalLM.from_pretrained(directory, dtype=dtype)
        finally:
            if dtype == torch.float16:
                a_done.set()

    def b(gates) -> None:
        wait(a_in, "A to enter")
        b_thread.append(threading.get_ident())
        notify()
        load(torch.float32, gates)

    with _Gates() as gates:
        run_threads([lambda: load(torch.float16, gates), lambda: b(gates)])
    later = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return {
        "float16_model_differs": _differs(models[torch.float16], sequential[torch.float16])[:2],
        "float32_model_differs": _differs(models[torch.float32], sequential[torch.float32])[:2],
        "default_dtype_after": str(torch.get_default_dtype()),
        "linspace_is_torchs": torch.linspace is linspace,
        "tie_weights_is_transformers": vars(PreTrainedModel)["tie_weights"] is tie_weights,
        "current_device_after": str(torch.utils._device.CURRENT_DEVICE),
        "later_load_lm_head_device": later.lm_head.weight.device.type,
    }


def xglm_buffer_dtypes() -> dict[str, str]:
    """Why ``local_torch_dtype`` is not rebound: XGLM built under ``default_dtype(float16)``."""
    from transformers import XGLMConfig, XGLMForCausalLM

    config = XGLMConfig(
        vocab_size=64, d_model=16, ffn_dim=32, num_layers=1, attention_heads=2,
        max_position_embeddings=32,
    )  # fmt: skip
    with metamode.default_dtype(torch.float16):
        model = XGLMForCausalLM(config)
    return {
        "parameters": str({p.dtype for p in model.parameters()}),
        "embed_positions": str(model.model.embed_positions.weights.dtype),
    }


@pytest.mark.requires_transformers_5
@pytest.mark.slow
@pytest.mark.parametrize("enable", [False, True], ids=["stock", "metamode.enable"])
def test_concurrent_transformers_loads_in_float16_and_float32(tmp_path, enable):
    """Stock corrupts both models and leaves the process in float16; with the shim, each
    model is a lone load's and the default ends float32 (tests/integration/test_dtype_loads.py
    covers diffusers and transformers 4)."""
    result = run_python(
        _LLAMA_SUBPROCESS.format(repo=str(REPO), enable=enable, directory=str(tmp_path))
    )
    # The torch.linspace wrapper no longer outlives the loads...
    assert result["linspace_is_torchs"] is enable
    # ...nor does no_tie_weights' no-op on PreTrainedModel.tie_weights, which in stock
    # leaves B's lm_head.weight on meta, and every later tied load's
    # (tests/unit/integrations/test_transformers_ties.py).
    assert result["tie_weights_is_transformers"] is enable
    if enable:
        assert result["float16_model_differs"] == []
        assert result["float32_model_differs"] == []
        assert result["default_dtype_after"] == "torch.float32"
        assert result["later_load_lm_head_device"] == "cpu"
        # Why a dtype window and not default_dtype: a thread-scoped dtype cannot reach
        # torch.get_default_dtype(), so XGLM's buffer would stay float32.
        assert result["xglm"] == {
            "parameters": "{torch.float16}",
            "embed_positions": "torch.float32",
        }
    else:
        assert result["float32_model_differs"] == ["lm_head.weight differs (meta, torch.float32)"]
        assert result["later_load_lm_head_device"] == "meta"
        assert result["default_dtype_after"] == "torch.float16"  # B restored A's float16
        assert result["float16_model_differs"], "A built part of its model in float32"


def test_a_release_without_the_targeted_module_is_refused_as_incompatible():
    from metamode.integrations._rebind import Rebinding

    rebinding = Rebinding(
        package="transformers",
        extra="transformers",
        home_module="transformers._metamode_no_such_module",
        replacements={"anything": print},
    )
    with pytest.raises(metamode.IncompatibleLibraryError, match=r"\d+\.\S+ has no module"):
        rebinding.enable()
    assert not rebinding.enabled
