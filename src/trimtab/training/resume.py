"""What `train` finds in an existing run directory before it builds anything: the checkpoint to
resume from, with corrupt newer ones moved aside.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trimtab.checkpoint import latest_valid, set_aside_corrupt
from trimtab.config import RunConfig
from trimtab.distributed import Parallel

log = logging.getLogger(__name__)
Found = tuple[Path, dict[str, Any]]  # a checkpoint directory and its state.json


def resume_point(cfg: RunConfig, dist: Parallel) -> Found | None:
    """The newest valid checkpoint (rank 0 reads the directory, and alone moves files); corrupt
    newer checkpoints are moved aside."""
    found = dist.from_main(latest_valid, cfg.run_dir)
    dist.on_main(_set_aside, cfg.run_dir, found)
    return found


def _set_aside(run_dir: Path, found: Found | None) -> None:
    moved = set_aside_corrupt(run_dir, found[1]["step"] if found else -1)
    if not moved:
        return
    names = ", ".join(p.name for p in moved)
    kept = f"kept for inspection in {moved[0].parent} (never resumed from, never pruned): {names}"
    if found:
        log.warning("resuming from %s, the newest valid checkpoint; corrupt ones %s", found[0].name, kept)
    else:
        log.warning("no valid checkpoint is left: the run starts over from step 0; the corrupt one(s) %s", kept)
