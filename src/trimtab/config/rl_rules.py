"""The orchestrator's rules of an RL run (`trimtab rl`, docs/rl.md): the sub-sections
orchestrator.rl_signal, rl_verifier, rl_entropy, rl_length, rl_ratio, rl_hacking and rl_reward,
and their checks. Apart from config/orchestrator.py (OrchestratorConfig holds them) so that the
section's own module stays the rules every run has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trimtab.config.checks import Section, _check, _positive

if TYPE_CHECKING:
    from trimtab.config.orchestrator import OrchestratorConfig


@dataclass
class RLSignalRule(Section):
    """RL's learning signal (`trimtab rl`, docs/rl.md): when the share of groups whose responses
    all earned the same reward (advantage 0: no gradient) averages `threshold` or more over
    `window` steps, dynamic sampling turns on (flat groups dropped, more prompts drawn: the
    policy's samples unchanged); if groups stay flat with it, the sampling temperature rises by
    `factor`, up to `max_temperature`, so a group's answers differ; at the ceiling the rule says
    so for a person (more samples per prompt, easier prompts, a warmer start), and once dynamic
    sampling drew a whole window there without a signal, stops the run (exit 3: the prompts are too
    hard) or, the groups solved (too easy), turns it off, quiet until the flat share falls below
    `threshold`. Mostly solved (`threshold` of the groups or more), the built-in task is raised a digit, up to
    `max_difficulty` (rl/curriculum.py), where a file's stops as learned (exit 0); half solved, half stuck is no
    learned task (docs/rl.md). A starting policy whose first rollouts earn no reward at all is said at step 1.
    The ceiling is low: a weak policy sampled at 2.0 lost its held-out pass@1 (0.15 to 0.005, docs/rl.md). Groups flat
    because the policy collapsed (every response fails: held-out pass@1 or the training score fallen
    `collapse_sigmas` standard errors from where it was, the entropy risen to `entropy_rise` x the
    starting policy's, or an RL rollback's incident open) are left to rules rl_reward and
    rl_hacking: warmer sampling does not mend a broken policy."""

    enabled: bool = True
    window: int = 5
    threshold: float = 0.75
    factor: float = 1.25
    max_temperature: float = 1.5
    collapse_sigmas: float = 2.0
    entropy_rise: float = 1.5
    # the built-in task's digits a curriculum raises it to at most (rl/curriculum.py): learned there, the run stops
    max_difficulty: int = 6


@dataclass
class RLVerifierRule(Section):
    """RL's verifier (`trimtab rl`, docs/rl.md): when `threshold` or more of the verifications of
    the last `window` steps failed (timed out, raised, or their process died: reward 0 each), a
    storm mostly of timeouts raises rl.verifier_timeout_s by `factor`, up to `max_timeout_s` (a
    slow verifier or a loaded machine); one of errors is said for a person (the verifier itself
    is broken: its rewards are not the task's), and where errors are `stop_share` or more of the
    verifications, the run stops (exit 3): no response can earn a reward, nothing is learned."""

    enabled: bool = True
    window: int = 3
    threshold: float = 0.1
    factor: float = 2.0
    max_timeout_s: float = 120.0
    stop_share: float = 0.9


@dataclass
class RLEntropyRule(Section):
    """RL's entropy (`trimtab rl`, docs/rl.md): when the sampled tokens' mean entropy over
    `window` steps falls below `threshold` x the starting policy's (its steps, as rl_signal's) while
    the mean reward stays under `solved` (a solved task may well be answered one way), the policy
    is collapsing onto few answers before it has learned the task: exploration ends and the
    gradient with it (DAPO, Yu et al. 2025, sec. 3.1). Remedy: an entropy bonus in the objective
    at `coef`, multiplied by `factor` while it recurs, up to `max_coef`; then the learning rate
    halved (a collapse the bonus cannot hold is usually an LR too high for RL)."""

    enabled: bool = True
    window: int = 5
    threshold: float = 0.25
    solved: float = 0.9
    coef: float = 0.01
    factor: float = 2.0
    max_coef: float = 0.05


@dataclass
class RLLengthRule(Section):
    """RL's response length (`trimtab rl`, docs/rl.md): when `threshold` or more of the
    responses of the last `window` steps ran to rl.max_new_tokens without ending, `rise` more
    than in the starting policy's rollouts (rl_reward.start_steps at most), the responses have
    grown into the budget and their rewards grade unfinished answers (a length runaway). Remedy:
    DAPO's soft overlong penalty over the last `buffer` of the budget (a share of
    rl.max_new_tokens), then over twice that, so lengths come back under it; then a rollback to
    the policy whose responses still ended, then with a lower LR; with no rollback left, the run
    stops (exit 3) once the runaway has been found `patience` windows in a row (raise
    rl.max_new_tokens if the task needs longer answers)."""

    enabled: bool = True
    window: int = 5
    threshold: float = 0.5
    rise: float = 0.25
    buffer: float = 0.25
    patience: int = 3


@dataclass
class RLRatioRule(Section):
    """RL's importance ratios (`trimtab rl`, docs/rl.md): when, in every one of `window` steps,
    `threshold` or more of the response tokens have pi / pi_behaviour outside the clip range (the
    policy that generated the rollouts too far from the one trained: stale asynchronous
    rollouts, an LR that moves the policy too far a step, or the generation engine disagreeing
    with the trainer), the objective's clip and the importance-weight cap discard most of the
    step. Remedy: asynchronous rollouts' staleness halved (rl.max_staleness, to 0: synchronous);
    synchronous, the learning rate cut (orchestrator.lr_cut)."""

    enabled: bool = True
    window: int = 3
    threshold: float = 0.2


@dataclass
class RLHackingRule(Section):
    """Reward hacking (`trimtab rl`, docs/rl.md): at each evaluation, when the held-out reward
    (rl.held_out_reward's verifier, else rl.reward's) has fallen `drop` or more below its best
    while the training reward of the last `window` steps rose `rise` or more above its level at
    that best, for `patience` evaluations in a row, the run rolls back to the best held-out
    policy with the learning rate cut (orchestrator.lr_cut); a second time, it stops there. The held-out
    pass@1's own fall, whatever the training reward did, is answered alike: the readings while Page's CUSUM of
    their standard errors below the baseline (the pooled count of the last `baseline_readings` readings in
    control), less `start_sigmas` each, stays above 0 are pooled, and `patience` or more of them `min_fall` or
    more and `sigmas` standard errors below it (a two-proportion test of the pooled counts) fire (an LR far too
    high: 14/100 -> 0/100 in 30 steps). Found again after a rollback in its incident, the fall is cut again (the
    LR x orchestrator.rl_reward.lr_factor, back to the best policy) until orchestrator.max_rollbacks or
    orchestrator.min_lr_scale, then it stops."""

    enabled: bool = True
    window: int = 5
    patience: int = 2
    drop: float = 0.1
    rise: float = 0.05
    sigmas: float = 3.75
    start_sigmas: float = 0.5
    min_fall: float = 0.05
    baseline_readings: int = 10


@dataclass
class RLRewardRule(Section):
    """RL's reward below its start (`trimtab rl`, docs/rl.md): when the verifier's mean score of
    the last `window` steps has fallen `drop` or more below the starting policy's (the rollouts
    it generated: step 1's, or the first eta + 1 steps' with rl.max_staleness eta; at most
    `start_steps`), `sigmas` standard errors clear of their sampling noise (over groups), the
    updates make the policy worse (an LR far too high for RL): the run rolls back to the last
    policy above that line with the LR x `lr_factor`; with no rollback left, it stops."""

    enabled: bool = True
    start_steps: int = 3
    window: int = 10
    drop: float = 0.5
    sigmas: float = 2.5
    lr_factor: float = 0.1


@dataclass
class DPOHeldOutRule(Section):
    """DPO's held-out preference loss (`trimtab dpo`, docs/rl.md): `rise` or more above its lowest reading for
    `patience` evaluations in a row, the held-out accuracy no higher than at that best, the run rolls back to the
    best reading's policy with the LR x orchestrator.rl_reward.lr_factor; with no rollback left, it stops. So too
    the chosen responses' mean log(pi / pi_ref) `displacement` nats or more below 0 at no more than chance accuracy
    (likelihood displacement, Razin et al. 2024: both responses pushed down, neither ranked better)."""

    enabled: bool = True
    rise: float = 0.05
    displacement: float = 5.0
    patience: int = 2


def check_rl_rules(o: OrchestratorConfig) -> None:
    """The RL rules' checks, in the order OrchestratorConfig.validate makes them."""
    _positive(o.rl_signal, "orchestrator.rl_signal", "window", "max_temperature")
    _check(0 < o.rl_signal.threshold <= 1, "orchestrator.rl_signal.threshold", "must be in (0, 1]")
    _check(o.rl_signal.factor > 1, "orchestrator.rl_signal.factor", "must be > 1 (it raises the temperature)")
    _positive(o.rl_signal, "orchestrator.rl_signal", "collapse_sigmas")
    _check(o.rl_signal.max_difficulty >= 1, "orchestrator.rl_signal.max_difficulty", "must be >= 1 (digits)")
    _check(o.rl_signal.entropy_rise > 1, "orchestrator.rl_signal.entropy_rise", "must be > 1 (a rise of the entropy)")
    _positive(o.rl_verifier, "orchestrator.rl_verifier", "window", "max_timeout_s")
    _check(0 < o.rl_verifier.threshold <= 1, "orchestrator.rl_verifier.threshold", "must be in (0, 1]")
    _check(o.rl_verifier.factor > 1, "orchestrator.rl_verifier.factor", "must be > 1 (it raises the timeout)")
    _check(0 < o.rl_verifier.stop_share <= 1, "orchestrator.rl_verifier.stop_share", "must be in (0, 1]")
    _positive(o.rl_entropy, "orchestrator.rl_entropy", "window", "coef", "max_coef")
    _check(0 < o.rl_entropy.threshold < 1, "orchestrator.rl_entropy.threshold", "must be in (0, 1)")
    _check(o.rl_entropy.factor > 1, "orchestrator.rl_entropy.factor", "must be > 1 (it raises the bonus)")
    _positive(o.rl_length, "orchestrator.rl_length", "window", "rise", "patience")
    _check(0 < o.rl_length.threshold <= 1, "orchestrator.rl_length.threshold", "must be in (0, 1]")
    _check(0 < o.rl_length.buffer < 1, "orchestrator.rl_length.buffer", "must be in (0, 1) of the budget")
    _positive(o.rl_hacking, "orchestrator.rl_hacking", "window", "patience", "drop", "sigmas", "start_sigmas")
    _positive(o.rl_hacking, "orchestrator.rl_hacking", "min_fall", "baseline_readings")
    _positive(o.rl_ratio, "orchestrator.rl_ratio", "window")
    _check(0 < o.rl_ratio.threshold <= 1, "orchestrator.rl_ratio.threshold", "must be in (0, 1]")
    _positive(o.rl_reward, "orchestrator.rl_reward", "start_steps", "window", "sigmas")
    _check(0 < o.rl_reward.drop <= 1, "orchestrator.rl_reward.drop", "must be in (0, 1]")
    _check(0 < o.rl_reward.lr_factor < 1, "orchestrator.rl_reward.lr_factor", "must be in (0, 1)")
    _check(o.rl_hacking.rise >= 0, "orchestrator.rl_hacking.rise", "must be >= 0")
    _positive(o.dpo_held_out, "orchestrator.dpo_held_out", "rise", "displacement", "patience")
