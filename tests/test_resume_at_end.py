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


def test_the_summary_of_a_session_stopped_in_its_start_up_is_not_taken_for_the_runs(tmp_path):
    """A SIGTERM in a relaunch's start-up writes summary.json (the Slurm script requeues on it) over
    the finished run's, at the checkpoint's step. Taken for the run's own, the next relaunch said
    "has not finished: its last session stopped (SIGTERM during start-up)" and never wrote the
    finished run's summary again; now it ends the run as after a session killed before its summary."""
    from trimtab.rundir import write_summary
    from trimtab.training.resume import saved_summary
    from trimtab.training.services.signals import StartUpInterrupted

    checkpoint = tmp_path / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    write_summary(tmp_path, StartUpInterrupted("SIGTERM", tmp_path).summary)
    found = (checkpoint, {"train": {"step": 2, "tokens": 64, "train_seconds": 1.0}})
    summary, saved = saved_summary(tmp_path, found, 2)
    assert saved is False and (summary["status"], summary["step"]) == ("completed", 2)
    write_summary(tmp_path, {"status": "completed", "step": 2, "val_loss": 5.0})  # the run's own is kept as before
    assert saved_summary(tmp_path, found, 2) == ({"status": "completed", "step": 2, "val_loss": 5.0}, True)


def test_the_final_evaluation_a_rollback_abandoned_is_not_the_summarys(tmp_path):
    """The evaluation logged_eval gives a session resumed at the run's end is a kept line of that step: a
    step-20 evaluation of the branch a rollback to 16 abandoned, then a replay killed after its step-20
    save and before its evaluation, left only the abandoned line; its figures were another model's."""
    from trimtab.rundir import write_jsonl
    from trimtab.training.resume import logged_eval

    lines = [
        {"step": 16, "loss": 3.0, "lr": 1e-3},
        {"step": 20, "loss": 9.0, "lr": 1e-3, "abandoned": True},
        {"step": 20, "val_loss": 9.5, "abandoned": True},  # the abandoned branch's evaluation
        {"step": 20, "loss": 2.9, "lr": 1e-3},
    ]
    write_jsonl(tmp_path / "metrics.jsonl", lines)
    assert logged_eval(tmp_path, 20) == {}
    write_jsonl(tmp_path / "metrics.jsonl", [*lines, {"step": 20, "val_loss": 2.8}])
    assert logged_eval(tmp_path, 20) == {"step": 20, "val_loss": 2.8}
