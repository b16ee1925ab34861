"""Each LR cut's ceiling bounds its own give-back (give_back.py): the cuts form a stack of debts, the newest given
back first up to its ceiling, then the one under it up to its own. One least ceiling over all cuts let a late cut's
cap the earlier ones: debug at 10x its LR, seed 2 (above_start cut x0.32 at 1.0, ceiling 0.56; a spike's x0.1 at
0.32, ceiling 0.1) stayed at x0.1 to the end, val 4.153; given back to x0.32, val 3.977."""

import math

import pytest

from test_lr_given_back import _quiet_until
from test_lr_too_high_floor import View
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.policy import Policy


def test_a_late_cuts_ceiling_does_not_cap_an_earlier_cuts_give_back():
    policy, view = Policy(OrchestratorConfig()), View(lr_scale=1.0, total_steps=160)
    first = 10**-0.5
    policy._owe(first, 1.0, ceiling=math.sqrt(first))  # above_start: never past 0.56
    view.lr_scale = first
    policy._owe(0.1, first, ceiling=first * math.sqrt(0.1))  # a spike at 0.32: its give-back stops at 0.1
    view.lr_scale *= 0.1
    policy.last_lr_change = 10
    # the spike's cut given back to its 0.1 (the rest of it kept), then the first cut in full: past the 0.1
    assert _quiet_until(policy, view, 11, 159) == [
        (30, 2.0),
        (50, pytest.approx(10**0.5 / 2)),
        (70, 2.0),
        (90, pytest.approx(10**0.5 / 2)),
    ]
    assert view.lr_scale == pytest.approx(first)
    assert policy.lr_debt == pytest.approx(1.0) and policy.lr_below == []


def test_a_chain_of_cuts_is_given_back_to_the_first_ones_multiplier():
    policy, view = Policy(OrchestratorConfig()), View(lr_scale=1.0, total_steps=160)
    for _ in range(2):  # two ladder cuts x0.5, each from the multiplier it was cut from
        policy._owe(0.5, view.lr_scale)
        view.lr_scale *= 0.5
    assert policy.lr_debt == pytest.approx(0.25)
    policy.last_lr_change = 10
    _quiet_until(policy, view, 11, 159)
    assert view.lr_scale == pytest.approx(1.0)


def test_a_give_backs_evidence_names_the_newest_cuts_debt_and_the_older_ones_under_it():
    """lr_debt is every cut's together while the give-back repays the newest up to its own ceiling: the
    evidence says which debt it repays and what waits under it, or a reader takes x0.032 owed for this one's."""
    policy, view = Policy(OrchestratorConfig()), View(lr_scale=1.0, total_steps=160)
    first = 10**-0.5
    policy._owe(first, 1.0, ceiling=math.sqrt(first))
    view.lr_scale = first
    policy._owe(0.1, first, ceiling=first * math.sqrt(0.1))
    view.lr_scale *= 0.1
    policy.last_lr_change = 10
    remedy = next(r for r in (policy.quiet(step, view) for step in range(11, 160)) if r is not None)
    evidence = remedy.evidence
    assert evidence["lr_debt"] == pytest.approx(first * 0.1) and evidence["newest_debt"] == pytest.approx(0.1)
    assert evidence["lr_ceiling"] == pytest.approx(first * math.sqrt(0.1))
    assert evidence["older_debts"] == [{"debt": pytest.approx(first), "ceiling": pytest.approx(math.sqrt(first))}]
