"""Idioms against two process-wide states the shims manage, after ``metamode.enable()``.

transformers 5's ``PreTrainedModel.initialize_weights`` runs in a dtype window of
``dtype_windows.default_for_this_thread()``. Checked: no thread holding a window waits on a
thread that needs an init window in another dtype (a join is detected as the joined thread
parked on a window, then released, so a deadlock is a failed assertion and never a hang);
each model is bitwise the one a lone load (or stock, for a load nested in another) builds,
every parameter and buffer, non-persistent ones included; the default dtype ends where it
was, no window stays open, ``torch.nn.init`` is unchanged; and where two loads in one dtype
wait for each other's phases.

torch's device-constructor table (``torch.utils._device._device_constructors()``), built when
metamode's core is first imported: a stock ``meta_device_safe_creation_ops`` open in another
thread does not reach it, ``doctor`` reports a replacement in it and repairs it, and what
happens when metamode is first used inside that patch.

Every interleaving is forced with Events, a registration hook or an overridden method, never
a sleep; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import metamode
from metamode import _torch
from metamode._core import dtype_windows
from metamode.integrations import _registry
from metamode.lab import dtype_loads
from metamode.lab.threads import WAIT_S, wait
from tests.conftest import REPO, run_python
from tests.integration.test_dtype_loads_server_idioms import (
    _LEFT_CLEAN,
    _left,
    _notify_windows,
    _tensors,
    _until,
)

pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"), pytest.mark.per_interpreter]


def _xglm_config() -> Any:
    """XGLM builds its non-persistent sinusoidal position buffer with
    ``.to(torch.get_default_dtype())``, in its constructor and again in ``_init_weights``."""
    from transformers import XGLMConfig

    return XGLMConfig(
        vocab_size=64, d_model=16, ffn_dim=32, num_layers=1, attention_heads=2,
        max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip


def _unflagged_xglm() -> nn.Module:
    """An XGLM built under ``torch.device("meta")`` (transformers skips its init there, so no
    module is marked initialised), then given uninitialised cpu memory: the model a user
    calls ``init_weights()`` on to initialise it in full."""
    from transformers import XGLMForCausalLM

    with torch.device("meta"):
        model = XGLMForCausalLM(_xglm_config())
    return model.to_empty(device="cpu")


# -- gates: a callback run once, in one thread, at one point of its load ------------------------

_GATES: dict[tuple[str, int], Callable[[], None]] = {}


def _gate(phase: str) -> None:
    callback = _GATES.pop((phase, threading.get_ident()), None)
    if callback is not None:
        callback()


@contextlib.contextmanager
def _build_gates() -> Iterator[None]:
    """A ``"build"`` gate runs at its thread's first parameter registration (inside its build,
    so inside a load's construction window)."""
    hook = nn.modules.module.register_module_parameter_registration_hook
    handle = hook(lambda *_: _gate("build"))
    try:
        yield
    finally:
        handle.remove()
        _GATES.clear()


class _Call:
    """``call`` in a daemon thread, with gates by phase; what it returned or raised."""

    def __init__(self, call: Callable[[], Any], **gates: Callable[[], None]) -> None:
        self.call, self.gates = call, gates
        self.reached = {phase: threading.Event() for phase in gates}
        self.done = threading.Event()
        self.ident: int | None = None
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> _Call:
        self.thread.start()
        return self

    def _run(self) -> None:
        self.ident = threading.get_ident()
        for phase, callback in self.gates.items():
            _GATES[(phase, self.ident)] = functools.partial(self._at, phase, callback)
        _notify_windows()
        try:
            self.result = self.call()
        except BaseException as error:
            self.result = error
        finally:
            for phase in self.gates:
                _GATES.pop((phase, self.ident), None)
            self.done.set()
            _notify_windows()

    def _at(self, phase: str, callback: Callable[[], None]) -> None:
        self.reached[phase].set()
        _notify_windows()
        callback()

    def parked(self, state: dtype_windows.WindowState) -> bool:
        return self.ident is not None and self.ident in state.parked

    def parked_for(self) -> str | None:
        dtype = dtype_windows.state().parked.get(self.ident)  # type: ignore[arg-type]
        return None if dtype is None else str(dtype)

    def finish(self) -> None:
        """Join, bounded: a thread still blocked is a failure, not a hang."""
        if self.thread.ident is not None:
            self.thread.join(WAIT_S)
            assert not self.thread.is_alive(), "a thread is still blocked"


# -- what a model and the process are left with ---------------------------------------------


def _differences(got: Any, expected: Any, buffers_only: bool = False) -> list[str]:
    """Every parameter's and buffer's dtype, device and bits (non-persistent buffers
    included); with ``buffers_only`` the parameters' dtypes and the buffers' bits."""
    if isinstance(got, BaseException) or isinstance(expected, BaseException):
        return [] if type(got) is type(expected) else [f"got {got!r}, expected {expected!r}"]
    found = []
    mine, theirs = _tensors(got), _tensors(expected)
    buffers = dict(expected.named_buffers(remove_duplicate=False))
    for name, want in theirs.items():
        have = mine.get(name)
        if have is None:
            found.append(f"{name} missing")
        elif (have.dtype, have.device) != (want.dtype, want.device):
            found.append(f"{name} is {have.dtype} on {have.device}, expected {want.dtype}")
        elif (not buffers_only or name in buffers) and not torch.equal(have, want):
            found.append(f"{name} values differ")
    return found[:3]


def _error(result: Any) -> str | None:
    return f"{type(result).__name__}: {result}"[:200] if isinstance(result, BaseException) else None


# -- models and checkpoints ------------------------------------------------------------------


@functools.cache
def _classes() -> Any:
    from types import SimpleNamespace

    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config
    from transformers import XGLMForCausalLM

    class GatedXGLM(XGLMForCausalLM):
        """Runs this thread's ``"missing"`` gate when ``from_pretrained`` is about to
        initialise what the checkpoint lacks (after the build, outside any window of its
        own), and its ``"init"`` gate inside ``initialize_weights`` (inside the init window:
        smart_apply ends with the top model)."""

        def _initialize_missing_keys(self, *args: Any, **kwargs: Any) -> Any:
            _gate("missing")
            return super()._initialize_missing_keys(*args, **kwargs)

        def _initialize_weights(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            _gate("init")
            return super()._initialize_weights(module, *args, **kwargs)

    class Joiner(ModelMixin, ConfigMixin):
        """A diffusers model whose constructor runs this thread's ``"inside"`` gate: inside
        ``from_pretrained``'s window, which diffusers holds until the call returns."""

        @register_to_config
        def __init__(self, width: int = 4) -> None:
            super().__init__()
            self.proj = nn.Linear(width, width)
            _gate("inside")

    class Outer(ModelMixin, ConfigMixin):
        """A diffusers model whose constructor loads an XGLM in float32 and builds another
        with XGLM's constructor: models built inside a load, in the same thread."""

        @register_to_config
        def __init__(self, xglm_path: str = "", width: int = 4) -> None:
            super().__init__()
            self.proj = nn.Linear(width, width)
            self.loaded = XGLMForCausalLM.from_pretrained(xglm_path, dtype=torch.float32)
            self.built = XGLMForCausalLM(_xglm_config())

    return SimpleNamespace(GatedXGLM=GatedXGLM, Joiner=Joiner, Outer=Outer)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    import diffusers
    import transformers
    from transformers import XGLMForCausalLM

    transformers.logging.set_verbosity_error()
    diffusers.utils.logging.set_verbosity_error()
    classes = _classes()
    root = tmp_path_factory.mktemp("init-window")
    paths = {name: str(root / name) for name in ("xglm", "joiner", "outer")}
    torch.manual_seed(0)
    XGLMForCausalLM(_xglm_config()).save_pretrained(paths["xglm"])
    classes.Joiner().save_pretrained(paths["joiner"])
    classes.Outer(xglm_path=paths["xglm"]).save_pretrained(paths["outer"])
    return paths


def _xglm(path: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def load() -> nn.Module:
        return _classes().GatedXGLM.from_pretrained(path, **kwargs)

    return load


# -- a thread holding a window joins one that runs transformers' init ----------------------------


def _works(paths: dict[str, str]) -> dict[str, Callable[[], Any]]:
    """What the joined thread runs, by name."""
    from transformers import AutoModelForCausalLM, XGLMForCausalLM

    existing = _unflagged_xglm()

    def inside(context: Callable[[], Any]) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            with context():
                return XGLMForCausalLM(_xglm_config())

        return build

    return {
        "nn.Linear": lambda: nn.Linear(4, 4),
        "constructor": lambda: XGLMForCausalLM(_xglm_config()),
        "init_weights": existing.init_weights,
        "constructor-in-torch.device-meta": inside(lambda: torch.device("meta")),
        "constructor-in-empty_weights": inside(metamode.empty_weights),
        "constructor-in-empty_weights-include_buffers": inside(
            lambda: metamode.empty_weights(include_buffers=True)
        ),
        "constructor-in-empty_weights-replayable": inside(
            lambda: metamode.empty_weights(replayable=True)
        ),
        "from_config-float16": lambda: AutoModelForCausalLM.from_config(
            _xglm_config(), dtype=torch.float16
        ),
        "from_config": lambda: AutoModelForCausalLM.from_config(_xglm_config()),
        "from_pretrained-float16": lambda: XGLMForCausalLM.from_pretrained(
            paths["xglm"], dtype=torch.float16
        ),
    }


def worker_joined_inside_a_load(paths: dict[str, str], work: str) -> dict[str, Any]:
    """A loads the diffusers ``Joiner`` in float16; its constructor (inside the window) starts
    W, running ``work``, and waits for W as a join does: until W is done. If W parks on a
    dtype window instead (there a join never returns), A records it and goes on."""
    init_functions = dtype_loads.init_functions()
    w = _Call(_works(paths)[work])
    seen: dict[str, Any] = {}

    def joins() -> None:
        w.start()
        _until(lambda s: w.done.is_set() or w.parked(s), "W done or parked")
        seen["worker_parked_while_joined"] = not w.done.is_set()

    a = _Call(
        lambda: _classes().Joiner.from_pretrained(
            paths["joiner"], torch_dtype=torch.float16, low_cpu_mem_usage=False
        ),
        inside=joins,
    )
    a.start()
    a.finish()
    w.finish()
    return {
        **seen,
        "load_error": _error(a.result),
        "worker_error": _error(w.result),
        **_left(init_functions),
    }


_JOINED = {
    "worker_parked_while_joined": False,
    "load_error": None,
    "worker_error": None,
    **_LEFT_CLEAN,
}


def _parks(reason: str) -> Any:
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)


@pytest.mark.parametrize(
    "work",
    [
        "nn.Linear",
        "constructor",
        "init_weights",
        "constructor-in-torch.device-meta",
        "constructor-in-empty_weights",
        "constructor-in-empty_weights-include_buffers",
        "constructor-in-empty_weights-replayable",
        "from_config-float16",
        pytest.param(
            "from_config",
            marks=_parks(
                "from_config given no dtype runs in a float32 window, which parks until A's "
                "float16 window closes (docs/limitations.md names a load given no dtype)"
            ),
        ),
        pytest.param(
            "from_pretrained-float16",
            marks=_parks(
                "W builds in A's float16, then its init window (float32) parks until A's "
                "window closes (docs/limitations.md names a load waiting for one in its own "
                "dtype)"
            ),
        ),
    ],
)
def test_a_load_joining_a_worker_that_builds_a_model(saved, all_shims, work):
    assert worker_joined_inside_a_load(saved, work) == _JOINED


@pytest.mark.parametrize(
    "work", ["constructor", "init_weights", "constructor-in-empty_weights", "from_config"]
)
def test_stock_libraries_complete_the_same_joins(saved, work):
    """Without ``enable()`` no thread ever parks: the join returns, the process is clean."""
    assert worker_joined_inside_a_load(saved, work) == _JOINED


# -- init after the build, beside another thread's float16 build ---------------------------------


def _after_the_build(paths: dict[str, str], idiom: str) -> Callable[[], nn.Module]:
    """``idiom``: a GatedXGLM load with these arguments; or ``init_weights`` on a float32
    XGLM the thread holds uninitialised. Both run the thread's ``"missing"`` gate first."""
    if idiom == "init_weights":

        def reinitialise() -> nn.Module:
            model = _unflagged_xglm()
            _gate("missing")
            torch.manual_seed(8)
            model.init_weights()
            return model

        return reinitialise
    kwargs = {
        "float32": {"dtype": torch.float32},
        "float32-device_map-cpu": {"dtype": torch.float32, "device_map": "cpu"},
        "float32-low_cpu_mem_usage": {"dtype": torch.float32, "low_cpu_mem_usage": True},
        "bfloat16": {"dtype": torch.bfloat16},
        "float64": {"dtype": torch.float64},
    }[idiom]
    return _xglm(paths["xglm"], **kwargs)


def init_beside_a_float16_build(paths: dict[str, str], idiom: str) -> dict[str, Any]:
    """A runs ``idiom``; at its ``"missing"`` gate (after its build) it starts B, loading XGLM
    in float16, and waits until B is inside its build (its first parameter registration),
    parked or done; B waits there until A is done or parked. A's initialisation thus starts
    while B's float16 window is open. Each model against a lone run of its idiom."""
    first = _after_the_build(paths, idiom)
    second = _xglm(paths["xglm"], dtype=torch.float16)
    alone = [first(), second()]
    init_functions = dtype_loads.init_functions()
    b = _Call(
        second, build=lambda: _until(lambda s: a.done.is_set() or a.parked(s), "A done or parked")
    )

    def start_b() -> None:
        b.start()
        _until(lambda s: b.reached["build"].is_set() or b.done.is_set() or b.parked(s), "B")

    a = _Call(first, missing=start_b)
    with _build_gates():
        a.start()
        a.finish()
        b.finish()
    return {
        "first": _differences(a.result, alone[0]),
        "second": _differences(b.result, alone[1]),
        **_left(init_functions),
    }


@pytest.mark.parametrize(
    "idiom",
    [
        "float32",
        "float32-device_map-cpu",
        "float32-low_cpu_mem_usage",
        "bfloat16",
        "float64",
        pytest.param(
            "init_weights",
            marks=pytest.mark.xfail(
                strict=True,
                raises=AssertionError,
                reason="init_weights() called directly opens no window: a bystander "
                "(docs/limitations.md), so XGLM's positions read the other thread's float16",
            ),
        ),
    ],
)
def test_init_after_the_build_beside_a_float16_build_is_a_lone_runs(saved, all_shims, idiom):
    assert init_beside_a_float16_build(saved, idiom) == {"first": [], "second": [], **_LEFT_CLEAN}


# -- two loads in one dtype -------------------------------------------------------------------


def same_dtype_phases(paths: dict[str, str], dtype: torch.dtype) -> dict[str, Any]:
    """Two XGLM loads in ``dtype``. (1) A, inside its init window, starts B and waits until B
    is inside its build, parked or done: the dtype B is parked for, if any. (2) A, inside its
    build, starts B and waits until B is done or parked: likewise. Parked threads are let go
    as soon as they are seen; each model against a lone load."""
    load = _xglm(paths["xglm"], dtype=dtype)
    alone = load()
    init_functions = dtype_loads.init_functions()
    seen: dict[str, Any] = {}

    def a_done_or_parked(a: Callable[[], _Call]) -> Callable[[], None]:
        return lambda: _until(lambda s: a().done.is_set() or a().parked(s), "A done or parked")

    with _build_gates():
        b1 = _Call(load, build=a_done_or_parked(lambda: a1))

        def a1_init() -> None:
            b1.start()
            _until(lambda s: b1.reached["build"].is_set() or b1.done.is_set() or b1.parked(s), "B")
            seen["B's build, while A initialises, parked for"] = b1.parked_for()

        a1 = _Call(load, init=a1_init)
        a1.start()
        a1.finish()
        b1.finish()

        b2 = _Call(load)

        def a2_build() -> None:
            b2.start()
            _until(lambda s: b2.done.is_set() or b2.parked(s), "B done or parked")
            seen["B's load, while A builds, parked for"] = b2.parked_for()

        a2 = _Call(load, build=a2_build)
        a2.start()
        a2.finish()
        b2.finish()
        results = [a1.result, b1.result, a2.result, b2.result]
    seen["differences"] = [d for r in results for d in _differences(r, alone)]
    return {**seen, **_left(init_functions)}


@pytest.mark.parametrize(
    ("dtype", "parked_for"),
    [
        (torch.float16, ("torch.float16", "torch.float32")),
        (torch.bfloat16, ("torch.bfloat16", "torch.float32")),
        (torch.float32, (None, None)),
    ],
)
def test_same_dtype_loads_take_turns_between_build_and_init(saved, all_shims, dtype, parked_for):
    """What two loads in one dtype do: in float16 or bfloat16, one's init window (float32)
    and the other's build window exclude each other, so their build and init phases run in
    turn (the loads still overlap while reading weights); in float32 they never wait."""
    assert same_dtype_phases(saved, dtype) == {
        "B's build, while A initialises, parked for": parked_for[0],
        "B's load, while A builds, parked for": parked_for[1],
        "differences": [],
        **_LEFT_CLEAN,
    }


def transformers_load_beside_a_diffusers_load(paths: dict[str, str]) -> dict[str, Any]:
    """A loads the diffusers ``Joiner`` in float16; inside its constructor (its window is
    open until ``from_pretrained`` returns) it starts B, loading XGLM in float16, and waits
    until B is done or parked: the dtype B is parked for, if any. Then A goes on."""
    second = _xglm(paths["xglm"], dtype=torch.float16)
    alone = second()
    init_functions = dtype_loads.init_functions()
    b = _Call(second)
    seen: dict[str, Any] = {}

    def start_b() -> None:
        b.start()
        _until(lambda s: b.done.is_set() or b.parked(s), "B done or parked")
        seen["B parked for"] = b.parked_for()

    a = _Call(
        lambda: _classes().Joiner.from_pretrained(paths["joiner"], torch_dtype=torch.float16),
        inside=start_b,
    )
    a.start()
    a.finish()
    b.finish()
    return {
        **seen,
        "first": [_error(a.result)] if _error(a.result) else [],
        "second": _differences(b.result, alone),
        **_left(init_functions),
    }


def test_a_float16_transformers_load_beside_a_float16_diffusers_load(saved, all_shims):
    """What a float16 pipeline's text encoder load does beside another pipeline's float16
    diffusers load: it builds in the shared float16 window, then parks for its float32 init
    window until the diffusers ``from_pretrained`` call returns."""
    assert transformers_load_beside_a_diffusers_load(saved) == {
        "B parked for": "torch.float32",
        "first": [],
        "second": [],
        **_LEFT_CLEAN,
    }


# -- toggling the shims around an init window ------------------------------------------------


def toggle_around_an_init_window(paths: dict[str, str], toggle: str) -> dict[str, Any]:
    """With the shims on, A loads XGLM in float32. ``in-init``: A waits inside its init window
    while the shims are disabled (and, for ``-enable``, enabled again and B loads XGLM in
    float16, which must park until A's window closes). ``parked-for-init``: A is parked for
    its init window behind B's float16 build when the shims are disabled; then B finishes
    while A waits inside its initialisation (after disable(), both initialise through
    stock's process-wide guard, whose spans must nest), then A. Each model against a lone
    load."""
    first = _xglm(paths["xglm"], dtype=torch.float32)
    second = _xglm(paths["xglm"], dtype=torch.float16)
    with metamode.enabled():
        alone = [first(), second()]
    init_functions = dtype_loads.init_functions()
    release_a, release_b, b_finished = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, Any] = {}
    metamode.enable()
    try:
        with _build_gates():
            if toggle.startswith("in-init"):
                a = _Call(first, init=lambda: wait(release_a, "the toggle"))
                b = _Call(second)
                a.start()
                wait(a.reached["init"], "A inside its init window")
                _registry.disable()
                if toggle == "in-init-then-enable":
                    metamode.enable()
                    b.start()
                    _until(lambda s: b.parked(s) or b.done.is_set(), "B parked")
                    seen["b_parked_for"] = b.parked_for()
                release_a.set()
            else:
                a = _Call(
                    first,
                    missing=lambda: wait(release_a, "B inside its build"),
                    init=lambda: wait(b_finished, "B finished"),
                )
                b = _Call(second, build=lambda: wait(release_b, "disable()"))
                a.start()
                wait(a.reached["missing"], "A built")
                b.start()
                wait(b.reached["build"], "B inside its build")
                release_a.set()
                _until(lambda s: a.parked(s) or a.done.is_set(), "A parked")
                seen["a_parked_for"] = a.parked_for()
                _registry.disable()
                release_b.set()
                b.finish()
                b_finished.set()
            a.finish()
            b.finish()
    finally:
        release_a.set()
        release_b.set()
        b_finished.set()
        _registry.disable()
    return {
        **seen,
        "first": _differences(a.result, alone[0]),
        "second": [] if b.thread.ident is None else _differences(b.result, alone[1]),
        **_left(init_functions),
    }


@pytest.mark.parametrize(
    ("toggle", "seen"),
    [
        ("in-init", {}),
        ("in-init-then-enable", {"b_parked_for": "torch.float16"}),
        ("parked-for-init", {"a_parked_for": "torch.float32"}),
    ],
)
def test_toggling_the_shims_around_an_init_window(saved, toggle, seen):
    assert toggle_around_an_init_window(saved, toggle) == {
        **seen,
        "first": [],
        "second": [],
        **_LEFT_CLEAN,
    }


def test_an_init_that_raises_closes_its_window(saved, all_shims):
    """``_init_weights`` raising inside the init window of a float16 load, in a diffusers
    float16 window: the error reaches the caller, every window is closed, the default back."""
    init_functions = dtype_loads.init_functions()

    def boom() -> None:
        raise RuntimeError("init failed")

    _GATES[("init", threading.get_ident())] = boom
    try:
        with pytest.raises(RuntimeError, match="init failed"):
            _classes().GatedXGLM.from_pretrained(saved["xglm"], dtype=torch.float16)
    finally:
        _GATES.clear()
    _GATES[("inside", threading.get_ident())] = lambda: _classes().GatedXGLM(_xglm_config())
    _GATES[("init", threading.get_ident())] = boom
    try:
        with pytest.raises(RuntimeError, match="init failed"):
            _classes().Joiner.from_pretrained(saved["joiner"], torch_dtype=torch.float16)
    finally:
        _GATES.clear()
    assert _left(init_functions) == _LEFT_CLEAN


# -- models built inside a load, in the same thread; init called by user code ------------------


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_models_built_inside_a_diffusers_load_are_stocks(saved, low_cpu_mem_usage):
    """``Outer`` loaded in float16: its XGLM loaded in float32 and its XGLM built with the
    constructor, in the same thread, both initialised inside diffusers' float16 window (stock
    reads float16 there too). Bitwise stock's, position buffers included."""
    classes = _classes()

    def load() -> nn.Module:
        torch.manual_seed(6)
        return classes.Outer.from_pretrained(
            saved["outer"], torch_dtype=torch.float16, low_cpu_mem_usage=low_cpu_mem_usage
        )

    stock = load()
    init_functions = dtype_loads.init_functions()
    with metamode.enabled():
        shimmed = load()
    assert _differences(shimmed, stock) == []
    assert _left(init_functions) == _LEFT_CLEAN


def _user_init(idiom: str) -> nn.Module:
    from transformers import XGLMForCausalLM

    if idiom.startswith("empty_weights"):
        torch.manual_seed(4)
        include = idiom.endswith("include_buffers")
        with metamode.empty_weights(replayable=True, include_buffers=include):
            model = XGLMForCausalLM(_xglm_config())
        return metamode.materialize(model)
    model = _unflagged_xglm()
    torch.manual_seed(4)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(idiom.split("-")[-1])
    with metamode.default_dtype(dtype) if dtype is not None else contextlib.nullcontext():
        model.init_weights()
    return model


@pytest.mark.parametrize(
    "idiom",
    [
        "init_weights",
        "init_weights-in-default_dtype-float16",
        "init_weights-in-default_dtype-bfloat16",
        "empty_weights-replayable",
        "empty_weights-replayable-include_buffers",
    ],
)
def test_init_run_by_user_code_is_stocks(idiom):
    """``init_weights()`` called on a built model (also under ``metamode.default_dtype``), and
    a build in ``empty_weights(replayable=True)`` then ``materialize``: the same tensors as
    stock's ``init_weights()`` or eager construction, with the shims on."""
    if idiom.startswith("empty_weights"):
        from transformers import XGLMForCausalLM

        torch.manual_seed(4)
        stock = XGLMForCausalLM(_xglm_config())
    else:
        stock = _user_init(idiom)
    init_functions = dtype_loads.init_functions()
    with metamode.enabled():
        shimmed = _user_init(idiom)
    assert _differences(shimmed, stock) == []
    assert _left(init_functions) == _LEFT_CLEAN


# -- bounded stress ---------------------------------------------------------------------------


def test_barrier_rounds_of_loads_and_inits_in_four_dtypes(saved, all_shims):
    """6 rounds of four threads released by a barrier, 1 µs switch interval: XGLM loads in
    float16, float32 (``device_map="cpu"``) and bfloat16 (``low_cpu_mem_usage``), and a
    ``from_config`` in float16 (it draws from the shared generator: its parameters' dtypes
    and its buffers are compared). ``init_weights()`` called directly is a bystander."""
    from transformers import AutoModelForCausalLM

    idioms: dict[str, tuple[Callable[[], nn.Module], bool]] = {
        "float16": (_xglm(saved["xglm"], dtype=torch.float16), False),
        "float32-device_map": (
            _xglm(saved["xglm"], dtype=torch.float32, device_map="cpu"),
            False,
        ),
        "bfloat16-low_cpu": (
            _xglm(saved["xglm"], dtype=torch.bfloat16, low_cpu_mem_usage=True),
            False,
        ),
        "from_config-float16": (
            lambda: AutoModelForCausalLM.from_config(_xglm_config(), dtype=torch.float16),
            True,
        ),
    }
    alone = {name: call() for name, (call, _) in idioms.items()}
    init_functions = dtype_loads.init_functions()
    wrong: list[str] = []
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(6):
            barrier = threading.Barrier(len(idioms))

            def after(call: Callable[[], nn.Module], b: threading.Barrier = barrier) -> Any:
                b.wait(WAIT_S)
                return call()

            calls = {
                name: _Call(functools.partial(after, call)).start()
                for name, (call, _) in idioms.items()
            }
            for name, call in calls.items():
                call.finish()
                wrong += [
                    f"{name}: {d}"
                    for d in _differences(call.result, alone[name], idioms[name][1])[:1]
                ]
    finally:
        sys.setswitchinterval(previous)
    assert wrong == []
    assert _left(init_functions) == _LEFT_CLEAN


# -- torch's device-constructor table -----------------------------------------------------------


def _table() -> frozenset[int]:
    return frozenset(map(id, _torch.device_constructors()))


def _linspace_device_in(context: Callable[[], Any]) -> str:
    with context():
        return torch.linspace(0, 1, 3).device.type


def test_a_stock_patch_open_in_another_thread_does_not_reach_the_table(saved):
    """Without the shims, A's load waits inside its build, where stock's
    ``meta_device_safe_creation_ops`` has replaced ``torch.linspace`` process-wide. Meanwhile
    this thread builds under ``torch.device("meta")`` and runs ``doctor()``: the table keeps
    torch's own functions, and afterwards ``torch.linspace`` goes to meta under
    ``torch.device`` and ``empty_weights(include_buffers=True)``."""
    before, own_linspace = _table(), torch.linspace
    release = threading.Event()
    seen: dict[str, Any] = {}
    a = _Call(_xglm(saved["xglm"], dtype=torch.float32), build=lambda: wait(release, "checks"))
    with _build_gates():
        a.start()
        try:
            wait(a.reached["build"], "A inside its build")
            seen["linspace_replaced_meanwhile"] = torch.linspace is not own_linspace
            with torch.device("meta"):
                torch.zeros(2)
            seen["doctor_names_the_table"] = any(
                "_device_constructors" in f.target for f in metamode.doctor().findings
            )
        finally:
            release.set()
            a.finish()
    assert _error(a.result) is None
    assert seen == {"linspace_replaced_meanwhile": True, "doctor_names_the_table": False}
    assert _table() == before
    assert _linspace_device_in(lambda: torch.device("meta")) == "meta"
    assert _linspace_device_in(lambda: metamode.empty_weights(include_buffers=True)) == "meta"


def test_placing_linspace_beside_a_shimmed_load_in_another_thread(saved, all_shims):
    """With the shims on, A's load waits inside its build (its linspace rule is
    thread-scoped). Meanwhile this thread's ``torch.linspace`` goes to meta under accelerate's
    ``init_on_device(include_buffers=True)``, ``torch.set_default_device("meta")`` and
    ``empty_weights(include_buffers=True)``; the table is unchanged."""
    import accelerate

    before = _table()
    release = threading.Event()
    a = _Call(_xglm(saved["xglm"], dtype=torch.float32), build=lambda: wait(release, "checks"))
    devices = {}
    with _build_gates():
        a.start()
        try:
            wait(a.reached["build"], "A inside its build")
            devices["init_on_device"] = _linspace_device_in(
                lambda: accelerate.init_on_device(torch.device("meta"), include_buffers=True)
            )
            torch.set_default_device("meta")
            try:
                devices["set_default_device"] = torch.linspace(0, 1, 3).device.type
            finally:
                torch.set_default_device(None)
            devices["empty_weights"] = _linspace_device_in(
                lambda: metamode.empty_weights(include_buffers=True)
            )
        finally:
            release.set()
            a.finish()
    assert _error(a.result) is None
    assert devices == dict.fromkeys(
        ("init_on_device", "set_default_device", "empty_weights"), "meta"
    )
    assert _table() == before


def _table_target_in(findings: Any) -> bool:
    return any("_device_constructors" in f.target for f in findings)


class _ClearGate:
    """torch's table function, running ``before_clear`` when doctor clears it."""

    def __init__(self, table: Any, before_clear: Callable[[], None]) -> None:
        self.table, self.before_clear = table, before_clear

    def __call__(self) -> Any:
        return self.table()

    def cache_clear(self) -> None:
        self.before_clear()
        self.table.cache_clear()


def test_doctor_repair_while_another_thread_enters_the_patch_reports_it(monkeypatch):
    """The table is made to hold stock's linspace replacement. ``doctor(repair=True)``
    checks that no factory is replaced, then clears the table and rebuilds it; A enters
    stock's ``meta_device_safe_creation_ops`` at the clear, so the rebuild takes A's
    replacement. The report lists the table among what remains (it does not claim a clean
    table), and a repair once A has left restores torch's table."""
    from transformers.initialization import meta_device_safe_creation_ops

    before = _table()
    table = _torch.device_constructors
    with meta_device_safe_creation_ops():
        table.cache_clear()
        table()
    inside, release = threading.Event(), threading.Event()

    def enter_the_patch() -> None:
        with meta_device_safe_creation_ops():
            inside.set()
            wait(release, "the repair")

    a = _Call(enter_the_patch)

    def before_clear() -> None:
        if a.thread.ident is None:
            a.start()
            wait(inside, "A inside the patch")

    try:
        assert _table_target_in(metamode.doctor().findings)
        with monkeypatch.context() as patch:
            patch.setattr(_torch, "device_constructors", _ClearGate(table, before_clear))
            report = metamode.doctor(repair=True)
        assert a.thread.ident is not None, "the repair cleared no table"
        assert _table_target_in(report.remaining)
    finally:
        release.set()
        a.finish()
        metamode.doctor(repair=True)
    assert not _table_target_in(metamode.doctor().findings)
    assert _table() == before


def test_doctor_repair_of_the_table_fails_while_a_table_factory_is_replaced():
    """The table holds stock's linspace replacement, and ``torch.hann_window`` (a factory in
    the table) is replaced while ``doctor(repair=True)`` runs: the rebuilt table takes that
    replacement in, so the repair says it did not succeed."""
    from transformers.initialization import meta_device_safe_creation_ops

    before, own = _table(), torch.hann_window
    with meta_device_safe_creation_ops():
        _torch.device_constructors.cache_clear()
        _torch.device_constructors()
    torch.hann_window = lambda *args, **kwargs: own(*args, **kwargs)
    try:
        report = metamode.doctor(repair=True)
    finally:
        torch.hann_window = own
        metamode.doctor(repair=True)
    assert _table() == before
    table = [f for f in report.findings if "_device_constructors" in f.target]
    assert [f.repaired for f in table] == [False]


_FIRST_USE_INSIDE_A_PATCH = """
import json, sys, threading, warnings
sys.path.insert(0, {repo!r})
warnings.filterwarnings("ignore")
import torch
import transformers
from transformers.initialization import meta_device_safe_creation_ops
import metamode
report = {{"core_imported_by_import_metamode": "metamode._torch" in sys.modules}}
inside, release = threading.Event(), threading.Event()
def a():
    with meta_device_safe_creation_ops():
        inside.set()
        release.wait(60)
thread = threading.Thread(target=a)
thread.start()
inside.wait(60)
metamode.enable()
release.set()
thread.join(60)
from metamode import _torch
def table_holds_torch_linspace():
    return torch.linspace in _torch.device_constructors()
def on_meta():
    with torch.device("meta"):
        return torch.linspace(0, 1, 3).device.type
report["table_holds_torch_linspace"] = table_holds_torch_linspace()
report["linspace_under_torch.device_meta"] = on_meta()
report["doctor_names_the_table"] = any(
    "_device_constructors" in f.target for f in metamode.doctor().findings
)
remaining = metamode.doctor(repair=True).remaining
report["left_after_repair"] = [f.target for f in remaining]
report["linspace_under_torch.device_meta_after_repair"] = on_meta()
metamode.disable()
print(json.dumps(report))
"""


def test_metamode_first_used_inside_a_stock_patch_builds_the_table_there():
    """``import metamode`` alone does not build the table; ``metamode.enable()``, its first
    use here, runs while another thread is inside stock's ``meta_device_safe_creation_ops``,
    so the table keeps transformers' linspace (as when the process's first
    ``torch.device`` use runs inside that patch, docs/limitations.md): ``doctor`` names it
    and ``repair=True`` rebuilds it."""
    report = run_python(_FIRST_USE_INSIDE_A_PATCH.format(repo=str(REPO)), timeout=120)
    assert report == {
        "core_imported_by_import_metamode": False,
        "table_holds_torch_linspace": False,
        "linspace_under_torch.device_meta": "cpu",
        "doctor_names_the_table": True,
        "left_after_repair": [],
        "linspace_under_torch.device_meta_after_repair": "meta",
    }


_IMPORT_LOCK = """
import json, os, sys, tempfile, threading, warnings
sys.path.insert(0, {repo!r})
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
import diffusers, transformers
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
import metamode
from metamode._core import dtype_windows
transformers.logging.set_verbosity_error()
diffusers.utils.logging.set_verbosity_error()
directory = tempfile.mkdtemp()
with open(os.path.join(directory, "builds_at_import.py"), "w") as module:
    module.write(
        "from transformers import XGLMConfig, XGLMForCausalLM\\n"
        "MODEL = XGLMForCausalLM(XGLMConfig(vocab_size=64, d_model=16, ffn_dim=32, "
        "num_layers=1, attention_heads=2, max_position_embeddings=32))\\n"
    )
sys.path.insert(0, directory)
report = {{"worker_parked": False}}

class ImportsInside(ModelMixin, ConfigMixin):
    armed = False

    @register_to_config
    def __init__(self, width: int = 4):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        if not type(self).armed:
            return
        done = threading.Event()

        def worker():
            try:
                import builds_at_import  # noqa: F401
            finally:
                done.set()
                with dtype_windows._condition:
                    dtype_windows._condition.notify_all()

        w = threading.Thread(target=worker, daemon=True)
        w.start()
        dtype_windows.wait_until(lambda s: done.is_set() or w.ident in s.parked, 60)
        report["worker_parked"] = not done.is_set()
        import builds_at_import  # noqa: F401

path = os.path.join(directory, "imports-inside")
ImportsInside().save_pretrained(path)
metamode.enable()
ImportsInside.armed = True
a = threading.Thread(
    target=lambda: ImportsInside.from_pretrained(path, torch_dtype=torch.float16), daemon=True
)
a.start()
a.join(10)  # the worker's build takes milliseconds: still blocked after 10 s is a deadlock
report["load_returned"] = not a.is_alive()
print(json.dumps(report), flush=True)
os._exit(0)
"""


def test_a_load_importing_a_module_another_thread_builds_a_model_in():
    """A loads a diffusers model in float16 whose constructor starts W, importing a module
    that builds an XGLM with its constructor at import time, waits until W is done or parked,
    then imports that module itself. Run in a subprocess, bounded by a 10 s join."""
    report = run_python(_IMPORT_LOCK.format(repo=str(REPO)), timeout=120)
    assert report == {"worker_parked": False, "load_returned": True}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("checkpoint", ["complete", "missing-a-linear-weight"])
def test_a_lone_xglm_load_with_the_shims_is_stocks(saved, tmp_path, checkpoint, dtype):
    """One thread: the shims' window around the initialisation after the build changes
    nothing against stock, for a checkpoint that holds every weight and for one that lacks
    some (initialised from the generator), buffers and the generator state included."""
    from safetensors.torch import load_file, save_file
    from transformers import XGLMForCausalLM

    path = saved["xglm"]
    if checkpoint != "complete":
        shutil.copytree(path, tmp_path / "xglm")
        weights = tmp_path / "xglm" / "model.safetensors"
        state = load_file(weights)
        [dropped] = [k for k in state if k.endswith("layers.0.fc1.weight")]
        save_file({k: v for k, v in state.items() if k != dropped}, weights, {"format": "pt"})
        path = str(tmp_path / "xglm")
    torch.manual_seed(5)
    stock = XGLMForCausalLM.from_pretrained(path, dtype=dtype)
    stock_state = torch.get_rng_state()
    with metamode.enabled():
        torch.manual_seed(5)
        shimmed = XGLMForCausalLM.from_pretrained(path, dtype=dtype)
        assert torch.equal(torch.get_rng_state(), stock_state)
    assert dtype_loads.differences(shimmed, stock) == []
