"""The race scenarios, runnable against stock libraries or metamode.

Used by ``python -m metamode demo`` and by the test suite. Stock runs corrupt
the process they run in, so callers run them in a subprocess::

    python -m metamode.lab.scenarios overlap stock-peft
    python -m metamode.lab.scenarios inject stock-peft --threads 8 --rounds 20

and read the JSON summary printed on the last line.

Kinds:
    ``metamode``    metamode.empty_weights() / inject with the PEFT shim off
                    (for ``inject``, the same as ``peft-shim``)
    ``stock-peft``  PEFT's own functions, as installed
    ``peft-shim``   PEFT's own functions after ``metamode.enable_for_peft()``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from metamode.lab.threads import WAIT_S, run_threads, wait

KINDS = ("metamode", "stock-peft", "peft-shim")
# torch's own, captured before any scenario runs (importing this module patches nothing).
_TORCH_REGISTER_PARAMETER = vars(nn.Module)["register_parameter"]


def _empty_weights_factory(kind: str) -> Callable[[], contextlib.AbstractContextManager]:
    if kind == "metamode":
        import metamode

        return metamode.empty_weights
    import peft.utils.integrations as integrations

    if kind == "peft-shim":
        import metamode

        metamode.enable_for_peft()
    # Looked up at call time, like PEFT's own call sites do after the shim.
    return lambda: integrations.init_empty_weights()


def register_parameter_is_torchs() -> bool:
    return vars(nn.Module)["register_parameter"] is _TORCH_REGISTER_PARAMETER


def torch_globals() -> dict[str, Any]:
    """What empty-weights helpers replace: Module's ``register_*`` and ``nn.init``'s functions."""
    return {
        "register_parameter": vars(nn.Module)["register_parameter"],
        "register_buffer": vars(nn.Module)["register_buffer"],
        **{f"init.{name}": getattr(nn.init, name) for name in dir(nn.init) if name[0] != "_"},
    }


def process_problems(original: dict[str, Any]) -> list[str]:
    """What is wrong with this process now: globals no longer ``original``, a new Linear off cpu."""
    problems = [
        f"{name} left replaced"
        for name, obj in torch_globals().items()
        if original.get(name) is not obj
    ]
    device = nn.Linear(2, 2).weight.device.type
    if device != "cpu":
        problems.append(f"a new Linear in the main thread is on {device}")
    return problems


def run_rounds(
    rounds: int, one_round: Callable[[int], list[str]], stop_at_first_corruption: bool
) -> dict[str, Any]:
    """Run ``one_round(index)`` ``rounds`` times, then check the process after each.

    A round is corrupted if it or :func:`process_problems` reports anything.
    """
    original = torch_globals()
    corrupted: list[int] = []
    first_problems: list[str] = []
    round_index = -1
    for round_index in range(rounds):
        problems = one_round(round_index) + process_problems(original)
        if problems:
            corrupted.append(round_index)
            first_problems = first_problems or problems[:6]
            if stop_at_first_corruption:
                break
    return {
        "rounds_run": round_index + 1,
        "corrupted_rounds": len(corrupted),
        "first_corrupted_round": corrupted[0] if corrupted else None,
        "first_problems": first_problems,
    }


def overlap(kind: str) -> dict[str, Any]:
    """Two overlapping contexts exiting in the opposite order, forced by Events.

    A enters, B enters, A exits, B builds a Linear (must be meta: its context
    is still live), B exits; then the main thread and a fresh thread each
    build a Linear (must be cpu: every context is gone).
    """
    make_context = _empty_weights_factory(kind)
    a_entered, b_entered, a_exited = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, Any] = {}
    errors: list[BaseException] = []

    def thread_a() -> None:
        try:
            with make_context():
                a_entered.set()
                wait(b_entered, "B to enter")
            a_exited.set()
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)
            a_exited.set()

    def thread_b() -> None:
        try:
            wait(a_entered, "A to enter")
            with make_context():
                b_entered.set()
                wait(a_exited, "A to exit")
                seen["live_context_linear"] = str(nn.Linear(2, 2).weight.device)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)
            b_entered.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    seen["register_parameter_is_torchs"] = register_parameter_is_torchs()
    seen["main_thread_linear_after"] = str(nn.Linear(2, 2).weight.device)
    other: dict[str, str] = {}
    bystander = threading.Thread(target=lambda: other.update(d=str(nn.Linear(2, 2).weight.device)))
    bystander.start()
    bystander.join()
    seen["other_thread_linear_after"] = other["d"]
    seen["corrupted"] = (
        seen["live_context_linear"] != "meta"
        or not seen["register_parameter_is_torchs"]
        or seen["main_thread_linear_after"] != "cpu"
        or seen["other_thread_linear_after"] != "cpu"
    )
    return seen


class TinyAttentionBlock(nn.Module):
    """Small enough to build in microseconds; LoRA targets ``q``, ``v`` and ``up``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x + self.q(x) * self.v(x))
        return x + self.down(torch.relu(self.up(x)))


def _inject(model: nn.Module, low_cpu_mem_usage: bool) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v", "up"])
    inject_adapter_in_model(config, model, low_cpu_mem_usage=low_cpu_mem_usage)


def check_injected(model: nn.Module, low_cpu_mem_usage: bool) -> list[str]:
    """What is wrong with ``model`` after injection (empty list: nothing)."""
    problems = []
    want_lora = "meta" if low_cpu_mem_usage else "cpu"
    for name, param in model.named_parameters():
        want = want_lora if "lora_" in name else "cpu"
        if param.device.type != want:
            problems.append(f"{name} on {param.device.type}, expected {want}")
    if not any("lora_" in name for name, _ in model.named_parameters()):
        problems.append("no LoRA parameters were injected")
    return problems


def inject(
    kind: str, threads: int = 8, rounds: int = 200, stop_at_first_corruption: bool = False
) -> dict[str, Any]:
    """``threads`` threads inject LoRA into their own fresh models, ``rounds`` times.

    Each round a Barrier releases all threads at once; each builds its model
    *after* the barrier (so construction overlaps other threads' contexts)
    and injects with ``low_cpu_mem_usage=True`` (even threads) or ``False``
    (odd threads). After every round the main thread checks the process
    (:func:`process_problems`).
    """
    if kind == "peft-shim" or kind == "metamode":
        import metamode

        metamode.enable_for_peft()
    import peft  # noqa: F401  (import before threads start)

    barrier = threading.Barrier(threads)
    slots: list[list[str]] = [[] for _ in range(threads)]

    def worker(index: int) -> None:
        low_cpu_mem_usage = index % 2 == 0
        try:
            barrier.wait(WAIT_S)
            model = TinyAttentionBlock()
            _inject(model, low_cpu_mem_usage)
            slots[index] = check_injected(model, low_cpu_mem_usage)
        except BaseException as error:
            slots[index] = [f"{type(error).__name__}: {error}"]

    def one_round(_: int) -> list[str]:
        run_threads(functools.partial(worker, i) for i in range(threads))
        return [f"thread {i}: {p}" for i, slot in enumerate(slots) for p in slot]

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        summary = run_rounds(rounds, one_round, stop_at_first_corruption)
    finally:
        sys.setswitchinterval(old_interval)
    return {
        "kind": kind,
        "threads": threads,
        **summary,
        "register_parameter_is_torchs_at_end": register_parameter_is_torchs(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m metamode.lab.scenarios")
    parser.add_argument("scenario", choices=("overlap", "inject"))
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--stop-at-first-corruption", action="store_true")
    args = parser.parse_args(argv)
    if args.scenario == "overlap":
        result = overlap(args.kind)
    else:
        result = inject(args.kind, args.threads, args.rounds, args.stop_at_first_corruption)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
