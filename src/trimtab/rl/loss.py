"""The GRPO family's advantages and policy objective, normalised exactly however a step is split.

Advantages (one scalar per response, broadcast over its tokens), from the rewards of a group of
responses to one prompt:
    grpo         (r - mean) / (std + eps) over the group (Shao et al. 2024, DeepSeekMath)
    dr_grpo      r - mean: no division by the std (Liu et al. 2025, "Understanding R1-Zero-Like
                 Training"), which up-weights groups whose rewards barely differ
    rloo         r - the mean of the group's other responses (Ahmadian et al. 2024)
    reinforce++  r - mean over the group, divided by the std over the whole batch (Hu 2025,
                 REINFORCE++ with a baseline)

The objective per token is PPO's clipped surrogate, -min(ratio A, clip(ratio, 1 - eps_low,
1 + eps_high) A) with ratio = pi / pi_old, the clip higher than low above (DAPO, Yu et al. 2025),
less `entropy_coef` x the entropy of the policy's distribution at the token (an entropy bonus,
Williams & Peng 1991; what rule rl_entropy turns on when the policy collapses onto few answers),
plus `kl_coef` x GRPO's estimator of KL(pi || pi_ref) at the token, pi_ref the frozen starting
policy (rl/reference.py; Shao et al. 2024, eq. 4).
With asynchronous rollouts (rl.max_staleness > 0) the objective is decoupled PPO (Hilton et al.
2022, "Batch size-invariance for policy optimization"; AReaL, Fu et al. 2025, eq. 5): the clip
is taken around the proximal policy pi_prox, the one before this step's update, and each token
is weighted by pi_prox / pi_behaviour, the stale rollouts' importance weight, truncated at
rl.behaviour_weight_cap (truncated importance sampling, which also absorbs the generation
engine's numerical mismatch with the trainer). One optimizer step per batch: pi_prox is the
policy the step's forward evaluates, its log-probabilities detached, so the clip never binds and
the gradient is min(w, cap) x A x grad log pi.
The step's loss is sum(weight_t x objective_t) / normaliser, where the weights and the normaliser
are fixed by the whole step (every micro-batch and every rank), so the gradient is the same
however the step is split (the sums are added; the normaliser is global):
    token_mean     weight 1, normaliser: the step's response tokens (DAPO; the default)
    seq_mean       weight 1 / the response's length, normaliser: the step's responses (GRPO)
    constant       weight 1, normaliser: responses x max_new_tokens (Dr. GRPO)

Shape legend: N responses, G responses per group, T response tokens (padded), mask [N, T] true
at a response token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trimtab.config.rl import AGGREGATIONS, BASELINES

EPS = 1e-6


def advantages(rewards: torch.Tensor, baseline: str = "grpo") -> torch.Tensor:
    """rewards [N / G, G] (one row a group) -> advantages [N / G, G]."""
    mean = rewards.mean(dim=1, keepdim=True)
    if baseline == "grpo":
        return (rewards - mean) / (rewards.std(dim=1, keepdim=True, unbiased=True) + EPS)
    if baseline == "dr_grpo":
        return rewards - mean
    if baseline == "rloo":
        G = rewards.shape[1]
        return (rewards - mean) * G / (G - 1)  # r - (sum - r) / (G - 1)
    if baseline == "reinforce++":
        centred = rewards - mean
        return centred / (centred.std(unbiased=True) + EPS)
    raise ValueError(f"baseline '{baseline}': one of {', '.join(BASELINES)}")


def token_weights(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Each response token's weight in the step's sum [N, T] (0 off the responses)."""
    mask = mask.float()
    if aggregation in ("token_mean", "constant"):
        return mask
    if aggregation == "seq_mean":
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1)
    raise ValueError(f"aggregation '{aggregation}': one of {', '.join(AGGREGATIONS)}")


def normaliser(lengths: list[int], aggregation: str, max_new_tokens: int) -> float:
    """The step's normaliser from every response's length (all micro-batches, all ranks)."""
    if aggregation == "token_mean":
        return float(max(sum(lengths), 1))
    if aggregation == "seq_mean":
        return float(max(len(lengths), 1))
    if aggregation == "constant":
        return float(max(len(lengths), 1) * max_new_tokens)
    raise ValueError(f"aggregation '{aggregation}': one of {', '.join(AGGREGATIONS)}")


@dataclass
class PolicyTerms:
    """A micro-batch's sums (0-d tensors, on device; divide by the step's normaliser)."""

    objective: torch.Tensor  # sum of weight x clipped surrogate (what is differentiated)
    clipped: torch.Tensor  # weight of the tokens whose ratio was clipped (the clip fraction's numerator)
    ratio_max: torch.Tensor  # the largest ratio pi / pi_old (an importance-ratio blow-up)
    kl: torch.Tensor  # sum of weight x k3 KL to the old policy (Schulman's estimator)
    # weight of the tokens whose pi / pi_behaviour lies outside [1 - eps_low, 1 + eps_high]: the
    # rollouts' policy too far from the one trained (staleness, an engine mismatch; rule rl_ratio)
    off_policy: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # sum of weight x the policy's entropy (nats), with an entropy bonus
    kl_ref: torch.Tensor | None = None  # sum of weight x the KL estimate to the reference, with a KL term
    # decoupled objective: sum of weight x the truncated importance weight, and of the tokens capped
    behaviour_weight: torch.Tensor | None = None
    behaviour_capped: torch.Tensor | None = None


def policy_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantage: torch.Tensor,
    weights: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    behaviour_cap: float | None = None,
) -> PolicyTerms:
    """The clipped surrogate's sums over a micro-batch: logprobs [N, T] (with gradient),
    old_logprobs [N, T] (the behaviour policy's), advantage [N] or [N, T], weights [N, T]
    (token_weights: 0 off the responses); entropy [N, T] (with gradient) with a bonus;
    ref_logprobs [N, T] (the reference policy's) with a KL term; behaviour_cap: the decoupled
    objective (see the module docstring)."""
    if advantage.dim() == 1:
        advantage = advantage[:, None]
    off = weights == 0
    # log pi / pi_behaviour: how far the rollouts' policy is from this one (staleness, mismatch)
    behaviour_log = (logprobs.detach() - old_logprobs).masked_fill(off, 0.0)
    anchor = old_logprobs if behaviour_cap is None else logprobs.detach()  # pi_old, or pi_prox
    log_ratio = (logprobs - anchor).masked_fill(off, 0.0)
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    surrogate = -torch.minimum(ratio * advantage, clipped_ratio * advantage)  # [N, T]
    is_weight = None
    if behaviour_cap is not None:
        is_weight = behaviour_log.exp().clamp(max=behaviour_cap)
        surrogate = is_weight * surrogate
    with torch.no_grad():
        was_clipped = (ratio * advantage > clipped_ratio * advantage).float()
        kl = (-behaviour_log).exp() + behaviour_log - 1.0  # k3 of KL(pi_old || pi): >= 0, unbiased
        outside = (behaviour_log < math.log1p(-eps_low)) | (behaviour_log > math.log1p(eps_high))
    bonus = None if entropy is None else (weights * entropy).sum()
    kl_ref = None
    if ref_logprobs is not None:
        to_ref = (ref_logprobs - logprobs).masked_fill(off, 0.0)
        kl_ref = (weights * (to_ref.exp() - to_ref - 1.0)).sum()  # KL(pi || pi_ref), GRPO's k3
    objective = (weights * surrogate).sum() - (entropy_coef * bonus if bonus is not None else 0.0)
    return PolicyTerms(
        objective=objective + (kl_coef * kl_ref if kl_ref is not None else 0.0),
        clipped=(weights * was_clipped).sum(),
        ratio_max=behaviour_log.exp().masked_fill(off, 0.0).max(),
        kl=(weights * kl).sum(),
        off_policy=(weights * outside).sum(),
        entropy=None if bonus is None else bonus.detach(),
        kl_ref=None if kl_ref is None else kl_ref.detach(),
        behaviour_weight=None if is_weight is None else (weights * is_weight).sum(),
        behaviour_capped=None if is_weight is None else (weights * (behaviour_log.exp() > behaviour_cap)).sum(),
    )


# A sampling temperature: one for every position, or a tensor broadcast against the logits (each
# response position's own, [N, 1]: temperatures_at)
Temperature = float | torch.Tensor


def log_distribution(hidden: torch.Tensor, head: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    """log softmax(logits / temperature) [B, T, V] of hidden states [B, T, D] through head [V, D],
    in fp32: the distribution a rollout was drawn from (rl/rollout.py), for policy and reference."""
    return (F.linear(hidden, head).float() / temperature).log_softmax(-1)


def at_targets(every: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each target's log-probability [B, T] from log_distribution's [B, T, V] (IGNORE targets
    read token 0: their weights are 0)."""
    return every.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)


# The objectives read the head's distribution at the response tokens only: a prompt's positions
# have no target, and their [B, T, V] fp32 log-softmax would be most of the head's time and
# memory (a DPO pair's prompt is often longer than its responses).


def response_positions(targets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The flat positions [N] of the targets [B, T] that are response tokens, from the
    micro-batch's host copy (no device sync), on `device`."""
    return (targets >= 0).flatten().nonzero().squeeze(1).to(device, non_blocking=True)


def temperatures_at(temperature: torch.Tensor, at: torch.Tensor, width: int) -> torch.Tensor:
    """Each response position's sampling temperature [N, 1], for distribution_at: a micro-batch's
    rows' [B] (PolicyMicroBatch.temperature) read at the flat positions `at` of its [B, width]."""
    return temperature.index_select(0, at // width)[:, None]


def distribution_at(
    hidden: torch.Tensor, head: torch.Tensor, at: torch.Tensor, temperature: Temperature
) -> torch.Tensor:
    """log_distribution [N, V] of hidden [B, T, D] at the flat positions `at` [N] only."""
    return log_distribution(hidden.flatten(0, 1).index_select(0, at), head, temperature)


def logprobs_at(every: torch.Tensor, targets: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """distribution_at's [N, V] read at the targets [B, T], as [B, T] (0 off the responses)."""
    return spread(at_targets(every, targets.flatten().index_select(0, at)), at, targets.shape)


def target_logprobs(
    hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, at: torch.Tensor, temperature: Temperature
) -> torch.Tensor:
    """Each response target's log-probability [B, T] under the head at `temperature`, the head
    read at the positions `at` only (0 elsewhere): a reference's, DPO's policy's."""
    return logprobs_at(distribution_at(hidden, head, at, temperature), targets, at)


def spread(values: torch.Tensor, at: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """values [N] at the flat positions `at` of a [B, T] tensor, 0 elsewhere (differentiable)."""
    return values.new_zeros(shape.numel()).index_copy(0, at, values).view(shape)


def policy_from_hidden(
    hidden: torch.Tensor,
    head: torch.Tensor,
    targets: torch.Tensor,
    at: torch.Tensor,
    micro: Any,
    temperature: Temperature,
    eps_low: float,
    eps_high: float,
    entropy_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    behaviour_cap: float | None = None,
) -> PolicyTerms:
    """The objective's sums for a micro-batch of rollouts (rl/step.py: PolicyMicroBatch, its
    tensors on hidden's device): hidden [B, T, D], head [V, D], targets [B, T] (IGNORE where
    no response token), `at` [N] their response positions (response_positions: the head reads
    those only). The policy's log-probabilities are taken at the rollouts' temperature, as their
    behaviour log-probabilities were (a tensor: each position's own, temperatures_at)."""
    every = distribution_at(hidden, head, at, temperature)  # [N, V]
    logprobs = logprobs_at(every, targets, at)
    entropy = spread(-(every.exp() * every).sum(-1), at, targets.shape) if entropy_coef else None
    return policy_terms(
        logprobs,
        micro.old_logprobs,
        micro.advantage,
        micro.weights,
        eps_low,
        eps_high,
        entropy,
        entropy_coef,
        ref_logprobs,
        kl_coef,
        behaviour_cap,
    )
