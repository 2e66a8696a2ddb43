"""materialize(submodule): allocates only that submodule, with exactly the eager values.

The rule: a submodule's tensors get the values the eager build gave them. The
replay still draws the random numbers drawn before them (into scratch tensors it
frees at once), back to the latest generator state an earlier materialize of the
same build computed; it needs the memory of the submodule plus one scratch tensor
at a time.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

import metamode
from tests.unit.contexts.test_materialize import MODES, Custom, _tensors

pytestmark = pytest.mark.filterwarnings("ignore")


def _llama():
    return tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )


def _stack():
    return nn.Sequential(*[Custom() for _ in range(3)], nn.LSTM(8, 8))


_llama()  # transformers adds Module.smart_apply on first use: before the state guard

CASES = {
    "llama_layer_2": (_llama, lambda m: m.model.layers[2]),
    "llama_rotary": (_llama, lambda m: m.model.rotary_emb),
    "custom_stack_middle": (_stack, lambda m: m[1]),
    "custom_stack_last": (_stack, lambda m: m[3]),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_submodule_gets_its_eager_values_and_nothing_else_is_allocated(name, include_buffers):
    """Also: a tensor's value does not depend on what is materialized with it."""
    build, pick = CASES[name]
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = build()
    part = pick(model)
    inside = {id(t) for t in _tensors(part).values()}
    meta_outside = [key for key, t in _tensors(model).items() if t.is_meta and id(t) not in inside]
    assert meta_outside and inside
    assert metamode.materialize(part) is part
    want = _tensors(pick(ref))
    for key, tensor in _tensors(part).items():
        assert not tensor.is_meta, key
        assert torch.equal(tensor, want[key]), key
    now = _tensors(model)
    assert [key for key in meta_outside if not now[key].is_meta] == []
    # materializing the rest afterwards completes the eager model
    metamode.materialize(model)
    for key, tensor in _tensors(ref).items():
        assert torch.equal(_tensors(model)[key], tensor), key


def test_a_transformers_block_built_with_buffers_without_its_shim_is_eagers():
    """transformers' device probe sees, inside the replayable context, what eager
    construction sees, so its weight initialisation is recorded without the shim."""
    torch.manual_seed(0)
    ref = _llama()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=True, replayable=True):
        model = _llama()
    metamode.materialize(model.model.layers[1])
    want = _tensors(ref.model.layers[1])
    for key, tensor in _tensors(model.model.layers[1]).items():
        assert torch.equal(tensor, want[key]), key


def _steps(part: nn.Module) -> int:
    from metamode._contexts.materialize import _survey

    _, plan = _survey(part)
    assert plan is not None
    return len(plan.steps)


@pytest.mark.parametrize("include_buffers", MODES)
def test_blocks_materialized_in_order_each_replay_only_their_own_calls(include_buffers):
    """The state a block's draws start from was computed by the blocks before it."""

    def build():
        return nn.Sequential(*[Custom() for _ in range(4)])

    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = build()
    first, last_alone = _steps(model[0]), _steps(model[3])
    assert last_alone >= 2 * first  # alone, the last block replays every earlier draw
    state = torch.default_generator.get_state()
    for index, block in enumerate(model):
        if index:  # its own calls, and the draw of the block before's discarded head
            assert _steps(block) == first + 1, index
        metamode.materialize(block)
    assert torch.equal(torch.default_generator.get_state(), state)
    for key, tensor in _tensors(ref).items():
        assert torch.equal(_tensors(model)[key], tensor), key


@pytest.mark.parametrize("include_buffers", MODES)
def test_blocks_materialized_in_reverse_order_equal_eager(include_buffers):
    def build():
        return nn.Sequential(*[Custom() for _ in range(3)])

    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    with metamode.empty_weights(include_buffers=include_buffers, replayable=True):
        model = build()
    for block in reversed(model):
        metamode.materialize(block)
    for key, tensor in _tensors(ref).items():
        assert torch.equal(_tensors(model)[key], tensor), key
