"""Semantics of metamode's contexts in one thread: placement, nesting, skip, arguments.

The ThreadScopedMode contract (single use, refused exits, decorator protocol) is
tested for every context class in tests/unit/core/test_mode_contract.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import metamode
from metamode._core.hooks import installed


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)))
        self.register_buffer("passed_in", torch.ones(2) * 0 + torch.tensor([1.0, 2.0]))


# -- placement ---------------------------------------------------------------


def test_parameters_go_to_meta_and_buffers_stay_real_by_default():
    with metamode.empty_weights():
        model = WithBuffer()
    assert model.linear.weight.is_meta and model.linear.bias.is_meta
    assert model.inv_freq.device.type == "cpu"
    assert torch.allclose(model.inv_freq, torch.tensor([1.0, 0.01]))


def test_include_buffers_places_buffers_and_factories_like_torch_device():
    outside = torch.ones(2)
    with metamode.empty_weights(include_buffers=True):
        model = WithBuffer()
        made = torch.zeros(3)
        explicit = torch.zeros(3, device="cpu")
        model.register_buffer("registered_real", outside)
    assert model.linear.weight.is_meta
    assert model.inv_freq.is_meta and made.is_meta
    assert explicit.device.type == "cpu", "an explicit device= must win, as in torch.device"
    assert model.registered_real.is_meta, "registered buffers move too"
    assert outside.device.type == "cpu", "the caller's tensor itself is untouched"


def test_parameter_metadata_is_kept():
    with metamode.empty_weights():
        layer = nn.Linear(5, 7, dtype=torch.float64)
        layer.frozen = nn.Parameter(torch.empty(2), requires_grad=False)
    assert layer.weight.shape == (7, 5) and layer.weight.dtype == torch.float64
    assert layer.weight.requires_grad and not layer.frozen.requires_grad
    assert type(layer.weight) is nn.Parameter


def test_other_device_is_supported():
    with metamode.init_on_device("cpu"):
        layer = nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu"


def test_parameter_already_on_target_keeps_identity():
    param = nn.Parameter(torch.empty(3, device="meta"))
    module = nn.Module()
    with metamode.empty_weights():
        module.p = param
    assert module.p is param


def test_parameter_registered_with_none_is_allowed():
    with metamode.empty_weights():
        layer = nn.Linear(2, 2, bias=False)
    assert layer.bias is None and layer.weight.is_meta


# -- Parameter subclasses ------------------------------------------------------


class TaggedParam(nn.Parameter):
    """Constructor takes no extra arguments; attributes are set afterwards."""


class QuantParam(nn.Parameter):
    """bitsandbytes-style: every attribute is a constructor argument."""

    def __new__(cls, data=None, requires_grad=False, quant_state=None, blocksize=64):
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self.quant_state = quant_state
        self.blocksize = blocksize
        self.constructed_by_new = True
        return self


class StrictParam(nn.Parameter):
    """A constructor that refuses both calling conventions."""

    def __new__(cls, data, *, token):
        self = torch.Tensor._make_subclass(cls, data, False)
        self.token = token
        return self


def test_parameter_subclasses_keep_class_and_attributes():
    tagged = TaggedParam(torch.empty(2, 2))
    tagged.role = "gate"
    quant = QuantParam(torch.empty(4), requires_grad=False, quant_state={"s": 1}, blocksize=32)
    strict = StrictParam(torch.empty(3), token="x")
    module = nn.Module()
    with metamode.empty_weights():
        module.tagged, module.quant, module.strict = tagged, quant, strict
    assert type(module.tagged) is TaggedParam and module.tagged.role == "gate"
    assert module.tagged.requires_grad
    assert type(module.quant) is QuantParam and module.quant.is_meta
    assert module.quant.quant_state == {"s": 1} and module.quant.blocksize == 32
    assert module.quant.constructed_by_new and not module.quant.requires_grad
    assert type(module.strict) is StrictParam and module.strict.token == "x"
    assert module.strict.is_meta
    assert "requires_grad" not in tagged.__dict__, "the original must not be mutated"
    assert tagged.device.type == "cpu"


# -- ties ------------------------------------------------------------------------


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_stay_tied():
    with metamode.empty_weights():
        model = TiedLM()
    assert model.head.weight is model.embed.weight and model.head.weight.is_meta


def test_same_original_registered_twice_maps_to_one_moved_parameter():
    shared = nn.Parameter(torch.empty(3))
    a, b = nn.Module(), nn.Module()
    with metamode.empty_weights():
        a.w = shared
        b.w = shared
    assert a.w is b.w and a.w.is_meta


def test_tie_memory_is_per_context():
    shared = nn.Parameter(torch.empty(3))
    a, b = nn.Module(), nn.Module()
    with metamode.empty_weights():
        a.w = shared
    with metamode.empty_weights():
        b.w = shared
    assert a.w is not b.w


@pytest.mark.parametrize("device", ["meta:0", "cpu:0", "meta", "cpu"])
def test_ties_hold_with_indexed_devices(device):
    # A placed parameter reports no device index: it must not count as "not yet
    # on the target" and be moved (and untied) again.
    with metamode.empty_weights(device=device):
        a = nn.Linear(2, 2)
        b = nn.Module()
        b.w = a.weight
    assert b.w is a.weight
    assert a.weight.device.type == torch.device(device).type


# Fails if EmptyWeights._memoised moves every registration afresh (no tie memo).


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


# -- nesting and skip -------------------------------------------------------------


def test_active_reports_innermost_context():
    assert metamode.active() is None
    with metamode.empty_weights() as outer:
        assert metamode.active() is outer
        with metamode.empty_weights(include_buffers=True) as inner:
            assert metamode.active() is inner
            assert torch.empty(1).is_meta
        assert metamode.active() is outer
        assert not torch.empty(1).is_meta
    assert metamode.active() is None


def test_skip_suspends_parameters_and_factories():
    with metamode.empty_weights(include_buffers=True):
        with metamode.skip_empty_weights():
            assert metamode.active() is None
            layer = nn.Linear(2, 2)
            made = torch.zeros(2)
        after = nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu" and made.device.type == "cpu"
    assert after.weight.is_meta, "the context resumes after the skip"


def test_skip_does_not_skip_init_of_real_tensors():
    torch.manual_seed(0)
    expected = nn.Linear(4, 4)
    torch.manual_seed(0)
    with metamode.empty_weights(), metamode.skip_empty_weights():
        layer = nn.Linear(4, 4)
    assert torch.equal(layer.weight, expected.weight) and torch.equal(layer.bias, expected.bias)


def test_context_entered_inside_skip_is_active():
    with metamode.empty_weights(), metamode.skip_empty_weights():
        with metamode.empty_weights() as inner:
            assert metamode.active() is inner
            assert nn.Linear(2, 2).weight.is_meta
        assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_skip_without_context_is_harmless():
    with metamode.skip_empty_weights():
        assert nn.Linear(2, 2).weight.device.type == "cpu"


# -- skipped initialisation -------------------------------------------------------------


def test_init_is_skipped_only_for_meta_tensors():
    from tests.unit.core.test_skip_rule import (
        InitKernelRecorder,  # counts value-writing kernels on meta
    )

    torch.manual_seed(0)
    expected = torch.nn.init.uniform_(torch.zeros(4))
    torch.manual_seed(0)
    recorder = InitKernelRecorder()
    with metamode.empty_weights(), recorder:
        real = torch.nn.init.uniform_(torch.zeros(4))
        meta = torch.empty(4, device="meta")
        assert torch.nn.init.kaiming_uniform_(meta.view(2, 2)).is_meta
        assert torch.nn.init.normal_(tensor=meta) is meta
        meta.fill_(3.0)
    assert recorder.seen == [], "an init call on a meta tensor reached its kernel"
    assert torch.equal(real, expected), "an init call on a real tensor was skipped"
    # The same calls without a context do reach the meta kernels (the recorder sees them).
    with InitKernelRecorder() as plain:
        torch.nn.init.normal_(tensor=meta)
    assert plain.seen == ["normal_"]


# -- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["not-a-device", "cuda:x", 3.5])
def test_invalid_device_is_refused_up_front(device):
    with pytest.raises(ValueError, match="device"):
        metamode.empty_weights(device=device)


def test_unavailable_device_is_refused_up_front():
    # One past the last CUDA device: unavailable on every machine, with or without CUDA.
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=missing):
        metamode.empty_weights(device=missing)


def test_include_buffers_must_be_bool():
    with pytest.raises(TypeError):
        metamode.empty_weights(include_buffers="yes")


def test_accelerate_signature_alias_reads_the_env(monkeypatch):
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "yes")
    assert metamode.init_empty_weights().include_buffers
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "0")
    assert not metamode.init_empty_weights().include_buffers
    assert metamode.init_empty_weights(include_buffers=True).include_buffers
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "maybe")
    with pytest.raises(ValueError, match="truth value"):
        metamode.init_empty_weights()


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: metamode.empty_weights("cpu"), r"Did you mean empty_weights\(device='cpu'\)\?"),
        (
            lambda: metamode.empty_weights(torch.device("meta")),
            r"Did you mean empty_weights\(device='meta'\)\?",
        ),
    ],
)
def test_positional_device_says_what_was_meant(call, says):
    # The first positional argument is include_buffers: a device there is a slip.
    with pytest.raises(TypeError, match=says):
        call()


def test_init_on_device_passes_include_buffers_on():
    context = metamode.init_on_device("meta", include_buffers=True)
    assert context.include_buffers is True and context.device == torch.device("meta")
    assert metamode.init_on_device("meta", include_buffers=False).include_buffers is False


def test_reprs_name_the_settings():
    assert repr(metamode.empty_weights(device="cpu")) == (
        "metamode.empty_weights(device='cpu', include_buffers=False)"
    )
    assert repr(metamode.skip_empty_weights()) == "metamode.skip_empty_weights()"


# -- global state ----------------------------------------------------------------------------------


def test_hooks_are_installed_at_import_and_contexts_do_not_touch_them():
    assert installed()
    before = (
        tuple(torch_module._global_parameter_registration_hooks),
        tuple(torch_module._global_buffer_registration_hooks),
        dict(vars(nn.Module)),
    )
    with metamode.empty_weights(include_buffers=True), metamode.skip_empty_weights():
        during = (
            tuple(torch_module._global_parameter_registration_hooks),
            tuple(torch_module._global_buffer_registration_hooks),
            dict(vars(nn.Module)),
        )
    assert before == during


def test_reimporting_the_hooks_module_installs_nothing_new():
    import importlib

    import metamode._core.hooks as hooks

    count = len(torch_module._global_parameter_registration_hooks)
    importlib.reload(hooks)
    assert len(torch_module._global_parameter_registration_hooks) == count


def test_context_does_not_leak_into_other_threads():
    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def bystander() -> None:
        assert inside.wait(30)
        seen["device"] = nn.Linear(2, 2).weight.device.type
        seen["factory"] = torch.empty(1).device.type
        seen["active"] = metamode.active()
        outside.set()

    thread = threading.Thread(target=bystander)
    thread.start()
    with metamode.empty_weights(include_buffers=True):
        inside.set()
        assert outside.wait(30)
        assert nn.Linear(2, 2).weight.is_meta
    thread.join()
    assert seen == {"device": "cpu", "factory": "cpu", "active": None}


# Fails if a context is process-global (e.g. active_empty_weights ignoring the thread).


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
