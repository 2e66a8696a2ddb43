"""Running a :class:`Plan` on CPU with private generators.

Storages live in ``env`` as torch ``UntypedStorage`` objects; every argument is rebuilt
as the exact view the build used (``set_`` on the storage with the recorded dtype, size,
strides and offset), so writes through views and aliases land where they did. Each draw
gets a private ``torch.Generator`` positioned where eager construction's generator was;
the process's default generator is never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from metamode._core.recording import settings
from metamode._core.recording.memory import _bytes
from metamode._core.recording.plan import DrawKey, Key, Plan, Step, Use
from metamode._core.recording.program import Call, Fill, Origin, Start, TensorRef
from metamode._core.recording.recorder import GENERATOR
from metamode._core.recording.streams import replayed
from metamode._core.recording.thread_state import replaying
from metamode._torch import DisableTorchFunction, neg_view

__all__ = ["ProcessChanged", "ReplayError", "execute", "with_bits"]


class ReplayError(RuntimeError):
    """Replay did not come out as the recording says it must."""


class ProcessChanged(ReplayError):
    """A process-wide setting a replayed call depends on changed during the replay (another
    thread set it after the plan was checked)."""


def _check_process(call: Call) -> None:
    """Raise if a process-wide setting ``call``'s result depends on differs from the build's."""
    default = torch.get_default_dtype()
    if call.default_dtype is not None and call.default_dtype != default:
        raise ProcessChanged(
            f"the default dtype changed from {call.default_dtype} to {default} during "
            f"materialize (torch.set_default_dtype in another thread?)"
        )
    if call.settings is not None and any(s != call.target for s in call.reads):
        changed = call.settings.differences(settings.now())
        if changed:
            raise ProcessChanged(
                f"process-wide settings changed during materialize ({', '.join(changed)}; in "
                f"another thread?)"
            )


def _view(storage: torch.UntypedStorage, ref: TensorRef) -> torch.Tensor:
    return with_bits(
        torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride), ref
    )


def with_bits(view: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """``view`` read through ``ref``'s conjugate and negative bits."""
    if ref.neg:
        view = neg_view(view)
    return view.conj() if ref.conj else view


class _Run:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.env: dict[Key, torch.UntypedStorage] = {}
        self.positioned: dict[DrawKey, torch.Generator] = {}
        self.snapshots: dict[DrawKey, torch.Tensor] = {}
        # fresh results torch's CPU kernel laid out unlike its meta kernel: the recorded
        # view -> the result as eager construction has it
        self.relaid: dict[Key, dict[TensorRef, torch.Tensor]] = {}

    def storage(self, key: Key) -> torch.UntypedStorage | None:
        storage = self.env.get(key)
        if storage is not None:
            return storage
        info = self.plan.programs[key[0]].storages[key[1]]
        outside = info.outside
        if info.origin is Origin.OUTSIDE and outside is not None:
            if outside.snapshot is not None:  # a private copy of its first value
                storage = self.env[key] = outside.snapshot.storage()
                return storage
            if outside.written:
                return None  # the plan needs only what the build wrote: private memory
            tensor = outside.tensor()
            if tensor is None:
                raise ReplayError("a tensor from outside the recording is gone")
            storage = self.env[key] = tensor.untyped_storage()
        return storage

    def generator(self, step: Step, draw: Any) -> torch.Generator:
        if draw.start is Start.ANCHOR:
            generator = torch.Generator()
            generator.set_state(draw.state)
            return generator
        key = step.starts.get(draw.stream)
        state = self.snapshots.get(key) if key is not None else None
        if state is None and key is not None:
            positioned = self.positioned.pop(key, None)
            if positioned is not None:
                return positioned
            state = self.plan.programs[key[0]].states.get((key[1], key[2]))  # an earlier replay's
        if state is None:
            raise ReplayError(f"no generator state for a draw of {_name(step.call)}")
        generator = torch.Generator()
        generator.set_state(state)
        return generator

    def run(self, step: Step) -> Any:
        call, serial = step.call, step.program.serial
        scratch: dict[int, torch.UntypedStorage] = {}
        draws_only = step.use is Use.DRAWS

        def decode(value: Any) -> Any:
            kind = type(value)
            if kind is TensorRef:
                storage = None
                if not (draws_only and value.storage == call.target):
                    storage = self.storage((serial, value.storage))
                if storage is None:
                    # born here (a call overwriting all of it), or memory for draws only
                    storage = scratch.get(value.storage)
                    if storage is None:
                        nbytes = step.program.storages[value.storage].nbytes
                        storage = scratch[value.storage] = torch.UntypedStorage(nbytes)
                        if not draws_only:
                            self.env[(serial, value.storage)] = storage
                tensor = _view(storage, value)
                if call.requires_grad and any(value is ref for ref in call.requires_grad):
                    tensor.requires_grad_()  # as eager's was: some kernels choose by it
                return tensor
            if kind is tuple or kind is list:
                return kind(decode(v) for v in value)
            if kind is dict:
                return {k: decode(v) for k, v in value.items()}
            if kind is slice:
                return slice(decode(value.start), decode(value.stop), decode(value.step))
            return value

        args = decode(call.args)
        kwargs = decode(call.kwargs)
        generators = [self.generator(step, draw) for draw in call.draws]
        if generators:
            args = tuple(generators[0] if a is GENERATOR else a for a in args)
            for name, value in kwargs.items():
                if value is GENERATOR:
                    kwargs[name] = generators[0]
            for draw, generator in zip(call.draws, generators, strict=True):
                for keyword in draw.keywords:
                    kwargs[keyword] = generator
        _check_process(call)
        if call.grows:  # what torch fills is what the build's flags said, not this process's
            before = args[0].untyped_storage().nbytes()
            kept = _tail(args[0], before).clone()
            result = call.func(*args, **kwargs)
            _tail(args[0], before).copy_(kept)
            if call.fills is Fill.ADDED:
                _fill_grown(args[0], before)
        else:
            result = call.func(*args, **kwargs)
            if call.fills is Fill.RESULT:
                _fill_uninitialised(result)
        _check_process(call)  # and while it ran
        if not draws_only:
            _bind(call, result, serial, self.env, self.relaid)
        for draw, generator in zip(call.draws, generators, strict=True):
            key = (serial, step.index, draw.stream)
            self.positioned[key] = generator
            state = generator.get_state()
            step.program.states[(step.index, draw.stream)] = state
            if draw.stream in step.keep:
                self.snapshots[key] = state
            seed = step.program.markers.get((step.index, draw.stream))
            if seed is not None:
                replayed(seed, state)
        return result


Done = Callable[[Key, torch.UntypedStorage, dict[TensorRef, torch.Tensor]], None]


def execute(plan: Plan, done: Done) -> None:
    """Run ``plan``; ``done(key, storage, relaid)`` is called once each wanted storage is
    final (``relaid``: its results whose eager layout differs from the build's)."""
    run = _Run(plan)
    finals: dict[int, list[Key]] = {}
    for key, position in plan.done_after.items():
        finals.setdefault(position, []).append(key)
    frees: dict[int, list[Key]] = {}
    for key, position in plan.last_use.items():
        frees.setdefault(position, []).append(key)
    # every call under the thread state it was recorded in, whatever the caller's
    with torch.no_grad(), DisableTorchFunction(), replaying(None), contextlib.ExitStack() as at:
        state = None
        for key in plan.wanted:
            if key not in plan.done_after:  # a tensor from outside, read as it is
                storage = run.storage(key)
                if storage is None:
                    raise ReplayError("a wanted storage has no value")
                done(key, storage, {})
        for position, step in enumerate(plan.steps):
            if step.call.state != state:
                at.close()
                state = step.call.state
                if state is not None:
                    at.enter_context(replaying(state))
            torch.set_grad_enabled(not step.call.no_grad)  # restored by no_grad's exit
            run.run(step)
            for key in finals.get(position, ()):
                done(key, run.env[key], run.relaid.pop(key, {}))
            for key in frees.get(position, ()):
                run.env.pop(key, None)


def _bind(
    call: Call,
    result: Any,
    serial: int,
    env: dict[Key, torch.UntypedStorage],
    relaid: dict[Key, dict[TensorRef, torch.Tensor]],
) -> None:
    created = set(call.creates)

    def bind(spec: Any, value: Any) -> None:
        if type(spec) is TensorRef:
            if spec.storage in created:
                if (
                    value.dtype != spec.dtype
                    or tuple(value.shape) != spec.size
                    or (value.is_conj(), value.is_neg()) != (spec.conj, spec.neg)
                ):
                    raise ReplayError(
                        f"{_name(call)} replayed {value.dtype}{list(value.shape)} where the "
                        f"build made {spec.dtype}{list(spec.size)}"
                    )
                if value.stride() != spec.stride or value.storage_offset() != spec.offset:
                    # torch's meta kernel laid it out otherwise: later calls of the recording
                    # refer to the build's layout, a tensor that is this result to eager's
                    relaid.setdefault((serial, spec.storage), {})[spec] = value
                    value = _relaid(value, spec)
                env[(serial, spec.storage)] = value.untyped_storage()
        elif isinstance(spec, tuple | list):
            for s, v in zip(spec, value, strict=True):
                bind(s, v)

    bind(call.result, result)


def _fill_uninitialised(result: Any) -> None:
    """Fill ``result`` as torch fills uninitialised memory under deterministic algorithms:
    NaN for floating and complex dtypes, the largest value for integers and bool."""
    if result.is_floating_point() or result.is_complex():
        result.fill_(float("nan"))
    elif result.dtype == torch.bool:
        result.fill_(True)
    else:
        result.fill_(torch.iinfo(result.dtype).max)


def _tail(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The bytes of ``tensor``'s storage, of ``nbytes``, past its last whole element: a
    resize that grows the storage fills from there under torch's deterministic fill."""
    return _bytes(tensor.untyped_storage())[nbytes // tensor.itemsize * tensor.itemsize : nbytes]


def _fill_grown(tensor: torch.Tensor, before: int) -> None:
    """Fill the elements a resize added past ``before`` bytes of ``tensor``'s storage, as
    torch's deterministic fill of a resize does."""
    storage = tensor.untyped_storage()
    start, end = before // tensor.itemsize, storage.nbytes() // tensor.itemsize
    if end > start:
        added = torch.empty(0, dtype=tensor.dtype).set_(storage, start, (end - start,), (1,))
        _fill_uninitialised(added)


def _relaid(value: torch.Tensor, spec: TensorRef) -> torch.Tensor:
    """``value`` copied into the layout ``spec`` describes."""
    extent = spec.offset + sum((n - 1) * s for n, s in zip(spec.size, spec.stride, strict=True))
    storage = torch.UntypedStorage((extent + 1) * spec.dtype.itemsize)
    return _view(storage, spec).copy_(value)


def _name(call: Call) -> str:
    return getattr(call.func, "__qualname__", None) or repr(call.func)
