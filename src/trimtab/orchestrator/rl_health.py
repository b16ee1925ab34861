"""RL's health (`trimtab rl`, docs/rl.md): monitors of the groups that teach nothing (rl_signal),
of the verifier failing (rl_verifier: rl_verifier.py), of the policy's entropy collapsing (rl_entropy); of
responses running to the length budget (rl_length) and of rollouts too far off the policy trained (rl_ratio):
rl_rollouts.py;
the held-out watch (rl_hacking) is rl_held_out.py's, their remedies rl_remedies.py's.

GRPO's advantage compares the responses of a group: when they all earn the same reward (all right,
or, far more often early on, all wrong) the advantage is 0 and the group contributes no gradient,
"loss 0, nothing learns". The monitor averages the share of such groups over `window` steps and
fires at `threshold` or above. Remedy, gentlest first: dynamic sampling (DAPO: flat groups
dropped, more prompts drawn until groups with a signal fill the step), which leaves the policy's
samples as they are; then, if groups stay flat, the sampling temperature rises by `factor` (up to
`max_temperature`), so a group's answers spread and some differ; at the ceiling, the finding is
said for a person (more samples per prompt, easier prompts, a warmer start), and dynamic sampling
that drew a whole window there without a signal has spent the remedies: the run stops (exit 3; groups
mostly solved: the task is learned, the built-in one raised a digit (rl/curriculum.py), else a stop with exit 0).
Turned off after it drew flat groups (a person's `ctl`), it stays off, and a window without one group with a
signal walks the same ladder. A starting policy whose first
rollouts earn no reward at all, or a partial credit alone, is said at once (_first_rollouts), with what it means
and the fixes, and stopped there where they prove it. The order is
measured: on the built-in arithmetic task from a weak warm start (held-out pass@1 0.15), raising
the temperature to 2.0 took pass@1 to 0.005 in 100 steps, where dynamic sampling took it to 0.19
(docs/rl.md).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, Rolling, StepMetrics
from trimtab.orchestrator.rl_reward import SCORE, _mean
from trimtab.orchestrator.rl_stats import (
    answered_groups,
    collapse_z,
    count_fall,
    exact_fall,
    group_size,
    poisoned,
    prompts_to_decide,
    start_splits,
    starting_policys,
)

# what mends a policy that earns no learning signal: said at its first rollouts (_first_rollouts) and in the stops
NO_SIGNAL_FIXES = (
    "a stronger starting model (a supervised warm start on the task, train.init_from), easier prompts (rl.prompts), "
    "or more samples a prompt (rl.group_size)"
)


class NoLearningSignal(Monitor):
    """The share of a step's groups whose responses all earned one reward, over `window` steps:
    at `threshold` or more, most prompts teach nothing. Evidence: that share, and the part of it
    solved (every response at rl.full_reward: prompts the policy has learnt), which the remedy
    tells apart from the stuck rest (flat at 0, or at a partial credit). Groups flat because
    their verifications failed (rl_verifier's share of failures or more) are the verifier's
    fault, which sampling does not mend: no finding then (rl_verifier's says it).

    Each step says whether dynamic sampling drew it: once it goes off after drawing groups that
    stayed flat (a person's `trimtab ctl RUN dynamic-sampling off`), it is not turned on again until a window's
    flat share falls below `threshold` (it would only draw 4x the groups for nothing, measured: 32 groups a step
    instead of 8 for the rest of a run, 1.5-3.4x the step time), and the rule is quiet unless a whole window has
    no group with a signal (evidence `sampling_off`: the remedy warms the sampling, then stops)."""

    rule, family = "rl_signal", "rl"
    # A rollback restores the windows with the weights, but not the step of the last finding: its
    # replay up to that step is the evidence already acted on (the same weights, RNG and knobs at
    # first: rule rl_reward's rollback puts the temperature back, and the windows restored held
    # most of that finding's steps), which warmed the sampling again within a step or two, undoing
    # the restore. Past that step the windows start afresh, and a recurrence is found as new.
    # The best held-out count is kept as rule rl_hacking keeps it: the step-0 evaluation is not taken again after a
    # rollback to step 0 (the latest reading goes back with the weights: the collapsed policy's is not the replay's)
    # (and the first rollouts' warning, said once)
    KEPT_ON_ROLLBACK = ("acted_at", "top", "warned")

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_signal
        self.failing = cfg.rl_verifier.threshold
        self.window = Rolling(self.cfg.window)
        self.solved = Rolling(self.cfg.window)
        self.failed = Rolling(self.cfg.window)  # the share of the step's verifications that failed
        self.acted_at = 0  # the step of the last finding (KEPT_ON_ROLLBACK)
        self.sampled = Rolling(self.cfg.window)  # 1 for a step dynamic sampling drew, else 0
        self.drawn = Rolling(self.cfg.window)  # the groups each step drew
        self.sampled_flat = Rolling(self.cfg.window)  # the flat share of the last steps dynamic sampling drew
        self.sampling: bool | None = None  # whether it drew the last step (None: unknown)
        self.gave_up = False  # it went off finding nothing: quiet until the flat share falls below threshold
        self.warned = False  # the starting policy's first rollouts were judged (_first_rollouts): said once a run
        # the policy's health, which tells a collapse from uniform groups at a sound policy (_collapsed): the phase's
        # first `window` steps and the last ones (overlapping while the phase is young: _splits parts them), as rule
        # rl_reward's steps [SCORE..., reward, group size] with their groups with a right response, and their
        # entropies; `own` of the first steps drew the starting policy's rollouts (rl_reward.start_steps at most);
        # the held-out reading of the most problems solved and the latest, [solved, n, step]
        self.min_fall, self.start_steps = cfg.rl_hacking.min_fall, cfg.rl_reward.start_steps
        self.first: int | None = None  # the phase's first step
        self.own, self.steps = 0, 0  # the starting policy's steps, the steps seen
        # the groups with a right response and the groups of every step after the starting policy's, pooled (-1:
        # some step's count unknown): a total collapse against them, not the last `window` steps alone (_collapsed)
        self.since = [0, 0]
        self.start: list[list[float]] = []
        self.recent: list[list[float]] = []
        self.entropy_start: list[float] = []
        self.entropy = Rolling(self.cfg.window)
        self.top: list[int] = []
        self.held_out: list[int] = []
        self.difficulty: int | None = None  # the built-in task's digits (rl/curriculum.py; None: not known)
        self.top_difficulty = 0  # the digits a raise past which did not fit (rl/curriculum.py; 0: none found)

    def state_dict(self) -> dict[str, Any]:
        config = ("failing", "min_fall", "start_steps")  # not state
        return {k: v for k, v in super().state_dict().items() if k not in config}

    def observe(self, m: StepMetrics) -> Finding | None:
        if (share := (m.rl or {}).get("flat_groups")) is None or poisoned(m.rl):
            return None
        if (level := m.rl.get("difficulty")) is not None and level != (self.difficulty or level):
            self._new_task()
        self.difficulty = m.rl.get("difficulty", self.difficulty)
        self.top_difficulty = m.rl.get("top_difficulty", 0)
        if m.step <= self.acted_at:  # a rollback's replay of what the last finding judged (KEPT_ON_ROLLBACK)
            self.window, self.solved, self.failed, self.sampled, self.drawn = (
                Rolling(self.cfg.window) for _ in range(5)
            )
            return None
        self.window.add(share)
        self.solved.add(m.rl.get("solved_groups", 0.0))
        scored, failed, _ = m.rl.get("verifications") or (0, 0, 0)
        self.failed.add(failed / max(scored, 1))
        self.drawn.add(m.rl.get("groups_drawn", 0))
        self._switched(m.rl.get("dynamic_sampling"), share)
        first = not self.steps and not self.start  # the phase's first step: the starting policy's first rollouts
        self._health(m.step, m.rl)
        if first and not self.warned:
            self.warned = True
            if (found := self._first_rollouts(m)) is not None:
                return found
        if len(self.window) < self.cfg.window or self.window.mean() < self.cfg.threshold:
            self.gave_up = self.gave_up and len(self.window) < self.cfg.window  # signal again: the rule is back
            return None
        # gone off after drawing flat groups: quiet, but not where no group of the window had a signal: a person's
        # `ctl dynamic-sampling off` on a barren run left it training on at loss 0 to max_steps (exit 0)
        if self.failed.mean() >= self.failing or (self.gave_up and self.window.mean() < 1.0):
            return None
        share, solved = self.window.mean(), self.solved.mean()
        evidence = {
            "flat_groups": share,
            "solved_groups": solved,
            "window": self.cfg.window,
            "threshold": self.cfg.threshold,
            "groups_drawn": self.drawn.mean(),
        }
        if self.difficulty:  # the built-in task's: a curriculum raises it where the task is learned (rl_remedies.py)
            evidence["difficulty"] = self.difficulty
        if self.top_difficulty:  # a raise past it did not fit model.max_seq_len: the curriculum's ceiling here
            evidence["top_difficulty"] = self.top_difficulty
        if len(self.sampled):  # the share of the window's steps dynamic sampling drew (older batches: unknown)
            evidence["dynamic_sampling"] = self.sampled.mean()
        if self.gave_up:  # off after it drew flat groups (by the rule or a person): not to be turned on again
            evidence["sampling_off"] = True
        if collapsed := self._collapsed():  # the remedy stands down (rl_remedies.py, _signal_remedy)
            evidence["collapsed"] = collapsed
        self.window, self.solved, self.sampled = (Rolling(self.cfg.window) for _ in range(3))  # fresh after the remedy
        self.acted_at = m.step
        summary = (
            f"{share:.0%} of the groups of the last {self.cfg.window} steps earned one reward for every "
            f"response ({solved:.0%} all at the full reward; threshold {self.cfg.threshold:.0%}): no advantage, "
            "no gradient"
        )
        if collapsed:
            summary += f", and the policy reads collapsed (its signs: {', '.join(collapsed)})"
        elif needed := self._prompts_to_decide():
            evidence["prompts_to_decide"] = needed
            summary += (
                f"; the starting policy's few groups with a right response cannot tell a collapse from thin signal: "
                f"rl.prompts_per_step={needed} would"
            )
        # 0.5 at the threshold, 1 when every group is flat
        strength = 0.5 + 0.5 * (share - self.cfg.threshold) / max(1 - self.cfg.threshold, 1e-9)
        return self.finding(m, evidence, summary, min(1.0, strength))

    def _first_rollouts(self, m: StepMetrics) -> Finding | None:
        """The starting policy's first rollouts, every group flat and none solved: said at once, not a window later
        (a 10-step text model on the arithmetic task: pass@1 0/64, every group flat for 20 steps through dynamic
        sampling and warmer sampling, the rule's stop at step 20). At no reward at all (kind no_reward; not where
        step 0's held-out count, where taken, is above 0: greedy answers earn, a signal warmer sampling may find), or
        at a partial credit (kind partial_credit: a group's responses alike in what the verifier pays). Where every
        response of every group earned one reward, and so many that the share of groups with a signal is bounded
        under 1 - `threshold` (_proven), the evidence says `proven`: the stop comes now (rl_remedies.py), not three
        windows on. Not where the verifications failed (rl_verifier's)."""
        rl, failing = m.rl or {}, self.failed.values[-1] >= self.failing
        groups, scored = rl.get("score_n", 0), (rl.get("verifications") or (0,))[0]
        if failing or not groups or rl["flat_groups"] < 1.0 or rl.get("solved_groups", 0.0) > 0:
            return None
        held = self.held_out if rl["score"] <= 0 else []  # greedy's count read for no reward alone
        if held and held[0] > 0:
            return None
        size, mean = round(scored / groups), rl["score"] / groups
        one = rl["score_sq"] / groups - mean * mean <= 1e-9  # the groups' mean scores all alike: one reward for all
        evidence = {"kind": "partial_credit" if mean > 0 else "no_reward", "groups": groups, "group_size": size}
        said = f"none of the {groups * size} responses of its first rollouts ({groups} prompts x rl.group_size {size}"
        said = (
            f"{said}: pass@{size} 0) earned one" if mean <= 0 else f"{said}) earned the full reward, and each group's"
        )
        said += "" if mean <= 0 else f" responses earned one partial credit ({'all' if one else 'a mean'} {mean:.3g})"
        if held:
            evidence |= {"held_out_solved": 0, "held_out_n": held[1]}
            said += f", and held-out pass@1 at step {held[2]} is 0/{held[1]}"
        if one and (bound := self._proven(groups * size + (held[1] if held else 0), size)) is not None:
            evidence |= {"proven": True, "signal_bound": bound}
            said += (
                f"; so many alike that under 1 in {1 / bound:.0f} groups could have a signal (95%), "
                f"under the {1 - self.cfg.threshold:.0%} the rule acts at (1 - orchestrator.rl_signal.threshold)"
            )
        summary = (
            f"the starting policy earns {'a partial credit alone' if mean > 0 else 'no reward at all'}: {said}. "
            f"GRPO's advantage compares the rewards of a group, so every group's is 0 and the steps have no gradient; "
            f"fixes: {NO_SIGNAL_FIXES}"
        )
        return self.finding(m, evidence, summary, 1.0)

    def _new_task(self) -> None:
        """Another difficulty (a curriculum step, rl/curriculum.py): its windows and its starting policy are
        the new task's, not the learned one's (whose solved share and training score would read the harder
        task as a collapse). The held-out readings stay: the held-out problems are the configured task's."""
        self.window, self.solved, self.failed, self.sampled, self.drawn, self.sampled_flat, self.entropy = (
            Rolling(self.cfg.window) for _ in range(7)
        )
        self.gave_up, self.sampling, self.first, self.own, self.steps = False, None, None, 0, 0
        self.since, self.start, self.recent, self.entropy_start = [0, 0], [], [], []

    def _proven(self, alike: int, size: int) -> float | None:
        """The most groups of `size` with a signal that `alike` responses all earning one reward leave likely: where
        none differed, 3 / alike bounds the share that would at 95% (the rule of three, Hanley & Lippman-Hand 1983),
        and a group has a signal unless its `size` all agree; None where that share reaches 1 - `threshold`, the flat
        share the rule acts at (8 x 8 responses alone: 0.32, not proven; with step 0's 0/64 held-out: 0.17)."""
        rate = 3 / max(alike, 1)
        bound = 1 - (1 - rate) ** size - rate**size
        return bound if bound < 1 - self.cfg.threshold else None

    def _switched(self, sampling: bool | None, share: float) -> None:
        """Dynamic sampling's state at this step: gone off after the steps it drew stayed flat
        (at `threshold` or more), the rule gives up until the flat share falls below it."""
        if sampling is None:
            return
        self.sampled.add(float(sampling))
        if sampling:
            self.sampled_flat.add(share)
        elif self.sampling and len(self.sampled_flat):
            self.gave_up = self.sampled_flat.mean() >= self.cfg.threshold
            self.sampled_flat = Rolling(self.cfg.window)
        self.sampling = sampling

    def observe_eval(self, step: int, phase: int, held_out: float, solved: int = 0, n: int = 0) -> Finding | None:
        """An RL evaluation's count of problems solved (core.py; n 0, an older run's, is not read): the latest reading
        and the best so far, which _collapsed compares. Never a finding of its own."""
        if n > 0:
            self.held_out = [solved, n, step]
            if not self.top or solved * self.top[1] > self.top[0] * n:
                self.top = [solved, n, step]
        return None

    def _health(self, step: int, rl: dict[str, Any]) -> None:
        """The step's verifier score and entropy: the phase's first `window` steps kept, and the last `window`."""
        if not self.steps and self.start:  # an older state: its last steps came after its start
            self.steps = len(self.start) + len(self.recent)
        if self.first is None:
            self.first = step - self.steps
        own = starting_policys(self.own, self.steps, self.start_steps, step, self.first, rl.get("staleness", 0.0))
        self.own, self.steps = self.own + own, self.steps + 1
        if rl.get("score_n"):
            seen = [*(rl[k] for k in SCORE), rl["reward"], group_size(rl), answered_groups(rl)]
            if not own and self.since[0] >= 0:
                self.since = [seen[5], 0] if seen[5] < 0 else [self.since[0] + seen[5], self.since[1] + round(seen[0])]
            self.start = self.start if len(self.start) >= self.cfg.window else [*self.start, seen]
            self.recent = [*self.recent, seen][-self.cfg.window :]
        if rl.get("entropy") is not None and math.isfinite(rl["entropy"]):
            if len(self.entropy_start) < self.cfg.window:
                self.entropy_start.append(rl["entropy"])
            self.entropy.add(rl["entropy"])

    def _splits(self, first: list[Any], last: list[Any]) -> list[tuple[list[Any], list[Any]]]:
        """The starts and the steps after each (rl_stats.start_splits)."""
        return start_splits(first, last, self.own, self.steps, self.cfg.window)

    def _prompts_to_decide(self) -> int:
        """The prompts a step needs for _collapsed to read a total collapse against the starting policy's steps
        (rl_stats.prompts_to_decide; 0: it can already, or nothing to tell). Only for 0/1 rewards (answered counts)."""
        parts = self._splits(self.start, self.recent)
        if not parts or any(len(step) <= 5 or step[5] < 0 for step in parts[0][0] + parts[0][1]):
            return 0
        (start, after) = parts[0]
        sigmas = -NormalDist().inv_cdf(NormalDist().cdf(-self.cfg.collapse_sigmas) / len(parts))  # _collapsed's bar
        groups = round(sum(step[0] for step in start))
        answered, later = round(sum(step[5] for step in start)), round(sum(step[0] for step in after))
        later = max(later, self.since[1]) if self.since[0] >= 0 else later  # as _collapse_z pools them
        return prompts_to_decide(answered, groups, later, max(groups // len(start), 1), sigmas)

    def _collapse_z(self, base: list[Any], after: list[Any], part: int) -> float:
        """collapse_z of a start and the steps after it, as rule rl_reward's; against the starting policy's steps
        (part 0), every step since pooled where their counts are known: a start of one step at 8 prompts holds ~2
        groups with a right response at a pass rate of 0.05, and 2 of 8 against the last 5 steps' 0 of 40 reads z 2.0,
        short of the bar, where against steps 2-20's 0 of 152 it reads 2.9. Simulated (8 x 8, Beta-spread prompts at
        0.05, 400 runs): a collapse at step 2 read by step 20 in 49% -> 79% of runs, at step 3 51% -> 60%; false
        readings over 60 sound steps 5.5% -> 4.5% (pass rate 0.02), 5.0% -> 4.5% (0.05)."""
        known = all(len(step) > 5 and step[5] >= 0 for step in base)
        if part or not known or self.since[0] < 0 or self.since[1] <= sum(step[0] for step in after):
            return collapse_z(base, after)
        k1, n1 = round(sum(step[5] for step in base)), round(sum(step[0] for step in base))
        return exact_fall(k1, n1, *self.since)

    def _collapsed(self) -> dict[str, list[float]]:
        """Why the groups read flat because the policy collapsed (every response fails), not because they are uniform
        at a sound policy ({}: they are): held-out pass@1 fallen from its best reading by rl_hacking.min_fall and
        `collapse_sigmas` standard errors of the two counts (count_fall) at the latest evaluation; the training
        score of the last `window` steps fallen to half a start's or less (_splits), `collapse_sigmas` clear of the
        noise over groups (collapse_z); the entropy risen to `entropy_rise` x the starting policy's. The bar is lower
        than rules rl_hacking's and rl_reward's, which roll back: here a false reading only leaves the sampling as it
        is."""
        rule, why = self.cfg, {}
        if self.top and self.held_out:
            (best, of, _), (solved, n, _) = self.top, self.held_out
            z = count_fall(best, of, solved, n)
            if z >= rule.collapse_sigmas and best / of - solved / n >= self.min_fall:
                why["held-out pass@1"] = [best / of, solved / n, z]
        parts = self._splits(self.start, self.recent)
        # either start may read the fall: Bonferroni's bound keeps the chance of a false reading at one test's
        sigmas = -NormalDist().inv_cdf(NormalDist().cdf(-rule.collapse_sigmas) / max(len(parts), 1))
        falls = [(self._collapse_z(base, after, i), _mean(base), _mean(after)) for i, (base, after) in enumerate(parts)]
        if falls := [(z, start, now) for z, start, now in falls if z >= sigmas and now <= start / 2]:
            z, start, now = max(falls)
            why["training reward"] = [start, now, z]
        if parts := self._splits(self.entropy_start, list(self.entropy.values))[:1]:  # the starting policy's
            start, now = (sum(values) / len(values) for values in parts[0])
            if now >= rule.entropy_rise * start:
                why["entropy"] = [start, now]
        return why


class EntropyCollapse(Monitor):
    """The sampled tokens' entropy over `window` steps against the starting policy's (the steps whose rollouts it
    drew, as rule rl_signal takes its start: rl_stats.start_splits): below `threshold` x that while the reward is
    under `solved`, the policy has stopped exploring before it has learned. Evidence: both entropies, the reward.
    The start was the phase's first `window` steps: a collapse inside them was its own baseline (simulated, 2.0 ->
    0.2 nats at step 2: never found; now at step 6, the first full window after the start)."""

    rule, family = "rl_entropy", "rl"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_entropy
        self.start_steps = cfg.rl_reward.start_steps
        self.first: int | None = None  # the phase's first step
        self.own, self.steps = 0, 0  # the starting policy's steps, the steps seen
        self.start: list[float] = []  # the starting policy's entropies
        self.window: list[tuple[float, float]] = []  # (entropy, reward) of the last steps
        self.difficulty: int | None = None  # the built-in task's digits (rl/curriculum.py; None: not known)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k != "start_steps"}  # config, not state

    def observe(self, m: StepMetrics) -> Finding | None:
        rl, rule = m.rl or {}, self.cfg
        # a NaN is no collapse: rollouts of non-finite weights (rule nonfinite's to roll back) read entropy NaN, which
        # compared as no higher than the start's and turned the bonus on (weights_nan@17, kept after the rollback)
        if rl.get("entropy") is None or poisoned(rl):
            return None
        if (level := rl.get("difficulty")) is not None and level != (self.difficulty or level):
            # a curriculum step: the policy that meets the harder task is its start, as rl_signal's (the learned
            # task's sharper policy read, against the first start, as a collapse once the reward fell)
            self.first, self.own, self.steps, self.start, self.window = None, 0, 0, [], []
        self.difficulty = rl.get("difficulty", self.difficulty)
        self._see(m.step, rl)
        parts = start_splits(self.start, self.window, self.own, self.steps, rule.window)[:1]  # the starting policy's
        if not parts or len(parts[0][1]) < rule.window:
            return None
        start = sum(parts[0][0]) / len(parts[0][0])
        entropy, reward = (sum(column) / rule.window for column in zip(*parts[0][1]))
        if entropy >= rule.threshold * start or reward >= rule.solved:
            return None
        self.window = []  # a fresh window after the remedy
        evidence = {"entropy": entropy, "start_entropy": start, "reward": reward, "window": rule.window}
        summary = (
            f"the sampled tokens' entropy fell to {entropy:.3g} nats, {entropy / max(start, 1e-12):.0%} of the "
            f"starting policy's {start:.3g} (threshold {rule.threshold:.0%}), with the reward at {reward:.2f} "
            f"(under {rule.solved:g}): the policy collapses onto few answers before it has learned the task"
        )
        strength = 0.5 + 0.5 * (1 - entropy / max(rule.threshold * start, 1e-12))
        return self.finding(m, evidence, summary, min(1.0, strength))

    def _see(self, step: int, rl: dict[str, Any]) -> None:
        """The step's entropy: into the start while the starting policy drew the rollouts, and the last window."""
        if not self.steps and self.start:  # an older state: its start was the phase's first window
            self.own, self.steps = len(self.start), len(self.start) + len(self.window)
        if self.first is None:
            self.first = step - self.steps
        own = starting_policys(self.own, self.steps, self.start_steps, step, self.first, rl.get("staleness", 0.0))
        self.own, self.steps = self.own + own, self.steps + 1
        self.start = [*self.start, rl["entropy"]] if own else self.start
        self.window = [*self.window, (rl["entropy"], rl["reward"])][-self.cfg.window :]
