"""transformers 4.x: ``enable()`` works and concurrent loads are safe.

Runs only where transformers 4.x is installed (``requires_transformers_4``;
deselected elsewhere by tests/conftest.py), e.g. ``/work/venvs/tf4``.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import metamode
from tests.conftest import REPO, run_python

pytestmark = [pytest.mark.requires_transformers_4, pytest.mark.per_interpreter]

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

CONFIG = dict(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)


def _save(directory, drop: tuple[str, ...] = ()) -> None:
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**CONFIG)).save_pretrained(directory)
    if drop:
        path = directory / "model.safetensors"
        state = load_file(path)
        for key in drop:
            del state[key]
        save_file(state, path, metadata={"format": "pt"})


def _load(directory, **kwargs):
    torch.manual_seed(1234)
    model = GPT2LMHeadModel.from_pretrained(directory, **kwargs)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, torch.get_rng_state(), model.lm_head.weight is model.transformer.wte.weight


@pytest.fixture(scope="module", autouse=True)
def _transformers_loaded_once(tmp_path_factory):
    """transformers' first from_pretrained adds nn.Module.smart_apply (its own, known
    class change: metamode/_diagnostics/known_changes.py): make it happen before the
    per-test torch-state guard."""
    directory = tmp_path_factory.mktemp("warm")
    _save(directory)
    GPT2LMHeadModel.from_pretrained(directory)


def test_enable_applies_what_fits_transformers_4():
    result = metamode.enable()
    try:
        assert "transformers.modeling_utils.no_init_weights" in result["transformers"]
        assert "transformers.integrations.accelerate.init_empty_weights" in result["transformers"]
        assert metamode.is_enabled("transformers")
    finally:
        metamode.disable()
    import transformers.modeling_utils as modeling_utils

    assert modeling_utils._init_weights is True
    assert modeling_utils.no_init_weights.__module__ == "transformers.modeling_utils"


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
@pytest.mark.parametrize(
    "drop", [(), ("transformer.ln_f.weight", "transformer.h.0.attn.c_attn.weight")]
)
def test_transformers_4_shim_loads_exactly_the_stock_model(tmp_path, drop, low_cpu_mem_usage):
    _save(tmp_path, drop)
    stock = _load(tmp_path, low_cpu_mem_usage=low_cpu_mem_usage)
    with metamode.enabled():
        shimmed = _load(tmp_path, low_cpu_mem_usage=low_cpu_mem_usage)
    assert torch.equal(shimmed[1], stock[1]), "different random draws"
    assert shimmed[2] == stock[2]
    assert shimmed[0].keys() == stock[0].keys()
    for key, value in stock[0].items():
        assert torch.equal(shimmed[0][key], value), key


_RACE = r"""
import json, pathlib, sys, tempfile, threading, torch
sys.path.insert(0, {root!r})
import metamode
from transformers import GPT2Config, GPT2LMHeadModel
import transformers.modeling_utils as modeling_utils
ENABLE = {enable!r}
d = pathlib.Path(tempfile.mkdtemp())
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config(**{config!r})).save_pretrained(d)
reference = {{k: v.clone() for k, v in GPT2LMHeadModel.from_pretrained(d).state_dict().items()}}
torch.manual_seed(5)
reference_layer = torch.nn.Linear(4, 4).weight.detach().clone()
def patched():
    init = torch.nn.init
    return (torch.nn.Module.register_parameter, init.normal_, init.kaiming_uniform_)
originals = patched()
if ENABLE:
    metamode.enable()

class Gated(GPT2LMHeadModel):
    gate = None
    def __init__(self, config):
        super().__init__(config)
        if Gated.gate is not None:
            Gated.gate(self)

corrupted = 0
for round_ in range(3):
    a_in, b_in, a_out, bystander_done = (threading.Event() for _ in range(4))
    def gate(model):
        if threading.current_thread().name == "A":
            a_in.set(); b_in.wait(30); bystander_done.wait(30)
        else:
            b_in.set(); a_out.wait(30)
    Gated.gate = gate
    loaded, problems = {{}}, []
    def load(name):
        loaded[name] = Gated.from_pretrained(d)
        if name == "A":
            a_out.set()
    def bystander():
        a_in.wait(30); b_in.wait(30)
        torch.manual_seed(5)
        layer = torch.nn.Linear(4, 4)
        if layer.weight.is_meta:
            problems.append("bystander weight on meta")
        elif not torch.equal(layer.weight, reference_layer):
            problems.append("bystander weight not initialised")
        bystander_done.set()
    threads = [threading.Thread(target=load, args=("A",), name="A"),
               threading.Thread(target=load, args=("B",), name="B"),
               threading.Thread(target=bystander)]
    for t in threads: t.start()
    for t in threads: t.join(60)
    Gated.gate = None
    if patched() != originals:
        problems.append("torch left patched")
    if not bool(modeling_utils._init_weights):
        problems.append("_init_weights left False")
    if torch.nn.Linear(2, 2).weight.is_meta:
        problems.append("main thread builds on meta")
    for name, model in loaded.items():
        state = model.state_dict()
        if any(state[k].is_meta or not torch.equal(state[k], v) for k, v in reference.items()):
            problems.append(f"load {{name}} differs")
    corrupted += bool(problems)
    if problems:
        print(round_, problems, file=sys.stderr)
        if not ENABLE:
            break
print(json.dumps({{"corrupted": corrupted}}))
"""


@pytest.mark.parametrize("enable", [False, True])
def test_concurrent_from_pretrained_with_a_bystander(enable):
    """Stock leaks (A enters, B enters, A exits, B restores A's patches); enable() fixes it."""

    root = str(REPO)
    result = run_python(_RACE.format(root=root, enable=enable, config=CONFIG))
    if enable:
        assert result == {"corrupted": 0}
    else:
        assert result["corrupted"] >= 1, json.dumps(result)


def test_init_weights_flag_is_per_thread():
    import transformers.modeling_utils as modeling_utils

    inside, release, seen = threading.Event(), threading.Event(), []
    with metamode.enabled("transformers"):

        def load_context():
            with modeling_utils.no_init_weights():
                seen.append(bool(modeling_utils._init_weights))
                inside.set()
                release.wait(30)

        thread = threading.Thread(target=load_context)
        thread.start()
        assert inside.wait(30)
        seen.append(bool(modeling_utils._init_weights))
        release.set()
        thread.join(30)
    assert seen == [False, True]


def test_enable_refuses_while_a_stock_no_init_weights_block_is_open():
    # Its exit would restore the plain True it saw over the shim's per-thread flag, and
    # the shim would then silently stop skipping init_weights (review finding).
    import transformers.modeling_utils as modeling_utils

    with modeling_utils.no_init_weights():  # stock: the shim is off
        with pytest.raises(RuntimeError, match="no_init_weights"):
            metamode.enable()
        assert not metamode.is_enabled("transformers") and not metamode.is_enabled("peft")
    assert modeling_utils._init_weights is True
    assert metamode.enable()["transformers"]
    metamode.disable()
