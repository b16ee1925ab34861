"""RL's health (`trimtab rl`, docs/rl.md): monitors of the groups that teach nothing (rl_signal),
of the verifier failing (rl_verifier: rl_verifier.py), of the policy's entropy collapsing (rl_entropy), of
responses running to the length budget (rl_length), of the training reward parting from the
held-out one (rl_hacking) and of rollouts too far off the policy trained (rl_ratio), and their
remedies.

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

The rules whose remedy rolls back (rl_length, rl_hacking, rl_reward) spend the rollbacks of the
open incident, not the run's (orchestrator.max_rollbacks per incident; the Policy counts them:
policy.py, RLIncident): a fall healed long ago does not take a later one's rollback.
"""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, Rolling, StepMetrics
from trimtab.orchestrator.remedies import Remedy, lr_cut
from trimtab.orchestrator.rl_reward import reward_remedy
from trimtab.orchestrator.rl_stats import poisoned
from trimtab.orchestrator.rl_verifier import verifier_remedy

# rules whose remedy may roll back: their findings keep RL's incident open (policy.py: RLIncident)
ROLLING_BACK = ("rl_length", "rl_hacking", "rl_reward")


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
    KEPT_ON_ROLLBACK = ("acted_at",)

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

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k != "failing"}  # config, not state

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
        self.window, self.solved, self.sampled = (Rolling(self.cfg.window) for _ in range(3))  # fresh after the remedy
        self.acted_at = m.step
        summary = (
            f"{share:.0%} of the groups of the last {self.cfg.window} steps earned one reward for every "
            f"response ({solved:.0%} all at the full reward; threshold {self.cfg.threshold:.0%}): no advantage, "
            "no gradient"
        )
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


class EntropyCollapse(Monitor):
    """The sampled tokens' entropy over `window` steps against the phase's first `window` steps
    (the starting policy's): below `threshold` x that while the reward is under `solved`, the
    policy has stopped exploring before it has learned. Evidence: both entropies, the reward."""

    rule, family = "rl_entropy", "rl"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_entropy
        self.start: list[float] = []  # the phase's first window of entropies
        self.window: list[tuple[float, float]] = []  # (entropy, reward) of the last steps

    def observe(self, m: StepMetrics) -> Finding | None:
        rl, rule = m.rl or {}, self.cfg
        # a NaN is no collapse: rollouts of non-finite weights (rule nonfinite's to roll back) read entropy NaN, which
        # compared as no higher than the start's and turned the bonus on (weights_nan@17, kept after the rollback)
        if rl.get("entropy") is None or poisoned(rl):
            return None
        if len(self.start) < rule.window:
            self.start.append(rl["entropy"])
            return None
        self.window = [*self.window, (rl["entropy"], rl["reward"])][-rule.window :]
        entropy = sum(e for e, _ in self.window) / len(self.window)
        reward = sum(r for _, r in self.window) / len(self.window)
        start = sum(self.start) / len(self.start)
        if len(self.window) < rule.window or entropy >= rule.threshold * start or reward >= rule.solved:
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
    sqrt(p (1 - p) / n), so `drop` should stand well above it (0.1: two errors at n = 100)."""

    rule, family = "rl_hacking", "rl"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rl_hacking
        self.recent: list[float] = []  # the training reward of the last steps
        self.best: float | None = None
        self.best_step, self.train_at_best, self.since, self.fired = 0, 0.0, 0, 0

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

    def observe_eval(self, step: int, phase: int, held_out: float) -> Finding | None:
        rule = self.cfg
        train = sum(self.recent) / len(self.recent) if self.recent else 0.0
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


def remedy(f: Finding, view: Any, cfg: OrchestratorConfig, *, rollbacks: int = 0) -> Remedy:
    """rl_signal: dynamic sampling, then a higher sampling temperature; rl_verifier: a longer
    verifier timeout; rl_entropy: an entropy bonus, then a lower LR; rl_length: the soft
    overlong penalty, then a wider one; rl_hacking: back to the best policy, then stop; rl_reward: back
    to the policy before the fall began with a smaller LR (orchestrator/rl_reward.py); at a
    ceiling (or a verifier that raises), a word for a person; a verifier that raises on nearly
    every response stops the run. `rollbacks`: those the open incident spent (ROLLING_BACK's)."""
    if f.rule == "rl_verifier":
        return verifier_remedy(f, view, cfg)
    if f.rule == "rl_entropy":
        return _entropy_remedy(view, cfg)
    if f.rule == "rl_length":
        return _length_remedy(f, view, cfg, rollbacks)
    if f.rule == "rl_hacking":
        return _hacking_remedy(f, view, cfg, rollbacks)
    if f.rule == "rl_ratio":
        return _ratio_remedy(view, cfg)
    if f.rule == "rl_reward":
        return reward_remedy(f, view, cfg, rollbacks)
    return _signal_remedy(f, view, cfg)


def _signal_remedy(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """Dynamic sampling on; then, for groups flat but not solved, warmer sampling to the ceiling;
    there, or with the groups mostly solved, dynamic sampling goes off once it drew a whole window
    without one group with a signal: it multiplied the step's cost for nothing."""
    rule = cfg.rl_signal
    # every group of a window dynamic sampling drew alone was flat: more draws will not find a signal
    barren = f.evidence["flat_groups"] >= 1.0 and f.evidence.get("dynamic_sampling", 0.0) >= 1.0
    if not view.rl_dynamic_sampling and barren:  # turned off since these steps were drawn: the monitor sees it
        return Remedy(
            action="none",
            reasoning="dynamic sampling drew these flat groups and has been turned off since: nothing to add",
        )
    if not view.rl_dynamic_sampling:
        return Remedy(
            action="set_dynamic_sampling",
            params={"value": "on"},
            reasoning="groups whose responses all earn one reward teach nothing: drop them and draw more prompts "
            "until groups with a signal fill the step (DAPO's dynamic sampling; the policy's samples unchanged)",
        )
    stuck = f.evidence["flat_groups"] - f.evidence.get("solved_groups", 0.0)
    if stuck < rule.threshold and barren:
        return _sampling_off(f, "easy", "harder prompts in rl.prompts, or the run has done its work")
    if stuck < rule.threshold:  # mostly learnt: warmer sampling would only unlearn them
        # the words stay the same while the answer does (the shares are the finding's evidence): a note with
        # each window's shares in it was a new one every window (Deciding folds a repeat by its words)
        return Remedy(
            action="none",
            reasoning="the flat groups are mostly solved (every response earned rl.full_reward; those stuck are under "
            "orchestrator.rl_signal.threshold): the policy has learnt these prompts, and dynamic sampling already "
            "looks for the others; harder prompts (rl.prompts), or the run has done its work",
        )
    now = view.rl_temperature
    value = round(min(rule.max_temperature, now * rule.factor), 4)
    if value <= now and barren:
        hard = "easier prompts in rl.prompts, more samples per prompt (rl.group_size) or a supervised warm start"
        return _sampling_off(f, "hard", f"{hard}; sampling at {now:g} did not spread the answers")
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


def _sampling_off(f: Finding, too: str, fix: str) -> Remedy:
    """Dynamic sampling off: the prompts are too `too` for this policy, which the data mends."""
    drawn, window = f.evidence.get("groups_drawn", 0.0), f.evidence["window"]
    return Remedy(
        action="set_dynamic_sampling",
        params={"value": "off"},
        reasoning=f"dynamic sampling drew {drawn:.0f} groups a step for the last {window} steps and not one had a "
        f"signal ({f.evidence['solved_groups']:.0%} solved): the prompts are too {too} for this policy, and it "
        f"only multiplies each step's generation; turn it off. The data needs changing ({fix}), not the "
        "optimiser; the rule is quiet until the flat share falls below "
        "orchestrator.rl_signal.threshold (`trimtab ctl RUN dynamic-sampling on` to draw again)",
    )


def _ratio_remedy(view: Any, cfg: OrchestratorConfig) -> Remedy:
    """Stale rollouts first (the cheap cause to remove: generate from a newer policy); on-policy
    already, the step moves the policy too far: a lower LR."""
    eta = view.rl_max_staleness
    if eta > 0:
        return Remedy(
            action="set_max_staleness",
            params={"steps": eta // 2},
            reasoning=f"the rollouts, generated up to {eta} steps behind, are too far from the policy trained: the "
            "clip and the importance-weight cap discard most of their tokens' gradient; generate them from a "
            f"newer policy ({eta} -> {eta // 2} steps behind)",
        )
    why = (
        "on-policy rollouts are off the clip range: each update moves the policy further than the trust region "
        "allows (or the generation engine disagrees with the trainer: compare rl/kl at a tiny LR)"
    )
    return _lower_lr(why, view, cfg)


def _entropy_remedy(view: Any, cfg: OrchestratorConfig) -> Remedy:
    """A bonus for entropy in the objective holds the distribution open; doubled while the
    collapse recurs, to the ceiling; then the LR halves (RL collapses fastest at a high LR)."""
    rule, now = cfg.rl_entropy, view.rl_entropy_coef
    value = round(min(rule.max_coef, now * rule.factor if now else rule.coef), 6)
    if value > now:
        return Remedy(
            action="set_entropy_bonus",
            params={"value": value},
            reasoning=f"reward the policy's entropy in the objective ({now:g} -> {value:g} x nats a token) so "
            "it keeps sampling answers it has not settled on; it costs nothing where the entropy is already high",
        )
    why = (
        f"the entropy collapses with the bonus at orchestrator.rl_entropy.max_coef ({now:g}): each update moves "
        "the policy too far onto the answers it already prefers"
    )
    return _lower_lr(why, view, cfg)


def _lower_lr(why: str, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """The LR x orchestrator.lr_cut, down to min_lr_scale; at that floor a word for a person: a cut
    under it is one the run was configured never to take (these rules' x0.5 went on under it before)."""
    factor = lr_cut(cfg.lr_cut, view, cfg)
    if factor is None:
        floor = f"the LR is at its floor (orchestrator.min_lr_scale={cfg.min_lr_scale:g})"
        return Remedy(action="none", reasoning=f"{why}; {floor}: lower optim.lr")
    return Remedy(action="scale_lr", params={"factor": factor}, reasoning=f"{why}; a lower learning rate")


def _length_remedy(f: Finding, view: Any, cfg: OrchestratorConfig, rollbacks: int) -> Remedy:
    """DAPO's soft overlong punishment over the budget's last `buffer` share, then over twice
    that; then, once an incident, back to the last checkpoint before the runaway (the last step whose share
    cut stood within `rise` of the start's) with the penalty kept; then a word for a person.
    The penalty grades every cut response alike, so it teaches ending only
    while some responses still end: measured (tests/test_rl_train.py's task, seeds 0-3), two runs
    whose responses had all run to the budget stayed there through step 48 with it; with it on
    from a policy that still ended, none ran away. Not the overlong filter: it leaves the cut
    responses out of the loss, and with them the only gradient that shortens them (measured: a
    runaway from 2% to 97% cut stayed at 95% with the filter on, penalty or not)."""
    _, buffer = view.rl_overlong
    budget = view.rl_max_new_tokens
    for share in (cfg.rl_length.buffer, min(2 * cfg.rl_length.buffer, 0.75)):
        tokens = min(budget - 1, max(1, round(budget * share)))
        if buffer < tokens:
            return Remedy(
                action="set_overlong_penalty",
                params={"tokens": tokens},
                reasoning=f"responses grow into the budget and are graded unfinished: a reward penalty growing over "
                f"the budget's last {tokens} of {budget} tokens (DAPO's soft overlong punishment) brings their "
                "lengths back under it (the overlong filter goes off: the penalty needs the cut responses trained)",
            )
    before = f.evidence["short_step"]
    if rollbacks < min(1, cfg.max_rollbacks) and view.has_checkpoint(before):
        return Remedy(
            action="rollback",
            params={"to": before},
            reasoning=f"the responses still run to the budget with the penalty over {buffer} of {budget} tokens: "
            "once every response is cut, the penalty grades them all alike and nothing teaches ending. Back to "
            f"the policy of step {before} or before, whose responses still ended as at the start, with the "
            "penalty kept from the start",
        )
    return Remedy(
        action="none",
        reasoning="responses still run to rl.max_new_tokens with the soft overlong penalty over most of the budget"
        + (", after a rollback in this incident" if rollbacks else "")
        + ": the task needs longer answers than the budget (raise rl.max_new_tokens) or the policy repeats itself "
        "(a lower LR, a stronger warm start)",
    )


def _hacking_remedy(f: Finding, view: Any, cfg: OrchestratorConfig, rollbacks: int) -> Remedy:
    """Back to the policy of the best held-out reward with a smaller step, once an incident; again
    within it, or with the LR at its floor (a replay at the same LR repeats the same updates), the
    run stops there: its best policy is in that checkpoint, and more of the same training hacks on."""
    best, factor = f.evidence["best_step"], lr_cut(cfg.lr_cut, view, cfg)
    if rollbacks == 0 and factor is not None:
        return Remedy(
            action="rollback",
            params={"to": best, "lr_factor": factor},
            reasoning=f"the training reward is no longer the task's: restore the policy of the best held-out reward "
            f"(the newest checkpoint at or before step {best}) and train on with a smaller learning rate, "
            "which moves the policy less far towards what the verifier pays for",
        )
    again = "again" if rollbacks else f"with the LR at its floor (orchestrator.min_lr_scale={cfg.min_lr_scale:g})"
    return Remedy(
        action="stop",
        reasoning=f"the held-out reward falls {again} while the training reward rises: more training hacks the "
        f"verifier; the best policy is the checkpoint at or before step {best} (a stricter verifier, "
        "rl.reward, or rl.held_out_reward measuring the task, is the lasting fix)",
    )
