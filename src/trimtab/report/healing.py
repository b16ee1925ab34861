"""The healing benchmark's result (bench/healing.py's healing.json) as the report's table and curves.

healing.json holds one entry per run under "runs", keyed "SCENARIO/MODE" (mode off or auto), each
with its outcome against the clean run, eval loss, decisions, steps redone, wall time and run_dir.
The curves read the runs' own metrics.jsonl when their directories are still there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from trimtab.errors import TrimtabError
from trimtab.report import figures
from trimtab.report.run import NotARunError, RunRecord, is_run_dir, read_run

HEALING = "healing.json"
COLUMNS = 3  # subplots per row of the curves


@dataclass
class Healing:
    path: Path
    results: dict[str, Any]

    def scenarios(self) -> list[str]:
        """Scenario names in the benchmark's order (the clean reference runs first)."""
        names: list[str] = []
        for key in self.results.get("runs", {}):
            name = key.rsplit("/", 1)[0]
            if name not in names:
                names.append(name)
        return names

    def run(self, scenario: str, mode: str) -> dict[str, Any] | None:
        return self.results.get("runs", {}).get(f"{scenario}/{mode}")


def is_healing(path: Path) -> bool:
    return (path.is_file() and path.suffix == ".json") or (path.is_dir() and (path / HEALING).is_file())


def load_healing(path: Path) -> Healing:
    file = path / HEALING if path.is_dir() else path
    try:
        results = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise NotARunError(f"{file}: not a healing benchmark result ({exc})") from exc
    if not isinstance(results, dict) or not isinstance(results.get("runs"), dict):
        raise NotARunError(f'{file}: not a healing benchmark result (no "runs" table; bench/healing.py writes one)')
    return Healing(file, results)


def table_rows(healing: Healing) -> list[list[str]]:
    """One row per scenario: off vs auto, as BENCHMARKS.md's table has it."""
    rows = []
    for name in healing.scenarios():
        off, auto = healing.run(name, "off") or {}, healing.run(name, "auto") or {}
        rows.append(
            [
                name,
                _faults(off, auto),
                _outcome(off),
                _outcome(auto),
                f"{_num(off.get('val_loss'))} / {_num(auto.get('val_loss'))}",
                str(len(auto.get("decisions") or [])),
                str(auto.get("steps_redone", "-")),
                f"{_num(off.get('wall_s'), 0)} / {_num(auto.get('wall_s'), 0)} s",
            ]
        )
    return rows


def _faults(off: dict[str, Any], auto: dict[str, Any]) -> str:
    """The injected faults, or a real scenario's setup (a tmpfs, a config)."""
    return ", ".join(auto.get("faults") or off.get("faults") or []) or auto.get("setup") or off.get("setup") or "-"


HEADER = ["scenario", "faults", "off", "auto", "eval loss off / auto", "decisions (auto)", "steps redone", "wall"]


def _outcome(run: dict[str, Any]) -> str:
    if not run:
        return "-"
    return str(run.get("outcome") or run.get("status") or "-")


def _num(x: Any, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) and math.isfinite(x) else "-"


def _run_dir(healing: Healing, entry: dict[str, Any] | None) -> Path | None:
    """The run's directory as recorded, else beside the JSON (a result moved with its runs)."""
    if not entry or not entry.get("run_dir"):
        return None
    recorded = Path(entry["run_dir"])
    for candidate in (recorded, healing.path.parent / recorded, healing.path.parent / recorded.name):
        if is_run_dir(candidate):
            return candidate
    return None


def curves(healing: Healing) -> go.Figure | None:
    """Each scenario's train loss under off (red, dotted) and auto (blue), abandoned stretches apart."""
    panels: list[tuple[str, dict[str, RunRecord]]] = []
    for name in healing.scenarios():
        runs = {}
        for mode in ("auto", "off"):  # off on top, dotted: the two agree until the fault
            path = _run_dir(healing, healing.run(name, mode))
            try:
                runs[mode] = read_run(path, name=mode) if path else None
            except (TrimtabError, OSError, ValueError):
                runs[mode] = None  # a run the benchmark left half-written: its row still shows
        found = {mode: run for mode, run in runs.items() if run is not None}
        if found:
            panels.append((name, found))
    if not panels:
        return None
    rows = math.ceil(len(panels) / COLUMNS)
    fig = make_subplots(rows=rows, cols=COLUMNS, subplot_titles=[name for name, _ in panels])
    for n, (_, runs) in enumerate(panels):
        cell = {"row": n // COLUMNS + 1, "col": n % COLUMNS + 1}
        for mode, run in runs.items():
            style = {"line": {"dash": "dot", "width": 3}} if mode == "off" else {}
            figures._line(fig, run, 1 if mode == "off" else 0, "loss", cell=cell, showlegend=n == 0, **style)
    fig.update_layout(
        title="Healing benchmark: train loss per scenario, orchestrator off vs auto",
        **{**figures.LAYOUT, "height": 80 + 260 * rows},
    )
    return figures._or_none(fig)
