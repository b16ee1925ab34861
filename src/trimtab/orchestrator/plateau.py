"""The Plateau rule: a loss that stopped falling, or never left where the phase started (trends.py has
the other detectors of a run's course)."""

from __future__ import annotations

import math

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, Rolling, StepMetrics


class Plateau(Monitor):
    """Loss variance below a threshold for `window` steps while far from the planned end; or, in
    pretraining, a loss that has not left where the phase started for a whole window after the
    LR's warm-up, however noisy: an LR far too low (debug at 0.01x the preset's LR: 6.25 -> 6.06
    by step 50, the variance of that slow descent 3e-3, and no rule fired; val 6.01 against 4.29).
    "Left" is by the margin above_start measures above the start (max(margin, rel_margin x it));
    a sound LR passes that line within 10 steps on the debug presets, 0.1x by step 16. A finetuning
    phase starts from a trained model, whose loss a low LR may rightly leave where it is: not judged
    (nor, by the policy, a run from train.init_from). A cyclic schedule's LR keeps rising: after
    the first two windows the variance alone judges it."""

    rule, family = "plateau", "plateau"
    SETTINGS = ("margin",)  # above_start's, as configured: a resume's edit of them applies

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.plateau
        self.window = Rolling(self.cfg.window)
        self.margin = (cfg.above_start.margin, cfg.above_start.rel_margin)
        self.start: float | None = None  # the phase's first loss: the untouched weights' score
        self.first_step = 0  # ... and its step
        self.rising_at = 0  # the last step the schedule raised the LR (its warm-up)
        self.last_lr: float | None = None  # the schedule's LR of the last step seen

    def observe(self, m: StepMetrics) -> Finding | None:
        if self.last_lr is not None and m.scheduled_lr > self.last_lr:  # a rise from the phase's first LR
            self.rising_at = m.step
        self.last_lr = m.scheduled_lr
        if not math.isfinite(m.loss):
            return None
        if self.start is None:
            self.start, self.first_step = m.loss, m.step
        if m.skipped:  # a withheld update's loss says nothing of progress
            return None
        self.window.add(m.loss)
        if not self.window.full() or m.progress >= self.cfg.max_progress:
            return None
        variance, mean = self.window.std() ** 2, self.window.mean()
        band = max(self.margin[0], self.margin[1] * self.start)
        line = self.start - band
        # a window of steps after the first (whose loss is the start), not above the start's band (above_start's)
        at_start = m.phase == 0 and m.step - self.first_step >= self.cfg.window and line < mean <= self.start + band
        if at_start and m.step - self.rising_at < self.cfg.window:
            if m.step - self.first_step < 2 * self.cfg.window:
                return None  # judged once the warm-up is a window behind (a raise during it would raise the peak)
            at_start = False  # an LR that keeps rising (a cyclic schedule): the variance alone judges
        if variance >= self.cfg.variance and not at_start:
            return None
        self.window = Rolling(self.cfg.window)
        evidence = {"variance": variance, "window": self.cfg.window, "progress": m.progress}
        if at_start:
            evidence |= {"mean": mean, "start": self.start, "line": line}
            return self.finding(
                m,
                evidence,
                f"loss {mean:.3f} (mean of the last {self.cfg.window} steps, past any LR warm-up) has not left the "
                f"{self.start:.3f} the phase started at (line {line:.3f})",
                0.5 + 0.5 * min(1.0, (mean - line) / max(self.start - line, 1e-6)),
            )
        return self.finding(
            m,
            evidence,
            f"loss variance {variance:.1e} < {self.cfg.variance:.0e} for {self.cfg.window} steps",
            0.5 + 0.5 * (1 - variance / self.cfg.variance),
        )
