"""A finetune phase starts from trained weights, whose loss starts steady (no fresh model's warm-up
overshoot, the reason orchestrator.spike.early_steps is off by default): LossSpike arms its early bar
there (trained_early_steps). debug 20 steps -> finetune 20 (400 prompt/response rows) with
bad_batch@28, the phase's 8th step, went undetected before (val 4.928 against 4.767 clean)."""

from test_orchestrator_units import metrics
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.loss_spike import LossSpike

# that run's losses over the finetune phase's steps 21-32, fault-free and with bad_batch@28
CLEAN = [6.147, 6.174, 6.048, 5.969, 5.877, 5.741, 5.673, 5.587, 5.486, 5.351, 5.271, 5.146]
BAD = [6.147, 6.174, 6.048, 5.969, 5.877, 5.741, 5.673, 6.918, 5.58, 5.836, 5.605, 5.408]


def found(monitor: LossSpike, losses: list[float], phase: int, start: int = 21) -> list[int]:
    steps = [metrics(start + i, loss=loss) for i, loss in enumerate(losses)]
    for m in steps:
        m.phase = phase
    return [m.step for m in steps if monitor.observe(m) is not None]


def test_bad_data_early_in_a_finetune_phase_is_a_spike_by_default():
    cfg = OrchestratorConfig()
    assert cfg.spike.early_steps == 0  # a fresh model's first steps: still off
    assert found(LossSpike(cfg), BAD, phase=1) == [28]
    assert found(LossSpike(cfg), CLEAN, phase=1) == []
    assert found(LossSpike(cfg), BAD, phase=0) == []  # a fresh model's phase: the early bar off, as before
    cfg.spike.trained_early_steps = 0
    assert found(LossSpike(cfg), BAD, phase=1) == []


def test_weights_trained_before_arm_the_early_bar_and_a_checkpoint_keeps_it():
    """train.init_from: phase 0 from trained weights (the orchestrator sets `trained`)."""
    cfg = OrchestratorConfig()
    monitor = LossSpike(cfg)
    monitor.trained = True
    assert found(monitor, BAD[:5], phase=0) == []
    resumed = LossSpike(cfg)
    resumed.load_state_dict(monitor.state_dict())
    assert found(resumed, BAD[5:], phase=0, start=26) == [28]
