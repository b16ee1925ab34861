"""The Divergence rule: a loss that climbs for good (trends.py and plateau.py have the other detectors of
a run's course)."""

from __future__ import annotations

import math

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, Rolling, StepMetrics


class Divergence(Monitor):
    """The loss trends up: the least-squares line through the window rises by min_rise of its mean
    and by `sigma` standard errors of that rise, so the noise of a sound run's losses does not draw
    it: a fault-free debug-moe run of 500 steps (5.7 epochs of the built-in data, losses 1.5-2.0
    with a spread of ~0.08 from step to step) had its LR halved at steps 304, 418 and 482 for rises
    of 5.4-6.1% (0.08-0.12 nats, their standard error ~0.04). Steps whose update was withheld are
    left out (their loss is a spike's or bad data's, not the trajectory's); the finding carries the
    window's rows, so the policy can tell bad data from a bad LR and attribute it to rows."""

    rule, family = "divergence", "instability"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.divergence
        self.window = Rolling(self.cfg.window)
        self.rows: list[list[int]] = []  # each window step's rows

    def observe(self, m: StepMetrics) -> Finding | None:
        if not math.isfinite(m.loss) or m.skipped:
            return None
        self.window.add(m.loss)
        self.rows = (self.rows + [list(m.rows)])[-self.cfg.window :]
        if not self.window.full():
            return None
        mean, rise = self.window.mean(), self.window.slope() * (len(self.window) - 1)
        if mean <= 0 or rise <= self.cfg.min_rise * mean:  # relative to a likelihood's (positive) mean
            return None
        error = self.window.rise_error()
        if rise <= self.cfg.sigma * error:  # the losses' noise about the line could draw it
            return None
        rows = sorted({r for step in self.rows for r in step})
        self.window, self.rows = Rolling(self.cfg.window), []  # a fresh window before it can fire again
        f = self.finding(
            m,
            {"rise": rise, "mean": mean, "window": self.cfg.window, "rise_error": error},
            f"loss rose {rise:.3f} ({rise / mean:.1%}) over {self.cfg.window} steps",
            0.5 + 0.5 * rise / (2 * self.cfg.min_rise * mean),
        )
        f.rows = rows
        return f
