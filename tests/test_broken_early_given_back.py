"""A rollback for weights broken early in a phase (worse than its untouched weights: ladder.py _rollback's
`high`, the probe of diagnosis.py) cuts the LR x above_start.lr_factor. A fault breaks weights so too (a
flipped bit, weights_noise), so the cut joins the LR debt (give_back.py) as the ladder's others do: given back
once quiet, never past the midpoint of the two LRs (as above_start's cuts), where it used to stay for good."""

import pytest

from test_lr_given_back import _quiet_until
from test_lr_too_high_floor import View
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.policy import Policy


def test_an_early_breakage_cut_is_given_back_part_way_once_quiet():
    policy, view = Policy(OrchestratorConfig()), View(lr_scale=1.0, total_steps=80)
    policy.start_probe, policy.probe_baseline, policy.updated_at, policy.ladder.last_step = 6.2, 6.2, 7, 8
    remedy = policy._rollback(view, broken=7.5, early=True)  # worse than the untouched weights' 6.2
    assert remedy.action == "rollback" and remedy.params["lr_factor"] == pytest.approx(0.1)
    assert "given back x2 at a time" in remedy.reasoning and "never to be given back" not in remedy.reasoning
    remedy.applied()
    view.lr_scale = 0.1
    given = _quiet_until(policy, view, 9, 80)
    assert [s for s, _ in given] == [28, 48]  # after outcome_after (20) quiet steps each
    assert view.lr_scale == pytest.approx(0.1**0.5)  # the midpoint of 1x and 0.1x, never past it
