"""The size of a second cut for an LR far too high. debug-moe at 20x its preset's LR: the first
steps' gain 0.22, cut x0.1 to 2x; the replay's gain 0.30, under 3/4 of min_gain (0.4), was cut
x0.1 again to a fifth of the preset's LR (80 steps: val 5.05 against 4.31 clean). A gain that rose
off its floor since the last cut says the LR is within a decade of a sound one: halved."""

from test_lr_too_high_floor import View, _gain
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.policy import Policy


def _second_cut(first: float, second: float) -> float:
    policy = Policy(OrchestratorConfig())
    remedy = policy.plan(_gain(step=7, gain=first), View(lr_scale=1.0))
    assert remedy.action == "rollback" and remedy.params["lr_factor"] == 0.1
    remedy.commit()
    return policy.plan(_gain(step=15, gain=second), View(lr_scale=0.1)).params["lr_factor"]


def test_a_gain_that_rose_after_a_decade_cut_is_halved():
    assert _second_cut(0.22, 0.298) == 0.5  # debug-moe at 20x, then 2x: x0.32 ended at 0.63x, 4.005 against 3.906


def test_a_gain_still_on_its_floor_is_cut_a_decade_again():
    assert _second_cut(0.12, 0.15) == 0.1  # rose, but under half min_gain: still far too high
    assert _second_cut(0.22, 0.21) == 0.1  # the last decade changed nothing


def test_the_reference_gain_survives_a_checkpoint():
    policy = Policy(OrchestratorConfig())
    policy.plan(_gain(step=7, gain=0.22), View(lr_scale=1.0)).commit()
    restored = Policy(OrchestratorConfig())
    restored.load_state_dict(policy.state_dict())
    assert restored.too_high_gain == [0, 0.22]


def test_a_cut_in_another_phase_is_no_reference():
    policy = Policy(OrchestratorConfig())
    policy.plan(_gain(step=7, gain=0.22), View(lr_scale=1.0)).commit()
    policy.new_phase(40, None)  # a finetuning phase: its own data and LR
    assert policy.plan(_gain(step=47, gain=0.298), View(lr_scale=1.0)).params["lr_factor"] == 0.1


def test_the_journal_says_why_a_replay_is_halved_where_a_fresh_run_is_not():
    """The same gain (0.33 at the cut LR) is halved on the replay after a decade's cut and cut x0.316
    in a fresh run (debug-hybrid at 20x: 0.22, then 0.33 at step 15): the earlier gain, the evidence
    only the replay has, is journaled and named, and the fresh run's reasoning claims no rise."""
    policy = Policy(OrchestratorConfig())
    policy.plan(_gain(step=7, gain=0.22), View(lr_scale=1.0)).commit()
    replay = policy.plan(_gain(step=15, gain=0.33), View(lr_scale=0.1))
    fresh = Policy(OrchestratorConfig()).plan(_gain(step=7, gain=0.33), View(lr_scale=0.1))
    assert (replay.params["lr_factor"], fresh.params["lr_factor"]) == (0.5, 0.1**0.5)
    assert replay.evidence["gain_before"] == 0.22 and "gain_before" not in fresh.evidence
    assert "answered a gain of 0.22" in replay.reasoning and "rose to 0.33" in replay.reasoning
    assert "rose" not in fresh.reasoning and "as an LR far too high makes them" in fresh.reasoning
