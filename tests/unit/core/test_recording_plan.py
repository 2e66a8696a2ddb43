"""The plan and the program format on hand-built programs: no recorder, no model."""

from __future__ import annotations

import torch

from metamode._core import recording
from metamode._core.recording.plan import Use
from metamode._core.recording.program import (
    Call,
    Draw,
    Origin,
    Program,
    ProgramState,
    Start,
    Storage,
    Stream,
    TensorRef,
)


def _ref(storage: int) -> TensorRef:
    return TensorRef(storage, torch.float32, (4,), (1,), 0)


def _program() -> Program:
    """s0 = empty; normal_(s0) draws; s1 = empty; uniform_(s1) draws; s2 = s0 * 2."""
    program = Program(state=ProgramState.CLOSED)
    program.streams.append(Stream(0, True))
    for _ in range(3):
        program.storages.append(Storage(Origin.CREATED, "cpu", 16, call=None))
    state = torch.Generator().manual_seed(0).get_state()

    def made(storage: int) -> Call:
        return Call(torch.empty, ((4,),), {}, (), (), (storage,), _ref(storage))

    def drawn(storage: int, start: Draw) -> Call:
        ref = _ref(storage)
        call = Call(torch.Tensor.normal_, (ref,), {}, (storage,), (storage,), (), ref)
        call.draws = (start,)
        call.target = call.covers = storage
        return call

    program.calls += [
        made(0),
        drawn(0, Draw(0, Start.ANCHOR, state=state)),
        made(1),
        drawn(1, Draw(0, Start.CONTINUE)),
        Call(torch.mul, (_ref(0), 2), {}, (0,), (), (2,), _ref(2)),
    ]
    for seq, call in enumerate(program.calls):
        call.seq = seq
    return program


def test_a_storage_computed_after_the_draws_replays_only_its_own_chain():
    # normal_ overwrites all of s0, so the empty() that made it is not needed
    program = _program()
    plan = recording.plan([(program, 2)])
    assert [(step.index, step.use) for step in plan.steps] == [(1, Use.VALUES), (4, Use.VALUES)]
    assert plan.refused == {}


def test_a_later_draw_replays_the_earlier_one_for_its_numbers_only():
    program = _program()
    plan = recording.plan([(program, 1)])
    uses = {step.index: step.use for step in plan.steps}
    assert uses == {1: Use.DRAWS, 3: Use.VALUES}


def test_a_pinned_storage_stays_refused_whatever_overwrites_it_and_taints_its_readers():
    program = _program()
    program.storages[0].pinned = "its memory was handed out"
    plan = recording.plan([(program, 0), (program, 2), (program, 1)])
    assert plan.refused == {
        (program.serial, 0): "its memory was handed out",
        (program.serial, 2): "its memory was handed out",
    }


def test_an_unknown_start_refuses_that_draw_and_every_draw_continuing_it():
    program = _program()
    program.calls[1].draws = (Draw(0, Start.UNKNOWN, reason="nobody recorded it"),)
    plan = recording.plan([(program, 0), (program, 1)])
    assert set(plan.refused) == {(program.serial, 0), (program.serial, 1)}
    for reason in plan.refused.values():
        assert reason.endswith("draws random numbers, and nobody recorded it")


def test_the_listing_names_every_call_its_writes_and_draws():
    lines = _program().listing().splitlines()
    assert lines[0].startswith("<metamode program") and len(lines) == 6
    assert "draws stream 0 (anchor)" in lines[2] and "writes s0" in lines[2]
    assert "draws stream 0 (continue)" in lines[4]
    assert lines[5].split() == [
        "4",
        "s2:float32[4]",
        "=",
        "_VariableFunctionsClass.mul(s0:float32[4],",
        "2)",
    ]
