"""Core guarantees, each pinned by a test that fails when the guarantee is broken.

These were written against planted bugs (mutants) that the rest of the suite let
through: the stack repaired in the wrong order after an out-of-order exit, the
bitsandbytes-style constructor path removed, the tie memo removed, a context
visible to other threads. Each test names the mutant it kills.
"""

from __future__ import annotations

import threading
import weakref
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.overrides import _pop_mode

import metamode
from metamode import ContextMisuseError
from metamode._core import stack as _stack
from metamode._core.stack import stack_depth
from metamode._diagnostics.invariants import snapshot


def _drain_to(depth: int) -> None:
    # Leave this thread's stack as the test found it even when an assertion failed.
    while stack_depth() > depth:
        _pop_mode()


# -- out-of-order exit with several newer contexts ---------------------------------------------
# Mutant: _stack.remove pushes the modes it popped back in the wrong (reverse) order.


def test_out_of_order_exit_keeps_two_newer_contexts_in_their_order():
    base = stack_depth()
    outer = metamode.empty_weights()
    middle = metamode.empty_weights(include_buffers=True)
    skip = metamode.skip_empty_weights()
    try:
        outer.__enter__()
        middle.__enter__()
        skip.__enter__()
        with pytest.raises(ContextMisuseError, match="reverse order"):
            outer.__exit__(None, None, None)
        assert list(_stack.modes_innermost_first())[:2] == [skip, middle]
        assert stack_depth() == base + 2
        # Still inside the skip, entered last: nothing is active, nothing moves.
        assert metamode.active() is None
        assert nn.Linear(2, 2).weight.device.type == "cpu"
        assert torch.empty(1).device.type == "cpu"
        skip.__exit__(None, None, None)
        assert metamode.active() is middle and torch.empty(1).is_meta
        middle.__exit__(None, None, None)
        assert stack_depth() == base
    finally:
        _drain_to(base)


def test_remove_keeps_order_of_three_modes_above():
    base = stack_depth()
    modes = [metamode.empty_weights() for _ in range(4)]
    try:
        for mode in modes:
            mode.__enter__()
        assert _stack.remove(modes[0]) is True
        assert list(_stack.modes_innermost_first())[:3] == modes[:0:-1]
        assert _stack.remove(modes[0]) is False, "already gone: reported, stack unchanged"
        assert list(_stack.modes_innermost_first())[:3] == modes[:0:-1]
    finally:
        _drain_to(base)


# -- the bitsandbytes-style constructor path ----------------------------------------------------
# Mutant: _params._rebuilt_subclass no longer calls cls(data, requires_grad=..., **attributes).


class KeywordParam(nn.Parameter):
    """bitsandbytes-style: attributes are constructor keywords, and construction is observable.

    Like ``bnb.nn.Params4bit``, defaults exist, so a rebuild *without* the keywords
    also succeeds; only the record of constructor calls tells the two paths apart.
    """

    calls: ClassVar[list[tuple[str, bool, object, int]]] = []
    made: ClassVar[list[weakref.ref]] = []

    def __new__(cls, data=None, requires_grad=False, quant_state=None, blocksize=64):
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self.quant_state = quant_state
        self.blocksize = blocksize
        cls.calls.append((data.device.type, requires_grad, quant_state, blocksize))
        cls.made.append(weakref.ref(self))
        return self


def test_bitsandbytes_style_subclass_is_rebuilt_through_its_constructor():
    KeywordParam.calls.clear()
    KeywordParam.made.clear()
    original = KeywordParam(torch.empty(4), True, quant_state={"s": 1}, blocksize=32)
    module = nn.Module()
    with metamode.empty_weights():
        module.quant = original
    moved = module.quant
    assert type(moved) is KeywordParam and moved.is_meta and moved.requires_grad
    assert KeywordParam.calls == [("cpu", True, {"s": 1}, 32), ("meta", True, {"s": 1}, 32)]
    assert KeywordParam.made[-1]() is moved, "the constructor's object must be the one kept"
    assert moved.quant_state == {"s": 1} and moved.blocksize == 32
    assert original.device.type == "cpu" and "requires_grad" not in original.__dict__


# -- ties made before anything is on meta ---------------------------------------------------------
# Mutant: EmptyWeights._memoised moves every registration afresh (no tie memo).


class SharedEmbeddingLM(nn.Module):
    """Input and output embeddings share one Parameter created before either module holds it."""

    def __init__(self, vocab: int = 10, dim: int = 4) -> None:
        super().__init__()
        shared = nn.Parameter(torch.empty(vocab, dim))
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.embed.weight = shared
        self.head.weight = shared


def test_tie_made_before_meta_stays_tied():
    eager = SharedEmbeddingLM()
    assert eager.head.weight is eager.embed.weight
    with metamode.empty_weights():
        model = SharedEmbeddingLM()
    assert model.head.weight is model.embed.weight and model.embed.weight.is_meta
    assert [name for name, _ in model.named_parameters()] == ["embed.weight"]


def test_one_original_in_two_modules_of_one_context_maps_to_one_parameter():
    shared = nn.Parameter(torch.empty(3, 3))
    with metamode.empty_weights():
        first, second = nn.Linear(3, 3), nn.Linear(3, 3)
        first.weight = shared
        second.weight = shared
    assert first.weight is second.weight and first.weight.is_meta
    assert shared.device.type == "cpu"


# -- thread scope while a context is open ----------------------------------------------------------
# Mutant: a process-global context (e.g. active_empty_weights ignoring the thread).


def test_bystander_thread_is_unaffected_while_two_contexts_overlap():
    a_entered, b_entered, checked = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    errors: list[BaseException] = []

    def context_thread(name: str, entered: threading.Event, wait_for: threading.Event) -> None:
        try:
            with metamode.empty_weights():
                entered.set()
                assert wait_for.wait(30)
                seen[name] = nn.Linear(2, 2).weight.device.type
        except BaseException as error:
            errors.append(error)

    def bystander() -> None:
        try:
            assert a_entered.wait(30) and b_entered.wait(30)
            seen["bystander_active"] = metamode.active()
            seen["bystander_linear"] = nn.Linear(2, 2).weight.device.type
            seen["bystander_factory"] = torch.empty(1).device.type
        except BaseException as error:
            errors.append(error)
        finally:
            checked.set()

    threads = [
        threading.Thread(target=context_thread, args=("a", a_entered, checked)),
        threading.Thread(target=context_thread, args=("b", b_entered, checked)),
        threading.Thread(target=bystander),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert seen == {
        "bystander_active": None,
        "bystander_linear": "cpu",
        "bystander_factory": "cpu",
        "a": "meta",
        "b": "meta",
    }
    # The main thread, also a bystander, saw nothing either.
    assert metamode.active() is None


# -- the global-state guard sees what it claims to see --------------------------------------------


def test_guard_reports_a_replaced_tensor_method():
    before = snapshot()
    original = vars(torch.Tensor)["register_hook"]
    setattr(torch.Tensor, "register_hook", lambda self, hook: None)  # noqa: B010 (planted)
    try:
        changes = snapshot().changes_since(before)
    finally:
        setattr(torch.Tensor, "register_hook", original)  # noqa: B010
    assert changes == ["torch.Tensor.register_hook replaced"], changes
    assert snapshot().changes_since(before) == []


@pytest.mark.parametrize("kind", ["parameter", "buffer", "module"])
def test_guard_reports_an_added_global_hook(kind):
    from torch.nn.modules import module as torch_module

    register = {
        "parameter": torch_module.register_module_parameter_registration_hook,
        "buffer": torch_module.register_module_buffer_registration_hook,
        "module": torch_module.register_module_module_registration_hook,
    }[kind]
    before = snapshot()
    handle = register(lambda *args: None)
    try:
        changes = snapshot().changes_since(before)
    finally:
        handle.remove()
    assert changes, f"a new global {kind} registration hook went unnoticed"
    assert snapshot().changes_since(before) == []


# -- small contracts the mutation run found untested ----------------------------------------------


def test_init_on_device_passes_include_buffers_on():
    context = metamode.init_on_device("meta", include_buffers=True)
    assert context.include_buffers is True and context.device == torch.device("meta")
    assert metamode.init_on_device("meta", include_buffers=False).include_buffers is False


def test_decorator_keeps_include_buffers():
    @metamode.empty_weights(include_buffers=True)
    def build() -> torch.Tensor:
        return torch.empty(2)

    assert build().is_meta


def test_reprs_name_the_settings():
    assert repr(metamode.empty_weights(device="cpu")) == (
        "metamode.empty_weights(device='cpu', include_buffers=False)"
    )
    assert repr(metamode.skip_empty_weights()) == "metamode.skip_empty_weights()"


def test_decorating_an_async_generator_is_refused():
    async def agen():
        yield

    with pytest.raises(TypeError, match="async"):
        metamode.empty_weights()(agen)


def test_hook_detection_ignores_foreign_hooks():
    from metamode._core import hooks as _hooks

    def foreign(*args):
        return None

    assert _hooks._already_installed({}) is False
    assert _hooks._already_installed({1: foreign}) is False
    assert _hooks._already_installed({1: foreign, 2: _hooks._on_buffer_registered}) is True


@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_install_adds_exactly_the_missing_hook(kind):
    from torch.nn.modules import module as torch_module

    from metamode._core import hooks as _hooks

    hooks = getattr(torch_module, f"_global_{kind}_registration_hooks")
    expected = {
        "parameter": _hooks._on_parameter_registered,
        "buffer": _hooks._on_buffer_registered,
    }
    saved = dict(hooks)
    try:
        ours = [k for k, hook in hooks.items() if getattr(hook, "__metamode_hook__", False)]
        for key in ours:
            del hooks[key]
        assert _hooks.installed() is False, f"the {kind} hook is missing"
        _hooks._install()
        assert _hooks.installed() is True
        added = [hook for hook in hooks.values() if getattr(hook, "__metamode_hook__", False)]
        assert added == [expected[kind]]
        assert len(hooks) == len(saved) - len(ours) + 1
    finally:
        hooks.clear()
        hooks.update(saved)


def test_none_buffer_is_registered_untouched_with_include_buffers():
    module = nn.Module()
    with metamode.empty_weights(include_buffers=True):
        module.register_buffer("absent", None)
        module.register_buffer("present", torch.ones(2, device="cpu"))
    assert module.absent is None and module.present.is_meta


class RecordingTensor(torch.Tensor):
    """A tensor subclass whose __torch_function__ must see the calls that move it."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclass_buffers_keep_their_dispatch_when_moved():
    RecordingTensor.seen.clear()
    buffer = torch.ones(2).as_subclass(RecordingTensor)
    RecordingTensor.seen.clear()
    module = nn.Module()
    with metamode.empty_weights(include_buffers=True):
        module.register_buffer("recorded", buffer)
    assert module.recorded.is_meta and type(module.recorded) is RecordingTensor
    assert "to" in RecordingTensor.seen, RecordingTensor.seen
    assert buffer.device.type == "cpu"


class PlainConstructorParam(nn.Parameter):
    """Takes (data, requires_grad) only; attributes are set afterwards."""

    made: ClassVar[list[tuple[weakref.ref, str, bool]]] = []

    def __new__(cls, data=None, requires_grad=True):
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        cls.made.append((weakref.ref(self), data.device.type, requires_grad))
        return self


class DowncastingParam(nn.Parameter):
    """A constructor that returns a plain Parameter instead of its own class."""

    def __new__(cls, data=None, requires_grad=True):
        if data is not None and data.is_meta:
            return nn.Parameter(data, requires_grad)
        return torch.Tensor._make_subclass(cls, data, requires_grad)


def test_subclass_without_keyword_constructor_is_rebuilt_through_it():
    PlainConstructorParam.made.clear()
    original = PlainConstructorParam(torch.empty(2), requires_grad=False)
    original.role = "gate"
    module = nn.Module()
    with metamode.empty_weights():
        module.p = original
    moved = module.p
    assert type(moved) is PlainConstructorParam and moved.is_meta and moved.role == "gate"
    reference, device, requires_grad = PlainConstructorParam.made[-1]
    assert reference() is moved and (device, requires_grad) == ("meta", False)


def test_constructor_that_returns_another_class_is_overruled():
    module = nn.Module()
    with metamode.empty_weights():
        module.p = DowncastingParam(torch.empty(3), requires_grad=False)
    assert type(module.p) is DowncastingParam and module.p.is_meta
    assert module.p.shape == (3,) and not module.p.requires_grad
