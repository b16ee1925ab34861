"""The run's final evaluation is what summary.json reports: a failure of it is tried again, and
where every try fails the summary says which step its figures are from instead of passing an
older evaluation off as the final one."""

from __future__ import annotations

import trimtab
import trimtab.training.phases as phases_module
from test_trainer import debug_cfg
from trimtab.rundir import read_decisions, read_summary


def test_a_final_evaluation_that_fails_once_is_tried_again(tmp_path, monkeypatch):
    """The run's last evaluation (step 12, after the step-8 one) fails once, as a transient error
    would: it is tried again and the summary's val_loss is step 12's; the journal says the trainer
    tries it again, not that a next evaluation will run (there is none)."""
    held_out, failed = phases_module.held_out_figures, []

    def failing_once_at_the_end(t):
        if t.state.step == 12 and not failed:
            failed.append(t.state.step)
            return {}, "OSError: the eval shard went away"
        return held_out(t)

    monkeypatch.setattr(phases_module, "held_out_figures", failing_once_at_the_end)
    run_dir = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run_dir, steps=12, train={"eval_every": 8}))
    assert failed == [12] and summary["val_loss"] is not None
    assert (summary["eval_step"], summary["eval_final"]) == (12, True)
    (decision,) = [d for d in read_decisions(run_dir) if d["rule"] == "eval_error"]
    assert decision["step"] == 12 and "the trainer tries it again" in decision["reasoning"]
    assert "the next evaluation runs as scheduled" not in decision["reasoning"]


def test_a_final_evaluation_failing_every_try_leaves_the_older_figures_dated(tmp_path, monkeypatch):
    """Every try of the step-12 evaluation fails: three tries, each journaled; the summary keeps
    the step-8 val_loss, dated (eval_step 8, eval_final false)."""
    held_out = phases_module.held_out_figures
    tries = []

    def failing_at_the_end(t):
        if t.state.step == 12:
            tries.append(t.state.step)
            return {}, "OSError: the eval shard went away"
        return held_out(t)

    monkeypatch.setattr(phases_module, "held_out_figures", failing_at_the_end)
    run_dir = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run_dir, steps=12, train={"eval_every": 8}))
    assert tries == [12] * phases_module.FINAL_EVAL_TRIES
    assert summary["val_loss"] is not None and (summary["eval_step"], summary["eval_final"]) == (8, False)
    assert read_summary(run_dir)["eval_final"] is False
    assert [d["step"] for d in read_decisions(run_dir) if d["rule"] == "eval_error"] == [12]  # one finding a step


def test_an_evaluation_of_the_restored_step_outlives_a_rollback(tmp_path, monkeypatch):
    """weights_nan@12 (the last step's NaN weights) rolls the run back to step 8, whose evaluation judged
    the very weights restored: it stays the run's newest (it was dropped, and a final evaluation failing
    every try left the summary with no val_loss at all)."""
    held_out = phases_module.held_out_figures
    monkeypatch.setattr(
        phases_module, "held_out_figures", lambda t: ({}, "OSError: gone") if t.state.step == 12 else held_out(t)
    )
    run_dir = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run_dir, steps=12, faults=["weights_nan@12"], train={"eval_every": 8}))
    assert [(d["rule"], d["action"]) for d in read_decisions(run_dir) if d["action"] == "rollback"] == [
        ("nonfinite", "rollback")
    ]
    assert summary["step"] == 12 and summary["val_loss"] is not None
    assert (summary["eval_step"], summary["eval_final"]) == (8, False)


def test_an_injected_evaluation_error_at_the_end_fails_the_first_try_only(tmp_path):
    """eval_error (count 1) fails the final evaluation once: the trainer's second try is another
    evaluation, which the fault has already failed (keyed by step), so the run ends evaluated."""
    run_dir = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run_dir, steps=10, train={"eval_every": 8}, faults=["eval_error@9"]))
    assert (summary["eval_step"], summary["eval_final"]) == (10, True) and summary["val_loss"] is not None
    assert [d["step"] for d in read_decisions(run_dir) if d["rule"] == "eval_error"] == [10]
