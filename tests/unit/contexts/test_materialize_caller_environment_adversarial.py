"""A break-it pass on "exact or refused upfront" from the caller's side: the environment
``materialize`` is called in, the model-level idioms a user checks after it, and generator
idioms the build uses.

What is checked, each against eager construction under the same seed, bitwise, with the
default generator left as it was (or, where refused, ``is_materializable`` saying so first,
``NotMaterializableError`` naming the cause, nothing changed):

1. the caller's environment at materialize time: autograd contexts (anomaly detection,
   saved-tensor hooks, forward AD), ``DisableTorchFunction``, torch function modes that
   perturb or raise, dispatch modes (a logging one, ``FakeTensorMode``, one that rewrites
   ``detach``), ``torch.func`` transforms, deterministic algorithms, and process-wide numeric
   settings earlier passes did not take (the new ``fp32_precision`` API, NNPACK);
2. model-level idioms after materialize: ``training``, hooks, persistence of buffers,
   ``state_dict`` keys, ties, ``is_leaf`` and ``grad``, a buffer computed with autograd,
   gradients and optimizer steps taken inside the build;
3. generator idioms: the default generator passed explicitly, its state copied into user
   generators (``set_state``, ``clone_state``) and back, ``sparse_`` with a generator,
   index draws used to write, ``fork_rng`` with a seed, and calls torch tags as random that
   draw nothing (``dropout`` in eval or with ``p=0``, attention without dropout).

Every case holds: the caller's dispatch modes and functorch transforms are set aside by
materialize, the settings are recorded, a buffer with an autograd graph or a ``.grad`` set in
the build is refused, gradients name the backward pass, and dropout that draws nothing is not
a draw.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import metamode
from tests.unit.contexts.materialize_checks import (
    MODES,
    Unchanged,
    assert_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    deterministic,
    materialize_exactly,
    tensors,
    warm_pickling,
)

warm_pickling()


def _promise_under(
    context: Callable[[], contextlib.AbstractContextManager],
    model: nn.Module,
    ref: nn.Module,
    because: str | None = None,
) -> str:
    """Inside ``context``: ``is_materializable``, then ``materialize``. Outside it (where
    comparisons run without the caller's modes): exact against ``ref`` with the default
    generator untouched, or refused (``NotMaterializableError`` only, matching ``because``)
    with nothing changed, whichever ``is_materializable`` announced."""
    before = Unchanged(model)
    state = torch.default_generator.get_state()
    refusal: metamode.NotMaterializableError | None = None
    with context():
        answer = metamode.is_materializable(model)
        try:
            metamode.materialize(model)
        except metamode.NotMaterializableError as error:
            refusal = error
    if answer:
        assert refusal is None, f"is_materializable said yes, materialize refused: {refusal}"
        assert_same_tensors(model, ref)
        assert torch.equal(torch.default_generator.get_state(), state), (
            "materialize changed the default generator"
        )
        return "exact"
    assert refusal is not None, "is_materializable said no, materialize went ahead"
    before.check()
    if because is not None:
        assert re.search(because, str(refusal), re.IGNORECASE), str(refusal)
    return "refused"


# == 1. the caller's environment at materialize time ========================================


class _Net(nn.Module):
    """Random inits before and after a computed buffer and running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        g = torch.randn(4, 4)
        self.register_buffer("gram", g @ g.T)
        self.b = nn.Linear(4, 3)


class _NormalPlusOne(TorchFunctionMode):
    """Adds one to whatever ``Tensor.normal_`` fills on a real tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.normal_ and not out.is_meta:
            with torch._C.DisableTorchFunction():
                out.add_(1)
        return out


class _NoRandomInit(TorchFunctionMode):
    """A guard that forbids random fills and matmuls in its block."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.__matmul__):
            raise RuntimeError(f"{func.__name__} is not allowed here")
        return func(*args, **(kwargs or {}))


class _Logging(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


HARMLESS_CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "autograd.detect_anomaly()": torch.autograd.detect_anomaly,
    "saved_tensors_hooks(doubling)": lambda: torch.autograd.graph.saved_tensors_hooks(
        lambda t: t * 2, lambda t: t
    ),
    "forward_ad.dual_level()": torch.autograd.forward_ad.dual_level,
    "DisableTorchFunction()": torch._C.DisableTorchFunction,
    "DisableTorchFunctionSubclass()": torch._C.DisableTorchFunctionSubclass,
    "a TorchFunctionMode adding 1 to normal_": _NormalPlusOne,
    "a TorchFunctionMode forbidding random fills": _NoRandomInit,
    "a logging TorchDispatchMode": _Logging,
    "_disable_current_modes()": torch.utils._python_dispatch._disable_current_modes,
    "use_deterministic_algorithms(True)": deterministic,
    "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("context", sorted(HARMLESS_CONTEXTS))
def test_materialize_under_caller_contexts_a_part_the_whole_then_again(context, include_buffers):
    """A submodule, the whole model, then the whole again, all inside the caller's
    context: exact, the default generator untouched, the second whole call a no-op."""
    ref = build_eagerly(_Net)
    model = build_empty(_Net, include_buffers)
    assert metamode.is_materializable(model)
    state = torch.default_generator.get_state()
    with HARMLESS_CONTEXTS[context]():
        metamode.materialize(model.b)
        metamode.materialize(model)
        objects = {name: id(t) for name, t in tensors(model).items()}
        metamode.materialize(model)
        assert {name: id(t) for name, t in tensors(model).items()} == objects
    assert torch.equal(torch.default_generator.get_state(), state)
    assert_same_tensors(model, ref)


def test_a_logging_dispatch_mode_sees_nothing_of_materialize():
    """The caller's dispatch mode is set aside: it sees neither the replay nor the install."""
    ref = build_eagerly(_Net)
    model = build_empty(_Net, include_buffers=True)
    mode = _Logging()
    _promise_under(lambda: mode, model, ref)
    assert mode.ops == [], sorted(set(mode.ops))


class _ZeroDetach(TorchDispatchMode):
    """A dispatch mode that rewrites what ``detach`` returns (zeros of its shape)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.detach.default and out.is_floating_point():
            out = torch.zeros_like(out)
        return out


def _functorch_grad() -> contextlib.AbstractContextManager:
    """``torch.func.grad``'s transform level, entered as a context (what a function being
    transformed runs under)."""
    return torch._functorch.eager_transforms.grad_increment_nesting()


DISPATCH_CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "FakeTensorMode()": FakeTensorMode,
    "FakeTensorMode(allow_non_fake_inputs=True)": lambda: FakeTensorMode(
        allow_non_fake_inputs=True
    ),
    "a dispatch mode rewriting detach": _ZeroDetach,
    "torch.func.grad's transform level": _functorch_grad,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize(
    "context",
    sorted(DISPATCH_CONTEXTS),
)
def test_materialize_under_a_dispatch_level_context_is_exact_or_refused(context, include_buffers):
    """materialize sets the caller's dispatch modes and functorch transforms aside: replay
    and install run as eager construction would outside them."""
    ref = build_eagerly(_Net)
    model = build_empty(_Net, include_buffers)
    _promise_under(DISPATCH_CONTEXTS[context], model, ref)


def test_eager_construction_works_under_grads_transform_level():
    """The eager side of the ``torch.func.grad`` case: building works there."""
    torch.manual_seed(0)
    with _functorch_grad():
        built = _Net()
    assert not any(t.is_meta for t in tensors(built).values())


def test_materialize_inside_torch_func_grad_of_a_buffer_free_model_is_exact():
    ref = build_eagerly(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    model = build_empty(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))

    def inside(x: torch.Tensor) -> torch.Tensor:
        metamode.materialize(model)
        return (x * 2).sum()

    torch.func.grad(inside)(torch.ones(2))
    assert_same_tensors(model, ref)


# -- process-wide numeric settings earlier passes did not take ---------------------------------


@contextlib.contextmanager
def _onednn_matmul_bf16():
    """torch's new precision API (``torch.backends.mkldnn.matmul.fp32_precision``), which
    torch recommends over ``set_float32_matmul_precision``: float32 matmuls in bfloat16."""
    before = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before


class _BigGram(nn.Module):
    """A matmul large enough for oneDNN to run it in bfloat16 under that setting (on a CPU
    with bfloat16 instructions its bits differ from the float32 product)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        a = torch.randn(256, 256)
        self.register_buffer("gram", a @ a)


@pytest.mark.parametrize("include_buffers", MODES)
def test_the_new_fp32_precision_api_set_after_the_build(include_buffers):
    ref = build_eagerly(_BigGram)
    model = build_empty(_BigGram, include_buffers)
    _promise_under(_onednn_matmul_bf16, model, ref, because="precision")


@pytest.mark.parametrize("include_buffers", MODES)
def test_the_new_fp32_precision_api_set_for_build_and_materialize(include_buffers):
    with _onednn_matmul_bf16():
        ref = build_eagerly(_BigGram)
        model = build_empty(_BigGram, include_buffers)
        materialize_exactly(model, ref)


def test_a_plain_build_under_the_new_fp32_precision_api():
    with _onednn_matmul_bf16(), metamode.empty_weights():
        built = _BigGram()
    assert built.fc.weight.is_meta


class _Calibrated(nn.Module):
    """A conv over a calibration batch of 16 after a random init: with oneDNN off, the CPU
    convolution takes NNPACK's path where ``torch.backends.nnpack.enabled``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        x, w = torch.randn(16, 3, 12, 12), torch.randn(8, 3, 3, 3)
        self.register_buffer("features", F.conv2d(x, w))


def _no_onednn():
    return torch.backends.mkldnn.flags(enabled=False)


@contextlib.contextmanager
def _no_onednn_no_nnpack():
    with torch.backends.mkldnn.flags(enabled=False), torch.backends.nnpack.flags(enabled=False):
        yield


@pytest.mark.parametrize("include_buffers", MODES)
def test_nnpack_switched_off_before_materialize(include_buffers):
    with _no_onednn():
        ref = build_eagerly(_Calibrated)
        model = build_empty(_Calibrated, include_buffers)
    _promise_under(_no_onednn_no_nnpack, model, ref, because="nnpack")


@pytest.mark.parametrize("include_buffers", MODES)
def test_nnpack_as_the_build_had_it(include_buffers):
    with _no_onednn():
        ref = build_eagerly(_Calibrated)
        model = build_empty(_Calibrated, include_buffers)
        materialize_exactly(model, ref)


# == 2. model-level idioms after materialize =================================================


class _Idiomatic(nn.Module):
    """What users check after materialize: mode, hooks, persistence, ties, frozen parts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)
        self.register_buffer("scratch", torch.randn(4), persistent=False)
        self.table = nn.Buffer(torch.arange(4.0), persistent=False)
        self.kept = nn.Buffer(torch.linspace(0, 1, 4))
        self.calls: list[str] = []
        self.body.register_forward_hook(lambda *_: self.calls.append("forward"))
        self.body.weight.register_hook(lambda g: self.calls.append("grad") or g)
        self.eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)) + self.frozen + self.table)


@pytest.mark.parametrize("include_buffers", MODES)
def test_model_level_idioms_after_materialize_are_eagers(include_buffers):
    ref = build_eagerly(_Idiomatic)
    model = build_empty(_Idiomatic, include_buffers)
    materialize_exactly(model, ref)
    assert model.head.weight is model.embed.weight
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == [
        n for n, _ in ref.named_parameters(remove_duplicate=False)
    ]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert model._non_persistent_buffers_set == ref._non_persistent_buffers_set
    assert [m.training for m in model.modules()] == [m.training for m in ref.modules()]
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert type(p) is type(q) and p.is_leaf and p.grad is None, name
        assert p.requires_grad == q.requires_grad, name
    for m in (model, ref):
        m(torch.tensor([[1, 2]])).sum().backward()
    assert model.calls == ref.calls == ["forward", "grad"]
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


class _ComputedBuffer(nn.Module):
    """A buffer computed from a parameter (a scaled copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.register_buffer("twice", self.w * 2)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("grad_mode", ["enable_grad", "no_grad"])
def test_a_buffer_computed_without_grad_under_another_grad_mode(grad_mode, include_buffers):
    """Built under ``no_grad`` (a leaf without grad), materialized under either mode."""

    def build() -> nn.Module:
        with torch.no_grad():
            return _ComputedBuffer()

    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    with getattr(torch, grad_mode)():
        materialize_exactly(model, ref)
    assert model.twice.is_leaf and not model.twice.requires_grad


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_buffer_computed_with_autograd_comes_back_a_leaf_keeping_requires_grad(include_buffers):
    """Eager's buffer is ``w * 2`` with a ``grad_fn``; materialize gives its value and its
    ``requires_grad``, not its graph (the materialize guide says so): a loss through it does
    not reach ``w``."""
    ref = build_eagerly(_ComputedBuffer)
    assert ref.twice.grad_fn is not None and ref.twice.requires_grad
    model = build_empty(_ComputedBuffer, include_buffers)
    materialize_exactly(model, ref)
    assert model.twice.is_leaf and model.twice.requires_grad
    model.twice.sum().backward()
    assert model.w.grad is None


def _grad_set_in_the_build() -> nn.Module:
    layer = nn.Linear(4, 4)
    layer.weight.grad = torch.zeros_like(layer.weight)  # a pre-allocated gradient
    return layer


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_grad_set_inside_the_build_is_refused_naming_it(include_buffers):
    ref = build_eagerly(_grad_set_in_the_build)
    assert ref.weight.grad is not None
    model = build_empty(_grad_set_in_the_build, include_buffers)
    assert_refused(model, "weight", because=".grad was set in the build")


def _backward_without_a_step() -> nn.Module:
    layer = nn.Linear(4, 2)
    layer(torch.ones(3, 4)).sum().backward()  # gradients kept, the weights unchanged
    return layer


def test_gradients_a_backward_in_the_build_left_are_refused_naming_grad():
    ref = build_eagerly(_backward_without_a_step)
    assert ref.weight.grad is not None
    model = build_empty(_backward_without_a_step, include_buffers=True)
    assert_refused(model, "weight", "bias", because=".grad was set in the build")


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_grad_set_in_the_build_and_cleared_after_it_is_exact(include_buffers):
    ref = build_eagerly(_grad_set_in_the_build)
    ref.weight.grad = None
    model = build_empty(_grad_set_in_the_build, include_buffers)
    model.weight.grad = None
    materialize_exactly(model, ref)


def _backward_in_the_build() -> nn.Module:
    """A data-dependent init: one backward over a calibration batch, then a step."""
    layer = nn.Linear(4, 2)
    layer(torch.ones(3, 4)).pow(2).sum().backward()
    with torch.no_grad():
        layer.weight -= 0.1 * layer.weight.grad
    layer.weight.grad = None
    return layer


def _sgd_step_in_the_build() -> nn.Module:
    layer = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.ones(3, 4)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return layer


@pytest.mark.parametrize(
    "build", [_backward_in_the_build, _sgd_step_in_the_build], ids=["backward", "SGD step"]
)
def test_a_backward_pass_inside_the_build_is_refused_naming_it(build):
    # include_buffers=True only: with parameters only, the eager code mixes a meta weight
    # with a real input and fails in the build, as it does without metamode's recording
    model = build_empty(build, include_buffers=True)
    message = assert_refused(model, "weight", because="backward pass of the build")
    assert "made outside the recording" not in message


# == 3. generators ===========================================================================


def _default_generator_passed_explicitly(m: nn.Module) -> None:
    m.a = nn.Linear(4, 4)
    nn.init.normal_(m.a.weight, generator=torch.default_generator)
    m.register_buffer("r", torch.rand(3, generator=torch.default_generator))
    m.b = nn.Linear(4, 4)


def _default_state_copied_into_a_user_generator(m: nn.Module) -> None:
    m.a = nn.Linear(4, 4)  # draws skipped on meta: the default is at a marker
    g = torch.Generator()
    g.set_state(torch.get_rng_state())
    m.w = nn.Parameter(torch.randn(4, generator=g))
    m.b = nn.Linear(4, 4)  # the default continues where it was


def _default_generator_clone_state(m: nn.Module) -> None:
    m.a = nn.Linear(4, 4)
    g = torch.default_generator.clone_state()
    m.w = nn.Parameter(torch.randn(4, generator=g))
    m.b = nn.Linear(4, 4)


def _user_state_copied_into_the_default(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(7)
    m.a = nn.Linear(4, 4)
    nn.init.normal_(m.a.weight, generator=g)
    torch.set_rng_state(g.get_state())
    m.b = nn.Linear(4, 4)


def _user_generator_copied_into_another(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(7)
    m.a = nn.Linear(4, 4)
    nn.init.normal_(m.a.weight, generator=g)
    h = torch.Generator()
    h.set_state(g.get_state())
    m.u = nn.Parameter(torch.randn(4, generator=h))
    m.v = nn.Parameter(torch.randn(4, generator=g))


def _sparse_with_a_generator(m: nn.Module) -> None:
    m.a = nn.Linear(8, 8)
    nn.init.sparse_(m.a.weight, 0.5, generator=torch.Generator().manual_seed(3))


def _index_draws_used_to_write(m: nn.Module) -> None:
    m.register_buffer("picked", torch.multinomial(torch.ones(10), 5, replacement=False))
    m.register_buffer("perm", torch.randperm(12))
    m.register_buffer("ints", torch.randint(0, 100, (5,)))
    m.register_buffer("mask", torch.empty(6).bernoulli_(0.3))
    m.a = nn.Linear(3, 3)
    with torch.no_grad():
        m.a.weight[:, m.perm[:3] % 3] = 0


def _fork_rng_with_a_seed(m: nn.Module) -> None:
    m.a = nn.Linear(4, 4)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        m.w = nn.Parameter(torch.randn(4))
    m.b = nn.Linear(4, 4)


GENERATOR_IDIOMS: dict[str, Callable[[nn.Module], None]] = {
    "generator=torch.default_generator": _default_generator_passed_explicitly,
    "default state set_state into a user generator": _default_state_copied_into_a_user_generator,
    "default_generator.clone_state()": _default_generator_clone_state,
    "user state set_rng_state into the default": _user_state_copied_into_the_default,
    "user generator state into another": _user_generator_copied_into_another,
    "sparse_(generator=)": _sparse_with_a_generator,
    "multinomial/randperm/randint/bernoulli_ used to index": _index_draws_used_to_write,
    "fork_rng with manual_seed inside": _fork_rng_with_a_seed,
}


class _Built(nn.Module):
    def __init__(self, init: Callable[[nn.Module], None]) -> None:
        super().__init__()
        init(self)


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(GENERATOR_IDIOMS))
def test_generator_idioms_are_exact(idiom, include_buffers):
    build = lambda: _Built(GENERATOR_IDIOMS[idiom])  # noqa: E731
    ref = build_eagerly(build)
    eager_state = torch.default_generator.get_state()
    model = build_empty(build, include_buffers)
    materialize_exactly(model, ref)
    torch.manual_seed(0)
    build()
    assert torch.equal(torch.default_generator.get_state(), eager_state)


# -- calls torch tags as random that draw nothing here -------------------------------------


def _dropout_p0(m: nn.Module) -> None:
    m.a = nn.Linear(4, 4)
    with torch.no_grad():
        m.register_buffer("kept", F.dropout(torch.arange(4.0) + 1, p=0.0))
    m.b = nn.Linear(4, 4)


def _attention_without_dropout(m: nn.Module) -> None:
    m.a = nn.Linear(4, 4)
    q = torch.arange(12.0).reshape(1, 1, 3, 4) / 12
    m.register_buffer("attended", F.scaled_dot_product_attention(q, q, q))
    m.b = nn.Linear(4, 4)


def _eval_forward_through_dropout(m: nn.Module) -> None:
    m.a = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    with torch.no_grad():
        m.register_buffer("mean", m.a(torch.ones(2, 4)).mean(0))
    m.b = nn.Linear(4, 4)


def _eval_multihead_attention(m: nn.Module) -> None:
    m.a = nn.MultiheadAttention(4, 2, dropout=0.1).eval()
    x = torch.ones(3, 1, 4)
    with torch.no_grad():
        m.register_buffer("out", m.a(x, x, x)[0])
    m.b = nn.Linear(4, 4)


NO_DRAW_CALLS: dict[str, tuple[Callable[[nn.Module], None], list[bool]]] = {
    "F.dropout(p=0.0)": (_dropout_p0, MODES),
    "scaled_dot_product_attention(dropout_p=0)": (_attention_without_dropout, MODES),
    # a forward on real inputs: params-only builds mix meta weights and real inputs
    "eval forward through nn.Dropout": (_eval_forward_through_dropout, [True]),
    "eval MultiheadAttention(dropout=0.1)": (_eval_multihead_attention, [True]),
}


def test_those_calls_draw_nothing_eagerly():
    q = torch.arange(12.0).reshape(1, 1, 3, 4) / 12
    attention = nn.MultiheadAttention(4, 2, dropout=0.1).eval()
    x = torch.ones(3, 1, 4)
    calls = [
        lambda: F.dropout(torch.arange(4.0) + 1, p=0.0),
        lambda: F.scaled_dot_product_attention(q, q, q),
        lambda: nn.Sequential(nn.Dropout(0.5)).eval()(torch.ones(2, 4)),
        lambda: attention(x, x, x),
    ]
    for call in calls:
        state = torch.default_generator.get_state()
        with torch.no_grad():
            call()
        assert torch.equal(torch.default_generator.get_state(), state)


@pytest.mark.parametrize(
    ("call", "include_buffers"),
    [
        pytest.param(name, mode, id=f"{name}-{mode}")
        for name, (_, modes) in NO_DRAW_CALLS.items()
        for mode in modes
    ],
)
def test_calls_that_draw_nothing_leave_the_build_exact(call, include_buffers):
    build = lambda: _Built(NO_DRAW_CALLS[call][0])  # noqa: E731
    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    materialize_exactly(model, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_the_layers_around_a_no_draw_call_are_exact_one_by_one(include_buffers):
    build = lambda: _Built(_dropout_p0)  # noqa: E731
    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    materialize_exactly(model.a, ref.a)
    materialize_exactly(model.b, ref.b)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_dropout_that_draws_still_refuses_the_draws_after_it(include_buffers):
    def init(m: nn.Module) -> None:
        m.a = nn.Linear(4, 4)
        m.register_buffer("kept", F.dropout(torch.ones(4), p=0.5))
        m.b = nn.Linear(4, 4)

    build = lambda: _Built(init)  # noqa: E731
    ref = build_eagerly(build)
    model = build_empty(build, include_buffers)
    materialize_exactly(model.a, ref.a)
    assert_refused(model.b, because="dropout draws random numbers and takes no generator=")
