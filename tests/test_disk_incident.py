"""A save out of space again is the same incident (orchestrator/saves.py SaveGuard._again), and a stop's
snapshot a later checkpoint superseded is freed when space is needed (snapshots.drop_superseded)."""

import json
import os

import torch

from helpers import trimtab_cli
from trimtab import snapshots
from trimtab.rundir import read_decisions
from trimtab.snapshots import list_snapshots, save_last_weights, save_snapshot


def test_a_save_out_of_space_again_is_counted_on_the_first_disk_decision(tmp_path):
    # each save at 5, 10 and 15 fails once (ENOSPC) and its retry is written: one incident, one decision
    # (before: three, one a save, as a tmpfs holding two checkpoints journaled one at each of its 10 saves)
    out = tmp_path / "r"
    args = ["train", "--preset", "debug", "--out", str(out), "--max-steps", "20"]
    sets = ("checkpoint.every=5", "train.eval_every=0", "log.progress=false", "log.tensorboard=false")
    sets += ("log.report=false", 'faults=["disk_full@5","disk_full@10","disk_full@15"]')
    for s in sets:
        args += ["--set", s]
    done = trimtab_cli(args, tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    disk = [d for d in read_decisions(out, abandoned=True) if d["rule"] == "disk"]
    assert len(disk) == 1, [(d["step"], d["action"]) for d in disk]
    assert disk[0]["step"] == 5 and disk[0]["action"] == "save_checkpoint"
    assert disk[0]["evidence"]["seen_again"] == 2 and disk[0]["evidence"]["last_seen_at"] == 15
    assert all(not a.startswith("failed") for a in disk[0]["applied"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step_000020"


def _weights() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(4, 4)}


def test_only_a_stops_snapshot_a_good_checkpoint_passed_is_dropped(tmp_path):
    save_snapshot(tmp_path, 10, _weights(), {}, keep=5, keep_every=0)  # the lean retention's: kept
    save_last_weights(tmp_path, 15, _weights(), {}, keep=5, keep_every=0)  # a stop's, superseded at 20
    save_last_weights(tmp_path, 25, _weights(), {}, keep=5, keep_every=0)  # past the checkpoint: the only copy
    assert snapshots.drop_superseded(tmp_path, 14) == []  # the checkpoint is older than the stop's weights
    gone = snapshots.drop_superseded(tmp_path, 20)
    assert [p.name for p in gone] == ["step_000015"]
    assert [p.name for p in list_snapshots(tmp_path)] == ["step_000010", "step_000025"]
    assert json.loads((tmp_path / "snapshots" / "step_000025" / "state.json").read_text())["last_weights"]
