"""``python -m metamode <command>``: the demo, the benchmark and the doctor."""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module with a ``main(argv)``, one-line help)
_COMMANDS = {
    "demo": ("metamode.lab.demo", "show PEFT's concurrency bug and metamode's fix on tiny models"),
    "bench": ("metamode.lab.bench", "benchmark empty-model construction against the stock paths"),
    "bench-record": (
        "metamode.lab.bench_record",
        "count the instructions (callgrind) of a replayable build against a plain one",
    ),
    "bench-materialize": (
        "metamode.lab.bench_materialize",
        "time replayable builds and materialize against eager construction",
    ),
    "dtype-loads": (
        "metamode.lab.dtype_loads",
        "concurrent from_pretrained loads with a dtype: races and throughput, stock and metamode",
    ),
    "doctor": (
        "metamode._diagnostics.doctor",
        "find (and optionally repair) global patches left in torch",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m metamode",
        description="metamode's command line: the demo, the benchmark and the doctor.",
        epilog="Run `python -m metamode COMMAND --help` for a command's options.",
    )
    parser.add_argument(
        "command",
        choices=sorted(_COMMANDS),
        help="; ".join(f"{name}: {text}" for name, (_, text) in sorted(_COMMANDS.items())),
    )
    args = parser.parse_args(argv[:1])
    module_name, _ = _COMMANDS[args.command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        parser.error(f"`{args.command}` is not available in this version of metamode")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
