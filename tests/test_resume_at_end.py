"""A session killed after its last checkpoint, before summary.json and the report (a preemption in
the final upload): the same command again said "has not finished ... nothing was trained", exit 0,
and never wrote them, so a wrapper relaunching until exit 0 ended with no summary. It now ends the
run as the killed session would have: summary.json (the final evaluation metrics.jsonl logged) and
the report, nothing trained, metrics.jsonl untouched."""

import logging

import trimtab
from test_trainer import debug_cfg
from trimtab.rundir import read_json


def test_a_run_killed_before_its_summary_writes_it_on_the_next_session(tmp_path, caplog):
    run_dir = tmp_path / "r"
    cfg = debug_cfg(run_dir, steps=2, train={"max_steps": 2, "eval_every": 2})
    first = trimtab.train(cfg)
    assert first["status"] == "completed" and first["val_loss"] is not None
    metrics, reported = (run_dir / "metrics.jsonl").read_bytes(), (run_dir / "report.html").is_file()
    for name in ("summary.json", "report.html"):  # what the kill left unwritten
        (run_dir / name).unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING):
        again = trimtab.train(debug_cfg(run_dir, steps=2, train={"max_steps": 2, "eval_every": 2}))
    assert "before writing summary.json and the report: this session writes them, training nothing" in caplog.text
    assert again["status"] == "completed" and again["steps_this_session"] == 0
    assert (again["step"], again["val_loss"], again["eval_final"]) == (2, first["val_loss"], True)
    assert (
        read_json(run_dir / "summary.json")["val_loss"] == first["val_loss"]
        and (run_dir / "report.html").is_file() == reported
    )
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics  # no step, no evaluation logged again
