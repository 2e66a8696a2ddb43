"""The two outcomes a sound ``metamode.materialize`` allows, as assertions.

*Exact*: every tensor gets what eager construction under the same seed gives it, bitwise
(values, dtype, class, device, ``requires_grad``, layout, conjugate and negative bits,
strides, ties by object and by storage), and the default generator is left as it was.
*Refused before anything changed*:
``NotMaterializableError`` names each refused tensor and why, while every tensor is still the
same object on the same device with the same data and the default generator is untouched.
Either way ``is_materializable`` says so first. Public API only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.utils.deterministic
from torch import nn

import metamode
from metamode._contexts.materialize import unreproducible

MODES = [False, True]


def tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by qualified name, tied ones under each of their names."""
    found = dict(module.named_parameters(remove_duplicate=False))
    found.update(module.named_buffers(remove_duplicate=False))
    return found


def _groups(found: dict[str, torch.Tensor], key: Callable[[torch.Tensor], object]) -> list:
    groups: dict[object, list[str]] = {}
    for name, tensor in found.items():
        groups.setdefault(key(tensor), []).append(name)
    return sorted(sorted(group) for group in groups.values() if len(group) > 1)


def ties(module: nn.Module) -> list[list[str]]:
    """Names that are one tensor object."""
    return _groups(tensors(module), id)


def shared_storage(module: nn.Module) -> list[list[str]]:
    """Names of real, non-empty tensors that live in one storage (views, ``.data`` aliases)."""
    real = {n: t for n, t in tensors(module).items() if not t.is_meta and t.numel() > 0}
    return _groups(real, lambda t: t.untyped_storage().data_ptr())


def build_eagerly(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def build_empty(
    build: Callable[[], nn.Module], include_buffers: bool = False, seed: int = 0
) -> nn.Module:
    torch.manual_seed(seed)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        return build()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as bytes where it has floats: ``torch.equal`` on floats calls
    0.0 and -0.0 equal, and subnormals equal to 0 while the thread flushes denormals."""
    tensor = tensor.detach()
    if tensor.layout is not torch.strided or not (
        tensor.dtype.is_floating_point or tensor.dtype.is_complex
    ):
        return tensor
    return tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensors(
    model: nn.Module, ref: nn.Module, names: list[str] | None = None, strides: bool = True
) -> None:
    """``model``'s tensors are ``ref``'s, bitwise, with the same ties (all names, or ``names``)."""
    got, want = tensors(model), tensors(ref)
    assert got.keys() == want.keys()
    problems = []
    for name in want if names is None else names:
        actual, expected = got[name], want[name]
        if actual.is_meta:
            problems.append(f"{name} is still on meta")
            continue
        checks = {
            "class": type(actual) is type(expected),
            f"dtype {actual.dtype} != {expected.dtype}": actual.dtype == expected.dtype,
            "device": actual.device == expected.device,
            "shape": actual.shape == expected.shape,
            "requires_grad": actual.requires_grad == expected.requires_grad,
            "inference tensor": actual.is_inference() == expected.is_inference(),
            "layout": actual.layout == expected.layout,
            "conjugate or negative bit": (actual.is_conj(), actual.is_neg())
            == (expected.is_conj(), expected.is_neg()),
        }
        if checks["shape"] and checks[f"dtype {actual.dtype} != {expected.dtype}"]:
            checks["values differ from eager"] = torch.equal(_bits(actual), _bits(expected))
        if strides:
            checks[f"strides {actual.stride()} != {expected.stride()}"] = (
                actual.stride() == expected.stride()
            )
        problems += [f"{name}: {what}" for what, ok in checks.items() if not ok]
    assert not problems, "; ".join(problems)
    assert ties(model) == ties(ref), f"ties {ties(model)} != eager {ties(ref)}"
    if names is None:
        assert shared_storage(model) == shared_storage(ref), "storage sharing differs from eager"


def materialize_exactly(
    model: nn.Module,
    ref: nn.Module | None = None,
    *,
    replaced: tuple[str, ...] = (),
    strides: bool = True,
    **kwargs,
) -> nn.Module:
    """``is_materializable`` says yes, ``materialize`` keeps every parameter object (but those
    in ``replaced``: an autograd graph or a view holds them) and the default generator, and
    (given ``ref``) every tensor equals ``ref``'s (strides too, unless ``strides=False``)."""
    assert metamode.is_materializable(model), (
        f"is_materializable refuses an exact build: {unreproducible(model)}"
    )
    for name, tensor in tensors(model).items():
        if tensor.is_meta:
            assert metamode.is_materializable(tensor), f"is_materializable({name}) says no"
    params = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    modules = [id(m) for m in model.modules()]
    state = torch.default_generator.get_state()
    assert metamode.materialize(model, **kwargs) is model
    generator = (
        ""
        if torch.equal(torch.default_generator.get_state(), state)
        else ("materialize changed the default generator")
    )
    if ref is not None:
        try:
            assert_same_tensors(model, ref, strides=strides)
        except AssertionError as error:
            raise AssertionError(f"{error}; {generator}" if generator else error) from None
    assert not generator, generator
    after = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    assert {n: i for n, i in after.items() if n not in replaced} == {
        n: i for n, i in params.items() if n not in replaced
    }
    assert [id(m) for m in model.modules()] == modules
    return model


def assert_eager_equal(
    build: Callable[[], nn.Module], include_buffers: bool = False, seed: int = 0
) -> nn.Module:
    """Seed, build eagerly; seed, build replayable, materialize: equal, bitwise."""
    ref = build_eagerly(build, seed)
    model = build_empty(build, include_buffers, seed)
    assert any(t.is_meta for t in tensors(model).values()), "nothing was built on meta"
    return materialize_exactly(model, ref)


class Unchanged:
    """What a refusal must leave as it was: every slot's tensor object, its device, a real
    tensor's data, and the default generator's state."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.slots = self._slots(module)
        self.data = {
            key: tensor.detach().clone() for key, tensor in self.slots.items() if not tensor.is_meta
        }
        self.devices = {key: tensor.device for key, tensor in self.slots.items()}
        self.state = torch.default_generator.get_state()

    @staticmethod
    def _slots(module: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
        slots = {}
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for table in (sub._parameters, sub._buffers):
                for name, tensor in table.items():
                    if tensor is not None:
                        slots[(prefix, name)] = tensor
        return slots

    def check(self) -> None:
        now = self._slots(self.module)
        assert now.keys() == self.slots.keys()
        for key, tensor in self.slots.items():
            where = ".".join(filter(None, key))
            assert now[key] is tensor, f"{where} was replaced"
            assert tensor.device == self.devices[key], f"{where} moved to {tensor.device}"
            if key in self.data:
                same = torch.equal(_bits(tensor), _bits(self.data[key]))  # NaN garbage too
                assert same, f"{where}: real data changed"
        assert torch.equal(torch.default_generator.get_state(), self.state), (
            "a refused materialize changed the default generator"
        )


def named(message: str, name: str) -> bool:
    """``name`` (a qualified tensor name) appears in ``message`` as a whole name."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w.])", message) is not None


def assert_refused(model: nn.Module, *names: str, because: str | None = None, **kwargs) -> str:
    """``is_materializable`` says no and ``materialize`` raises ``NotMaterializableError``
    naming each of ``names`` (and matching ``because``), having changed nothing."""
    before = Unchanged(model)
    assert not metamode.is_materializable(model), "is_materializable accepts a refused build"
    found = tensors(model)
    for name in names:
        assert not metamode.is_materializable(found[name]), f"is_materializable({name}) says yes"
    with pytest.raises(metamode.NotMaterializableError) as refusal:
        metamode.materialize(model, **kwargs)
    before.check()
    message = str(refusal.value)
    for name in names:
        assert named(message, name), f"the refusal does not name {name!r}:\n{message}"
    if because is not None:
        assert re.search(because, message, re.IGNORECASE), (
            f"the refusal does not say {because!r}:\n{message}"
        )
    return message


def assert_exact_or_refused(
    model: nn.Module, ref: nn.Module, *names: str, because: str | None = None
) -> str:
    """Whichever ``is_materializable`` announces, and nothing in between: exact against
    ``ref``, or refused upfront naming ``names``. Returns ``"exact"`` or ``"refused"``."""
    if metamode.is_materializable(model):
        materialize_exactly(model, ref)
        return "exact"
    assert_refused(model, *names, because=because)
    return "refused"


# -- idioms: constructor bodies, each with what the promise allows in each mode ----------

EXACT = "exact"
REFUSED = "refused"
EITHER = "either"  # exact, or refused upfront for the reason ``because`` names


class Outcome:
    """What the promise allows for one idiom in one mode, and (``broken``) what happens
    instead today; a broken one runs as a strict xfail."""

    def __init__(self, kind: str, because: str | None = None, broken: str | None = None) -> None:
        self.kind, self.because, self.broken = kind, because, broken


def broken(what: str, because: str | None = None) -> Outcome:
    """An idiom that breaks the promise today: ``what`` happens (exact is what is allowed,
    or, given ``because``, a refusal for that reason)."""
    return Outcome(EITHER if because else EXACT, because, what)


class Built(nn.Module):
    """A module whose constructor is ``init(self)``."""

    def __init__(self, init: Callable[[nn.Module], None]) -> None:
        super().__init__()
        init(self)


def idiom_cases(
    idioms: dict[str, Callable[[nn.Module], None]], outcomes: dict[str, dict[bool, Outcome]]
) -> list:
    """``(idiom, include_buffers, outcome)`` for each idiom in both modes; an idiom not in
    ``outcomes`` is exact."""
    cases = []
    for name in idioms:
        for mode in MODES:
            outcome = outcomes.get(name, {}).get(mode, Outcome(EXACT))
            marks = (
                [pytest.mark.xfail(strict=True, reason=outcome.broken)] if outcome.broken else []
            )
            cases.append(pytest.param(name, mode, outcome, marks=marks, id=f"{name}-{mode}"))
    return cases


def mode_cases(table: dict[str, object], broken: dict[str, str]) -> list:
    """``(name, include_buffers)`` for each entry of ``table`` in both modes; one named in
    ``broken`` runs as a strict xfail (an ``AssertionError``) saying what happens."""
    cases = []
    for name in sorted(table):
        marks = []
        if name in broken:
            marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=broken[name])]
        cases.extend(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}") for mode in MODES)
    return cases


def check_idiom(init: Callable[[nn.Module], None], include_buffers: bool, outcome: Outcome) -> None:
    """Built eagerly and in a replayable context under one seed, ``Built(init)`` is what
    ``outcome`` allows: exact, refused upfront for its reason, or either."""
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    if outcome.kind == EXACT:
        materialize_exactly(model, ref)
    elif outcome.kind == REFUSED:
        assert_refused(model, because=outcome.because)
    elif metamode.is_materializable(model):
        materialize_exactly(model, ref)
    else:
        assert_refused(model, because=outcome.because)


def load_probe(path: Path, **names: object) -> Callable[[nn.Module], object]:
    """The ``probe`` function of the source file at ``path`` (written by the test, so that
    it has a file the interpreter and ``linecache`` read), run with ``names`` in its
    module's globals."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    vars(module).update(names)
    spec.loader.exec_module(module)
    return module.probe


def warm_pickling() -> None:
    """Pickling caches ``__slotnames__`` on each class it pickles the first time: called
    where a test module is imported, before the global-state guard's snapshot."""
    import copyreg

    for kind in (torch.Tensor, nn.Parameter, nn.Linear):
        copyreg._slotnames(kind)  # type: ignore[attr-defined]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.set_default_dtype(dtype)`` for the block, restored after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def deterministic(
    algorithms: bool = True, fill: bool = True, warn_only: bool = False
) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(algorithms, warn_only=...)`` and
    ``fill_uninitialized_memory = fill`` inside; both as they were after."""
    flags = torch.utils.deterministic  # type: ignore[attr-defined]
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        flags.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
    flags.fill_uninitialized_memory = fill
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        flags.fill_uninitialized_memory = saved[2]


@contextlib.contextmanager
def flushing(on: bool = True) -> Iterator[None]:
    """This thread flushes subnormal floats to zero (``on``) inside; off after, whatever
    happens."""
    assert torch.set_flush_denormal(on) or not on, "this CPU cannot flush denormals"
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
