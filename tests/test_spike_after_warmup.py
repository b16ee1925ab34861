"""LossSpike fits its trend from the end of the phase's LR warm-up (orchestrator/loss_spike.py): the
warm-up's loss is no line in log(step), and its bend inflated the residuals the bar is made of.
debug-moe, 40 steps, weights_noise@25:2: the loss jumped 4.79 -> 5.44 at step 25 under a bar of
5.654 (steps 1-24 fitted, residual std 0.154) and trained on, val 4.978 against 4.820 clean."""

from types import SimpleNamespace

import torch

from test_orchestrator_units import View
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.train import OptimConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.loss_spike import LossSpike
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.policy import Policy
from trimtab.training.optim import lr_at

# that run's steps 1-24 (the fault-free run's too), then step 25 fault-free and with the fault
BEFORE = [6.256, 6.227, 6.159, 6.065, 5.991, 5.917, 5.819, 5.724, 5.601, 5.473, 5.391, 5.298]
BEFORE += [5.215, 5.155, 5.109, 5.027, 5.032, 5.078, 4.981, 4.999, 4.95, 4.869, 4.745, 4.792]
CLEAN, WRECKED = 4.744, 5.442
SCHEDULE = OptimConfig(lr=3e-3, warmup_steps=10)  # debug-moe's: 10 warm-up steps, cosine over 40


def step(n: int, loss: float, warm_up: bool = True, skipped: bool = False) -> StepMetrics:
    lr = lr_at(n - 1, 40, SCHEDULE) if warm_up else 3e-3  # lr_at counts steps from 0
    return StepMetrics(step=n, loss=loss, grad_norm=1.0, scheduled_lr=lr, skipped=skipped)


def fed(spike: LossSpike, losses: list[float], warm_up: bool = True, start: int = 1) -> LossSpike:
    for n, loss in enumerate(losses, start=start):
        assert spike.observe(step(n, loss, warm_up)) is None, n
    return spike


def test_a_wrecked_update_after_the_warm_up_is_a_spike_and_its_update_withheld(tmp_path):
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    spike = fed(orchestrator.monitors["spike"], BEFORE)
    assert spike.trend()[1] < 0.06 and CLEAN < spike.ceiling() < WRECKED  # 0.048, 5.017 (steps 1-24: 0.154, 5.654)
    orchestrator.ceilings = orchestrator._gate_ceilings()  # as each read sets them (Orchestrator._read)
    run = SimpleNamespace(applied_lr=1e-3, scheduled_lr=1e-3, lr_scale=1.0, phase=0, mod_layer_capacities=None)
    gate = lambda loss: bool(orchestrator.update_gate(run, torch.tensor(loss), torch.tensor(1.0)))  # noqa: E731
    assert gate(WRECKED) and not gate(CLEAN)
    found = spike.observe(step(25, WRECKED, skipped=True))
    assert found is not None and found.step == 25 and found.evidence["fit_from"] == spike.warm_end == 10
    assert Policy(OrchestratorConfig()).plan(found, View()).action == "skip_step"


def test_the_clean_step_passes_and_a_resumed_monitor_judges_alike():
    spike = fed(LossSpike(OrchestratorConfig()), BEFORE[:15])
    resumed = LossSpike(OrchestratorConfig())
    resumed.load_state_dict(spike.state_dict())  # a checkpoint at step 15 (exact resume)
    for monitor in (spike, resumed):
        fed(monitor, BEFORE[15:], start=16)
        assert monitor.ceiling() == fed(LossSpike(OrchestratorConfig()), BEFORE).ceiling()
    assert spike.observe(step(25, CLEAN)) is None
    assert resumed.observe(step(25, WRECKED)) is not None


def test_without_a_warm_up_or_before_enough_steps_after_it_the_whole_window_is_fitted():
    """A constant LR (no warm-up) keeps the window's fit; so do the steps before min_samples follow
    the warm-up's end (step 10: from step 19 on)."""
    flat = fed(LossSpike(OrchestratorConfig()), BEFORE, warm_up=False)
    assert flat.fit_from() == 0 and flat.ceiling() > WRECKED  # the bar as before: 5.654
    early = fed(LossSpike(OrchestratorConfig()), BEFORE[:17])
    assert early.warm_end == 10 and early.fit_from() == 0


def test_a_withheld_update_in_the_warm_up_does_not_end_it():
    """lr_at holds the warm-up back a step per withheld update: the next step meets the same LR."""
    spike = LossSpike(OrchestratorConfig())
    for n, loss in enumerate(BEFORE[:5], start=1):
        spike.observe(step(n, loss))
    held = lr_at(5, 40, SCHEDULE)  # step 6's LR again at step 7: step 6's update was withheld
    spike.observe(StepMetrics(step=6, loss=BEFORE[5], grad_norm=1.0, scheduled_lr=held, skipped=True))
    spike.observe(StepMetrics(step=7, loss=BEFORE[6], grad_norm=1.0, scheduled_lr=held))
    assert spike.warming and spike.warm_end == 7


def test_a_jump_of_the_mod_capacity_restarts_the_window_and_opens_the_gate(tmp_path):
    """A person's cut 0.5 -> 0.02 (debug-mod, step 30) raised the loss 4.7 -> 5.1-5.4: judged from the
    window before it, spikes, withheld updates and rollbacks that kept the cut (val 6.04, 5.58 with the
    MoD rule's give-back). The capacity warm-up's own steps (here 0.1 a step) keep the window."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    spike = orchestrator.monitors["spike"]
    for n, loss in enumerate(BEFORE, start=1):  # the capacity warms up from 1.0 to 0.5 over steps 1-5
        m = step(n, loss)
        warm = max(0.5, 1.0 - 0.1 * n)
        assert spike.observe(StepMetrics(**{**vars(m), "mod_layers": [(1, warm), (3, warm)]})) is None
    assert len(spike.window) == len(BEFORE) and spike.capacity == [0.5, 0.5]
    orchestrator.ceilings = orchestrator._gate_ceilings()
    run = SimpleNamespace(applied_lr=1e-3, scheduled_lr=1e-3, lr_scale=1.0, phase=0, mod_layer_capacities=[0.5, 0.5])
    assert bool(orchestrator.update_gate(run, torch.tensor(WRECKED), torch.tensor(1.0)))  # the same model: withheld
    run.mod_layer_capacities = [0.5, 0.02]  # one layer of two cut (their mean moves 0.24, one of four's 0.12)
    assert not bool(orchestrator.update_gate(run, torch.tensor(WRECKED), torch.tensor(1.0)))  # another model
    assert spike.observe(StepMetrics(**{**vars(step(25, WRECKED)), "mod_layers": [(1, 0.5), (3, 0.02)]})) is None
    assert list(spike.steps.values) == [25] and spike.ceiling() == float("inf")
