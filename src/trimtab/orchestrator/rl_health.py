"""RL's learning signal (`trimtab rl`, docs/rl.md): a monitor of the groups that teach nothing,
and its remedy.

GRPO's advantage compares the responses of a group: when they all earn the same reward (all right,
or, far more often early on, all wrong) the advantage is 0 and the group contributes no gradient,
"loss 0, nothing learns". The monitor averages the share of such groups over `window` steps and
fires at `threshold` or above. Remedy: the sampling temperature rises by `factor` (up to
`max_temperature`), so a group's answers spread and some differ; at the ceiling, the finding is
said for a person (more samples per prompt, easier prompts, a warmer start).
"""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, Rolling, StepMetrics
from trimtab.orchestrator.remedies import Remedy


class NoLearningSignal(Monitor):
    rule, family = "rl_signal", "rl"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_signal
        self.window = Rolling(self.cfg.window)

    def observe(self, m: StepMetrics) -> Finding | None:
        if m.rl_flat_groups is None:
            return None
        self.window.add(m.rl_flat_groups)
        if len(self.window) < self.cfg.window or self.window.mean() < self.cfg.threshold:
            return None
        share, self.window = self.window.mean(), Rolling(self.cfg.window)  # a fresh window after the remedy
        evidence = {"flat_groups": share, "window": self.cfg.window, "threshold": self.cfg.threshold}
        summary = (
            f"{share:.0%} of the groups of the last {self.cfg.window} steps earned one reward for every "
            f"response (threshold {self.cfg.threshold:.0%}): no advantage, no gradient"
        )
        # 0.5 at the threshold, 1 when every group is flat
        strength = 0.5 + 0.5 * (share - self.cfg.threshold) / max(1 - self.cfg.threshold, 1e-9)
        return self.finding(m, evidence, summary, min(1.0, strength))


def remedy(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """A higher sampling temperature, or a word for a person at the ceiling."""
    rule = cfg.rl_signal
    now = view.rl_temperature
    value = round(min(rule.max_temperature, now * rule.factor), 4)
    if value <= now:
        return Remedy(
            action="none",
            reasoning=f"the sampling temperature is at orchestrator.rl_signal.max_temperature ({now:g}): the groups "
            "still agree, so the prompts are too hard (or too easy) for this policy: more samples per prompt "
            "(rl.group_size), easier prompts, rl.dynamic_sampling, or a supervised warm start",
        )
    return Remedy(
        action="set_rl_temperature",
        params={"value": value},
        reasoning=f"groups whose responses all earn one reward teach nothing: sample warmer ({now:g} -> {value:g}) "
        "so a group's answers spread and some differ; the objective follows the same temperature",
    )
