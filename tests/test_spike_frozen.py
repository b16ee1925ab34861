"""LossSpike's trend runs on the update clock, not the step (orchestrator/loss_spike.py): a stretch of
steps whose update was not applied leaves the loss where it was. Debug, 200 steps, `bad_batch@25:25`:
every row of steps 25-49 gated by the row gate (their updates withheld), then the first clean steps
50-55 read 4.95-5.03 against a trend extrapolated in steps to 4.62-4.57 over the frozen ones: six spike
findings, the LR cut x0.5 and a rollback to step 23 (55 steps re-done) for weights that were fine."""

from dataclasses import replace

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.train import OptimConfig
from trimtab.orchestrator.loss_spike import LossSpike
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.training.optim import lr_at

# that run's steps 1-24 (warm-up 10 steps), the frozen steps' mean loss (their garbage rows as scored), steps 50-55
BEFORE = [6.251, 6.211, 6.12, 6.043, 5.972, 5.904, 5.858, 5.715, 5.606, 5.499, 5.38, 5.314]
BEFORE += [5.249, 5.186, 5.166, 5.102, 5.101, 5.156, 5.094, 5.097, 5.092, 5.067, 4.968, 4.999]
FROZEN, GARBAGE = range(25, 50), 7.52
AFTER = [4.992, 4.959, 5.027, 4.964, 4.986, 4.953]
SCHEDULE = OptimConfig(lr=3e-3, warmup_steps=10)  # debug's: cosine over 200 steps


def step(n: int, loss: float, skipped: bool = False) -> StepMetrics:
    return StepMetrics(step=n, loss=loss, grad_norm=1.0, scheduled_lr=lr_at(n - 1, 200, SCHEDULE), skipped=skipped)


def frozen(spike: LossSpike, loss: float = GARBAGE) -> LossSpike:
    """Steps 1-24 trained, then 25-49 with no update applied (each scoring `loss`)."""
    for n, value in enumerate(BEFORE, start=1):
        assert spike.observe(step(n, value)) is None, n
    for n in FROZEN:
        spike.observe(step(n, loss, skipped=True))  # the garbage's losses are spikes: not the window's
    return spike


def test_clean_steps_after_a_frozen_stretch_at_the_same_level_are_no_spike():
    spike = frozen(LossSpike(OrchestratorConfig()))
    for n, loss in enumerate(AFTER, start=50):
        assert spike.ceiling() > loss, n  # the update gate's bar too: their updates go in
        assert spike.observe(step(n, loss)) is None, n
    predicted, _ = spike.trend()  # the curve where it stopped (in steps: 4.57 at step 55)
    assert spike.held == len(FROZEN) and abs(predicted - AFTER[-1]) < 0.15


def test_withheld_steps_at_the_weights_level_stand_at_one_clock():
    """Withheld for another reason (a person's skips) with losses under the bar: the same weights scored
    them, so they stand at the next applied step's clock, and the clean steps after pass."""
    spike = frozen(LossSpike(OrchestratorConfig()), loss=4.99)
    assert set(list(spike.clock.values)[-len(FROZEN) :]) == {25}
    assert all(spike.observe(step(n, loss)) is None for n, loss in enumerate(AFTER, start=50))


def test_a_real_spike_after_a_frozen_stretch_is_still_found():
    spike = frozen(LossSpike(OrchestratorConfig()))
    found = spike.observe(step(50, AFTER[0] + 0.5, skipped=True))
    assert found is not None and found.rule == "spike" and found.evidence["predicted"] < AFTER[0] + 0.25
    assert spike.observe(step(51, AFTER[1])) is None  # the weights were fine: the next clean step passes


def test_the_update_clock_survives_a_resume_and_an_older_checkpoint_reads_as_before():
    spike = frozen(LossSpike(OrchestratorConfig()))
    resumed = LossSpike(OrchestratorConfig())
    resumed.load_state_dict(spike.state_dict())  # a checkpoint at step 49 (exact resume)
    assert resumed.ceiling() == spike.ceiling() and resumed.observe(step(50, AFTER[0])) is None
    older = {k: v for k, v in spike.state_dict().items() if k not in ("clock", "held")}
    old = LossSpike(OrchestratorConfig())
    old.load_state_dict(older)  # saved before the update clock: the steps stand in for it
    assert list(old.clock.values) == list(old.steps.values) and old.held == 0


def test_an_fp16_overflow_applies_no_update_either():
    spike = LossSpike(OrchestratorConfig())
    for n, value in enumerate(BEFORE, start=1):
        spike.observe(replace(step(n, value), overflow=n > 20))
    assert spike.held == 4 and spike.next_step - spike.held == 21
