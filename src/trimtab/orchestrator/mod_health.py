"""Mixture-of-Depths quality: a monitor that ties a loss rise to a fall in capacity, and its remedy.

A MoD block processes only a fraction (the capacity) of the tokens; the capacity falls during its
warm-up, or when a person (`trimtab ctl RUN mod-capacity V`) or a config sets it low. When that
costs quality, the training loss says so right after the fall: the monitor compares the mean loss
of the last `recent` steps with the mean of the `window` steps before them and fires when it is
higher by `tolerance` while the mean capacity fell by `min_drop` or more between the two. In
healthy training, and in a warm-up that costs nothing, the loss keeps falling and the rule stays
silent. Remedy: each MoD layer whose capacity fell goes back to the highest it had in the window
(before the fall), which also ends a warm-up that went too far; a layer that did not fall keeps
its own. Layers differ (`model.mod.layer_capacity`, a person's `mod-capacity V L`): one value for
all would lower some, so then each layer is its own finding, one a step (as the MoE rule's).
"""

from __future__ import annotations

import math

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics


class MoDQuality(Monitor):
    rule, family = "mod", "mod"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.mod
        self.history: list[tuple[float, float]] = []  # (capacity, loss), oldest first
        self.layers: list[list[list[float]]] = []  # per step, [layer, capacity] of each MoD layer
        self.owed: list[list[float]] = []  # [layer, capacity] still to give back, one per step

    def observe(self, m: StepMetrics) -> Finding | None:
        if self.owed:  # the rest of a finding whose layers fell from different capacities
            layer, value = self.owed.pop(0)
            return self._layer_finding(m, {"layer": int(layer), "restore_to": value, "owed": True}, value)
        if m.mod_capacity is None or m.skipped or not math.isfinite(m.loss):  # NaN, Inf: the nonfinite rule's
            return None
        cfg = self.cfg
        keep = cfg.window + cfg.recent
        self.history = (self.history + [(m.mod_capacity, m.loss)])[-keep:]
        self.layers = (self.layers + [[[i, c] for i, c in m.mod_layers or ()]])[-keep:]
        if len(self.history) < keep:
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
        restore, n_layers = self._restore()
        self.history, self.layers = [], []  # a fresh baseline after the remedy
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
        strength = min(1.0, 0.5 + rise / (4 * cfg.tolerance))
        if len({value for _, value in restore}) <= 1 and len(restore) in (0, n_layers):
            if restore:  # every layer fell from the same capacity: one value for all
                evidence["restore_to"] = restore[0][1]
            return self.finding(m, evidence, summary, strength)
        (layer, value), self.owed = restore[0], [list(r) for r in restore[1:]]
        return self._layer_finding(m, {**evidence, "layer": layer, "restore_to": value}, value, summary, strength)

    def _restore(self) -> tuple[list[tuple[int, float]], int]:
        """(layer, the highest capacity it had before the fall) of each layer whose capacity fell
        (its recent mean below that by `min_drop` / 2: a layer a person cut alone moves the mean
        less than it fell), and the number of MoD layers; ([], 0) when the steps carried no
        per-layer capacities (all layers then go back to the mean's highest)."""
        cfg = self.cfg
        if not all(self.layers):
            return [], 0
        out = []
        for j, (layer, _) in enumerate(self.layers[-1]):
            high = max(step[j][1] for step in self.layers[: cfg.window])
            recent = sum(step[j][1] for step in self.layers[cfg.window :]) / cfg.recent
            if high - recent >= cfg.min_drop / 2:
                out.append((int(layer), high))
        return out, len(self.layers[-1])

    def _layer_finding(
        self, m: StepMetrics, evidence: dict, value: float, summary: str = "", strength: float = 0.75
    ) -> Finding:
        """A finding that gives one MoD layer its capacity back (family per layer, as MoE's)."""
        layer = evidence["layer"]
        summary = summary or f"MoD layer {layer} still has less capacity than before the loss rose"
        finding = self.finding(m, evidence, f"{summary} (layer {layer}: back to {value:.2f})", strength)
        finding.family = f"mod/{layer}"
        return finding
