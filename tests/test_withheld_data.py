"""Garbage to the end of the run (debug, 120 steps, `bad_batch@15:106`): the row gate left out every row of
most steps, but let a step's rows through now and then (a spike or the data watch withheld them), which reset
the withheld guard's count of fully gated steps in a row, so it never answered: the grad rule's window filled
with the gated steps' 0.0 norms and its ceiling of 0 raised ZeroDivisionError at step 97 (exit 1); with that
fixed alone the run "completed" at step 133 with frozen weights. Now the guard stops the run at step 55 (exit
3) and names the data: no rollback that replays the garbage, no LR cut (withheld.py garbage_stop)."""

from dataclasses import replace

import trimtab
from helpers import faulted
from test_orchestrator_incidents import Run
from test_orchestrator_units import View, metrics
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import GradExplosion
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.withheld import WithheldUpdates
from trimtab.rundir import read_decisions
from trimtab.training.state import GAVE_UP

ROWS = 32
LET_THROUGH = (37, 41, 80, 83)  # the measured run's steps the gate let a row through: a spike withheld them
APPLIED_31 = 88  # 31 of 32 gated, its update applied


def _step(step: int, gated: int, skipped: bool):
    rows = list(range(ROWS * step, ROWS * step + ROWS))
    return replace(metrics(step), rows=rows, gated_rows=rows[:gated], skipped=skipped)


def _garbage_to_the_end(step: int):
    """The measured run's step: clean before 15, then garbage the gate mostly left out."""
    if step < 15:
        return _step(step, 0, False)
    if step == APPLIED_31:
        return _step(step, ROWS - 1, False)
    return _step(step, ROWS - 1 if step in LET_THROUGH else ROWS, True)


def _findings(steps, guard=None):
    guard = guard or WithheldUpdates(OrchestratorConfig(withheld_window=20))
    return [f for m in steps if (f := guard.observe(m)) is not None]


def test_garbage_to_the_end_is_answered_as_the_datas_even_with_steps_the_gate_let_through():
    """Before: no finding at all over 120 steps (the streak reset at 37, 41, 80, 83, 88)."""
    found = _findings(_garbage_to_the_end(s) for s in range(1, 121))
    assert [(f.step, f.family) for f in found][:1] == [(55, "data")]
    ev = found[0].evidence
    assert ev["steps"] == "15-55" and ev["stretch"] == 41 and ev["rows_seen"] == 41 * ROWS
    assert ev["rows_gated"] == 41 * ROWS - 2  # steps 37 and 41 let a row through: 1,310 of 1,312, as measured
    assert "garbage for 41 steps" in found[0].summary


def test_the_datas_finding_is_a_stop_with_exit_3_naming_the_data_not_a_rollback_or_a_cut():
    found = _findings(_step(s, ROWS if s >= 15 else 0, s >= 15) for s in range(1, 56))
    policy = Policy(OrchestratorConfig())
    plan = policy.plan(found[0], View(lr_scale=1.0))
    assert plan.action == "stop" and plan.params["exit_code"] == GAVE_UP and "lr_factor" not in plan.params
    reason = plan.params["reason"]
    assert "garbage for 41 steps" in reason and "steps 15-55" in reason and "1,312 of the 1,312 rows" in reason
    assert "corpus.txt" in reason and plan.evidence["sources"] == {"corpus.txt": 32}  # View.row_sources
    assert "check the corpus" in reason and "trimtab data prepare" in reason
    assert "LR" not in reason and "rollback would replay" in plan.reasoning
    plan.applied()
    assert policy.rollbacks == 0 and policy.lr_debt == 1.0


def test_the_orchestrator_requests_the_stop_and_journals_it_as_the_datas(tmp_path):
    found = _findings(_step(s, ROWS if s >= 15 else 0, s >= 15) for s in range(1, 56))
    orchestrator, run = Orchestrator(OrchestratorConfig(), tmp_path), Run()
    decision = orchestrator.decide(run, found[0])
    assert (decision.rule, decision.family, decision.action, decision.mode) == ("withheld", "data", "stop", "auto")
    assert run.requests == [("stop", decision.params)] and decision.params["exit_code"] == GAVE_UP


def test_a_short_stretch_and_the_mixed_case_keep_their_answers():
    """15 or 25 fully gated steps: no instability finding, only their replay at the first clean step
    (bad_data_early_long, test_stretch_replay.py); withheld steps with rows to train
    (a spike's) among gated ones: under 90% of the rows gated, the instability answer as before."""
    short = _findings(_step(s, ROWS if 15 <= s < 30 else 0, 15 <= s < 30) for s in range(1, 121))
    assert [(f.step, f.family, "replay" in f.evidence) for f in short] == [(30, "data", True)]
    long = _findings(_step(s, ROWS if 25 <= s < 50 else 0, 25 <= s < 50) for s in range(1, 201))
    assert [(f.step, f.family, "replay" in f.evidence) for f in long] == [(50, "data", True)]
    mixed = [_step(s, ROWS if s >= 15 and s % 3 == 0 else 0, s >= 15) for s in range(1, 120)]
    found = _findings(mixed)  # a third of the rows gated: the findings of the code before, step for step
    assert [(f.step, f.family) for f in found] == [(s, "instability") for s in (31, 47, 64, 80, 97, 113)]
    plan = Policy(OrchestratorConfig()).plan(found[0], View())
    assert plan.action == "rollback" and plan.params["lr_factor"] < 1


def test_a_resume_keeps_the_stretch():
    guard = WithheldUpdates(OrchestratorConfig(withheld_window=20))
    assert _findings((_garbage_to_the_end(s) for s in range(1, 40)), guard) == []
    resumed = WithheldUpdates(OrchestratorConfig(withheld_window=20))
    resumed.load_state_dict(guard.state_dict())
    assert [f.step for f in _findings((_garbage_to_the_end(s) for s in range(40, 60)), resumed)] == [55]


def test_the_grad_rule_takes_no_level_from_steps_without_a_gradient():
    """A fully gated step's norm is 0.0: 50 of them made the ceiling 0, and the next step with a row
    trained divided by it (ZeroDivisionError, exit 1 at step 97)."""
    grad = GradExplosion(OrchestratorConfig())
    for s in range(1, 21):
        assert grad.observe(metrics(s, grad_norm=1.0)) is None
    for s in range(21, 80):
        assert grad.observe(metrics(s, grad_norm=0.0)) is None
    assert grad.ceiling() == 10.0  # factor x the mean of the steps that had a gradient
    assert grad.observe(metrics(80, grad_norm=0.05)) is None


def test_a_real_run_on_garbage_to_the_end_stops_naming_the_data(tmp_path):
    """The trainer end to end (debug, a window of 5 so the stretch passes two at its 11th step): the stop saves,
    exits 3 and says the data's words in summary.json; no rollback, no LR change journaled."""
    summary = trimtab.train(faulted(tmp_path / "run", ["bad_batch@8:100"], 40, orchestrator={"withheld_window": 5}))
    assert summary["exit_code"] == GAVE_UP and summary["step"] < 30, summary["status"]
    assert "the data stream has been garbage for 11 steps" in summary["status"]
    assert "train.init_from=" in summary["status"]
    decisions = read_decisions(tmp_path / "run")
    stop = [d for d in decisions if d["rule"] == "withheld"]
    assert [(d["family"], d["action"]) for d in stop] == [("data", "stop")]
    assert stop[0]["evidence"]["sources"]  # the gated rows' files, named
    assert not [d for d in decisions if d["action"] in ("rollback", "scale_lr", "set_lr")]
    assert (tmp_path / "run" / "checkpoints" / f"step_{summary['step']:06d}").is_dir()
