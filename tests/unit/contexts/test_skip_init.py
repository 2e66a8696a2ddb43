"""metamode.skip_init(): which writes are skipped, thread isolation, nesting.

"Skipped" is checked by value: a parameter is filled with a known value
first, and a skipped call must leave exactly that value in place (and return
the parameter). Module construction is checked with a recording mode entered
*below* ``skip_init``: it sees every call ``skip_init`` lets through.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import metamode
from metamode._contexts.skip_init import SkipInit
from metamode.lab.threads import wait

SENTINEL = 7.0


def _param(value: float = SENTINEL, requires_grad: bool = True) -> nn.Parameter:
    return nn.Parameter(torch.full((4, 4), value), requires_grad=requires_grad)


class _Recorder(TorchFunctionMode):
    """Records value-initialising calls, split by whether they target a parameter."""

    WRITES = frozenset({"uniform_", "normal_", "constant_", "kaiming_uniform_", "fill_", "zero_"})

    def __init__(self) -> None:
        super().__init__()
        self.into_parameters: list[str] = []
        self.into_other_tensors: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.WRITES:
            target = args[0] if args else kwargs.get("tensor")
            kind = isinstance(target, nn.Parameter)
            (self.into_parameters if kind else self.into_other_tensors).append(name)
        return func(*args, **kwargs)


SKIPPED = {
    "uniform_": lambda p: nn.init.uniform_(p, -1, 1),
    "normal_": lambda p: nn.init.normal_(p, std=0.02),
    "constant_": lambda p: nn.init.constant_(p, 3.0),
    "ones_": nn.init.ones_,
    "zeros_": nn.init.zeros_,
    "xavier_uniform_": nn.init.xavier_uniform_,
    "xavier_normal_": nn.init.xavier_normal_,
    "kaiming_uniform_": lambda p: nn.init.kaiming_uniform_(p, a=math.sqrt(5)),
    "kaiming_normal_": nn.init.kaiming_normal_,
    "keyword tensor=": lambda p: nn.init.normal_(tensor=p),
    "Tensor.uniform_": lambda p: p.uniform_(),
    "Tensor.normal_": lambda p: p.normal_(),
    "Tensor.fill_": lambda p: p.fill_(1.5),
    "Tensor.zero_": lambda p: p.zero_(),
    "Tensor.random_": lambda p: p.random_(0, 10),
    "Tensor.exponential_": lambda p: p.exponential_(),
    "Tensor.geometric_": lambda p: p.geometric_(0.5),
    "Tensor.log_normal_": lambda p: p.log_normal_(),
    "Tensor.cauchy_": lambda p: p.cauchy_(),
    "Tensor.bernoulli_": lambda p: p.bernoulli_(0.5),
}


@pytest.mark.parametrize("name", sorted(SKIPPED))
def test_value_initialising_calls_leave_a_parameter_untouched(name):
    param = _param()
    with torch.no_grad(), metamode.skip_init():
        result = SKIPPED[name](param)
    assert result is param
    assert bool((param == SENTINEL).all())


def test_the_same_calls_run_outside_the_context():
    for name, call in SKIPPED.items():
        param = _param()
        with torch.no_grad():
            call(param)
        assert not bool((param == SENTINEL).all()), name


# Each returns the tensor it wrote into (a parameter filled with SENTINEL, or not).
WRITTEN = {
    # Plain tensors, buffers and ``param.data``: always written, so what a
    # module computes while it is built is still computed.
    "plain tensor normal_": lambda p: torch.full((4, 4), SENTINEL).normal_(),
    "plain tensor nn.init.constant_": lambda p: nn.init.constant_(torch.empty(4, 4), 3.0),
    "param.data.uniform_": lambda p: p.data.uniform_(),
    # Arithmetic and copies always run.
    "mul_": lambda p: p.mul_(2.0),
    "clamp_": lambda p: p.clamp_(max=1.0),
    "copy_": lambda p: p.copy_(torch.zeros(4, 4)),
    # Another tensor among the arguments: could raise a shape error, so it runs.
    "fill_ with a tensor": lambda p: p.fill_(torch.tensor(1.5)),
    # init functions that compute through other operations still write.
    "trunc_normal_": lambda p: nn.init.trunc_normal_(p),
    "orthogonal_": nn.init.orthogonal_,
    "eye_": nn.init.eye_,
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_calls_outside_the_rule_still_write(name):
    with torch.no_grad(), metamode.skip_init():
        written = WRITTEN[name](_param())
    assert not bool((written == SENTINEL).all())


def test_buffers_are_computed_and_parameters_skipped_when_building_modules():
    with _Recorder() as unskipped:
        nn.Linear(4, 4)
    assert unskipped.into_parameters == ["kaiming_uniform_", "uniform_"], "the recorder sees"
    with _Recorder() as seen, metamode.skip_init():
        linear = nn.Linear(4, 4)
        norm = nn.BatchNorm1d(4)
        layer_norm = nn.LayerNorm(4)
        embedding = nn.Embedding(10, 4, padding_idx=0)
        conv = nn.Conv2d(2, 2, 3)
    assert seen.into_parameters == []
    # BatchNorm's running stats (buffers) and the Embedding's padding row (a
    # plain view of the weight) are written.
    assert sorted(seen.into_other_tensors) == ["fill_", "fill_", "zero_", "zero_"]
    assert torch.equal(norm.running_mean, torch.zeros(4))
    assert torch.equal(norm.running_var, torch.ones(4))
    assert all(p.device.type == "cpu" for m in (linear, layer_norm, embedding, conv)
               for p in m.parameters())  # fmt: skip


def test_grad_mode_on_a_leaf_raises_as_without_the_context():
    param = _param()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        param.fill_(1.0)
    with (
        metamode.skip_init(),
        pytest.raises(RuntimeError, match="leaf Variable that requires grad"),
    ):
        param.fill_(1.0)
    frozen = _param(requires_grad=False)
    with metamode.skip_init():
        frozen.fill_(1.0)  # nothing to record: skipped
    assert bool((frozen == SENTINEL).all())


class _CustomParameter(nn.Parameter):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_parameter_subclass_with_its_own_torch_function_gets_every_call():
    param = _CustomParameter(torch.full((2, 2), SENTINEL))
    with torch.no_grad(), metamode.skip_init():
        nn.init.constant_(param, 1.0)
    assert bool((param == 1.0).all())


def test_an_init_function_rebound_under_its_torch_name_is_recognised(monkeypatch):
    """transformers' guard_torch_init_functions rebinds torch.nn.init.normal_ etc.

    torch's own ``normal_`` then dispatches with whatever is bound under that
    name, so the mode must recognise it by name and binding, not identity.
    """
    torchs = nn.init.normal_

    def normal_(tensor, mean=0.0, std=1.0, generator=None):
        return torchs(tensor, mean=mean, std=std, generator=generator)

    monkeypatch.setattr(nn.init, "normal_", normal_)
    param = _param()
    with torch.no_grad(), metamode.skip_init():
        assert torchs(param) is param
    assert bool((param == SENTINEL).all())


def test_meta_parameters_and_empty_weights_compose():
    with metamode.skip_init(), metamode.empty_weights():
        linear = nn.Linear(4, 4)
    assert linear.weight.is_meta
    with metamode.empty_weights(), metamode.skip_init():
        linear = nn.Linear(4, 4)
    assert linear.weight.is_meta


# -- thread isolation ---------------------------------------------------------------


def _expected_kaiming(seed: int) -> torch.Tensor:
    return nn.init.kaiming_uniform_(
        torch.empty(4, 4), a=math.sqrt(5), generator=torch.Generator().manual_seed(seed)
    )


def test_other_threads_initialise_as_usual_while_one_skips():
    inside, built = threading.Event(), threading.Event()
    other: dict[str, torch.Tensor] = {}

    def bystander() -> None:
        wait(inside)
        try:
            param = _param()
            nn.init.kaiming_uniform_(
                param, a=math.sqrt(5), generator=torch.Generator().manual_seed(3)
            )
            other["param"] = param.detach()
        finally:
            built.set()

    thread = threading.Thread(target=bystander)
    thread.start()
    mine = _param()
    with torch.no_grad(), metamode.skip_init():
        inside.set()
        wait(built)  # the bystander initialised while this context was active
        nn.init.kaiming_uniform_(mine, a=math.sqrt(5))
    thread.join()
    assert torch.equal(other["param"], _expected_kaiming(3))
    assert bool((mine == SENTINEL).all())


def test_torch_nn_init_is_never_reassigned():
    before = {name: getattr(nn.init, name) for name in dir(nn.init)}
    with metamode.skip_init():
        during = {name: getattr(nn.init, name) for name in dir(nn.init)}
    assert during == before


# -- nesting --------------------------------------------------------------------------


def test_nesting_and_exit_restores_initialisation():
    with metamode.skip_init():
        with metamode.skip_init():
            pass
        param = _param()
        with torch.no_grad():
            nn.init.zeros_(param)
        assert bool((param == SENTINEL).all()), "the outer context is still active"
    with torch.no_grad():
        nn.init.zeros_(param)
    assert bool((param == 0).all())


def test_skip_init_returns_a_skip_init_context():
    # The ThreadScopedMode contract (single use, refused exits, decorator) is
    # tested for every context class in tests/unit/core/test_mode_contract.py.
    context = metamode.skip_init()
    assert isinstance(context, SkipInit)
    assert repr(context) == "metamode.skip_init()"
