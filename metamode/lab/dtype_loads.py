"""Concurrent ``from_pretrained`` loads with a dtype: the race, and what each design costs.

``python -m metamode dtype-loads`` runs, in one subprocess per setting (stock, or after
``metamode.enable()``), rounds of two loader threads released together by a barrier, each
model compared with a single-threaded load of the same dtype, then prints what was wrong and
what the process was left with. ``--throughput`` times the same loads: mixed and same-dtype
pairs, stock, metamode's dtype windows, and a process-wide lock around every load. The
models are tiny and saved once into a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["main", "race", "save_models"]

LIBRARIES = ("transformers", "diffusers")
_INIT_MODULES = (
    "torch.nn.init",
    "torch.nn.modules.activation",
    "torch.nn.modules.transformer",
    "torch.nn.modules.linear",
    "torch.nn.modules.loss",
    "torch.nn.modules.batchnorm",
    "torch.nn.modules.conv",
    "torch.nn.modules.normalization",
    "torch.nn.modules.rnn",
    "torch.nn.modules.sparse",
)


# Llama sizes: tiny (2 layers of width 16, Python-bound loads) and small (4 layers of width
# 512, 23M parameters: loads spend most of their time in torch's kernels and memory copies).
_LLAMA_SIZES = {
    "tiny": {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2},
    "small": {
        "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
    },
}  # fmt: skip


def save_models(directory: str, size: str = "tiny") -> dict[str, str]:
    """Save a tied Llama of ``size``, a tiny tied GPT-2, a tiny UNet2DModel and a tiny SDXL
    pipeline with text encoders; their paths."""
    paths = {}
    torch.manual_seed(0)
    if _installed("transformers"):
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        transformers.logging.set_verbosity_error()
        llama = LlamaConfig(
            **_LLAMA_SIZES[size], num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=32, tie_word_embeddings=True,
        )  # fmt: skip
        paths["llama"] = os.path.join(directory, "llama")
        LlamaForCausalLM(llama).save_pretrained(paths["llama"])
        gpt2 = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)
        paths["gpt2"] = os.path.join(directory, "gpt2")
        GPT2LMHeadModel(gpt2).save_pretrained(paths["gpt2"])
    if _installed("diffusers"):
        from diffusers import UNet2DModel

        unet = UNet2DModel(
            sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=(8, 16), norm_num_groups=4,
            down_block_types=("DownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "UpBlock2D"),
        )  # fmt: skip
        paths["unet"] = os.path.join(directory, "unet")
        unet.save_pretrained(paths["unet"])
    if _installed("diffusers") and _installed("transformers"):
        paths["sdxl"] = os.path.join(directory, "sdxl")
        _tiny_sdxl_with_text_encoders().save_pretrained(paths["sdxl"])
    return paths


def _tiny_sdxl_with_text_encoders() -> Any:
    """The tiny SDXL pipeline with two tiny CLIP text encoders (transformers models)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from metamode.lab.tiny_sdxl import build_tiny_sdxl_pipeline

    pipe = build_tiny_sdxl_pipeline()
    config = CLIPTextConfig(
        vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=16, projection_dim=8,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    pipe.register_modules(
        text_encoder=CLIPTextModel(config), text_encoder_2=CLIPTextModelWithProjection(config)
    )
    return pipe


def _installed(library: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(library) is not None


def loader(name: str, path: str) -> Callable[[torch.dtype], nn.Module]:
    """``from_pretrained`` of the saved model ``name`` with a dtype (a pipeline's
    ``nn.Module`` components as one ``nn.ModuleDict``)."""
    if name == "sdxl":
        from diffusers import DiffusionPipeline

        def load_pipeline(dtype: torch.dtype) -> nn.Module:
            pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=dtype)
            modules = {k: v for k, v in pipe.components.items() if isinstance(v, nn.Module)}
            return nn.ModuleDict(modules)

        return load_pipeline
    if name == "unet":
        from diffusers import UNet2DModel

        return lambda dtype: UNet2DModel.from_pretrained(path, torch_dtype=dtype)
    from transformers import AutoModelForCausalLM

    return lambda dtype: AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def not_torchs() -> list[str]:
    """The ``torch.nn.init`` names in the modules transformers' guard patches that hold a
    function defined outside torch."""
    return sorted(
        name
        for name, value in init_functions().items()
        if not str(getattr(value, "__module__", "")).startswith("torch")
    )


def init_functions() -> dict[str, object]:
    """Every ``torch.nn.init`` function bound in the modules transformers' guard patches."""
    found = {}
    for module_name in _INIT_MODULES:
        module = sys.modules.get(module_name)
        for name, value in vars(module or object()).items():
            if callable(value) and name.endswith("_") and not name.startswith("_"):
                found[f"{module_name}.{name}"] = value
    return found


def differences(model: nn.Module, reference: nn.Module) -> list[str]:
    """What differs from ``reference``: the dtype, device and bits of each parameter and
    buffer (a non-persistent one too, which ``state_dict`` leaves out), and ties."""
    found = []
    mine, theirs = _tensors(model), _tensors(reference)
    for key, expected in theirs.items():
        got = mine.get(key)
        if got is None:
            found.append(f"{key} missing")
        elif got.dtype != expected.dtype or got.device != expected.device:
            found.append(f"{key} is {got.dtype} on {got.device}, expected {expected.dtype}")
        elif not torch.equal(got, expected):
            found.append(f"{key} values differ")
    ties = [(a, b) for a in theirs for b in theirs if a < b and theirs[a] is theirs[b]]
    found += [f"{a} and {b} not tied" for a, b in ties if mine.get(a) is not mine.get(b)]
    return found


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def _one_round(
    loads: dict[str, Callable[[torch.dtype], nn.Module]],
    pairs: list[tuple[str, torch.dtype]],
    seen: dict[str, int],
) -> dict[int, Any]:
    """One thread per pair and a bystander, released together; each load's model or error."""
    barrier = threading.Barrier(len(pairs) + 1)
    done = threading.Event()
    results: dict[int, Any] = {}

    def load(index: int, name: str, dtype: torch.dtype) -> None:
        barrier.wait()
        try:
            results[index] = loads[name](dtype)
        except Exception as error:  # counted, not raised: the round is what we measure
            results[index] = error

    def bystander() -> None:
        barrier.wait()
        while not done.is_set():
            dtype = str(nn.Linear(2, 2).weight.dtype)
            seen[dtype] = seen.get(dtype, 0) + 1

    threads = [threading.Thread(target=load, args=(i, *p)) for i, p in enumerate(pairs)]
    watcher = threading.Thread(target=bystander)
    for thread in [*threads, watcher]:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()
    return results


def race(
    paths: dict[str, str], pairs: list[tuple[str, torch.dtype]], rounds: int
) -> dict[str, Any]:
    """``rounds`` rounds of one thread per ``(model, dtype)`` in ``pairs``, released by a
    barrier, with a bystander thread building ``nn.Linear`` throughout; what went wrong."""
    loads = {name: loader(name, paths[name]) for name, _ in pairs}
    references = {(n, d): loads[n](d) for n, d in pairs}
    default = torch.get_default_dtype()
    wrong_dtype = wrong_values = errors = 0
    seen: dict[str, int] = {}
    examples: list[str] = []
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(rounds):
            results = _one_round(loads, pairs, seen)
            round_dtype = round_values = False
            for index, pair in enumerate(pairs):
                got = results[index]
                if isinstance(got, Exception):
                    errors += 1
                    examples.append(f"{pair[0]} {pair[1]}: {type(got).__name__}: {got}"[:200])
                    continue
                found = differences(got, references[pair])
                round_dtype |= any(" is torch." in f for f in found)
                round_values |= bool(found)
                examples += [f"{pair[0]} {pair[1]}: {f}" for f in found[:1]]
            wrong_dtype += round_dtype
            wrong_values += round_values
    finally:
        sys.setswitchinterval(0.005)
    changed = not_torchs()
    return {
        "rounds": rounds,
        "wrong_dtype_rounds": wrong_dtype,
        "wrong_rounds": wrong_values,
        "errors": errors,
        "default_dtype_after": str(torch.get_default_dtype()),
        "default_dtype_before": str(default),
        "init_functions_replaced": len(changed),
        "bystander_linear_dtypes": seen,
        "examples": examples[:4],
    }


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in a for b0, b1 in b)


def _record_windows(spans: dict[int, list[tuple[float, float]]]) -> None:
    """Record when each thread's outermost dtype window opens and closes (lab only)."""
    from metamode._core import dtype_windows

    open_window, close_window = dtype_windows.open_window, dtype_windows.close_window
    opened: dict[int, float] = {}

    def timed_open(dtype: torch.dtype) -> None:
        open_window(dtype)
        if dtype_windows.windows_open_in_this_thread() == 1:
            opened[threading.get_ident()] = time.perf_counter()

    def timed_close() -> None:
        outermost = dtype_windows.windows_open_in_this_thread() == 1
        close_window()
        if outermost:
            thread = threading.get_ident()
            spans.setdefault(thread, []).append((opened.pop(thread), time.perf_counter()))

    dtype_windows.open_window, dtype_windows.close_window = timed_open, timed_close


def throughput(
    paths: dict[str, str], name: str, dtypes: tuple[torch.dtype, torch.dtype], loads: int,
    locked: bool,
) -> dict[str, float]:  # fmt: skip
    """Two threads each making ``loads`` loads (thread i in ``dtypes[i]``): wall seconds,
    how long the two threads' loads ran at the same time (a load under the lock counts from
    when it holds the lock), and how long their dtype windows were open at the same time;
    and the wall seconds of the same loads made one after another in one thread."""
    load = loader(name, paths[name])
    lock = threading.Lock() if locked else contextlib.nullcontext()
    load(dtypes[0])  # warm up
    start = time.perf_counter()
    for index in range(2 * loads):
        load(dtypes[index % 2])
    one_thread = time.perf_counter() - start
    spans: list[list[tuple[float, float]]] = [[], []]
    windows: dict[int, list[tuple[float, float]]] = {}
    if "metamode" in sys.modules:
        _record_windows(windows)
    barrier = threading.Barrier(2)

    def work(index: int) -> None:
        barrier.wait()
        for _ in range(loads):
            with lock:
                start = time.perf_counter()
                load(dtypes[index])
                spans[index].append((start, time.perf_counter()))

    start = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    window_spans = list(windows.values())
    return {
        "wall_s": wall,
        "one_thread_s": one_thread,
        "overlap_s": _overlap(*spans),
        "window_overlap_s": _overlap(*window_spans) if len(window_spans) == 2 else 0.0,
    }


_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _child(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    if args.setting == "metamode":
        import metamode

        metamode.enable()
    paths = json.loads(args.paths)
    if args.kind == "race":
        pairs = [(p.split(":")[0], _DTYPES[p.split(":")[1]]) for p in args.pairs.split(",")]
        return race(paths, pairs, args.rounds)
    d0, d1 = (_DTYPES[d] for d in args.pairs.split(","))
    return throughput(paths, args.model, (d0, d1), args.loads, args.setting == "lock")


def _run_child(argv: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "metamode", "dtype-loads", "--child", *argv],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


_RACES = {
    "transformers, float16 + float32": "llama:float16,llama:float32",
    "transformers, same dtype (Llama + GPT-2, float32)": "llama:float32,gpt2:float32",
    "diffusers, float16 + float32": "unet:float16,unet:float32",
    "diffusers SDXL pipeline, float16 + float32": "sdxl:float16,sdxl:float32",
}


def _race_row(title: str, setting: str, result: dict[str, Any]) -> str:
    rounds = result["rounds"]
    seen = ", ".join(
        f"{dtype.removeprefix('torch.')} {count}"
        for dtype, count in sorted(result["bystander_linear_dtypes"].items())
    )
    return (
        f"{title} | {setting} | wrong dtype {result['wrong_dtype_rounds']}/{rounds} | "
        f"wrong {result['wrong_rounds']}/{rounds} | errors {result['errors']} | "
        f"default after {result['default_dtype_after'].removeprefix('torch.')} | "
        f"torch functions replaced {result['init_functions_replaced']} | "
        f"bystander nn.Linear: {seen}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m metamode dtype-loads",
        description="Concurrent from_pretrained loads with a dtype: rounds of loader threads "
        "released together, each model compared with a lone load (stock, and after "
        "metamode.enable()); with --throughput, the time of mixed and same-dtype loads "
        "(stock, metamode, and a lock around every load).",
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--settings", default="stock,metamode")
    parser.add_argument("--throughput", action="store_true", help="time loads instead")
    parser.add_argument("--loads", type=int, default=10, help="loads per thread (--throughput)")
    parser.add_argument(
        "--size", choices=sorted(_LLAMA_SIZES), default="tiny", help="the Llama's size"
    )
    parser.add_argument("--models", default="llama,unet", help="models timed (--throughput)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    settings = args.settings.split(",")
    with tempfile.TemporaryDirectory() as directory:
        paths = save_models(directory, args.size)
        common = ["--paths", json.dumps(paths)]
        if not args.throughput:
            for title, pairs in _RACES.items():
                if not all(p.split(":")[0] in paths for p in pairs.split(",")):
                    continue
                for setting in settings:
                    result = _run_child(
                        [*common, "--setting", setting, "--kind", "race", "--pairs", pairs,
                         "--rounds", str(args.rounds)]
                    )  # fmt: skip
                    print(_race_row(title, setting, result))
            return 0
        for model in [m for m in args.models.split(",") if m in paths]:
            for pairs in ("float16,float32", "float16,float16"):
                for setting in [*settings, "lock"]:
                    result = _run_child(
                        [*common, "--setting", setting, "--kind", "throughput", "--pairs", pairs,
                         "--model", model, "--loads", str(args.loads)]
                    )  # fmt: skip
                    print(
                        f"{model} {pairs} {setting}: {result['wall_s']:.2f} s wall "
                        f"(one thread: {result['one_thread_s']:.2f} s), "
                        f"loads running together {result['overlap_s']:.2f} s, "
                        f"dtype windows open together {result['window_overlap_s']:.2f} s"
                    )
    return 0
