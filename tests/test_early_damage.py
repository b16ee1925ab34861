"""Weights damaged in a phase's first steps: the trend's spike bar has too few samples there (and
the warm-up's fall inflates its residuals), so weights_noise@8:3 on debug trained on, 13% worse at
the end, with no decision. LossSpike's early bar (the phase's lowest loss + max(early_sigma x the
step-to-step spread, early_min_rise)) finds it, and the policy answers at once: the step's rows
left out when they explain it, else a rollback to the last good checkpoint."""

import math

import pytest

from test_orchestrator_units import View, act, metrics
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.errors import ConfigError
from trimtab.orchestrator.loss_spike import LossSpike
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.policy import Policy

# debug, 120 steps, default seed: the fault-free losses of steps 1-30, and the same run with
# weights_noise@8:3 (orchestrator off) over steps 1-12
CLEAN = [
    6.251, 6.211, 6.120, 6.043, 5.972, 5.904, 5.858, 5.715, 5.606, 5.499, 5.380, 5.314, 5.249, 5.186, 5.166,
    5.102, 5.101, 5.156, 5.095, 5.097, 5.091, 5.065, 4.932, 4.981, 4.914, 4.983, 5.024, 4.765, 4.857, 4.867,
]  # fmt: skip
DAMAGED = [6.251, 6.211, 6.120, 6.043, 5.972, 5.904, 5.858, 6.184, 5.815, 5.567, 5.431, 5.373]


def observe_all(monitor, losses, start=1):
    return [monitor.observe(metrics(start + i, loss=loss)) for i, loss in enumerate(losses)]


def test_a_jump_over_the_phase_lowest_in_its_first_steps_is_a_spike():
    cfg = OrchestratorConfig()
    cfg.spike.early_steps = 25  # off by default
    assert observe_all(LossSpike(cfg), CLEAN) == [None] * len(CLEAN)  # the warm-up's own noise: nothing
    monitor = LossSpike(cfg)
    found = [(s, f) for s, f in enumerate(observe_all(monitor, DAMAGED), 1) if f is not None]
    assert [s for s, _ in found] == [8]  # the trend's bar alone (silent until 10 samples) found nothing
    f = found[0][1]
    assert f.rule == "spike" and f.evidence["early"] and f.evidence["lowest"] == pytest.approx(5.858)
    assert f.evidence["loss"] > f.evidence["ceiling"] >= 5.858 + cfg.spike.early_min_rise
    assert f.evidence["ceiling"] == pytest.approx(5.858 + max(cfg.spike.early_sigma * f.evidence["step_spread"], 0.15))
    assert 0.6 <= f.strength <= 1 and "first 25 steps" in f.summary
    assert 6.184 not in monitor.window.values and len(monitor.window) == 11  # flagged: kept out of the window


def test_the_early_bar_is_the_first_steps_only_and_can_be_switched_off():
    cfg = OrchestratorConfig()
    cfg.spike.early_steps = 25  # off by default
    late = LossSpike(cfg)
    observe_all(late, [5.0, 4.99, 4.98], start=30)  # a phase that began at step 30 judges from there
    assert late.observe(metrics(33, loss=5.4)).evidence["early"]
    after = LossSpike(cfg)
    observe_all(after, [5.0 - 0.001 * i for i in range(25)])
    assert after.early_ceiling()[0] == math.inf  # 25 steps in: the trend's bar alone
    cfg.spike.early_steps = 0
    off = LossSpike(cfg)
    assert observe_all(off, DAMAGED) == [None] * len(DAMAGED)


@pytest.mark.parametrize("key, value", [("early_steps", -1), ("early_window", 1), ("early_sigma", 0)])
def test_the_early_bar_settings_are_checked(key, value):
    cfg = OrchestratorConfig()
    cfg.spike.early_steps = 25  # off by default
    setattr(cfg.spike, key, value)
    with pytest.raises(ConfigError, match=f"orchestrator.spike.{key}"):
        cfg.validate()


def early(step, rows=(80, 81), loss=6.184):
    evidence = {"loss": loss, "early": True, "lowest": 5.858, "step_spread": 0.03, "ceiling": 6.04}
    return Finding(rule="spike", family="instability", step=step, evidence=evidence, summary="", strength=1.0,
                   rows=list(rows))  # fmt: skip


def test_an_early_spike_its_rows_do_not_explain_rolls_back_at_once_keeping_the_data():
    policy = Policy(OrchestratorConfig())
    policy.measured(6.24, 0)  # the untouched weights' held-out loss
    view = View(bad_row_loss=5.0, probe=5.9, last_good=0, checkpoints=(0,))  # rows score as held-out rows do
    plan = act(policy, early(8), view)
    assert plan.action == "rollback" and plan.params == {"to": "last_good", "skip_rows": []}  # the LR stays
    assert "no row of the step scores as an outlier: the weights are suspect" in plan.reasoning
    assert plan.evidence["rows_scored"] == 2 and plan.evidence["rows_outliers"] == 0
    assert policy.rollbacks == 1 and policy.broken_at == 8 and policy.ladder.recent == []
    # broken again within the replay, at another loss: the same steps at this LR break the weights
    policy.shift(8)
    again = act(policy, early(5, loss=6.5), view)
    assert again.action == "rollback" and again.params["lr_factor"] == 0.1


def test_an_early_spike_the_replay_meets_again_is_the_data_and_a_note():
    """A clean debug run on a 60 KB corpus jumped 0.84 nats at an epoch's last step (step 9); one
    update later no row scored as an outlier and the weights looked as wrecked ones do. The
    rollback's replay met the same loss at the same step: the data's, so no second rollback (it
    had cut the LR x0.1 as for weights that break again)."""
    policy = Policy(OrchestratorConfig())
    view = View(bad_row_loss=5.0, probe=5.4, last_good=0, checkpoints=(0,))
    assert act(policy, early(9, loss=6.384), view).action == "rollback"
    state = policy.state_dict()
    policy.shift(9)
    policy.load_state_dict(state)  # what a checkpoint keeps of it
    plan = act(policy, early(9, loss=6.384), view)
    assert plan.action == "none" and "the same loss at the same step" in plan.reasoning
    assert policy.rollbacks == 1 and view.lr_scale == 1.0
    assert not policy.unsettled(10) and policy.broken_at == -1  # no breakage: the rows rule judges again


def test_an_early_spike_its_rows_explain_leaves_them_out():
    policy = Policy(OrchestratorConfig())
    plan = act(policy, early(15, rows=(150, 151, 152)), View(bad_row_loss=9.0, probe=5.0, last_good=0))
    assert plan.action == "skip_data" and plan.params == {"rows": [150, 151, 152]}
    assert "the data is to blame" in plan.reasoning and policy.rollbacks == 0
    assert policy.data.watch_until >= 0  # the next steps' rows are watched, as after any bad data
