"""Lean snapshots around a kill and broken weights: what a SIGKILL in a snapshot's write leaves is
cleaned up (or put back, when it is a step's only copy), and weights that are not finite are never
written as a snapshot (the retention would make room for them by deleting the good ones)."""

import os
from types import SimpleNamespace

import torch
from torch import nn

from trimtab.snapshots import list_snapshots, save_snapshot, snapshot_root
from trimtab.training.checkpointing import Checkpointing


def weights(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), value)}


def test_a_killed_snapshot_write_leaves_no_copy_behind_and_an_only_copy_is_put_back(tmp_path):
    for step in (1, 2):
        save_snapshot(tmp_path, step, weights(), {"tokens": step}, keep=3, keep_every=0)
    root = snapshot_root(tmp_path)
    leaked = root / ".tmp_step_000003_999999"  # a writer SIGKILLed before its rename
    leaked.mkdir()
    (leaked / "model.safetensors").write_bytes(os.urandom(4096))
    # killed between _replace_dir's two renames: step 2's only copy is the aside one
    os.replace(root / "step_000002", root / ".tmp_step_000002_replaced_999999")
    save_snapshot(tmp_path, 4, weights(), {"tokens": 4}, keep=3, keep_every=0)
    assert [p.name for p in list_snapshots(tmp_path)] == ["step_000001", "step_000002", "step_000004"]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp")) == []


class Tiny(nn.Linear):
    def moe_state(self):
        return {}

    def mod_state(self):
        return {}


def test_weights_that_are_not_finite_are_not_snapshotted_and_the_good_ones_stay(tmp_path):
    said = []
    model = Tiny(4, 4)
    run = SimpleNamespace(
        cfg=SimpleNamespace(run_dir=tmp_path, checkpoint=SimpleNamespace(snapshot_keep=1, snapshot_keep_every=0)),
        state=SimpleNamespace(step=1, tokens=10),
        model=model,
        dist=SimpleNamespace(
            all_finite=lambda params: all(bool(torch.isfinite(p).all()) for p in params),
            on_main=lambda fn, *args: fn(*args),
        ),
        say=said.append,
    )
    Checkpointing.snapshot(run)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    run.state.step = 2
    Checkpointing.snapshot(run)
    assert [p.name for p in list_snapshots(tmp_path)] == ["step_000001"]  # keep=1: step 1 is not pushed out
    assert said == ["step 2: the weights are not finite: no lean snapshot written"]
