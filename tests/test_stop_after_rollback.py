"""A run stopped right after a rollback: the stop saves the restored step again, with what the
rollback decided since (its journal line, the ladder, the LR cut), so the resumed run keeps it
(issue: the checkpoint on disk was taken as current, the stop saved nothing, and the resume
marked the applied rollback abandoned)."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch

import trimtab
from test_orchestrator_loop import debug_cfg, decisions
from trimtab.checkpoint import list_checkpoints, save_checkpoint, verify
from trimtab.training.hooks import Hook

# the second noise strikes in the replay from step 8, so its rollback cuts the LR (x0.1);
# the stop lands on the step of that rollback, the run back at step 8
FAULTS = ["weights_noise@12:10", "weights_noise@15:10", "sigterm@17"]
ROLLBACKS = [
    "rolled back from step 14 to step 8",
    "rolled back from step 17 to step 8; lr multiplier 1 -> 0.1",
]


def rollbacks(run):
    return [d for d in decisions(run) if d["action"] == "rollback"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_stop_right_after_a_rollback_saves_what_it_decided(tmp_path, asynchronous):
    """Either way of saving: the background one's write is finished by the stop's save."""
    run = tmp_path / "r"
    cfg = debug_cfg(run, steps=24, faults=FAULTS, checkpoint={"every": 8, "asynchronous": asynchronous})
    first = trimtab.train(cfg)
    assert first["status"] == "stopped (SIGTERM)" and first["step"] == 8
    assert [d["applied"][0] for d in rollbacks(run)] == ROLLBACKS
    saved = verify(list_checkpoints(run)[-1])
    assert saved["step"] == 8 and saved["train"]["rollbacks"] == 2 and saved["train"]["lr_scale"] == 0.1
    assert saved["good"], "still the run's last good checkpoint: the weights are the restored ones"

    second = trimtab.train(cfg)
    assert second["status"] == "completed" and second["step"] == 24
    kept = rollbacks(run)
    assert [d["applied"][0] for d in kept] == ROLLBACKS
    assert not any(d.get("abandoned") for d in kept)
    assert kept[-1]["outcome"]["result"] == "recovered"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["decisions"] == len(decisions(run)) == 6


class StopAtStart(Hook):
    """Stops a resumed run before its first step: its checkpoint is the state it stops in."""

    def on_train_start(self, run):
        run.control.request("stop", reason="test")


def test_a_stop_with_nothing_changed_since_the_checkpoint_writes_nothing(tmp_path):
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=10, faults=["sigterm@4"]))
    state = run / "checkpoints" / "step_000004" / "state.json"
    before = state.stat().st_mtime_ns
    assert trimtab.train(debug_cfg(run, steps=10), hooks=[StopAtStart()])["step"] == 4
    assert state.stat().st_mtime_ns == before


def test_saving_a_step_again_replaces_it_whole_and_keeps_it_until_then(tmp_path, monkeypatch):
    """The stop's save writes the restored step again: the old copy goes only once the new one is
    in place, so a failure in between (or a kill) leaves a checkpoint of that step."""
    weights = {"w": torch.zeros(4)}
    save_checkpoint(tmp_path, 8, weights, {}, {"train": {"rollbacks": 0}}, keep=2)
    save_checkpoint(tmp_path, 8, weights, {}, {"train": {"rollbacks": 1}}, keep=2)
    assert verify(tmp_path / "checkpoints" / "step_000008")["train"]["rollbacks"] == 1
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000008"]

    def fail_into_place(src, dst, replace=os.replace):
        if Path(src).name == f".tmp_step_000008_{os.getpid()}":  # the new copy's rename into place
            raise OSError(errno.EIO, "injected")
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_into_place)
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(tmp_path, 8, weights, {}, {"train": {"rollbacks": 2}}, keep=2)
    assert verify(tmp_path / "checkpoints" / "step_000008")["train"]["rollbacks"] == 1
