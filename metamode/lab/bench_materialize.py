"""``python -m metamode bench-materialize``: what replayable builds and materialize cost.

Rows, each measured in a fresh process (peak RSS is growth over the process
after imports and a warm-up build and materialize of the tiny shape; one intra-op
thread):

* build: plain ``empty_weights()`` against ``empty_weights(replayable=True)``,
  both modes (best of ``--reps``);
* eager construction against ``materialize(model)`` and ``materialize`` of the first and
  of the last block after a replayable build (a block's replay draws every random number
  drawn before its own, so the last block costs about what the whole model does);
* with ``--fsdp``: per rank of 2 gloo processes, eager construction against
  ``materialize(model)`` after ``fully_shard`` of every block and the root.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

__all__ = ["main", "measure"]


def _blocks(model: Any) -> list[Any]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return list(layers) if layers is not None else list(model.children())


def _block(model: Any, which: int) -> Any:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is not None:
        return layers[which]
    blocks = [m for m in model.children() if len(list(m.parameters()))]
    return blocks[which]


def measure(model: str, phase: str, tiny: bool = False) -> dict[str, Any]:
    """One row's numbers, in this process."""
    import resource

    import torch

    import metamode
    from metamode.lab import workloads

    workloads.build(model, tiny=True)
    with metamode.empty_weights(replayable=True):  # warm-up: metamode's first use imports
        warm = workloads.build(model, tiny=True)  # its integrations
    metamode.materialize(warm)
    torch.set_num_threads(1)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    if phase.startswith("build"):
        include_buffers = phase.endswith("+buffers")
        replayable = "replayable" in phase
        start = time.perf_counter()
        with metamode.empty_weights(include_buffers=include_buffers, replayable=replayable):
            built = workloads.build(model, tiny=tiny)
        seconds = time.perf_counter() - start
    elif phase == "eager":
        start = time.perf_counter()
        built = workloads.build(model, tiny=tiny)
        seconds = time.perf_counter() - start
    else:
        with metamode.empty_weights(replayable=True):
            built = workloads.build(model, tiny=tiny)
        part = {
            "materialize": built,
            "materialize first block": None,
            "materialize last block": None,
        }[phase] or _block(built, 0 if phase == "materialize first block" else -1)
        start = time.perf_counter()
        metamode.materialize(part)
        seconds = time.perf_counter() - start
    tensors = [*built.parameters(), *built.buffers()]
    allocated = sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)
    model_bytes = sum(t.numel() * t.element_size() for t in tensors)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seconds": seconds,
        "allocated_mib": allocated / 2**20,
        "model_mib": model_bytes / 2**20,
        "peak_rss_growth_mib": (peak - base) / 1024,
    }


PHASES = (
    "build",
    "build replayable",
    "build+buffers",
    "build replayable+buffers",
    "eager",
    "materialize",
    "materialize first block",
    "materialize last block",
)


def _run(model: str, phase: str, tiny: bool) -> dict[str, Any]:
    code = (
        "import json, metamode.lab.bench_materialize as b; "
        f"print(json.dumps(b.measure({model!r}, {phase!r}, {tiny!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{phase} of {model} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fsdp_rank(rank: int, port: int, model: str, tiny: bool, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import metamode
    from metamode.lab import workloads

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        workloads.build(model, tiny=True)  # warm-up
        torch.manual_seed(0)
        start = time.perf_counter()
        eager = workloads.build(model, tiny=tiny)
        eager_s = time.perf_counter() - start
        del eager
        torch.manual_seed(0)
        with metamode.empty_weights(replayable=True):
            built = workloads.build(model, tiny=tiny)
        for block in _blocks(built):
            fully_shard(block)
        fully_shard(built)
        dist.barrier()
        start = time.perf_counter()
        metamode.materialize(built)
        queue.put((rank, eager_s, time.perf_counter() - start))
    finally:
        dist.destroy_process_group()


def _fsdp(model: str, tiny: bool) -> list[tuple[int, float, float]]:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(
        _fsdp_rank, args=(port, model, tiny, queue), nprocs=2, join=True, start_method="spawn"
    )
    return sorted(queue.get(timeout=60) for _ in range(2))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m metamode bench-materialize")
    parser.add_argument(
        "--model", default="llama-small", help="a model of `python -m metamode bench`"
    )
    parser.add_argument("--reps", type=int, default=3, help="runs per row; the best is shown")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (a smoke test)")
    parser.add_argument(
        "--fsdp", action="store_true", help="per-rank times under FSDP2 (2 gloo processes)"
    )
    args = parser.parse_args(argv)
    if args.fsdp:
        print(f"{args.model}{' (tiny)' if args.tiny else ''}: FSDP2, 2 gloo ranks")
        for rank, eager_s, materialize_s in _fsdp(args.model, args.tiny):
            print(
                f"rank {rank}: eager construction {eager_s:.3f} s, materialize its shards "
                f"{materialize_s:.3f} s ({materialize_s / max(eager_s, 1e-9):.2f}x)"
            )
        return 0
    rows: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    from metamode.lab.bench import _mem_available

    limit_mib = 0.6 * (_mem_available() or 8 * 2**30) / 2**20
    for phase in PHASES:
        model_mib = rows["build"]["model_mib"] if rows else 0.0
        if not phase.startswith("build") and model_mib > limit_mib:
            skipped[phase] = (
                f"skipped: {model_mib / 1024:.1f} GiB of weights > 60% of available memory"
            )
            continue
        runs = [_run(args.model, phase, args.tiny) for _ in range(max(1, args.reps))]
        rows[phase] = min(runs, key=lambda r: r["seconds"])
    print(f"{args.model}{' (tiny)' if args.tiny else ''}: best of {args.reps}")
    print(f"{'row':28} {'time':>10} {'allocated':>12} {'peak RSS':>12}")
    for phase, row in rows.items():
        print(
            f"{phase:28} {row['seconds']:>9.3f}s {row['allocated_mib']:>8.0f} MiB"
            f" {row['peak_rss_growth_mib']:>8.0f} MiB"
        )
    for phase, why in skipped.items():
        print(f"{phase:28} {why}")
    for plain, recorded in (
        ("build", "build replayable"),
        ("build+buffers", "build replayable+buffers"),
    ):
        ratio = rows[recorded]["seconds"] / max(rows[plain]["seconds"], 1e-9)
        print(f"{recorded} / {plain}: {ratio:.2f}x")
    if "materialize" in rows:
        eager = rows["eager"]["seconds"]
        print(f"materialize / eager: {rows['materialize']['seconds'] / max(eager, 1e-9):.2f}x")
        for which in ("first", "last"):
            seconds = rows[f"materialize {which} block"]["seconds"]
            print(f"materialize {which} block / eager: {seconds / max(eager, 1e-9):.2f}x")
    return 0
