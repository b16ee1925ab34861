"""The update gate holds LossSpike's early bar (orchestrator.spike.early_steps): a garbage batch in
the warm-up is withheld before the optimizer step, not trained on and found one read later."""

from types import SimpleNamespace

import torch

from test_early_damage import CLEAN
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import LossSpike, StepMetrics

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
    run = SimpleNamespace(applied_lr=1e-3, scheduled_lr=1e-3, lr_scale=1.0, phase=0)
    gate = lambda loss: bool(orchestrator.update_gate(run, torch.tensor(loss), torch.tensor(1.2)))  # noqa: E731
    assert gate(GARBAGE) and not gate(CLEAN[9])
    assert spike.ceiling() == float("inf") and spike.gate_ceiling() < GARBAGE
    found = spike.observe(StepMetrics(step=10, loss=GARBAGE, grad_norm=1.2, skipped=True))
    assert found is not None and found.evidence["early"] and found.evidence["ceiling"] == spike.gate_ceiling()


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
