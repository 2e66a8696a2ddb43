"""A break-it pass on random state that real code touches while it builds a model.

Idioms from transformers, diffusers, timm, torchtitan, PEFT, Lightning and fairseq-style
code: ``fork_rng`` blocks (with and without ``devices=[]``, raising, disabled),
``get_rng_state``/``set_rng_state`` save and restore (before and after skipped draws, across
real draws, across builds, with torch functions disabled in between), ``manual_seed`` per
layer, ``torch.seed()``, ``initial_seed()`` steering the build, private generators seeded
for init (PEFT VeRA's ``projection_prng_key``) passed to ``nn.init.*`` and to every random
factory and in-place sampler, the default generator's state copied into a private one and
back, ``torch.utils.data``'s ``random_().item()`` seed, ``SobolEngine``, NumPy and Python
random seeded from torch, another thread using the default generator while the build waits
(forced with events), and replayable contexts nested in other contexts.

Each idiom is built eagerly and in ``empty_weights(replayable=True)`` (params-only and
``include_buffers=True``) under one seed. ``materialize`` must give eager's tensors bit for
bit, the default generator left as it was, or refuse upfront for an accurate reason, with
``is_materializable`` agreeing. The default generator after the build must be where eager
leaves it when no default draw was skipped, and otherwise in a marker state that a next
replayable build continues exactly as eager continues (a probe layer, built after both).
A case that breaks the promise is a strict xfail whose reason says what happens instead.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import pickle
import random
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import RandomSampler

import metamode
from tests.unit.contexts.materialize_checks import (
    EITHER,
    EXACT,
    MODES,
    REFUSED,
    Built,
    Outcome,
    assert_exact_or_refused,
    assert_refused,
    broken,
    idiom_cases,
    materialize_exactly,
    warm_pickling,
)

warm_pickling()  # the pickled generator below pickles a state tensor

CPU = "cpu"  # a factory given device="cpu" is real in both modes
UNRECORDED = r"did not record"
NO_GENERATOR = r"takes no generator="
READ_SHIFTED = r"read the values of a tensor .* draws differently"
_WAIT_S = 30.0  # guards against a hang; never used for ordering


@pytest.fixture(autouse=True)
def _default_generator_kept() -> Iterator[None]:
    state = torch.default_generator.get_state()
    py_state, np_state = random.getstate(), np.random.get_state()
    yield
    torch.default_generator.set_state(state)
    random.setstate(py_state)
    np.random.set_state(np_state)


def _context(include_buffers: bool) -> contextlib.AbstractContextManager:
    return metamode.empty_weights(include_buffers=include_buffers, replayable=True)


def _check(
    build: Callable[[], nn.Module],
    include_buffers: bool,
    outcome: Outcome,
    *,
    skips_default: bool | None = None,
) -> None:
    """``build()`` eagerly and replayably from seed 0: what ``outcome`` allows; then a probe
    layer built after each continues the default generator as eager does (exactly, unless
    the build itself was refused, when it may be refused too). ``skips_default=False``: the
    build skipped no default draw, so the generator must be eager's state right away."""
    torch.manual_seed(0)
    ref = build()
    eager_state = torch.default_generator.get_state()
    ref_probe = nn.Linear(3, 3)
    torch.manual_seed(0)
    with _context(include_buffers):
        model = build()
    built_state = torch.default_generator.get_state()
    if skips_default is False:
        assert torch.equal(built_state, eager_state), "the build left the default off eager's"
    if outcome.kind == EXACT:
        materialize_exactly(model, ref)
        verdict = "exact"
    elif outcome.kind == REFUSED:
        assert_refused(model, because=outcome.because)
        verdict = "refused"
    else:
        verdict = assert_exact_or_refused(model, ref, because=outcome.because)
    with _context(include_buffers):
        probe = nn.Linear(3, 3)
    if verdict == "exact":
        materialize_exactly(probe, ref_probe)
    else:
        assert_exact_or_refused(probe, ref_probe, "weight", "bias")
    torch.default_generator.set_state(built_state)


def _disabled() -> contextlib.AbstractContextManager:
    return torch._C.DisableTorchFunction()


# -- fork_rng -----------------------------------------------------------------------------------


def _fork_seeded_per_layer(m: nn.Module) -> None:
    """fairseq's ``with set_torch_seed(seed + i)`` per layer; the tail continues the entry."""
    m.head = nn.Linear(3, 3)
    m.layers = nn.ModuleList()
    for i in range(3):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(100 + i)
            m.layers.append(nn.Linear(3, 3))
    m.tail = nn.Linear(3, 3)


def _fork_default_devices_real_draw(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    with torch.random.fork_rng():
        m.register_buffer("probe", torch.rand(5, device=CPU))  # from a's end, unseeded
        m.inner = nn.Linear(3, 3)
    m.b = nn.Linear(3, 3)  # a's end again: the probe's and inner's draws again


def _fork_disabled(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    with torch.random.fork_rng(devices=[], enabled=False):
        m.b = nn.Linear(3, 3)  # not forked: the stream goes on
    m.c = nn.Linear(3, 3)


def _fork_body_raises(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    try:
        with torch.random.fork_rng(devices=[]):
            m.b = nn.Linear(3, 3)
            raise ValueError("a shape check")
    except ValueError:
        pass
    m.c = nn.Linear(3, 3)  # b's values


def _fork_around_an_unrecorded_discarded_draw(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    with torch.random.fork_rng(devices=[]), _disabled():
        torch.randn(8)  # nobody keeps it; the fork puts the stream back
    m.b = nn.Linear(3, 3)


# -- get_rng_state / set_rng_state --------------------------------------------------------------


def _saved_before_the_first_skipped_draw(m: nn.Module) -> None:
    state = torch.get_rng_state()  # the entry state: no marker yet
    m.a = nn.Linear(3, 3)
    m.b = nn.Linear(3, 3)
    torch.set_rng_state(state)
    m.c = nn.Linear(3, 3)  # a's values
    m.d = nn.Linear(3, 3)  # b's values


def _restored_to_itself(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    torch.set_rng_state(torch.get_rng_state())
    torch.default_generator.set_state(torch.default_generator.get_state().clone())
    m.b = nn.Linear(3, 3)


def _restored_across_a_real_draw(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    state = torch.get_rng_state()
    m.register_buffer("noise", torch.randn(6, device=CPU))  # real in both modes
    torch.set_rng_state(state)
    m.b = nn.Linear(3, 3)  # starts where the noise started


def _restored_after_an_unrecorded_discarded_draw(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    state = torch.get_rng_state()
    with _disabled():
        torch.randn(8)  # nobody keeps it
    torch.set_rng_state(state)
    m.b = nn.Linear(3, 3)


def _saved_after_an_unrecorded_draw_restored_later(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    with _disabled():
        torch.randn(8)  # nobody keeps it, but the state saved next is past it
    state = torch.get_rng_state()
    torch.manual_seed(1)
    m.b = nn.Linear(3, 3)
    torch.set_rng_state(state)
    m.c = nn.Linear(3, 3)  # from a state no recording knows


def _unrecorded_kept_draw_then_restored(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    state = torch.get_rng_state()
    with _disabled():
        m.register_buffer("noise", torch.randn(6, device=CPU))  # kept; eager: a's end stream
    torch.set_rng_state(state)
    m.b = nn.Linear(3, 3)


def _isolate_rng(m: nn.Module) -> None:
    """Lightning's ``isolate_rng``: torch, NumPy and Python states saved, restored after."""
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    m.a = nn.Linear(3, 3)
    m.register_buffer("np_noise", torch.from_numpy(np.random.rand(4)).clone().float())
    m.register_buffer("py_noise", torch.tensor([random.random() for _ in range(3)]))
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])
    m.b = nn.Linear(3, 3)  # a's values


# -- manual_seed, seed, initial_seed ------------------------------------------------------------


def _seeded_per_stage(m: nn.Module) -> None:
    """torchtitan's ``set_determinism``: a base seed plus the stage, layer by layer."""
    m.stages = nn.ModuleList()
    for stage in range(3):
        torch.manual_seed(1234 + stage)
        m.stages.append(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))


def _dropout_discarded_then_reseeded(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    nn.Dropout(0.5).train()(torch.ones(8))  # a shape probe in train mode: nobody keeps it
    torch.manual_seed(3)
    m.b = nn.Linear(3, 3)


def _unrecorded_discarded_draw_then_reseeded(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    with _disabled():
        torch.randn(8)  # nobody keeps it
    torch.manual_seed(3)
    m.b = nn.Linear(3, 3)


def _dropout_discarded_then_entry_state_restored(m: nn.Module) -> None:
    state = torch.get_rng_state()
    m.a = nn.Linear(3, 3)
    F.dropout(torch.ones(8), 0.5, training=True)  # nobody keeps it
    torch.set_rng_state(state)
    m.b = nn.Linear(3, 3)  # a's values


def _initial_seed_steers_a_width_first(m: nn.Module) -> None:
    width = 3 + torch.initial_seed() % 2  # read before any skipped draw: the build's seed
    m.a = nn.Linear(3, width)
    m.b = nn.Linear(width, 3)


def _initial_seed_steers_a_width_later(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    width = 3 + torch.initial_seed() % 2  # after a skipped draw: the marker's seed
    m.b = nn.Linear(3, width)


def _python_random_from_initial_seed(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    rng = random.Random(torch.initial_seed())
    m.register_buffer("jitter", torch.tensor([rng.random() for _ in range(4)]))


def _numpy_from_initial_seed_first(m: nn.Module) -> None:
    rng = np.random.default_rng(torch.initial_seed())  # before any skipped draw
    m.a = nn.Linear(3, 3)
    m.register_buffer("mask", torch.from_numpy(rng.random(5) < 0.5).clone())


# -- private generators -------------------------------------------------------------------------


def _kaiming_init(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    tensor = torch.empty(shape)
    with torch.no_grad():
        return nn.init.kaiming_uniform_(tensor, a=5**0.5, generator=generator)


def _vera_shared_projections(m: nn.Module) -> None:
    """PEFT VeRA: one ``projection_prng_key`` generator, A and B shared by every layer."""
    generator = torch.Generator(device=CPU).manual_seed(0)
    m.register_buffer("vera_A", _kaiming_init((4, 3), generator))
    m.register_buffer("vera_B", _kaiming_init((3, 4), generator))
    m.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
    for layer in m.layers:
        layer.lambda_d = nn.Parameter(torch.randn(4) * 0.1)
        layer.lambda_b = nn.Parameter(torch.zeros(3))


def _every_init_with_a_generator(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(11)
    m.a = nn.Linear(6, 6)
    nn.init.trunc_normal_(m.a.weight, std=0.02, a=-0.03, b=0.03, generator=g)
    m.b = nn.Linear(6, 4)
    nn.init.orthogonal_(m.b.weight, gain=0.5, generator=g)
    m.c = nn.Linear(6, 6)
    nn.init.sparse_(m.c.weight, 0.5, std=0.1, generator=g)
    m.d = nn.Linear(6, 6)
    nn.init.xavier_uniform_(m.d.weight, generator=g)
    nn.init.xavier_normal_(m.d.weight, gain=2.0, generator=g)
    m.e = nn.Linear(6, 6)  # the default between
    nn.init.kaiming_normal_(m.e.weight, mode="fan_out", generator=g)
    nn.init.uniform_(m.e.bias, -1, 1, generator=g)


def _factories_with_a_generator(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(5)
    m.a = nn.Linear(3, 3)
    m.p_rand = nn.Parameter(torch.rand(3, generator=g))
    m.p_randn = nn.Parameter(torch.randn(3, generator=g))
    m.register_buffer("perm", torch.randperm(7, generator=g))
    m.register_buffer("ints", torch.randint(3, 9, (4,), generator=g))
    m.register_buffer("picked", torch.multinomial(torch.ones(8), 3, generator=g))
    m.register_buffer("coins", torch.bernoulli(torch.full((5,), 0.3), generator=g))
    m.p_normal = nn.Parameter(torch.normal(torch.zeros(4), torch.ones(4), generator=g))
    m.register_buffer("real", torch.randn(3, generator=g, device=CPU))
    m.b = nn.Linear(3, 3)


def _samplers_in_place(generator: torch.Generator | None) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        kw: dict[str, Any] = {} if generator is None else {"generator": generator}
        if generator is not None:
            generator.manual_seed(9)
        m.a = nn.Linear(3, 3)
        m.ints = nn.Parameter(torch.empty(5).random_(0, 10, **kw))
        m.expo = nn.Parameter(torch.empty(5).exponential_(2.0, **kw))
        m.geo = nn.Parameter(torch.empty(5).geometric_(0.4, **kw))
        m.cauchy = nn.Parameter(torch.empty(5).cauchy_(0.0, 0.5, **kw))
        m.lognormal = nn.Parameter(torch.empty(5).log_normal_(0.0, 0.25, **kw))
        m.mask = nn.Parameter(torch.empty(5).bernoulli_(0.7, **kw))
        m.b = nn.Linear(3, 3)

    return init


def _default_copied_at_entry(m: nn.Module) -> None:
    g = torch.Generator()
    g.set_state(torch.default_generator.get_state())  # before any skipped draw
    m.a = nn.Linear(3, 3, bias=False)  # the default
    m.b = nn.Linear(3, 3, bias=False)
    nn.init.kaiming_uniform_(m.b.weight, a=5**0.5, generator=g)  # a.weight's values


def _default_round_trip_through_a_copy(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    g = torch.Generator()
    g.set_state(torch.default_generator.get_state())
    m.w = nn.Parameter(torch.empty(5))
    nn.init.normal_(m.w, generator=g)
    torch.default_generator.set_state(g.get_state())  # the default goes on after w
    m.b = nn.Linear(3, 3)


def _graphsafe_or_clone_state(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    try:
        g = torch.default_generator.graphsafe_get_state()
    except RuntimeError:  # CPU generators: not supported
        g = torch.default_generator.clone_state()
    m.w = nn.Parameter(torch.randn(4, generator=g))  # b.weight's first draws
    m.b = nn.Linear(3, 3)


def _private_state_saved_then_unrecorded_discarded_draw(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(4)
    m.w = nn.Parameter(torch.empty(4))
    nn.init.normal_(m.w, generator=g)
    state = g.get_state()
    with _disabled():
        torch.randn(8, generator=g)  # nobody keeps it
    g.set_state(state)
    m.v = nn.Parameter(torch.empty(4))
    nn.init.normal_(m.v, generator=g)


def _data_loader_seed(first: bool) -> Callable[[nn.Module], None]:
    """``torch.utils.data``'s ``torch.empty((), dtype=torch.int64).random_().item()``."""

    def init(m: nn.Module) -> None:
        if not first:
            m.a = nn.Linear(3, 3)
        seed = int(torch.empty((), dtype=torch.int64, device=CPU).random_().item())
        g = torch.Generator().manual_seed(seed)
        m.w = nn.Parameter(torch.randn(4, generator=g))
        m.b = nn.Linear(3, 3)

    return init


def _sobol_scrambled(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    engine = torch.quasirandom.SobolEngine(3, scramble=True, seed=7)
    m.register_buffer("points", engine.draw(4))
    m.b = nn.Linear(3, 3)


def _deepcopy_of_the_default(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    g = copy.deepcopy(torch.default_generator)  # the marker state, in a new generator
    m.w = nn.Parameter(torch.randn(4, generator=g))  # b.weight's first draws
    m.b = nn.Linear(3, 3)


def _pickled_private_generator(m: nn.Module) -> None:
    """A generator pickled (a checkpoint of RNG states) and loaded mid-build."""
    g = torch.Generator().manual_seed(1)
    m.w = nn.Parameter(torch.empty(3))
    nn.init.normal_(m.w, generator=g)
    loaded = pickle.loads(pickle.dumps(g))
    m.v = nn.Parameter(torch.empty(3))
    nn.init.normal_(m.v, generator=loaded)
    m.u = nn.Parameter(torch.empty(3))
    nn.init.normal_(m.u, generator=g)  # v's values


def _random_sampler_picks_layers(generator: bool) -> Callable[[nn.Module], None]:
    """A ``RandomSampler`` choosing which layers start at zero (its own generator, or one
    seeded from the default with ``random_().item()`` before any skipped draw)."""

    def init(m: nn.Module) -> None:
        g = torch.Generator().manual_seed(3) if generator else None
        order = list(RandomSampler(range(4), generator=g))
        m.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))
        for i in order[:2]:
            nn.init.zeros_(m.layers[i].weight)

    return init


def _seeded_by_name(m: nn.Module) -> None:
    for name in ("q", "k", "v"):
        torch.manual_seed(zlib.crc32(name.encode()))
        setattr(m, name, nn.Linear(3, 3))


def _private_draw_steers_a_width(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(5)
    width = int(torch.randint(2, 5, (1,), generator=g, device=CPU))  # g's first draw
    m.a = nn.Linear(3, width)
    m.w = nn.Parameter(torch.empty(width))
    nn.init.normal_(m.w, generator=g)


# -- random ops ---------------------------------------------------------------------------------


def _normal_of_meta_tensors(m: nn.Module) -> None:
    m.mean = nn.Parameter(torch.zeros(4))
    m.std = nn.Parameter(torch.full((4,), 0.5))
    with torch.no_grad():
        m.register_buffer("sample", torch.normal(m.mean, m.std))
    m.b = nn.Linear(3, 3)


def _draws_with_out(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    m.register_buffer("noise", torch.empty(4))
    torch.randn(4, out=m.noise)
    m.register_buffer("uniform", torch.empty(3))
    torch.rand(3, out=m.uniform)
    m.b = nn.Linear(3, 3)


def _draws_into_slices(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.zeros(4, 3))
    with torch.no_grad():
        m.w[:2].normal_(0, 0.02)
        m.w.data[2:].uniform_(-0.1, 0.1)
    m.b = nn.Linear(3, 3)


def _distribution_sample_after_skipped(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    dist = torch.distributions.Normal(torch.zeros(4, device=CPU), torch.ones(4, device=CPU))
    m.p = nn.Parameter(dist.sample())
    m.b = nn.Linear(3, 3)


def _randn_on_cpu_copied_into_meta(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    m.w = nn.Parameter(torch.empty(3, 3))
    with torch.no_grad():
        m.w.copy_(torch.randn(3, 3, device=CPU) * 0.02)  # a real draw from a's end
    m.b = nn.Linear(3, 3)


def _random_permutation_indexes_a_weight(m: nn.Module) -> None:
    m.a = nn.Linear(4, 4)
    perm = torch.randperm(4, device=CPU)
    with torch.no_grad():
        m.a.weight.copy_(m.a.weight[perm])
    m.b = nn.Linear(3, 3)


IDIOMS: dict[str, Callable[[nn.Module], None]] = {
    "fork_rng(devices=[]) seeded per layer": _fork_seeded_per_layer,
    "fork_rng() around a real unseeded draw and a layer": _fork_default_devices_real_draw,
    "fork_rng(enabled=False)": _fork_disabled,
    "fork_rng whose body raises": _fork_body_raises,
    "fork_rng around an unrecorded discarded draw": _fork_around_an_unrecorded_discarded_draw,
    "get_rng_state before the first skipped draw": _saved_before_the_first_skipped_draw,
    "set_rng_state(get_rng_state()) no-op": _restored_to_itself,
    "get/set_rng_state across a real draw": _restored_across_a_real_draw,
    "get/set_rng_state around an unrecorded discarded draw": (
        _restored_after_an_unrecorded_discarded_draw
    ),
    "state saved past an unrecorded draw, restored later": (
        _saved_after_an_unrecorded_draw_restored_later
    ),
    "unrecorded kept draw, then set_rng_state": _unrecorded_kept_draw_then_restored,
    "Lightning isolate_rng": _isolate_rng,
    "manual_seed per stage": _seeded_per_stage,
    "Dropout probe discarded, then manual_seed": _dropout_discarded_then_reseeded,
    "unrecorded discarded draw, then manual_seed": _unrecorded_discarded_draw_then_reseeded,
    "F.dropout discarded, then entry state restored": (
        _dropout_discarded_then_entry_state_restored
    ),
    "initial_seed steers a width first": _initial_seed_steers_a_width_first,
    "initial_seed steers a width after a skipped draw": _initial_seed_steers_a_width_later,
    "random.Random(initial_seed()) after a skipped draw": _python_random_from_initial_seed,
    "numpy default_rng(initial_seed()) first": _numpy_from_initial_seed_first,
    "VeRA shared projections": _vera_shared_projections,
    "nn.init.* with generator=": _every_init_with_a_generator,
    "random factories with generator=": _factories_with_a_generator,
    "in-place samplers, default generator": _samplers_in_place(None),
    "in-place samplers, generator=": _samplers_in_place(torch.Generator()),
    "default copied into a generator at entry": _default_copied_at_entry,
    "default round trip through a copy": _default_round_trip_through_a_copy,
    "graphsafe_get_state falling back to clone_state": _graphsafe_or_clone_state,
    "private get_state, unrecorded discarded draw, set_state": (
        _private_state_saved_then_unrecorded_discarded_draw
    ),
    "data loader random_().item() seed first": _data_loader_seed(first=True),
    "data loader random_().item() seed after a skipped draw": _data_loader_seed(first=False),
    "SobolEngine(scramble=True, seed=)": _sobol_scrambled,
    "copy.deepcopy(default_generator)": _deepcopy_of_the_default,
    "pickled private generator": _pickled_private_generator,
    "RandomSampler(generator=) picks layers": _random_sampler_picks_layers(True),
    "RandomSampler() picks layers first": _random_sampler_picks_layers(False),
    "manual_seed(crc32(name)) per layer": _seeded_by_name,
    "a private draw steers a width": _private_draw_steers_a_width,
    "normal(meta mean, meta std)": _normal_of_meta_tensors,
    "randn/rand out=": _draws_with_out,
    "draws into slices": _draws_into_slices,
    "Normal.sample after a skipped draw": _distribution_sample_after_skipped,
    "randn on cpu copied into meta": _randn_on_cpu_copied_into_meta,
    "randperm indexes a weight": _random_permutation_indexes_a_weight,
}

_DOCUMENTED_READ = (
    "silently wrong (the documented initial_seed limit): after a draw skipped on meta, "
    "torch.initial_seed() in the build returns the marker seed, not eager's, and no torch "
    "function call shows the read: "
)
_META_FACTORY = (
    "raises in the build, as a plain meta build does: include_buffers=True puts the "
    "sampler's {what} on meta (torch.device semantics), and {call} of a meta tensor raises "
    "(the documented 'builds that raise as a plain meta build does')"
)
OUTCOMES: dict[str, dict[bool, Outcome]] = {
    "RandomSampler(generator=) picks layers": {
        True: broken(_META_FACTORY.format(what="randperm", call="tolist()"))
    },
    "RandomSampler() picks layers first": {
        True: broken(_META_FACTORY.format(what="seed tensor", call="item()"))
    },
    "state saved past an unrecorded draw, restored later": {
        mode: Outcome(REFUSED, UNRECORDED) for mode in MODES
    },
    "data loader random_().item() seed after a skipped draw": {
        mode: Outcome(REFUSED, READ_SHIFTED) for mode in MODES
    },
    "unrecorded kept draw, then set_rng_state": {
        mode: broken(
            "silently wrong (the documented reseed-removes-the-trace limit): a buffer drawn "
            "with torch functions disabled from the marker state is kept, and set_rng_state of "
            "the state saved before it puts the generator back on a fresh marker, so nothing "
            "is refused and the buffer keeps the marker stream's numbers, not eager's",
            UNRECORDED,
        )
        for mode in MODES
    },
    "initial_seed steers a width after a skipped draw": {
        mode: broken(_DOCUMENTED_READ + "a layer gets another shape than eager's") for mode in MODES
    },
    "random.Random(initial_seed()) after a skipped draw": {
        mode: broken(_DOCUMENTED_READ + "a buffer drawn by Python's random has other values")
        for mode in MODES
    },
}


@pytest.mark.parametrize(("idiom", "include_buffers", "outcome"), idiom_cases(IDIOMS, OUTCOMES))
def test_random_state_idioms(idiom: str, include_buffers: bool, outcome: Outcome) -> None:
    """Each idiom exact, or refused upfront; the default generator continued as eager."""
    _check(lambda: Built(IDIOMS[idiom]), include_buffers, outcome)


# -- builds that leave the default generator exactly where eager does ---------------------------


def _every_skipped_draw_inside_a_fork(m: nn.Module) -> None:
    with torch.random.fork_rng(devices=[]):
        m.a = nn.Linear(3, 3)
        m.b = nn.Linear(3, 3)


def _reseeded_at_the_end(m: nn.Module) -> None:
    m.a = nn.Linear(3, 3)
    torch.manual_seed(77)


def _entry_state_restored_at_the_end(m: nn.Module) -> None:
    state = torch.get_rng_state()
    m.a = nn.Linear(3, 3)
    m.register_buffer("noise", torch.randn(4, device=CPU))
    torch.set_rng_state(state)


def _only_an_unseeded_private_generator(m: nn.Module) -> None:
    for i in range(2):
        g = torch.Generator()  # unseeded: torch's fixed default seed, in both builds
        w = nn.Parameter(torch.empty(3, 3))
        nn.init.normal_(w, generator=g)
        setattr(m, f"w{i}", w)


def _only_a_private_generator(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    m.w = nn.Parameter(torch.empty(4, 4))
    nn.init.xavier_uniform_(m.w, generator=g)
    m.register_buffer("r", torch.rand(4, generator=g))


LEAVES_EAGERS_STATE: dict[str, Callable[[nn.Module], None]] = {
    "every skipped draw inside fork_rng": _every_skipped_draw_inside_a_fork,
    "manual_seed at the end": _reseeded_at_the_end,
    "entry state restored at the end": _entry_state_restored_at_the_end,
    "unseeded private generators per layer": _only_an_unseeded_private_generator,
    "only a private generator draws": _only_a_private_generator,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("idiom", sorted(LEAVES_EAGERS_STATE))
def test_builds_that_leave_the_default_where_eager_does(idiom: str, include_buffers: bool) -> None:
    """The build ends with no default draw skipped since the last reseed or restore: the
    default generator is bitwise eager's right after the block, and stays so."""
    _check(
        lambda: Built(LEAVES_EAGERS_STATE[idiom]),
        include_buffers,
        Outcome(EXACT),
        skips_default=False,
    )


# -- torch.seed(): a seed nobody chose ----------------------------------------------------------


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("private", [False, True], ids=["default", "private"])
def test_a_nondeterministic_reseed_mid_build(private: bool, include_buffers: bool) -> None:
    """``torch.seed()`` (or ``Generator.seed()``) after skipped draws: the seed it picked,
    read back right after, is what eager construction with that seed gives."""
    picked: list[int] = []
    g = torch.Generator().manual_seed(1)

    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 3)
        if picked:  # eager: the seed the replayable build's torch.seed() picked
            (g if private else torch.default_generator).manual_seed(picked[0])
        else:
            picked.append((g if private else torch.default_generator).seed())
        m.w = nn.Parameter(torch.randn(4, generator=g if private else None))
        m.b = nn.Linear(3, 3)

    torch.manual_seed(0)
    with _context(include_buffers):
        model = Built(init)
    g.manual_seed(1)
    torch.manual_seed(0)
    ref = Built(init)
    materialize_exactly(model, ref)


# -- another thread using the default generator while the build waits ---------------------------


class _Neighbour:
    """A thread that runs ``action`` once, while the build waits for it in ``turn()``."""

    def __init__(self, action: Callable[[], object]) -> None:
        self.go, self.done = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        self.result: list[object] = []
        self.thread = threading.Thread(target=self._run, args=(action,), name="neighbour")
        self.thread.start()

    def _run(self, action: Callable[[], object]) -> None:
        try:
            if self.go.wait(_WAIT_S):
                self.result.append(action())
        except BaseException as error:
            self.errors.append(error)
        finally:
            self.done.set()

    def turn(self) -> object:
        self.go.set()
        assert self.done.wait(_WAIT_S), "the neighbour thread hung"
        assert not self.errors, self.errors
        return self.result[0] if self.result else None

    def close(self) -> None:
        self.go.set()
        self.thread.join(_WAIT_S)
        assert not self.errors, self.errors


def _forked_draw() -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        return torch.randn(4)


NEIGHBOURS: dict[str, tuple[Callable[[], object], bool, bool]] = {
    # name: (the neighbour's action, whether it runs before the build's first skipped draw,
    # whether the build keeps what it returns)
    "manual_seed after skipped draws": (lambda: torch.manual_seed(7), False, False),
    "a draw before any skipped draw": (lambda: torch.randn(5), True, False),
    "a draw inside fork_rng after skipped draws": (_forked_draw, False, False),
    "a draw inside fork_rng, kept by the build": (_forked_draw, False, True),
    "a draw before any skipped draw, kept by the build": (lambda: torch.randn(4), True, True),
}
NEIGHBOUR_OUTCOMES: dict[str, Outcome] = {
    "a draw inside fork_rng, kept by the build": broken(
        "silently wrong (the documented reseed-removes-the-trace limit, reached from another "
        "thread): the neighbour draws from the build's marker state inside fork_rng, whose "
        "exit puts the fresh marker back, so nothing shows the draw; the build registers the "
        "tensor, materialize keeps it as loaded, and it holds the marker stream's numbers, "
        "not eager's",
        UNRECORDED,
    ),
}


def _neighbour_cases() -> list:
    cases = []
    for name in sorted(NEIGHBOURS):
        outcome = NEIGHBOUR_OUTCOMES.get(name, Outcome(EXACT))
        marks = [pytest.mark.xfail(strict=True, reason=outcome.broken)] if outcome.broken else []
        for mode in MODES:
            cases.append(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}"))
    return cases


@pytest.mark.parametrize(("name", "include_buffers"), _neighbour_cases())
def test_another_thread_touches_the_default_generator_mid_build(
    name: str, include_buffers: bool
) -> None:
    """A neighbour thread (a prefetcher, a validation loop) uses the default generator at one
    point of the build, forced by events; eager construction sees the same order."""
    action, first, keep = NEIGHBOURS[name]

    def build() -> nn.Module:
        neighbour = _Neighbour(action)
        try:

            def init(m: nn.Module) -> None:
                if not first:
                    m.a = nn.Linear(3, 3)
                got = neighbour.turn()
                if keep:
                    assert isinstance(got, torch.Tensor)
                    m.register_buffer("from_neighbour", got)
                m.b = nn.Linear(3, 3)

            return Built(init)
        finally:
            neighbour.close()

    _check(build, include_buffers, NEIGHBOUR_OUTCOMES.get(name, Outcome(EXACT)))


@pytest.mark.parametrize("include_buffers", MODES)
def test_another_thread_draws_then_the_build_reseeds(include_buffers: bool) -> None:
    """A neighbour's draw nobody keeps moves the marker; the build's own ``manual_seed``
    after it makes the rest known again: exact."""

    def build() -> nn.Module:
        neighbour = _Neighbour(lambda: torch.randn(6))
        try:

            def init(m: nn.Module) -> None:
                m.a = nn.Linear(3, 3)
                neighbour.turn()
                torch.manual_seed(3)
                m.b = nn.Linear(3, 3)

            return Built(init)
        finally:
            neighbour.close()

    _check(build, include_buffers, Outcome(EXACT))


@pytest.mark.parametrize("include_buffers", MODES)
def test_another_thread_restores_a_state_the_build_saved(include_buffers: bool) -> None:
    """A neighbour puts back a state the build saved after skipped draws (a marker)."""
    saved: list[torch.Tensor] = []

    def build() -> nn.Module:
        saved.clear()
        neighbour = _Neighbour(lambda: torch.set_rng_state(saved[0]))
        try:

            def init(m: nn.Module) -> None:
                m.a = nn.Linear(3, 3)
                saved.append(torch.get_rng_state())
                m.b = nn.Linear(3, 3)
                neighbour.turn()
                m.c = nn.Linear(3, 3)  # b's values

            return Built(init)
        finally:
            neighbour.close()

    _check(build, include_buffers, Outcome(EXACT))


# -- contexts inside contexts -------------------------------------------------------------------


def _nested(inner: Callable[[], contextlib.AbstractContextManager]) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 3)
        with inner() if metamode.active() is not None else contextlib.nullcontext():
            m.b = nn.Linear(3, 3)
            m.register_buffer("noise", torch.randn(4))
        m.c = nn.Linear(3, 3)

    return init


NESTED: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "replayable params-only": lambda: metamode.empty_weights(replayable=True),
    "replayable include_buffers": lambda: metamode.empty_weights(
        include_buffers=True, replayable=True
    ),
    "skip_empty_weights": metamode.skip_empty_weights,
    "init_empty_weights": lambda: metamode.init_empty_weights(include_buffers=False),
    "non-replayable empty_weights": lambda: metamode.empty_weights(include_buffers=True),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("inner", sorted(NESTED))
def test_a_context_nested_in_the_build(inner: str, include_buffers: bool) -> None:
    """Another context entered inside the replayable one around a layer and a buffer
    (replayable or not, ``skip_empty_weights``): the outer recording sees every call, so
    the build is exact and the layers after it continue the stream as eager's do."""
    _check(lambda: Built(_nested(NESTED[inner])), include_buffers, Outcome(EXACT))


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_replayable_build_inside_a_plain_empty_weights(include_buffers: bool) -> None:
    """An outer non-replayable ``empty_weights()`` around the replayable one."""

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))

    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    with metamode.empty_weights(), _context(include_buffers):
        model = build()
    assert_exact_or_refused(model, ref, "0.weight")


# -- builds that carry states into each other ---------------------------------------------------


@pytest.mark.parametrize("include_buffers", MODES)
def test_an_entry_state_saved_in_one_build_restored_in_a_second_before_materialize(
    include_buffers: bool,
) -> None:
    """Build one saves its entry state; build two, started before one is materialized,
    restores it: two's layer is one's; materialized in reverse order."""
    saved: list[torch.Tensor] = []

    def one() -> nn.Module:
        saved.append(torch.get_rng_state())
        return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))

    def two() -> nn.Module:
        head = nn.Linear(3, 3)
        torch.set_rng_state(saved[-1])
        return nn.Sequential(head, nn.Linear(3, 3))

    torch.manual_seed(0)
    ref_one, ref_two = one(), two()
    torch.manual_seed(0)
    with _context(include_buffers):
        built_one = one()
    with _context(include_buffers):
        built_two = two()
    materialize_exactly(built_two, ref_two)
    materialize_exactly(built_one, ref_one)
    assert torch.equal(built_two[1].weight, built_one[0].weight)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_marker_saved_in_a_materialized_build_restored_inside_a_fork_of_the_next(
    include_buffers: bool,
) -> None:
    """Build one saves its state after a skipped draw and is materialized and dropped;
    build two restores it inside ``fork_rng`` for one layer, then goes on."""
    saved: list[torch.Tensor] = []

    def one() -> nn.Module:
        first = nn.Linear(3, 3)
        saved.append(torch.get_rng_state())
        return nn.Sequential(first, nn.Linear(3, 3))

    def two() -> nn.Module:
        head = nn.Linear(3, 3)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(saved[-1])
            twin = nn.Linear(3, 3)  # one[1]'s values
        return nn.Sequential(head, twin, nn.Linear(3, 3))

    torch.manual_seed(0)
    one()
    ref = two()
    torch.manual_seed(0)
    with _context(include_buffers):
        built_one = one()
    metamode.materialize(built_one)
    del built_one
    gc.collect()
    with _context(include_buffers):
        built_two = two()
    materialize_exactly(built_two, ref)


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_validation_step_inside_fork_rng_between_two_builds(include_buffers: bool) -> None:
    """Between two builds, code outside any context samples inside ``fork_rng``: the second
    build continues the first as eager does."""

    def between() -> None:
        with torch.random.fork_rng(devices=[]):
            torch.randn(16)
            torch.randperm(10)

    torch.manual_seed(0)
    ref_one = nn.Linear(3, 3)
    between()
    ref_two = nn.Linear(3, 3)
    torch.manual_seed(0)
    with _context(include_buffers):
        one = nn.Linear(3, 3)
    between()
    with _context(include_buffers):
        two = nn.Linear(3, 3)
    materialize_exactly(two, ref_two)
    materialize_exactly(one, ref_one)


# -- unrecorded draws kept at the end of a build, from a marker it did not set last -------------


def _unrecorded(m: nn.Module) -> None:
    with _disabled():  # code metamode does not see (a subclass's __torch_function__ body)
        m.register_buffer("noise", torch.randn(3, device=CPU))


def _in_a_worker_thread(m: nn.Module) -> None:
    made: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: made.append(torch.randn(3)), name="init-worker")
    worker.start()  # a thread started inside the build: its calls are not recorded
    worker.join(_WAIT_S)
    m.register_buffer("noise", made[0])


TRAILING_UNRECORDED: dict[str, Callable[[nn.Module], None]] = {
    "torch functions disabled": _unrecorded,
    "a worker thread": _in_a_worker_thread,
}


def _after_fork_rng(kept: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 3)
        with torch.random.fork_rng(devices=[]):  # leaves the generator on a's marker
            m.b = nn.Linear(3, 3)
        kept(m)

    return init


def _after_an_older_state_restored(
    kept: Callable[[nn.Module], None],
) -> Callable[[nn.Module], None]:
    def init(m: nn.Module) -> None:
        m.a = nn.Linear(3, 3)
        state = torch.get_rng_state()
        m.b = nn.Linear(3, 3)
        torch.set_rng_state(state)  # a's marker again
        kept(m)

    return init


def _private_after_an_older_state_restored(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(4)
    m.w = nn.Parameter(torch.empty(3))
    nn.init.normal_(m.w, generator=g)
    state = g.get_state()
    m.v = nn.Parameter(torch.empty(3))
    nn.init.normal_(m.v, generator=g)
    g.set_state(state)
    with _disabled():
        m.register_buffer("noise", torch.randn(3, generator=g, device=CPU))


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("how", sorted(TRAILING_UNRECORDED))
@pytest.mark.parametrize("order", ["after fork_rng", "after set_rng_state"])
def test_an_unrecorded_kept_draw_from_an_older_marker_at_the_build_end(
    order: str, how: str, include_buffers: bool
) -> None:
    """The build forks or restores back to an earlier marker, then code it does not record
    draws a tensor the build keeps, and the build ends: exact is impossible (eager's draw
    comes from a's end state, the build's from a's marker), so it must be refused."""

    wrap = _after_fork_rng if order == "after fork_rng" else _after_an_older_state_restored
    outcome = Outcome(EITHER, UNRECORDED)
    _check(lambda: Built(wrap(TRAILING_UNRECORDED[how])), include_buffers, outcome)


@pytest.mark.parametrize("include_buffers", MODES)
def test_an_unrecorded_kept_draw_from_an_older_private_marker(include_buffers: bool) -> None:
    """The same with a private generator put back on an earlier marker by ``set_state``."""
    outcome = Outcome(EITHER, UNRECORDED)
    _check(lambda: Built(_private_after_an_older_state_restored), include_buffers, outcome)


def _second_build(draws_privately: bool, kept: Callable[[nn.Module], None]) -> Callable:
    def init(m: nn.Module) -> None:
        if draws_privately:
            m.w = nn.Parameter(torch.empty(3))
            nn.init.normal_(m.w, generator=torch.Generator().manual_seed(2))
        else:
            m.z = nn.Parameter(torch.zeros(3))
        kept(m)

    return init


@pytest.mark.parametrize("how", sorted(TRAILING_UNRECORDED))
@pytest.mark.parametrize("draws_privately", [False, True], ids=["no draw", "private draw"])
@pytest.mark.parametrize("include_buffers", MODES)
def test_an_unrecorded_kept_draw_from_an_earlier_builds_marker(
    include_buffers: bool, draws_privately: bool, how: str
) -> None:
    """Build one skips default draws; build two draws only from a private generator (or not
    at all) and keeps a tensor unrecorded code drew from the default: exact or refused."""
    init = _second_build(draws_privately, TRAILING_UNRECORDED[how])
    torch.manual_seed(0)
    nn.Linear(3, 3)
    ref = Built(init)
    torch.manual_seed(0)
    with _context(include_buffers):
        first = nn.Linear(3, 3)
    with _context(include_buffers):
        model = Built(init)
    assert_exact_or_refused(model, ref, "noise")
    del first


@pytest.mark.parametrize("reseeds", [False, True], ids=["as it is", "reseeded"])
@pytest.mark.parametrize("include_buffers", MODES)
def test_a_draw_from_a_marker_before_the_build_refuses_nothing_it_did_not_use(
    include_buffers: bool, reseeds: bool
) -> None:
    """Code outside any build draws from the marker an earlier build left; a later build
    that draws nothing from the default generator (or reseeds it first) is exact: the
    generator's state at the block's end is compared with its state at the start."""

    def init(m: nn.Module) -> None:
        if reseeds:
            torch.manual_seed(7)
            m.b = nn.Linear(3, 3)
        m.z = nn.Parameter(torch.zeros(3))

    torch.manual_seed(0)
    nn.Linear(3, 3)
    torch.randn(3)
    ref = Built(init)
    torch.manual_seed(0)
    with _context(include_buffers):
        first = nn.Linear(3, 3)
    torch.randn(3)  # outside any build: from the first build's marker
    with _context(include_buffers):
        model = Built(init)
    assert metamode.is_materializable(model)
    assert_exact_or_refused(model, ref)
    del first
