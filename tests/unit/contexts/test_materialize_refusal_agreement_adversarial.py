"""Break-it pass on the refusal side of ``materialize``: does each refusal name its real cause,
does ``is_materializable`` agree with ``materialize``, and is nothing changed before a refusal?

For the recorder's, the plan's and materialize's refusal messages this file builds the case each
was written for (the message must be accurate) and neighbouring ordinary idioms (``no_grad`` +
``copy_``, ``.data``, weight and spectral norm, pruning, computed buffers, casts inside and after
the block, ``set_default_dtype``, ``deepcopy``, ``state_dict`` round trips, pickling, threads, ties
across builds, containers holding tensors). Each test asserts what the promise allows: exact
against eager construction under the same seed, or refused upfront, changing nothing, for a
reason named by its key words. The strict xfails are the defects found, each describing what
happens instead.
"""

from __future__ import annotations

import collections
import copy
import enum
import io
import pickle
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.utils.prune as prune
from torch import nn
from torch.nn.utils import parametrizations

import metamode
from metamode._contexts.materialize import unreproducible
from tests.unit.contexts.materialize_checks import (
    MODES,
    assert_refused,
    build_eagerly,
    build_empty,
    default_dtype,
    materialize_exactly,
    warm_pickling,
)

warm_pickling()  # before the global-state guard's snapshot


def _defect(reason: str):
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)


class Built(nn.Module):
    """A module whose constructor is ``init(self)`` after a first random layer, so that later
    draws in the build continue a stream the context skipped on meta."""

    def __init__(self, init) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        init(self)


def _pair(init, include_buffers: bool) -> tuple[nn.Module, nn.Module]:
    ref = build_eagerly(lambda: Built(init))
    model = build_empty(lambda: Built(init), include_buffers)
    return model, ref


# -- inside the block: ordinary idioms that must be exact ---------------------------------


def _no_grad_copy(m):
    m.lin = nn.Linear(4, 4)
    with torch.no_grad():
        m.lin.weight.copy_(torch.eye(4))
        m.lin.bias.zero_()


def _data_copy(m):
    m.lin = nn.Linear(4, 4)
    m.lin.weight.data.copy_(torch.full((4, 4), 0.5))


def _data_normal(m):
    m.lin = nn.Linear(4, 4)
    m.lin.weight.data.normal_(0.0, 0.02)
    m.lin.bias.data.zero_()


def _clamp(m):
    m.lin = nn.Linear(4, 4)
    with torch.no_grad():
        m.lin.weight.clamp_(-0.1, 0.1)


def _old_weight_norm(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        m.lin = nn.utils.weight_norm(nn.Linear(4, 4))


def _weight_norm(m):
    m.lin = parametrizations.weight_norm(nn.Linear(4, 4))


def _old_spectral_norm(m):
    m.lin = nn.utils.spectral_norm(nn.Linear(4, 4))


def _spectral_norm(m):
    m.lin = parametrizations.spectral_norm(nn.Linear(4, 4))


def _prune_l1(m):
    m.lin = nn.Linear(4, 4)
    prune.l1_unstructured(m.lin, "weight", amount=0.5)


def _prune_random(m):
    m.lin = nn.Linear(4, 4)
    prune.random_unstructured(m.lin, "weight", amount=0.5)


def _prune_then_remove(m):
    m.lin = nn.Linear(4, 4)
    prune.l1_unstructured(m.lin, "weight", amount=0.5)
    prune.remove(m.lin, "weight")


def _computed_buffer(m):
    m.lin = nn.Linear(4, 4)
    m.register_buffer("col_sums", m.lin.weight.detach().sum(0))
    m.register_buffer("norm", torch.linalg.matrix_norm(m.lin.weight.detach()))


def _requires_grad_false(m):
    m.lin = nn.Linear(4, 4).requires_grad_(False)
    m.frozen = nn.Parameter(torch.ones(3), requires_grad=False)


def _to_float64(m):
    m.lin = nn.Linear(4, 4)
    m.register_buffer("steps", torch.arange(3))
    m.to(torch.float64)


def _half(m):
    m.lin = nn.Linear(4, 4)
    m.register_buffer("scale", torch.ones(3))
    m.half()


def _bfloat16(m):
    m.lin = nn.Linear(4, 4)
    m.bfloat16()


def _half_then_float(m):
    m.lin = nn.Linear(4, 4)
    m.lin.half()
    m.lin.float()


def _channels_last(m):
    m.conv = nn.Conv2d(2, 2, 3)
    m.to(memory_format=torch.channels_last)


def _default_dtype_for_factories(m):
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        m.lin = nn.Linear(4, 4)
        m.extra = nn.Parameter(torch.randn(3))
    finally:
        torch.set_default_dtype(before)


def _deepcopy_teacher(m):
    m.student = nn.Linear(4, 4)
    m.register_buffer("projection", torch.randn(3))
    m.teacher = copy.deepcopy(m.student).requires_grad_(False)
    m.projection_copy = copy.deepcopy(m.projection)


def _state_dict_copy(m):
    m.a = nn.Linear(4, 4)
    m.b = nn.Linear(4, 4)
    m.b.load_state_dict(m.a.state_dict())


def _state_dict_assign(m):
    m.a = nn.Linear(4, 4)
    m.b = nn.Linear(4, 4)
    m.b.load_state_dict(m.a.state_dict(), assign=True)


def _vector_round_trip(m):
    m.a = nn.Linear(4, 4)
    m.b = nn.Linear(4, 4)
    nn.utils.vector_to_parameters(
        nn.utils.parameters_to_vector(m.a.parameters()) * 0.5, m.b.parameters()
    )


def _fork_rng(m):
    with torch.random.fork_rng():
        torch.manual_seed(5)
        m.a = nn.Linear(4, 4)
    m.b = nn.Linear(4, 4)


def _rng_state_round_trip(m):
    state = torch.get_rng_state()
    m.a = nn.Linear(4, 4)
    torch.set_rng_state(state)
    m.b = nn.Linear(4, 4)


def _own_generator(m):
    g = torch.Generator().manual_seed(3)
    m.p = nn.Parameter(torch.randn(3, generator=g))


def _bernoulli_and_randperm(m):
    m.mask = nn.Parameter(torch.bernoulli(torch.full((4,), 0.5)))
    m.register_buffer("perm", torch.randperm(6))


def _inference_mode_buffer(m):
    with torch.inference_mode():
        m.register_buffer("table", torch.arange(3.0) * 2)


def _numpy_parameter(m):
    m.p = nn.Parameter(torch.tensor(np.arange(4.0)))


def _parameter_from_buffer(m):
    m.register_buffer("base", torch.randn(3))
    m.p = nn.Parameter(m.base * 2)


def _expanded_buffer(m):
    m.register_buffer("ones", torch.ones(1, 3).expand(4, 3))


def _nn_buffer(m):
    m.b = nn.Buffer(torch.randn(3))
    m.c = nn.Buffer(torch.arange(3.0), persistent=False)


def _gradient_hook(m):
    m.lin = nn.Linear(4, 4)
    m.lin.weight.register_hook(lambda grad: grad)


def _swap_tensors(m):
    m.a = nn.Linear(4, 4)
    m.b = nn.Linear(4, 4)
    torch.utils.swap_tensors(m.a.weight, m.b.weight)


def _sparse_embedding(m):
    m.emb = nn.Embedding(5, 4, sparse=True)


EXACT_INSIDE = {
    "no_grad + copy_/zero_": _no_grad_copy,
    ".data.copy_": _data_copy,
    ".data.normal_/zero_": _data_normal,
    "no_grad clamp_": _clamp,
    "nn.utils.weight_norm": _old_weight_norm,
    "parametrizations.weight_norm": _weight_norm,
    "nn.utils.spectral_norm": _old_spectral_norm,
    "parametrizations.spectral_norm": _spectral_norm,
    "prune.l1_unstructured": _prune_l1,
    "prune.random_unstructured": _prune_random,
    "prune then remove": _prune_then_remove,
    "register_buffer of computed tensors": _computed_buffer,
    "requires_grad_(False)": _requires_grad_false,
    "module.to(float64) inside": _to_float64,
    "module.half() inside": _half,
    "module.bfloat16() inside": _bfloat16,
    "half() then float() inside": _half_then_float,
    "to(channels_last) inside": _channels_last,
    "set_default_dtype around factories": _default_dtype_for_factories,
    "deepcopy teacher and random buffer": _deepcopy_teacher,
    "load_state_dict from a sibling": _state_dict_copy,
    "load_state_dict(assign=True) from a sibling": _state_dict_assign,
    "parameters_to_vector round trip": _vector_round_trip,
    "fork_rng + manual_seed": _fork_rng,
    "get_rng_state/set_rng_state": _rng_state_round_trip,
    "own torch.Generator": _own_generator,
    "bernoulli and randperm": _bernoulli_and_randperm,
    "inference_mode buffer": _inference_mode_buffer,
    "torch.tensor(ndarray) parameter": _numpy_parameter,
    "parameter computed from a buffer": _parameter_from_buffer,
    "stride-0 expanded buffer": _expanded_buffer,
    "nn.Buffer": _nn_buffer,
    "gradient hook registered inside": _gradient_hook,
    "torch.utils.swap_tensors inside": _swap_tensors,
    "sparse=True embedding": _sparse_embedding,
}


# parameters an autograd graph holds after the build, which materialize replaces (and warns)
REPLACED_INSIDE = {"nn.utils.weight_norm": ("lin.weight_g", "lin.weight_v")}
# pruning keeps ``weight = weight_orig * mask`` as an attribute: its graph keeps the
# AccumulateGrad node of weight_orig alive, which materialize warns about (documented)
WARNS_INSIDE = {"prune.l1_unstructured", "prune.random_unstructured"}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(EXACT_INSIDE))
def test_ordinary_idioms_inside_the_block_are_exact(idiom, include_buffers):
    model, ref = _pair(EXACT_INSIDE[idiom], include_buffers)
    replaced = REPLACED_INSIDE.get(idiom, ())
    with warnings.catch_warnings():
        # the documented warning where an autograd graph holds a parameter (the old
        # weight_norm keeps the computed weight as an attribute)
        quiet = replaced or idiom in WARNS_INSIDE
        warnings.simplefilter("ignore" if quiet else "error", UserWarning)
        materialize_exactly(model, ref, replaced=replaced)


# -- inside the block: refusals written for these cases name them ------------------------


def _dropout(m):
    m.p = nn.Parameter(nn.functional.dropout(torch.ones(4), 0.5))


def _pickled(m):
    buffer = io.BytesIO()
    torch.save(m.first.state_dict(), buffer)
    buffer.seek(0)
    m.copy = nn.Linear(4, 4)
    m.copy.load_state_dict(torch.load(buffer))


def _autocast_matmul(m):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m.register_buffer("gram", m.first.weight.detach() @ m.first.weight.detach().T)


def _data_ptr_tie_check(m):
    m.second = nn.Linear(4, 4)
    m.tied = m.first.weight.data_ptr() == m.second.weight.data_ptr()


def _worker_thread_draws(m):
    made = []
    worker = threading.Thread(target=lambda: made.append(nn.Linear(2, 2)))
    worker.start()
    worker.join()
    m.worker = made[0]


def _numpy_registered(m):
    m.emb = nn.Embedding.from_pretrained(torch.from_numpy(np.ones((3, 2))))


def _sparse_buffer(m):
    indices = torch.tensor([[0, 1], [1, 0]])
    m.register_buffer(
        "adjacency", torch.sparse_coo_tensor(indices, torch.ones(2), (2, 2), check_invariants=False)
    )


def _apply_(m):
    m.register_buffer("table", torch.arange(4.0))
    m.table.apply_(lambda x: x * 2)


REFUSED_INSIDE = {
    # idiom: (build, names, reason, modes)
    "F.dropout without a generator": (
        _dropout,
        ["p"],
        r"dropout draws random.*no generator=",
        MODES,
    ),
    "torch.save/torch.load of a meta layer": (_pickled, ["copy.weight"], r"torch\.load", MODES),
    "autocast matmul on meta": (_autocast_matmul, ["gram"], r"autocast.*on meta tensors", MODES),
    "data_ptr() tie check": (
        _data_ptr_tie_check,
        ["first.weight"],
        r"memory address.*data_ptr",
        MODES,
    ),
    "worker thread drawing in the build": (
        _worker_thread_draws,
        ["first.weight"],
        r"another thread",
        MODES,
    ),
    "from_numpy registered": (
        _numpy_registered,
        ["emb.weight"],
        r"does not own.*\.clone\(\)",
        [True],
    ),
    "sparse buffer on meta": (_sparse_buffer, ["adjacency"], r"layout torch\.sparse_coo", [True]),
    "apply_ on a meta buffer": (
        _apply_,
        ["table"],
        r"apply_\(\).*without an operator schema",
        [True],
    ),
}


@pytest.mark.parametrize(
    ("idiom", "include_buffers"),
    [(idiom, mode) for idiom in sorted(REFUSED_INSIDE) for mode in REFUSED_INSIDE[idiom][3]],
)
def test_refusals_inside_the_block_name_their_cause(idiom, include_buffers):
    init, names, because, _ = REFUSED_INSIDE[idiom]
    model, _ = _pair(init, include_buffers)
    assert_refused(model, *names, because=because)


def test_a_default_dtype_set_inside_the_build_is_refused_naming_it_and_exact_under_it():
    def init(m):
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            m.register_buffer("positions", torch.arange(4) * 0.5)
        finally:
            torch.set_default_dtype(before)

    model, ref = _pair(init, True)
    assert_refused(model, "positions", because=r"default dtype torch\.float64.*float32 now")
    with default_dtype(torch.float64):
        materialize_exactly(model, ref)


@pytest.mark.parametrize(
    ("setting", "because"),
    [("threads", r"intra_op_threads"), ("precision", r"float32_matmul_precision")],
)
def test_a_process_setting_changed_before_materialize_is_named(setting, because):
    def init(m):
        m.register_buffer("gram", m.first.weight.detach() @ m.first.weight.detach().T)

    model, ref = _pair(init, False)
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    try:
        if setting == "threads":
            torch.set_num_threads(1 if threads != 1 else 2)
        else:
            torch.set_float32_matmul_precision("medium")
        assert_refused(model, "gram", because=because)
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)
    materialize_exactly(model, ref)


def test_materialize_inside_its_own_open_block_is_refused_saying_so():
    ref = build_eagerly(lambda: nn.Linear(2, 2))
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        model = nn.Linear(2, 2)
        # no reads of the model here: they would be the build's own
        with pytest.raises(metamode.NotMaterializableError, match=r"still open"):
            metamode.materialize(model)
    materialize_exactly(model, ref)


def test_a_tensor_made_under_torch_device_meta_is_refused_naming_that():
    with torch.device("meta"):
        outside = torch.empty(3)
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True, include_buffers=True):
        model = nn.Linear(2, 2)
        model.register_buffer("scaled", outside * 2)
    assert_refused(model, "scaled", because=r"made outside the recording on meta")
    assert metamode.is_materializable(model.weight)


def test_an_inference_tensor_from_before_the_block_is_refused_naming_it():
    with torch.inference_mode():
        table = torch.arange(3.0)
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True, include_buffers=True):
        model = nn.Linear(2, 2)
        model.register_buffer("scaled", table * 2)
    assert_refused(model, "scaled", because=r"inference tensor")


# -- after the block ----------------------------------------------------------------------


def _net() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    model.register_buffer("steps", torch.arange(3.0))
    return model


EXACT_AFTER = {
    "requires_grad_(False)": lambda m: m.requires_grad_(False),
    "eval()": lambda m: m.eval(),
    "state_dict()": lambda m: m.state_dict(),
    "load_state_dict(own state_dict, assign=True)": lambda m: m.load_state_dict(
        m.state_dict(), assign=True
    ),
    "torch.save of the module": lambda m: torch.save(m, io.BytesIO()),
    "torch.save of the state_dict": lambda m: torch.save(m.state_dict(), io.BytesIO()),
    "zero_grad()": lambda m: m.zero_grad(),
    "float() (no-op cast)": lambda m: m.float(),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(EXACT_AFTER))
def test_reads_and_no_ops_after_the_block_stay_exact(idiom, include_buffers):
    ref = build_eagerly(_net)
    model = build_empty(_net, include_buffers)
    EXACT_AFTER[idiom](model)
    if idiom == "requires_grad_(False)":
        ref.requires_grad_(False)
    materialize_exactly(model, ref)


def _no_grad_copy_after(m):
    with torch.no_grad():
        m[0].weight.copy_(torch.ones(4, 4))


REFUSED_AFTER = {
    "no_grad copy_ into a meta weight": (_no_grad_copy_after, ["0.weight"], r"written"),
    "load_state_dict of real values (no assign)": (
        lambda m: m.load_state_dict({"0.bias": torch.zeros(4)}, strict=False),
        ["0.bias"],
        r"written",
    ),
    "a parameter assigned after the block": (
        lambda m: setattr(m[1], "extra", nn.Parameter(torch.empty(2, device="meta"))),
        ["1.extra"],
        r"assigned after the context",
    ),
    "load_state_dict(deepcopy(state_dict), assign=True)": (
        lambda m: m.load_state_dict(copy.deepcopy(m.state_dict()), assign=True),
        ["0.weight"],
        r"replaced after the block.*assignment",
    ),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(REFUSED_AFTER))
def test_changes_after_the_block_are_refused_upfront_naming_them(idiom, include_buffers):
    change, names, because = REFUSED_AFTER[idiom]
    model = build_empty(_net, include_buffers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # load_state_dict into meta warns
        change(model)
    assert_refused(model, *names, because=because)


def test_a_module_built_in_a_thread_is_exact_materialized_in_another():
    ref = build_eagerly(_net)
    built: list[nn.Module] = []

    def build() -> None:
        built.append(build_empty(_net, True))

    worker = threading.Thread(target=build)
    worker.start()
    worker.join()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            materialize_exactly(built[0], ref)
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert not errors, errors


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize(
    "cast",
    [
        pytest.param(lambda m: m.half(), id="half"),
        pytest.param(lambda m: m.to(torch.float64), id="to(float64)"),
        pytest.param(
            lambda m: setattr(m[0].weight, "data", torch.empty(4, 4, device="meta")),
            id=".data = meta",
        ),
    ],
)
def test_a_cast_after_the_block_is_refused_as_a_change_not_a_replacement(cast, include_buffers):
    model = build_empty(_net, include_buffers)
    weight = model[0].weight
    cast(model)
    assert model[0].weight is weight  # the same Parameter: nothing was replaced
    # the Parameter keeps its object and gets other memory (`param.data =`, the default
    # swap setting): refused as memory replaced in place, not as another tensor
    message = assert_refused(model, "0.weight", because=r"replaced after the block, in place")
    line = next(line for line in message.splitlines() if "'0.weight'" in line)
    assert "in place" in line, line


# -- ties and values across two replayable builds -----------------------------------------


def test_a_weight_tied_across_two_builds_stays_exact_in_its_own_build():
    torch.manual_seed(0)
    enc_ref = nn.Embedding(5, 4)
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        enc = nn.Embedding(5, 4)
    assert metamode.is_materializable(enc)
    with metamode.empty_weights(replayable=True):
        dec = nn.Linear(4, 5, bias=False)
        dec.weight = enc.weight
    metamode.materialize(enc)
    assert torch.equal(enc.weight, enc_ref.weight)
    metamode.materialize(dec)
    assert dec.weight is enc.weight


def test_a_cross_build_refusal_says_to_build_after_the_materialize():
    """The value was computed from the other build's meta stand-in: materializing that build
    afterwards cannot change it, and the reason says so (build this one after it)."""
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        a = nn.Linear(3, 3)
    with metamode.empty_weights(replayable=True):
        b = nn.Module()
        b.p = nn.Parameter(a.weight.detach() * 2)
    assert_refused(b, "p", because=r"materialize that one first, then build this one")
    metamode.materialize(a)
    assert "then build this one" in unreproducible(b)["p"]


def test_a_weight_tied_across_two_builds_and_written_in_the_second_is_refused():
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        enc = nn.Embedding(5, 4)
    with metamode.empty_weights(replayable=True):
        dec = nn.Linear(4, 5, bias=False)
        dec.weight = enc.weight
        nn.init.zeros_(dec.weight)  # eager: enc's weight is zeros now
    assert_refused(enc, "weight", because="a later replayable build wrote it")
    assert_refused(dec, "weight", because="a later replayable build wrote it")


def test_a_value_built_after_the_other_build_was_materialized_is_exact():
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        a = nn.Linear(3, 3)
    metamode.materialize(a)
    with metamode.empty_weights(replayable=True):
        b = nn.Module()
        b.p = nn.Parameter(a.weight.detach() * 2)
    metamode.materialize(b)
    assert torch.equal(b.p, a.weight * 2)


# -- arguments metamode could copy --------------------------------------------------------


class Width(enum.IntEnum):
    HIDDEN = 4


Shape = collections.namedtuple("Shape", "rows cols")


def _int_enum_size(m):
    m.p = nn.Parameter(torch.zeros(Width.HIDDEN))


def _int_enum_fill(m):
    m.register_buffer("filled", torch.full((2,), Width.HIDDEN))


def _named_tuple_size(m):
    m.p = nn.Parameter(torch.randn(Shape(2, 3)))


# (a real buffer filled in a params-only build is kept as it is: nothing recorded needs it)
_ARGUMENT_CASES = [
    (_int_enum_size, "IntEnum size", MODES),
    (_int_enum_fill, "IntEnum fill value", [True]),
    (_named_tuple_size, "namedtuple shape", MODES),
]


@pytest.mark.parametrize(
    ("init", "include_buffers"),
    [
        pytest.param(init, mode, id=f"{name}-{mode}")
        for init, name, modes in _ARGUMENT_CASES
        for mode in modes
    ],
)
def test_int_and_tuple_subclass_arguments_are_exact(init, include_buffers):
    model, ref = _pair(init, include_buffers)
    materialize_exactly(model, ref)


# -- pickling a real tensor inside the build ---------------------------------------------


def _pickle_real_buffer(m):
    m.register_buffer("projection", torch.randn(3))
    m.blob = pickle.dumps(m.projection)


def _torch_save_state_dict(m):
    m.register_buffer("projection", torch.randn(3))
    torch.save(m.state_dict(), io.BytesIO())


@pytest.mark.parametrize(
    ("init", "through"),
    [
        pytest.param(_pickle_real_buffer, "Tensor.__reduce_ex__", id="pickle.dumps"),
        pytest.param(_torch_save_state_dict, "save", id="torch.save(state_dict)"),
    ],
)
def test_pickling_a_real_buffer_inside_the_build_is_exact_or_refused_naming_it(init, through):
    """The refusal names the user's call and torch's function that took the storage, not
    only ``untyped_storage()``, which the user never called."""
    model, ref = _pair(init, False)
    if metamode.is_materializable(model):
        materialize_exactly(model, ref)
        return
    message = assert_refused(model, "projection")
    assert f"called by torch's {through}() from {init.__name__}()" in message, message


@pytest.mark.parametrize("init", [_pickle_real_buffer, _torch_save_state_dict])
def test_pickling_a_meta_buffer_inside_the_build_is_exact(init):
    model, ref = _pair(init, True)
    materialize_exactly(model, ref)


# -- tensors held in containers materialize does not walk ---------------------------------


Holder = collections.namedtuple("Holder", "tensor")
CONTAINERS = {
    "list": (lambda t: [t], lambda c: c[0]),
    "dict": (lambda t: {"k": t}, lambda c: c["k"]),
    "OrderedDict": (lambda t: collections.OrderedDict(k=t), lambda c: c["k"]),
    "defaultdict": (lambda t: collections.defaultdict(list, k=t), lambda c: c["k"]),
    "deque": (lambda t: collections.deque([t]), lambda c: c[0]),
    "namedtuple": (lambda t: Holder(t), lambda c: c.tensor),
}


def _held_in(container: str):
    make, _ = CONTAINERS[container]

    def init(m):
        m.register_buffer("table", torch.arange(3.0) * 2)
        m.view = make(m.table)

    return init


@pytest.mark.parametrize("container", sorted(set(CONTAINERS) - {"namedtuple"}))
def test_a_buffer_also_held_in_a_container_attribute_is_updated_there(container):
    model, ref = _pair(_held_in(container), True)
    materialize_exactly(model, ref)
    assert CONTAINERS[container][1](model.view) is model.table


def test_a_buffer_also_held_in_a_namedtuple_attribute_is_refused_as_in_a_tuple():
    model, _ = _pair(_held_in("namedtuple"), True)
    message = assert_refused(model, because="tuple attribute")  # the tensor alone is not
    assert "'table'" in message, message


# -- attributes in __slots__ ----------------------------------------------------------


class SlottedParameter(nn.Parameter):
    __slots__ = ("tag",)


class SlottedTensor(torch.Tensor):
    __slots__ = ("tag",)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_slot_attribute_of_a_parameter_subclass_survives_materialize(include_buffers):
    def init(m):
        p = SlottedParameter(torch.randn(3))
        p.tag = "keep"
        m.p = p

    model, ref = _pair(init, include_buffers)
    assert model.p.tag == "keep"
    materialize_exactly(model, ref)
    assert getattr(model.p, "tag", None) == "keep"


def test_a_slot_attribute_of_a_buffer_subclass_survives_materialize():
    def init(m):
        b = torch.randn(3).as_subclass(SlottedTensor)
        b.tag = "keep"
        m.register_buffer("b", b)

    model, _ = _pair(init, True)
    assert model.b.tag == "keep"
    metamode.materialize(model)
    assert getattr(model.b, "tag", None) == "keep"


# -- a failed install changes nothing ---------------------------------------------------


def test_materialize_to_a_device_that_fails_changes_nothing():
    model = build_empty(_net, True)
    weight, state = model[0].weight, torch.default_generator.get_state()
    with pytest.raises((AssertionError, RuntimeError)):  # no machine has 100 GPUs
        metamode.materialize(model, device="cuda:99")
    assert model[0].weight is weight and weight.is_meta and model.steps.is_meta
    assert torch.equal(torch.default_generator.get_state(), state)
    ref = build_eagerly(_net)
    materialize_exactly(model, ref)
