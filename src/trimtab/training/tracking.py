"""Experiment trackers as hooks. PLACEHOLDER: being built."""

from __future__ import annotations

from pathlib import Path

from trimtab.config import LogConfig
from trimtab.training.hooks import Hook


def tracking_hooks(log: LogConfig, run_dir: Path) -> list[Hook]:
    return []
