"""`trimtab runs DIR`: a table of the run directories under DIR (files only, no torch).

A run directory is one with config.yaml and metrics.jsonl, summary.json, decisions.jsonl or .lock (a run
before its first log line has no metrics yet: report/run.py RUN_FILES); the search does not
go inside one (its checkpoints hold no runs), nor inside a tracking store's tree (mlruns/,
mlartifacts/, wandb/: the copies of runs it keeps as artifacts), and a directory holding the same
config.yaml and metrics.jsonl as another is listed once (a copy). Status: completed, stopped (a signal, a person, the
orchestrator), failed (gave up, or no summary and no live process: crashed or killed) or running
(a process holds RUN_DIR/.lock). Decisions are those that act or advise; notes (action none: a
slower machine, a failed evaluation) are counted apart, and faults healed counts incidents
(rundir.healed), not decisions.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from trimtab.errors import TrimtabError
from trimtab.report.run import is_run_dir, read_run, val_loss
from trimtab.rundir import CONFIG, METRICS_FILE, healed, is_note

COLUMNS = [
    "run",
    "preset",
    "status",
    "steps",
    "tokens",
    "val_loss",
    "held_out",
    "decisions",
    "notes",
    "healed",
    "wall_s",
    "ettr",
]
HEADINGS = {"val_loss": "val loss", "held_out": "held-out", "healed": "faults healed", "wall_s": "wall", "ettr": "ETTR"}
# An RL or DPO run's last held-out figure (higher is better): it has no validation loss
HELD_OUT = ("rl/held_out_pass@1", "dpo/held_out_accuracy")


class RunsError(TrimtabError):
    """`trimtab runs` was given a directory that does not exist or a column it does not have."""


# Where MLflow (file store: mlruns/; tracking server or trimtab's sqlite store: mlartifacts/) and
# wandb keep their copies of a run's files: tune's trials log theirs next to the trials, and every
# trial was listed twice.
TRACKING_STORES = {"mlruns", "mlartifacts", "wandb"}


def find_runs(root: Path) -> list[Path]:
    """Run directories under root (root itself included), in path order, copies left out."""
    found, seen = [], set()
    # symlinks followed (runs linked into a folder of their own were not found), each directory once
    for here, dirs, _ in os.walk(root, followlinks=True):
        path = Path(here)
        if os.path.realpath(path) in seen:  # a link back up the tree, or a second link to it
            dirs.clear()
            continue
        seen.add(os.path.realpath(path))
        if is_run_dir(path):
            found.append(path)
            dirs.clear()  # checkpoints/, tb/: nothing to find inside a run
        else:
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in TRACKING_STORES)
    return sorted(_originals(found))


def _originals(paths: list[Path]) -> list[Path]:
    """One directory per run: of those with the same config.yaml and metrics.jsonl (the copy of a
    run, which the timings in metrics.jsonl tell apart from a rerun), the one the run trained in,
    its checkpoints/ there, else the shallowest."""
    groups: dict[str, list[Path]] = {}
    for path in paths:
        groups.setdefault(_fingerprint(path), []).append(path)
    return [min(group, key=_original_first) for group in groups.values()]


def _original_first(path: Path) -> tuple[bool, int, str]:
    return not (path / "checkpoints").is_dir(), len(path.parts), str(path)


def _fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    for name in (CONFIG, METRICS_FILE):
        file = path / name
        digest.update(file.read_bytes() if file.is_file() else b"")
        digest.update(b"\0")
    return digest.hexdigest()


def run_row(path: Path, root: Path) -> dict[str, Any]:
    """One run's row: raw values (None where the run has none), for --json and for sorting."""
    run = read_run(path)
    s = run.summary or {}
    last = run.train[-1] if run.train else {}
    kept = [d for d in run.decisions if not d.get("abandoned")]
    rel = path.relative_to(root)
    return {
        "run": str(rel) if str(rel) != "." else path.name,
        "preset": run.preset or None,
        "status": run.status,
        "steps": s.get("step", last.get("step")),
        "tokens": s.get("tokens", last.get("tokens")),
        "val_loss": val_loss(run),
        "held_out": next((s[k] for k in HELD_OUT if isinstance(s.get(k), (int, float))), None),
        "decisions": sum(not is_note(d) for d in kept),
        "notes": sum(is_note(d) for d in kept),
        "healed": healed(kept),
        "wall_s": run_wall(run.goodput, s),
        "ettr": (run.goodput or {}).get("ettr"),  # productive / wall over every session (docs/resilience.md)
        "detail": run.detail,
        "path": str(path),
    }


def run_wall(goodput: dict[str, Any] | None, summary: dict[str, Any]) -> float | None:
    """The run's wall time over every session, restarts and the downs between them included: the
    ETTR's denominator (goodput.json); summary.json's `seconds`, its last session's alone, only for a
    run without a ledger (a damaged one, or an older trimtab's)."""
    total = (goodput or {}).get("wall_s")
    seconds = total if isinstance(total, (int, float)) and total > 0 else summary.get("seconds")
    return round(seconds, 1) if isinstance(seconds, (int, float)) else None


def list_runs(root: str | Path, sort: str = "val_loss", reverse: bool = False) -> list[dict[str, Any]]:
    """The rows of the runs under root sorted by a column (reverse: descending); runs without a
    value in that column come last either way."""
    root = Path(root)
    if not root.is_dir():
        what = "a file, not a directory" if root.exists() else "no such directory"
        raise RunsError(f"{root}: {what} (trimtab runs DIR lists the run directories under DIR)")
    if sort not in COLUMNS:
        raise RunsError(f"unknown column {sort!r} for --sort; one of {', '.join(COLUMNS)}")
    rows = [run_row(path, root) for path in find_runs(root)]
    present = sorted((r for r in rows if r[sort] is not None), key=lambda r: r[sort], reverse=reverse)
    return present + [r for r in rows if r[sort] is None]


def format_table(rows: list[dict[str, Any]]) -> str:
    """Aligned columns, numbers on the right."""
    cells = [[HEADINGS.get(c, c) for c in COLUMNS]] + [[_cell(c, r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(row[j]) for row in cells) for j in range(len(COLUMNS))]
    numeric = {"steps", "tokens", "val_loss", "held_out", "decisions", "notes", "healed", "wall_s", "ettr"}
    lines = [
        "  ".join(v.rjust(w) if COLUMNS[j] in numeric else v.ljust(w) for j, (v, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    return "\n".join(line.rstrip() for line in lines)


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column == "val_loss":
        return f"{value:.4f}"
    if column == "held_out":
        return f"{value:.3f}"
    if column == "tokens":
        return f"{value:,}"
    if column == "wall_s":
        return f"{value:.0f} s"
    if column == "ettr":
        return f"{value:.1%}"
    return str(value)


def print_runs(root: str | Path, sort: str = "val_loss", reverse: bool = False, as_json: bool = False) -> int:
    """`trimtab runs`: the table on stdout (as_json: the rows as a JSON list, for scripts)."""
    rows = list_runs(root, sort, reverse)
    if as_json:
        print(json.dumps(rows, indent=1))
    elif rows:
        print(format_table(rows))
    else:
        print(f"no run directories under {root}")
    return 0
