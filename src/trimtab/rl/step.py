"""An RL step's batch (`RolloutBatch`: its rollouts, rewards and advantages, the counts the
orchestrator's RL rules read) and its micro-batches (`PolicyMicroBatch`: a micro-batch with the
policy's fields), as rl/batches.py's `RolloutLoader` makes them; the figures drawn from its counts.

Shape legend: B sequences in a micro-batch, T its longest prompt + response - 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trimtab.data.batches import MicroBatch, StepBatch
from trimtab.rl.loss import PolicyTerms
from trimtab.rl.rollout import Rollout


def flat(rewards: list[float]) -> bool:
    """A group whose responses all earned one reward: advantage 0, nothing to learn."""
    return max(rewards) == min(rewards)


def fill_failed(rewards: list[float], failed: set[int], group_size: int) -> list[float]:
    """Each failed verification's reward (it timed out, raised, returned no number) set to the mean
    of its group's verified ones, so its advantage is 0 under every baseline and the others' are
    taken against what was verified: scored 0, a right response the verifier could not read was
    trained as a wrong one (a verifier raising on answers that begin with 1 taught the policy away
    from right answers that begin with 1). A group none of whose responses was verified: 0 each."""
    out = list(rewards)
    for start in range(0, len(out), group_size):
        group = range(start, min(start + group_size, len(out)))
        verified = [out[j] for j in group if j not in failed]
        for j in (j for j in group if j in failed):
            out[j] = sum(verified) / len(verified) if verified else 0.0
    return out


def solved(groups: list[list[float]], full: float) -> int:
    """Of the groups' rewards, those every response of which earned the full reward (rl.full_reward):
    prompts the policy has learnt. Nothing to learn there either, but warmer sampling would only
    unlearn them, where a group flat at 0 or at a partial credit needs it (rule rl_signal)."""
    return sum(min(g) >= full for g in groups)


@dataclass
class PolicyMicroBatch(MicroBatch):
    old_logprobs: torch.Tensor = None  # fp32 [B, T]: the behaviour policy's, at each target (0 elsewhere)
    advantage: torch.Tensor = None  # fp32 [B]: each response's
    weights: torch.Tensor = None  # fp32 [B, T]: each target's weight in the step's sum (rl/loss.py)
    experts: torch.Tensor | None = None  # long [B, T, MoE layers, k]: generation's routing, replayed (rl/replay.py)
    # fp32 [B]: each response's sampling temperature (Rollout.temperature): the objective evaluates
    # the policy at it, not at the knob as it is now (a batch queued ahead was drawn before a change)
    temperature: torch.Tensor = None
    depth: torch.Tensor | None = None  # bool [B, T, MoD layers]: generation's decisions, replayed likewise
    # n_targets: this micro-batch's part of the step's normaliser (its response tokens under token_mean)


# A step's counts, summed over the data-parallel ranks (RolloutLoader.all_sum): the groups drawn
# and those with one reward for every response, of these the solved ones (all at rl.full_reward),
# the responses scored (dynamic sampling's extra draws included), their rewards' sum, the groups'
# mean verifier scores (the rewards less the overlong penalty) summed and squared, the responses'
# sampling temperatures summed; the verifications failed and timed out; of the responses trained,
# their number, entropies, truncations and tokens
SUMS = (
    "groups",
    "flat",
    "solved",
    "verified",
    "reward",
    "score",
    "score_sq",
    "temperature",
    "failures",
    "timeouts",
    "rollouts",
    "entropy",
    "truncated",
    "tokens",
)
# the objective's sums the figures read (rl/loss.py PolicyTerms), with their token weight
TERMS = ("clipped", "kl", "off_policy", "kl_ref", "behaviour_weight", "behaviour_capped")


@dataclass
class RolloutBatch(StepBatch):
    # group_size consecutive ones a prompt; no tensors (a hook's seal need not walk them)
    rollouts: list[Rollout] = field(default_factory=list, metadata={"sealed": False})
    advantage: list[float] = field(default_factory=list)  # each rollout's
    rewards: list[float] = field(default_factory=list)
    sums: dict[str, float] = field(default_factory=dict)  # SUMS, every rank's
    terms: list[PolicyTerms] = field(default_factory=list)  # the objective's sums, filled by the trainer
    totals: dict[str, Any] = field(default_factory=dict)  # TERMS over the micro-batches and ranks (settle)
    staleness: float = 0.0  # optimizer steps from the rollouts' policy to the one trained (mean)
    verifier_error: str = ""  # this rank's last verification that raised or died, this step (rl_verifier)
    normaliser: float = 0.0  # the step's, every rank's responses (rl/loss.py)
    overlong_buffer: int = 0  # the soft overlong penalty the rewards carry, in tokens (rule rl_length's knob)
    # seconds the longest verification that gave its verdict took (rule rl_verifier: a slow verifier or
    # hangs?), the longest of every rank's; kept out of `sums`: a time, not a count
    slowest: float = -1.0
    # whether dynamic sampling drew this step (rule rl_signal: what it found; None: a checkpoint's older batch)
    dynamic_sampling: bool | None = None
    # the built-in task's digits the prompts were drawn at (rl/curriculum.py; 0: a file's task, or an older batch)
    difficulty: int = 0
    # the difficulty a raise past which did not fit model.max_seq_len (rl/curriculum.py; 0: none found)
    top: int = 0

    @property
    def health(self) -> dict[str, Any]:
        """The step's figures the orchestrator's RL rules read (orchestrator/rl_health.py), every
        rank's: the share of the groups drawn that teach nothing (rl_signal), the verifications
        scored, failed and timed out (rl_verifier), the sampled tokens' entropy against the mean
        reward (rl_entropy), the share of responses cut at the budget (rl_length), and once
        trained, the share of tokens whose rollouts' policy is off the clip range (rl_ratio).
        rl_signal also reads the groups drawn and whether dynamic sampling drew them."""
        figures = step_figures(self.sums)
        figures["groups_drawn"] = self.sums["groups"]
        if self.dynamic_sampling is not None:
            figures["dynamic_sampling"] = self.dynamic_sampling
        if self.difficulty:  # a curriculum's step starts the rules' baselines again (rl_health, rl_reward)
            figures["difficulty"] = self.difficulty
        if self.top:  # rule rl_signal's ceiling short of orchestrator.rl_signal.max_difficulty (rl_remedies.py)
            figures["top_difficulty"] = self.top
        figures["verifications"] = tuple(int(self.sums[k]) for k in ("verified", "failures", "timeouts"))
        if self.verifier_error:
            figures["verifier_error"] = self.verifier_error
        if self.slowest >= 0:  # a checkpoint's older batches: unknown
            figures["slowest_verification"] = self.slowest
        if "score" in self.sums:  # rl_reward's, per group (a checkpoint's older batches: none)
            figures |= {"score_n": self.sums["groups"], "score": self.sums["score"], "score_sq": self.sums["score_sq"]}
            figures["temperature"] = round(self.sums["temperature"] / max(self.sums["verified"], 1), 6)
            figures["overlong_buffer"] = self.overlong_buffer
        if self.totals:  # one host read
            weight = max(float(self.totals["weight"]), 1e-12)
            figures |= {k: float(self.totals[k]) / weight for k in ("off_policy", "kl")}
            figures["staleness"] = self.staleness
        return figures

    def settle(self, over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After the step's objective: its TERMS summed over the micro-batches and, by
        `over_ranks`, the data-parallel ranks, with their token weight, on device (no host read)."""
        names = [k for k in TERMS if getattr(self.terms[0], k) is not None]
        device = self.terms[0].objective.device
        weight = sum(m.weights.sum() for m in self.micro).to(device)
        summed = over_ranks(torch.stack([sum(getattr(t, k) for t in self.terms) for k in names] + [weight]))
        self.totals = dict(zip([*names, "weight"], summed))
        self.totals["ratio_max"] = torch.stack([t.ratio_max for t in self.terms]).max()  # this rank's


def step_figures(sums: dict[str, float]) -> dict[str, float]:
    """Shares and means from SUMS (one step's, or a log window's added)."""
    n = max(sums["rollouts"], 1)
    return {
        "flat_groups": sums["flat"] / max(sums["groups"], 1),
        "solved_groups": sums.get("solved", 0) / max(sums["groups"], 1),  # a checkpoint's older batches: none
        "reward": sums["reward"] / max(sums["verified"], 1),
        "entropy": sums["entropy"] / n,
        "truncated": sums["truncated"] / n,
        "response_tokens": sums["tokens"] / n,
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that k of n sampled responses, c of them right, hold a right one: Chen et al.
    2021's unbiased estimator 1 - C(n - c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def overlong_penalty(length: int, budget: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to `budget` (max_new_tokens)
    - `buffer` tokens, then falling linearly to -1 at the budget (0 with no buffer)."""
    start = budget - buffer
    if not buffer or length <= start:
        return 0.0
    return (start - length) / buffer


BATCH_FIELDS = (
    "n_tokens",
    "rows",
    "advantage",
    "rewards",
    "sums",
    "verifier_error",
    "overlong_buffer",
    "slowest",
    "dynamic_sampling",
    "difficulty",
)


def batch_state(batch: RolloutBatch) -> dict[str, Any]:
    """A generated step (before its micro-batches are cut) as JSON holds it."""
    return {**{k: getattr(batch, k) for k in BATCH_FIELDS}, "rollouts": [r.state_dict() for r in batch.rollouts]}


def batch_from_state(state: dict[str, Any]) -> RolloutBatch:
    rollouts = [Rollout.from_state(r) for r in state["rollouts"]]
    fields = {k: state[k] for k in BATCH_FIELDS if k in state}  # older checkpoints' batches: fewer fields
    return RolloutBatch([], 0, rollouts=rollouts, **fields)
