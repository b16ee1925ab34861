"""The orchestrator never freezes training silently (debug-moe, a person's `ctl scale-lr 30` at step 13:
the data watch withheld 81 updates on the same weights, each judged "recovered", and the run "completed"
with val_loss 6.17 at steps 50 and 100): the watch does not feed itself, a guard over every rule answers
most updates withheld, and a data decision of a frozen run is not "recovered"."""

import random
from dataclasses import replace

import pytest

from test_orchestrator_incidents import Run, pending
from test_orchestrator_units import View, metrics
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.attribution import DataAttribution
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.journal import Decision
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.remedies import Remedy
from trimtab.orchestrator.withheld import WithheldUpdates, person_lr
from trimtab.training.state import GAVE_UP


def test_the_watch_does_not_take_its_own_withheld_steps_on_the_same_weights_as_new_evidence():
    """The soak: each watched step's clean tail (1-9 of 32 rows over the bar of weights that never
    moved) was left out and the watch extended, 81 steps running. On the same weights as its last
    finding (no update applied since) a step is not scored; once an update applied, it is again."""
    rng = random.Random(0)
    data, view = DataAttribution(OrchestratorConfig()), View()
    scores = {r: rng.gauss(5.0, 0.1) for r in range(2000)} | {r: 9.0 for r in range(0, 2000, 8)}  # a tail over the bar
    view.row_losses = lambda rows: {r: scores[r] for r in rows}
    data.record(15, list(range(32)))
    data.watch_more()  # the rows rule's blamed step 15: steps 16-25 watched
    data.record(16, list(range(32, 64)))
    first = data.watch(view, replace(metrics(16), rows=list(range(32, 64))), 14)  # 15's update withheld
    assert first is not None and data.watch_until == 26
    for step in range(17, 30):  # every update withheld: the weights of step 14, the same bar, the same scores
        rows = list(range(32 * step, 32 * step + 32))
        data.record(step, rows)
        assert data.watch(view, replace(metrics(step), rows=rows), 14) is None
    assert data.watch_until == 26  # not extended: the watch ends
    data.watch_until = 40
    data.record(30, list(range(960, 992)))
    moved = data.watch(view, replace(metrics(30), rows=list(range(960, 992))), 29)  # an update applied: new weights
    assert moved is not None
    saved = data.state_dict()
    again = DataAttribution(OrchestratorConfig())
    again.load_state_dict(saved)
    assert again.found_on == 29  # checkpointed: a resume does not take the same weights as new


def _frozen_policy(withheld, window=20):
    guard, found = WithheldUpdates(OrchestratorConfig(withheld_window=window)), None
    for step in range(1, window + 1):
        found = guard.observe(replace(metrics(step), skipped=step > window - withheld)) or found
    return found


def test_most_updates_withheld_by_any_rule_is_an_instability_answered_with_a_rollback_and_a_cut():
    """More than half of the window's updates withheld is a finding of its own (10 of 20 is not); a
    person's LR raise is named, taken back and cut under the schedule's, and the rollback counted."""
    assert _frozen_policy(10) is None
    found = _frozen_policy(11)
    assert found is not None and found.family == "instability" and found.evidence["withheld"] == 11
    manual = Decision(
        id=1, step=13, rule="manual", evidence={}, reasoning="", action="scale_lr", params={"factor": 30.0},
        confidence=1.0, mode="manual", family="manual",
    )  # fmt: skip
    found = person_lr(found, [manual])
    assert found.evidence["person_lr"]["step"] == 13 and "a person set at step 13" in found.summary
    policy = Policy(OrchestratorConfig())
    plan = policy.plan(found, View(lr_scale=30.0))
    assert plan.action == "rollback" and plan.params["to"] == "last_good"
    assert 30.0 * plan.params["lr_factor"] == 0.1  # under the schedule's x above_start.lr_factor
    assert "a person's (trimtab ctl scale_lr at step 13)" in plan.reasoning
    assert plan.evidence["incident_rollback"] == 1
    plan.applied()
    assert policy.rollbacks == 1 and policy.lr_too_high_at == found.step


def test_a_frozen_run_the_ladder_cannot_heal_stops_with_exit_3_and_says_why():
    """No good checkpoint, or this incident's rollbacks spent: save and stop (exit 3), never
    "completed" with frozen weights."""
    found = _frozen_policy(15)  # found at the 11th
    policy = Policy(OrchestratorConfig())
    stop = policy.plan(found, View(has_good_checkpoint=False))
    assert stop.action == "stop" and stop.params["exit_code"] == GAVE_UP
    assert "11 of the last 20 updates were withheld" in stop.params["reason"]
    policy.rollbacks = OrchestratorConfig().max_rollbacks
    assert policy.plan(found, View()).action == "stop"


def test_the_guard_window_starts_over_after_a_rollback_and_is_checkpointed():
    policy = Policy(OrchestratorConfig())
    for step in range(1, 11):
        assert policy.withheld.observe(replace(metrics(step), skipped=True)) is None
    restored = Policy(OrchestratorConfig())
    restored.load_state_dict(policy.state_dict())
    assert restored.withheld.observe(replace(metrics(11), skipped=True)) is not None  # 11 of 20
    policy.shift(5)
    assert policy.withheld.steps == {}


def test_a_data_decision_of_a_frozen_run_whose_loss_rose_is_not_recovered(tmp_path):
    """77 data decisions of the soak were "recovered" (loss 6.5 after, 5.7 before, every update withheld),
    and the track record raised the confidence 0.75 -> 0.98. The same decision with its updates applied
    is judged as before."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)  # outcome_after 20
    frozen = pending(orchestrator.journal, 20, "data", "skip_data", family="data", loss_before=5.7)
    for step in range(21, 41):
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=6.5, grad_norm=1.0, skipped=True), [])
    assert frozen.outcome["result"] == "not recovered"
    trained = pending(orchestrator.journal, 40, "data", "skip_data", family="data", loss_before=5.7)
    for step in range(41, 61):
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=6.5, grad_norm=1.0), [])
    assert trained.outcome["result"] == "recovered"  # data outcomes are judged on the rows' return


def test_the_guards_cut_is_given_back_once_quiet_up_to_the_schedules_and_kept_if_trouble_returns():
    """The guard's cut was never given back: whatever withheld the updates (a fault, a stretch of data)
    kept the run at 0.1x for good. Quiet, it is given back as the ladder's cuts are, x2 at a time, up to
    the schedule's (a person's x30 raise is not given back); withheld again after a give-back, it is tried once
    more after twice the wait, and after that it stays."""
    found = person_lr(_frozen_policy(11), [])
    policy = Policy(OrchestratorConfig())  # lr_restore_after 100; View's run: 1000 steps
    plan = policy.plan(found, View(lr_scale=30.0))
    plan.applied()
    assert policy.lr_debt == plan.params["lr_factor"] and policy.lr_ceiling == 1.0
    scale, step = 0.1, found.step
    for factor in (2.0, 2.0, 2.0, 1.25):
        assert policy.quiet(step + 99, View(lr_scale=scale)) is None
        back = policy.quiet(step := step + 100, View(lr_scale=scale))
        assert back.params["factor"] == pytest.approx(factor) and back.evidence["quiet_steps"] == 100
        back.applied()
        scale *= factor
    assert scale == pytest.approx(1.0) and policy.quiet(step + 200, View()) is None and policy.lr_debt == 1.0
    again = Policy(OrchestratorConfig())
    again.plan(found, View(lr_scale=30.0)).applied()
    again.quiet(found.step + 100, View(lr_scale=0.1)).applied()
    again.plan(replace(found, step=found.step + 110), View(lr_scale=0.2)).applied()  # withheld again: cut again
    assert all(again.quiet(s, View(lr_scale=0.02)) is None for s in range(found.step + 111, found.step + 310))
    again.quiet(found.step + 310, View(lr_scale=0.02)).applied()  # once more, after twice the wait (give_back.py)
    again.plan(replace(found, step=found.step + 320), View(lr_scale=0.04)).applied()  # and withheld again
    assert all(again.quiet(s, View(lr_scale=0.004)) is None for s in range(found.step + 321, found.step + 900))


def test_the_guards_step_is_an_emergency_other_rules_changes_wait(tmp_path):
    """The guard's rollback and, at its step, another rule's change (the data watch's rows left out, a
    checkpoint interval): both were requested, and the change outlived the rollback into the replay.
    An emergency's step is its own: the others are journaled, not applied, and say why; notes still go
    with it, and once the loop applied it the replay decides as ever."""
    orchestrator, run = Orchestrator(OrchestratorConfig(), tmp_path), Run()
    guard = orchestrator.decide(run, _frozen_policy(11))
    assert (guard.step, guard.action, guard.mode) == (20, "rollback", "auto")
    rows = Finding(rule="data", family="data", step=20, evidence={}, summary="rows", strength=1.0)
    leave_out = Remedy(action="skip_data", params={"rows": [3, 4]}, reasoning="they score as outliers")
    waited = orchestrator._decide(run, rows, leave_out)
    assert run.requests == [("rollback", guard.params)]  # the rows stay in the replay
    assert waited.outcome == {"result": "cut short", "steps": 0, "dropped_by": guard.id}
    assert f"withheld rule's rollback decided at this step (decision {guard.id}) is an emergency" in waited.applied[0]
    note = orchestrator._decide(run, replace(rows, rule="throughput"), Remedy(action="none", reasoning="slower"))
    assert note.outcome["result"] == "noted" and len(run.requests) == 1
    orchestrator._decide(run, replace(rows, step=21), leave_out)  # a read of several steps: still unapplied
    assert len(run.requests) == 1
    orchestrator.last_step, run.step = 21, 10
    orchestrator.on_rollback(run, {})  # the loop applied it: the replay decides as ever
    orchestrator._decide(run, replace(rows, step=11), leave_out)
    assert run.requests[-1] == ("skip_data", {"rows": [3, 4]})
