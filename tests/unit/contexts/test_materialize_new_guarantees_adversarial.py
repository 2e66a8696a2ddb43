"""The draw lock, the install locks, the refusal of unseen draws after a build's last draw,
settings changed during materialize and PEFT's conditional meta branches, met with everyday
idioms: random ops that synchronise threads, processes forked from a threaded server, worker
pools and RNG bookkeeping inside a build, lazy materialize on first forward, precision and
flush-denormal switches, PEFT adapters in every floating dtype. Interleavings are forced with
events, barriers and turns; each outcome is exact against eager under the same seed, or
refused before anything changed, or a strict xfail saying what happens instead.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import metamode
import metamode._contexts.materialize as materialize_module
from metamode._core import recording
from metamode._core.recording import recorder as recorder_module
from metamode._core.recording import settings as settings_module
from tests.unit.contexts.materialize_checks import (
    MODES,
    Unchanged,
    assert_exact_or_refused,
    assert_refused,
    assert_same_tensors,
    default_dtype,
    materialize_exactly,
)
from tests.unit.contexts.thread_checks import WAIT_S as _WAIT_S
from tests.unit.contexts.thread_checks import Turns, default_generator_kept  # noqa: F401
from tests.unit.contexts.thread_checks import at_once as _at_once
from tests.unit.contexts.thread_checks import replayable_or_eager as _context
from tests.unit.contexts.thread_checks import run_threads as _run
from tests.unit.contexts.thread_checks import switching_often as _switching_often

_HANG_S = 5.0  # how long a case that could deadlock is given before it counts as hung
_DRAWN_PAST = "drawn from by code metamode did not record"


class Built(nn.Module):
    def __init__(self, init: Callable[[nn.Module], None]) -> None:
        super().__init__()
        init(self)


def _built(init: Callable[[nn.Module], None], replayable: bool, include_buffers: bool = False):
    torch.manual_seed(0)
    with _context(replayable, include_buffers):
        return Built(init)


# == 1. the draw lock =======================================================================


class _Shard(torch.Tensor):
    """One rank's shard of a tensor whose random ops keep the ranks in step, as DTensor's
    do under a threaded process group: each rank's op waits for every rank to reach it."""

    ranks: threading.Barrier | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "normal_" and cls.ranks is not None:
            cls.ranks.wait()
        return super().__torch_function__(func, types, args, kwargs or {})


def _rank_build(replayable: bool) -> None:
    with _context(replayable):
        nn.Linear(4, 4)
        torch.empty(8).as_subclass(_Shard).normal_()


@pytest.mark.parametrize("replayable", [False, True])
def test_rank_threads_whose_random_op_waits_for_the_other_rank(replayable, monkeypatch):
    monkeypatch.setattr(_Shard, "ranks", threading.Barrier(2, timeout=_HANG_S))
    torch.manual_seed(0)
    _run(lambda: _rank_build(replayable), lambda: _rank_build(replayable))


def _fork_and_run(child: Callable[[], None]) -> bool:
    """Run ``child`` in a forked process; whether it finished (False: it hangs)."""

    def main() -> None:
        child()
        os._exit(0)

    process = multiprocessing.get_context("fork").Process(target=main)
    process.start()
    process.join(_HANG_S)
    hung = process.is_alive()
    if hung:
        process.kill()
        process.join(_WAIT_S)
    else:
        assert process.exitcode == 0, f"the child failed ({process.exitcode})"
    return not hung


def _child_builds() -> None:
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        nn.Linear(3, 3)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_a_worker_process_forked_while_another_thread_draws(monkeypatch):
    """A server forks a worker process (multiprocessing's fork start method) while a
    background thread is building a model; the worker builds its own."""
    inside, release = threading.Event(), threading.Event()
    original = recorder_module.before_draw

    def before_draw(*args, **kwargs):
        if threading.current_thread().name == "builder" and not inside.is_set():
            inside.set()
            assert release.wait(_WAIT_S)
        return original(*args, **kwargs)

    monkeypatch.setattr(recorder_module, "before_draw", before_draw)
    built: dict[str, nn.Module] = {}

    def builder() -> None:
        with metamode.empty_weights(replayable=True):
            built["m"] = nn.Linear(3, 3)

    torch.manual_seed(0)
    thread = threading.Thread(target=builder, name="builder")
    thread.start()
    try:
        assert inside.wait(_WAIT_S)
        finished = _fork_and_run(_child_builds)
    finally:
        release.set()
        thread.join(_WAIT_S)
    monkeypatch.undo()
    torch.manual_seed(0)
    materialize_exactly(built["m"], nn.Linear(3, 3))
    assert finished, "the forked worker hangs in its build"


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_a_worker_process_forked_while_another_thread_materializes(monkeypatch):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    torch.manual_seed(0)
    with metamode.empty_weights(replayable=True):
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    inside, release = threading.Event(), threading.Event()
    survey = materialize_module._survey

    def paused(module: nn.Module):
        found = survey(module)
        if threading.current_thread().name == "installer" and not inside.is_set():
            inside.set()
            assert release.wait(_WAIT_S)
        return found

    monkeypatch.setattr(materialize_module, "_survey", paused)
    thread = threading.Thread(target=lambda: metamode.materialize(model[0]), name="installer")
    thread.start()
    try:
        assert inside.wait(_WAIT_S)
        finished = _fork_and_run(lambda: metamode.materialize(model[1]))
    finally:
        release.set()
        thread.join(_WAIT_S)
    monkeypatch.undo()
    materialize_exactly(model, ref)
    assert finished, "the forked worker hangs in materialize"


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_draw_that_raises_lets_the_other_builds_draw(include_buffers):
    """Thread a's build raises inside a recorded random call (a size from a broken config);
    thread b's build, next in turn, draws and is exact."""
    built: dict[str, nn.Module] = {}

    def a(replayable: bool, turns: Turns) -> None:
        with turns(0), pytest.raises(RuntimeError), _context(replayable, include_buffers):
            built["a"] = nn.Linear(3, 3)
            torch.randn(-1)

    def b(replayable: bool, turns: Turns) -> None:
        with turns(1), _context(replayable, include_buffers):
            built["b"] = nn.Sequential(nn.Linear(3, 3), nn.Embedding(4, 3))

    for replayable in (False, True):
        turns = Turns(2)
        torch.manual_seed(0)
        _run(lambda r=replayable, t=turns: a(r, t), lambda r=replayable, t=turns: b(r, t))
        if not replayable:
            ref = dict(built)
    for name in "ab":
        materialize_exactly(built[name], ref[name])


class _Buffered(nn.Module):
    def __init__(self, generator: torch.Generator | None) -> None:
        super().__init__()
        self.register_buffer("r", torch.randn(3, generator=generator))


_PIECES: dict[str, Callable[[torch.Generator], nn.Module]] = {
    "meta draw": lambda g: nn.Linear(2, 2),
    "real draw": lambda g: _Buffered(None),
    "private draw": lambda g: _Buffered(g),
    "both": lambda g: nn.Sequential(nn.Linear(2, 2), _Buffered(None)),
}
_SEQUENCES = [
    list(zip(owners, kinds, strict=True))
    for owners in (("a", "b", "a"), ("b", "a", "b"))
    for kinds in itertools.product(_PIECES, repeat=3)
    if len(set(kinds)) == 3
][::3]


def _turn_taking(replayable: bool, sequence: list[tuple[str, str]]) -> dict[str, nn.Module]:
    """Threads a and b build the pieces of ``sequence`` in turn, sharing the default
    generator and one private generator."""
    generator = torch.Generator().manual_seed(3)
    turns, built = Turns(len(sequence)), {"a": [], "b": []}

    def worker(name: str) -> None:
        with _context(replayable):
            for turn, (owner, kind) in enumerate(sequence):
                if owner == name:
                    with turns(turn):
                        built[name].append(_PIECES[kind](generator))

    torch.manual_seed(0)
    _run(lambda: worker("a"), lambda: worker("b"))
    return {name: nn.Sequential(*pieces) for name, pieces in built.items()}


def test_builds_taking_turns_on_a_shared_private_and_the_default_generator():
    for sequence in _SEQUENCES:
        ref, built = _turn_taking(False, sequence), _turn_taking(True, sequence)
        for name in "ab":
            assert_exact_or_refused(built[name], ref[name])


# == 2. the install locks ===================================================================


def _two_builds(replayable: bool) -> list[nn.ModuleDict]:
    builds = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with _context(replayable):
            builds.append(
                nn.ModuleDict({"x": nn.Linear(8, 8), "y": nn.LayerNorm(8), "z": nn.Conv1d(2, 2, 3)})
            )
    return builds


def test_modules_mixing_two_builds_in_opposite_orders_materialized_at_once():
    with _switching_often():
        for _ in range(4):
            ref, (a, b) = _two_builds(False), _two_builds(True)
            _at_once(
                lambda a=a, b=b: metamode.materialize(nn.ModuleList([a["x"], b["x"], a["z"]])),
                lambda a=a, b=b: metamode.materialize(nn.ModuleList([b["z"], a["x"], b["y"]])),
                lambda a=a, b=b: metamode.materialize(nn.ModuleList([b["x"], a["y"]])),
            )
            assert_same_tensors(a, ref[0])
            assert_same_tensors(b, ref[1])


def test_a_module_and_its_parts_materialized_at_once():
    with _switching_often():
        for _ in range(4):
            ref, (a, b) = _two_builds(False), _two_builds(True)
            _at_once(
                lambda a=a: metamode.materialize(a),
                lambda a=a: metamode.materialize(a["x"]),
                lambda a=a, b=b: metamode.materialize(nn.ModuleList([b, a["z"]])),
            )
            assert_same_tensors(a, ref[0])
            assert_same_tensors(b, ref[1])


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def _materialize_on_first_forward(module: nn.Module, args: object) -> None:
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        metamode.materialize(module)


def test_lazy_materialize_on_first_forward_from_request_threads():
    with _switching_often():
        for _ in range(4):
            torch.manual_seed(0)
            ref = _Tied()
            torch.manual_seed(0)
            with metamode.empty_weights(include_buffers=True, replayable=True):
                model = _Tied()
            model.register_forward_pre_hook(_materialize_on_first_forward)
            ids = torch.tensor([1, 2])
            _at_once(*[lambda m=model, i=ids: m(i)] * 3)
            assert_same_tensors(model, ref)


# == 3. unseen draws after the last recorded draw ===========================================


def _last_real_draw(self: nn.Module) -> None:
    self.a = nn.Linear(3, 3)
    self.register_buffer("r", torch.randn(3))


def _private_generator(self: nn.Module) -> None:
    generator = torch.Generator().manual_seed(7)
    self.a = nn.Linear(3, 3)
    weight = torch.empty(3, 3)
    nn.init.normal_(weight, generator=generator)
    self.w = nn.Parameter(weight)
    self.register_buffer("r", torch.rand(3, generator=generator))


def _fork_rng_at_the_end(self: nn.Module) -> None:
    self.a = nn.Linear(3, 3)
    with torch.random.fork_rng():
        self.register_buffer("r", torch.randn(3))
        self.b = nn.Linear(3, 3)


def _process_seed_at_the_end(self: nn.Module) -> None:
    self.a = nn.Linear(3, 3)
    torch.random.seed()


def _nested_contexts(self: nn.Module) -> None:
    self.a = nn.Linear(3, 3)
    inner = metamode.empty_weights(replayable=True) if metamode.active() else None
    with inner or contextlib.nullcontext():
        self.b = nn.Linear(3, 3)
    self.c = nn.Linear(3, 3)


def _sampling_at_the_end(self: nn.Module) -> None:
    self.a = nn.Linear(3, 3)
    self.register_buffer("idx", torch.multinomial(torch.ones(10), 3))
    self.register_buffer("perm", torch.randperm(6))
    self.register_buffer("mask", torch.empty(5).bernoulli_(0.5))


ORDINARY = {
    "last call a real draw": _last_real_draw,
    "a private generator passed around": _private_generator,
    "fork_rng around the last draws": _fork_rng_at_the_end,
    "torch.random.seed() at the end": _process_seed_at_the_end,
    "a nested replayable context": _nested_contexts,
    "sampling at the end": _sampling_at_the_end,
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", ORDINARY)
def test_an_ordinary_build_is_exact(name, include_buffers):
    init = ORDINARY[name]
    materialize_exactly(_built(init, True, include_buffers), _built(init, False))


def _tiny_transformers(kind: str) -> Callable[[], nn.Module]:
    from transformers import (
        AutoModelForCausalLM,
        BertConfig,
        BertModel,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
    )

    llama = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return {
        "gpt2": lambda: GPT2LMHeadModel(
            GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
        ),
        "bert": lambda: BertModel(
            BertConfig(
                vocab_size=64,
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=32,
            )
        ),
        "llama bfloat16 from_config": lambda: AutoModelForCausalLM.from_config(
            llama, dtype=torch.bfloat16
        ),
    }[kind]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama bfloat16 from_config"])
def test_a_transformers_model_from_an_in_code_config_is_exact(kind, include_buffers):
    build = _tiny_transformers(kind)
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = build()
    materialize_exactly(model, ref)


def _shuffled_calibration(self: nn.Module) -> None:
    self.a = nn.Linear(3, 3)
    batches = DataLoader(torch.arange(8.0), batch_size=4, shuffle=True)
    self.register_buffer("first", torch.cat(list(batches))[:2].clone())


def _dropout_in_a_forward(self: nn.Module) -> None:
    self.a = nn.Linear(3, 3)
    self.drop = nn.Dropout(0.5)
    self.register_buffer("calib", self.drop(torch.ones(8)))


@pytest.mark.parametrize(
    ("init", "because"),
    [
        (_shuffled_calibration, "read the values of a tensor the build computed from random"),
        (_dropout_in_a_forward, "takes no generator="),
    ],
    ids=["DataLoader shuffle in the build", "dropout forward in the build"],
)
def test_random_calls_replay_cannot_position_are_refused(init, because):
    model = _built(init, True)
    assert_refused(model, because=because)


def test_a_fork_rng_in_another_thread_open_across_the_builds_end():
    """A validation thread samples inside fork_rng while the build ends; it restores the
    generator after. Nothing of the build depends on it: exact, or refused saying so."""

    def build(replayable: bool) -> nn.Module:
        turns = Turns(3)
        built: dict[str, nn.Module] = {}

        def main() -> None:
            with _context(replayable):
                with turns(0):
                    built["m"] = nn.Sequential(nn.Linear(3, 3))
                turns.wait(2)  # the validation thread drew inside its fork_rng
            with turns(2):
                pass  # the build has ended

        def validation() -> None:
            with contextlib.ExitStack() as forked:
                with turns(1):
                    forked.enter_context(torch.random.fork_rng())
                    torch.randn(5)
                turns.wait(3)

        torch.manual_seed(0)
        _run(main, validation)
        return built["m"]

    assert_exact_or_refused(build(True), build(False), "0.weight", because=_DRAWN_PAST)


class _Holder(nn.Module):
    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("noise", tensor)


def _from_a_worker(size: int) -> torch.Tensor:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(torch.randn, size).result(_WAIT_S)


_SAVED: list[torch.Tensor] = []


def _noise_from_a_worker_then(after: Callable[[], None]) -> Callable[[nn.Module], None]:
    """A build whose noise buffer a worker thread draws (an init pool), then ``after``."""

    def init(self: nn.Module) -> None:
        self.a = nn.Linear(3, 3)
        self.h = _Holder(_from_a_worker(4))
        after()
        self.b = nn.Linear(3, 3)

    return init


UNSEEN_THEN = {
    "reseeded": lambda: torch.manual_seed(1),
    "state restored": lambda: torch.set_rng_state(_SAVED[0]),
}


@pytest.mark.xfail(
    strict=True,
    reason="silently wrong: a worker drew the noise from the marker state, and the reseed "
    "or set_rng_state after it hides that from the check at the build's end",
)
@pytest.mark.parametrize("then", UNSEEN_THEN)
def test_an_unseen_draw_into_the_build_then_a_reseed(then):
    torch.manual_seed(5)
    _SAVED[:] = [torch.get_rng_state()]
    init = _noise_from_a_worker_then(UNSEEN_THEN[then])
    assert_exact_or_refused(_built(init, True), _built(init, False), "h.noise")


@pytest.mark.xfail(
    strict=True,
    reason="silently wrong: the build's later layer is refused, but a part holding the "
    "worker's noise (real, drawn from the marker state) is materialized as exact",
)
def test_an_unseen_draw_into_the_build_materialized_without_the_rest():
    init = _noise_from_a_worker_then(lambda: None)
    model, ref = _built(init, True), _built(init, False)
    assert_refused(model, "b.weight", because="drawn from by code metamode did not record")
    assert_exact_or_refused(nn.Sequential(model.a, model.h), nn.Sequential(ref.a, ref.h))


def _numpy_seeded_from_torch(self: nn.Module) -> None:
    self.a = nn.Linear(3, 3)
    rng = np.random.default_rng(torch.initial_seed())
    self.register_buffer("proj", torch.tensor(rng.standard_normal(4), dtype=torch.float32))


def _rng_state_kept(self: nn.Module) -> None:
    self.a = nn.Linear(3, 3)
    self.register_buffer("rng_state", torch.get_rng_state(), persistent=False)


@pytest.mark.xfail(
    strict=True,
    reason="silently wrong: after a draw skipped on meta, torch.initial_seed() and "
    "get_rng_state() in the build read the marker, not eager's seed and state",
)
@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize(
    "init",
    [_numpy_seeded_from_torch, _rng_state_kept],
    ids=["numpy seeded from initial_seed", "get_rng_state kept"],
)
def test_the_generators_seed_or_state_read_inside_the_build(init, include_buffers):
    assert_exact_or_refused(_built(init, True, include_buffers), _built(init, False))


def _scrambled_sobol(self: nn.Module) -> None:
    self.a = nn.Linear(3, 3)
    engine = torch.quasirandom.SobolEngine(2, scramble=True)
    self.register_buffer("points", engine.draw(3))


@pytest.mark.parametrize("include_buffers", MODES)
def test_a_scrambled_sobol_engine_after_a_skipped_draw(include_buffers):
    model = _built(_scrambled_sobol, True, include_buffers)
    assert_exact_or_refused(model, _built(_scrambled_sobol, False))


# == 4. settings changed during materialize =================================================


class _Gram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(256, 256))
        self.register_buffer("gram", self.w.detach() @ self.w.detach().T)


def test_precision_switched_between_the_replays_check_and_its_matmul(monkeypatch):
    torch.manual_seed(0)
    ref = _Gram()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=True, replayable=True):
        model = _Gram()
    go, changed, back = threading.Event(), threading.Event(), threading.Event()
    replaying = threading.Event()

    def serving_thread() -> None:
        assert go.wait(_WAIT_S)
        torch.set_float32_matmul_precision("medium")
        changed.set()
        assert back.wait(_WAIT_S)
        torch.set_float32_matmul_precision("highest")

    now, execute = settings_module.now, recording.execute

    def now_then_switched():
        current = now()
        if replaying.is_set() and not go.is_set():  # the GIL switches right after
            go.set()
            assert changed.wait(_WAIT_S)
        return current

    def execute_flagged(plan, done) -> None:
        replaying.set()
        try:
            execute(plan, done)
        finally:
            replaying.clear()

    monkeypatch.setattr(settings_module, "now", now_then_switched)
    monkeypatch.setattr(recording, "execute", execute_flagged)
    thread = threading.Thread(target=serving_thread)
    thread.start()
    try:
        assert metamode.is_materializable(model)
        before = Unchanged(model)
        try:
            metamode.materialize(model)
            refused = False
        except metamode.NotMaterializableError:
            before.check()
            refused = True
    finally:
        go.set()
        back.set()
        thread.join(_WAIT_S)
        monkeypatch.undo()
    if not refused:
        assert_same_tensors(model, ref)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("tiny", torch.full((3,), 1e-30) * 1e-10)  # subnormal


def test_flush_denormal_switched_on_after_the_build():
    torch.manual_seed(0)
    ref = _Tiny()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=True, replayable=True):
        model = _Tiny()
    assert torch.set_flush_denormal(True), "flush-denormal unsupported here"
    try:
        assert_refused(model, "tiny", because=r"set_flush_denormal\(False\)")
    finally:
        torch.set_flush_denormal(False)
    assert ref.tiny.ne(0).all()  # subnormal, as eager made them
    metamode.materialize(model)
    assert_same_tensors(model, ref)


class _TwoComputed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(256, 256))
        self.register_buffer("first", self.w.detach() @ self.w.detach().T)
        self.register_buffer("second", self.w.detach().T @ self.w.detach())


def test_a_setting_switched_after_the_first_install_leaves_nothing_changed(monkeypatch):
    """Another thread switches matmul precision once materialize installed one buffer and
    before it computes the next: refused, the first install undone."""
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=True, replayable=True):
        model = _TwoComputed()
    go, changed, back = threading.Event(), threading.Event(), threading.Event()

    def serving_thread() -> None:
        assert go.wait(_WAIT_S)
        torch.set_float32_matmul_precision("medium")
        changed.set()
        assert back.wait(_WAIT_S)
        torch.set_float32_matmul_precision("highest")

    execute = recording.execute

    def switched_after_the_first(plan, done) -> None:
        def first_then_switched(*args) -> None:
            done(*args)
            if not go.is_set():
                go.set()
                assert changed.wait(_WAIT_S)

        execute(plan, first_then_switched)

    monkeypatch.setattr(recording, "execute", switched_after_the_first)
    thread = threading.Thread(target=serving_thread)
    thread.start()
    try:
        before = Unchanged(model)
        with pytest.raises(metamode.NotMaterializableError, match="nothing was changed"):
            metamode.materialize(model)
        before.check()
    finally:
        go.set()
        back.set()
        thread.join(_WAIT_S)
        monkeypatch.undo()
    torch.manual_seed(0)
    materialize_exactly(model, _TwoComputed())


# == 5. PEFT adapters in every floating dtype ===============================================


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.v = nn.Linear(16, 16)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2)
        self.q = nn.Linear(16, 16)


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.conv = nn.Conv1d(16, 16, 3)
        self.q = nn.Linear(16, 16)


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.randn(2, 16, 8))
        self.q = nn.Linear(16, 16)


def _lora(**kwargs) -> Callable[[], object]:
    import peft

    kwargs.setdefault("target_modules", ["q", "v"])
    return lambda: peft.LoraConfig(r=4, **kwargs)


# name -> (base, config, base dtype, default dtype while adapting, how, second adapter)
PEFT_CASES = {
    "float32, autocast_adapter_dtype": (_Base, _lora(), None, None, "get", False),
    "float64 base, float64 adapter": (_Base, _lora(), torch.float64, torch.float64, "get", False),
    "bfloat16 base, bfloat16 adapter": (
        _Base,
        _lora(),
        torch.bfloat16,
        torch.bfloat16,
        "get",
        False,
    ),
    "bfloat16 base, bfloat16 adapter, injected": (
        _Base,
        _lora(),
        torch.bfloat16,
        torch.bfloat16,
        "inject",
        False,
    ),
    "float16 base, float16 adapter": (_Base, _lora(), torch.float16, torch.float16, "get", False),
    "two adapters in one block": (_Base, _lora(), None, None, "get", True),
    "two bfloat16 adapters in one block": (
        _Base,
        _lora(),
        torch.bfloat16,
        torch.bfloat16,
        "get",
        True,
    ),
    "MultiheadAttention": (
        _Attention,
        _lora(target_modules=["attn", "q"]),
        None,
        None,
        "get",
        False,
    ),
    "Embedding and Conv1d, bfloat16": (
        _Embedded,
        _lora(target_modules=["emb", "conv", "q"], init_lora_weights="gaussian"),
        torch.bfloat16,
        torch.bfloat16,
        "get",
        False,
    ),
    "target_parameters": (
        _Experts,
        _lora(target_modules=["q"], target_parameters=["experts.w"]),
        None,
        None,
        "get",
        False,
    ),
    "target_parameters, bfloat16": (
        _Experts,
        _lora(target_modules=["q"], target_parameters=["experts.w"]),
        torch.bfloat16,
        torch.bfloat16,
        "get",
        False,
    ),
    # refused: eager casts the float32 adapter to the base layer's dtype
    "float64 base, float32 adapter": (_Base, _lora(), torch.float64, None, "get", False),
    "bfloat16 base, float32 adapter": (_Base, _lora(), torch.bfloat16, None, "get", False),
    "MultiheadAttention, bfloat16 base": (
        _Attention,
        _lora(target_modules=["attn", "q"]),
        torch.bfloat16,
        None,
        "get",
        False,
    ),
    "target_parameters, bfloat16 base": (
        _Experts,
        _lora(target_modules=["q"], target_parameters=["experts.w"]),
        torch.bfloat16,
        None,
        "get",
        False,
    ),
}
_CAST = "casts it to the base layer's dtype"
PEFT_REFUSED = {
    "float64 base, float32 adapter",
    "bfloat16 base, float32 adapter",
    "MultiheadAttention, bfloat16 base",
    "target_parameters, bfloat16 base",
}
# PEFT's MultiheadAttention layer hands out new objects for these on each visit, eager too
_PEFT_RENEWED = (
    "base_model.model.attn.base_layer.in_proj_weight",
    "base_model.model.attn.base_layer.out_proj.base_layer.weight",
)


def _adapted(name: str, replayable: bool) -> nn.Module:
    import peft

    base, config, base_dtype, adapter_dtype, how, second = PEFT_CASES[name]
    torch.manual_seed(0)
    model = base()
    if base_dtype is not None:
        model = model.to(base_dtype)
    torch.manual_seed(1)
    dtype = default_dtype(adapter_dtype) if adapter_dtype else contextlib.nullcontext()
    with dtype, _context(replayable):
        if how == "get":
            model = peft.get_peft_model(model, config(), low_cpu_mem_usage=replayable)
        else:
            model = peft.inject_adapter_in_model(config(), model, low_cpu_mem_usage=replayable)
        if second:
            model.add_adapter("b", config(), low_cpu_mem_usage=replayable)
    return model


@pytest.fixture
def _peft_shim(one_intra_op_thread):
    with metamode.enabled("peft"):
        yield


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", PEFT_CASES)
def test_a_peft_adapter_in_its_dtype(_peft_shim, name):
    ref, model = _adapted(name, False), _adapted(name, True)
    assert any(t.is_meta for t in model.parameters())
    if name in PEFT_REFUSED and isinstance(model.base_model.model, _Attention):
        assert not metamode.is_materializable(model)  # its renewed objects: no Unchanged
        with pytest.raises(metamode.NotMaterializableError, match=_CAST):
            metamode.materialize(model)
        assert any(t.is_meta for t in model.parameters())
    elif name in PEFT_REFUSED:
        assert_refused(model, because=_CAST)
    else:
        materialize_exactly(model, ref, replaced=_PEFT_RENEWED)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_second_peft_adapter_added_before_the_first_is_materialized(_peft_shim, dtype):
    import peft

    def build(replayable: bool) -> nn.Module:
        torch.manual_seed(0)
        model = _Base().to(dtype)
        torch.manual_seed(1)
        with default_dtype(dtype), _context(replayable):
            model = peft.get_peft_model(model, _lora()(), low_cpu_mem_usage=replayable)
        with default_dtype(dtype), _context(replayable):
            model.add_adapter(
                "b", _lora(init_lora_weights="gaussian")(), low_cpu_mem_usage=replayable
            )
        return model

    ref, model = build(False), build(True)
    materialize_exactly(model, ref)


@pytest.mark.filterwarnings("ignore")
def test_a_peft_adapter_on_a_bfloat16_transformers_model_from_config(_peft_shim):
    import peft

    build = _tiny_transformers("llama bfloat16 from_config")
    config = _lora(target_modules=["q_proj", "v_proj"])
    torch.manual_seed(0)
    base = build()
    torch.manual_seed(1)
    with metamode.empty_weights(replayable=True):
        model = peft.get_peft_model(copy.deepcopy(base), config(), low_cpu_mem_usage=True)
    assert_refused(model, because=_CAST)


@pytest.mark.xfail(
    strict=True,
    reason="late failure: is_materializable accepts it and materialize raises torch's "
    "RuntimeError from the replayed normal_ instead of refusing upfront",
)
def test_an_init_eager_construction_rejects_is_refused_upfront():
    """A config's negative initializer range: eager's nn.init.normal_ raises; skipped on
    meta it does not, so the build ends. There are no eager values to give."""

    def init(self: nn.Module) -> None:
        self.w = nn.Parameter(torch.empty(4, 4))
        nn.init.normal_(self.w, 0.0, -0.02)

    with pytest.raises(RuntimeError, match="std"):
        _built(init, False)
    assert_refused(_built(init, True, True), "w")
