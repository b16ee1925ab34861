"""A stop's snapshot written before the mark (snapshots.LAST_WEIGHTS) is freed like a marked one once a good
checkpoint supersedes it, known by the journal's disk stop at its step; a lean snapshot never is."""

import json

import torch

from trimtab import snapshots
from trimtab.snapshots import list_snapshots, save_snapshot


def _old_style(run_dir, step):
    """What save_last_weights wrote before the mark: a plain snapshot, state.json without last_weights."""
    save_snapshot(run_dir, step, {"w": torch.ones(4, 4)}, {"tokens": step * 64}, keep=10, keep_every=0)


def _journal(run_dir, *stops):
    """decisions.jsonl with the disk rule's stop at each of `stops` (abandoned by the resume, as a stop is)."""
    lines = [{"id": 1, "step": 2, "rule": "disk", "action": "save_checkpoint"}]
    lines += [
        {"id": 2 + i, "step": s, "rule": "disk", "action": "stop", "abandoned": True} for i, s in enumerate(stops)
    ]
    (run_dir / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))


def _names(run_dir):
    return [p.name for p in list_snapshots(run_dir)]


def test_an_unmarked_snapshot_of_a_journaled_stop_is_freed_once_superseded(tmp_path):
    for step in (10, 15, 20, 25):
        _old_style(tmp_path, step)
    assert "last_weights" not in json.loads((tmp_path / "snapshots" / "step_000015" / "state.json").read_text())
    assert snapshots.drop_superseded(tmp_path, 30) == []  # no journal: none is known to be a stop's
    _journal(tmp_path, 15, 20, 25)
    # 10: no stop there (a lean snapshot's); 25: past the newest good checkpoint, the only copy of its steps
    gone = snapshots.drop_superseded(tmp_path, 22)
    assert [p.name for p in gone] == ["step_000015", "step_000020"]
    assert _names(tmp_path) == ["step_000010", "step_000025"]


def test_an_unmarked_snapshot_on_the_lean_cadence_is_kept(tmp_path):
    # a stop whose own write failed names the lean snapshot of its step (checkpointing.py _weights_not_kept)
    for step in (20, 25):
        _old_style(tmp_path, step)
    _journal(tmp_path, 20, 25)
    assert [p.name for p in snapshots.drop_superseded(tmp_path, 30, lean_every=10)] == ["step_000025"]
    assert _names(tmp_path) == ["step_000020"]
