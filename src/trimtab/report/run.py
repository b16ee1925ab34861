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

from trimtab.config import parse_yaml
from trimtab.errors import TrimtabError
from trimtab.resilience.goodput import read_goodput
from trimtab.rundir import (
    ABANDONED,
    CONFIG,
    DECISIONS_FILE,
    GOODPUT_FILE,
    LOCK,
    METRICS_FILE,
    PLAN_STATUS_FILE,
    SUMMARY,
    read_decisions,
    read_json,
    read_jsonl,
    read_metrics,
    read_summary,
)
from trimtab.runlock import liveness


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


# What a run leaves beside config.yaml from its start: the lock and the journal come before its first
# log line, so a run still in its first log interval (or killed in it) is listed and reported (it was
# missing from `trimtab runs`, and `trimtab report` refused it as not a run directory)
RUN_FILES = (METRICS_FILE, SUMMARY, DECISIONS_FILE, LOCK)


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG).is_file() and any((path / name).is_file() for name in RUN_FILES)


def read_run(path: str | Path, name: str | None = None, summary: dict[str, Any] | None = None) -> RunRecord:
    """Read a run directory; `summary` stands in for summary.json (the report written at the end
    of a run comes before the file is). Raises NotARunError naming what is missing."""
    path = Path(path)
    if not path.is_dir():
        what = "a file, not a directory" if path.exists() else "no such directory"
        raise NotARunError(f"{path}: {what} (expected a run directory with {CONFIG} and {METRICS_FILE})")
    # a run that ended before its first logged step (given up at step 4, log_every 5) has its
    # decisions and summary, no metrics: its report is the one a person needs (it was refused)
    if not (path / CONFIG).is_file():
        raise NotARunError(f"{path} is not a run directory: it has no {CONFIG}")
    if summary is None and not is_run_dir(path):
        raise NotARunError(
            f"{path} is not a run directory: it has no {METRICS_FILE} and no {SUMMARY}, nor the {DECISIONS_FILE} "
            f"and {LOCK} a run writes from its start; pass the --out of a `trimtab train`"
        )
    try:
        config = parse_yaml((path / CONFIG).read_text()) or {}  # libyaml's parser: 8x the pure one
    except yaml.YAMLError:  # damaged (a disk fault): listed and drawn all the same, its settings unknown
        config = {}
    lines = read_metrics(path, abandoned=True)
    later = None
    if summary is None:
        summary = read_summary(path)
        later = _session_after(path, summary, lines)
        summary = None if later else summary  # an earlier session's word: the figures come from the files
    status, detail = run_status(path, summary, later)
    return RunRecord(
        path=path,
        name=name or path.name,
        config=config if isinstance(config, dict) else {},
        lines=lines,
        decisions=read_decisions(path, abandoned=True),
        plan=read_jsonl(path / PLAN_STATUS_FILE),
        summary=summary,
        status=status,
        detail=detail,
        goodput=(summary or {}).get("goodput") or read_goodput(path),
    )


def run_status(path: Path, summary: dict[str, Any] | None, later: str | None = None) -> tuple[str, str]:
    """(completed | stopped | failed | running, the summary's own words). A run with no summary (or
    only an earlier session's, `later` saying why) is running while a process holds its lock, else
    it crashed or was killed: failed."""
    if summary is not None:
        text = str(summary.get("status", ""))
        kind = "completed" if text == "completed" else "stopped" if text.startswith("stopped") else "failed"
        return kind, text

    alive, evidence = liveness(path)
    missing = later or ("summary.json unreadable" if (path / SUMMARY).is_file() else "no summary.json")
    return ("running", f"running ({evidence})") if alive else ("failed", f"failed: {missing} ({evidence})")


def _session_after(path: Path, summary: dict[str, Any] | None, lines: list[dict[str, Any]]) -> str | None:
    """Why summary.json is an earlier session's (the run was resumed after it and is training now,
    or that session was killed or crashed), or None when it is the run's latest word. It is left in
    place until a session ends, and would list the run as done at the old step."""
    if summary is None:
        return None
    if liveness(path)[0]:
        return "resumed after summary.json"
    trained = [m["step"] for m in lines if "loss" in m and not m.get(ABANDONED) and isinstance(m.get("step"), int)]
    if isinstance(summary.get("step"), int) and trained and max(trained) > summary["step"]:
        return f"resumed after summary.json's step {summary['step']}, trained to step {max(trained)}, ended without one"
    return "resumed after summary.json, the session ended without one" if _lost_after_summary(path) else None


def _lost_after_summary(path: Path) -> bool:
    """goodput.json's last session started after summary.json was written and never said it ended:
    killed before it logged a step past the summary's (resilience/goodput.py)."""
    ledger = read_json(path / GOODPUT_FILE)
    sessions = ledger.get("sessions") if isinstance(ledger, dict) else None
    last = sessions[-1] if isinstance(sessions, list) and sessions and isinstance(sessions[-1], dict) else {}
    started = last.get("started")
    return (
        isinstance(started, (int, float)) and last.get("end", "") is None and started > (path / SUMMARY).stat().st_mtime
    )


def outcome_result(decision: dict[str, Any]) -> str:
    """A decision's measured result, or why it has none: "pending" only while it can still come. A
    decision abandoned before it was judged (its session killed before the outcome's steps ran,
    then resumed from an earlier checkpoint) never will be: a finished run's report said "pending"."""
    outcome = decision.get("outcome") or {}
    if "result" in outcome:
        return str(outcome["result"])
    return "never judged (abandoned before its outcome was measured)" if decision.get(ABANDONED) else "pending"


def finite(x: Any) -> float | None:
    """A number for a plot or table: None for missing, NaN or infinite (a gap, not a zero)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def val_loss(run: RunRecord) -> float | None:
    if run.summary and finite(run.summary.get("val_loss")) is not None:
        return float(run.summary["val_loss"])
    return finite(run.last("val_loss"))
