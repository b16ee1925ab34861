"""Cuts past orchestrator.min_lr_scale for an LR still far too high. debug-mod at 333x its preset's LR
(optim.lr=1.0): the loss rose above its start (cut x0.1), the first steps' gain read 0.10 (cut x0.1 to
the floor, 3.3x the preset's), then 0.39 and 0.60 on the replay: noted at the floor, not cut, and the
run ended at 4.59 against 3.99 clean (100 steps). A gain that rose with the last cut says the LR
answers the cuts as one too high does; the gain climbs to 1 as the LR falls, so such cuts end."""

from test_lr_too_high_floor import View, _gain
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.policy import Policy


def _at_the_floor(gain_before: float) -> Policy:
    """A policy whose last cut (x0.1, gain `gain_before`) brought the LR to the floor."""
    policy = Policy(OrchestratorConfig())
    remedy = policy.plan(_gain(step=7, gain=gain_before), View(lr_scale=0.1))
    assert remedy.action == "rollback" and remedy.params["lr_factor"] == 0.1
    remedy.commit()
    return policy


def test_a_gain_that_rose_with_the_cut_to_the_floor_is_cut_past_it():
    remedy = _at_the_floor(0.10).plan(_gain(step=11, gain=0.39), View(lr_scale=0.01))
    assert remedy.action == "rollback" and remedy.params == {"to": 0, "skip_rows": [], "lr_factor": 0.5}
    assert remedy.evidence["gain_before"] == 0.10
    assert (
        "past the floor (orchestrator.min_lr_scale=0.01)" in remedy.reasoning and "rose from 0.10" in remedy.reasoning
    )


def test_the_replay_short_of_a_sound_gain_is_halved_past_the_floor_again():
    policy = _at_the_floor(0.10)
    past = policy.plan(_gain(step=11, gain=0.39), View(lr_scale=0.01))
    assert past.action == "rollback", past.reasoning
    past.commit()
    evidence = {"loss": 5.1, "start": 6.24, "gain": 0.60, "min_gain": 0.4, "sound_gain": 0.72, "gain_window": 15}
    short = Finding(
        rule="above_start", family="instability", step=15, evidence=evidence | {"since": 1}, summary="", strength=0.7
    )
    remedy = policy.plan(short, View(lr_scale=0.005))
    assert remedy.action == "rollback" and remedy.params["lr_factor"] == 0.5 and "rose from 0.39" in remedy.reasoning


def test_a_gain_that_did_not_rise_stays_at_the_floor():
    remedy = _at_the_floor(0.30).plan(_gain(step=11, gain=0.25), View(lr_scale=0.01))
    assert remedy.action == "none" and "at its floor" in remedy.reasoning
