"""RL's health (`trimtab rl`, docs/rl.md): monitors of the groups that teach nothing (rl_signal)
and of the verifier failing (rl_verifier), and their remedies.

GRPO's advantage compares the responses of a group: when they all earn the same reward (all right,
or, far more often early on, all wrong) the advantage is 0 and the group contributes no gradient,
"loss 0, nothing learns". The monitor averages the share of such groups over `window` steps and
fires at `threshold` or above. Remedy, gentlest first: dynamic sampling (DAPO: flat groups
dropped, more prompts drawn until groups with a signal fill the step), which leaves the policy's
samples as they are; then, if groups stay flat, the sampling temperature rises by `factor` (up to
`max_temperature`), so a group's answers spread and some differ; at the ceiling, the finding is
said for a person (more samples per prompt, easier prompts, a warmer start). The order is
measured: on the built-in arithmetic task from a weak warm start (held-out pass@1 0.15), raising
the temperature to 2.0 took pass@1 to 0.005 in 100 steps, where dynamic sampling took it to 0.19
(docs/rl.md).
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


class VerifierFailures(Monitor):
    """Verifications that fail (time out, raise, or lose their process) score 0 whatever the
    response: past `threshold` of a window's verifications, the rewards are the verifier's, not
    the task's. Evidence: the window's counts by kind."""

    rule, family = "rl_verifier", "rl"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_verifier
        self.window: list[tuple[int, int, int]] = []

    def observe(self, m: StepMetrics) -> Finding | None:
        if m.rl_verifications is None:
            return None
        self.window = [*self.window, m.rl_verifications][-self.cfg.window :]
        scored, failed, timeouts = (sum(column) for column in zip(*self.window))
        share = failed / max(scored, 1)
        if len(self.window) < self.cfg.window or share < self.cfg.threshold:
            return None
        self.window = []  # a fresh window after the remedy
        evidence = {"failed": failed, "timeouts": timeouts, "scored": scored, "share": share, "window": self.cfg.window}
        summary = (
            f"{failed} of the {scored} verifications of the last {self.cfg.window} steps failed ({share:.0%}; "
            f"{timeouts} timed out; threshold {self.cfg.threshold:.0%}): each scored 0 whatever the response"
        )
        strength = 0.5 + 0.5 * (share - self.cfg.threshold) / max(1 - self.cfg.threshold, 1e-9)
        return self.finding(m, evidence, summary, min(1.0, strength))


def remedy(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """rl_signal: a higher sampling temperature; rl_verifier: a longer verifier timeout; or, at
    a ceiling (or a verifier that raises), a word for a person."""
    if f.rule == "rl_verifier":
        return _verifier_remedy(f, view, cfg)
    rule = cfg.rl_signal
    if not view.rl_dynamic_sampling:
        return Remedy(
            action="set_dynamic_sampling",
            params={"value": "on"},
            reasoning="groups whose responses all earn one reward teach nothing: drop them and draw more prompts "
            "until groups with a signal fill the step (DAPO's dynamic sampling; the policy's samples unchanged)",
        )
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
        reasoning=f"groups stay flat with dynamic sampling on: sample warmer ({now:g} -> {value:g}) so a group's "
        "answers spread and some differ; the objective follows the same temperature",
    )


def _verifier_remedy(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """Timeouts: the verifier needs longer (a slow check, a loaded machine), up to the ceiling.
    Errors: the verifier is broken, which no knob of the run mends."""
    rule, now = cfg.rl_verifier, view.rl_verifier_timeout
    if f.evidence["timeouts"] * 2 < f.evidence["failed"]:
        return Remedy(
            action="none",
            reasoning="the verifier raised (or its process died) on most of the failures: their responses "
            "scored 0 for the verifier's fault, not theirs; fix rl.reward's verifier (the journal's events "
            "name each error) and resume from a checkpoint before the failures",
        )
    value = round(min(rule.max_timeout_s, now * rule.factor), 3)
    if value <= now:
        return Remedy(
            action="none",
            reasoning=f"verifications still time out at orchestrator.rl_verifier.max_timeout_s ({now:g} s): the "
            "verifier hangs on these responses (a loop, a blocking call); bound it, or raise the ceiling",
        )
    return Remedy(
        action="set_verifier_timeout",
        params={"value": value},
        reasoning=f"verifications ran past rl.verifier_timeout_s and scored 0: allow longer ({now:g} -> "
        f"{value:g} s) so a slow but sound verification gives its verdict",
    )
