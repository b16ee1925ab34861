"""RL's reward falling below where the policy started (rule rl_reward, `trimtab rl`, docs/rl.md),
and its remedy.

A policy trained to earn a reward that earns markedly less than it did at the start of the phase
is being made worse by its updates: RL's sign of a learning rate far too high (a pretraining LR
typed into an RL run: on the arithmetic task at lr 3e-3, 30x the README's, the training reward
went 0.066 -> 0.007 -> 0 in 15 steps, the entropy collapsed and then exploded, and the held-out
pass@1 fell from 0.14 to 0, while the other RL rules turned knobs that cannot undo it). It is
pretraining's `above_start` for a quantity that should rise.

The monitor compares the verifier's mean score (the reward without the overlong penalty, which
is shaping, not the task) of the last `window` steps with the phase's first `start_steps`: few,
since an LR that far off wrecks the policy within a handful of steps (above, 0.047 -> 0 by step
5; a start of 10 steps held the fall and read 0.015). It fires when the fall is at least `drop`
of the start and stands `sigmas` standard errors clear of the two windows' sampling noise:
Welch's z over the groups' mean scores, since a group's responses answer one prompt and share
its difficulty (the responses one by one would count a window's few dozen prompts as hundreds of
independent draws, and understate the noise up to sqrt(group size) times). The sampling
temperature is not a reason to start again: rule rl_signal warms the sampling when groups go flat,
which a collapsing policy makes them (above, 1.0 -> 1.5 while the reward fell); the evidence
records both temperatures. The overlong penalty is: rule rl_length sets it to trade the verifier's
score of answers that run on for answers that end (a verifier that pays for length pays less by
design): a new penalty starts the line again from its first `start_steps`, and the rule fires only
where the reward trained on (the penalty's included) fell too; it rises as a penalty does its work
(measured, tests/test_rl_train.py's overlong run: a verifier paying for length fell 0.31 -> 0.15 as
the penalty brought the responses cut from 98% to 6%, and the reward trained on rose -0.78 -> -0.02;
the rule, blind to that, rolled back three times and stopped the run). Without a penalty the two
are one. Remedy: back to the policy of the step where the fall began (the last whose window
stood within `sigmas` standard errors of the start), with the LR cut x `lr_factor`; when no
rollback is left (orchestrator.max_rollbacks, per incident: policy.py, RLIncident), the run
stops there (its better policy is in the checkpoints). Measured on the arithmetic run above
(lr 3e-3, 60 steps): the held-out pass@1 ended at 0.094 (0.14 at the start) where the same run
with the rule off ended at 0. The target is not the last step whose window
stood above the line: a window lags a gradual fall, that step's policy already earned below the
line, and each replay at the smaller LR found the same window again, rolling back until
orchestrator.max_rollbacks and stopping (tests/test_rl_reward.py: a fall of 0.02 a step from
0.4, that target step 19 at 0.12, against step 13 at 0.24).
"""

from __future__ import annotations

import math
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics
from trimtab.orchestrator.remedies import GAVE_UP, Remedy

SCORE = ("score_n", "score", "score_sq")  # a step's groups drawn, their mean scores' sum and sum of squares


class RewardFall(Monitor):
    """The verifier's mean score of the last `window` steps against the phase's first
    `start_steps`: fallen by `drop` of the start or more, `sigmas` standard errors clear of the
    noise. Evidence: both means, the z, both temperatures, the step where the fall began (the
    last whose window stood within the noise of the start) and its window's score."""

    rule, family = "rl_reward", "rl"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_reward
        self.temperature: float | None = None  # the start's sampling temperature
        self.overlong_buffer = 0  # the soft overlong penalty the start was scored under (tokens)
        self.start: list[list[float]] = []  # the first `start_steps` steps' SCORE sums
        self.window: list[list[float]] = []  # the last steps'
        # the last step whose window was within the noise of the start (the fall not yet begun):
        # the rollback's target, and that window's mean score
        self.good_step, self.good_score = 0, 0.0
        self.fired = 0  # findings in this run (kept across a rollback)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A rollback restores the windows, not what was decided: a finding after one counts on."""
        fired = self.fired
        super().load_state_dict(state)
        self.fired = max(self.fired, fired)

    def observe(self, m: StepMetrics) -> Finding | None:
        rl, rule = m.rl or {}, self.cfg
        if rl.get("score_n") is None or not rl["score_n"]:
            return None
        seen = [*(rl[k] for k in SCORE), rl["reward"]]
        if rl.get("overlong_buffer", 0) != self.overlong_buffer:  # another objective: its own start
            self.start, self.window, self.overlong_buffer = [], [], rl.get("overlong_buffer", 0)
        if len(self.start) < rule.start_steps:
            self.start.append(seen)
            self.temperature = rl["temperature"]
            self.good_step, self.good_score = m.step, _mean_and_se(self.start)[0]
            return None
        self.window = [*self.window, seen][-rule.window :]
        (start, start_se), (now, now_se) = _mean_and_se(self.start), _mean_and_se(self.window)
        z = (start - now) / max(math.hypot(start_se, now_se), 1e-12)
        # the fall had not begun while the window stood within the noise of the start; the last
        # window above the line is too late a target: in a gradual fall its policy is already
        # below the line, and the replay found the same window again until max_rollbacks
        if z < rule.sigmas:
            self.good_step, self.good_score = m.step, now
        line = (1 - rule.drop) * start
        if len(self.window) < rule.window or now > line:
            return None
        if z < rule.sigmas or _reward(self.window) >= _reward(self.start):
            return None
        evidence = {
            "score": now,
            "start_score": start,
            "reward": _reward(self.window),  # the reward trained on, the overlong penalty included
            "start_reward": _reward(self.start),
            "z": z,
            "window": rule.window,
            "start_temperature": self.temperature,
            "temperature": rl["temperature"],
            "good_step": self.good_step,
            "good_score": self.good_score,
            "times": self.fired + 1,
        }
        self.window, self.fired = [], self.fired + 1
        summary = (
            f"the verifier's mean score over the last {rule.window} steps fell to {now:.3f} from the {start:.3f} "
            f"of the phase's first {rule.start_steps} ({z:.1f} standard errors, "
            f"threshold {rule.sigmas:g}; a fall of {rule.drop:.0%} or more): the updates make the policy worse"
        )
        return self.finding(m, evidence, summary, min(1.0, 0.5 + 0.5 * (1 - now / max(start, 1e-12))))


def _mean_and_se(steps: list[list[float]]) -> tuple[float, float]:
    """The mean group score over the steps and its standard error."""
    n, total, squares = (sum(step[k] for step in steps) for k in range(3))
    mean = total / max(n, 1)
    variance = max(squares / max(n, 1) - mean * mean, 0.0)
    return mean, math.sqrt(variance / max(n, 1))


def _reward(steps: list[list[float]]) -> float:
    """The steps' mean reward trained on (older checkpoints' windows: their verifier score)."""
    return sum(step[3] if len(step) > 3 else step[1] / max(step[0], 1) for step in steps) / max(len(steps), 1)


def reward_remedy(f: Finding, view: Any, cfg: OrchestratorConfig, rollbacks: int) -> Remedy:
    """Back to the last policy that earned its start's reward, with a smaller step; when no
    rollback is left (or none reaches that far back), stop: training on makes the policy worse.
    `rollbacks`: those the open incident spent (max_rollbacks bounds an incident's, not the run's)."""
    rule, before = cfg.rl_reward, f.evidence["good_step"]
    factor = max(rule.lr_factor, cfg.min_lr_scale / max(view.lr_scale, 1e-12))
    why = (
        f"a policy trained to earn the reward earns {f.evidence['score']:.3f} where it started at "
        f"{f.evidence['start_score']:.3f}: each update moves it the wrong way, as an LR far too high for RL does "
        f"(RL's LRs are 10-100x below pretraining's)"
    )
    if factor < 1 and rollbacks < cfg.max_rollbacks and view.has_checkpoint(before):
        good = f.evidence.get("good_score")
        scored = f" ({good:.3f})" if good is not None else ""
        return Remedy(
            action="rollback",
            params={"to": before, "skip_rows": [], "lr_factor": factor},
            reasoning=why + f"; restore the policy of step {before} or before (the last whose window{scored} stood "
            f"within the noise of the start: before the fall began) and train on with the LR x{factor:g}, never to "
            "be given back",
        )
    most = cfg.max_rollbacks
    reason = (
        "the LR is at its floor (orchestrator.min_lr_scale)"
        if factor >= 1
        else f"{rollbacks} rollbacks used on this incident (orchestrator.max_rollbacks={most} per incident)"
        if rollbacks >= cfg.max_rollbacks
        else f"no checkpoint at or before step {before}"
    )
    return Remedy(
        action="stop",
        params={
            "reason": f"the RL reward keeps falling below its start and {reason}: lower optim.lr; the better "
            f"policy is the checkpoint at or before step {before}",
            "exit_code": GAVE_UP,
        },
        reasoning=why + f"; {reason}: stopping keeps the better policy in the checkpoints, training on would not",
    )
