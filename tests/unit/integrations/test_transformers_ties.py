"""transformers 5's ``no_tie_weights``: stock leaks its no-op; metamode's is thread-scoped.

Stock ``transformers.initialization.no_tie_weights()`` (entered by
``from_pretrained`` while it builds the model) assigns
``PreTrainedModel.tie_weights`` a no-op and restores what it captured. When
two loads overlap -- A enters, B enters (capturing A's no-op), A exits, B
exits -- B "restores" the no-op, and from then on every tied model the
process loads keeps ``lm_head.weight`` on meta, untied.

With the shim, ``initialization.no_tie_weights`` is metamode's
:class:`~metamode.integrations.transformers.NoTieWeights`: while it is on
the calling thread's mode stack, the parameter/buffer registration hooks keep
a module's existing tensor whenever ``PreTrainedModel.tie_weights`` assigns
another one -- the model comes out as stock's no-op leaves it, and no class
attribute changes. Every interleaving here is forced with events (never
sleeps); the stress loop is free-running on top.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import metamode
from metamode.lab.threads import run_threads as _run_threads
from metamode.lab.threads import wait as _wait
from tests.conftest import REPO, run_python
from tests.integration.test_integrations_hf import _Gates

pytestmark = pytest.mark.requires_transformers_5


_STRESS_ROUNDS = 10


# -- helpers (also run in a subprocess against stock transformers) -------------------


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def bert_config():
    """BertForMaskedLM: its tie also assigns a bias, and ``_adjust_bias`` pads one."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, tie_word_embeddings=True,
    )  # fmt: skip


def save_gpt2(directory: str) -> None:
    import transformers
    from transformers import GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config()).save_pretrained(directory)


def tie_state(model: nn.Module) -> dict[str, Any]:
    """Is ``lm_head`` tied to the input embedding, and is it real (not meta)?"""
    return {
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "lm_head_device": model.lm_head.weight.device.type,
    }


def stock_forced_overlap(directory: str) -> dict[str, Any]:
    """Two threads' ``no_tie_weights`` entered and exited A, B, A, B; then loads.

    Run against stock transformers (in a subprocess: it corrupts the class).
    Also a forced overlap of two real ``from_pretrained`` calls, after
    repairing the first leak, and a bystander building a tied model while
    another thread is inside the context.
    """
    import transformers.initialization as initialization
    from transformers import GPT2LMHeadModel
    from transformers.modeling_utils import PreTrainedModel

    save_gpt2(directory)
    original = vars(PreTrainedModel)["tie_weights"]
    result: dict[str, Any] = {"before": tie_state(GPT2LMHeadModel.from_pretrained(directory))}

    # 1. The context managers themselves, in the order that leaks.
    _contexts_a_b_a_b(initialization.no_tie_weights, {})
    leaked = vars(PreTrainedModel)["tie_weights"]
    result["contexts_leak"] = leaked is not original
    result["leaked_qualname"] = leaked.__qualname__
    result["after_contexts"] = tie_state(GPT2LMHeadModel.from_pretrained(directory))

    # 2. Two from_pretrained calls forced into the same order (repaired first).
    PreTrainedModel.tie_weights = original
    models = _forced_loads(directory, GPT2LMHeadModel)
    result["loads_leak"] = vars(PreTrainedModel)["tie_weights"] is not original
    result["after_loads"] = tie_state(GPT2LMHeadModel.from_pretrained(directory))
    result["loaded"] = [tie_state(model) for model in models]

    # 3. A bystander thread's tied model while another thread is inside.
    PreTrainedModel.tie_weights = original
    result["bystander"] = _bystander_while_inside(initialization.no_tie_weights)
    result["restored"] = vars(PreTrainedModel)["tie_weights"] is original
    return result


def _contexts_a_b_a_b(no_tie_weights, seen: dict[str, Any]) -> None:
    """Thread A enters, B enters, A exits, B exits; each records what it builds."""
    from transformers import GPT2LMHeadModel

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        with no_tie_weights():
            seen["a_inside"] = GPT2LMHeadModel(gpt2_config()).lm_head.weight
            seen["a_inside_model"] = GPT2LMHeadModel(gpt2_config())
            a_in.set()
            _wait(b_in, "B to enter")
        seen["a_after"] = GPT2LMHeadModel(gpt2_config())
        a_out.set()

    def b() -> None:
        _wait(a_in, "A to enter")
        with no_tie_weights():
            b_in.set()
            _wait(a_out, "A to exit")
            seen["b_inside_model"] = GPT2LMHeadModel(gpt2_config())

    _run_threads([a, b])


def _forced_loads(directory: str, model_class) -> list[nn.Module]:
    """A's ``from_pretrained`` is building when B's enters; A finishes, then B.

    The gate runs at each loader's first parameter registration, which is
    inside ``get_init_context``'s contexts.
    """
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    models: dict[str, nn.Module] = {}

    def load(key, entered, waits_for, gates) -> None:
        def gate() -> None:
            entered.set()
            _wait(waits_for, "the other loader")

        gates.arm(gate)
        try:
            models[key] = model_class.from_pretrained(directory)
        finally:
            entered.set()
            if key == "a":
                a_done.set()

    def b(gates) -> None:
        _wait(a_in, "A to enter")
        load("b", b_in, a_done, gates)

    with _Gates() as gates:
        _run_threads([lambda: load("a", a_in, b_in, gates), lambda: b(gates)])
    return [models["a"], models["b"]]


class _TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def _bystander_while_inside(no_tie_weights) -> dict[str, Any]:
    """Thread A holds ``no_tie_weights``; the bystander builds, then A builds."""
    from transformers import GPT2LMHeadModel

    inside, built = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def holder() -> None:
        with no_tie_weights():
            inside.set()
            _wait(built, "the bystander")
            pair = _TiedPair()
            seen["holder_pair_tied"] = pair.head.weight is pair.embed.weight
            seen["holder_gpt2_tied"] = tie_state(GPT2LMHeadModel(gpt2_config()))["tied"]

    def bystander() -> None:
        _wait(inside, "the holder to enter")
        linear = nn.Linear(4, 4)
        pair = _TiedPair()
        seen["linear_device"] = linear.weight.device.type
        seen["pair_tied"] = pair.head.weight is pair.embed.weight
        seen["gpt2_tied"] = tie_state(GPT2LMHeadModel(gpt2_config()))["tied"]
        built.set()

    _run_threads([holder, bystander])
    return seen


_STOCK_SUBPROCESS = """
import json, sys, warnings
sys.path.insert(0, {repo!r})
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
import metamode
assert not metamode.is_enabled("transformers")
from tests.unit.integrations.test_transformers_ties import stock_forced_overlap
print(json.dumps(stock_forced_overlap({directory!r})))
"""


@pytest.mark.slow  # a subprocess
@pytest.mark.per_interpreter
def test_stock_no_tie_weights_leaks_its_no_op_when_two_threads_overlap(tmp_path):
    """Stock is broken: one forced overlap leaves every later tied load untied, on meta."""
    result = run_python(_STOCK_SUBPROCESS.format(repo=str(REPO), directory=str(tmp_path)))
    assert result["before"] == {"tied": True, "lm_head_device": "cpu"}
    assert result["contexts_leak"] is True
    assert result["leaked_qualname"] == "no_tie_weights.<locals>.empty_func"
    assert result["after_contexts"] == {"tied": False, "lm_head_device": "meta"}
    assert result["loads_leak"] is True
    assert result["after_loads"] == {"tied": False, "lm_head_device": "meta"}
    # B built and loaded while the leaked no-op was already in place: B's model is broken too.
    assert result["loaded"][1] == {"tied": False, "lm_head_device": "meta"}
    # A thread that never entered the context does not tie either.
    assert result["bystander"]["gpt2_tied"] is False
    assert result["bystander"]["pair_tied"] is True  # a plain assignment is not tie_weights
    assert result["restored"] is True


# -- with the shim --------------------------------------------------------------------


@pytest.fixture
def shim() -> Iterator[None]:
    """The transformers shim on for one test; the class attribute checked afterwards."""
    from transformers.modeling_utils import PreTrainedModel

    original = vars(PreTrainedModel)["tie_weights"]
    try:
        with metamode.enabled("transformers"):
            yield
    finally:
        leaked = vars(PreTrainedModel)["tie_weights"]
        if leaked is not original:  # keep the rest of the suite usable, then fail
            PreTrainedModel.tie_weights = original
            pytest.fail(f"PreTrainedModel.tie_weights was left as {leaked!r}")


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("gpt2"))
    save_gpt2(directory)
    return directory


@pytest.fixture(scope="module", autouse=True)
def _transformers_initialised_once() -> None:
    """transformers' first cpu init adds nn.Module.smart_apply (its own, known class
    change: metamode/_diagnostics/known_changes.py): make it happen before the per-test
    torch-state guard."""
    from transformers import GPT2LMHeadModel

    GPT2LMHeadModel(gpt2_config())


def test_enable_rebinds_no_tie_weights_and_disable_restores_it():
    import transformers.initialization as initialization

    from metamode.integrations.transformers import NoTieWeights

    original = initialization.no_tie_weights
    result = metamode.enable()
    try:
        assert "transformers.initialization.no_tie_weights" in result["transformers"]
        assert "transformers.initialization.meta_device_safe_creation_ops" in result["transformers"]
        assert "transformers" not in result.left_alone
        assert isinstance(initialization.no_tie_weights(), NoTieWeights)
        assert metamode.enable_for_transformers() == tuple(sorted(result["transformers"]))
    finally:
        restored = metamode.disable()
    assert "transformers.initialization.no_tie_weights" in restored["transformers"]
    assert initialization.no_tie_weights is original


def test_modeling_utils_looks_no_tie_weights_up_at_call_time(shim):
    """``get_init_context`` calls ``init.no_tie_weights()``: it gets the shim's context."""
    from transformers import GPT2LMHeadModel

    from metamode.integrations.transformers import NoTieWeights

    contexts = GPT2LMHeadModel.get_init_context(torch.float32, False, False, None)
    assert sum(isinstance(context, NoTieWeights) for context in contexts) == 1


@pytest.mark.parametrize(
    "missing", [(), ("meta_device_safe_creation_ops",)], ids=["both", "no-linspace"]
)
def test_only_the_names_this_release_has_are_rebound(monkeypatch, missing):
    import transformers.initialization as initialization

    for name in missing:
        monkeypatch.delattr(initialization, name)
    try:
        bound = metamode.enable_for_transformers()
    finally:
        restored = metamode.disable_for_transformers()
    assert "transformers.initialization.no_tie_weights" in bound
    assert all(name.rsplit(".", 1)[1] not in missing for name in bound)
    assert restored == bound


def test_a_release_with_none_of_the_patches_is_left_alone(monkeypatch):
    import transformers.initialization as initialization
    import transformers.modeling_utils as modeling_utils

    monkeypatch.delattr(initialization, "meta_device_safe_creation_ops")
    monkeypatch.delattr(initialization, "no_tie_weights")
    monkeypatch.delattr(initialization, "guard_torch_init_functions")
    monkeypatch.delattr(modeling_utils, "local_torch_dtype")
    with metamode.enabled():
        result = metamode.enable()
        assert result["transformers"] == ()
        assert "no_tie_weights" in result.left_alone["transformers"]
        assert not metamode.is_enabled("transformers")


def test_forced_overlap_of_the_contexts_is_thread_scoped(shim):
    """A enters, B enters, A exits, B exits: nothing leaks, and each thread ties
    exactly when it is outside its own context."""
    import transformers.initialization as initialization
    from transformers.modeling_utils import PreTrainedModel

    original = vars(PreTrainedModel)["tie_weights"]
    seen: dict[str, Any] = {}
    _contexts_a_b_a_b(initialization.no_tie_weights, seen)
    assert vars(PreTrainedModel)["tie_weights"] is original
    assert tie_state(seen["a_inside_model"]) == {"tied": False, "lm_head_device": "cpu"}
    assert tie_state(seen["a_after"])["tied"] is True, "A ties again while B is still inside"
    assert tie_state(seen["b_inside_model"])["tied"] is False


def test_forced_overlap_of_two_loads_leaks_nothing(shim, gpt2_checkpoint):
    from transformers import GPT2LMHeadModel
    from transformers.modeling_utils import PreTrainedModel

    original = vars(PreTrainedModel)["tie_weights"]
    models = _forced_loads(gpt2_checkpoint, GPT2LMHeadModel)
    later = GPT2LMHeadModel.from_pretrained(gpt2_checkpoint)
    assert vars(PreTrainedModel)["tie_weights"] is original
    for model in (*models, later):
        assert tie_state(model) == {"tied": True, "lm_head_device": "cpu"}


def stress_loads(directory: str, rounds: int) -> dict[str, Any]:
    """Free-running: two threads released by a barrier per round, 1 µs switch interval."""
    import transformers
    from transformers import GPT2LMHeadModel
    from transformers.modeling_utils import PreTrainedModel

    transformers.logging.set_verbosity_error()
    save_gpt2(directory)
    original = vars(PreTrainedModel)["tie_weights"]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    loaded: list[nn.Module] = []
    leaks = 0
    try:
        for _ in range(rounds):
            barrier = threading.Barrier(2, timeout=60)

            def load(barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                loaded.append(GPT2LMHeadModel.from_pretrained(directory))

            _run_threads([load, load])
            leaks += vars(PreTrainedModel)["tie_weights"] is not original
    finally:
        sys.setswitchinterval(interval)
    states = [tie_state(model) for model in loaded]
    return {
        "leaks": leaks,
        "loaded": len(loaded),
        "bad": [s for s in states if s != {"tied": True, "lm_head_device": "cpu"}],
        "interval_restored": sys.getswitchinterval() == interval,
    }


_STRESS_SUBPROCESS = """
import json, sys, warnings
sys.path.insert(0, {repo!r})
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
import metamode
metamode.enable()
from tests.unit.integrations.test_transformers_ties import stress_loads
print(json.dumps(stress_loads({directory!r}, {rounds!r})))
"""


@pytest.mark.slow  # a subprocess
def test_concurrent_loads_stress_leak_nothing(tmp_path):
    """In a subprocess: concurrent loads still race on transformers' other global
    patches (``torch.nn.init`` around ``initialize_weights``; docs/limitations.md)."""
    result = run_python(
        _STRESS_SUBPROCESS.format(repo=str(REPO), directory=str(tmp_path), rounds=_STRESS_ROUNDS)
    )
    assert result == {
        "leaks": 0,
        "loaded": 2 * _STRESS_ROUNDS,
        "bad": [],
        "interval_restored": True,
    }


def test_a_bystander_thread_still_ties(shim):
    import transformers.initialization as initialization

    seen = _bystander_while_inside(initialization.no_tie_weights)
    assert seen == {
        "linear_device": "cpu",
        "pair_tied": True,
        "gpt2_tied": True,  # stock: False (the no-op is process-wide)
        # Inside the context, as stock: tie_weights does not tie, a plain assignment does.
        "holder_pair_tied": True,
        "holder_gpt2_tied": False,
    }


def _tie_in_code_named_tie_weights_from_modeling_utils():
    """A function that is not ``PreTrainedModel.tie_weights`` but has its name and file."""
    from transformers import modeling_utils

    source = "def tie_weights(pair):\n    pair[1].weight = pair[0].weight\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, modeling_utils.__file__, "exec"), namespace)
    pair = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    namespace["tie_weights"](pair)
    return pair[1].weight is pair[0].weight


@pytest.mark.per_interpreter
def test_only_pretrained_models_own_tie_weights_is_undone():
    """Stock replaces ``PreTrainedModel.tie_weights`` alone; so is the shim's rule."""
    import transformers.initialization as initialization

    with initialization.no_tie_weights():
        assert _tie_in_code_named_tie_weights_from_modeling_utils()  # stock
    with metamode.enabled("transformers"), initialization.no_tie_weights():
        assert _tie_in_code_named_tie_weights_from_modeling_utils()


def test_the_tie_weights_code_survives_a_stand_in_on_the_class(monkeypatch):
    from transformers.modeling_utils import PreTrainedModel

    from metamode.integrations import transformers as shim

    real = vars(PreTrainedModel)["tie_weights"].__code__
    monkeypatch.setattr(shim, "_TIE_WEIGHTS_CODE", type(shim._TIE_WEIGHTS_CODE)())
    with monkeypatch.context() as patched:
        patched.setattr(PreTrainedModel, "tie_weights", lambda self: None)  # as stock's no-op
        assert shim.no_tie_weights().code is None
    assert shim.no_tie_weights().code is real
    monkeypatch.setattr(PreTrainedModel, "tie_weights", lambda self: None)
    assert shim.no_tie_weights().code is real


# -- the shim builds and loads exactly stock's model ---------------------------------


def _ties(model: nn.Module) -> list[tuple[str, ...]]:
    groups: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        groups.setdefault(id(tensor), []).append(name)
    return sorted(tuple(names) for names in groups.values() if len(names) > 1)


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "devices": {k: v.device.type for k, v in model.state_dict().items()},
        "ties": _ties(model),
    }


def _assert_same(shim_model: dict[str, Any], stock_model: dict[str, Any]) -> None:
    assert shim_model["ties"] == stock_model["ties"]
    assert shim_model["devices"] == stock_model["devices"]
    assert shim_model["state"].keys() == stock_model["state"].keys()
    for key, value in stock_model["state"].items():
        other = shim_model["state"][key]
        assert other.dtype == value.dtype and other.shape == value.shape, key
        if value.device.type != "meta":
            assert torch.equal(other, value), key


def _build_inside(config_factory, model_name: str) -> dict[str, Any]:
    """Built as ``from_pretrained`` builds (on meta) and on cpu, inside ``no_tie_weights``."""
    import transformers
    import transformers.initialization as initialization

    model_class = getattr(transformers, model_name)
    built = {}
    for device in ("meta", "cpu"):
        torch.manual_seed(1)
        with torch.device(device), initialization.no_tie_weights():
            built[device] = _snapshot(model_class(config_factory()))
    return built


@pytest.mark.parametrize(
    ("config_factory", "model_name"),
    [(gpt2_config, "GPT2LMHeadModel"), (bert_config, "BertForMaskedLM")],
    ids=["gpt2", "bert"],
)
@pytest.mark.per_interpreter
def test_inside_the_context_the_model_is_built_as_stock_builds_it(config_factory, model_name):
    stock = _build_inside(config_factory, model_name)
    with metamode.enabled("transformers"):
        shimmed = _build_inside(config_factory, model_name)
    for device in ("meta", "cpu"):
        _assert_same(shimmed[device], stock[device])
    assert stock["cpu"]["ties"] == [], "stock's no-op leaves the model untied"


def _drop_key(directory: Path, key: str) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    assert key in tensors
    del tensors[key]
    save_file(tensors, str(path), metadata={"format": "pt"})


def _load(model_name: str, directory: Path) -> dict[str, Any]:
    import transformers

    torch.manual_seed(2)
    model, info = getattr(transformers, model_name).from_pretrained(
        str(directory), output_loading_info=True
    )
    return {**_snapshot(model), "info": {k: sorted(v) for k, v in info.items()}}


@pytest.mark.parametrize(
    ("config_factory", "model_name", "dropped"),
    [
        (gpt2_config, "GPT2LMHeadModel", None),
        (gpt2_config, "GPT2LMHeadModel", "transformer.h.0.mlp.c_fc.weight"),
        (gpt2_config, "GPT2LMHeadModel", "transformer.wte.weight"),
        (bert_config, "BertForMaskedLM", None),
        (bert_config, "BertForMaskedLM", "bert.embeddings.word_embeddings.weight"),
    ],
    ids=["gpt2", "gpt2-missing-mlp", "gpt2-missing-tied", "bert", "bert-missing-tied"],
)
@pytest.mark.per_interpreter
def test_from_pretrained_with_the_shim_equals_stock(tmp_path, config_factory, model_name, dropped):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    getattr(transformers, model_name)(config_factory()).save_pretrained(tmp_path)
    if dropped is not None:
        _drop_key(tmp_path, dropped)
    stock = _load(model_name, tmp_path)
    with metamode.enabled("transformers"):
        shimmed = _load(model_name, tmp_path)
    _assert_same(shimmed, stock)
    assert shimmed["info"] == stock["info"]
    assert stock["ties"], "loading ties again, outside the context"
    assert all(device == "cpu" for device in stock["devices"].values())
