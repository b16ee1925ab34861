"""The collapse follow-up (AboveStart._collapsed: the gradient norm dying away while the loss stalls, after a
cut for an LR far too high) leaves be an LR the replay's gain measured sound (its first gains' median at
SOUND_GAIN or more, _short_of_sound): the gain answered the LR as a sound one's does. Raised since (a
give-back), the LR is judged again, and cut back no further than the LR measured sound."""

import pytest

from test_lr_short_of_sound import SOUND, TWICE
from test_lr_too_high_floor import View
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.trends import AboveStart


def _collapse(gains: list[float], raised_at: int | None = None) -> list:
    """A replay after a cut (fired, LR x0.316): `gains` over its first steps, then the gradient norm down to
    0.3x its first steps' with the loss flat; from step `raised_at` on, the LR given back x2."""
    mon = AboveStart(OrchestratorConfig())
    mon.fired = True
    found = []
    for s in range(1, 61):
        scale = 0.316 * (2 if raised_at is not None and s >= raised_at else 1)
        gain = gains[s - 1] if s <= len(gains) else None
        m = StepMetrics(step=s, loss=5.1, grad_norm=1.0 if s <= 10 else 0.3, update_gain=gain, lr_scale=scale)
        found.append(mon.observe(m))
    return [f for f in found if f is not None]


def test_a_dying_gradient_at_an_lr_the_replay_measured_sound_is_no_finding():
    assert _collapse(SOUND) == []  # median 0.78: the cut LR is sound


def test_a_dying_gradient_is_judged_where_the_gain_was_short_or_the_lr_was_raised_since():
    (unmeasured,) = _collapse([])  # no gain measured since the cut (a stall's)
    assert "warm_grad_norm" in unmeasured.evidence
    assert all("warm_grad_norm" not in f.evidence for f in _collapse(TWICE))  # median 0.67: halved at step 15 instead
    (raised,) = _collapse(SOUND, raised_at=20)  # the give-back's LR was not measured
    assert "warm_grad_norm" in raised.evidence


def test_a_collapse_after_a_give_back_cuts_back_to_the_lr_measured_sound_not_below():
    """debug at 3x (the last stop's x10 bad_rows seed 0): cut to 1x, its replay sound, given back to 1.78x, then a
    collapse cut it x0.316 to 0.56x, under the LR the replay had measured sound."""
    (raised,) = _collapse(SOUND, raised_at=20)
    assert raised.evidence["sound_at"] == 0.316
    remedy = Policy(OrchestratorConfig()).plan(raised, View(lr_scale=0.632))
    assert remedy.action == "rollback" and remedy.params["lr_factor"] == pytest.approx(0.5)  # not x0.316
    assert "not below the x0.316 multiplier" in remedy.reasoning
