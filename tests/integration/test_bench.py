"""``python -m metamode bench``: its statistics, its tables, and a quick end-to-end run.

No timing is asserted anywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from metamode.lab import bench as _bench

# -- statistics and rendering ---------------------------------------------------------


def _record(section, model, method, rep, seconds):
    task = {"section": section, "model": model, "method": method, "rep": rep}
    return {"task": task, "result": {"ok": True, "cpu_s": seconds, "wall_s": seconds}}


def test_ratios_are_medians_of_paired_ratios_not_ratios_of_medians():
    records = [
        _record("skeleton", "m", "torch.device", 0, 1.0),
        _record("skeleton", "m", "metamode", 0, 2.0),
        _record("skeleton", "m", "torch.device", 1, 10.0),
        _record("skeleton", "m", "metamode", 1, 10.0),
        _record("skeleton", "m", "torch.device", 2, 4.0),
        _record("skeleton", "m", "metamode", 2, 6.0),
    ]
    summary = _bench.summarise(records, "cpu")
    cell = summary["skeleton|m|metamode"]
    assert cell["median_s"] == 6.0
    assert cell["ratios"] == [2.0, 1.0, 1.5] and cell["ratio"] == 1.5
    assert _bench.paired(summary, "skeleton", "m", "metamode", "torch.device") == 1.5


def test_tables_render_with_rich_and_as_plain_text(capsys, monkeypatch):
    table = _bench.Table("title", ["method", "llama-7b"], [["metamode", "1.0 ms  0.70x"]])
    _bench.print_tables([table], plain=False)
    with_rich = capsys.readouterr().out
    monkeypatch.setattr(_bench, "_has_rich", lambda: False)
    _bench.print_tables([table], plain=False)
    plain = capsys.readouterr().out
    for out in (with_rich, plain):
        assert "title" in out and "metamode" in out and "0.70x" in out
    assert plain.strip() == _bench.render_plain(table).strip()
    for progress in (_bench._RichProgress(1), _bench._PlainProgress(1)):
        with progress:
            progress.start("skeleton llama-7b metamode (rep 1)")
            progress.finish("1.0 ms")
    assert "[   1/1]" in capsys.readouterr().err


def test_without_optional_packages_the_pure_torch_workload_still_runs():
    args = _bench._parser().parse_args([])
    plan = _bench.make_plan(args, {name: False for name in _bench._OPTIONAL})
    assert plan.skeleton_models == ["torch-7b"]
    assert plan.skeleton_methods == ["none", "torch.device", "metamode", "metamode+buffers"]
    assert plan.lora_models == [] and plan.thread_model is None and plan.packages == []
    quick = _bench.make_plan(_bench._parser().parse_args(["--quick"]), {})
    assert quick.skeleton_models == ["torch-7b"] and quick.reps == 3


# -- the command ----------------------------------------------------------------------


@pytest.mark.slow
def test_bench_quick_runs_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "metamode",
            "bench",
            "--quick",
            "--tiny",
            "--reps",
            "2",
            "--plain",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "metamode vs the stock path" in done.stdout and "targets met" not in done.stdout
    data = json.loads(out.read_text())
    records = [r for r in data["records"] if r["task"]["section"] != "size"]
    sections = {r["task"]["section"] for r in records}
    assert sections == {"skeleton", "lora", "threads", "idle"}
    failed = [(r["task"], r["result"].get("error")) for r in records if not r["result"]["ok"]]
    assert not failed
    skeleton = {r["task"]["method"] for r in records if r["task"]["section"] == "skeleton"}
    assert skeleton == set(_bench.SKELETON_METHODS)
    for record in records:
        task, result = record["task"], record["result"]
        assert result["cpu_s"] > 0 and result["wall_s"] > 0
        if task["section"] == "skeleton":
            on_meta = result["devices"].get("meta", 0)
            assert (on_meta == 0) == (task["method"] == "none"), task
        if task["section"] == "idle":
            assert result["metamode_imported"] == (task["method"] == "imported+enabled")
        if task["section"] in ("lora", "threads") and "shim" in task["method"]:
            assert result["problems"] == [] and not result.get("leaked"), task
    assert {row["comparison"] for row in data["comparison"]} >= {
        "empty_weights() / torch.device('meta')",
        "LoRA injection: shim / stock PEFT (low_cpu_mem_usage=True)",
    }
