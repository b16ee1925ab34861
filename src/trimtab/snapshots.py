"""Lean snapshots (`checkpoint.snapshot_every`, docs/resilience.md): frequent weights-only copies
of the model in bf16, beside the full-precision resumable checkpoints, for evaluation and export
(`trimtab export RUN --snapshot STEP`); a quarter of a checkpoint's bytes (fp32 weights and AdamW's
two moments: 12 bytes a parameter against 2).

    RUN/snapshots/step_000500/model.safetensors   bf16 floating tensors (integer buffers as they are)
    RUN/snapshots/step_000500/state.json          step, tokens, MoE / MoD state, the files' manifest

Each is written into a temporary directory, sealed with a manifest and renamed into place as a
checkpoint is (checkpoint.install), so a snapshot is whole or absent and `trimtab export` checks
it as it checks a checkpoint. Retention: the newest `keep`, every `keep_every`-th step's (0: none), and never
the newest one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from trimtab.checkpoint import STEP_DIR, clear_stale, dedup, install, put_back_replaced, step_dirs
from trimtab.write_errors import writing


def snapshot_root(run_dir: Path) -> Path:
    return Path(run_dir) / "snapshots"


def list_snapshots(run_dir: Path) -> list[Path]:
    """Snapshot directories, oldest first."""
    return step_dirs(snapshot_root(run_dir))


def save_snapshot(
    run_dir: Path, step: int, weights: dict[str, torch.Tensor], state: dict, keep: int, keep_every: int
) -> Path:
    """Write snapshot `step` (floating tensors as bf16; `state`: the run's tokens and MoE / MoD
    state, as a checkpoint keeps them) atomically, then apply the retention."""
    root = snapshot_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    # a tied head is stored once, as in a checkpoint (load_model ties it again)
    lean = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in dedup(weights).items()}
    try:
        with writing(tmp):
            tmp.mkdir()
            save_file(lean, str(tmp / "model.safetensors"))
            install(tmp, final, {**state, "step": step, "snapshot": "bf16"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_snapshots(run_dir, keep, keep_every)
    return final


def prune_snapshots(run_dir: Path, keep: int, keep_every: int) -> list[Path]:
    """Delete the snapshots the retention does not keep, and what a killed writer left (a step's
    only copy, renamed aside while it was saved again, is put back first); returns the deleted."""
    put_back_replaced(snapshot_root(run_dir))
    clear_stale(snapshot_root(run_dir))  # each a bf16 copy of the weights: a kill in a write leaked it
    found = list_snapshots(run_dir)
    steps = [int(STEP_DIR.match(p.name).group(1)) for p in found]
    kept = set(steps[-keep:]) | {s for s in steps if keep_every and s % keep_every == 0}
    gone = [p for p, s in zip(found, steps) if s not in kept]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone
