"""``metamode.materialize``: give an empty-built module the values eager construction gives it."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from metamode import _torch
from metamode._core.trace import (
    Op,
    Trace,
    _Gen,
    _MetaDevice,
    _Ref,
    forget,
    home_entry,
    registry_entry,
)

__all__ = ["NotMaterializableError", "is_materializable", "materialize"]

_CPU = torch.device("cpu")


class NotMaterializableError(RuntimeError):
    """Some tensors of a module cannot be reproduced; nothing was allocated."""


class _Slot:
    __slots__ = ("homes", "kind", "names", "tensor")

    def __init__(self, tensor: torch.Tensor, kind: str) -> None:
        self.tensor = tensor
        self.kind = kind
        self.names: list[str] = []
        self.homes: list[tuple[nn.Module, str]] = []


def _slots(module: nn.Module) -> dict[int, _Slot]:
    slots: dict[int, _Slot] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for kind, table in (("parameter", sub._parameters), ("buffer", sub._buffers)):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                slot = slots.get(id(tensor))
                if slot is None:
                    slot = slots[id(tensor)] = _Slot(tensor, kind)
                qualname = f"{prefix}.{name}" if prefix else name
                if qualname not in slot.names:
                    slot.names.append(qualname)
                slot.homes.append((sub, name))
    return slots


def _traces(slots: dict[int, _Slot]) -> list[Trace]:
    found: dict[Trace, None] = {}
    for slot in slots.values():
        entry = registry_entry(slot.tensor)
        for home, name in slot.homes if entry is None and _is_dtensor(slot.tensor) else ():
            entry = entry or home_entry(home, name)
        if entry is not None:
            found[entry[0]] = None
    return list(found)


def _why_not(
    tensor: torch.Tensor, traces: Sequence[Trace] = (), homes: Sequence = ()
) -> tuple[tuple[Trace, int] | None, str | None]:
    entry = registry_entry(tensor)
    if entry is None and _is_dtensor(tensor):
        # fully_shard made it: it stands for what was registered in its place
        for home, name in homes:
            entry = home_entry(home, name)
            if entry is not None:
                break
    if entry is None and tensor.is_meta:
        # made without registration (deepcopy of a module, a parameter put in
        # _parameters directly): found by its storage in a sibling's recording
        for trace in traces:
            vid = trace.lookup(tensor)
            if vid is not None:
                entry = (trace, vid)
                break
    if entry is None:
        if tensor.is_meta:
            return None, (
                "not registered inside a metamode.empty_weights(replayable=True) context (built "
                "under torch.device('meta') or a non-replayable context, moved with "
                ".to('meta'), or assigned after the context?)"
            )
        return None, None
    trace, vid = entry
    if trace.abandoned:
        return entry, trace.abandoned
    if trace.recording:
        return entry, (
            f"its empty_weights context (thread {trace.owner}) is still open; "
            f"materialize after the `with` block"
        )
    reason = trace.taint.get(vid) or trace.taint.get(trace.root.get(vid, vid))
    return entry, reason


def is_materializable(obj: nn.Module | torch.Tensor) -> bool:
    """Whether :func:`materialize` can give ``obj`` (each meta tensor of a module) eager values."""
    if isinstance(obj, torch.Tensor):
        entry, reason = _why_not(obj)
        return entry is not None and reason is None
    slots = _slots(obj)
    traces = _traces(slots)
    return all(_why_not(slot.tensor, traces, slot.homes)[1] is None for slot in slots.values())


def materialize(
    module: nn.Module,
    device: torch.device | str | None = None,
    *,
    on_unreproducible: Literal["error", "empty"] = "error",
) -> nn.Module:
    """Allocate ``module``'s empty-built tensors on ``device`` with their eager values, in place.

    Every parameter and buffer registered inside ``metamode.empty_weights(replayable=True)``
    (either ``include_buffers`` mode) gets what ``torch.manual_seed(s); build()`` puts there,
    when the context was entered right after ``torch.manual_seed(s)`` -- a submodule's too.
    Real tensors registered in the context are replaced by their replayed values; real
    tensors that were not (loaded weights) are left alone. Parameters stay the same Python
    objects (``torch.utils.swap_tensors``: ties, classes, attributes, ``requires_grad``
    kept); buffers are replaced in their modules' ``_buffers``. A parameter that FSDP2's
    ``fully_shard`` replaced by a DTensor gets its rank's local shard.

    Values are computed on CPU from the recorded generator state with a private generator,
    then moved to ``device`` one tensor at a time, so they are bitwise the CPU eager values
    anywhere; the process's default generator is neither drawn from nor changed. May run
    while other threads build or materialize other modules; do not materialize one module
    from two threads.

    Args:
        device: where the tensors go; ``"cpu"`` by default (where eager construction puts them).
        on_unreproducible: ``"empty"`` leaves tensors that cannot be reproduced uninitialised
            on ``device`` instead of raising.

    Returns ``module`` itself.

    Raises:
        NotMaterializableError: before allocating anything, naming every tensor that cannot
            be reproduced -- made outside the context, from NumPy data, by plain
            ``torch.device("meta")`` or a non-replayable context, or drawn after a random
            call that takes no ``generator=`` (unless ``on_unreproducible="empty"``).
    """
    if on_unreproducible not in ("error", "empty"):
        raise ValueError(f"on_unreproducible must be 'error' or 'empty', not {on_unreproducible!r}")
    device = _CPU if device is None else torch.device(device)
    slots = _slots(module)
    per_trace: dict[Trace, dict[int, list[_Slot]]] = {}
    refused: list[tuple[_Slot, str]] = []
    traces = _traces(slots)
    for slot in slots.values():
        entry, reason = _why_not(slot.tensor, traces, slot.homes)
        if reason is not None:
            refused.append((slot, reason))
        elif entry is not None:
            trace, vid = entry
            per_trace.setdefault(trace, {}).setdefault(vid, []).append(slot)
    if refused and on_unreproducible == "error":
        lines = "\n".join(
            f"  {', '.join(repr(n) for n in slot.names)} ({slot.kind}): {reason}"
            for slot, reason in refused
        )
        raise NotMaterializableError(
            f"metamode.materialize({type(module).__name__}) in thread "
            f"{threading.current_thread().name!r}: {len(refused)} tensor(s) cannot be "
            f"reproduced, nothing was allocated:\n{lines}\nFix: build them inside "
            f"metamode.empty_weights(replayable=True) from torch calls only, load them "
            f"from a checkpoint (load_state_dict(assign=True)), or pass "
            f"on_unreproducible='empty' to leave them uninitialised."
        )
    with torch.no_grad(), _torch.DisableTorchFunction():
        for slot, _ in refused:
            _install(slot, torch.empty_like(slot.tensor, device=device))
        together = set(traces)
        for trace in together:
            trace.replayed_exit = None
        for trace in sorted(per_trace, key=lambda t: t.serial):
            _replay(trace, per_trace[trace], device, together)
        sharded = {id(slot.tensor) for slot in slots.values() if _is_dtensor(slot.tensor)}
        if sharded:
            _reset_fsdp(module, sharded)
    return module


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "device_mesh")


def _local_shard(tensor: Any, value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the full ``value`` of DTensor ``tensor`` (a DTensor)."""
    from torch.distributed.tensor import DTensor

    shape, offset = _torch.local_shape_and_offset(tensor)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    local = value[index].clone(memory_format=torch.contiguous_format)
    return DTensor.from_local(
        local,
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=tensor.shape,
        stride=tensor.stride(),
    )


def _reset_fsdp(module: nn.Module, swapped: set[int]) -> None:
    """FSDP2 keeps its own view of each sharded parameter's local data: refresh it."""
    for sub in module.modules():
        state = getattr(sub, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            if id(fsdp_param.sharded_param) in swapped:
                fsdp_param.reset_sharded_param()


def _install(slot: _Slot, value: torch.Tensor) -> None:
    tensor = slot.tensor
    forget(tensor)
    if _is_dtensor(tensor):
        value = _local_shard(tensor, value)
    if slot.kind == "buffer":
        for home, name in slot.homes:
            home._buffers[name] = value
        return
    if _is_dtensor(tensor):
        new: torch.Tensor = nn.Parameter(value, requires_grad=tensor.requires_grad)
    else:
        new = _torch.make_subclass(type(tensor), value.detach(), tensor.requires_grad)
    new.__dict__ = dict(tensor.__dict__)
    rnns = [home for home, _ in slot.homes if isinstance(home, nn.RNNBase)]
    for rnn in rnns:  # its weak references would stop swap_tensors; rebuilt below
        rnn._flat_weight_refs = []
    if not weakref.getweakrefs(tensor):
        torch.utils.swap_tensors(tensor, new)  # same object: ties and optimizers keep it
        for rnn in rnns:
            rnn._init_flat_weights()
        return
    # Something holds a weak reference to it (RNN's _flat_weight_refs), which
    # swap_tensors refuses: put the new parameter in every place the old one was.
    for home, name in slot.homes:
        home._parameters[name] = new  # type: ignore[assignment]
        if isinstance(home, nn.RNNBase):
            home._init_flat_weights()


def _parent(trace: Trace, together: set[Trace]) -> Trace | None:
    # A context entered right after another one closed in the same thread, with
    # no draw from the default generator between, continues that context's
    # random stream (PEFT enters one per adapted layer). Only trusted between
    # contexts whose tensors are materialized together: a generator re-seeded
    # to the same state between two unrelated builds looks exactly the same.
    parent = trace.parent
    return parent if parent is not None and parent in together else None


def _entry_state(trace: Trace, together: set[Trace]) -> torch.Tensor:
    """The generator state eager construction was in when ``trace``'s context was entered."""
    parent = _parent(trace, together)
    if parent is None:
        return trace.entry_state
    if parent.replayed_exit is None:
        chain: list[Trace] = []
        ancestor: Trace | None = parent
        while ancestor is not None and ancestor.replayed_exit is None:
            chain.append(ancestor)
            ancestor = _parent(ancestor, together)
        for ancestor in reversed(chain):  # oldest first, for their random draws only
            _replay(ancestor, {}, _CPU, together)
    assert parent.replayed_exit is not None
    return parent.replayed_exit


def _replay(
    trace: Trace, targets: dict[int, list[_Slot]], device: torch.device, together: set[Trace]
) -> None:
    ops = trace.ops
    root = trace.root
    wanted = {root.get(v, v) for v in targets}
    live: list[bool] = [False] * len(ops)
    # random calls whose result nobody wants: run on a scratch tensor for their draws
    draw_only: list[bool] = [False] * len(ops)
    # random calls that overwrite a whole wanted tensor: it is allocated there,
    # and what was written into it before only needs its draws replayed
    birth: list[bool] = [False] * len(ops)
    first_def: dict[int, int] = {}
    for i, op in enumerate(ops):
        for v in op.outs:
            first_def.setdefault(v, i)
    used_later: dict[int, set[int]] = {}
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op.random or any(root.get(v, v) in wanted for v in op.outs):
            live[i] = True
            r = root.get(op.mutated, op.mutated)
            if op.scratch is not None and r not in wanted:
                draw_only[i] = True
                continue
            if (
                op.scratch is not None
                and op.mutated == r
                and all(v == r or first_def.get(v, -1) > i for v in used_later.get(r, ()))
            ):
                birth[i] = True
                wanted.discard(r)
            else:
                wanted.update(root.get(v, v) for v in op.ins)
            for v in (*op.ins, *op.outs):
                used_later.setdefault(root.get(v, v), set()).add(v)
    last: dict[int, int] = {}
    done: set[int] = set()
    for i, op in enumerate(ops):
        if live[i] and not draw_only[i]:
            for v in op.ins:
                last[root.get(v, v)] = i
            for v in op.outs:
                last[root.get(v, v)] = i
    finish: dict[int, list[int]] = {}
    for r, i in last.items():
        finish.setdefault(i, []).append(r)
    by_root: dict[int, list[int]] = {}
    for vid in targets:
        by_root.setdefault(root.get(vid, vid), []).append(vid)
    generator = torch.Generator()
    generator.set_state(_entry_state(trace, together))
    private: dict[int, torch.Generator] = {}
    env: dict[int, torch.Tensor] = {}
    held: dict[int, list[int]] = {}  # root -> value ids in env

    def decode(value: Any) -> Any:
        kind = type(value)
        if kind is _Ref:
            return env[value.vid]
        if kind is tuple or kind is list:
            return kind(decode(v) for v in value)
        if kind is dict:
            return {k: decode(v) for k, v in value.items()}
        if value is _MetaDevice:
            return _CPU
        if kind is _Gen:
            gen = private.get(value.key)
            if gen is None:
                gen = private[value.key] = torch.Generator()
                gen.set_state(trace.generators[value.key])
            return gen
        return value

    def bind(spec: Any, result: Any) -> None:
        if type(spec) is _Ref:
            env[spec.vid] = result
            held.setdefault(root.get(spec.vid, spec.vid), []).append(spec.vid)
        elif type(spec) in (tuple, list):
            for s, r in zip(spec, result, strict=True):
                bind(s, r)

    done = set()
    for i, op in enumerate(ops):
        if draw_only[i]:
            assert op.scratch is not None
            shape, dtype = op.scratch
            env[op.mutated] = torch.empty(shape, dtype=dtype)
            _run(op, env, decode, bind, generator)
            del env[op.mutated]
        elif birth[i]:
            assert op.scratch is not None
            shape, dtype = op.scratch
            env[op.mutated] = torch.empty(shape, dtype=dtype)
            held.setdefault(op.mutated, []).append(op.mutated)
            _run(op, env, decode, bind, generator)
        elif live[i]:
            _run(op, env, decode, bind, generator)
        for r in finish.get(i, ()):
            for vid in by_root.get(r, ()):
                value = env[vid]
                if device != _CPU:
                    value = value.to(device)
                for slot in targets[vid]:
                    _check(slot, value)
                    _install(slot, value)
                done.add(vid)
            for vid in held.pop(r, ()):
                env.pop(vid, None)
    trace.replayed_exit = generator.get_state()
    missing = [group[0].names[0] for vid, group in targets.items() if vid not in done]
    if missing:
        raise RuntimeError(f"metamode.materialize: replay produced no value for {missing}")


def _run(op: Op, env: dict, decode: Any, bind: Any, generator: torch.Generator) -> None:
    if any(v not in env for v in op.ins):
        return  # reads a tensor the replay cannot make: its results are refused
    args = decode(op.args)
    kwargs = decode(op.kwargs)
    if op.random:
        if kwargs.get("generator") is None:
            kwargs["generator"] = generator
        if "default_generator" in kwargs:
            kwargs["default_generator"] = generator
    result = op.func(*args, **kwargs)
    bind(op.out_spec, result)


def _check(slot: _Slot, value: torch.Tensor) -> None:
    tensor = slot.tensor
    if value.shape != tensor.shape or value.dtype != tensor.dtype:
        raise RuntimeError(
            f"metamode.materialize: replayed {slot.names[0]!r} is {value.dtype}{list(value.shape)}"
            f" but the module holds {tensor.dtype}{list(tensor.shape)}; the recorded build and "
            f"the module disagree (was it changed after the empty_weights block?)"
        )
