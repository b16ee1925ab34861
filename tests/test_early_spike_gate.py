"""The update gate holds LossSpike's early bar (orchestrator.spike.early_steps): a garbage batch in
the warm-up is withheld before the optimizer step, not trained on and found one read later."""

from types import SimpleNamespace

import torch

from test_early_damage import CLEAN
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.loss_spike import LossSpike
from trimtab.orchestrator.monitors import StepMetrics

WARM_UP = CLEAN[:9]  # debug's fault-free steps 1-9 (6.25 -> 5.61, the warm-up's steep fall)
GARBAGE = 6.42  # step 10 with bad_batch@10 (its rows all garbage tokens)


def test_an_early_spike_is_withheld_by_the_update_gate(tmp_path):
    """Nine healthy steps: under min_samples the trend's bar is no bar (ceiling() is infinite), so
    only the early one (the lowest 5.606 + max(6 x the step-to-step spread, 0.15)) stands between
    the garbage and the weights; the gate withholds it and lets step 10's fault-free 5.499 through."""
    cfg = OrchestratorConfig()
    cfg.spike.early_steps = 25  # off by default
    orchestrator = Orchestrator(cfg, tmp_path)
    spike = orchestrator.monitors["spike"]
    for step, loss in enumerate(WARM_UP, start=1):
        assert spike.observe(StepMetrics(step=step, loss=loss, grad_norm=1.0)) is None
    orchestrator.ceilings = orchestrator._gate_ceilings()  # as each read sets them (Orchestrator._read)
    run = SimpleNamespace(applied_lr=1e-3, scheduled_lr=1e-3, lr_scale=1.0, phase=0, mod_layer_capacities=None)
    gate = lambda loss: bool(orchestrator.update_gate(run, torch.tensor(loss), torch.tensor(1.2)))  # noqa: E731
    assert gate(GARBAGE) and not gate(CLEAN[9])
    assert spike.ceiling() == float("inf") and spike.gate_ceiling() < GARBAGE
    bar = spike.gate_ceiling()  # after a withheld spike, the next step is judged from its level
    found = spike.observe(StepMetrics(step=10, loss=GARBAGE, grad_norm=1.2, skipped=True))
    assert found is not None and found.evidence["early"] and found.evidence["ceiling"] == bar


# the undisturbed 2-rank DDP run of tests/test_distributed.py (debug, fp32, 150 KB, 10 steps): its
# 9-step warm-up reaches the peak LR at step 9, and the loss overshoots 0.36 nats, then falls on
DDP_CLEAN = [6.245, 6.181, 6.078, 5.997, 5.935, 5.835, 5.709, 5.554, 5.914, 5.402]


def test_a_fault_free_overshoot_at_the_warm_up_peak_is_no_spike_at_the_default_bar():
    """Step 9 is 10.7 step-to-step spreads (0.034) over the lowest: under 6 spreads it was a spike, and
    the fault-free run left rows out for nothing; the default bar (13 spreads) lets it through."""
    cfg = OrchestratorConfig()
    cfg.spike.early_steps = 25  # off by default
    spike = LossSpike(cfg)
    found = [spike.observe(StepMetrics(step=s, loss=x, grad_norm=1.0)) for s, x in enumerate(DDP_CLEAN, 1)]
    assert found == [None] * 10 and spike.early_ceiling()[0] < float("inf")  # judged, and let through


# debug, fp32, 60 KB, 24 steps: fault-free, the loss overshoots 0.84 nats at the warm-up's peak LR (step 9);
# step 10 is what the same weights score on the next batch when step 9's update was withheld
OVERSHOOT = [6.261, 6.168, 6.028, 5.935, 5.844, 5.743, 5.641, 5.545, 6.384]
SAME_WEIGHTS, AFTER = 6.493, [5.286, 5.229, 5.099]


def _tripped() -> LossSpike:
    cfg = OrchestratorConfig()
    cfg.spike.early_steps = 25  # off by default
    spike = LossSpike(cfg)
    for step, loss in enumerate(OVERSHOOT[:-1], start=1):
        assert spike.observe(StepMetrics(step=step, loss=loss, grad_norm=1.0)) is None
    assert spike.observe(StepMetrics(step=9, loss=OVERSHOOT[-1], grad_norm=1.0, skipped=True)) is not None
    return spike


def test_a_withheld_early_spike_does_not_hold_the_run_still():
    """Judged from the phase's lowest (5.545), every loss of the frozen weights stayed over the bar and
    each update was withheld (steps 10-19, then three rollbacks, gave up). The next step is judged
    from the withheld step's level: it passes, and the bar's lowest starts over from it."""
    spike = _tripped()
    assert spike.gate_ceiling() > SAME_WEIGHTS  # the gate lets step 10's update through
    assert spike.observe(StepMetrics(step=10, loss=SAME_WEIGHTS, grad_norm=1.0)) is None
    assert spike.gate_ceiling() > SAME_WEIGHTS  # judged from the same level while it stays over the old bar
    found = [spike.observe(StepMetrics(step=s, loss=x, grad_norm=1.0)) for s, x in enumerate(AFTER, 11)]
    assert found == [None] * 3 and spike.early_ceiling()[1] == AFTER[-1]  # back on the curve: its lowest
    assert spike.early_ceiling()[2] < 0.05  # the fall after the overshoot, per step, is no extra noise


def test_a_loss_rising_further_after_a_withheld_spike_is_a_spike_again():
    """Only a loss at the withheld step's level passes: one rising a bar's width further trips again."""
    spike = _tripped()
    bar = spike.gate_ceiling()
    assert OVERSHOOT[-1] < bar < OVERSHOOT[-1] + 0.3
    found = spike.observe(StepMetrics(step=10, loss=bar + 0.05, grad_norm=1.0, skipped=True))
    assert found is not None and found.evidence["early"] and found.evidence["lowest"] == OVERSHOOT[-1]
    assert "the withheld step's loss 6.384" in found.summary
