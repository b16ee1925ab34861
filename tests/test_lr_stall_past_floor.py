"""A gradient dying away after the gain's cuts, at orchestrator.min_lr_scale. debug-moe at 30x and 300x
its preset's LR (seed 1, 80 steps) both stood at 1.5x the preset's after their cuts (gains 0.18 -> 0.60)
and met the same dying gradient at step 35: 30x was cut x0.316 (4.563), 300x, its multiplier past the
floor already, was only noted (4.961; clean 4.416). The floor is a multiple of optim.lr, not of a sound LR."""

from test_lr_too_high_floor import View, _gain
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.policy import Policy


def _collapse(step: int = 35) -> Finding:
    evidence = {"loss": 5.08, "start": 6.27, "grad_norm": 0.41, "warm_grad_norm": 0.88, "collapse": 0.6}
    return Finding(
        rule="above_start",
        family="instability",
        step=step,
        evidence=evidence | {"window": 10, "since": 1},
        summary="",
        strength=0.7,
    )


def _cut_on_the_gain() -> Policy:
    """A policy whose phase was cut x0.1 for a gain of 0.18."""
    policy = Policy(OrchestratorConfig())
    remedy = policy.plan(_gain(step=7, gain=0.18), View(lr_scale=1.0))
    assert remedy.action == "rollback" and remedy.params["lr_factor"] == 0.1, remedy.reasoning
    remedy.commit()
    return policy


def test_a_dying_gradient_after_the_gains_cut_passes_the_floor():
    remedy = _cut_on_the_gain().plan(_collapse(), View(lr_scale=0.005))
    assert remedy.action == "rollback", remedy.reasoning
    assert remedy.params == {"to": 0, "skip_rows": [], "lr_factor": 0.1**0.5}
    assert "past the floor (orchestrator.min_lr_scale=0.01)" in remedy.reasoning
    assert remedy.evidence["gain_before"] == 0.18


def test_the_same_collapse_above_the_floor_is_cut_alike():
    remedy = _cut_on_the_gain().plan(_collapse(), View(lr_scale=0.05))
    assert remedy.action == "rollback" and remedy.params["lr_factor"] == 0.1**0.5
    assert "past the floor" not in remedy.reasoning


def test_without_a_gain_cut_in_the_phase_the_floor_holds():
    remedy = Policy(OrchestratorConfig()).plan(_collapse(), View(lr_scale=0.01))
    assert remedy.action == "none" and "at its floor" in remedy.reasoning
