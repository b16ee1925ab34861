"""An LR far too low: the loss has not left where the phase started a window after the LR's
warm-up (plateau.Plateau), raised x10 (policy._too_low), not x1.5 under the plateau's 2x ceiling.
debug at 0.01x the preset's LR fell 6.25 -> 6.06 by step 50 (val 6.01 against 4.29 at the preset's):
a descent too steep for the plateau's variance (3e-3 > 1e-3), so no rule fired; at 0.001x the
plateau raised it x1.5 once (val 6.215 against 6.219 off)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.plateau import Plateau
from trimtab.orchestrator.policy import Policy

UNIGRAM = 5.258  # debug's training targets' unigram entropy
CURVES = json.loads((Path(__file__).parent / "golden" / "lr_curves.json").read_text())


def _schedule(step: int, lr: float = 3e-5, warmup: int = 10) -> float:
    return lr * min(step, warmup) / warmup


def _slow(step: int) -> float:
    """debug at 0.01x its LR: 6.25 falling 0.0038 a step, with batch noise."""
    return 6.25 - 0.0038 * step + 0.03 * math.sin(1.7 * step)


def _findings(mon: Plateau, losses, lrs, total: int = 100):
    found = []
    for step, (loss, lr) in enumerate(zip(losses, lrs), 1):
        m = StepMetrics(step=step, loss=loss, grad_norm=1.0, scheduled_lr=lr, lr=lr, progress=step / total)
        if (f := mon.observe(m)) is not None:
            found.append(f)
    return found


@dataclass
class View:
    lr_scale: float = 1.0
    unigram: float | None = UNIGRAM
    init_from: str = ""

    @property
    def cfg(self):
        return SimpleNamespace(train=SimpleNamespace(init_from=self.init_from))

    def context_free_loss(self):
        return self.unigram


def test_a_loss_that_never_left_its_start_is_found_a_window_after_the_warm_up():
    steps = range(1, 71)
    found = _findings(Plateau(OrchestratorConfig()), [_slow(s) for s in steps], [_schedule(s) for s in steps])
    assert [f.step for f in found] == [60]  # the window 11-60 follows the warm-up (steps 1-10)
    ev = found[0].evidence
    assert ev["start"] == pytest.approx(_slow(1)) and ev["variance"] > 1e-3  # not flat: the variance misses it
    assert ev["line"] == pytest.approx(_slow(1) - 0.05 * _slow(1))  # above_start's margin, below the start


@pytest.mark.parametrize("name", ["d1", "w0", "low10", "moe1", "d3", "hyb3"])
def test_recorded_curves_of_a_sound_lr_one_too_high_or_a_tenth_are_not_found(name):
    """The first 70 steps of real runs (tests/golden/lr_curves.json): each left its start within 16
    steps (0.1x included), so none is an LR far too low."""
    curve = CURVES[name]
    assert _findings(Plateau(OrchestratorConfig()), curve["loss"], curve["lr"]) == []


def _stuck_finding():
    steps = range(1, 71)
    [f] = _findings(Plateau(OrchestratorConfig()), [_slow(s) for s in steps], [_schedule(s) for s in steps])
    return f


def test_the_policy_raises_an_lr_far_too_low_x10():
    policy, f = Policy(OrchestratorConfig()), _stuck_finding()
    remedy = policy.plan(f, View())
    assert remedy.action == "scale_lr" and remedy.params == {"factor": pytest.approx(10.0)}
    assert "max_lr_scale" in remedy.reasoning and f"{UNIGRAM:.3f}" in remedy.reasoning
    remedy.applied()
    assert policy.last_lr_change == 60
    bounded = Policy(OrchestratorConfig()).plan(f, View(lr_scale=50.0))  # up to 1/min_lr_scale = 100x
    assert bounded.params == {"factor": pytest.approx(2.0)}
    at_ceiling = Policy(OrchestratorConfig()).plan(f, View(lr_scale=100.0))
    assert at_ceiling.action == "none" and "raise optim.lr" in at_ceiling.reasoning


def test_no_raise_for_a_trained_model_nor_after_the_lr_was_found_too_high():
    f = _stuck_finding()
    trained = Policy(OrchestratorConfig()).plan(f, View(unigram=7.0))  # started below its data's unigram level
    assert trained.action == "none" and "trained before" in trained.reasoning
    assert Policy(OrchestratorConfig()).plan(f, View(unigram=None)).action == "none"
    assert Policy(OrchestratorConfig()).plan(f, View(init_from="runs/base")).action == "none"
    flat = replace(f, evidence={**f.evidence, "variance": 1e-4})  # flat too: the plateau's own raise, as before
    assert Policy(OrchestratorConfig()).plan(flat, View(init_from="runs/base")).params == {"factor": 1.5}
    blind = Policy(OrchestratorConfig()).plan(f, View(unigram=5.95))  # stalled at the context-free level
    assert blind.action == "none" and "blind to context" in blind.reasoning
    cut = Policy(OrchestratorConfig())
    cut.lr_too_high_at = 12  # above_start cut it at step 12 of this phase
    again = cut.plan(f, View())
    assert again.action == "none" and "far too high at step 12" in again.reasoning
