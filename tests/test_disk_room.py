"""While a disk incident stands (orchestrator/saves.py), every save the run makes is made room for before it writes:
the periodic ones, a phase's last, a stop's (room_for_save, asked by Checkpointing.save), never freeing the last good,
the best evaluation's or the reference checkpoint."""

import shutil
from collections import namedtuple

import trimtab
from test_disk_incident_resume import _cfg, _disk  # the same runs: a debug run saving every 2 steps
from trimtab.checkpoint import list_checkpoints
from trimtab.report.page import _outcome
from trimtab.report.runs import run_row

Usage = namedtuple("Usage", "total used free")


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


def test_a_retry_is_judged_on_the_saves_after_it_not_the_loss(tmp_path):
    # before: judged on the loss like an instability, a 7-step run's retry at step 6, its saves at 6 and 7 written,
    # read "too early" and `trimtab runs` counted no fault healed; the report says the room made and a return
    out = tmp_path / "r"
    trimtab.train(_cfg(out, 7, ["disk_full@6"]))
    (disk,) = _disk(out)
    assert disk["outcome"]["result"] == "recovered" and disk["outcome"]["saves_after"] == 2, disk["outcome"]
    assert read_runs_healed(out) == 1
    out = tmp_path / "again"  # back at step 9, whose retry and the run's last try fail: the run ends unsaved
    trimtab.train(_cfg(out, 9, ["disk_full@6", "disk_full@9:5"]))
    first = _disk(out)[0]
    assert first["outcome"]["result"] == "not recovered" and first["outcome"]["last_failed"] == 9, first["outcome"]
    assert _outcome(first, 20) == "not recovered (came back 1 time, last at step 9)"


def test_the_report_says_the_room_made_before_later_saves(tmp_path, monkeypatch):
    out = tmp_path / "r"
    trimtab.train(_cfg(out, 4, ["disk_full@2"]))
    _full(monkeypatch)
    trimtab.train(_cfg(out, 9, ["disk_full@2"]))
    (disk,) = _disk(out)
    assert "(room made before 3 later saves, deleting " in _outcome(disk, 20), _outcome(disk, 20)


def read_runs_healed(out):
    return run_row(out, out.parent)["healed"]  # `trimtab runs`' faults healed


def test_a_retry_that_freed_room_but_failed_does_not_say_nothing_changed(tmp_path, capsys):
    # the retry at step 6 deletes the checkpoints at steps 0 and 2 (step 4 is the last good), then its save fails too
    out = tmp_path / "r"
    trimtab.train(_cfg(out, 7, ["disk_full@6:2"]))
    err = capsys.readouterr().err
    assert "step 6 disk: save_checkpoint failed: deleted 2 older checkpoints; the checkpoint at step 6" in err, err
    assert "nothing changed" not in err
