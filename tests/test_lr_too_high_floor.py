"""An LR still far too high once the cuts reach their floor (orchestrator.min_lr_scale): debug at
1000x the preset's LR was cut twice to the floor (10x the preset's), then its first steps' gain
(0.38, under 0.4) was answered with a rollback to step 0 without a cut: a replay at the same LR that
met the same gain at the same step, and the run stopped at step 12 (exit 3, "unstable")."""

from dataclasses import dataclass

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.policy import Policy


@dataclass
class View:
    lr_scale: float = 0.01  # the floor: orchestrator.min_lr_scale
    last_good: int = 0
    has_good_checkpoint: bool = True
    total_steps: int = 100

    def has_checkpoint(self, step):
        return step >= 0

    def probe_loss(self):
        return None

    def row_losses(self, rows):
        return {r: 5.0 for r in rows}

    def held_out_row_losses(self, limit):
        return [5.0] * 12

    def row_parts(self, rows):
        return None  # one source

    def row_sources(self, rows):
        return {}


def _gain(step=12, gain=0.38):
    evidence = {"loss": 5.18, "start": 6.25, "gain": gain, "min_gain": 0.4, "gain_window": 7, "since": 1}
    return Finding(rule="above_start", family="instability", step=step, evidence=evidence, summary="", strength=0.7)


def test_overshooting_updates_at_the_lr_floor_are_noted_not_replayed():
    remedy = Policy(OrchestratorConfig()).plan(_gain(), View())
    assert remedy.action == "none"
    assert "at its floor (orchestrator.min_lr_scale=0.01)" in remedy.reasoning and "0.38" in remedy.reasoning
    assert remedy.reasoning.endswith("lower optim.lr")


def test_above_the_floor_they_are_still_cut_with_a_rollback():
    remedy = Policy(OrchestratorConfig()).plan(_gain(), View(lr_scale=1.0))
    assert remedy.action == "rollback" and remedy.params["to"] == 0
    assert remedy.params["lr_factor"] == 0.1**0.5  # a gain just under min_gain: half a decade
    assert "they overshoot, as an LR far too high makes them" in remedy.reasoning
