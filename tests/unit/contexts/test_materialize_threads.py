"""materialize runs while another thread builds in a replayable context: both exact."""

from __future__ import annotations

import threading

import torch

import metamode
from tests.unit.contexts.test_materialize import Custom, _tensors

_WAIT_S = 60.0  # guards against a hang; never used for ordering


def test_materialize_while_another_thread_records_a_build():
    torch.manual_seed(4)
    ref_a = Custom()
    torch.manual_seed(4)
    with metamode.empty_weights(replayable=True):
        model_a = Custom()

    inside = threading.Event()
    materialized = threading.Event()
    built: dict[str, object] = {}
    errors: list[BaseException] = []

    def builder() -> None:
        try:
            torch.manual_seed(5)  # seeds the (process-wide) default generator
            with metamode.empty_weights(replayable=True):
                first = torch.nn.Linear(8, 8)  # noqa: F841 (part of the build)
                inside.set()
                assert materialized.wait(_WAIT_S)
                built["b"] = Custom()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=builder)
    thread.start()
    assert inside.wait(_WAIT_S)
    state = torch.default_generator.get_state()
    metamode.materialize(model_a)  # while the builder's context is open and recording
    assert torch.equal(torch.default_generator.get_state(), state)
    materialized.set()
    thread.join(_WAIT_S)
    assert not errors, errors
    for name, tensor in _tensors(ref_a).items():
        assert torch.equal(_tensors(model_a)[name], tensor), name

    # the builder's trace saw none of the replay: its model materializes exactly
    # to an eager build with the same calls (a Linear first, then Custom)
    torch.manual_seed(5)
    torch.nn.Linear(8, 8)
    ref_b = Custom()
    model_b = built["b"]
    metamode.materialize(model_b)
    for name, tensor in _tensors(ref_b).items():
        assert torch.equal(_tensors(model_b)[name], tensor), name
