"""``python -m metamode bench-record``: its table, its fallback, its callgrind mode.

No instruction count or time is asserted beyond being positive and consistent.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import metamode
from metamode._core.recording import recorder
from metamode.lab import bench_record

CALLGRIND_PROBLEMS = bench_record.callgrind_problems()
ROW = re.compile(
    r"^(?P<model>\S+)\s+(?P<mode>params-only|include_buffers=True)\s+"
    r"(?P<plain>[\d,.]+)\s+(?P<replayable>[\d,.]+)\s+(?P<ratio>\d+\.\d{3})x$"
)


def _bench_record(*args: str, env: dict[str, str] | None = None, timeout: float = 600):
    return subprocess.run(
        [sys.executable, "-m", "metamode", "bench-record", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _rows(stdout: str) -> list[dict[str, str]]:
    return [m.groupdict() for line in stdout.splitlines() if (m := ROW.match(line))]


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _check_rows(stdout: str, model: str, modes: list[str]) -> list[dict[str, str]]:
    rows = _rows(stdout)
    assert [(r["model"], r["mode"]) for r in rows] == [(model, mode) for mode in modes], stdout
    for row in rows:
        plain, replayable = _number(row["plain"]), _number(row["replayable"])
        assert plain > 0 and replayable > 0, row
        # the ratio is of the unrounded numbers: bound it by the printed ones' rounding
        half = 0.5 if "," in row["plain"] + row["replayable"] or "." not in row["plain"] else 0.005
        low, high = (replayable - half) / (plain + half), (replayable + half) / (plain - half)
        assert low - 5e-4 <= float(row["ratio"]) <= high + 5e-4, row
    return rows


def test_the_total_is_read_from_totals_not_from_the_header_summary():
    dump = "\n".join(
        [
            "# callgrind format",
            "events: Ir",
            "summary: 0",
            "fn=(1) f",
            "0 7",
            "totals: 1234",
        ]
    )
    assert bench_record.parse_callgrind_total(dump) == 1234
    two_events = "events: Ir Dr\nsummary: 50 9\n"
    assert bench_record.parse_callgrind_total(two_events) == 50
    with pytest.raises(ValueError, match="no Ir event"):
        bench_record.parse_callgrind_total("events: Dr\ntotals: 3\n")


def test_wall_mode_prints_a_row_per_mode_with_its_ratio():
    done = _bench_record("--mode", "wall", "--model", "torch-small", "--tiny", "--reps", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("torch-small (tiny): wall time of the build (seconds, not instr")
    assert lines[1].split() == ["model", "mode", "plain", "ms", "replayable", "ms", "ratio"]
    _check_rows(done.stdout, "torch-small", ["params-only", "include_buffers=True"])


def test_log_only_swaps_the_recorder_for_one_that_only_appends():
    done = _bench_record(
        "--mode", "wall", "--model", "torch-small", "--tiny", "--reps", "1", "--log-only"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == (
        "replayable: a recorder that only appends each call to a list (--log-only)"
    )
    _check_rows(done.stdout, "torch-small", ["params-only", "include_buffers=True"])


def test_a_log_only_recorder_logs_every_call_and_records_nothing():
    saved = {name: vars(recorder.Recorder)[name] for name in ("record", "registered", "close")}
    try:
        bench_record._log_only()
        with metamode.empty_weights(replayable=True) as context:
            torch.nn.Linear(2, 2)
        log = context._recorder.log
        assert any(call[0] is torch.nn.init.kaiming_uniform_ for call in log)
        assert not context._recorder.program.calls
    finally:
        for name, method in saved.items():
            setattr(recorder.Recorder, name, method)


def test_call_time_only_swaps_the_recorder_for_one_that_analyses_nothing():
    done = _bench_record(
        "--mode", "wall", "--model", "torch-small", "--tiny", "--reps", "1", "--call-time-only"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == (
        "replayable: a recorder that reads at call time only what a later analysis could "
        "not, and analyses nothing (--call-time-only)"
    )
    _check_rows(done.stdout, "torch-small", ["params-only", "include_buffers=True"])


def test_a_call_time_recorder_reads_what_cannot_wait_and_records_nothing():
    saved = {name: vars(recorder.Recorder)[name] for name in ("record", "registered", "close")}
    try:
        bench_record._call_time_only()
        torch.manual_seed(7)
        with torch.autocast("cpu"), metamode.empty_weights(replayable=True) as context:
            linear = torch.nn.Linear(2, 2)
        assert torch.initial_seed() != 7  # each skipped draw set its marker
        log = context._recorder.log
        draw = next(call for call in log if call[0] is torch.nn.init.kaiming_uniform_)
        assert draw[4] is not None and draw[4].autocast  # the thread state, read then
        assert draw[5][0] == 0 and draw[5][2][0] == (2, 2)  # version, storage, geometry
        registrations = [entry for entry in log if entry[2] is linear]
        assert [entry[3] for entry in registrations] == ["weight", "bias"]
        assert not context._recorder.program.calls
    finally:
        for name, method in saved.items():
            setattr(recorder.Recorder, name, method)


def test_common_deferred_swaps_the_recorder_for_one_that_defers_a_builds_common_events():
    done = _bench_record(
        "--mode", "wall", "--model", "torch-small", "--tiny", "--reps", "1", "--common-deferred"
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == (
        "replayable: a recorder that defers the skipped calls, tensorless factory calls and "
        "registrations, reading at call time what a later analysis could not, and analyses "
        "the other calls as they happen (--common-deferred)"
    )
    _check_rows(done.stdout, "torch-small", ["params-only", "include_buffers=True"])


def test_a_common_deferred_recorder_logs_the_common_events_and_records_the_rest():
    names = ("_made", "_skipped", "registered", "close")
    saved = {name: vars(recorder.Recorder)[name] for name in names}
    try:
        bench_record._common_deferred()
        torch.manual_seed(7)
        with metamode.empty_weights(replayable=True) as context:
            linear = torch.nn.Linear(2, 2)
            linear.register_buffer("steps", torch.arange(3) * 2)
        assert torch.initial_seed() != 7  # each skipped draw set its marker
        log = context._recorder.log
        draw = next(event for event in log if event[0] is torch.nn.init.kaiming_uniform_)
        assert draw[3] is linear.weight and draw[5][0] == 0 and draw[5][2][0] == (2, 2)
        factories = {event[0] for event in log if event[0] in (torch.empty, torch.arange)}
        assert factories == {torch.empty, torch.arange}  # tensorless factory calls
        assert [event[3] for event in log if event[2] is linear] == ["weight", "bias", "steps"]
        recorded = [call.func for call in context._recorder.program.calls]
        assert recorded == [torch.Tensor.mul]  # the other calls are analysed as they happen
    finally:
        for name, method in saved.items():
            setattr(recorder.Recorder, name, method)


def test_without_names_each_part_the_recorder_skips():
    done = _bench_record(
        "--mode", "wall", "--model", "torch-small", "--tiny", "--reps", "1",
        "--include-buffers", "false", "--without", "markers,registrations",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[:2] == [
        "replayable: without the generator marker work of each draw (state read, marker "
        "seed) (--without markers)",
        "replayable: without the bookkeeping of each registered parameter and buffer "
        "(--without registrations)",
    ]
    _check_rows(done.stdout, "torch-small", ["params-only"])


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--without", "markers,bogus"], "expected parts of markers, thread-state, registrations"),
        (["--without", ","], "expected parts of markers, thread-state, registrations"),
        (["--log-only", "--without", "markers"], "not allowed with --log-only"),
        (["--call-time-only", "--without", "markers"], "not allowed with --call-time-only"),
        (["--common-deferred", "--without", "markers"], "not allowed with --common-deferred"),
        (["--common-deferred", "--log-only"], "not allowed with argument --common-deferred"),
        (["--log-only", "--call-time-only"], "not allowed with argument --log-only"),
    ],
)
def test_without_refuses_unknown_parts_and_log_only(args, error):
    done = _bench_record("--mode", "wall", "--model", "torch-small", "--tiny", *args)
    assert done.returncode == 2 and done.stdout == ""
    assert error in done.stderr and "Traceback" not in done.stderr


def test_each_knocked_out_part_is_skipped_and_the_rest_still_recorded():
    from metamode._core.recording import thread_state

    saved = (
        recorder.before_draw,
        recorder.mark,
        thread_state.current,
        vars(recorder.Recorder)["registered"],
    )
    try:
        bench_record._knock_out(("markers", "thread-state", "registrations"))
        state = torch.get_rng_state()
        with torch.autocast("cpu"), metamode.empty_weights(replayable=True) as context:
            torch.nn.Linear(2, 2)
        program = context._recorder.program
        assert torch.equal(torch.get_rng_state(), state)  # no marker was set
        assert not program.markers
        assert all(call.state is None for call in program.calls)  # autocast not read
        assert not context._recorder._registered  # no registration kept
        assert any(call.func is torch.nn.init.kaiming_uniform_ for call in program.calls)
    finally:
        recorder.before_draw, recorder.mark, thread_state.current = saved[:3]
        recorder.Recorder.registered = saved[3]  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="unknown recorder parts"):
        bench_record._knock_out(("bogus",))


def test_without_valgrind_callgrind_mode_refuses_and_auto_says_it_fell_back(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # neither valgrind nor cc
    refused = _bench_record("--mode", "callgrind", "--model", "torch-small", env=env)
    assert refused.returncode == 2 and refused.stdout == ""
    assert "--mode callgrind: `valgrind` is not on PATH" in refused.stderr
    assert "apt-get install valgrind" in refused.stderr and "Traceback" not in refused.stderr

    auto = _bench_record(
        "--model", "torch-small", "--tiny", "--reps", "1", "--include-buffers", "false", env=env
    )
    assert auto.returncode == 0, auto.stdout[-3000:] + auto.stderr[-3000:]
    assert auto.stdout.splitlines()[0] == (
        "callgrind unavailable (`valgrind` is not on PATH; no C compiler (`cc`) on PATH): "
        "WALL TIME, not instructions"
    )
    _check_rows(auto.stdout, "torch-small", ["params-only"])


@pytest.mark.slow
@pytest.mark.skipif(
    bool(CALLGRIND_PROBLEMS),
    reason=f"callgrind mode cannot run here: {'; '.join(CALLGRIND_PROBLEMS)}",
)
def test_callgrind_mode_counts_the_build_and_keeps_its_dumps(tmp_path):
    keep = tmp_path / "dumps"
    done = _bench_record(
        "--mode", "callgrind", "--model", "torch-small", "--tiny", "--keep", str(keep)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("torch-small (tiny): instructions executed by the build")
    rows = _check_rows(done.stdout, "torch-small", ["params-only", "include_buffers=True"])
    for row, kind in zip(rows, ("params", "buffers"), strict=True):
        for side in ("plain", "replayable"):
            dump = (keep / f"callgrind.torch-small.{kind}.{side}").read_text()
            assert bench_record.parse_callgrind_total(dump) == int(row[side].replace(",", ""))
