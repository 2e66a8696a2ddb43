"""A break-it pass on ``Tensor.to`` towards meta of tensors the context put on meta, with
the moves real code makes: accelerate's ``init_on_device`` and ``set_module_tensor_to_device``,
PEFT's move of an adapter to its base layer's device, transformers' and diffusers'
``.to(model.device)``, ``Module.to`` / ``_apply`` / ``to_empty``, swapping conversions,
``nn.Parameter(p.to(...))``, ``p.data = ...``, memory formats, dtype-only moves, moves by
another tensor, views, ``.data`` and ``.detach()``, copies and ties.

Eager construction has such a tensor on the CPU: its ``.to("meta")`` is a new meta tensor into
which a draw draws nothing, and its ``.to(cpu device)`` is the tensor itself. Each case is
built eagerly and in ``empty_weights(replayable=True)`` (params-only and
``include_buffers=True``) under one seed, and must be exact against eager (generator state
included), or refused upfront for the reason that names the cause; where eager itself leaves
a tensor on meta, the others must be exact and that one must be real, holding (where the
case knows it) what it was moved from. A case that breaks the promise today (silently
wrong, an exact idiom refused, a crash) is a strict xfail saying what happens.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metamode
from metamode._contexts.materialize import unreproducible
from tests.unit.contexts.materialize_checks import (
    MODES,
    Built,
    _bits,
    assert_refused,
    assert_same_tensors,
    build_eagerly,
    build_empty,
    materialize_exactly,
    tensors,
    warm_pickling,
)

warm_pickling()

pytestmark = pytest.mark.filterwarnings("ignore")

_ASKED = "the build asked for itself"
_META = torch.device("meta")

with torch.device("meta"):  # made on meta outside every recording, as a library's template
    _OUTSIDE_META = torch.empty(1)


def _xfail(reason: str, raises: type[BaseException] = AssertionError) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, raises=raises, reason=reason)


Broken = dict[bool, pytest.MarkDecorator]


def _both(mark: pytest.MarkDecorator) -> Broken:
    return dict.fromkeys(MODES, mark)


def _cases(table: dict, broken: dict[str, Broken]) -> list:
    """``(name, include_buffers)`` for each entry in both modes; one ``broken`` in a mode is
    a strict xfail there."""
    return [
        pytest.param(
            name,
            mode,
            marks=[broken[name][mode]] if mode in broken.get(name, {}) else [],
            id=f"{name}-{mode}",
        )
        for name in table
        for mode in MODES
    ]


def _lin(m: nn.Module) -> None:
    m.lin = nn.Linear(3, 3)


def _base(m: nn.Module) -> None:
    """A placed layer ``a`` and a buffer ``b`` (real with params-only, placed with
    ``include_buffers=True``)."""
    m.a = nn.Linear(3, 3)
    m.register_buffer("b", torch.randn(3))


@contextlib.contextmanager
def _swapping() -> Iterator[None]:
    """``Module._apply`` swaps each parameter with ``torch.utils.swap_tensors`` inside."""
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def _no_grad(move: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return move()


def _module_to_meta(m: nn.Module) -> torch.Tensor:
    m.a.to("meta")
    return m.a.weight


def _by_the_device_of_a_module_moved_to_meta(m: nn.Module) -> torch.Tensor:
    m.a.to("meta")
    device = m.a.weight.device  # eager: meta, the moved module's
    m.c = nn.Linear(3, 3)
    return m.c.weight.to(device)


def _built_under_a_cpu_device_context(m: nn.Module) -> torch.Tensor:
    with torch.device("cpu"):
        m.c = nn.Linear(3, 3)
    return m.c.weight.to("meta")


def _module_apply_meta(m: nn.Module) -> torch.Tensor:
    m.a._apply(lambda t: t.to("meta"))
    return m.a.weight


def _module_to_meta_swapping(m: nn.Module) -> torch.Tensor:
    with _swapping():
        m.a.to("meta")
    return m.a.weight


# == 1. a draw into a placed tensor moved to meta: eager draws nothing, the rest is refused ==

MOVED_TO_META: dict[str, Callable[[nn.Module], torch.Tensor]] = {
    "torch.Tensor.to(w, 'meta')": lambda m: torch.Tensor.to(m.a.weight, "meta"),
    "torch.Tensor.to(w, device='meta')": lambda m: torch.Tensor.to(m.a.weight, device="meta"),
    "w.to(torch.device('meta', 0))": lambda m: m.a.weight.to(torch.device("meta", 0)),
    "w.to('meta:0')": lambda m: m.a.weight.to("meta:0"),
    "w[0].to('meta') (a view)": lambda m: m.a.weight[0].to("meta"),
    "w.t().to('meta')": lambda m: m.a.weight.t().to("meta"),
    "w.view(-1).to('meta')": lambda m: m.a.weight.view(-1).to("meta"),
    "w.data.to('meta')": lambda m: m.a.weight.data.to("meta"),
    "w.detach().to('meta')": lambda m: m.a.weight.detach().to("meta"),
    "buffer.to('meta')": lambda m: m.b.to("meta"),
    "w.to('meta', memory_format=preserve_format)": lambda m: m.a.weight.to(
        "meta", memory_format=torch.preserve_format
    ),
    "w.to('meta', None, False, False)": lambda m: m.a.weight.to("meta", None, False, False),
    "w.to(meta tensor, False, False)": lambda m: m.a.weight.to(
        torch.empty(1, device="meta"), False, False
    ),
    "w.to('meta', float32, True) (non_blocking only)": lambda m: m.a.weight.to(
        "meta", torch.float32, True
    ),
    "w.to('meta', copy=True)": lambda m: m.a.weight.to("meta", copy=True),
    "w.to(w.device.type) (documented: a string)": lambda m: m.a.weight.to(m.a.weight.device.type),
    "w.to(a placed tensor moved to meta)": lambda m: m.a.weight.to(torch.empty(1).to("meta")),
    "w.to('meta').to('meta')": lambda m: m.a.weight.to("meta").to("meta"),
    "w.to(meta tensor made outside the recording)": lambda m: m.a.weight.to(_OUTSIDE_META),
    "w.to('meta') under no_grad": lambda m: _no_grad(lambda: m.a.weight.to("meta")),
    "copy.deepcopy(w).to('meta')": lambda m: copy.deepcopy(m.a.weight).to("meta"),
    "copy.deepcopy(w.to('meta')) under no_grad": lambda m: _no_grad(
        lambda: copy.deepcopy(m.a.weight.to("meta"))
    ),
    "empty_like(w.to('meta'))": lambda m: torch.empty_like(m.a.weight.to("meta")),
    "Module.to('meta'), then its weight": _module_to_meta,
    "Module._apply(t.to('meta')), then its weight": _module_apply_meta,
    "Module.to('meta') swapping parameters, then its weight": _module_to_meta_swapping,
    "w2.to(the .device of a module moved to meta)": _by_the_device_of_a_module_moved_to_meta,
    "a layer built under torch.device('cpu'), w.to('meta')": _built_under_a_cpu_device_context,
}


@pytest.mark.parametrize(("idiom", "include_buffers"), _cases(MOVED_TO_META, {}))
def test_a_draw_into_a_placed_tensor_moved_to_meta_refuses_the_draws_after_it(
    idiom, include_buffers
):
    def init(m: nn.Module) -> None:
        _base(m)
        nn.init.normal_(MOVED_TO_META[idiom](m))  # eager: a meta copy, drawing nothing
        _lin(m)

    ref = build_eagerly(lambda: Built(init))
    assert not any(t.is_meta for t in (ref.lin.weight, ref.lin.bias))
    model = build_empty(lambda: Built(init), include_buffers)
    assert_refused(model, "lin.weight", "lin.bias", because=_ASKED)


def _kaiming(t: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(t)


def _randn_out(t: torch.Tensor) -> None:
    torch.randn(t.shape, out=t)


def _dropout(t: torch.Tensor) -> None:
    F.dropout(t, 0.5, training=True)


DRAWS: dict[str, Callable[[torch.Tensor], object]] = {
    "moved.normal_()": lambda t: t.normal_(),
    "moved.uniform_()": lambda t: t.uniform_(),
    "moved.random_()": lambda t: t.random_(0, 5),
    "moved.exponential_()": lambda t: t.exponential_(),
    "kaiming_uniform_(moved)": _kaiming,
    "trunc_normal_(moved) (returns early on meta)": lambda t: nn.init.trunc_normal_(t),
    "orthogonal_(moved)": lambda t: nn.init.orthogonal_(t),
    "randn(out=moved)": _randn_out,
    "rand_like(moved)": torch.rand_like,
    "bernoulli(moved, 0.5)": lambda t: torch.bernoulli(t, 0.5),
    "F.dropout(moved, training=True)": _dropout,
}


@pytest.mark.parametrize(("draw", "include_buffers"), _cases(DRAWS, {}))
def test_each_kind_of_draw_into_a_moved_weight_refuses_the_draws_after_it(draw, include_buffers):
    def init(m: nn.Module) -> None:
        _base(m)
        with torch.no_grad():
            DRAWS[draw](m.a.weight.to("meta"))
        _lin(m)

    model = build_empty(lambda: Built(init), include_buffers)
    assert_refused(model, "lin.weight", "lin.bias", because=_ASKED)


def _explicit_generator(draw_again: bool) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        generator = torch.Generator().manual_seed(1)
        _base(m)
        nn.init.normal_(m.a.weight.to("meta"), generator=generator)
        _lin(m)  # the default generator: untouched by the draw into meta
        if draw_again:
            m.p = nn.Parameter(torch.randn(3, generator=generator))

    return init


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_draw_into_a_moved_weight_from_a_generator_of_its_own_leaves_the_default_exact(
    include_buffers,
):
    init = _explicit_generator(draw_again=False)
    materialize_exactly(
        build_empty(lambda: Built(init), include_buffers), build_eagerly(lambda: Built(init))
    )


@pytest.mark.parametrize("include_buffers", MODES)
def test_the_next_draw_from_that_generator_is_refused(include_buffers):
    init = _explicit_generator(draw_again=True)
    model = build_empty(lambda: Built(init), include_buffers)
    assert_refused(model, "p", because=_ASKED)
    assert metamode.is_materializable(model.lin)


# == 2. moves eager answers with the tensor itself, or a real copy: exact, draws included ===


def _placed_device(m: nn.Module) -> torch.device:
    return m.a.weight.device


def _layer_to(m: nn.Module, *args, **kwargs) -> nn.Linear:
    m.c = nn.Linear(3, 3).to(*args, **kwargs)
    return m.c


def _draw(tensor: torch.Tensor) -> None:
    nn.init.normal_(tensor)


def _module_to_placed_device_then_reset(m: nn.Module) -> None:
    _layer_to(m, _placed_device(m)).reset_parameters()


def _module_to_placed_device_by_keyword(m: nn.Module) -> None:
    _draw(_layer_to(m, device=_placed_device(m)).weight)


def _module_to_a_placed_tensor_then_reset(m: nn.Module) -> None:
    _layer_to(m, m.a.weight).reset_parameters()


def _diffusers_device_property(m: nn.Module) -> None:
    """diffusers ``ModelMixin.device`` (``get_parameter_device``: the first parameter's)."""
    device = next(m.parameters()).device
    m.c = nn.Linear(3, 3).to(device)
    nn.init.xavier_uniform_(m.c.weight)


def _module_to_placed_device_swapping(m: nn.Module) -> None:
    with _swapping():
        m.c = nn.Linear(3, 3)
        m.c.to(_placed_device(m))
    m.c.reset_parameters()


def _accelerate_init_on_placed_device(m: nn.Module) -> None:
    import accelerate

    with accelerate.init_on_device(_placed_device(m)):
        m.c = nn.Linear(3, 3)
    _draw(m.c.weight)


def _parameter_of_a_real_copy(m: nn.Module) -> None:
    m.p = nn.Parameter(m.a.weight.to(torch.float64))
    _draw(m.p)


def _data_set_to_a_real_copy(m: nn.Module) -> None:
    m.a.weight.data = m.a.weight.data.to(torch.float64)
    _draw(m.a.weight)


def _conv_channels_last_parameter(m: nn.Module) -> None:
    m.conv = nn.Conv2d(3, 4, 3)
    m.conv.weight = nn.Parameter(m.conv.weight.to(memory_format=torch.channels_last))
    _draw(m.conv.weight)


def _module_channels_last_then_reset(m: nn.Module) -> None:
    m.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    m.conv.reset_parameters()


def _module_double_then_reset(m: nn.Module) -> None:
    m.c = nn.Linear(3, 3).double()
    m.c.reset_parameters()


def _empty_to_placed_device_parameter(m: nn.Module) -> None:
    m.p = nn.Parameter(torch.empty(3, 3).to(_placed_device(m)))
    _draw(m.p)


def _moved_by(move: Callable[[nn.Module], torch.Tensor]) -> Callable[[nn.Module], None]:
    return lambda m: _draw(move(m))


MOVED_ELSEWHERE: dict[str, Callable[[nn.Module], None]] = {
    "w.to(device=w.device)": _moved_by(lambda m: m.a.weight.to(device=_placed_device(m))),
    "w.to(dtype=float32)": _moved_by(lambda m: m.a.weight.to(dtype=torch.float32)),
    "w.to(float32)": _moved_by(lambda m: m.a.weight.to(torch.float32)),
    "w.to(float64) (a real copy)": _moved_by(lambda m: m.a.weight.to(torch.float64)),
    "w.to(memory_format=contiguous_format)": _moved_by(
        lambda m: m.a.weight.to(memory_format=torch.contiguous_format)
    ),
    "w.to(bias) (another placed tensor)": _moved_by(lambda m: m.a.weight.to(m.a.bias)),
    "w.to(w)": _moved_by(lambda m: m.a.weight.to(m.a.weight)),
    "w.to(buffer)": _moved_by(lambda m: m.a.weight.to(m.b)),
    "w.to(buffer.device)": _moved_by(lambda m: m.a.weight.to(m.b.device)),
    "w.to(torch.empty(0).device)": _moved_by(lambda m: m.a.weight.to(torch.empty(0).device)),
    "w.to(device=w.device, dtype=float64)": _moved_by(
        lambda m: m.a.weight.to(device=_placed_device(m), dtype=torch.float64)
    ),
    "w.type(float64)": _moved_by(lambda m: m.a.weight.type(torch.float64)),
    "w.to(torch.device(w.device))": _moved_by(
        lambda m: m.a.weight.to(torch.device(_placed_device(m)))
    ),
    "w.to('cpu')": _moved_by(lambda m: m.a.weight.to("cpu")),
    "w.cpu()": _moved_by(lambda m: m.a.weight.cpu()),
    "w.to(torch.get_default_device())": _moved_by(
        lambda m: m.a.weight.to(torch.get_default_device())
    ),
    "w.type(torch.FloatTensor)": _moved_by(lambda m: m.a.weight.type(torch.FloatTensor)),
    "nn.Parameter(w.to(float64)), normal_": _parameter_of_a_real_copy,
    "w.data = w.data.to(float64), normal_": _data_set_to_a_real_copy,
    "nn.Parameter(conv.weight.to(channels_last)), normal_": _conv_channels_last_parameter,
    "Conv2d.to(memory_format=channels_last), reset_parameters": _module_channels_last_then_reset,
    "Linear.double(), reset_parameters": _module_double_then_reset,
    "nn.Parameter(empty().to(w.device)), normal_": _empty_to_placed_device_parameter,
    "accelerate init_on_device(w.device), normal_": _accelerate_init_on_placed_device,
    "Linear.to(w.device), reset_parameters": _module_to_placed_device_then_reset,
    "Linear.to(device=w.device), normal_": _module_to_placed_device_by_keyword,
    "Linear.to(w), reset_parameters": _module_to_a_placed_tensor_then_reset,
    "diffusers Linear.to(next(parameters()).device), xavier_uniform_": _diffusers_device_property,
    "Linear.to(w.device) swapping parameters, reset_parameters": _module_to_placed_device_swapping,
}

_CRASH = (
    "crash (documented: a plain meta build raises the same): eager's .to of its CPU tensor "
    "to the CPU is the tensor, the build's moves the placed meta tensor to the CPU and "
    "raises 'Cannot copy out of meta tensor'"
)
_CRASH_PARAMS_ONLY = (
    "crash (documented: a plain meta build raises the same): with params-only the buffer "
    "and torch.empty(0) are real CPU tensors, so the move of the placed weight by one goes "
    "to the CPU and raises 'Cannot copy out of meta tensor'"
)
MOVED_ELSEWHERE_BROKEN: dict[str, Broken] = {
    "w.to(buffer)": {False: _xfail(_CRASH_PARAMS_ONLY, NotImplementedError)},
    "w.to(buffer.device)": {False: _xfail(_CRASH_PARAMS_ONLY, NotImplementedError)},
    "w.to(torch.empty(0).device)": {False: _xfail(_CRASH_PARAMS_ONLY, NotImplementedError)},
    "w.to('cpu')": _both(_xfail(_CRASH, NotImplementedError)),
    "w.cpu()": _both(_xfail(_CRASH, NotImplementedError)),
    "w.to(torch.get_default_device())": _both(_xfail(_CRASH, NotImplementedError)),
    "w.type(torch.FloatTensor)": _both(_xfail(_CRASH, NotImplementedError)),
}


@pytest.mark.parametrize(
    ("idiom", "include_buffers"), _cases(MOVED_ELSEWHERE, MOVED_ELSEWHERE_BROKEN)
)
def test_a_move_eager_answers_on_the_cpu_keeps_the_draws_into_it_exact(idiom, include_buffers):
    def init(m: nn.Module) -> None:
        _base(m)
        MOVED_ELSEWHERE[idiom](m)
        _lin(m)

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    materialize_exactly(model, ref)


# == 3. the tensor moved, and the one it was moved from, are eager's ========================


def _looks(source: torch.Tensor, moved: torch.Tensor) -> tuple:
    """What the build may read of a move's result (the device aside: placed ones differ)."""
    return (
        moved is source,
        moved._base is source,
        type(moved).__name__,
        moved.dtype,
        tuple(moved.shape),
        moved.stride(),
        moved.requires_grad,
        moved.is_leaf,
        type(moved.grad_fn).__name__,
    )


LOOKS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "w.to('meta')": lambda w: w.to("meta"),
    "w.to(meta tensor made outside the recording)": lambda w: w.to(_OUTSIDE_META),
    "w.to('meta', float64)": lambda w: w.to("meta", torch.float64),
    "w.to('meta') under no_grad": lambda w: _no_grad(lambda: w.to("meta")),
    "w.data.to('meta')": lambda w: w.data.to("meta"),
    "w.t().to('meta')": lambda w: w.t().to("meta"),
    "w.t().to('meta', memory_format=contiguous_format)": lambda w: w.t().to(
        "meta", memory_format=torch.contiguous_format
    ),
    "w.to('meta', memory_format=preserve_format)": lambda w: w.to(
        "meta", memory_format=torch.preserve_format
    ),
    "w.to('meta', copy=True)": lambda w: w.to("meta", copy=True),
    "w.to(w.device)": lambda w: w.to(w.device),
    "w.to(float32)": lambda w: w.to(torch.float32),
}


@pytest.mark.parametrize(("move", "include_buffers"), _cases(LOOKS, {}))
def test_the_moved_tensor_looks_like_eagers_and_its_source_stays_exact(move, include_buffers):
    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 2)
        m.looks = _looks(m.a.weight, LOOKS[move](m.a.weight))
        _lin(m)

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    assert model.looks == ref.looks
    materialize_exactly(model, ref)


def _zero_the_moved(m: nn.Module) -> None:
    with torch.no_grad():
        m.a.weight.to("meta").zero_()


def _zero_the_moved_by_an_outside_target(m: nn.Module) -> None:
    with torch.no_grad():
        m.a.weight.to(_OUTSIDE_META).zero_()


def _fill_the_moved_bias(m: nn.Module) -> None:
    with torch.no_grad():
        m.a.bias.to("meta").fill_(1.0)


def _copy_into_the_moved_then_draw_into_the_source(m: nn.Module) -> None:
    moved = m.a.weight.to("meta")
    with torch.no_grad():
        moved.copy_(torch.randn(3, 3))  # eager: a real draw, copied into meta
    _draw(m.a.weight)


def _moved_then_tied(m: nn.Module) -> None:
    m.a.weight.to("meta")
    m.t = nn.Linear(3, 3, bias=False)
    m.t.weight = m.a.weight
    _draw(m.t.weight)


def _module_to_meta_then_to_empty(device: Callable[[nn.Module], object]):
    def init(m: nn.Module) -> None:
        m.c = nn.Linear(3, 3)
        m.c.to("meta")
        m.c.to_empty(device=device(m))
        m.c.reset_parameters()

    return init


def _reseeded(m: nn.Module) -> None:
    nn.init.normal_(m.a.weight.to("meta"))
    torch.manual_seed(1)  # the draws after it are known again


def _state_restored(m: nn.Module) -> None:
    state = torch.get_rng_state()
    nn.init.normal_(m.a.weight.to("meta"))
    torch.set_rng_state(state)


def _forked(m: nn.Module) -> None:
    with torch.random.fork_rng():
        nn.init.normal_(m.a.weight.to("meta"))


def _assigned_after_module_to_meta(m: nn.Module) -> None:
    m.z = nn.Linear(3, 3)
    state = m.z.state_dict()
    m.a.to("meta")
    m.a.load_state_dict(state, assign=True)


AFTER_A_MOVE: dict[str, Callable[[nn.Module], None]] = {
    "w.to('meta').zero_()": _zero_the_moved,
    "w.to(meta tensor made outside the recording).zero_()": _zero_the_moved_by_an_outside_target,
    "bias.to('meta').fill_(1)": _fill_the_moved_bias,
    "w.to('meta').copy_(randn), then normal_(w)": _copy_into_the_moved_then_draw_into_the_source,
    "w.to('meta') dropped, then w tied and drawn into": _moved_then_tied,
    "Module.to('meta'), to_empty(device='cpu'), reset_parameters": _module_to_meta_then_to_empty(
        lambda m: "cpu"
    ),
    "Module.to('meta'), to_empty(device=w.device), reset_parameters": (
        _module_to_meta_then_to_empty(_placed_device)
    ),
    "a draw into w.to('meta'), then torch.manual_seed": _reseeded,
    "a draw into w.to('meta'), then set_rng_state of the state before": _state_restored,
    "a draw into w.to('meta') inside torch.random.fork_rng": _forked,
    "Module.to('meta'), load_state_dict(a placed layer's, assign=True)": (
        _assigned_after_module_to_meta
    ),
}


@pytest.mark.parametrize(("idiom", "include_buffers"), _cases(AFTER_A_MOVE, {}))
def test_what_the_build_does_after_a_move_to_meta_stays_exact(idiom, include_buffers):
    def init(m: nn.Module) -> None:
        _base(m)
        AFTER_A_MOVE[idiom](m)
        _lin(m)

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    materialize_exactly(model, ref)


# == 4. moves whose result the module keeps: eager leaves it on meta ========================

Keep = Callable[[str, torch.Tensor], None]


def _materialized_beside_meta(model: nn.Module, ref: nn.Module, before: dict) -> None:
    """``materialize`` is accepted and keeps the default generator; what eager has on the
    CPU is eager's, bitwise, with eager's ties; what eager left on meta is real, with eager's
    class, dtype, shape and ``requires_grad``, and holds what it was moved from (``before``:
    eager's values at the move)."""
    assert metamode.is_materializable(model), unreproducible(model)
    state = torch.default_generator.get_state()
    assert metamode.materialize(model) is model
    assert torch.equal(torch.default_generator.get_state(), state)
    found, want = tensors(model), tensors(ref)
    left_on_meta = sorted(name for name, t in want.items() if t.is_meta)
    assert left_on_meta, "eager left nothing on meta: not a case for this check"
    assert_same_tensors(model, ref, names=[n for n in want if n not in left_on_meta])
    for name in left_on_meta:
        got, expected = found[name], want[name]
        assert not got.is_meta, f"{name} is still on meta"
        assert (type(got), got.dtype, got.shape, got.requires_grad) == (
            type(expected),
            expected.dtype,
            expected.shape,
            expected.requires_grad,
        ), name
        if name in before:
            assert torch.equal(_bits(got), _bits(before[name])), (
                f"{name}: not what it was moved from"
            )


def _kept_buffer(m: nn.Module, keep: Keep) -> None:
    keep("b2", m.a.weight)
    m.register_buffer("b2", m.a.weight.to("meta"))


def _kept_parameter(m: nn.Module, keep: Keep) -> None:
    keep("p", m.a.weight)
    m.p = nn.Parameter(m.a.weight.to("meta"))


def _registered_parameter(m: nn.Module, keep: Keep) -> None:
    keep("p", m.a.weight)
    m.register_parameter("p", nn.Parameter(m.a.weight.detach().to("meta")))


def _kept_parameter_float64(m: nn.Module, keep: Keep) -> None:
    keep("p", m.a.weight.to(torch.float64))
    m.p = nn.Parameter(m.a.weight.to("meta", torch.float64))


def _kept_buffer_of_a_moved_buffer(m: nn.Module, keep: Keep) -> None:
    keep("b2", m.b)
    m.register_buffer("b2", m.b.to("meta"))


def _kept_product(m: nn.Module, keep: Keep) -> None:
    keep("p", m.a.weight * 2)
    m.p = nn.Parameter(m.a.weight.to("meta") * 2)


def _loaded_into_a_layer_moved_to_meta(m: nn.Module, keep: Keep) -> None:
    m.z = nn.Linear(3, 3)
    m.a.to("meta")
    m.a.load_state_dict(m.z.state_dict())  # eager: a copy into meta, a no-op


def _layer_moved(how: Callable[[nn.Module], None]) -> Callable[[nn.Module, Keep], None]:
    def init(m: nn.Module, keep: Keep) -> None:
        m.c = nn.Linear(3, 3)
        keep("c.weight", m.c.weight)
        keep("c.bias", m.c.bias)
        how(m.c)

    return init


def _batch_norm_moved(m: nn.Module, keep: Keep) -> None:
    m.bn = nn.BatchNorm1d(3)
    for name, tensor in m.bn.state_dict().items():
        keep(f"bn.{name}", tensor)
    m.bn.to(_META)


def _moved_swapping(layer: nn.Module) -> None:
    with _swapping():
        layer.to("meta")


def _tied_then_one_moved(swap: bool) -> Callable[[nn.Module, Keep], None]:
    def init(m: nn.Module, keep: Keep) -> None:
        m.t = nn.Linear(3, 3, bias=False)
        m.t.weight = m.a.weight
        keep("t.weight", m.a.weight)
        keep("a.weight", m.a.weight)
        if swap:
            _moved_swapping(m.t)
        else:
            m.t.to("meta")  # eager: t gets a new meta parameter, a keeps the CPU one

    return init


def _accelerate_meta_with_buffers(m: nn.Module, keep: Keep) -> None:
    import accelerate

    with accelerate.init_on_device(_META, include_buffers=True):
        m.bn = nn.BatchNorm1d(3)


KEPT: dict[str, Callable[[nn.Module, Keep], None]] = {
    "register_buffer(w.to('meta'))": _kept_buffer,
    "nn.Parameter(w.to('meta'))": _kept_parameter,
    "register_parameter(nn.Parameter(w.detach().to('meta')))": _registered_parameter,
    "nn.Parameter(w.to('meta', float64))": _kept_parameter_float64,
    "register_buffer(buffer.to('meta'))": _kept_buffer_of_a_moved_buffer,
    "nn.Parameter(w.to('meta') * 2)": _kept_product,
    "Linear.to('meta'), load_state_dict(a placed layer's)": _loaded_into_a_layer_moved_to_meta,
    "Linear.to('meta')": _layer_moved(lambda c: c.to("meta")),
    "Linear._apply(t.to('meta'))": _layer_moved(lambda c: c._apply(lambda t: t.to("meta"))),
    "Linear.to('meta') swapping parameters": _layer_moved(_moved_swapping),
    "BatchNorm1d.to(torch.device('meta'))": _batch_norm_moved,
    "tied weight, one module .to('meta')": _tied_then_one_moved(swap=False),
    "tied weight, one module .to('meta') swapping parameters": _tied_then_one_moved(swap=True),
    "accelerate init_on_device(meta, include_buffers=True) BatchNorm1d": (
        _accelerate_meta_with_buffers
    ),
}


@pytest.mark.parametrize(("idiom", "include_buffers"), _cases(KEPT, {}))
def test_a_kept_move_to_meta_is_exact_beside_it_or_refused_upfront(idiom, include_buffers):
    before: dict[str, torch.Tensor] = {}

    def keep(name: str, tensor: torch.Tensor) -> None:
        before[name] = tensor.detach().clone()

    ref = build_eagerly(lambda: Built(lambda m: (_base(m), KEPT[idiom](m, keep), _lin(m))))
    model = build_empty(
        lambda: Built(lambda m: (_base(m), KEPT[idiom](m, lambda *_: None), _lin(m))),
        include_buffers,
    )
    if metamode.is_materializable(model):
        _materialized_beside_meta(model, ref, before)
    else:
        assert_refused(model, because=_ASKED)


# == 5. Module.to('meta') gives eager's moved module new parameter objects ==================


def _identity_after_module_to(m: nn.Module) -> None:
    _base(m)
    weight = m.a.weight
    m.a.to("meta")
    m.same = m.a.weight is weight
    _lin(m)


@pytest.mark.parametrize("include_buffers", MODES)
def test_module_to_meta_replaces_parameter_objects_as_eager_does(include_buffers):
    ref = build_eagerly(lambda: Built(_identity_after_module_to))
    model = build_empty(lambda: Built(_identity_after_module_to), include_buffers)
    assert model.same == ref.same


@pytest.mark.parametrize("include_buffers", MODES)
def test_swapping_module_to_meta_keeps_parameter_objects_as_eager_does(include_buffers):
    def init(m: nn.Module) -> None:
        with _swapping():
            _identity_after_module_to(m)

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    assert ref.same and model.same


def _draw_into_a_held_parameter(m: nn.Module) -> None:
    weight = m.a.weight
    m.a.to("meta")  # eager: a new meta Parameter in a; ``weight`` is still the CPU one
    _draw(weight)
    m.held = weight


def _draw_into_the_tied_layer(m: nn.Module) -> None:
    m.t = nn.Linear(3, 3, bias=False)
    m.t.weight = m.a.weight
    m.t.to("meta")  # eager: t gets a new meta Parameter; a keeps the CPU one
    _draw(m.a.weight)


def _draw_on_the_device_of_a_held_parameter(m: nn.Module) -> None:
    weight = m.a.weight
    m.a.to("meta")
    m.p = nn.Parameter(torch.randn(3, device=weight.device))  # eager: the CPU


HELD: dict[str, Callable[[nn.Module], None]] = {
    "a parameter held before its module moved to meta, drawn into": _draw_into_a_held_parameter,
    "a tied weight, its other module moved to meta, drawn into": _draw_into_the_tied_layer,
    "randn on the .device of a parameter held before its module moved to meta": (
        _draw_on_the_device_of_a_held_parameter
    ),
}


@pytest.mark.parametrize(("idiom", "include_buffers"), _cases(HELD, {}))
def test_a_parameter_eager_keeps_on_the_cpu_after_module_to_meta_is_exact(idiom, include_buffers):
    def init(m: nn.Module) -> None:
        _base(m)
        HELD[idiom](m)
        _lin(m)

    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    assert metamode.is_materializable(model.lin), "the draws after it are eager's"
    materialize_exactly(model.lin, ref.lin)


# == 6. libraries ===========================================================================


def _accelerate_init_on_meta(m: nn.Module) -> None:
    import accelerate

    with accelerate.init_on_device(_META):  # registers param.to(meta) of each new parameter
        m.sk = nn.Linear(3, 3)
    _lin(m)


@pytest.mark.parametrize("include_buffers", MODES)
def test_accelerate_init_on_device_meta_inside_the_build_is_refused(include_buffers):
    """accelerate registers the meta copy (``param.to(meta)``) of each new parameter;
    ``Linear.reset_parameters`` then draws into that copy, where eager draws nothing, so
    ``lin``'s draws are unknown."""
    ref = build_eagerly(lambda: Built(_accelerate_init_on_meta))
    assert ref.sk.weight.is_meta
    model = build_empty(lambda: Built(_accelerate_init_on_meta), include_buffers)
    assert_refused(model, "sk.weight", "lin.weight", "lin.bias", because=_ASKED)


def _set_module_tensor_to_meta(m: nn.Module) -> None:
    from accelerate.utils import set_module_tensor_to_device

    _base(m)
    set_module_tensor_to_device(m.a, "weight", "meta")  # eager: param_cls(w.to('meta'))
    _lin(m)


@pytest.mark.parametrize("include_buffers", MODES)
def test_accelerate_set_module_tensor_to_device_meta_is_refused_for_its_device_read(
    include_buffers,
):
    """It compares ``old_value.device == torch.device('meta')`` first: a placed tensor's
    answer differs from eager's, and the build is refused for that read (an over-refusal by
    the device-read rule: the ``and`` after it decides the same either way)."""
    ref = build_eagerly(lambda: Built(_set_module_tensor_to_meta))
    assert ref.a.weight.is_meta and not ref.lin.weight.is_meta
    model = build_empty(lambda: Built(_set_module_tensor_to_meta), include_buffers)
    assert_refused(model, "a.weight", "lin.weight", because=r"read \.device")


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


def _peft_lora_moved_then_drawn(m: nn.Module) -> None:
    import peft

    config = peft.LoraConfig(r=2, target_modules=["lin"], init_lora_weights=False)
    m.peft = peft.get_peft_model(_Base(), config)
    layer = m.peft.base_model.model.lin
    layer._move_adapter_to_device_of_base_layer("default")  # .to(weight.device, dtype=...)
    nn.init.normal_(layer.lora_A["default"].weight)
    _lin(m)


@pytest.mark.parametrize("include_buffers", MODES)
def test_peft_moving_an_adapter_to_its_base_layers_device_then_drawing_is_exact(include_buffers):
    ref = build_eagerly(lambda: Built(_peft_lora_moved_then_drawn))
    model = build_empty(lambda: Built(_peft_lora_moved_then_drawn), include_buffers)
    materialize_exactly(model, ref)


def _gpt2(reinit: bool) -> Callable[[nn.Module], None]:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)

    def init(m: nn.Module) -> None:
        m.g = transformers.GPT2LMHeadModel(config)
        m.g.to(m.g.device)
        if reinit:
            nn.init.normal_(m.g.lm_head.weight, std=0.02)
        _lin(m)

    return init


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("reinit", [False, True])
def test_transformers_model_to_its_own_device_is_exact(reinit, include_buffers):
    """``model.to(model.device)``, then (``reinit``) a re-init of the tied head."""
    init = _gpt2(reinit)
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    materialize_exactly(model, ref)
