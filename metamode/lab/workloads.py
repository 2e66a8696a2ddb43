"""Workloads for ``python -m metamode bench``, and the worker that measures them.

Why a separate worker: every measurement must start from a process in which
no empty-weights helper has run (accelerate and PEFT patch ``torch.nn.Module``
process-wide; metamode installs registration hooks on import; transformers
adds ``torch.nn.Module.smart_apply`` on its first init). Importing torch,
transformers and diffusers takes seconds, so the worker imports them once and
then *forks* a fresh child per measurement: the child inherits the imports
and nothing else, measures one thing, reports it and exits. Pass
``--no-fork`` to the bench to start a new interpreter per measurement instead.

This module never imports metamode's core at module level (see
:mod:`metamode.lab`): the "not imported" side of the idle-overhead comparison
and the stock-library baselines must run in processes without metamode's
hooks. A child imports metamode only when its method needs it.

Shapes are the real models' published configuration values, written out in
code (no hub access): Llama-2-7B and Llama-2-70B, Llama-3.2-1B, and the
SDXL-base-1.0 UNet. Every workload also has a ``tiny`` shape for the test suite
and each child's warm-up build.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from metamode.lab import core_imported
from metamode.lab.scenarios import register_parameter_is_torchs

# -- shapes ---------------------------------------------------------------------------

LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-2-7b-hf
    "7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # meta-llama/Llama-2-70b-hf
    "70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # meta-llama/Llama-3.2-1B
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # idle-overhead model: small enough to build with real weights in ~0.1 s
    "small": dict(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8000,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ),
}

# stabilityai/stable-diffusion-xl-base-1.0, unet/config.json
SDXL_UNET: dict[str, Any] = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    center_input_sample=False,
    flip_sin_to_cos=True,
    freq_shift=0,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    mid_block_type="UNetMidBlock2DCrossAttn",
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    only_cross_attention=False,
    block_out_channels=(320, 640, 1280),
    layers_per_block=2,
    downsample_padding=1,
    mid_block_scale_factor=1,
    act_fn="silu",
    norm_num_groups=32,
    norm_eps=1e-5,
    cross_attention_dim=2048,
    transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20),
    dual_cross_attention=False,
    use_linear_projection=True,
    upcast_attention=False,
    resnet_time_scale_shift="default",
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    conv_in_kernel=3,
    conv_out_kernel=3,
)
SDXL_UNET_TINY: dict[str, Any] = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(8, 16),
    layers_per_block=1,
    norm_num_groups=4,
    cross_attention_dim=16,
    transformer_layers_per_block=(1, 1),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=4,
    projection_class_embeddings_input_dim=6 * 4 + 8,
)

# A Llama-2-7B-shaped decoder written in plain torch.nn (no optional package).
TORCH_LM_SHAPES: dict[str, dict[str, int]] = {
    "7b": dict(vocab=32000, width=4096, ffn=11008, layers=32),
    "small": dict(vocab=8000, width=512, ffn=1376, layers=4),
    "tiny": dict(vocab=128, width=32, ffn=64, layers=2),
}

LORA_RANK = 16
LLAMA_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# every attention projection and both feed-forward linears of every transformer block
UNET_LORA_TARGETS = r".*\.attn[12]\.(to_q|to_k|to_v|to_out\.0)|.*\.ff\.net\.(0\.proj|2)"
TORCH_LORA_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


# -- models ---------------------------------------------------------------------------


class TorchBlock(nn.Module):
    """One pre-norm decoder block: attention projections and a gated MLP."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.norm2 = nn.LayerNorm(width)
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        scores = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / h.shape[-1] ** 0.5, -1)
        x = x + self.o(scores @ self.v(h))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class TorchLM(nn.Module):
    """A decoder-only LM from torch.nn alone, with a tied head and a position buffer."""

    def __init__(self, vocab: int, width: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(TorchBlock(width, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(4096), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_torch_lm(shape: str) -> nn.Module:
    return TorchLM(**TORCH_LM_SHAPES[shape])


def build_llama(shape: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPES[shape]))


def build_sdxl_unet(shape: str) -> nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**(SDXL_UNET_TINY if shape == "tiny" else SDXL_UNET))


# name -> (builder, full shape, packages it needs)
MODELS: dict[str, tuple[Callable[[str], nn.Module], str, tuple[str, ...]]] = {
    "torch-7b": (build_torch_lm, "7b", ()),
    "torch-small": (build_torch_lm, "small", ()),
    "llama-7b": (build_llama, "7b", ("transformers",)),
    "llama-70b": (build_llama, "70b", ("transformers",)),
    "llama-1b": (build_llama, "1b", ("transformers",)),
    "llama-small": (build_llama, "small", ("transformers",)),
    "sdxl-unet": (build_sdxl_unet, "full", ("diffusers",)),
}
LORA_TARGETS = {
    "torch-7b": TORCH_LORA_TARGETS,
    "torch-small": TORCH_LORA_TARGETS,
    "llama-1b": LLAMA_LORA_TARGETS,
    "sdxl-unet": UNET_LORA_TARGETS,
}


def build(model: str, tiny: bool = False) -> nn.Module:
    builder, shape, _ = MODELS[model]
    return builder("tiny" if tiny else shape)


def describe(module: nn.Module) -> dict[str, Any]:
    """Everything about ``module`` except tensor values, as plain data.

    Module tree (names and classes), every parameter and buffer (shape, dtype,
    device, ``requires_grad``, class, persistence) and which names share one
    parameter object (ties). Two builds of a model are structurally identical
    exactly when their descriptions are equal.
    """
    param_ids: dict[int, str] = {}
    params = []
    for name, param in module.named_parameters(remove_duplicate=False):
        first = param_ids.setdefault(id(param), name)
        params.append(
            [
                name,
                list(param.shape),
                str(param.dtype),
                param.device.type,
                param.requires_grad,
                type(param).__qualname__,
                first,
            ]
        )
    buffers = []
    for qualified, sub in module.named_modules(remove_duplicate=False):
        for name, tensor in sub._buffers.items():
            if tensor is None:
                continue
            persistent = name not in sub._non_persistent_buffers_set
            buffers.append(
                [
                    f"{qualified}.{name}".lstrip("."),
                    list(tensor.shape),
                    str(tensor.dtype),
                    tensor.device.type,
                    persistent,
                ]
            )
    modules = [[name, type(sub).__qualname__] for name, sub in module.named_modules()]
    return {"modules": modules, "parameters": params, "buffers": buffers}


# -- methods --------------------------------------------------------------------------

SKELETON_METHODS = (
    "none",
    "accelerate",
    "accelerate+buffers",
    "peft",
    "torch.device",
    "metamode",
    "metamode+buffers",
)
LORA_METHODS = (
    "low_cpu_mem_usage=False",
    "stock low_cpu_mem_usage=True",
    "shim low_cpu_mem_usage=True",
)
THREAD_FLAVOURS = ("stock", "shim", "control")
IDLE_METHODS = ("not imported", "imported+enabled")


def skeleton_context(method: str) -> contextlib.AbstractContextManager:
    if method == "none":
        return contextlib.nullcontext()
    if method == "torch.device":
        return torch.device("meta")
    if method.startswith("accelerate"):
        from accelerate import init_empty_weights

        return init_empty_weights(include_buffers=method.endswith("+buffers"))
    if method == "peft":
        from peft.utils.integrations import init_empty_weights

        return init_empty_weights()
    if method.startswith("metamode"):
        import metamode

        return metamode.empty_weights(include_buffers=method.endswith("+buffers"))
    raise ValueError(f"unknown method {method!r}")


# -- measuring ------------------------------------------------------------------------


def _rss_now() -> int | None:
    """Resident set size in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Make the kernel's peak-RSS mark start from now (Linux ``clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        return None


class _GcClock:
    """Seconds spent in garbage collection, via ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._started = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections += 1


@contextlib.contextmanager
def _timed(result: dict[str, Any]) -> Iterator[None]:
    """Record wall and CPU seconds, peak/start RSS and GC time of the block.

    Everything alive before the block is collected and then frozen
    (``gc.freeze``): a full collection traverses every object the imported
    libraries made (~400k, ~0.2 s here), and where one happens to land is
    noise, not a property of the method being measured.
    """
    gc.collect()
    gc.freeze()
    clock = _GcClock()
    gc.callbacks.append(clock)
    result["peak_reset"] = _reset_peak_rss()
    result["rss_start"] = _rss_now()
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        yield
    finally:
        result["wall_s"] = time.perf_counter() - wall
        result["cpu_s"] = time.process_time() - cpu
        result["rss_peak"] = _peak_rss()
        gc.callbacks.remove(clock)
        result["gc_s"], result["gc_collections"] = clock.seconds, clock.collections


def _devices(module: nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        counts[tensor.device.type] = counts.get(tensor.device.type, 0) + 1
    return counts


def measure_skeleton(task: dict[str, Any]) -> dict[str, Any]:
    model, method, tiny = task["model"], task["method"], task.get("tiny", False)
    with skeleton_context(method):  # warm-up: lazy imports, caches, first kernels
        build(model, tiny=True)
    result: dict[str, Any] = {}
    with _timed(result), skeleton_context(method):
        built = build(model, tiny=tiny)
    result["devices"] = _devices(built)
    result["parameters"] = sum(p.numel() for p in built.parameters())
    return result


def measure_size(task: dict[str, Any]) -> dict[str, Any]:
    """Bytes of parameters and buffers, from a meta build (decides if "none" fits)."""
    with torch.device("meta"):
        built = build(task["model"], tiny=task.get("tiny", False))
    tensors = {id(t): t for t in [*built.parameters(), *built.buffers()]}
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def real_base_model(model: str, tiny: bool) -> nn.Module:
    """``model`` with real (CPU, uninitialised) weights, built without running inits."""
    with torch.device("meta"):
        built = build(model, tiny=tiny)
    return built.to_empty(device="cpu")


def _lora_config(model: str) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=LORA_TARGETS[model])


def _inject(model_name: str, model: nn.Module, low_cpu_mem_usage: bool) -> None:
    from peft import inject_adapter_in_model

    inject_adapter_in_model(_lora_config(model_name), model, low_cpu_mem_usage=low_cpu_mem_usage)


def _lora_problems(model: nn.Module, low_cpu_mem_usage: bool) -> list[str]:
    want = "meta" if low_cpu_mem_usage else "cpu"
    problems = []
    lora = 0
    for name, param in model.named_parameters():
        expected = want if "lora_" in name else "cpu"
        lora += "lora_" in name
        if param.device.type != expected:
            problems.append(f"{name} on {param.device.type}, expected {expected}")
    if not lora:
        problems.append("no LoRA parameters were injected")
    return problems


def measure_lora(task: dict[str, Any]) -> dict[str, Any]:
    model, method, tiny = task["model"], task["method"], task.get("tiny", False)
    low_cpu_mem_usage = method != "low_cpu_mem_usage=False"
    if method.startswith("shim"):
        import metamode

        metamode.enable_for_peft()
    _inject(model, real_base_model(model, tiny=True), low_cpu_mem_usage)  # warm-up
    base = real_base_model(model, tiny=tiny)
    result: dict[str, Any] = {}
    with _timed(result):
        _inject(model, base, low_cpu_mem_usage)
    problems = _lora_problems(base, low_cpu_mem_usage)
    result["lora_parameters"] = sum(p.numel() for n, p in base.named_parameters() if "lora_" in n)
    result["problems"] = problems[:5]
    return result


def _torch_op_loop(tiny: bool) -> Callable[[], None]:
    """The control workload: nothing but trivial torch calls (no PEFT, no metamode)."""
    tensor = torch.empty(4, device="meta")
    rounds = 2_000 if tiny else 20_000

    def loop() -> None:
        for _ in range(rounds):
            tensor.view(2, 2)

    return loop


def measure_threads(task: dict[str, Any]) -> dict[str, Any]:
    """``threads`` units of work into independent models, concurrently or one by one.

    A unit is a LoRA injection (``low_cpu_mem_usage=True``) into its own
    model with stock PEFT or metamode's shim, or -- flavour ``control`` -- a
    loop of trivial torch calls: the overhead the GIL alone puts on threads
    that call torch, with neither PEFT nor metamode involved.
    ``concurrent``: one thread per unit, released together by a Barrier;
    ``sequential``: the same units one after another in this thread.
    Afterwards: did any injection go wrong, and is ``register_parameter``
    still torch's own (stock PEFT can leak its patch)?
    """
    model, count, tiny = task["model"], task["threads"], task.get("tiny", False)
    flavour = task["flavour"]
    errors: list[str] = []
    if flavour == "control":
        loop = _torch_op_loop(tiny)
        loop()  # warm-up
        units: list[Callable[[], None]] = [loop] * count
        bases: list[nn.Module] = []
    else:
        if flavour == "shim":
            import metamode

            metamode.enable_for_peft()
        _inject(model, real_base_model(model, tiny=True), True)  # warm-up
        bases = [real_base_model(model, tiny=tiny) for _ in range(count)]
        units = [functools.partial(_inject, model, base, True) for base in bases]

    def run(unit: Callable[[], None]) -> None:
        try:
            unit()
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}"[:300])

    barrier = threading.Barrier(count)

    def worker(unit: Callable[[], None]) -> None:
        try:
            barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            errors.append("barrier broken")
            return
        run(unit)

    result: dict[str, Any] = {}
    if task["mode"] == "concurrent":
        threads = [threading.Thread(target=worker, args=(unit,)) for unit in units]
        with _timed(result):
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    else:
        with _timed(result):
            for unit in units:
                run(unit)
    problems = [p for base in bases for p in _lora_problems(base, True)]
    result["problems"] = (errors + problems)[:5]
    result["leaked"] = not register_parameter_is_torchs()
    result["linear_after"] = nn.Linear(2, 2).weight.device.type
    return result


def _idle_model(tiny: bool) -> tuple[str, torch.Tensor]:
    name = "llama-small" if _available("transformers") else "torch-small"
    ids = torch.randint(0, 100, (1, 8 if tiny else 64))
    return name, ids


IDLE_INNER = 5  # timed build+forward rounds per process; the median is the measurement


def measure_idle(task: dict[str, Any]) -> dict[str, Any]:
    """Build a small model with real weights and run one forward pass, no context active.

    "imported+enabled" runs ``import metamode; metamode.enable()`` first
    (every shim whose library is installed), so the registration hooks and
    rebound names are all in place. Each process times ``IDLE_INNER`` rounds
    and reports their median: the effect looked for is ~0, and a single round
    varies by a few percent on a busy machine. One intra-op thread, for the
    same reason: OpenMP threads spinning on a loaded machine would drown a 2%
    effect.
    """
    torch.set_num_threads(1)
    tiny = task.get("tiny", False)
    result: dict[str, Any] = {}
    if task["method"] == "imported+enabled":
        started = time.perf_counter()
        import metamode

        enable = getattr(metamode, "enable", None) or metamode.enable_for_peft
        result["enabled"] = sorted(enable() or ())
        result["import_s"] = time.perf_counter() - started
    name, ids = _idle_model(tiny)
    rounds: list[dict[str, Any]] = []
    with torch.no_grad():
        build(name, tiny=True)(ids[:, :4])  # warm-up
        for _ in range(2 if tiny else IDLE_INNER):
            torch.manual_seed(0)
            timed: dict[str, Any] = {}
            with _timed(timed):
                model = build(name, tiny=tiny)
                model(ids)
            del model
            rounds.append(timed)
    for key in ("wall_s", "cpu_s", "gc_s"):
        result[key] = statistics.median(r[key] for r in rounds)
        result[f"{key}_rounds"] = [r[key] for r in rounds]
    result["rss_peak"] = max((r["rss_peak"] or 0) for r in rounds) or None
    result["metamode_imported"] = core_imported()
    result["model"] = name
    return result


MEASURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "skeleton": measure_skeleton,
    "size": measure_size,
    "lora": measure_lora,
    "threads": measure_threads,
    "idle": measure_idle,
}


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    """Measure ``task`` in this process; never raises (errors are reported)."""
    try:
        result = MEASURES[task["kind"]](task)
        result["ok"] = True
    except Exception as error:
        result = {
            "ok": False,
            "error": f"{type(error).__name__}: {error}"[:500],
            "traceback": traceback.format_exc()[-2000:],
        }
    return result


# -- the worker process ----------------------------------------------------------------


def _available(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def preload(packages: list[str]) -> list[str]:
    """Import what the tasks need once, so forked children start warm."""
    loaded = []
    imports = {
        "transformers": ("transformers", "transformers.models.llama.modeling_llama"),
        "diffusers": ("diffusers", "diffusers.models.unets.unet_2d_condition"),
        "peft": ("peft", "peft.tuners.lora"),
        "accelerate": ("accelerate",),
    }
    for package in packages:
        try:
            for module in imports.get(package, (package,)):
                importlib.import_module(module)
            loaded.append(package)
        except ImportError:
            pass
    return loaded


def _run_forked(task: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``task`` in a forked child; its result comes back through a pipe."""
    read_end, write_end = os.pipe()
    with tempfile.TemporaryFile() as log:
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                os.close(read_end)
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                payload = json.dumps(run_task(task)).encode()
                with os.fdopen(write_end, "wb") as out:
                    out.write(payload)
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        chunks = []
        deadline = time.monotonic() + timeout
        import select

        with os.fdopen(read_end, "rb") as pipe:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    os.kill(pid, 9)
                    break
                ready, _, _ = select.select([pipe], [], [], min(left, 1.0))
                if ready:
                    chunk = os.read(pipe.fileno(), 1 << 16)
                    if not chunk:
                        break
                    chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        if chunks and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            return json.loads(b"".join(chunks))
        log.seek(0)
        tail = log.read()[-2000:].decode(errors="replace")
    if os.WIFSIGNALED(status):
        signal = os.WTERMSIG(status)
        why = "timed out" if time.monotonic() >= deadline else f"killed by signal {signal}"
        if signal == 9 and why != "timed out":
            why += " (out of memory?)"
    else:
        why = f"exited with status {os.WEXITSTATUS(status)}"
    return {"ok": False, "error": why, "killed": os.WIFSIGNALED(status), "log": tail}


def serve(packages: list[str]) -> None:
    """Read one JSON task per line on stdin; answer one JSON result per line."""
    loaded = preload(packages)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "loaded": loaded}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        result = _run_forked(task, float(task.get("timeout", 600)))
        out.write(json.dumps(result) + "\n")
        out.flush()


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        serve(argv[1].split(",") if len(argv) > 1 and argv[1] else [])
    elif argv[:1] == ["once"]:
        print(json.dumps(run_task(json.loads(argv[1]))), flush=True)
    else:
        raise SystemExit("usage: python -m metamode.lab.workloads serve PKG,PKG | once TASK_JSON")


if __name__ == "__main__":
    main(sys.argv[1:])
