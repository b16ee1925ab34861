"""RL's health (`trimtab rl`, docs/rl.md): monitors of the groups that teach nothing (rl_signal),
of the verifier failing (rl_verifier: rl_verifier.py), of the policy's entropy collapsing (rl_entropy), of
responses running to the length budget (rl_length), of the training reward parting from the
held-out one (rl_hacking) and of rollouts too far off the policy trained (rl_ratio); their
remedies are rl_remedies.py's.

GRPO's advantage compares the responses of a group: when they all earn the same reward (all right,
or, far more often early on, all wrong) the advantage is 0 and the group contributes no gradient,
"loss 0, nothing learns". The monitor averages the share of such groups over `window` steps and
fires at `threshold` or above. Remedy, gentlest first: dynamic sampling (DAPO: flat groups
dropped, more prompts drawn until groups with a signal fill the step), which leaves the policy's
samples as they are; then, if groups stay flat, the sampling temperature rises by `factor` (up to
`max_temperature`), so a group's answers spread and some differ; at the ceiling, the finding is
said for a person (more samples per prompt, easier prompts, a warmer start), and dynamic sampling
that drew a whole window without a signal goes off (it only multiplied the step's cost). The order is
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
    group_size,
    poisoned,
    start_splits,
    starting_policys,
)


class NoLearningSignal(Monitor):
    """The share of a step's groups whose responses all earned one reward, over `window` steps:
    at `threshold` or more, most prompts teach nothing. Evidence: that share, and the part of it
    solved (every response at rl.full_reward: prompts the policy has learnt), which the remedy
    tells apart from the stuck rest (flat at 0, or at a partial credit). Groups flat because
    their verifications failed (rl_verifier's share of failures or more) are the verifier's
    fault, which sampling does not mend: no finding then (rl_verifier's says it).

    Each step says whether dynamic sampling drew it: once it goes off after drawing groups that
    stayed flat (the remedy's last step, or a person's `trimtab ctl RUN dynamic-sampling off`), the
    rule is quiet until a window's flat share falls below `threshold`: the prompts are too hard or
    too easy for the policy, and turning sampling on again would only draw 4x the groups for
    nothing (measured: 32 groups a step instead of 8 for the rest of a run, 1.5-3.4x the step time)."""

    rule, family = "rl_signal", "rl"
    # A rollback restores the windows with the weights, but not the step of the last finding: its
    # replay up to that step is the evidence already acted on (the same weights, RNG and knobs at
    # first: rule rl_reward's rollback puts the temperature back, and the windows restored held
    # most of that finding's steps), which warmed the sampling again within a step or two, undoing
    # the restore. Past that step the windows start afresh, and a recurrence is found as new.
    # The best held-out count is kept as rule rl_hacking keeps it: the step-0 evaluation is not taken again after a
    # rollback to step 0 (the latest reading goes back with the weights: the collapsed policy's is not the replay's)
    KEPT_ON_ROLLBACK = ("acted_at", "top")

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
        # the policy's health, which tells a collapse from uniform groups at a sound policy (_collapsed): the phase's
        # first `window` steps and the last ones (overlapping while the phase is young: _splits parts them), as rule
        # rl_reward's steps [SCORE..., reward, group size] with their groups with a right response, and their
        # entropies; `own` of the first steps drew the starting policy's rollouts (rl_reward.start_steps at most);
        # the held-out reading of the most problems solved and the latest, [solved, n, step]
        self.min_fall, self.start_steps = cfg.rl_hacking.min_fall, cfg.rl_reward.start_steps
        self.first: int | None = None  # the phase's first step
        self.own, self.steps = 0, 0  # the starting policy's steps, the steps seen
        self.start: list[list[float]] = []
        self.recent: list[list[float]] = []
        self.entropy_start: list[float] = []
        self.entropy = Rolling(self.cfg.window)
        self.top: list[int] = []
        self.held_out: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        config = ("failing", "min_fall", "start_steps")  # not state
        return {k: v for k, v in super().state_dict().items() if k not in config}

    def observe(self, m: StepMetrics) -> Finding | None:
        if (share := (m.rl or {}).get("flat_groups")) is None or poisoned(m.rl):
            return None
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
        self._health(m.step, m.rl)
        if len(self.window) < self.cfg.window or self.window.mean() < self.cfg.threshold:
            self.gave_up = self.gave_up and len(self.window) < self.cfg.window  # signal again: the rule is back
            return None
        if self.failed.mean() >= self.failing or self.gave_up:
            return None
        share, solved = self.window.mean(), self.solved.mean()
        evidence = {
            "flat_groups": share,
            "solved_groups": solved,
            "window": self.cfg.window,
            "threshold": self.cfg.threshold,
            "groups_drawn": self.drawn.mean(),
        }
        if len(self.sampled):  # the share of the window's steps dynamic sampling drew (older batches: unknown)
            evidence["dynamic_sampling"] = self.sampled.mean()
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
        # 0.5 at the threshold, 1 when every group is flat
        strength = 0.5 + 0.5 * (share - self.cfg.threshold) / max(1 - self.cfg.threshold, 1e-9)
        return self.finding(m, evidence, summary, min(1.0, strength))

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
            self.start = self.start if len(self.start) >= self.cfg.window else [*self.start, seen]
            self.recent = [*self.recent, seen][-self.cfg.window :]
        if rl.get("entropy") is not None and math.isfinite(rl["entropy"]):
            if len(self.entropy_start) < self.cfg.window:
                self.entropy_start.append(rl["entropy"])
            self.entropy.add(rl["entropy"])

    def _splits(self, first: list[Any], last: list[Any]) -> list[tuple[list[Any], list[Any]]]:
        """The starts and the steps after each (rl_stats.start_splits)."""
        return start_splits(first, last, self.own, self.steps, self.cfg.window)

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
        falls = [(collapse_z(base, after), _mean(base), _mean(after)) for base, after in parts]  # as rule rl_reward's
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

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k != "start_steps"}  # config, not state

    def observe(self, m: StepMetrics) -> Finding | None:
        rl, rule = m.rl or {}, self.cfg
        # a NaN is no collapse: rollouts of non-finite weights (rule nonfinite's to roll back) read entropy NaN, which
        # compared as no higher than the start's and turned the bonus on (weights_nan@17, kept after the rollback)
        if rl.get("entropy") is None or poisoned(rl):
            return None
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


class LengthRunaway(Monitor):
    """The share of responses cut at rl.max_new_tokens over `window` steps against the phase's
    first `window` steps: at `threshold` or more, and `rise` above where the policy started, the
    responses have grown into the budget and rewards grade unfinished answers. (A budget every
    response fills from the first step is the run's design, a tiny one for a tiny task, not a
    runaway.) Evidence: both shares and the mean lengths."""

    rule, family = "rl_length", "rl"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_length
        self.start: list[tuple[float, float]] = []  # the phase's first window: (truncated share, tokens)
        self.window: list[tuple[float, float]] = []  # the last steps'
        self.short_step = 0  # the last step whose share cut had not risen from the start's: before a runaway

    def observe(self, m: StepMetrics) -> Finding | None:
        rl, rule = m.rl or {}, self.cfg
        if rl.get("truncated") is None or poisoned(rl):
            return None
        seen = (rl["truncated"], rl["response_tokens"])
        if len(self.start) < rule.window:
            self.start.append(seen)
            self.short_step = m.step  # not yet risen `rise` above the start (the rollback's target)
            return None
        start, start_length = (sum(column) / len(self.start) for column in zip(*self.start))
        if rl["truncated"] <= start + rule.rise:
            self.short_step = m.step
        self.window = [*self.window, seen][-rule.window :]
        share, length = (sum(column) / len(self.window) for column in zip(*self.window))
        if len(self.window) < rule.window or share < rule.threshold or share - start < rule.rise:
            return None
        self.window = []
        evidence = {
            "truncated": share,
            "start_truncated": start,
            "response_tokens": length,
            "start_response_tokens": start_length,
            "window": rule.window,
            "short_step": self.short_step,  # the rollback's target
        }
        summary = (
            f"{share:.0%} of the responses of the last {rule.window} steps ran to the length budget without "
            f"ending ({start:.0%} at the start, threshold {rule.threshold:.0%}; {start_length:.1f} -> "
            f"{length:.1f} tokens): their rewards grade unfinished answers"
        )
        strength = 0.5 + 0.5 * (share - rule.threshold) / max(1 - rule.threshold, 1e-9)
        return self.finding(m, evidence, summary, min(1.0, strength))


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


class RewardHacking(Monitor):
    """At each RL evaluation: the held-out reward against its best so far, and the training
    reward of the last `window` steps against its level at that best. Fallen by `drop` or more
    while the training reward rose by `rise` or more, for `patience` evaluations in a row: the
    policy learns what the verifier pays for on the training prompts, not the task (reward
    hacking; or overfitting to the training prompts, which the same sign shows). A drop under the
    held-out set's own noise is not counted: with n prompts, pass@1's standard error is
    sqrt(p (1 - p) / n), so `drop` should stand well above it (0.1: two errors at n = 100).

    The held-out reward's own fall is judged too, whatever the training reward did (_fall): an LR far
    too high collapses both, and a training reward too low to resolve its fall (rule rl_reward) left
    held-out pass@1 to go 14/100 -> 0/100 unanswered. Its reference is the pooled count of the evaluations
    before the fall (the baseline: the last `baseline_readings` in control), not the best one: the best of many
    noisy readings stands above the policy's rate, and two readings in a row 3 errors under it fired in 33% of
    simulated flat runs of 200 evaluations (n = 100, p = 0.14). The fall is sequential (_falling, a CUSUM): its
    readings are pooled, and a pool of `patience` or more readings `min_fall` and `sigmas` standard
    errors below the baseline fires, so a fall whose single readings straddle the bar is caught (14 -> 4, 4, 2 of 100:
    2.5, 2.5, 3.1 errors each, never two in a row at 3; pooled, 3.9 at the third)."""

    rule, family = "rl_hacking", "rl"
    # Orchestrator.on_rollback keeps the best count over the checkpoint's: the rollback's target is that reading's
    # policy, and the step-0 evaluation is not taken again (restored without it, the replay at half the LR read
    # 4/100 as its best, and 1/100 and 2/100 after it as within the noise, on the arithmetic run of _falling)
    KEPT_ON_ROLLBACK = ("top", "base", "run", "readings", "pending", "cusum")

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_hacking
        self.recent: list[float] = []  # the training reward of the last steps
        self.best: float | None = None
        self.best_step, self.train_at_best, self.since, self.fired = 0, 0.0, 0, 0
        # the held-out reading of the most problems solved so far, [solved, of n, step] (the rollback's target); the
        # pooled count of the readings before the fall, [solved, of n] (its baseline); and the fall's readings in a
        # row, pooled, [solved, of n, readings] (_falling)
        self.top: list[int] = []
        self.base: list[int] = []
        self.run: list[int] = [0, 0, 0]
        # the baseline's readings, [solved, of n] each, and the fall's (pending: they join it if it does not go on);
        # Page's CUSUM of the readings' z below the baseline (_falling)
        self.readings: list[list[int]] = []
        self.pending: list[list[int]] = []
        self.cusum = 0.0

    def observe(self, m: StepMetrics) -> Finding | None:
        if (reward := (m.rl or {}).get("reward")) is not None and not poisoned(m.rl):
            self.recent = [*self.recent, reward][-self.cfg.window :]
        return None  # judged at evaluations (observe_eval)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A rollback restores the windows, not what was decided: a second finding after one
        still stops the run."""
        fired = self.fired
        super().load_state_dict(state)
        self.fired = max(self.fired, fired)

    def observe_eval(self, step: int, phase: int, held_out: float, solved: int = 0, n: int = 0) -> Finding | None:
        """`solved` of `n` held-out problems at full reward (pass@1's count; n 0: unknown, no count judged)."""
        train = sum(self.recent) / len(self.recent) if self.recent else 0.0
        z = self._falling(step, solved, n)
        # both at once: the training reward rising is the finer diagnosis (hacking), the remedy the same
        if (hacked := self._hacking(step, held_out, train)) is not None:
            self.run, self.pending, self.cusum = [0, 0, 0], [], 0.0
            return hacked
        return None if z is None else self._fall(step, held_out, solved, n, train, z)

    def _hacking(self, step: int, held_out: float, train: float) -> Finding | None:
        """The held-out reward fallen `drop` from its best as the training reward rose `rise`, `patience` in a row."""
        rule = self.cfg
        if self.best is None or held_out > self.best:
            self.best, self.best_step, self.train_at_best, self.since = held_out, step, train, 0
            return None
        fallen, rose = self.best - held_out, train - self.train_at_best
        self.since = self.since + 1 if fallen >= rule.drop and rose >= rule.rise else 0
        if self.since < rule.patience:
            return None
        self.since, self.fired = 0, self.fired + 1
        evidence = {
            "held_out_reward": held_out,
            "best_held_out_reward": self.best,
            "best_step": self.best_step,
            "train_reward": train,
            "train_reward_at_best": self.train_at_best,
            "evaluations": rule.patience,
            "times": self.fired,
        }
        summary = (
            f"the held-out reward fell from {self.best:.3f} (step {self.best_step}) to {held_out:.3f} while the "
            f"training reward rose from {self.train_at_best:.3f} to {train:.3f}, {rule.patience} evaluations in "
            "a row: the policy learns what the verifier pays for on the training prompts, not the task"
        )
        return Finding(rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=1.0)

    def _falling(self, step: int, solved: int, n: int) -> float | None:
        """The held-out count's own fall (docs/rl.md), whatever the training reward did; its z, else None. An LR far
        too high collapses both, and the training reward's fall alone can be too small to resolve: at lr 1e-3 on
        the arithmetic task it went 0.043 -> 0.01 (rule rl_reward: the start's 23 groups "too few to tell") while
        held-out pass@1 went 14/100 -> 0/100. Each reading's z below the baseline (count_fall) feeds Page's one-sided
        CUSUM (Biometrika 1954), S = max(0, S + z - `start_sigmas`): the readings while S > 0 are the fall's, kept
        out of the baseline and pooled, and a pool of `patience` or more readings `min_fall` and `sigmas` standard
        errors below the baseline fires. The baseline is the last `baseline_readings` readings in control, so it
        follows a policy that improved (a fall 0.6 -> 0.45 after a gain 0.3 -> 0.6 was judged against both levels
        pooled, 0.45, and never fired); where a reading had to stand `start_sigmas` (2) below it to start a fall,
        the first readings of a slow decline joined it, which sank with the decline (docs/rl.md: the delays)."""
        rule = self.cfg
        if n <= 0:  # an older caller's reading, without its count
            return None
        if not self.top or solved * self.top[1] > self.top[0] * n:
            self.top = [solved, n, step]
        if self.base:
            z = count_fall(self.base[0], self.base[1], solved, n)
            self.cusum = max(0.0, self.cusum + z - rule.start_sigmas)
            if self.cusum > 0:
                self.pending = [*self.pending, [solved, n]]
                self.run = [self.run[0] + solved, self.run[1] + n, self.run[2] + 1]
                z = count_fall(self.base[0], self.base[1], self.run[0], self.run[1])
                fallen = self.base[0] / self.base[1] - self.run[0] / self.run[1] >= rule.min_fall and z >= rule.sigmas
                return z if fallen and self.run[2] >= rule.patience else None
        # in control: the readings of a fall that did not go on measured the policy's rate too
        kept = self.readings or ([self.base] if self.base else [])  # an older state's baseline: its readings pooled
        readings = [*kept, *self.pending, [solved, n]][-rule.baseline_readings :]
        self.readings, self.pending, self.run = readings, [], [0, 0, 0]
        self.base = [sum(r[0] for r in readings), sum(r[1] for r in readings)]
        return None

    def _fall(self, step: int, held_out: float, solved: int, n: int, train: float, z: float) -> Finding:
        """The finding of the held-out count's fall (_falling), its evidence the two counts and the z."""
        rule, (best, of, at), (k, m), (pooled, pooled_n, readings) = self.cfg, self.top, self.base, self.run
        self.run, self.pending, self.since, self.fired, self.cusum = [0, 0, 0], [], 0, self.fired + 1, 0.0
        evidence = {
            "kind": "held_out_fall",
            "held_out_solved": solved,
            "held_out_n": n,
            "fall_solved": pooled,  # the fall's readings pooled (_falling), against the baseline's
            "fall_n": pooled_n,
            "baseline_solved": k,
            "baseline_n": m,
            "best_solved": best,
            "best_n": of,
            "best_step": at,  # the rollback's target (_hacking_remedy)
            "z": z,
            "held_out_reward": held_out,
            "train_reward": train,
            "evaluations": readings,
            "times": self.fired,
        }
        summary = (
            f"held-out pass@1 fell to {pooled}/{pooled_n} over the last {readings} evaluations (the latest "
            f"{solved}/{n}) from {k}/{m} before them (best {best}/{of} at step {at}), {z:.1f} standard errors "
            f"(threshold {rule.sigmas:g}), with the training reward at {train:.3f}: the updates make the policy "
            "worse at the task"
        )
        strength = min(1.0, 0.5 + 0.5 * (z - rule.sigmas) / rule.sigmas)
        return Finding(
            rule=self.rule, family=self.family, step=step, evidence=evidence, summary=summary, strength=strength
        )


def count_fall(k1: int, n1: int, k2: int, n2: int) -> float:
    """The z of a fall from k1 of n1 to k2 of n2 solved: the two-proportion score test, its standard error at
    the pooled rate (the rate the two share if nothing fell; Agresti, Categorical Data Analysis, 3.1.3);
    0 where the pooled rate is 0 or 1 (no variance: nothing solved, or everything, in both)."""
    pooled = (k1 + k2) / (n1 + n2)
    if pooled <= 0 or pooled >= 1:
        return 0.0
    return (k1 / n1 - k2 / n2) / math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))


def held_out_counts(metrics: dict[str, Any]) -> dict[str, int]:
    """An RL evaluation's problems solved and its problems (rl/batches.py, evaluate), for rule rl_hacking's
    test of a fall; {} where the evaluation has no count (an older run's figures)."""
    n = int(metrics.get("rl/held_out_n", 0))
    if n <= 0 or "rl/held_out_pass@1" not in metrics:
        return {}
    return {"solved": round(metrics["rl/held_out_pass@1"] * n), "n": n}
