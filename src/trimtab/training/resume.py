"""What `train` finds in an existing run directory before it builds anything: the checkpoint to
resume from, with corrupt newer ones moved aside, or the news that the run has already reached
the length its config asks for, in which case nothing is built and nothing in the directory
changes (re-running a finished run used to overwrite its summary with this call's empty figures
and append a duplicate evaluation to metrics.jsonl).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trimtab.checkpoint import latest_valid, set_aside_corrupt
from trimtab.config import RunConfig, read_saved
from trimtab.distributed import Parallel
from trimtab.errors import CheckpointError, ConfigError, RunFinished
from trimtab.rundir import SUMMARY, read_json
from trimtab.storage import Remote
from trimtab.training.schedule import KEYS, configured_lengths
from trimtab.training.services.storage import reference_steps, restore_from

log = logging.getLogger(__name__)
Found = tuple[Path, dict[str, Any]]  # a checkpoint directory and its state.json


def resume_point(cfg: RunConfig, dist: Parallel, remote: Remote | None = None) -> Found | None:
    """The newest valid checkpoint (rank 0 reads the directory, and alone moves files); with
    none there, the newest valid one in `remote` (checkpoint.dir), downloaded into it. Raises
    RunFinished for a run already at its length; moves corrupt newer checkpoints aside."""
    found = dist.from_main(latest_valid, cfg.run_dir)
    if found is None and remote is not None:
        found = dist.from_main(restore_from, remote, cfg.run_dir, reference_steps(cfg))
    if found is not None and "train" not in found[1]:  # weights without a training state (trimtab merge)
        dist.close()
        raise CheckpointError(
            f"{cfg.run_dir} holds a merged model, not a run to resume; start a new run from it: "
            f"--out NEW --set train.init_from={cfg.run_dir}"
        )
    if found is not None:
        _stop_if_finished(cfg, found, dist)
    dist.on_main(_set_aside, cfg.run_dir, found)
    return found


def _stop_if_finished(cfg: RunConfig, found: Found, dist: Parallel) -> None:
    """The run's length under this config is the configured phase lengths plus the live
    planner's change to pretraining (TrainState.length_delta); a longer one trains on."""
    train = found[1].get("train", {})
    step, delta, lengths = train.get("step", 0), train.get("length_delta", 0), _lengths(cfg)
    if lengths is None:
        return  # its length is not resolved yet: it cannot have reached it
    total = sum(lengths) + delta
    if step < total:
        return
    summary = dist.from_main(saved_summary, cfg.run_dir, found, total)
    dist.close()
    key = KEYS[len(lengths) - 1]  # the last phase's length is the one to raise
    longer = "--max-steps (train.max_steps)" if key == "train.max_steps" else key
    planner = f", {delta:+d} by the live planner" if delta else ""
    raise RunFinished(
        f"{cfg.run_dir} has finished: it is at step {step} of {total} ({key} {lengths[-1]}{planner}); "
        f"nothing was trained and nothing in it changed. A larger {longer} trains on",
        summary,
    )


def _lengths(cfg: RunConfig) -> list[int] | None:
    """The phase lengths; a pretraining length that depends on the data (train.epochs) or the
    model (max_steps: auto) is the one the run resolved and saved in config.yaml."""
    if cfg.train.epochs <= 0 and cfg.train.max_steps != "auto":
        return configured_lengths(cfg)
    try:
        saved = read_saved(cfg.run_dir)
    except (OSError, ConfigError):
        return None
    return [int(saved.train.max_steps)] + configured_lengths(cfg)[1:]


def saved_summary(run_dir: Path, found: Found, total: int) -> dict[str, Any]:
    """summary.json as the session that reached this checkpoint wrote it; if it is missing or
    belongs to another step (a session killed before writing it), one from the checkpoint."""
    saved = read_json(run_dir / SUMMARY)
    train = found[1]["train"]
    if isinstance(saved, dict) and saved.get("step") == train["step"]:
        return saved
    return {
        "status": "completed",
        "run_dir": str(run_dir),
        "step": train["step"],
        "total_steps": total,
        "tokens": train["tokens"],
        "train_seconds": train.get("train_seconds", 0.0),
        "tokens_per_s": train["tokens"] / max(train.get("train_seconds", 0.0), 1e-9),  # over the whole run
        "checkpoint": str(found[0]),
    }


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
