"""One run directory, read for the report and the runs table: files only, no torch.

What a run leaves: config.yaml, metrics.jsonl, decisions.jsonl, plan_status.jsonl (the live
Chinchilla status), summary.json (written when fit() returns) and RUN_DIR/.lock (held while it
trains); trimtab/rundir.py reads them all and marks what a rollback or a resume abandoned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trimtab.errors import TrimtabError
from trimtab.resilience.goodput import read_goodput
from trimtab.rundir import (
    ABANDONED,
    CONFIG,
    METRICS_FILE,
    PLAN_STATUS_FILE,
    SUMMARY,
    liveness,
    read_decisions,
    read_jsonl,
    read_metrics,
    read_summary,
)


class NotARunError(TrimtabError):
    """A path given as a run directory is not one; the message names the path and what is missing."""


@dataclass
class RunRecord:
    path: Path
    name: str  # how plots and tables label it
    config: dict[str, Any]
    lines: list[dict[str, Any]]  # every metrics line, in file order; abandoned ones marked
    decisions: list[dict[str, Any]]
    plan: list[dict[str, Any]]  # plan_status.jsonl
    summary: dict[str, Any] | None
    status: str  # completed | stopped | failed | running
    detail: str = ""  # the status in words, e.g. the summary's "stopped (SIGTERM)"
    goodput: dict[str, Any] | None = None  # goodput.json's totals (resilience/goodput.py): ETTR, time by bucket

    @property
    def train(self) -> list[dict[str, Any]]:
        """Kept training lines (the trajectory)."""
        return [m for m in self.lines if "loss" in m and not m.get(ABANDONED)]

    @property
    def preset(self) -> str:
        return str(self.config.get("preset") or "")

    def last(self, key: str) -> Any:
        """The key's value on the last kept line that has it, else None."""
        for m in reversed(self.lines):
            if key in m and not m.get(ABANDONED):
                return m[key]
        return None


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG).is_file() and ((path / METRICS_FILE).is_file() or (path / SUMMARY).is_file())


def read_run(path: str | Path, name: str | None = None, summary: dict[str, Any] | None = None) -> RunRecord:
    """Read a run directory; `summary` stands in for summary.json (the report written at the end
    of a run comes before the file is). Raises NotARunError naming what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise NotARunError(f"{path}: no such directory (expected a run directory with {CONFIG} and {METRICS_FILE})")
    missing = [f for f in (CONFIG, METRICS_FILE) if not (path / f).is_file()]
    if missing:
        raise NotARunError(f"{path} is not a run directory: it has no {' and no '.join(missing)}")
    try:
        config = yaml.safe_load((path / CONFIG).read_text()) or {}
    except yaml.YAMLError:  # damaged (a disk fault): listed and drawn all the same, its settings unknown
        config = {}
    if summary is None:
        summary = read_summary(path)
    status, detail = run_status(path, summary)
    return RunRecord(
        path=path,
        name=name or path.name,
        config=config if isinstance(config, dict) else {},
        lines=read_metrics(path, abandoned=True),
        decisions=read_decisions(path, abandoned=True),
        plan=read_jsonl(path / PLAN_STATUS_FILE),
        summary=summary,
        status=status,
        detail=detail,
        goodput=(summary or {}).get("goodput") or read_goodput(path),
    )


def run_status(path: Path, summary: dict[str, Any] | None) -> tuple[str, str]:
    """(completed | stopped | failed | running, the summary's own words). A run with no summary is
    running while a process holds its lock, else it crashed or was killed: failed."""
    if summary is not None:
        text = str(summary.get("status", ""))
        kind = "completed" if text == "completed" else "stopped" if text.startswith("stopped") else "failed"
        return kind, text

    alive, evidence = liveness(path)
    missing = "summary.json unreadable" if (path / SUMMARY).is_file() else "no summary.json"
    return ("running", f"running ({evidence})") if alive else ("failed", f"failed: {missing} ({evidence})")


def finite(x: Any) -> float | None:
    """A number for a plot or table: None for missing, NaN or infinite (a gap, not a zero)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def val_loss(run: RunRecord) -> float | None:
    if run.summary and finite(run.summary.get("val_loss")) is not None:
        return float(run.summary["val_loss"])
    return finite(run.last("val_loss"))
