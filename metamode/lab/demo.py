"""``python -m metamode demo``: PEFT's race, then the same work under metamode.

Runs two scenarios from :mod:`metamode.lab.scenarios`, each in a fresh
subprocess (the stock run corrupts the interpreter it runs in):

1. *overlap*: two threads' empty-weights contexts overlap and exit in the
   opposite order, forced with Events;
2. *inject*: threads concurrently call PEFT's ``inject_adapter_in_model`` on
   their own tiny models, half with ``low_cpu_mem_usage=True``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any


def run_scenario(*args: str, timeout: float = 600) -> dict[str, Any]:
    """Run ``python -m metamode.lab.scenarios *args`` and return its JSON summary."""
    done = subprocess.run(
        [sys.executable, "-m", "metamode.lab.scenarios", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scenario {args} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _overlap_line(result: dict[str, Any]) -> str:
    return (
        f"live context still works: {result['live_context_linear'] == 'meta'}; "
        f"register_parameter is torch's after: {result['register_parameter_is_torchs']}; "
        f"Linear built afterwards: main thread on {result['main_thread_linear_after']}, "
        f"new thread on {result['other_thread_linear_after']}"
    )


def _inject_line(result: dict[str, Any]) -> str:
    line = (
        f"{result['corrupted_rounds']}/{_plural(result['rounds_run'], 'round')} corrupted; "
        f"register_parameter is torch's at the end: {result['register_parameter_is_torchs_at_end']}"
    )
    if result["first_problems"]:
        line += "\n      e.g. " + "\n           ".join(result["first_problems"][:3])
    return line


_DESCRIPTION = (
    "Reproduce PEFT's race on tiny built-in models, then run the same work under metamode. "
    "Each run is a fresh subprocess (the stock one corrupts the interpreter it runs in): "
    "1. two threads' empty-weights contexts overlap and exit in the opposite order; "
    "2. threads concurrently call PEFT's inject_adapter_in_model on their own models, "
    "half with low_cpu_mem_usage=True."
)


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metamode demo", description=_DESCRIPTION)
    parser.add_argument(
        "--threads",
        type=_at_least_one,
        default=8,
        metavar="N",
        help="threads injecting adapters at the same time in scenario 2 (default: 8)",
    )
    parser.add_argument(
        "--rounds",
        type=_at_least_one,
        default=20,
        metavar="N",
        help="rounds of scenario 2; each starts all threads together (default: 20)",
    )
    args = parser.parse_args(argv)
    try:
        import peft
    except ImportError:
        print("the demo drives PEFT: pip install 'metamode[peft]'", file=sys.stderr)
        return 2
    threads, rounds = _plural(args.threads, "thread"), _plural(args.rounds, "round")
    print(f"metamode demo -- PEFT {peft.__version__}, {threads}\n")
    print("1. Two overlapping empty-weights contexts (A enters, B enters, A exits, B builds):")
    stock = run_scenario("overlap", "stock-peft")
    fixed = run_scenario("overlap", "peft-shim")
    print(f"   stock PEFT      : {_overlap_line(stock)}")
    print(f"   with metamode   : {_overlap_line(fixed)}\n")
    print(
        f"2. {threads} x {rounds} of concurrent "
        f"inject_adapter_in_model (even threads low_cpu_mem_usage=True, odd False):"
    )
    inject_args = ["--threads", str(args.threads), "--rounds", str(args.rounds)]
    stock_inject = run_scenario("inject", "stock-peft", *inject_args)
    fixed_inject = run_scenario("inject", "peft-shim", *inject_args)
    print(f"   stock PEFT      : {_inject_line(stock_inject)}")
    print(f"   with metamode   : {_inject_line(fixed_inject)}\n")
    ok = not fixed["corrupted"] and fixed_inject["corrupted_rounds"] == 0
    print(
        "metamode kept every context in its own thread: nothing leaked."
        if ok
        else "metamode FAILED to keep the process clean -- please report this."
    )
    return 0 if ok else 1
