"""Each row of ``facts.FUSED_FAST_PATHS`` against torch itself: the forward keeps its reason
for the slow path in the named local, a torch function mode sends it there, and its result
then differs from eager's fused one; and the table names every forward of ``torch.nn`` that
asks ``has_torch_function`` before choosing a kernel."""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from metamode._core.facts import FUSED_FAST_PATHS, fused_fast_path


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Spy(TorchFunctionMode):
    """What the rule answers for each torch call made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.found.append(fused_fast_path(sys._getframe(1)))
        return func(*args, **(kwargs or {}))


def _mha() -> Callable[[], torch.Tensor]:
    attention = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    return lambda: attention(x, x, x)[0]


def _encoder_layer() -> Callable[[], torch.Tensor]:
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    return lambda: layer(x)


def _encoder() -> Callable[[], torch.Tensor]:
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 32)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    return lambda: encoder(x, src_key_padding_mask=padding)


_RUNS = {
    nn.MultiheadAttention.forward: _mha,
    nn.TransformerEncoderLayer.forward: _encoder_layer,
    nn.TransformerEncoder.forward: _encoder,
}
_ROWS = [
    pytest.param(forward, local, id=forward.__qualname__) for forward, local, _ in FUSED_FAST_PATHS
]


@pytest.mark.parametrize(("forward", "local"), _ROWS)
def test_the_forward_keeps_its_reason_in_the_named_local(forward, local) -> None:
    code = forward.__code__
    assert local in code.co_varnames
    assert "some Tensor argument has_torch_function" in code.co_consts
    assert "tensor_args" in code.co_varnames


@pytest.mark.parametrize(("forward", "local"), _ROWS)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_torch_function_mode_sends_it_to_a_slow_path_that_differs(forward, local) -> None:
    torch.manual_seed(0)
    run = _RUNS[forward]()
    with torch.no_grad():
        fused = run()
        with _PassThrough():
            slow = run()
    assert not torch.equal(fused, slow)


@pytest.mark.parametrize(("forward", "local"), _ROWS)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_the_rule_names_the_forward_while_it_runs_its_slow_path(forward, local) -> None:
    """A call made inside the forward, under a mode, finds it on the stack."""
    spy = _Spy()
    torch.manual_seed(0)
    run = _RUNS[forward]()
    with torch.no_grad(), spy:
        run()
    assert forward.__qualname__ in spy.found


def _mha_without_bias() -> Callable[[], torch.Tensor]:
    attention = nn.MultiheadAttention(32, 4, batch_first=True, bias=False).eval()
    x = torch.randn(2, 5, 32)
    return lambda: attention(x, x, x)[0]


# forward -> a run of it in which one of the attributes its fused call needs is None
_WITHOUT_A_NEED = {nn.MultiheadAttention.forward: _mha_without_bias}
_NEEDING = [
    pytest.param(forward, needs, id=forward.__qualname__)
    for forward, _, needs in FUSED_FAST_PATHS
    if needs
]


@pytest.mark.parametrize(("forward", "needs"), _NEEDING)
def test_without_what_its_fused_call_needs_eager_runs_slowly_and_is_not_named(forward, needs):
    spy = _Spy()
    torch.manual_seed(0)
    run = _WITHOUT_A_NEED[forward]()
    with torch.no_grad():
        eager = run()
        with spy:
            recorded = run()
    assert torch.equal(eager, recorded)
    assert spy.found and not any(spy.found)


def test_a_forward_that_eager_runs_slowly_too_is_not_named() -> None:
    """Training mode, or grad enabled with a weight requiring it, stops eager's fast path
    as well."""
    spy = _Spy()
    attention = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 5, 32)
    with spy:
        attention.train()(x, x, x)
        attention.eval()(x, x, x)  # grad enabled, and its weights require it
    assert spy.found and not any(spy.found)


def _asks_has_torch_function(node: ast.AST) -> bool:
    return any(
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute | ast.Name)
        and getattr(call.func, "attr", getattr(call.func, "id", None)) == "has_torch_function"
        for call in ast.walk(node)
    )


def test_the_table_names_every_nn_forward_that_asks_has_torch_function() -> None:
    """A torch release adding a fast path to another module fails here first."""
    modules = Path(inspect.getfile(nn.Module)).parent
    asking = set()
    for path in sorted(modules.glob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                if _asks_has_torch_function(method):
                    asking.add(f"{cls.name}.{method.name}")
    assert asking == {forward.__qualname__ for forward, _, _ in FUSED_FAST_PATHS}
