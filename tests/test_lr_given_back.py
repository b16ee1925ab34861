"""above_start's own cuts are owed as the ladder's are (ladder.py quiet): debug at 10x-300x its preset's
LR kept them to the end, landing 1.25-1.6x the preset's or, where a cut overshot, far under it. Given back
x2 at a time once quiet, never past the midpoint of the LR found too high and the cut one; tried once more
after a give-back instability followed, then kept (give_back.py). A run of SHORT_RUN steps or fewer is not
rolled back for overshooting updates while its loss falls (a 10-step tune trial at 7x, rolled back to step 0
at step 10: 5.546 against 5.377 off)."""

import math

import pytest

from test_lr_too_high_floor import View, _gain
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.policy import Policy


def _cut(policy: Policy, view: View, step: int = 12, gain: float = 0.2) -> float:
    """Apply above_start's cut of an LR far too high (gain under half min_gain: x0.1); its factor."""
    remedy = policy.plan(_gain(step=step, gain=gain), view)
    remedy.applied()
    factor = remedy.params["lr_factor"]
    view.lr_scale *= factor
    return factor


def _quiet_until(policy: Policy, view: View, first: int, last: int) -> list[tuple[int, float]]:
    """The give-backs the quiet steps first..last make, applied: (step, factor) each."""
    given = []
    for step in range(first, last + 1):
        remedy = policy.quiet(step, view)
        if remedy is not None:
            remedy.applied()
            view.lr_scale *= remedy.params["factor"]
            given.append((step, remedy.params["factor"]))
    return given


def test_a_cut_for_an_lr_far_too_high_is_given_back_part_way_once_quiet():
    policy, view = Policy(OrchestratorConfig()), View(lr_scale=1.0, total_steps=80)
    assert _cut(policy, view) == pytest.approx(0.1)
    assert "given back x2 at a time" in policy.plan(_gain(gain=0.2), View(lr_scale=1.0)).reasoning
    given = _quiet_until(policy, view, 13, 80)
    # an 80-step run waits outcome_after (20) quiet steps; x2, then up to the midpoint of 1x and 0.1x
    assert [s for s, _ in given] == [32, 52]
    assert view.lr_scale == pytest.approx(math.sqrt(0.1))


def _spike(step: int) -> Finding:
    return Finding(rule="spike", family="instability", step=step, evidence={"loss": 6.0}, summary="", strength=0.8)


def test_instability_after_a_give_back_is_tried_once_more_at_twice_the_wait_then_keeps_the_cut():
    policy, view = Policy(OrchestratorConfig()), View(lr_scale=0.1, total_steps=160)
    policy._owe(0.1, 1.0)  # an applied x0.1 cut from the schedule's LR (the ladder's: up to it)
    policy.last_lr_change = 12
    assert _quiet_until(policy, view, 13, 32) == [(32, 2.0)]
    policy.plan(_spike(35), view)
    assert _quiet_until(policy, view, 36, 75) == [(75, 2.0)]  # once more, after 40 quiet steps, not 20
    assert "the cut stays" in policy.quiet(115, View(lr_scale=0.4, total_steps=160)).reasoning  # (not applied)
    policy.plan(_spike(78), view)
    assert _quiet_until(policy, view, 79, 160) == []
    assert view.lr_scale == pytest.approx(0.4)


def test_a_short_run_whose_loss_falls_is_cut_without_a_rollback_and_not_at_its_last_step():
    policy = Policy(OrchestratorConfig())
    remedy = policy.plan(_gain(step=7), View(lr_scale=1.0, total_steps=10))
    assert remedy.action == "scale_lr" and remedy.params["factor"] == pytest.approx(0.1**0.5)
    assert "no rollback" in remedy.reasoning
    last = policy.plan(_gain(step=10), View(lr_scale=1.0, total_steps=10))
    assert last.action == "none" and "last step" in last.reasoning
    # a longer run, or a loss above its start, is rolled back as ever
    assert policy.plan(_gain(step=10), View(lr_scale=1.0, total_steps=21)).action == "rollback"
    above = _gain(step=7)
    above.evidence["loss"] = 6.3
    assert policy.plan(above, View(lr_scale=1.0, total_steps=10)).action == "rollback"


def test_no_give_back_at_the_runs_last_step():
    """Nothing trains at a give-back made at the run's last step: debug-moe at 30x its LR journaled x1.12 at step
    100 of 100, its outcome "too early" for good. The give-back due then is not made."""
    policy, view = Policy(OrchestratorConfig()), View(lr_scale=1.0, total_steps=52)
    _cut(policy, view)
    assert [s for s, _ in _quiet_until(policy, view, 13, 52)] == [32]  # 52 was due (an 80-step run's second)
