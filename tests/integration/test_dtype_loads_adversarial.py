"""Concurrent loads with the idioms real code uses, against dtype windows: each load, made
while another thread's load holds a window in another dtype, returns the model a lone stock
load returns, and the process default ends where it was. Every interleaving is forced: the
other load waits inside its model's constructor (inside its window) until the load under
test is seen parked (``dtype_windows.wait_until``) or has returned; none uses a sleep."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn.init import normal_ as imported_normal_

import metamode
from metamode._core import dtype_windows
from metamode.integrations import _registry
from metamode.lab import dtype_loads
from metamode.lab.threads import WAIT_S, wait

pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"), pytest.mark.per_interpreter]

TRANSFORMERS_MAJOR = int(__import__("transformers").__version__.split(".")[0])
_TINY_LLAMA = {
    "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
}  # fmt: skip


def _llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_TINY_LLAMA)


def _llava_config() -> Any:
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        image_size=8, patch_size=4, projection_dim=8,
    )  # fmt: skip
    return LlavaConfig(vision_config=vision, text_config=_llama_config(), image_token_index=3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama, a tiny Llava (its __init__ builds both sub-models with
    ``AutoModel.from_config``), a tiny UNet2DModel and a tiny SDXL pipeline with text
    encoders, saved in float32."""
    import transformers
    from diffusers import UNet2DModel
    from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

    transformers.logging.set_verbosity_error()
    directory = tmp_path_factory.mktemp("adversarial")
    paths = {name: str(directory / name) for name in ("llama", "llava", "unet", "sdxl")}
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config()).save_pretrained(paths["llama"])
    LlavaForConditionalGeneration(_llava_config()).save_pretrained(paths["llava"])
    UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    ).save_pretrained(paths["unet"])  # fmt: skip
    dtype_loads._tiny_sdxl_with_text_encoders().save_pretrained(paths["sdxl"])
    return paths


def _notify_windows() -> None:
    with dtype_windows._condition:
        dtype_windows._condition.notify_all()


def _held_llama_class() -> type:
    """``LlamaForCausalLM`` whose constructor runs ``gate`` first (inside the load's window)."""
    from transformers import LlamaForCausalLM

    class HeldLlama(LlamaForCausalLM):
        gate: ClassVar[Callable[[], None] | None] = None

        def __init__(self, config: Any) -> None:
            gate = type(self).gate
            if gate is not None:
                type(self).gate = None
                gate()
            super().__init__(config)

    return HeldLlama


def beside_a_load(
    paths: dict[str, str], body: Callable[[], Any], held_dtype: torch.dtype = torch.float16
) -> tuple[Any, bool]:
    """Run ``body`` in thread L while thread H's ``from_pretrained(dtype=held_dtype)`` waits
    inside its model's constructor; H goes on once L is parked on H's window or has
    returned. Returns L's result (or what it raised) and whether L parked; checks H's model
    against a lone load."""
    held = _held_llama_class()
    h_inside, release = threading.Event(), threading.Event()
    out: dict[str, Any] = {}

    def gate() -> None:
        h_inside.set()
        wait(release, "L to park or return")

    def h() -> None:
        held.gate = gate
        try:
            out["held"] = held.from_pretrained(paths["llama"], dtype=held_dtype)
        except BaseException as error:
            out["held"] = error
            h_inside.set()

    def l_body() -> None:
        out["ident"] = threading.get_ident()
        _notify_windows()
        try:
            out["result"] = body()
        except BaseException as error:
            out["result"] = error
        finally:
            out["done"] = True
            _notify_windows()

    th = threading.Thread(target=h)
    th.start()
    wait(h_inside, "H inside its construction")
    tl = threading.Thread(target=l_body)
    tl.start()
    seen = dtype_windows.wait_until(
        lambda s: out.get("done", False) or out.get("ident") in s.parked, WAIT_S
    )
    parked = not out.get("done", False)
    release.set()
    th.join()
    tl.join()
    assert seen, "deadlocked: L neither parked nor returned"
    if isinstance(out["held"], BaseException):
        raise out["held"]
    alone = held.from_pretrained(paths["llama"], dtype=held_dtype)
    assert dtype_loads.differences(out["held"], alone) == [], "H's model"
    return out["result"], parked


def _as_module(result: Any) -> nn.Module:
    if isinstance(result, BaseException):
        raise result
    if isinstance(result, nn.Module):
        return result
    return nn.ModuleDict({k: v for k, v in result.components.items() if isinstance(v, nn.Module)})


def _exact_beside_a_load(paths: dict[str, str], load: Callable[[], Any]) -> dict[str, Any]:
    """A lone stock load, then the same load with ``enable()`` beside H's float16 load
    (each from the same seed: ``from_config`` draws its weights)."""

    def seeded() -> Any:
        torch.manual_seed(5)
        return load()

    alone = _as_module(seeded())
    with metamode.enabled():
        got, _ = beside_a_load(paths, seeded)
        state = dtype_windows.state()
    return {
        "differences": dtype_loads.differences(_as_module(got), alone)[:3],
        "default_dtype_after": torch.get_default_dtype(),
        "windows_after": state,
    }


_CLEAN = {"differences": [], "default_dtype_after": torch.float32}


def _clean(result: dict[str, Any]) -> dict[str, Any]:
    assert result.pop("windows_after") == dtype_windows.WindowState(baseline=None)
    return result


# -- transformers' dtype idioms ----------------------------------------------------------


def _transformers_loads(paths: dict[str, str]) -> dict[str, Callable[[], Any]]:
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    llama, llava = paths["llama"], paths["llava"]
    no_dtype = _llama_config()
    return {
        "auto": lambda: AutoModelForCausalLM.from_pretrained(llama, dtype="auto"),
        "string": lambda: AutoModelForCausalLM.from_pretrained(llama, dtype="float32"),
        "torch_dtype-alias": lambda: AutoModelForCausalLM.from_pretrained(
            llama, torch_dtype=torch.float32
        ),
        "no-dtype": lambda: AutoModelForCausalLM.from_pretrained(llama),
        "bfloat16": lambda: AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16),
        "composite": lambda: LlavaForConditionalGeneration.from_pretrained(
            llava, dtype=torch.float32
        ),
        "composite-auto": lambda: LlavaForConditionalGeneration.from_pretrained(llava),
        "dict-with-main": lambda: LlavaForConditionalGeneration.from_pretrained(
            llava, dtype={"": torch.float32, "text_config": torch.bfloat16}
        ),
        "dict-without-main": lambda: LlavaForConditionalGeneration.from_pretrained(
            llava, dtype={"text_config": torch.float32}
        ),
        "from_config-dtype": lambda: AutoModelForCausalLM.from_config(
            _llama_config(), dtype=torch.float32
        ),
        "from_config-no-dtype": lambda: AutoModelForCausalLM.from_config(no_dtype),
        "_from_config-composite": lambda: LlavaForConditionalGeneration._from_config(
            _llava_config(), dtype=torch.bfloat16
        ),
    }


# Fail on the code before the fix: built in the float16 another thread's window had set.
_READ_THE_OTHER_WINDOW = {"from_config-no-dtype", "dict-without-main", "no-dtype"}


@pytest.mark.parametrize(
    "idiom",
    [
        "auto", "string", "torch_dtype-alias", "no-dtype", "bfloat16", "composite",
        "composite-auto", "dict-with-main", "dict-without-main", "from_config-dtype",
        "from_config-no-dtype", "_from_config-composite",
    ],
)  # fmt: skip
def test_a_transformers_idiom_beside_another_dtypes_load_builds_a_lone_loads_model(saved, idiom):
    """``no-dtype`` (4.x reads the default for ``dtype=None``), ``dict-without-main`` (5.x
    reads it for the main dtype) and ``from_config-no-dtype`` (the model is built in the
    default) read or build in the process default outside any window of their own."""
    load = _transformers_loads(saved)[idiom]
    assert _clean(_exact_beside_a_load(saved, load)) == _CLEAN


@pytest.mark.requires_transformers_4
def test_a_dict_of_sub_model_dtypes_nests_windows_of_other_dtypes_beside_a_load(saved):
    """transformers 4: each sub-config's dtype is its own ``_from_config`` window inside the
    load's, so one thread opens windows in three dtypes while another holds float16."""
    from transformers import LlavaForConditionalGeneration

    def load() -> nn.Module:
        return LlavaForConditionalGeneration.from_pretrained(
            saved["llava"],
            dtype={"": torch.float32, "text_config": torch.float16,
                   "vision_config": torch.bfloat16},
        )  # fmt: skip

    result = _clean(_exact_beside_a_load(saved, load))
    assert result == _CLEAN
    model = load()
    assert {p.dtype for p in model.model.language_model.parameters()} == {torch.float16}


# -- diffusers' dtype idioms --------------------------------------------------------------


def _diffusers_loads(paths: dict[str, str]) -> dict[str, Callable[[], Any]]:
    from diffusers import DiffusionPipeline, UNet2DModel

    unet, sdxl = paths["unet"], paths["sdxl"]
    return {
        "no-torch_dtype": lambda: UNet2DModel.from_pretrained(unet),
        "float32": lambda: UNet2DModel.from_pretrained(unet, torch_dtype=torch.float32),
        "low_cpu_mem_usage-False": lambda: UNet2DModel.from_pretrained(
            unet, torch_dtype=torch.bfloat16, low_cpu_mem_usage=False
        ),
        "pipeline-no-torch_dtype": lambda: DiffusionPipeline.from_pretrained(sdxl),
        "pipeline-dict": lambda: DiffusionPipeline.from_pretrained(
            sdxl, torch_dtype={"unet": torch.bfloat16, "default": torch.float32}
        ),
    }


@pytest.mark.parametrize(
    "idiom",
    ["no-torch_dtype", "float32", "low_cpu_mem_usage-False", "pipeline-no-torch_dtype",
     "pipeline-dict"],
)  # fmt: skip
def test_a_diffusers_idiom_beside_another_dtypes_load_builds_a_lone_loads_model(saved, idiom):
    """``no-torch_dtype`` and ``pipeline-no-torch_dtype`` build in the process default
    (diffusers sets none): before the fix, in the other thread's float16."""
    load = _diffusers_loads(saved)[idiom]
    assert _clean(_exact_beside_a_load(saved, load)) == _CLEAN


# -- the process default the user set, and metamode's own contexts -----------------------


@pytest.fixture
def float64_default() -> Iterator[None]:
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("idiom", ["no-dtype", "from_config-no-dtype", "dict-without-main"])
def test_a_float64_default_set_by_the_user_is_what_loads_without_a_dtype_see(
    saved, float64_default, idiom
):
    load = _transformers_loads(saved)[idiom]
    result = _clean(_exact_beside_a_load(saved, load))
    assert result == {"differences": [], "default_dtype_after": torch.float64}


def test_a_load_inside_metamode_default_dtype_beside_another_dtypes_load(saved):
    from transformers import AutoModelForCausalLM

    def load() -> nn.Module:
        with metamode.default_dtype(torch.float64):
            return AutoModelForCausalLM.from_pretrained(saved["llama"], dtype=torch.float32)

    with metamode.enabled():
        alone = load()
    assert _clean(_exact_beside_a_load(saved, load))["differences"] == []
    assert dtype_loads.differences(load(), alone) == []


def _skeleton(model: nn.Module) -> list[tuple[str, torch.dtype, str, tuple[int, ...]]]:
    return [(k, v.dtype, v.device.type, tuple(v.shape)) for k, v in model.state_dict().items()]


@pytest.mark.parametrize(
    "idiom",
    [
        "from_config", "from_config-dtype", "from_pretrained",
        pytest.param(
            "constructor",
            marks=pytest.mark.xfail(
                strict=True,
                reason="a model's constructor opens no window: it builds in whatever the "
                "process default is, the open window's (docs/limitations.md, bystanders)",
            ),
        ),
    ],
)  # fmt: skip
def test_a_skeleton_built_in_metamode_empty_weights_beside_another_dtypes_load(saved, idiom):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    build = {
        "from_config": lambda: AutoModelForCausalLM.from_config(_llama_config()),
        "from_config-dtype": lambda: AutoModelForCausalLM.from_config(
            _llama_config(), dtype=torch.bfloat16
        ),
        # a skeleton stays on meta, which transformers' kernelize after loading refuses
        # (with ``kernels`` installed, stock's too): the skeleton asks for no kernels
        "from_pretrained": lambda: AutoModelForCausalLM.from_pretrained(
            saved["llama"], dtype=torch.float32, use_kernels=False
        ),
        "constructor": lambda: LlamaForCausalLM(_llama_config()),
    }[idiom]

    def body() -> nn.Module:
        with metamode.empty_weights():
            return build()

    with metamode.enabled():
        alone = body()
        got, _ = beside_a_load(saved, body)
    assert _skeleton(_as_module(got)) == _skeleton(alone)
    assert torch.get_default_dtype() == torch.float32


def test_loads_from_a_thread_pool_in_three_dtypes_each_build_a_lone_loads_model(saved):
    from transformers import AutoModelForCausalLM

    dtypes = [torch.float16, torch.float32, torch.bfloat16, None] * 2
    alone = {d: AutoModelForCausalLM.from_pretrained(saved["llama"], dtype=d) for d in dtypes}

    def load(dtype: torch.dtype | None) -> nn.Module:
        return AutoModelForCausalLM.from_pretrained(saved["llama"], dtype=dtype)

    with metamode.enabled(), concurrent.futures.ThreadPoolExecutor(3) as pool:
        models = list(pool.map(load, dtypes))
    found = [dtype_loads.differences(m, alone[d]) for m, d in zip(models, dtypes, strict=True)]
    assert found == [[]] * 8
    assert torch.get_default_dtype() == torch.float32
    assert dtype_windows.state() == dtype_windows.WindowState(baseline=None)


def test_a_bystander_reading_the_default_sees_the_open_window_as_documented(saved):
    """docs/limitations.md, "Dtype windows and bystanders": a thread outside every window
    reads the running window's dtype, and the baseline once the last window closes."""
    seen = []

    def bystander() -> None:
        seen.append(torch.get_default_dtype())

    def body() -> None:
        thread = threading.Thread(target=bystander)
        thread.start()
        thread.join()

    with metamode.enabled():
        beside_a_load(saved, body)
    bystander()
    assert seen == [torch.float16, torch.float32]


# -- loads that raise ----------------------------------------------------------------------


class _Abort(BaseException):
    """Like KeyboardInterrupt: not an Exception."""


def _raising_loads(paths: dict[str, str]) -> dict[str, Callable[[], Any]]:
    from diffusers import UNet2DModel
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    class RaisingLlama(LlamaForCausalLM):
        def __init__(self, config: Any) -> None:
            raise _Abort("the constructor was interrupted")

    class RaisingUNet(UNet2DModel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise _Abort("the constructor was interrupted")

    llama = paths["llama"]
    return {
        "bad-kwarg": lambda: AutoModelForCausalLM.from_pretrained(
            llama, dtype=torch.float32, not_a_model_argument=1
        ),
        "missing-directory": lambda: AutoModelForCausalLM.from_pretrained(
            os.path.join(llama, "missing"), dtype=torch.float32
        ),
        "transformers-__init__": lambda: RaisingLlama.from_pretrained(llama, dtype=torch.float32),
        "transformers-no-dtype-__init__": lambda: RaisingLlama.from_pretrained(llama),
        "diffusers-__init__": lambda: RaisingUNet.from_pretrained(
            paths["unet"], torch_dtype=torch.float32
        ),
        "diffusers-no-dtype-__init__": lambda: RaisingUNet.from_pretrained(paths["unet"]),
        "non-float-dtype": lambda: AutoModelForCausalLM.from_pretrained(llama, dtype=torch.int8),
    }


@pytest.mark.parametrize(
    "idiom",
    ["bad-kwarg", "missing-directory", "transformers-__init__", "transformers-no-dtype-__init__",
     "diffusers-__init__", "diffusers-no-dtype-__init__", "non-float-dtype"],
)  # fmt: skip
def test_a_load_that_raises_beside_another_dtypes_load_leaves_nothing_open(saved, idiom):
    load = _raising_loads(saved)[idiom]
    with metamode.enabled():
        result, _ = beside_a_load(saved, load)
        state = dtype_windows.state()
    assert isinstance(result, BaseException), result
    assert state == dtype_windows.WindowState(baseline=None)
    assert torch.get_default_dtype() == torch.float32


_interrupted = threading.Event()


@contextlib.contextmanager
def _sigint_raises_abort() -> Iterator[None]:
    """SIGINT raises ``_Abort`` in the main thread, once."""

    def handler(signum: int, frame: object) -> None:
        if not _interrupted.is_set():
            _interrupted.set()
            raise _Abort("interrupted")

    _interrupted.clear()
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_main_once_parked() -> threading.Thread:
    """A thread that sends SIGINT to the main thread once it is parked. A signal that lands
    just before the main thread blocks does not wake it, so it is sent again (the handler
    acts once) until the handler has run."""
    main = threading.main_thread().ident

    def interrupt() -> None:
        if not dtype_windows.wait_until(lambda s: main in s.parked, WAIT_S):
            raise TimeoutError("the main thread never parked")
        for _ in range(int(WAIT_S / 0.05)):
            signal.pthread_kill(main, signal.SIGINT)
            if _interrupted.wait(0.05):
                return
        raise TimeoutError("the main thread was never interrupted")

    thread = threading.Thread(target=interrupt)
    thread.start()
    return thread


def test_ctrl_c_while_a_load_waits_for_its_window(saved):
    """The main thread's float32 load parks on another thread's float16 load; SIGINT's
    handler raises there. The other load goes on, and nothing stays open."""
    from transformers import AutoModelForCausalLM

    assert threading.current_thread() is threading.main_thread()
    raised: list[BaseException] = []

    def load() -> None:
        interrupter = _interrupt_main_once_parked()
        try:
            AutoModelForCausalLM.from_pretrained(saved["llama"], dtype=torch.float32)
        except _Abort as error:
            raised.append(error)
        finally:
            interrupter.join()

    held = _held_llama_class()
    h_inside, release, done = threading.Event(), threading.Event(), threading.Event()
    models: list[nn.Module] = []

    def gate() -> None:
        h_inside.set()
        wait(release, "the main thread's interrupted load")

    def h() -> None:
        held.gate = gate
        try:
            models.append(held.from_pretrained(saved["llama"], dtype=torch.float16))
        finally:
            done.set()

    with metamode.enabled(), _sigint_raises_abort():
        thread = threading.Thread(target=h)
        thread.start()
        wait(h_inside, "H inside its construction")
        try:
            load()
        finally:
            release.set()
            thread.join()
        state = dtype_windows.state()
    assert len(raised) == 1
    assert state == dtype_windows.WindowState(baseline=None)
    assert torch.get_default_dtype() == torch.float32
    alone = held.from_pretrained(saved["llama"], dtype=torch.float16)
    assert dtype_loads.differences(models[0], alone) == []


def test_ctrl_c_while_waiting_to_reopen_an_outer_window_leaves_it_closable():
    """A composite build: the main thread's float16 window holds a float32 one (a sub-model);
    closing the inner one waits for float16 while B runs float32, and SIGINT's handler
    raises there. The outer window must still close, and the baseline come back. (Before
    the fix: KeyError in the outer close, the windows left inconsistent.)"""
    assert threading.current_thread() is threading.main_thread()
    b_running, b_release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def b() -> None:
        try:
            with dtype_windows.dtype_window(torch.float32):
                b_running.set()
                wait(b_release, "the main thread")
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=b)
    with _sigint_raises_abort():
        with contextlib.suppress(_Abort), dtype_windows.dtype_window(torch.float16):
            thread.start()
            dtype_windows.wait_until(lambda s: thread.ident in s.parked, WAIT_S)
            with dtype_windows.dtype_window(torch.float32):
                wait(b_running, "B running beside the inner window")
                interrupter = _interrupt_main_once_parked()
        interrupter.join()
        interrupted_state = dtype_windows.state()
        b_release.set()
        thread.join()
    assert errors == []
    assert threading.get_ident() not in interrupted_state.stacks
    assert dtype_windows.state() == dtype_windows.WindowState(baseline=None)
    assert torch.get_default_dtype() == torch.float32


def test_an_interrupted_wait_while_a_call_closes_its_windows_closes_them_all():
    """diffusers' windows are closed by ``closing_call`` when ``from_pretrained`` returns;
    an interruption between two closes must not leave the outer one open for good."""
    assert threading.current_thread() is threading.main_thread()
    b_running, b_release = threading.Event(), threading.Event()

    def b() -> None:
        dtype_windows.open_window(torch.float32)
        b_running.set()
        wait(b_release, "the main thread")
        dtype_windows.close_window()

    thread = threading.Thread(target=b)
    with _sigint_raises_abort():
        with contextlib.suppress(_Abort), dtype_windows.closing_call():
            dtype_windows.open_window(torch.float16)
            thread.start()
            dtype_windows.wait_until(lambda s: thread.ident in s.parked, WAIT_S)
            dtype_windows.open_window(torch.float32)
            wait(b_running, "B")
            interrupter = _interrupt_main_once_parked()
        interrupter.join()
    left = dtype_windows.state()
    b_release.set()
    thread.join()
    assert threading.get_ident() not in left.stacks
    assert dtype_windows.state() == dtype_windows.WindowState(baseline=None)
    assert torch.get_default_dtype() == torch.float32


# -- enable and disable while another thread loads ------------------------------------------


@pytest.mark.parametrize("library", ["transformers", "diffusers"])
def test_disable_while_another_thread_is_inside_its_window(saved, library):
    """``disable()`` while a routed load is inside its window (waiting at its model's first
    parameter): that load still closes its window and builds its lone model, and the
    default comes back."""
    from diffusers import UNet2DModel
    from transformers import AutoModelForCausalLM

    from tests.integration.test_integrations_hf import _Gates

    def load() -> nn.Module:
        if library == "transformers":
            return AutoModelForCausalLM.from_pretrained(saved["llama"], dtype=torch.float16)
        return UNet2DModel.from_pretrained(saved["unet"], torch_dtype=torch.float16)

    alone = load()
    inside, release = threading.Event(), threading.Event()
    out: list[Any] = []

    def gate() -> None:
        inside.set()
        wait(release, "disable()")

    def h(gates: _Gates) -> None:
        gates.arm(gate)
        out.append(load())

    metamode.enable()
    with _Gates() as gates:
        thread = threading.Thread(target=h, args=(gates,))
        try:
            thread.start()
            wait(inside, "the load inside its window")
            assert dtype_windows.state().running == {thread.ident: torch.float16}
        finally:
            _registry.disable()
            release.set()
            thread.join()
    assert dtype_loads.differences(out[0], alone) == []
    assert dtype_windows.state() == dtype_windows.WindowState(baseline=None)
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.requires_transformers_5
@pytest.mark.xfail(
    strict=True,
    reason="a stock load that began before enable() set the default itself: the first window "
    "records that float16 as the baseline, and the last window to close puts it back after the "
    "stock load restored its own (docs/guides/shims.md, enable once, disable when idle)",
)
def test_enable_while_a_stock_load_is_inside_its_construction(saved):
    """H's stock float16 load waits in its constructor; ``enable()``; L's float32 load opens
    its window and waits in its constructor; H finishes, then L."""
    h_held, l_held = _held_llama_class(), _held_llama_class()
    h_inside, h_release, l_inside, l_release = (threading.Event() for _ in range(4))

    def gate(inside: threading.Event, release: threading.Event) -> Callable[[], None]:
        def run() -> None:
            inside.set()
            wait(release, "the test")

        return run

    def h() -> None:
        h_held.gate = gate(h_inside, h_release)
        h_held.from_pretrained(saved["llama"], dtype=torch.float16)

    def l_load() -> None:
        l_held.gate = gate(l_inside, l_release)
        l_held.from_pretrained(saved["llama"], dtype=torch.float32)

    threads = [threading.Thread(target=h), threading.Thread(target=l_load)]
    try:
        threads[0].start()
        wait(h_inside, "H's stock load in its constructor")
        metamode.enable()
        threads[1].start()
        wait(l_inside, "L's load in its window")
        h_release.set()
        threads[0].join()
        l_release.set()
        threads[1].join()
        left = torch.get_default_dtype()
    finally:
        h_release.set()
        l_release.set()
        for thread in threads:
            if thread.is_alive() or thread.ident is not None:
                thread.join()
        _registry.disable()
        torch.set_default_dtype(torch.float32)
    assert left == torch.float32


# -- transformers 5's init guard, by the ways real code calls torch.nn.init ---------------


def _guard_idiom_classes() -> tuple[type, type]:
    from transformers import PretrainedConfig, PreTrainedModel

    class IdiomConfig(PretrainedConfig):
        model_type = "metamode-guard-idioms"

    class Idioms(PreTrainedModel):
        """``loaded``'s weight is in the checkpoint, its bias is not, so ``_init_weights``
        runs on ``loaded`` with its weight marked ``_is_hf_initialized``: stock's guard
        leaves the weight as loaded for every call that reaches its wrappers."""

        config_class = IdiomConfig
        base_model_prefix = "idioms"
        style: ClassVar[str] = "attribute"

        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.loaded = nn.Linear(4, 4)
            self.conv = nn.Conv1d(4, 4, 1)  # dirac_ takes 3-5 dimensions
            self.post_init()

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Conv1d):
                if type(self).style == "dirac_":
                    nn.init.dirac_(module.weight)
                nn.init.zeros_(module.bias)
            if not isinstance(module, nn.Linear):
                return
            weight, style = module.weight, type(self).style
            if style == "attribute":
                torch.nn.init.normal_(weight)
            elif style == "from-import":  # bound before the guard: stock runs it
                imported_normal_(weight)
            elif style == "reset_parameters":
                module.reset_parameters()
            elif style == "trunc_normal_":
                nn.init.trunc_normal_(weight, std=0.02, a=-0.5, b=0.5)  # loaded values outside
            elif style == "xavier_uniform_":
                nn.init.xavier_uniform_(weight)
            elif style == "zeros_":
                nn.init.zeros_(weight)
            elif style == "tensor-method":  # not an init function: stock runs it
                weight.data.normal_()
            elif style == "getattr":
                getattr(torch.nn.init, "normal_")(weight)  # noqa: B009 (the idiom under test)
            elif style == "local-alias":
                init = nn.init.normal_
                init(weight)
            elif style == "orthogonal_":
                nn.init.orthogonal_(weight)
            elif style == "eye_":
                nn.init.eye_(weight)
            elif style == "sparse_":
                nn.init.sparse_(weight, 0.5)
            nn.init.zeros_(module.bias)

    return IdiomConfig, Idioms


_NOT_A_CALL_SITE = (
    "the call site is not `<expr>.NAME(...)`: GuardLoadedTensors cannot tell a name looked up "
    "inside initialize_weights (stock's wrapper) from one bound before it (torch's function), "
    "so the loaded tensor is overwritten and the generator advances where stock skips"
)
_NO_DISPATCH = (
    "torch.nn.init.{} has no __torch_function__ dispatch of its own: a mode sees only the "
    "operations inside it, on views, scratch tensors or `out=`, never the call stock's "
    "wrapper skips, so the loaded tensor is overwritten"
)

_REDRAWS = (
    "torch.nn.init.trunc_normal_ has no __torch_function__ dispatch of its own, and its "
    "rejection loop redraws, into scratch tensors, the loaded values outside [a, b]: the mode "
    "skips the writes to the loaded tensor, not those draws, so the generator advances where "
    "stock's wrapper skips the call"
)


@pytest.mark.requires_transformers_5
@pytest.mark.parametrize(
    "style",
    [
        "attribute", "from-import", "reset_parameters", "xavier_uniform_", "zeros_",
        "tensor-method",
        pytest.param("getattr", marks=pytest.mark.xfail(strict=True, reason=_NOT_A_CALL_SITE)),
        pytest.param(
            "local-alias", marks=pytest.mark.xfail(strict=True, reason=_NOT_A_CALL_SITE)
        ),
        pytest.param(
            "trunc_normal_", marks=pytest.mark.xfail(strict=True, reason=_REDRAWS)
        ),
        pytest.param(
            "orthogonal_",
            marks=pytest.mark.xfail(strict=True, reason=_NO_DISPATCH.format("orthogonal_")),
        ),
        pytest.param(
            "eye_", marks=pytest.mark.xfail(strict=True, reason=_NO_DISPATCH.format("eye_"))
        ),
        pytest.param(
            "sparse_", marks=pytest.mark.xfail(strict=True, reason=_NO_DISPATCH.format("sparse_"))
        ),
        pytest.param(
            "dirac_", marks=pytest.mark.xfail(strict=True, reason=_NO_DISPATCH.format("dirac_"))
        ),
    ],
)  # fmt: skip
def test_the_guard_skips_a_loaded_tensor_exactly_where_stock_does(tmp_path, style):
    config_class, idioms = _guard_idiom_classes()
    torch.manual_seed(3)
    model = idioms(config_class())
    model.save_pretrained(str(tmp_path))
    weights = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if k not in ("loaded.bias", "conv.bias")
    }
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    idioms.style = style
    torch.manual_seed(11)
    stock = idioms.from_pretrained(str(tmp_path))
    state = torch.get_rng_state()
    with metamode.enabled("transformers"):
        torch.manual_seed(11)
        shimmed = idioms.from_pretrained(str(tmp_path))
        same_generator = torch.equal(torch.get_rng_state(), state)
    assert (dtype_loads.differences(shimmed, stock), same_generator) == ([], True)


# -- a lone load given no dtype is still stock's ----------------------------------------------


@pytest.mark.parametrize(
    "idiom",
    ["transformers:no-dtype", "transformers:from_config-no-dtype",
     "transformers:dict-without-main", "transformers:composite-auto",
     "diffusers:no-torch_dtype", "diffusers:pipeline-no-torch_dtype"],
)  # fmt: skip
def test_a_lone_load_given_no_dtype_is_stocks_bitwise_with_the_generator(saved, idiom):
    library, name = idiom.split(":")
    loads = _transformers_loads(saved) if library == "transformers" else _diffusers_loads(saved)
    torch.manual_seed(7)
    stock = _as_module(loads[name]())
    stock_state = torch.get_rng_state()
    with metamode.enabled():
        torch.manual_seed(7)
        shimmed = _as_module(loads[name]())
        same_generator = torch.equal(torch.get_rng_state(), stock_state)
    assert (dtype_loads.differences(shimmed, stock), same_generator) == ([], True)


def test_barrier_rounds_of_loads_with_and_without_a_dtype_are_each_exact(saved):
    """Bounded stress beside the forced scenarios: 5 rounds of four loads released by a
    barrier, 1 µs switch interval: float16, none, a config without one, diffusers without
    one."""
    from diffusers import UNet2DModel
    from transformers import AutoModelForCausalLM

    def from_config() -> nn.Module:
        torch.manual_seed(5)
        return AutoModelForCausalLM.from_config(_llama_config())

    loads: list[Callable[[], nn.Module]] = [
        lambda: AutoModelForCausalLM.from_pretrained(saved["llama"], dtype=torch.float16),
        lambda: AutoModelForCausalLM.from_pretrained(saved["llama"]),
        from_config,
        lambda: UNet2DModel.from_pretrained(saved["unet"]),
    ]
    alone = [load() for load in loads]
    wrong: list[str] = []
    with metamode.enabled():
        previous = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            for _ in range(5):
                barrier = threading.Barrier(len(loads))
                models: dict[int, Any] = {}

                def run(
                    index: int, barrier: threading.Barrier = barrier, models: dict = models
                ) -> None:
                    barrier.wait()
                    try:
                        models[index] = loads[index]()
                    except BaseException as error:
                        models[index] = error

                threads = [threading.Thread(target=run, args=(i,)) for i in range(len(loads))]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                for index, reference in enumerate(alone):
                    got = _as_module(models[index])
                    found = dtype_loads.differences(got, reference)
                    if index == 2:  # random weights: the generator is shared by the threads
                        found = [f for f in found if "values differ" not in f]
                    wrong += found[:1]
        finally:
            sys.setswitchinterval(previous)
    assert wrong == []
    assert torch.get_default_dtype() == torch.float32
    assert dtype_windows.state() == dtype_windows.WindowState(baseline=None)
