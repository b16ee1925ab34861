"""The run's length after orchestrator.make_up added steps for withheld updates: the console's step
line reads it once the loop applied the step's decision, and a resume naming another --max-steps keeps
the steps made up on top of it, as a fresh run of that length would have added them (schedule.reconcile)."""

from types import SimpleNamespace

from trimtab.config import OptimConfig
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.make_up import MakeUp, remedy
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.training.hooks import ConsoleLogger
from trimtab.training.schedule import reconcile
from trimtab.training.services.signals import run_length
from trimtab.training.state import KEPT_ON_ROLLBACK, TrainState


def test_the_console_step_line_shows_the_length_a_decision_of_that_step_set(capsys):
    """debug, --inject bad_batch@20: make_up decided at step 25 (run length 41) and the console wrote
    "step 25/40", the loop applying the decision after the step's on_log."""
    console, run = ConsoleLogger(progress=False), SimpleNamespace(total_steps=40)
    console.on_step_end(run, SimpleNamespace(step=25))
    console.on_log(run, {"step": 25, "loss": 5.0295, "lr": 1.79e-3, "tokens_per_s": 3636.0})
    run.total_steps = 41  # Control.apply: the make-up decision of step 25
    console.on_applied(run)
    assert capsys.readouterr().err.splitlines() == ["step 25/41 loss 5.0295 lr 1.79e-03 tok/s 3,636"]


def test_a_resume_naming_another_max_steps_keeps_the_steps_made_up_on_top():
    """A 40-step run, one update withheld and made up (41 steps), resumed with --max-steps 60 trained to 60
    (before: the made-up step dropped while make_up's cap still counted it); now 61, as a fresh run of 60."""
    rule = MakeUp(OrchestratorConfig().make_up)
    rule.observe(StepMetrics(step=20, loss=1.0, grad_norm=1.0, skipped=True), 20, 40, 40)
    made = rule.observe(StepMetrics(step=25, loss=1.0, grad_norm=1.0), 20, 40, 40)
    decided = remedy(made, None, OrchestratorConfig())
    assert decided.params == {"steps": 41, "by": "make_up"}  # so Control counts them apart: TrainState.made_up
    state = TrainState(step=41, phase_steps=[40], length_delta=1, made_up=1)
    changes = reconcile(state, [SimpleNamespace(start=0, steps=41, optim=OptimConfig())], [60])
    assert (state.length_delta, state.phase_steps) == (1, [60]) and "stay on top" in changes[0]["effect"]
    assert "its 20 added steps re-warm" in changes[0]["effect"]  # the run had ended at 41: 61 - 41
    assert run_length({"phase_steps": [40], "length_delta": 1, "made_up": 1}, [60]) == 61  # the finished check
    assert "made_up" in KEPT_ON_ROLLBACK


def test_a_new_max_steps_still_replaces_a_persons_or_the_planners_change():
    state = TrainState(step=30, phase_steps=[40], length_delta=21, made_up=1)  # ctl total-steps 60 after make-up's 41
    changes = reconcile(state, [SimpleNamespace(start=0, steps=61, optim=OptimConfig())], [70])
    assert state.length_delta == 1 and "replaces set_total_steps' +20" in changes[0]["effect"]
    assert run_length({"phase_steps": [40], "length_delta": 21, "made_up": 1}, [70]) == 71
    assert run_length({"phase_steps": [40], "length_delta": 21, "made_up": 1}, [40]) == 61  # unchanged: all kept


def test_train_help_says_what_max_steps_means_on_resume():
    """`trimtab train --help`: --max-steps on resume is the new length plus make-up's steps (reconcile above)."""
    from trimtab.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    steps = next(a for a in train._actions if a.dest == "max_steps")
    assert "on resume the new length, plus the steps orchestrator.make_up added" in steps.help, steps.help


def test_a_checkpoint_older_than_made_up_keeps_its_made_up_steps_from_its_journal(tmp_path):
    """A checkpoint saved before TrainState.made_up existed: its make-up steps were dropped by a resume
    naming another --max-steps (debug, nan_loss@15, 30 -> 31 steps; --max-steps 40 ran 40, not 41).
    Recovered from the journal's make_up decisions where the journal accounts for the whole length_delta."""
    import torch

    from trimtab.checkpoint import save_checkpoint
    from trimtab.config import load_config
    from trimtab.training.resume import resume_point

    made = {"rule": "make_up", "action": "set_total_steps", "applied": ["total steps 30 -> 31"]}
    train = {"step": 31, "tokens": 0, "phase_steps": [30], "length_delta": 1}  # no "made_up": an older trimtab's
    state = {"train": train, "hooks": {"Orchestrator": {"journal": [made]}}}
    save_checkpoint(tmp_path, 31, {"w": torch.ones(2)}, {}, state, keep=1)
    cfg = load_config(preset="debug", sets=[f"out={tmp_path}", "train.max_steps=40"])
    _, found = resume_point(cfg, SimpleNamespace(from_main=lambda fn, *a: fn(*a), on_main=lambda fn, *a: fn(*a)))
    assert run_length(found["train"], [40]) == 41  # the finished check counts them: 41 steps, as a fresh run's
    from trimtab.training.resume import made_up_steps  # Checkpointing._load's, the same recovery

    ctl = {"rule": "manual", "action": "set_total_steps", "applied": ["total steps 31 -> 41"]}  # unaccounted for
    assert made_up_steps({"train": {**train, "length_delta": 11}, "hooks": {"Orchestrator": {"journal": [made]}}}) == 0
    assert (
        made_up_steps({"train": {**train, "length_delta": 11}, "hooks": {"Orchestrator": {"journal": [made, ctl]}}})
        == 1
    )
