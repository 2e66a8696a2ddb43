"""materialize and code that asks whether a tensor is on meta and does something else there.

The build took a branch eager construction does not take, so what the replay would compute is
not what eager computes: the tensors are refused, naming the read -- never silently
different. torch's own init functions that return early on meta (``trunc_normal_``,
``orthogonal_``, ``sparse_``, ``dirac_``) are exact, and reading a meta tensor's device to put
a new tensor beside it changes nothing.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_eager_equal,
    assert_refused,
    build_empty,
)


def _is_meta(t: torch.Tensor) -> bool:
    return t.is_meta


READS = {"is_meta": (_is_meta, "is_meta")}
# A ``.device`` comparison against meta itself (``.type == "meta"``, ``== meta``) is not
# refused: libraries check meta-ness so to skip a move that is a no-op in eager (PEFT's
# ``_move_adapter_to_device_of_base_layer``); those that build otherwise are refused by the
# integrations (tests/integration/test_materialize_peft_init.py). A comparison telling the
# CPU from other devices is refused (below).


class SkipsItsInitOnMeta(nn.Module):
    """A layer that leaves its weight to a checkpoint when built on meta."""

    def __init__(self, on_meta) -> None:
        super().__init__()
        self.on_meta = on_meta
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.on_meta(self.weight):
            return
        nn.init.normal_(self.weight)


class InitsOnlyWhenReal(nn.Module):
    """accelerate-style: ``if not any(p.is_meta ...)`` around a custom init."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        if not any(p.is_meta for p in self.parameters()):
            with torch.no_grad():
                self.proj.weight.mul_(0.1)
                self.proj.bias.zero_()


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("read", sorted(READS))
def test_a_branch_on_meta_refuses_naming_the_read(read, include_buffers):
    on_meta, word = READS[read]

    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), SkipsItsInitOnMeta(on_meta))

    model = build_empty(build, include_buffers)
    # what was built before the read is refused too: the branch may skip writes to any
    # tensor, built before it or after
    assert_refused(model, "1.weight", "0.weight", because=word)


@pytest.mark.parametrize("include_buffers", MODES)
def test_an_init_guarded_by_any_is_meta_refuses_naming_the_read(include_buffers):
    model = build_empty(InitsOnlyWhenReal, include_buffers)
    assert_refused(model, "proj.weight", "proj.bias", because="is_meta")


def _torch_inits() -> nn.Module:
    class Inits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(4)
            self.trunc = nn.Parameter(torch.empty(5, 4))
            nn.init.trunc_normal_(self.trunc, mean=0.5, std=2.0, a=-1.0, b=2.0)
            self.trunc_gen = nn.Parameter(torch.empty(6))
            nn.init.trunc_normal_(self.trunc_gen, std=0.02, generator=gen)
            self.tall = nn.Parameter(torch.empty(6, 3))
            nn.init.orthogonal_(self.tall, gain=2.0)
            self.wide = nn.Parameter(torch.empty(3, 6))
            nn.init.orthogonal_(self.wide)
            self.cube = nn.Parameter(torch.empty(4, 2, 3))
            nn.init.orthogonal_(self.cube, generator=gen)
            self.sparse = nn.Parameter(torch.empty(6, 4))
            nn.init.sparse_(self.sparse, sparsity=0.3, std=0.5)
            self.conv = nn.Conv2d(4, 4, 3, groups=2)
            nn.init.dirac_(self.conv.weight, groups=2)
            with torch.no_grad():
                nn.init.trunc_normal_(self.conv.bias)
            self.after = nn.Linear(3, 3)

    return Inits()


def _applied(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.orthogonal_(module.weight)
        nn.init.trunc_normal_(module.bias, std=0.1)
    elif isinstance(module, nn.Conv1d):
        nn.init.dirac_(module.weight)


def _applied_inits() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 6), nn.Conv1d(3, 3, 3), nn.Linear(6, 2))
    model.apply(_applied)
    return model


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("build", [_torch_inits, _applied_inits], ids=["direct", "apply"])
def test_torch_inits_that_return_early_on_meta_are_exact(build, include_buffers):
    assert_eager_equal(build, include_buffers)


class PlacesBesideItsWeight(nn.Module):
    """Reads a meta tensor's device and dtype to make new tensors beside it: no branch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        w = self.lin.weight
        self.register_buffer("eye", torch.eye(4, device=w.device, dtype=w.dtype))
        self.scale = nn.Parameter(torch.ones(4, device=w.device) * w.shape[0])
        self.register_buffer("noise", torch.randn(4, device=w.device))
        self.after = nn.Linear(4, 4)


@pytest.mark.parametrize("include_buffers", MODES)
def test_reading_a_meta_tensors_device_to_place_new_tensors_is_exact(include_buffers):
    assert_eager_equal(PlacesBesideItsWeight, include_buffers)


# -- where a tensor lives, read otherwise than through .is_meta ------------------------------


class TiesIfSameMemory(nn.Module):
    """Ties two weights if ``address`` says they share memory (every meta address is 0)."""

    def __init__(self, address) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        if address(self.head.weight) == address(self.embed.weight):
            self.head.weight = self.embed.weight


ADDRESSES = {
    "data_ptr()": lambda t: t.data_ptr(),
    "untyped_storage().data_ptr()": lambda t: t.untyped_storage().data_ptr(),
    "storage().data_ptr()": lambda t: t.storage().data_ptr(),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("address", sorted(ADDRESSES))
def test_a_memory_address_read_on_meta_refuses_naming_the_read(address, include_buffers):
    model = build_empty(lambda: TiesIfSameMemory(ADDRESSES[address]), include_buffers)
    assert_refused(model, "embed.weight", "head.weight", because=r"read the memory address")


def test_a_memory_address_read_of_a_real_tensor_in_the_build_is_exact():
    class Real(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            table = torch.zeros(4)
            self.register_buffer("ptr_seen", torch.tensor(table.data_ptr() != 0))

    assert_eager_equal(Real)


class CpuOnlyInit(nn.Module):
    """An init taken only when ``on_cpu(weight)`` says the weight is on the CPU."""

    def __init__(self, on_cpu) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        if on_cpu(self.fc.weight):
            with torch.no_grad():
                self.fc.weight.mul_(2.0)


_CPU = torch.device("cpu")
CPU_CHECKS = {
    "is_cpu": (lambda t: t.is_cpu, r"read \.is_cpu"),
    "device.type == 'cpu'": (lambda t: t.device.type == "cpu", r"\.device.*compared"),
    "device.type in ('cpu', 'mps')": (lambda t: t.device.type in ("cpu", "mps"), "compared"),
    "'cpu' == device.type": (lambda t: "cpu" == t.device.type, r"\.device.*compared"),  # noqa: SIM300
    "device == torch.device('cpu')": (lambda t: t.device == torch.device("cpu"), "compared"),
    "device == a local cpu device": (lambda t: t.device == _CPU, r"\.device.*compared"),
    "device.type != 'cuda' and != 'meta'": (
        lambda t: t.device.type not in ("cuda", "meta", "mps"),
        r"\.device.*compared",
    ),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("check", sorted(CPU_CHECKS))
def test_a_branch_on_being_on_the_cpu_refuses_naming_the_read(check, include_buffers):
    on_cpu, because = CPU_CHECKS[check]
    model = build_empty(lambda: CpuOnlyInit(on_cpu), include_buffers)
    assert_refused(model, "fc.weight", because=because)


class AskedSameOnMetaAndCpu(nn.Module):
    """Placement questions whose answer is the same on meta as on the CPU: no branch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.other = nn.Linear(3, 3)
        w = self.fc.weight
        with torch.no_grad():
            if w.is_cuda or w.device.type == "cuda" or w.device.index is not None:
                w.mul_(2.0)
            if w.device != self.other.weight.device:
                w.mul_(3.0)
        self.register_buffer("cache", torch.arange(4, device=w.device, dtype=w.dtype))
        self.register_buffer("ones", torch.ones(2, 2).to(w.device))


@pytest.mark.parametrize("include_buffers", MODES)
def test_placement_reads_that_answer_the_same_on_the_cpu_are_exact(include_buffers):
    assert_eager_equal(AskedSameOnMetaAndCpu, include_buffers)


_REAL_STATE = {"weight": torch.arange(9.0).reshape(3, 3), "bias": torch.ones(3)}


class LoadsAStateDict(nn.Module):
    """A layer given a real state dict inside the build (``Module._load_from_state_dict``
    reads each meta parameter's ``.is_meta`` to warn that copying into it does nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.loaded = nn.Linear(3, 3)
        self.loaded.load_state_dict(_REAL_STATE)
        self.after = nn.Linear(3, 3)


@pytest.mark.filterwarnings("ignore:.*copying from a non-meta parameter")
@pytest.mark.parametrize("include_buffers", MODES)
def test_a_state_dict_loaded_inside_the_build_is_exact(include_buffers):
    assert_eager_equal(LoadsAStateDict, include_buffers)


def test_load_from_state_dict_reads_is_meta_only_to_warn():
    """The read metamode lets pass (``facts.reads_meta_only_to_warn``) decides a warning
    and nothing else, in the torch this runs on."""
    source = inspect.getsource(nn.Module._load_from_state_dict)
    flat = " ".join(source.split())
    assert flat.count("is_meta") == 2
    guard = flat.index("param.is_meta and not input_param.is_meta")
    assert flat[guard:].startswith(
        "param.is_meta and not input_param.is_meta and not assign_to_params_buffers ): "
        "warnings.warn("
    )


class _RegisteredBranch(nn.Module):
    """A library layer that skips its init on meta, as a registered branch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.reset()

    def reset(self) -> None:
        if self.weight.is_meta:
            return
        nn.init.normal_(self.weight)


class _HarmlessBranch(_RegisteredBranch):
    """The same read, where what it skips on meta changes nothing eager computes."""

    def reset(self) -> None:
        nn.init.normal_(self.weight)
        if self.weight.is_meta:
            return
        self.weight.data = self.weight.data.to("cpu")  # a no-op move


_WHY = "skips its init on meta, a registered branch"


@pytest.fixture
def registered_branches():
    from metamode._core import facts

    kept = list(facts._META_BRANCHES)

    def codes() -> list:
        return [_RegisteredBranch.reset.__code__, _HarmlessBranch.reset.__code__]

    def where(frame) -> bool:
        return type(frame.f_locals["self"]) is _RegisteredBranch

    facts.register_meta_branch(codes, _WHY, where)
    try:
        yield
    finally:
        facts._META_BRANCHES[:] = kept
        facts._KNOWN_FOR[0] = -1


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_registered_branch_refuses_with_its_reason_where_its_condition_holds(
    registered_branches, include_buffers
):
    model = build_empty(_RegisteredBranch, include_buffers)
    assert_refused(model, "weight", because=_WHY)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_registered_branch_builds_as_eager_where_its_condition_does_not(
    registered_branches, include_buffers
):
    assert_eager_equal(_HarmlessBranch, include_buffers)


@pytest.mark.parametrize("include_buffers", MODES)
def test_an_unregistered_read_of_the_same_branch_refuses_naming_the_read(include_buffers):
    model = build_empty(_HarmlessBranch, include_buffers)
    assert_refused(model, "weight", because=r"_HarmlessBranch.reset read \.is_meta")
