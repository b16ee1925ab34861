"""RUN_DIR/metrics.jsonl: its format and its one reader (torch-free, so report tools, benchmarks
and tests read runs with it without the training stack).

One JSON object a line, appended as training goes (training/hooks.py JsonlLogger): a training line
per log interval ({"step", "phase", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", ...}) and
an evaluation line per evaluation ({"step", "phase", "val_loss", "val_ppl"}).

A rollback restores an older checkpoint and trains the steps after it again, so a step can appear
twice. The lines the rollback threw away stay in the file, in place, with `"abandoned": true`:
each line says for itself whether it belongs to the run's trajectory, so any line-by-line filter
(jq, pandas) gets it without replaying events, and nothing that happened is lost. The unmarked
lines, in file order, are the kept trajectory: each step once (per kind of line), in order. A
resume deletes the unmarked lines past its checkpoint (they are trained again, the same), never
abandoned ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
ABANDONED = "abandoned"  # the key set (true) on lines of steps a rollback threw away


def read_metrics(run_dir: str | Path, abandoned: bool = False) -> list[dict[str, Any]]:
    """The lines of RUN_DIR/metrics.jsonl in file order: the kept trajectory, or with
    abandoned=True every line (those of abandoned steps marked); [] when there is no file."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if not text.endswith("\n"):
        lines = lines[:-1]  # being written by a live run, or cut off by a crash
    records = [json.loads(line) for line in lines if line.strip()]
    return records if abandoned else [r for r in records if not r.get(ABANDONED)]
