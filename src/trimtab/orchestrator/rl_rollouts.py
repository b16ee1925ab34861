"""RL's rollouts out of shape (`trimtab rl`, docs/rl.md): responses running to the length budget (rule
rl_length, LengthRunaway) and rollouts generated too far off the policy trained (rule rl_ratio, OffPolicy); the
other RL monitors are rl_health.py's, their remedies rl_remedies.py's."""

from __future__ import annotations

import math
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics
from trimtab.orchestrator.rl_stats import poisoned, starting_policys


class LengthRunaway(Monitor):
    """The share of responses cut at rl.max_new_tokens over `window` steps against the starting policy's (the steps
    whose rollouts it drew, as rule rl_reward takes its start: rl_stats.starting_policys): at `threshold` or more,
    and `rise` above it, the responses have grown into the budget and rewards grade unfinished answers. (A budget
    every response fills from the first step is the run's design, a tiny one for a tiny task, not a runaway.)
    Evidence: both shares and the mean lengths. The start was the phase's first `window` steps: a runaway begun in
    them was part of its own baseline (measured: 0%, 2%, 59% cut at steps 1-3, a start of 20% at window 3), which
    raised the bar and the target's bound by as much, and the first window judged came after it (found at step 6,
    now at 4)."""

    rule, family = "rl_length", "rl"
    SETTINGS = ("start_steps",)  # rl_reward's, as configured

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_length
        self.start_steps = cfg.rl_reward.start_steps
        self.first: int | None = None  # the phase's first step
        self.own, self.steps = 0, 0  # the starting policy's steps, the steps seen
        self.start: list[tuple[float, float]] = []  # the starting policy's steps: (truncated share, tokens)
        self.window: list[tuple[float, float]] = []  # the last steps'
        self.short_step = 0  # the last policy whose rollouts' share cut had not risen from the start's: the target
        self.rising = False  # the last step's share had risen from the start's: short_step's checkpoint is kept
        self.times = 0  # the windows in a row found since a step's responses last ended (rl_length.patience)

    def observe(self, m: StepMetrics) -> Finding | None:
        rl, rule = m.rl or {}, self.cfg
        if rl.get("truncated") is None or poisoned(rl):
            return None
        seen = (rl["truncated"], rl["response_tokens"])
        if not self.steps and self.start:  # an older state: its start was the phase's first window
            self.own, self.steps = len(self.start), len(self.start) + len(self.window)
        if self.first is None:
            self.first = m.step - self.steps
        own = starting_policys(self.own, self.steps, self.start_steps, m.step, self.first, rl.get("staleness", 0.0))
        self.own, self.steps = self.own + own, self.steps + 1
        if own or not self.start:
            self.start.append(seen)
            # against the start's lowest share: a target set at every step of it may already be running away
            self._short(m, rl, min(share for share, _ in self.start) + rule.rise)
            return None
        start, start_length = (sum(column) / len(self.start) for column in zip(*self.start))
        self._short(m, rl, start + rule.rise)
        self.window = [*self.window, seen][-rule.window :]
        share, length = (sum(column) / len(self.window) for column in zip(*self.window))
        # not where the last step's responses end again (self.rising): the runaway is turning. At lr 1e-2 a replay's
        # 92%, 89%, 0% cut fired, rolled back to step 3 at x0.5, and fired again on the window the checkpoint restored
        # at the replayed step 4 (0% again): the incident's rollbacks spent on a runaway the penalty had mended
        if len(self.window) < rule.window or share < rule.threshold or share - start < rule.rise or not self.rising:
            return None
        self.window, self.times = [], self.times + 1
        evidence = {
            "truncated": share,
            "start_truncated": start,
            "response_tokens": length,
            "start_response_tokens": start_length,
            "window": rule.window,
            "short_step": self.short_step,  # the rollback's target
            "times": self.times,
        }
        summary = (
            f"{share:.0%} of the responses of the last {rule.window} steps ran to the length budget without "
            f"ending ({start:.0%} at the start, threshold {rule.threshold:.0%}; {start_length:.1f} -> "
            f"{length:.1f} tokens): their rewards grade unfinished answers"
        )
        strength = 0.5 + 0.5 * (share - rule.threshold) / max(1 - rule.threshold, 1e-9)
        return self.finding(m, evidence, summary, min(1.0, strength))

    def _short(self, m: StepMetrics, rl: dict[str, Any], bound: float) -> None:
        """A step's share within `bound`: the weights that drew its rollouts, the checkpoint of the step before
        (and `staleness` steps before that), still ended their answers. Not the step's own checkpoint: it holds
        the update on these rollouts, and a rollback to step 3, whose rollouts were 59% cut, replayed from a
        policy whose next were 98% cut and stayed at the budget, penalty kept (tests/test_rl_train.py's task)."""
        self.rising = rl["truncated"] > bound
        if not self.rising:
            self.short_step = max(0, m.step - 1 - math.ceil(rl.get("staleness") or 0.0))
            self.times = 0


class OffPolicy(Monitor):
    """The share of response tokens whose pi / pi_behaviour lies outside the clip range, in every
    step of `window` (a step's own is noise: one sharp token moves it): at `threshold` or more,
    the rollouts' policy is too far from the one trained. Evidence: the mean share, the KL to the
    rollouts' policy, the staleness."""

    rule, family = "rl_ratio", "rl"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_ratio
        self.window: list[tuple[float, float, float]] = []  # the last steps': (share off, kl, staleness)

    def observe(self, m: StepMetrics) -> Finding | None:
        rl, rule = m.rl or {}, self.cfg
        if rl.get("off_policy") is None or poisoned(rl):
            return None
        self.window = [*self.window, (rl["off_policy"], rl["kl"], rl["staleness"])][-rule.window :]
        if len(self.window) < rule.window or min(w[0] for w in self.window) < rule.threshold:
            return None
        share, kl, staleness = (sum(column) / len(self.window) for column in zip(*self.window))
        self.window = []
        evidence = {"off_policy": share, "kl": kl, "staleness": staleness, "window": rule.window}
        summary = (
            f"{share:.0%} of the response tokens of the last {rule.window} steps had pi / pi_behaviour outside the "
            f"clip range (threshold {rule.threshold:.0%}; KL to the rollouts' policy {kl:.3g} a token, rollouts "
            f"{staleness:.1f} steps behind): the objective discards most of their gradient"
        )
        strength = 0.5 + 0.5 * (share - rule.threshold) / max(1 - rule.threshold, 1e-9)
        return self.finding(m, evidence, summary, min(1.0, strength))
