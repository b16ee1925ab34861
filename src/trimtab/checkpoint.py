"""Atomic checkpoints: write to a temp dir, fsync, rename; verify on load; fall back when corrupt.

    checkpoints/step_000120/
        model.safetensors   weights (tied tensors stored once)
        optim.pt            optimizer state + RNG states (loaded with weights_only=True)
        state.json          step, tokens, data position, hook state, and a manifest
                            (size + sha256 of each file) that makes truncation detectable

state.json is written last, inside the temp dir, so a directory named step_* is complete by
construction; the manifest still catches later damage (a truncated copy, a bad disk).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from trimtab.errors import CheckpointError

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def save_checkpoint(run_dir: Path, step: int, model_state: dict[str, torch.Tensor],
                    optim_state: dict[str, Any], state: dict[str, Any], keep: int,
                    protect: tuple[int, ...] = ()) -> Path:
    """Write checkpoint `step` atomically and prune to the newest `keep` (plus `protect` steps)."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file(_dedup(model_state), str(tmp / "model.safetensors"))
        torch.save(optim_state, tmp / "optim.pt")
        manifest = {name: _digest(tmp / name) for name in ("model.safetensors", "optim.pt")}
        _write_json(tmp / "state.json", {**state, "step": step, "manifest": manifest})
        for name in ("model.safetensors", "optim.pt", "state.json"):
            _fsync(tmp / name)
        _fsync(tmp)
        if final.exists():  # re-saving a step (after a rollback): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(run_dir, keep, protect=(*protect, step))
    return final


def prune(run_dir: Path, keep: int, protect: tuple[int, ...] = ()) -> None:
    ckpts = list_checkpoints(run_dir)
    for path in ckpts[:-keep]:
        if _step_of(path) not in protect:
            shutil.rmtree(path, ignore_errors=True)
    for stale in checkpoint_root(run_dir).glob(".tmp_step_*"):  # left by a killed writer
        shutil.rmtree(stale, ignore_errors=True)


def verify(path: Path) -> dict[str, Any]:
    """Return the checkpoint's state.json after checking every file against the manifest."""
    try:
        state = json.loads((path / "state.json").read_text())
        manifest = state["manifest"]
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: unreadable state.json ({exc})") from None
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if _digest(file) != expected:
            raise CheckpointError(f"{file}: size or checksum differs from the manifest (truncated or corrupt)")
    return state


def latest_valid(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """Newest checkpoint that verifies; corrupt newer ones are skipped with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, verify(path)
        except CheckpointError as exc:
            log.warning("skipping corrupt checkpoint: %s; falling back to the previous one", exc)
    return None


def find_checkpoint(run_dir: Path, to: str | int = "last_good") -> tuple[Path, dict[str, Any]] | None:
    """A rollback target: the newest valid checkpoint marked good (`"last_good"`), or the newest
    valid one at or before step `to`."""
    for path in reversed(list_checkpoints(run_dir)):
        if to != "last_good" and _step_of(path) > int(to):
            continue
        try:
            state = verify(path)
        except CheckpointError as exc:
            log.warning("skipping corrupt checkpoint: %s", exc)
            continue
        if to != "last_good" or state.get("good"):
            return path, state
    return None


def retire_after(run_dir: Path, step: int, keep: int) -> list[Path]:
    """After a rollback to `step`, newer checkpoints belong to an abandoned trajectory: move them to
    checkpoints/rolled_back/ (kept for inspection, newest `keep`) so resume never picks them."""
    attic = checkpoint_root(run_dir) / "rolled_back"
    moved = []
    for path in list_checkpoints(run_dir):
        if _step_of(path) > step:
            attic.mkdir(exist_ok=True)
            target = attic / path.name
            shutil.rmtree(target, ignore_errors=True)
            os.replace(path, target)
            moved.append(target)
    for old in sorted(attic.iterdir(), key=lambda p: p.stat().st_mtime)[:-keep] if moved else []:
        shutil.rmtree(old, ignore_errors=True)
    return moved


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    state = verify(path)
    weights = load_file(str(path / "model.safetensors"))
    optim_state = torch.load(path / "optim.pt", weights_only=True, map_location="cpu")
    return weights, optim_state, state


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: Path) -> None:
    """Load weights saved by save_checkpoint (tied tensors were stored once)."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in weights and not _is_tied(model, k, weights)]
    unexpected = [k for k in weights if k not in expected]
    mismatched = [k for k, v in weights.items() if k in expected and v.shape != expected[k].shape]
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"{source}: weights do not fit this model (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, shape mismatch {mismatched[:3]}); the model config differs from the "
            "one that trained it: use the same model settings or a new --out")
    model.load_state_dict(weights, strict=False)


def _is_tied(model: torch.nn.Module, key: str, weights: dict[str, torch.Tensor]) -> bool:
    sd = model.state_dict()
    ptr = sd[key].data_ptr()
    return any(k in weights for k, v in sd.items() if k != key and v.data_ptr() == ptr)


def _dedup(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses aliased tensors: keep the first name of each storage."""
    seen: set[int] = set()
    out = {}
    for key, tensor in state.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[key] = tensor.detach().contiguous().cpu()
    return out


def _digest(path: Path) -> dict[str, Any]:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            sha.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))
