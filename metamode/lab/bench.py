"""``python -m metamode bench``: empty-model construction, side by side.

Every number comes from a fresh process: a worker imports torch and the
optional libraries once, then forks one child per measurement (see
:mod:`metamode.lab.workloads`), so no measurement inherits a patch, a
registration hook or a warm cache from another. Each child first builds a
tiny version of its workload the same way (lazy imports, first-kernel costs),
then times one full-size build. Repetitions are interleaved -- repetition
``r`` of every method runs before repetition ``r + 1`` of any, in a rotated
order -- so drifting machine load hits all methods alike. The tables show
medians over repetitions, and ratios as the median of *paired* ratios
(method / baseline within the same repetition).

Sections:

* ``skeleton``: an empty model under no context (only where it fits in
  memory), accelerate's ``init_empty_weights`` (both ``include_buffers``),
  PEFT's copy of it, ``torch.device('meta')``, ``metamode.empty_weights()``
  and ``empty_weights(include_buffers=True)``;
* ``lora``: PEFT LoRA injection (r=16, every attention and feed-forward
  linear) into real base weights, ``low_cpu_mem_usage`` False / True stock /
  True through metamode's PEFT shim;
* ``threads``: 2 and 4 threads injecting into independent models at once vs
  the same injections one after another, stock and shim, and whether stock
  leaked its ``register_parameter`` patch;
* ``idle``: building a small model with real weights plus a forward pass,
  with metamode imported and enabled but no context active, vs not imported.

The pure-torch workload needs no optional package, so the command always
runs; the others are used when transformers / diffusers / PEFT / accelerate
are installed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metamode.lab.workloads import (
    IDLE_METHODS,
    LORA_METHODS,
    MODELS,
    SKELETON_METHODS,
    THREAD_FLAVOURS,
)

__all__ = ["main"]

# Importing it installs no metamode hooks (see metamode.lab): workers start clean.
WORKER = [sys.executable, "-m", "metamode.lab.workloads"]
_OPTIONAL = ("transformers", "diffusers", "peft", "accelerate")
_GIB = 1 << 30

METHOD_LABELS = {
    "none": "no context",
    "accelerate": "accelerate init_empty_weights()",
    "accelerate+buffers": "accelerate init_empty_weights(include_buffers=True)",
    "peft": "PEFT init_empty_weights()",
    "torch.device": "with torch.device('meta')",
    "metamode": "metamode.empty_weights()",
    "metamode+buffers": "metamode.empty_weights(include_buffers=True)",
}
METHOD_NEEDS = {"accelerate": "accelerate", "accelerate+buffers": "accelerate", "peft": "peft"}
MODEL_NEEDS = {name: needs for name, (_, _, needs) in MODELS.items()}
SKELETON_MODELS = ("torch-7b", "llama-7b", "llama-70b", "sdxl-unet")
LORA_MODELS = ("sdxl-unet", "llama-1b", "torch-small")
BASELINES = {
    "skeleton": "torch.device",
    "lora": "stock low_cpu_mem_usage=True",
    "idle": "not imported",
}
SECTIONS = ("skeleton", "lora", "threads", "idle")


# -- the plan -----------------------------------------------------------------------------


@dataclass
class Plan:
    reps: int
    tiny: bool
    skeleton_models: list[str]
    skeleton_methods: list[str]
    lora_models: list[str]
    thread_model: str | None
    thread_counts: list[int]
    idle_reps: int
    none_reps: int
    max_real_bytes: int
    packages: list[str]
    notes: list[str] = field(default_factory=list)


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def make_plan(args: argparse.Namespace, installed: dict[str, bool]) -> Plan:
    has = {name: installed.get(name, False) for name in _OPTIONAL}
    notes = [
        f"{name} not installed: its workloads/methods are left out"
        for name, ok in has.items()
        if not ok
    ]

    def usable(model: str) -> bool:
        return all(has[p] for p in MODEL_NEEDS[model])

    sections = set(args.sections.split(",")) if args.sections else set(SECTIONS)
    if args.quick:
        skeleton = ["llama-7b" if has["transformers"] else "torch-7b"]
        lora = ["llama-1b"] if has["transformers"] else []
        thread_counts = [2]
    else:
        skeleton = ["torch-7b", "llama-7b", "llama-70b", "sdxl-unet"]
        lora = ["sdxl-unet", "llama-1b"]
        thread_counts = [2, 4]
    if args.models:
        wanted = args.models.split(",")
        unknown = [m for m in wanted if m not in MODEL_NEEDS]
        if unknown:
            raise SystemExit(f"unknown model(s) {unknown}; choose from {sorted(MODEL_NEEDS)}")
        skeleton = [m for m in wanted if m in SKELETON_MODELS]
        lora = [m for m in wanted if m in LORA_MODELS]
    skeleton = [m for m in skeleton if usable(m)] if "skeleton" in sections else []
    methods = [m for m in SKELETON_METHODS if has.get(METHOD_NEEDS.get(m, ""), True)]
    if not has["peft"]:
        lora, thread_model = [], None
    else:
        lora = [m for m in lora if usable(m)] if "lora" in sections else []
        thread_model = "llama-1b" if has["transformers"] else "torch-small"
        if "threads" not in sections:
            thread_model = None
    available = _mem_available()
    if args.max_real_gib is not None:
        max_real = int(args.max_real_gib * _GIB)
    else:
        max_real = int(0.6 * available) if available else 4 * _GIB
    reps = args.reps or (3 if args.quick else 5)
    # The worker imports these once, before forking; none of them patches torch on import.
    packages = [name for name in _OPTIONAL if has[name]]
    return Plan(
        reps=reps,
        tiny=args.tiny,
        skeleton_models=skeleton,
        skeleton_methods=methods,
        lora_models=lora,
        thread_model=thread_model,
        thread_counts=thread_counts,
        idle_reps=(reps if args.quick else 2 * reps + 1) if "idle" in sections else 0,
        none_reps=min(args.none_reps, reps),
        max_real_bytes=max_real,
        packages=packages,
        notes=notes,
    )


def _rotated(items: list[Any], by: int) -> list[Any]:
    by %= max(len(items), 1)
    return items[by:] + items[:by]


def tasks_for_rep(plan: Plan, rep: int, skip: dict[tuple[str, str], str]) -> list[dict]:
    """Repetition ``rep`` of every measurement, methods in rotated order."""
    tasks: list[dict] = []
    for model in plan.skeleton_models:
        for method in _rotated(plan.skeleton_methods, rep):
            if (model, method) in skip or (method == "none" and rep >= plan.none_reps):
                continue
            timeout = 900 if method == "none" else 300
            tasks.append(
                dict(
                    section="skeleton",
                    kind="skeleton",
                    model=model,
                    method=method,
                    rep=rep,
                    tiny=plan.tiny,
                    timeout=timeout,
                )
            )
    for model in plan.lora_models:
        for method in _rotated(list(LORA_METHODS), rep):
            tasks.append(
                dict(
                    section="lora",
                    kind="lora",
                    model=model,
                    method=method,
                    rep=rep,
                    tiny=plan.tiny,
                    timeout=300,
                )
            )
    if plan.thread_model:
        variants = [
            (flavour, n, mode)
            for flavour in THREAD_FLAVOURS
            for n in plan.thread_counts
            for mode in ("sequential", "concurrent")
        ]
        for flavour, n, mode in _rotated(variants, rep):
            tasks.append(
                dict(
                    section="threads",
                    kind="threads",
                    model=plan.thread_model,
                    method=f"{flavour} {n} {mode}",
                    flavour=flavour,
                    threads=n,
                    mode=mode,
                    rep=rep,
                    tiny=plan.tiny,
                    timeout=300,
                )
            )
    idle_per_rep = -(-plan.idle_reps // plan.reps) if plan.idle_reps else 0
    for sub in range(idle_per_rep):
        index = rep * idle_per_rep + sub
        if index >= plan.idle_reps:
            break
        for method in _rotated(list(IDLE_METHODS), index):
            tasks.append(
                dict(
                    section="idle",
                    kind="idle",
                    model="idle",
                    method=method,
                    rep=index,
                    tiny=plan.tiny,
                    timeout=300,
                )
            )
    return tasks


# -- running measurements -----------------------------------------------------------------


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("DIFFUSERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


class ForkServer:
    """A warm worker that forks a fresh child per measurement (Linux)."""

    def __init__(self, packages: list[str]) -> None:
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self._process = subprocess.Popen(
            [*WORKER, "serve", ",".join(packages)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=_worker_env(),
        )
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"bench worker failed to start: {ready}")
        self.loaded = ready.get("loaded", [])

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self._log.seek(0)
            tail = self._log.read()[-3000:].decode(errors="replace")
            raise RuntimeError(f"bench worker exited unexpectedly:\n{tail}")
        return json.loads(line)

    def run(self, task: dict[str, Any]) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(task) + "\n")
        self._process.stdin.flush()
        return self._read()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self._process.stdin:
                self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()


class FreshInterpreters:
    """A new Python interpreter per measurement (no fork; slower to start)."""

    loaded: tuple[str, ...] = ()

    def run(self, task: dict[str, Any]) -> dict[str, Any]:
        try:
            done = subprocess.run(
                [*WORKER, "once", json.dumps(task)],
                capture_output=True,
                text=True,
                timeout=float(task.get("timeout", 600)) + 120,
                env=_worker_env(),
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": "timed out"}
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            why = f"exited with status {done.returncode}"
            if done.returncode < 0:
                why = f"killed by signal {-done.returncode}"
            return {"ok": False, "error": why, "log": done.stderr[-2000:]}
        return json.loads(lines[-1])

    def close(self) -> None:
        pass


# -- progress display ---------------------------------------------------------------------


class _PlainProgress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, time.perf_counter()

    def __enter__(self) -> _PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def start(self, label: str) -> None:
        self._label = label

    def finish(self, outcome: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        print(
            f"[{self.done:>4}/{self.total}] {elapsed:6.0f}s  {self._label}: {outcome}",
            file=sys.stderr,
            flush=True,
        )


class _RichProgress:
    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]bench[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=Console(stderr=True),
            transient=True,
        )
        self._task = self._progress.add_task("", total=total)

    def __enter__(self) -> _RichProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(None, None, None)

    def start(self, label: str) -> None:
        self._progress.update(self._task, description=label)

    def finish(self, outcome: str) -> None:
        self._progress.advance(self._task)


def _has_rich() -> bool:
    return _installed("rich")


# -- statistics ---------------------------------------------------------------------------


def _value(result: dict[str, Any], clock: str, section: str) -> float | None:
    if not result.get("ok"):
        return None
    key = "wall_s" if clock == "wall" or section == "threads" else "cpu_s"
    return result.get(key)


def _baseline_of(section: str, method: str) -> str | None:
    if section == "threads":
        kind, n, mode = method.split()
        return f"{kind} {n} sequential" if mode == "concurrent" else None
    baseline = BASELINES.get(section)
    return None if method == baseline else baseline


def summarise(records: list[dict[str, Any]], clock: str) -> dict[str, dict[str, Any]]:
    """Per (section, model, method): median, paired-ratio median vs baseline, RSS, errors."""
    by_cell: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for record in records:
        task = record["task"]
        by_cell.setdefault((task["section"], task["model"], task["method"]), {})[task["rep"]] = (
            record["result"]
        )
    summary: dict[str, dict[str, Any]] = {}
    for (section, model, method), runs in by_cell.items():
        values = {rep: _value(res, clock, section) for rep, res in runs.items()}
        good = {rep: v for rep, v in values.items() if v is not None}
        cell: dict[str, Any] = {
            "section": section,
            "model": model,
            "method": method,
            "n": len(good),
            "reps": sorted(good),
            "values_s": [good[r] for r in sorted(good)],
            "median_s": statistics.median(good.values()) if good else None,
            "errors": sorted({res.get("error", "?") for res in runs.values() if not res.get("ok")}),
        }
        peaks = [res["rss_peak"] for res in runs.values() if res.get("ok") and res.get("rss_peak")]
        cell["rss_peak_median"] = statistics.median(peaks) if peaks else None
        growths = [
            res["rss_peak"] - res["rss_start"]
            for res in runs.values()
            if res.get("ok") and res.get("rss_peak") and res.get("rss_start")
        ]
        cell["rss_growth_median"] = statistics.median(growths) if growths else None
        problems = sorted({p for res in runs.values() for p in res.get("problems", []) or []})
        cell["problems"] = problems[:5]
        cell["leaked_runs"] = sum(bool(res.get("leaked")) for res in runs.values())
        cell["runs"] = len(runs)
        baseline = _baseline_of(section, method)
        if baseline is not None:
            base_runs = by_cell.get((section, model, baseline), {})
            ratios = [
                good[rep] / base
                for rep in sorted(good)
                if (base := _value(base_runs.get(rep, {}), clock, section))
            ]
            cell["baseline"] = baseline
            cell["ratios"] = ratios
            cell["ratio"] = statistics.median(ratios) if ratios else None
        summary["|".join((section, model, method))] = cell
    return summary


def _cell(summary: dict[str, Any], section: str, model: str, method: str) -> dict[str, Any] | None:
    return summary.get("|".join((section, model, method)))


def paired(summary: dict, section: str, model: str, top: str, bottom: str) -> float | None:
    """Median over repetitions of ``top / bottom`` (both measured in the same repetition)."""
    a, b = _cell(summary, section, model, top), _cell(summary, section, model, bottom)
    if not a or not b:
        return None
    a_runs = dict(zip(_reps(a), a["values_s"], strict=False))
    b_runs = dict(zip(_reps(b), b["values_s"], strict=False))
    ratios = [a_runs[r] / b_runs[r] for r in a_runs if b_runs.get(r)]
    return statistics.median(ratios) if ratios else None


def _reps(cell: dict[str, Any]) -> list[int]:
    return cell["reps"]


# -- comparison ---------------------------------------------------------------------------


def comparison(summary: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    """metamode against the stock path, one paired ratio per row (< 1: metamode is faster)."""
    rows: list[dict[str, Any]] = []

    def add(what: str, workload: str, ratio: float | None) -> None:
        if ratio is not None:
            rows.append({"comparison": what, "workload": workload, "ratio": ratio})

    for model in plan.skeleton_models:
        for method, label in (
            ("metamode", "empty_weights()"),
            ("metamode+buffers", "empty_weights(include_buffers=True)"),
        ):
            ratio = paired(summary, "skeleton", model, method, "torch.device")
            add(f"{label} / torch.device('meta')", model, ratio)
        for stock, label in (("accelerate", "accelerate"), ("peft", "PEFT")):
            ratio = paired(summary, "skeleton", model, "metamode", stock)
            add(f"empty_weights() / {label} init_empty_weights()", model, ratio)
    for model in plan.lora_models:
        ratio = paired(
            summary, "lora", model, "shim low_cpu_mem_usage=True", "stock low_cpu_mem_usage=True"
        )
        add("LoRA injection: shim / stock PEFT (low_cpu_mem_usage=True)", model, ratio)
    if plan.thread_model:
        n = max(plan.thread_counts)
        for flavour, label in (
            ("shim", "metamode shim"),
            ("stock", "stock PEFT"),
            ("control", "control: torch calls only"),
        ):
            cell = _cell(summary, "threads", plan.thread_model, f"{flavour} {n} concurrent")
            add(
                f"{n} threads concurrent / sequential, {label}",
                plan.thread_model,
                cell.get("ratio") if cell else None,
            )
    if plan.idle_reps:
        cell = _cell(summary, "idle", "idle", "imported+enabled")
        add(
            "idle: metamode imported+enabled / not imported",
            "build+forward",
            cell.get("ratio") if cell else None,
        )
    rss_model = (
        "llama-70b"
        if "llama-70b" in plan.skeleton_models
        else (plan.skeleton_models[-1] if plan.skeleton_models else None)
    )
    if rss_model:
        a = _cell(summary, "skeleton", rss_model, "metamode")
        b = _cell(summary, "skeleton", rss_model, "torch.device")
        if a and b and a["rss_peak_median"] and b["rss_peak_median"]:
            add(
                "peak RSS: empty_weights() / torch.device('meta')",
                rss_model,
                a["rss_peak_median"] / b["rss_peak_median"],
            )
    return rows


# -- tables -------------------------------------------------------------------------------


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    caption: str = ""


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms"


def _x(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f"{ratio:.2f}x" if ratio < 100 else f"{ratio:.0f}x"


def _timing(cell: dict[str, Any] | None, na: str | None = None) -> str:
    if na:
        return na
    if cell is None:
        return "-"
    if cell["median_s"] is None:
        return "error"
    text = _ms(cell["median_s"])
    if cell.get("ratio") is not None:
        text += f"  {_x(cell['ratio'])}"
    return text


def build_tables(
    summary: dict[str, Any], plan: Plan, skipped: dict[tuple[str, str], str], clock: str
) -> list[Table]:
    tables: list[Table] = []
    what = "CPU time" if clock == "cpu" else "wall time"
    if plan.tiny:
        what += ", TINY shapes: a smoke test"
    if plan.skeleton_models:
        rows = []
        for method in plan.skeleton_methods:
            row = [METHOD_LABELS[method]]
            for model in plan.skeleton_models:
                row.append(
                    _timing(_cell(summary, "skeleton", model, method), skipped.get((model, method)))
                )
            rows.append(row)
        tables.append(
            Table(
                f"Empty skeleton build ({what}, median of {plan.reps} fresh processes; "
                f"ratio vs torch.device('meta'))",
                ["method", *plan.skeleton_models],
                rows,
            )
        )
        rows = []
        for method in plan.skeleton_methods:
            row = [METHOD_LABELS[method]]
            for model in plan.skeleton_models:
                cell = _cell(summary, "skeleton", model, method)
                na = skipped.get((model, method))
                peak = cell.get("rss_peak_median") if cell else None
                row.append("n/a" if na else "-" if not peak else f"{peak / (1 << 20):,.0f} MiB")
            rows.append(row)
        tables.append(
            Table(
                "Peak RSS of the process during the build", ["method", *plan.skeleton_models], rows
            )
        )
    if plan.lora_models:
        rows = [
            [method]
            + [_timing(_cell(summary, "lora", model, method)) for model in plan.lora_models]
            for method in LORA_METHODS
        ]
        tables.append(
            Table(
                f"PEFT LoRA injection, r=16 on every attention and feed-forward linear ({what}; "
                f"ratio vs stock low_cpu_mem_usage=True)",
                ["inject_adapter_in_model", *plan.lora_models],
                rows,
            )
        )
        rows = []
        for method in LORA_METHODS:
            row = [method]
            for model in plan.lora_models:
                cell = _cell(summary, "lora", model, method)
                growth = cell.get("rss_growth_median") if cell else None
                row.append("-" if growth is None else f"{growth / (1 << 20):,.1f} MiB")
            rows.append(row)
        tables.append(
            Table(
                "Peak RSS growth of the process during the injection (median)",
                ["inject_adapter_in_model", *plan.lora_models],
                rows,
            )
        )
    if plan.thread_model:
        rows = []
        labels = {
            "stock": "stock PEFT",
            "shim": "metamode shim",
            "control": "control: torch calls only",
        }
        for flavour in THREAD_FLAVOURS:
            for n in plan.thread_counts:
                seq = _cell(summary, "threads", plan.thread_model, f"{flavour} {n} sequential")
                con = _cell(summary, "threads", plan.thread_model, f"{flavour} {n} concurrent")
                control = flavour == "control"
                leaked = con["leaked_runs"] if con else 0
                runs = con["runs"] if con else 0
                broken = sum(bool(c and c["problems"]) for c in (seq, con))
                rows.append(
                    [
                        labels[flavour],
                        str(n),
                        _timing(seq),
                        _ms(con["median_s"]) if con else "-",
                        _x(con.get("ratio")) if con else "",
                        "-" if control else f"{leaked}/{runs}",
                        "-" if control else "yes" if broken else "no",
                    ]
                )
        tables.append(
            Table(
                f"Concurrent LoRA injection into independent {plan.thread_model} models "
                f"(low_cpu_mem_usage=True, wall time; ratio = concurrent / sequential)",
                [
                    "PEFT",
                    "threads",
                    "sequential",
                    "concurrent",
                    "ratio",
                    "leaked patch",
                    "wrong devices/errors",
                ],
                rows,
                caption="control: each thread only loops over a trivial torch call "
                "(meta_tensor.view); torch releases and re-takes the GIL in every call, "
                "which alone makes threads slower than one-by-one on a multi-core machine.",
            )
        )
    if plan.idle_reps:
        rows = [
            [method, _timing(_cell(summary, "idle", "idle", method))] for method in IDLE_METHODS
        ]
        tables.append(
            Table(
                f"Idle overhead: build a small model with real weights + one forward pass "
                f"({what}, median of {plan.idle_reps})",
                ["metamode", "time  ratio"],
                rows,
            )
        )
    return tables


def comparison_table(rows: list[dict[str, Any]]) -> Table:
    return Table(
        "metamode vs the stock path (median of paired ratios from this run; below 1x is faster)",
        ["comparison", "workload", "ratio"],
        [[row["comparison"], row["workload"], _x(row["ratio"])] for row in rows],
    )


def render_plain(table: Table) -> str:
    widths = [
        max(len(str(row[i])) for row in [table.columns, *table.rows])
        for i in range(len(table.columns))
    ]
    rule = "  ".join("-" * w for w in widths)

    def line(cells: list[str]) -> str:
        return "  ".join(
            (str(c).ljust(w) if i == 0 else str(c).rjust(w))
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [table.title, rule, line(table.columns), rule, *map(line, table.rows), rule]
    if table.caption:
        out.append(table.caption)
    return "\n".join(out)


def print_tables(tables: list[Table], plain: bool) -> None:
    if plain or not _has_rich():
        for table in tables:
            print(render_plain(table) + "\n")
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table as RichTable

    width = None if sys.stdout.isatty() else max(120, shutil.get_terminal_size((160, 24)).columns)
    console = Console(width=width)
    for table in tables:
        console.print(table.title, style="bold", highlight=False)
        rich_table = RichTable(box=box.SIMPLE_HEAD, caption=table.caption or None)
        for i, column in enumerate(table.columns):
            rich_table.add_column(column, justify="left" if i == 0 else "right", no_wrap=i > 0)
        for row in table.rows:
            rich_table.add_row(*row)
        console.print(rich_table)
        console.print()


# -- machine facts ------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    total = None
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    versions: dict[str, str | None] = {}
    for package in ("torch", *_OPTIONAL, "metamode", "rich"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(total / _GIB, 1) if total else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def machine_line(facts: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in facts["versions"].items() if v)
    return (
        f"{facts['cpus']} CPUs ({facts['cpu_model']}), {facts['memory_gib']} GiB, "
        f"Python {facts['python']}; {versions}"
    )


# -- main ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m metamode bench",
        description="Benchmark empty-model construction: metamode vs torch, accelerate, PEFT.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one skeleton workload, fewer repetitions: about a minute",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="fresh processes per measurement (default 5, --quick 3)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every raw measurement here")
    parser.add_argument("--sections", help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument(
        "--models", help="comma-separated subset of workloads: " + ",".join(MODEL_NEEDS)
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="cpu",
        help="CPU time of the measuring process (default: robust to other load on the "
        "machine; builds are single-threaded) or wall time; threads are always wall time",
    )
    parser.add_argument(
        "--max-real-gib",
        type=float,
        default=None,
        help="largest model built with real weights ('no context'); "
        "default: 60%% of the available memory",
    )
    parser.add_argument(
        "--none-reps",
        type=int,
        default=1,
        help="repetitions of the slow 'no context' builds (default 1)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny shapes for every workload (a smoke test; numbers say nothing)",
    )
    parser.add_argument(
        "--plain", action="store_true", help="plain text, even if rich is installed"
    )
    parser.add_argument(
        "--no-fork",
        action="store_true",
        help="start a new interpreter per measurement instead of forking a warm one",
    )
    return parser


def _label(task: dict[str, Any]) -> str:
    return f"{task['section']} {task['model']} {task['method']} (rep {task['rep'] + 1})"


def _outcome(result: dict[str, Any]) -> str:
    if not result.get("ok"):
        return f"FAILED: {result.get('error')}"
    text = f"{_ms(result.get('wall_s'))} wall, {_ms(result.get('cpu_s'))} cpu"
    if result.get("problems"):
        text += f"; problems: {result['problems'][0]}"
    return text


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    installed = {name: _installed(name) for name in _OPTIONAL}
    plan = make_plan(args, installed)
    use_fork = hasattr(os, "fork") and sys.platform.startswith("linux") and not args.no_fork
    plain = args.plain or not _has_rich()
    facts = machine()
    command = "python -m metamode bench" + ("" if not argv else " " + " ".join(argv))
    print(f"{command}\n{machine_line(facts)}", flush=True)
    for note in plan.notes:
        print(f"note: {note}", flush=True)

    runner: ForkServer | FreshInterpreters
    runner = ForkServer(plan.packages) if use_fork else FreshInterpreters()
    records: list[dict[str, Any]] = []
    skipped: dict[tuple[Any, str], str] = {}
    try:
        probes = [
            dict(section="size", kind="size", model=m, method="size", rep=0, tiny=plan.tiny)
            for m in plan.skeleton_models
            if "none" in plan.skeleton_methods
        ]
        reps = [tasks_for_rep(plan, rep, {}) for rep in range(plan.reps)]
        total = len(probes) + sum(map(len, reps))
        live = not plain and sys.stderr.isatty()  # else one line per measurement (logs, CI)
        progress = _RichProgress(total) if live else _PlainProgress(total)
        with progress:
            for probe in probes:
                progress.start(f"size of {probe['model']}")
                result = runner.run(probe)
                progress.finish(_outcome(result) if not result.get("ok") else "ok")
                size = result.get("bytes")
                if size is None or size > plan.max_real_bytes:
                    need = f"{size / _GIB:.0f} GiB" if size else "?"
                    skipped[(probe["model"], "none")] = f"n/a ({need} real)"
                records.append({"task": probe, "result": result})
            for rep in range(plan.reps):
                for task in tasks_for_rep(plan, rep, skipped):
                    progress.start(_label(task))
                    result = runner.run(task)
                    progress.finish(_outcome(result))
                    records.append({"task": task, "result": result})
                    if task["method"] == "none" and result.get("killed"):
                        skipped[(task["model"], "none")] = "n/a (killed)"
    finally:
        runner.close()

    measured = [r for r in records if r["task"]["section"] != "size"]
    summary = summarise(measured, args.clock)
    compared = comparison(summary, plan)
    tables = build_tables(summary, plan, skipped, args.clock)
    tables.append(comparison_table(compared))
    wall = time.perf_counter() - started
    print()
    print_tables(tables, plain)
    errors = sorted(
        {
            f"{c['section']} {c['model']} {c['method']}: {e}"
            for c in summary.values()
            for e in c["errors"]
        }
    )
    for error in errors:
        print(f"error: {error}")
    print(
        f"{len(measured)} measurements in {wall:.0f} s "
        f"({'forked' if use_fork else 'fresh'} processes, {args.clock} clock)"
    )
    if args.json:
        payload = {
            "command": command,
            "machine": facts,
            "args": vars(args),
            "wall_s": wall,
            "plan": {k: v for k, v in vars(plan).items()},
            "skipped": {f"{m}|{meth}": why for (m, meth), why in skipped.items()},
            "records": records,
            "summary": summary,
            "comparison": compared,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"raw data: {args.json}")
    failed_ours = any(
        c["method"].startswith(("metamode", "shim")) and c["errors"] for c in summary.values()
    )
    return 1 if failed_ours else 0
