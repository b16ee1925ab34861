"""An outcome measures what its decision claims: a run lengthened by make_up is "done" once the steps
it added ran, a checkpoint interval set is "applied", the lr rule's multiplier is answered once the LR
stayed explained for a few steps, and an LR-cut rollback's replay must get under the trouble it cut for."""

import pytest

from helpers import FakeTrainer
from test_orchestrator_incidents import pending
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.rundir import read_decisions


def _follow(orchestrator, steps, loss=lambda step: 5.0):
    for step in steps:
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=loss(step), grad_norm=1.0), [])


def _outcomes(run_dir):
    return {d["id"]: d["outcome"] for d in read_decisions(run_dir)}


def test_made_up_steps_are_done_once_they_ran_not_recovered(tmp_path):
    """debug, bad_batch@20: make_up's 30 -> 31 steps at step 25 read "recovered" (loss 5.31 -> 4.56)
    before step 31 had run. It heals nothing: done once the run trained to its total, and not done when
    the run ended short of it; neither counts in its track record."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)  # outcome_after 20
    grown = pending(orchestrator.journal, 25, "make_up", "set_total_steps", family="make_up")
    grown.params, grown.evidence = {"steps": 31, "by": "make_up"}, {"extend": 1, "total_steps": 30}
    short = pending(orchestrator.journal, 26, "make_up", "set_total_steps", family="make_up")
    short.params, short.evidence = {"steps": 60, "by": "make_up"}, {"extend": 2, "total_steps": 58}
    orchestrator.outcomes.rolled_back(20, None)  # a rollback keeps the run's length: nothing to judge
    _follow(orchestrator, range(21, 50))
    results = _outcomes(tmp_path)
    assert results[grown.id] == {"result": "done", "steps": 11, "made_up": 1, "total_steps": 31, "trained_to": 31}
    orchestrator.on_train_end(FakeTrainer(tmp_path), {"status": "stopped (SIGTERM)"})
    assert _outcomes(tmp_path)[short.id]["result"] == "not done"
    assert _outcomes(tmp_path)[short.id]["trained_to"] == 49
    assert orchestrator.journal.track_record("make_up", "set_total_steps") == (0, 0)


def test_a_checkpoint_interval_set_is_applied_not_recovered(tmp_path):
    """debug-mod: checkpoint_interval's set_checkpoint_every at step 1 read "recovered" (5.51 -> 5.44): a
    knob that heals nothing. Once Control applied it, it is "applied", and no loss judges it."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    interval = pending(orchestrator.journal, 1, "checkpoint_interval", "set_checkpoint_every", family="checkpoint")
    orchestrator._applied(interval, "checkpoint every 20 -> 8 steps")
    _follow(orchestrator, range(2, 30))
    assert _outcomes(tmp_path)[interval.id] == {"result": "applied", "steps": 0}


def test_the_lr_rules_multiplier_is_answered_once_the_lr_stayed_explained(tmp_path):
    """debug, lr_spike@12:10, 30 steps (31 with a step made up): the lr rule's x0.1 at step 12 read "too
    early" after 19 steps at the schedule's LR, held to outcome_after 20. The rule reads the LR at every
    step: SETTLED steps without its finding answer it; its finding back within them does not."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    cut = pending(orchestrator.journal, 12, "lr", "scale_lr", family="lr")
    _follow(orchestrator, range(13, 32))
    orchestrator.on_train_end(FakeTrainer(tmp_path), {"status": "completed"})
    assert _outcomes(tmp_path)[cut.id]["result"] == "recovered" and _outcomes(tmp_path)[cut.id]["steps"] == 19


def _stall_cut(tmp_path, replay, evidence=None):
    """debug-moe at 30x (the gain rule off): above_start at step 43, the loss stalled at 5.24 (unigram
    5.26), rolled back to 0 with a cut x0.316; the replay of steps 1-20 has losses `replay(step)`."""
    tmp_path.mkdir()
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)  # outcome_after 20
    _follow(orchestrator, range(1, 44), lambda step: max(6.26 - 0.1 * step, 5.24))
    cut = pending(orchestrator.journal, 43, "above_start", "rollback", loss_before=5.21)
    cut.evidence = evidence or {"start": 6.26, "level": 5.24, "unigram": 5.26, "since": 1}
    cut.params = {"to": 0, "lr_factor": 0.316}
    _follow(orchestrator, range(1, 21), replay)
    return _outcomes(tmp_path)[cut.id]


def test_an_lr_cut_for_a_stall_must_get_under_the_stall(tmp_path):
    """The cut was "recovered" on its replay's mean (5.41) under the start (6.26): every run trains below
    its start. It claims the model learns past the level it stalled at: by the window's end, under it."""
    stalled = _stall_cut(tmp_path / "a", lambda step: max(6.26 - 0.1 * step, 5.3))  # mean 5.51, ends at 5.30
    assert stalled["result"] == "not recovered" and stalled["compared_with"] == "stall"
    assert stalled["loss_before"] == pytest.approx(5.24) and stalled["loss_end"] == pytest.approx(5.3)
    past = _stall_cut(tmp_path / "b", lambda step: 6.26 - 0.06 * step)  # its last 5 steps: 5.30-5.06
    assert past["result"] == "recovered"


def test_an_lr_cut_for_a_collapse_must_get_under_the_loss_it_stalled_at(tmp_path):
    """debug-moe at 30x: a x0.1 cut for a gradient-norm collapse at 5.02 was "recovered" on a replay mean
    of 5.41 (5.08 by the window's end) under the start; its replay collapsed again at 5.06. A collapse
    fires on a stalled loss: the replay must end under the loss the rule fired at."""
    collapse = {"start": 6.26, "since": 1, "line": 6.57, "loss": 5.24, "grad_norm": 0.29, "collapse": 0.6}
    stalled = _stall_cut(tmp_path / "a", lambda step: max(6.26 - 0.1 * step, 5.3), collapse)
    assert stalled["result"] == "not recovered" and stalled["compared_with"] == "the loss at step 43"


def test_an_lr_cut_is_not_settled_by_quiet_steps_past_its_step(tmp_path):
    """debug at 30x: above_start's x0.1 at step 7, rolled back to 0, read "recovered" with the gain too low
    again at step 15 of the replay (cut x0.5 twice more): 5 quiet steps past step 7 had settled it, as they
    settle a rollback for one step's fault. An LR's trouble is every step's: its return is the cut's failure."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)  # outcome_after 20
    _follow(orchestrator, range(1, 8), lambda step: 6.25 - 0.09 * step)
    cut = pending(orchestrator.journal, 7, "above_start", "rollback", loss_before=5.6)
    cut.evidence, cut.params = {"start": 6.25, "since": 1, "loss": 5.64, "gain": 0.2}, {"to": 0, "lr_factor": 0.1}
    _follow(orchestrator, range(1, 15), lambda step: 6.25 - 0.08 * step)
    again = Finding(rule="above_start", family="instability", step=15, evidence={}, summary="gain", strength=1.0)
    orchestrator.outcomes.follow(StepMetrics(step=15, loss=5.05, grad_norm=1.0), [again])
    _follow(orchestrator, range(16, 21), lambda step: 6.25 - 0.08 * step)
    outcome = _outcomes(tmp_path)[cut.id]
    assert outcome["result"] == "not recovered" and outcome["found_after"] == ["above_start@15"]
