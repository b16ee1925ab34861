"""above_start after a person's LR raise (orchestrator/too_high.py _raise_undone): debug pretrained 40 steps, then
finetuned with `trimtab ctl --queue RUN scale-lr 100` applied at step 41; above_start at step 45 cut x0.1 from
the raised level with the journal silent on the raise, and jumped steps after a raise blamed their rows. The raise
is the suspect, named in the decision and undone as the ladder undoes one (raised.py: no deeper than
above_start.lr_factor, given back part way once quiet)."""

import pytest

from test_lr_too_high_floor import View, _gain
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.policy import Policy


def _above(step: int = 45, since: int = 41) -> Finding:
    """The loss above the phase's start for 3 steps (no gain evidence: the finetune's case)."""
    evidence = {"loss": 5.49, "level": 5.49, "start": 4.89, "line": 5.13, "patience": 3, "since": since}
    summary = "loss 5.49 over 3 steps"
    return Finding(
        rule="above_start", family="instability", step=step, evidence=evidence, summary=summary, strength=0.75
    )


def _raised(at: int = 41, factor: float = 100.0, phase_start: int = 40) -> Policy:
    policy = Policy(OrchestratorConfig())
    policy.phase_start = phase_start
    policy.person_raised(at, factor, "trimtab ctl scale_lr 100.0")
    return policy


def test_above_start_after_a_persons_raise_undoes_it_with_the_rollback():
    policy, view = _raised(), View(lr_scale=100.0, last_good=40)
    remedy = policy.plan(_above(), view)
    assert remedy.action == "rollback" and remedy.params["to"] == "last_good"
    assert remedy.params["lr_factor"] == pytest.approx(0.1)  # no deeper than an LR too high's cut (raised.py)
    assert "raised x100 at step 41 (trimtab ctl scale_lr 100.0)" in remedy.reasoning
    assert "the raise is the suspect" in remedy.reasoning
    assert remedy.evidence["person_raise"] == {"step": 41, "factor": 100.0, "by": "trimtab ctl scale_lr 100.0"}


def test_overshooting_updates_after_a_raise_undo_it_too():
    policy = _raised(at=0, factor=10.0, phase_start=0)
    remedy = policy.plan(_gain(step=12), View(lr_scale=10.0))
    assert remedy.action == "rollback" and remedy.params["to"] == 0
    assert remedy.params["lr_factor"] == pytest.approx(0.1)  # not half a decade: the raise, undone
    assert "raised x10 at step 0" in remedy.reasoning


def test_without_a_raise_in_this_phase_or_after_an_lr_decision_the_cut_is_as_ever():
    earlier_phase = _raised(at=30)  # raised in the pretraining phase, the finetune started at 40
    answered = _raised()
    answered.last_lr_change = 42  # an LR decision after the raise answered it
    for policy in (Policy(OrchestratorConfig()), earlier_phase, answered):
        remedy = policy.plan(_above(), View(lr_scale=100.0, last_good=40))
        assert remedy.params["lr_factor"] == pytest.approx(0.1) and "raised" not in remedy.reasoning


def test_jumps_after_a_raise_blame_the_raise_not_the_rows():
    policy = _raised(at=0, factor=10.0, phase_start=0)
    finding = _gain(step=12)
    finding.evidence |= {"gain_rest": 0.7, "jumped_steps": [5, 6], "rows": [3, 4, 5]}
    remedy = policy.plan(finding, View(lr_scale=10.0))
    assert remedy.action == "rollback" and remedy.params["skip_rows"] == []
    assert remedy.params["lr_factor"] == pytest.approx(0.1) and "raised x10" in remedy.reasoning
