"""Mixture-of-Depths quality: a monitor that ties a loss rise to a fall in capacity, and its remedy.

A MoD block processes only a fraction (the capacity) of the tokens; the capacity falls during its
warm-up, or when a person (`trimtab ctl RUN mod-capacity V`) or a config sets it low. When that
costs quality, the training loss says so right after the fall: the monitor compares the mean loss
of the last `recent` steps with the mean of the `window` steps before them and fires when it is
higher by `tolerance` while the mean capacity fell by `min_drop` or more between the two. In
healthy training, and in a warm-up that costs nothing, the loss keeps falling and the rule stays
silent. Remedy: every MoD layer's target capacity goes back to the highest of the window (before
the fall), which also ends a warm-up that went too far.
"""

from __future__ import annotations

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics


class MoDQuality(Monitor):
    rule, family = "mod", "mod"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.mod
        self.history: list[tuple[float, float]] = []  # (capacity, loss), oldest first

    def observe(self, m: StepMetrics) -> Finding | None:
        if m.mod_capacity is None or m.skipped or m.loss != m.loss:  # NaN: the other rules' case
            return None
        cfg = self.cfg
        self.history = (self.history + [(m.mod_capacity, m.loss)])[-(cfg.window + cfg.recent) :]
        if len(self.history) < cfg.window + cfg.recent:
            return None
        before, after = self.history[: cfg.window], self.history[cfg.window :]
        loss_before = sum(loss for _, loss in before) / cfg.window
        loss_after = sum(loss for _, loss in after) / cfg.recent
        cap_before = sum(c for c, _ in before) / cfg.window
        cap_after = sum(c for c, _ in after) / cfg.recent
        # a relative rise needs a positive loss: an RL objective (0 with no signal, signed) has none
        if loss_before <= 0:
            return None
        rise = loss_after / loss_before - 1
        if rise <= cfg.tolerance or cap_before - cap_after < cfg.min_drop:
            return None
        self.history = []  # a fresh baseline after the remedy
        evidence = {
            "loss_before": loss_before,
            "loss_after": loss_after,
            "rise": rise,
            "capacity_before": cap_before,
            "capacity_after": cap_after,
            "restore_to": max(c for c, _ in before),
        }
        summary = (
            f"loss {loss_after:.3f} is {rise:.1%} above {loss_before:.3f} since the MoD capacity "
            f"fell from {cap_before:.2f} to {cap_after:.2f}"
        )
        return self.finding(m, evidence, summary, min(1.0, 0.5 + rise / (4 * cfg.tolerance)))
