"""The skipped-init fast path changes nothing but speed.

Inside ``metamode.empty_weights()`` value-initialising calls on meta tensors
return at once (:mod:`metamode._core.skip_rule`). These tests prove, for a
pure-torch model in this process and for transformers / diffusers / PEFT
models in a subprocess, that a model built with the skip is *exactly* the
model built without it -- module tree, parameter and buffer shapes, dtypes,
devices, ``requires_grad``, classes and ties -- and, with a dispatch-level
recorder, that the skip really happened (no init kernel ran on a meta
tensor). Then the rule's edges, one by one.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import metamode
from metamode.lab.workloads import TorchLM, describe
from tests.conftest import run_python

# aten ops that only write values (what the skip avoids on meta tensors)
_INIT_OPS = (
    "normal_",
    "uniform_",
    "fill_",
    "zero_",
    "random_",
    "bernoulli_",
    "exponential_",
    "erfinv_",
    "clamp_",
    "mul_",
    "add_",
    "sub_",
    "div_",
    "log_normal_",
    "cauchy_",
)


class InitKernelRecorder(TorchDispatchMode):
    """Records value-writing aten ops that reach a meta tensor (below every torch-function mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in _INIT_OPS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _context(include_buffers: bool, skip: bool) -> metamode.EmptyWeights:
    context = metamode.empty_weights(include_buffers=include_buffers)
    context._skip_init = skip  # the switch the mode reads; False = the plain path
    return context


def _build(factory, include_buffers: bool, skip: bool):
    recorder = InitKernelRecorder()
    with _context(include_buffers, skip), recorder:
        model = factory()
    return model, recorder.seen


class Tagged(nn.Parameter):
    """A Parameter subclass with an attribute, like quantisation libraries use."""


class Mixed(nn.Module):
    """Every kind of thing a skeleton must keep: ties, frozen and subclassed
    parameters, persistent and non-persistent buffers, an init-time in-place op."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TorchLM(vocab=64, width=16, ffn=32, layers=2)
        self.frozen = nn.Parameter(torch.empty(3, 3), requires_grad=False)
        nn.init.trunc_normal_(self.frozen, std=0.02)
        self.tagged = Tagged(torch.empty(4, 2))
        self.tagged.kind = "int4"
        nn.init.xavier_uniform_(self.tagged)
        self.conv = nn.Conv2d(2, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.bn = nn.BatchNorm1d(4)
        self.gru = nn.GRU(4, 4)
        self.attention = nn.MultiheadAttention(8, 2)
        self.scale = nn.Parameter(torch.ones(4))
        with torch.no_grad():
            self.scale.mul_(0.5).add_(1.0)
        self.register_buffer("table", torch.arange(6.0).reshape(2, 3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


@pytest.mark.parametrize("include_buffers", [False, True])
def test_skipped_init_builds_exactly_the_plain_model_pure_torch(include_buffers):
    skipped, skipped_kernels = _build(Mixed, include_buffers, skip=True)
    plain, plain_kernels = _build(Mixed, include_buffers, skip=False)
    assert describe(skipped) == describe(plain)
    assert skipped_kernels == [], "an init kernel ran on a meta tensor despite the skip"
    assert plain_kernels, "the plain path should run init kernels on meta (else this test is moot)"
    assert skipped.lm.head.weight is skipped.lm.embed.weight
    assert type(skipped.tagged) is Tagged and skipped.tagged.kind == "int4"
    if include_buffers:
        with torch.device("meta"):
            reference = Mixed()
        assert describe(skipped) == describe(reference)
    else:
        assert torch.equal(skipped.table, torch.arange(6.0).reshape(2, 3))


_LIBRARY_CHECK = textwrap.dedent(
    """
    import json
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    import metamode
    from metamode.lab.workloads import LLAMA_SHAPES, describe, _lora_config

    def llama(**overrides):
        from transformers import LlamaConfig, LlamaForCausalLM
        return lambda: LlamaForCausalLM(LlamaConfig(**{**LLAMA_SHAPES["tiny"], **overrides}))

    def unet():
        from diffusers import UNet2DConditionModel
        from metamode.lab.workloads import SDXL_UNET_TINY
        return UNet2DConditionModel(**SDXL_UNET_TINY)

    cases = {
        "llama-tied": llama(),
        "llama-untied": llama(tie_word_embeddings=False),
        "llama3-rope": llama(rope_scaling={"rope_type": "llama3", "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}, rope_theta=500000.0),
        "sdxl-unet": unet,
    }
    out = {}
    for name, factory in cases.items():
        for include_buffers in (False, True):
            skipped, skipped_kernels = _build(factory, include_buffers, skip=True)
            plain, plain_kernels = _build(factory, include_buffers, skip=False)
            a, b = describe(skipped), describe(plain)
            out[f"{name} include_buffers={include_buffers}"] = {
                "same": a == b,
                "diff": [k for k in a if a[k] != b[k]],
                "skipped_kernels": skipped_kernels[:5],
                "plain_kernels": len(plain_kernels),
                "parameters": len(a["parameters"]),
            }

    # PEFT LoRA injection with metamode's shim: skip on vs off.
    import metamode._core.modes as modes
    from peft import inject_adapter_in_model
    metamode.enable_for_peft()
    real_skip = modes.skipped_target
    described = {}
    for skip in (True, False):
        modes.skipped_target = real_skip if skip else (lambda func, args, kwargs: None)
        torch.manual_seed(0)
        base = llama()()
        recorder = InitKernelRecorder()
        with recorder:
            inject_adapter_in_model(_lora_config("llama-1b"), base, low_cpu_mem_usage=True)
        described[skip] = (describe(base), recorder.seen)
    modes.skipped_target = real_skip
    out["peft lora shim"] = {
        "same": described[True][0] == described[False][0],
        "diff": [k for k in described[True][0]
                 if described[True][0][k] != described[False][0][k]],
        "skipped_kernels": described[True][1][:5],
        "plain_kernels": len(described[False][1]),
        "parameters": len(described[True][0]["parameters"]),
    }
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_skipped_init_builds_exactly_the_plain_model_transformers_diffusers_peft():
    # A subprocess: transformers' first init adds torch.nn.Module.smart_apply,
    # a global change the suite's guard would (rightly) report.
    helpers = "\n".join(inspect.getsource(f) for f in (InitKernelRecorder, _context, _build))
    imports = "import metamode, torch\nfrom torch.utils._python_dispatch import TorchDispatchMode\n"
    script = f"{imports}_INIT_OPS = {_INIT_OPS!r}\n{helpers}\n{_LIBRARY_CHECK}"
    results = run_python(script, timeout=600)
    assert len(results) == 9
    for case, result in results.items():
        assert result["same"], f"{case}: skipped build differs in {result['diff']}"
        assert result["skipped_kernels"] == [], f"{case}: init kernels ran on meta tensors"
        assert result["plain_kernels"] > 0, f"{case}: plain path ran no init kernel (moot test)"
        assert result["parameters"] > 0


# -- the rule's edges -----------------------------------------------------------------


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


def test_real_tensors_are_never_skipped():
    torch.manual_seed(0)
    expected = nn.init.normal_(torch.zeros(8))
    torch.manual_seed(0)
    with metamode.empty_weights():
        real = torch.zeros(8)
        nn.init.normal_(real)
        assert torch.equal(real, expected)
        real.fill_(2.0).mul_(3.0)
    assert torch.equal(real, torch.full((8,), 6.0))


def test_structural_methods_are_never_skipped():
    with metamode.empty_weights():
        resized = _meta(4).resize_(2, 3)
        flagged = _meta(2).requires_grad_()
        target = _meta(2, 2)
        target.set_(_meta(5))
        copied = _meta(3).copy_(torch.ones(3))
    assert resized.shape == (2, 3) and flagged.requires_grad and target.shape == (5,)
    assert copied.is_meta


def test_skip_keeps_errors_a_tensor_argument_could_raise():
    with metamode.empty_weights(), pytest.raises(RuntimeError):
        _meta(4).add_(_meta(5))


def test_init_called_with_keyword_tensor_is_skipped():
    recorder = InitKernelRecorder()
    meta = _meta(3, 3)
    with metamode.empty_weights(), recorder:
        assert nn.init.normal_(tensor=meta, std=0.5) is meta
        assert nn.init.uniform_(tensor=meta) is meta
        assert nn.init.constant_(tensor=meta, val=1.0) is meta
    assert recorder.seen == []


def test_methods_autograd_would_record_are_not_skipped():
    leaf = nn.Parameter(_meta(3))
    with metamode.empty_weights(), pytest.raises(RuntimeError, match="leaf Variable"):
        leaf.mul_(2.0)
    with metamode.empty_weights():
        recorded = (leaf + 1).mul_(2.0)
        with torch.no_grad():
            assert leaf.mul_(2.0) is leaf  # nothing to record: skipped
    assert type(recorded.grad_fn).__name__ == "MulBackward0"


def test_subclasses_with_their_own_torch_function_see_the_call():
    seen: list[str] = []

    class Tracked(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    tracked = _meta(2, 2).as_subclass(Tracked)
    with metamode.empty_weights():
        nn.init.normal_(tracked)
    assert "normal_" in seen


def test_a_library_rebound_init_function_is_skipped(monkeypatch):
    # transformers' guard_torch_init_functions rebinds torch.nn.init.* during
    # init_weights; torch's dispatch then names the rebound function.
    original = nn.init.normal_
    calls: list[str] = []

    def guarded_normal_(tensor, mean=0.0, std=1.0, generator=None):
        calls.append("guard")
        return original(tensor, mean=mean, std=std, generator=generator)

    guarded_normal_.__name__ = "normal_"
    monkeypatch.setattr(nn.init, "normal_", guarded_normal_)
    recorder = InitKernelRecorder()
    meta = _meta(4, 4)
    with metamode.empty_weights(), recorder:
        assert guarded_normal_(meta) is meta
    assert recorder.seen == [] and calls == ["guard"]


def test_skip_is_off_for_contexts_on_real_devices():
    torch.manual_seed(0)
    expected = nn.Linear(4, 4)
    context = metamode.empty_weights(device="cpu")
    assert context._skip_init is False
    recorder = InitKernelRecorder()
    torch.manual_seed(0)
    with context, recorder:
        layer = nn.Linear(4, 4)
        # The rule alone would skip this (a meta tensor); the context's flag must stop it.
        nn.init.normal_(_meta(4, 4))
    assert recorder.seen == ["normal_"], "a cpu context skipped an init call"
    assert torch.equal(layer.weight, expected.weight) and torch.equal(layer.bias, expected.bias)
