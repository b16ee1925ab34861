"""`trimtab report`: a run directory (or several, overlaid) as one self-contained HTML file.

It reads only files (trimtab/rundir.py: config.yaml, metrics.jsonl, decisions.jsonl, plan_status.jsonl,
summary.json) and imports no torch, so it runs anywhere the run directory is copied to. A healing
benchmark's result (healing.json, or the directory holding it) renders as its table and curves.
docs/report.md says how to read the page.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

from trimtab.errors import TrimtabError
from trimtab.report.healing import Healing, is_healing, load_healing
from trimtab.report.run import NotARunError, RunRecord, is_run_dir, read_run
from trimtab.rundir import write_atomic

REPORT = "report.html"

__all__ = ["NotARunError", "default_out", "write_report"]

HTML = (".html", ".htm")  # --out names a page; anything else is a directory to hold report.html

log = logging.getLogger(__name__)


def write_report(paths: list[str | Path], out: str | Path | None = None, summary: dict[str, Any] | None = None) -> Path:
    """Write the report of `paths` (run directories, healing.json files or the directories holding
    them) to `out` (default: default_out(paths)); `summary` stands in for a single run's
    summary.json (at the end of a run, the report is written before it). Returns the file."""
    from trimtab.report.page import render  # plotly: only when a page is made

    if not paths:
        raise NotARunError("no run directory given")
    unique: dict[Path, str | Path] = {}
    for path in paths:  # one run named twice (a typo, a shell glob and a name) is drawn once
        unique.setdefault(Path(path).resolve(), path)
    paths = list(unique.values())
    runs, healings = _load(paths, summary)
    target = Path(out) if out else default_out(paths)
    if out and (target.is_dir() or str(out).endswith(("/", os.sep)) or target.suffix.lower() not in HTML):
        target = target / REPORT  # `--out DIR` (new ones too), as `trimtab plan --out` takes a directory
    page = render(runs, healings)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, page)  # a reader (a browser reloading) never sees half a page
    except OSError as exc:  # a run directory on a read-only mount ended in a traceback
        raise TrimtabError(f"the report cannot be written to {target} ({_why(exc)}); {_fix(exc)}") from None
    return target


def _why(exc: OSError) -> str:
    """The failure, and the file it names when it names one: a full disk's write names none
    (it read "No space left on device: None")."""
    reason = exc.strerror or str(exc)
    return f"{reason}: {exc.filename}" if exc.filename else reason


def _fix(exc: OSError) -> str:
    """What to do: on a full disk, free space (another --out on the same disk fails alike)."""
    other = "give --out a file or directory that can be written, e.g. --out /tmp/report.html"
    return f"free space there, or {other}" if exc.errno == errno.ENOSPC else other


def default_out(paths: list[str | Path]) -> Path:
    """RUN/report.html for one run (or beside one healing.json); report.html here for several."""
    if len(paths) == 1:
        path = Path(paths[0])
        return path.with_suffix(".html") if path.is_file() else path / REPORT
    return Path(REPORT)


def _load(paths: list[str | Path], summary: dict[str, Any] | None) -> tuple[list[RunRecord], list[Healing]]:
    """Read each path. Of several, one that is no run (a typo, a shell glob's stray match) is skipped
    with a warning naming it and why: it aborted the whole comparison. None readable: NotARunError."""
    runs: list[RunRecord] = []
    healings: list[Healing] = []
    skipped: list[str] = []
    names = _names([Path(p) for p in paths])
    for path, name in zip(map(Path, paths), names):
        try:
            if is_healing(path) and not is_run_dir(path):
                healings.append(load_healing(path))
            else:
                runs.append(read_run(path, name=name, summary=summary if len(paths) == 1 else None))
        except NotARunError as exc:
            if len(paths) == 1:
                raise
            skipped.append(str(exc))
    if len(skipped) == len(paths):
        raise NotARunError(f"none of the {len(paths)} paths given is a run directory: " + "; ".join(skipped))
    for why in skipped:
        log.warning("report: skipped %s", why)
    return runs, healings


def _names(paths: list[Path]) -> list[str]:
    """Each run's label: its directory name, with as many parent names as makes it unique."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]
