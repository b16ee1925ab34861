"""Lean snapshots (`checkpoint.snapshot_every`, docs/resilience.md): frequent weights-only copies
of the model in bf16, beside the full-precision resumable checkpoints, for evaluation and export
(`trimtab export RUN --snapshot STEP`); a quarter of a checkpoint's bytes (fp32 weights and AdamW's
two moments: 12 bytes a parameter against 2).

    RUN/snapshots/step_000500/model.safetensors   bf16 floating tensors (integer buffers as they are)
    RUN/snapshots/step_000500/state.json          step, tokens, MoE / MoD state, the files' manifest

Each is written into a temporary directory, sealed with a manifest and renamed into place as a
checkpoint is (checkpoint.install), so a snapshot is whole or absent and `trimtab export` checks
it as it checks a checkpoint. Retention: the newest `keep`, every `keep_every`-th step's (0: none), and never
the newest one. The disk rule's stop keeps its last weights the same way, in fp32 where they fit (bf16
weights in bf16: a snapshot never upcasts) (save_last_weights): they are what a new run trains on from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from trimtab.checkpoint import clear_stale, dedup, dir_step, install, put_back_replaced, step_dirs, verify
from trimtab.errors import CheckpointError
from trimtab.rundir import read_decisions
from trimtab.write_errors import writing

PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# room left beyond the fp32 tensors: the safetensors header, state.json and the manifest (a few KB), and
# the other writers of a stopping run (summary.json, the journal, not report.html, which a full disk may refuse)
FP32_MARGIN = 1 << 20
LAST_WEIGHTS = "last_weights"  # state.json's mark of a stop's snapshot (save_last_weights, drop_superseded)


def fp32_fits(run_dir: Path, weights: dict[str, torch.Tensor]) -> bool:
    """Whether the weights fit in fp32 on the run directory's file system, with FP32_MARGIN to spare."""
    need = sum(v.numel() * _kept_dtype(v, torch.float32).itemsize for v in dedup(weights).values())
    return shutil.disk_usage(Path(run_dir)).free >= need + FP32_MARGIN


def save_last_weights(
    run_dir: Path, step: int, weights: dict[str, torch.Tensor], state: dict, keep: int, keep_every: int
) -> tuple[Path, str]:
    """The disk rule's stop (checkpointing.py _keep_weights): the trained weights as they are (fp32, or their
    own narrower dtype such as bf16, never upcast) when they fit in the space left, a run trained on from them
    (train.init_from) keeping their precision; else bf16, half the bytes; neither fitting, once more after
    make_room. Returns the snapshot and the wording of its precision for the stop reason."""
    state = {**state, LAST_WEIGHTS: True}  # drop_superseded's mark: a stop's, not the lean retention's
    try:
        return _save_weights(run_dir, step, weights, state, keep, keep_every)
    except OSError:
        if not make_room(run_dir, step, keep_every):
            raise
    return _save_weights(run_dir, step, weights, state, keep, keep_every)


def drop_superseded(run_dir: Path, last_good: int, lean_every: int = 0) -> list[Path]:
    """A stop's snapshots (save_last_weights) that good checkpoint `last_good` supersedes, deleted for the disk
    rule to free space: at or before its step, a later session's checkpoint holds those weights (or newer ones)
    with the optimizer state. A resume on a still-full disk kept the given-up session's bf16 copy to the end
    (debug: snapshots/step_000015 beside checkpoints 55 and 60, the tmpfs 99% full). Never a snapshot past it
    (the only copy of the steps trained since), nor the lean retention's (checkpoint.snapshot_every, `lean_every`:
    kept for evaluation). Returns the deleted."""
    gone, stops = [], None
    for path in list_snapshots(run_dir):
        if dir_step(path) > last_good:
            break
        try:
            state = json.loads((path / "state.json").read_text())
        except (OSError, ValueError):  # unreadable: not known to be a stop's, so kept
            continue
        if not state.get(LAST_WEIGHTS, False):
            stops = _stopped_at(run_dir) if stops is None else stops
            if not _older_stop(dir_step(path), stops, lean_every):
                continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


def _older_stop(step: int, stops: set[int], lean_every: int) -> bool:
    """Whether an unmarked snapshot is a stop's written before the mark (LAST_WEIGHTS): the same files, so known
    by the journal only, the disk rule's stop at its very step (abandoned by the resume or not), and off the
    lean cadence (where the stop's own write failed, a lean snapshot of its step held its weights: kept). Before,
    such a snapshot was never freed (an older version's step_000015, 1.1 MiB of a 16 MiB tmpfs to the end)."""
    return step in stops and not (lean_every and step % lean_every == 0)


def _stopped_at(run_dir: Path) -> set[int]:
    """The steps the run's journal has the disk rule's stop at."""
    found = read_decisions(run_dir, abandoned=True)
    return {d["step"] for d in found if d.get("rule") == "disk" and d.get("action") == "stop"}


def make_room(run_dir: Path, step: int, keep_every: int) -> list[Path]:
    """The snapshots before `step` but the newest of them (and keep_every's), deleted for the disk rule's stop
    to keep step `step`'s weights in their space: older weights replaced by newer ones. Never the newest: until
    the new one is whole it is the run's last weights kept. Returns the deleted."""
    older = [p for p in list_snapshots(run_dir) if dir_step(p) < step][:-1]
    gone = [p for p in older if not (keep_every and dir_step(p) % keep_every == 0)]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def newest_weights(run_dir: Path, step: int) -> Path | None:
    """The snapshot that holds the run's last weights kept when step `step`'s did not fit: that step's own (an
    earlier session's stop at the same step left it), else the newest at or before it; one that fails its
    manifest does not count (None: no such snapshot)."""
    for path in sorted(list_snapshots(run_dir), key=lambda p: (dir_step(p) != step, -dir_step(p))):
        if dir_step(path) > step:
            continue
        try:
            verify(path)
        except CheckpointError:
            continue
        return path
    return None


def _save_weights(
    run_dir: Path, step: int, weights: dict[str, torch.Tensor], state: dict, keep: int, keep_every: int
) -> tuple[Path, str]:
    """save_last_weights' write: fp32 where it fits, else bf16."""
    if fp32_fits(run_dir, weights):
        try:
            path = save_snapshot(run_dir, step, weights, state, keep, keep_every, "fp32")
        except OSError:  # the space went to another writer since: bf16 still may fit
            pass
        else:
            kept = kept_precision(weights, torch.float32)
            return path, kept if kept == "fp32" else f"{kept}: the weights' own, none upcast to fp32"
    free = shutil.disk_usage(Path(run_dir)).free / 2**20
    path = save_snapshot(run_dir, step, weights, state, keep, keep_every)
    return path, f"bf16: fp32 did not fit in the {free:.1f} MiB left; a run trained on from it starts rounded"


def _kept_dtype(v: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """`dtype` for a floating tensor, unless it is narrower already (bf16 weights in an fp32 snapshot): upcast,
    it would take twice the bytes and hold no more precision. Other tensors (integer buffers) as they are."""
    return v.dtype if not v.is_floating_point() or v.element_size() < dtype.itemsize else dtype


def kept_precision(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    """The floating dtypes a snapshot in `dtype` keeps these weights in, widest first: "fp32", "bf16",
    "fp32+bf16"; "" for weights without a floating tensor."""
    kept = {_kept_dtype(v, dtype) for v in weights.values() if v.is_floating_point()}
    return "+".join(NAMES.get(d, str(d).removeprefix("torch.")) for d in sorted(kept, key=lambda d: -d.itemsize))


def snapshot_root(run_dir: Path) -> Path:
    return Path(run_dir) / "snapshots"


def list_snapshots(run_dir: Path) -> list[Path]:
    """Snapshot directories, oldest first."""
    return step_dirs(snapshot_root(run_dir))


def save_snapshot(
    run_dir: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    state: dict,
    keep: int,
    keep_every: int,
    precision: str = "bf16",
) -> Path:
    """Write snapshot `step` (floating tensors as `precision`, bf16 or fp32, a narrower one as it is; `state`:
    the run's tokens and MoE / MoD state, as a checkpoint keeps them) atomically, then apply the retention."""
    root = snapshot_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    # a tied head is stored once, as in a checkpoint (load_model ties it again)
    dtype = PRECISIONS[precision]
    lean = {k: v.to(_kept_dtype(v, dtype)) for k, v in dedup(weights).items()}
    try:
        with writing(tmp):
            tmp.mkdir()
            save_file(lean, str(tmp / "model.safetensors"))
            install(tmp, final, {**state, "step": step, "snapshot": kept_precision(weights, dtype) or precision})
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
    steps = [dir_step(p) for p in found]
    kept = set(steps[-keep:]) | {s for s in steps if keep_every and s % keep_every == 0}
    gone = [p for p, s in zip(found, steps) if s not in kept]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone
