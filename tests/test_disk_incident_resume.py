"""A disk incident (orchestrator/saves.py) outlives its session: a resumed run on the same full disk carries on with
the decision its checkpoint names instead of journaling a new one, and while the incident lasts a save that would
not fit is made room for first (room_keep) instead of failing a write."""

import json
import shutil
from collections import namedtuple

import trimtab
from trimtab.checkpoint import _sealed, list_checkpoints
from trimtab.config import load_config, merge
from trimtab.orchestrator import saves
from trimtab.rundir import read_decisions

Usage = namedtuple("Usage", "total used free")


def _cfg(out, steps, faults):
    base = {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "log_every": 2, "batch_tokens": 1024, "eval_tokens": 1024}
        | {"precision": "fp32"},
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": 2, "keep": 3},
        "log": {"progress": False, "tensorboard": False, "report": False},
        "faults": list(faults),
        "orchestrator": {"throughput": {"enabled": False}, "checkpoint_interval": {"enabled": False}},
    }
    return load_config(preset="debug", overrides=merge(base, {}))


def _disk(out):
    return [d for d in read_decisions(out, abandoned=True) if d["rule"] == "disk"]


def test_a_resumed_sessions_save_out_of_space_is_the_same_incident(tmp_path):
    # before: the resumed session's failure at step 6 journaled a second disk decision (a 16 MiB tmpfs, kill -9
    # at step 40 and resumed: decisions at 15 and 45, each save failing once in both sessions)
    out = tmp_path / "r"
    trimtab.train(_cfg(out, 4, ["disk_full@2"]))
    trimtab.train(_cfg(out, 8, ["disk_full@2", "disk_full@6"]))
    disk = _disk(out)
    assert [(d["step"], d["action"]) for d in disk] == [(2, "save_checkpoint")]
    assert disk[0]["evidence"]["seen_again"] == 1 and disk[0]["evidence"]["last_seen_at"] == 6
    assert list_checkpoints(out)[-1].name == "step_000008"


def test_the_incident_makes_room_before_a_save_that_would_not_fit(tmp_path, monkeypatch):
    # the resumed session's disk reads full: each save it owes frees the older checkpoints first and none fails
    out = tmp_path / "r"
    trimtab.train(_cfg(out, 4, ["disk_full@2"]))
    assert [p.name for p in list_checkpoints(out)][-2:] == ["step_000002", "step_000004"]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 30, 0))
    summary = trimtab.train(_cfg(out, 8, ["disk_full@2"]))
    assert summary["status"] == "completed"
    disk = _disk(out)
    assert len(disk) == 1 and disk[0]["evidence"]["made_room"] == 2 and "seen_again" not in disk[0]["evidence"]
    # each save made room down to the newest one first (never the last good, nor the best evaluation's: step 4's,
    # the first session's last, until step 8's evaluation, which comes before step 8's save and its room), then
    # was written beside it
    assert [p.name for p in list_checkpoints(out)] == ["step_000006", "step_000008"]


def test_room_keep_frees_only_what_the_next_save_needs(tmp_path, monkeypatch):
    for step in (5, 10, 15):
        folder = tmp_path / "checkpoints" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    room = saves.ROOM_MARGIN + 4096

    def free(n):
        monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 0, n))

    free(room)
    assert saves.room_keep(tmp_path, 1) is None  # it fits beside them all: checkpoint.keep holds (space freed)
    free(room - 1)
    assert saves.room_keep(tmp_path, 1) == 2  # one checkpoint's bytes short: the oldest goes
    free(0)
    assert saves.room_keep(tmp_path, 1) == 1  # never below the disk rule's keep
    assert saves.room_keep(tmp_path / "none", 1) is None


def test_making_room_keeps_the_best_evaluations_checkpoint(tmp_path, monkeypatch):
    # the remedy's freeing kept the last good checkpoint alone: on a disk incident that makes room before each save
    # the best evaluation's (here step 2's, as the checkpoint says) went first; it stays, as pruning keeps it
    out = tmp_path / "r"
    trimtab.train(_cfg(out, 4, ["disk_full@2"]))
    newest = list_checkpoints(out)[-1] / "state.json"
    state = json.loads(newest.read_text())
    state["best"] = {"eval": [2, 0.5], "checkpoint": 2}  # no later evaluation beats a loss of 0.5
    newest.write_text(json.dumps(_sealed(state)))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 30, 0))
    assert trimtab.train(_cfg(out, 8, ["disk_full@2"]))["status"] == "completed"
    assert [p.name for p in list_checkpoints(out)] == ["step_000002", "step_000006", "step_000008"]
