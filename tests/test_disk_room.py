"""While a disk incident stands (orchestrator/saves.py), every save the run makes is made room for before it writes:
the periodic ones, a phase's last, a stop's (room_for_save, asked by Checkpointing.save), never freeing the last good,
the best evaluation's or the reference checkpoint."""

import shutil
from collections import namedtuple

import trimtab
from trimtab.checkpoint import list_checkpoints
from trimtab.config import load_config, merge
from trimtab.rundir import read_decisions

Usage = namedtuple("Usage", "total used free")


def _cfg(out, steps, faults, every=2):
    base = {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "log_every": 2, "batch_tokens": 1024, "eval_tokens": 1024}
        | {"precision": "fp32"},
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": every, "keep": 3},
        "log": {"progress": False, "tensorboard": False, "report": False},
        "faults": list(faults),
        "orchestrator": {"throughput": {"enabled": False}, "checkpoint_interval": {"enabled": False}},
    }
    return load_config(preset="debug", overrides=merge(base, {}))


def _disk(out):
    return [d for d in read_decisions(out, abandoned=True) if d["rule"] == "disk"]


def _full(monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 30, 0))


def test_the_runs_last_save_off_the_interval_is_made_room_for(tmp_path, monkeypatch):
    # before: only the saves due at checkpoint.every were (6, 8); the final one at 9 wrote beside them all and, on a
    # real full disk, failed once first (a 16 MiB tmpfs, every 5, 23 steps: seen_again at step 23)
    out = tmp_path / "r"
    trimtab.train(_cfg(out, 4, ["disk_full@2"]))
    _full(monkeypatch)
    assert trimtab.train(_cfg(out, 9, ["disk_full@2"]))["status"] == "completed"
    (disk,) = _disk(out)
    assert disk["evidence"]["made_room"] == 3 and "seen_again" not in disk["evidence"]
    # step 9's evaluation beat step 4's: the last good (8) is the one kept beside it
    assert [p.name for p in list_checkpoints(out)] == ["step_000008", "step_000009"]


def test_a_stops_save_is_made_room_for(tmp_path, monkeypatch):
    # SIGTERM at step 7: the stop's save at 7, off the interval, frees the older checkpoints first too
    out = tmp_path / "r"
    trimtab.train(_cfg(out, 4, ["disk_full@2"]))
    _full(monkeypatch)
    summary = trimtab.train(_cfg(out, 20, ["disk_full@2", "sigterm@7"]))
    assert summary["step"] == 7, summary
    (disk,) = _disk(out)
    assert disk["evidence"]["made_room"] == 2 and "seen_again" not in disk["evidence"]
    # step 4 the best evaluation's, step 6 the last good: both kept through the freeing
    assert [p.name for p in list_checkpoints(out)] == ["step_000004", "step_000006", "step_000007"]
