"""FSDP2: build empty, fully_shard, materialize -> each rank holds only its shards,
and the gathered model equals eager construction. Two gloo processes on loopback."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

# materialize under FSDP2 rests on the recorder's frame and source reads: every interpreter
# cell runs it
pytestmark = pytest.mark.per_interpreter

WORLD = 2


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)
        self.scale = nn.Parameter(torch.randn(width) * 0.1)
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(0, width, 2) / width)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x)))) * self.scale


def build() -> nn.Module:
    model = nn.Sequential(nn.Embedding(11, 6), *[Block(6) for _ in range(3)], nn.Linear(6, 5))
    with torch.no_grad():
        model[0].weight[0].zero_()
    return model


@contextlib.contextmanager
def _full_values_watched() -> Iterator[list[int]]:
    """Elements of earlier full (unsharded) values still alive each time one is sharded."""
    from metamode._contexts import materialize as materialize_module

    shard = materialize_module._local_shard
    earlier: list[weakref.ref] = []
    alive_at_shard: list[int] = []

    def watched(tensor, value):
        gc.collect()
        alive_at_shard.append(sum(t.numel() for r in earlier if (t := r()) is not None))
        earlier.append(weakref.ref(value))
        return shard(tensor, value)

    materialize_module._local_shard = watched
    try:
        yield alive_at_shard
    finally:
        materialize_module._local_shard = shard


def _worker(rank: int, port: int, include_buffers: bool, results) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import metamode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        eager = build()
        torch.manual_seed(0)
        with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
            model = build()
        for block in model[1:4]:
            fully_shard(block)
        fully_shard(model)
        local_before = {n: p.to_local().shape for n, p in model.named_parameters()}
        ids = {n: id(p) for n, p in model.named_parameters()}
        largest = max(p.numel() for p in model.parameters())
        with _full_values_watched() as alive_at_shard:
            assert metamode.materialize(model) is model
        problems = []
        # Each full value is sharded as soon as it is final and then dropped: when a
        # parameter is sharded, the full values of the earlier ones are gone (at most
        # about one full parameter beyond the local shards).
        if len(alive_at_shard) != len(ids) or max(alive_at_shard) > largest:
            problems.append(f"full values alive at each shard: {alive_at_shard} > {largest}")
        for name, param in model.named_parameters():
            if id(param) != ids[name]:
                problems.append(f"{name}: new object")
            local = param.to_local()
            if local.is_meta or local.shape != local_before[name]:
                problems.append(f"{name}: local shard {local.shape} on {local.device}")
            full = param.full_tensor()
            if not torch.equal(full, eager.get_parameter(name)):
                problems.append(f"{name}: differs from eager")
        for name, buf in model.named_buffers():
            if not torch.equal(buf, eager.get_buffer(name)):
                problems.append(f"{name}: buffer differs from eager")
        out = model(torch.tensor([[1, 2, 3]])).sum()
        out.backward()
        ref = eager(torch.tensor([[1, 2, 3]])).sum()
        if not torch.equal(out.detach(), ref.detach()):
            problems.append("forward differs from eager")
        results.put((rank, problems))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(include_buffers: bool) -> None:
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(
        _worker,
        args=(_free_port(), include_buffers, results),
        nprocs=WORLD,
        join=True,
        start_method="spawn",
    )
    found = dict(results.get(timeout=60) for _ in range(WORLD))
    assert found == {rank: [] for rank in range(WORLD)}


def test_fsdp2_materialize_gives_each_rank_its_eager_shards():
    _run(include_buffers=False)


def test_fsdp2_materialize_with_include_buffers():
    _run(include_buffers=True)
