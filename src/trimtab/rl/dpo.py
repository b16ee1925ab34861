"""Direct preference optimization's loss on pairs of responses to one prompt, a chosen one y_w and
a rejected one y_l, against the frozen starting policy pi_ref (rl/reference.py).

The implicit reward of a response is r(y) = beta x (log pi(y | x) - log pi_ref(y | x)), the log-
probabilities summed over the response's tokens, and h = (r(y_w) - r(y_l)) / beta the pair's
log-ratio difference. Per pair (dpo.loss):
    sigmoid   -log sigmoid(beta h) (DPO, Rafailov et al. 2023, eq. 7); with label smoothing eps,
              -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) (conservative DPO, Mitchell
              2023: a share eps of the pairs taken to be mislabelled)
    ipo       (h - 1 / (2 beta))^2 (IPO, Azar et al. 2023, eq. 17): a target margin instead of an
              ever-growing one, so a policy cannot drive the rejected response's probability to 0
    hinge     max(0, 1 - beta h) (SLiC-HF's calibration loss, Zhao et al. 2023)
and with no reference at all (reference_free_losses: the reward is beta x the mean log-probability
of the response's tokens, so no reference model is loaded or run):
    simpo     -log sigmoid(r(y_w) - r(y_l) - gamma) (SimPO, Meng et al. 2024, eq. 6)
    orpo      the chosen response's NLL per token + beta x -log sigmoid(log odds(y_w) - log odds(y_l)),
              odds(y) = p / (1 - p) with p the mean token probability exp(mean log pi) (ORPO, Hong
              et al. 2024, eq. 6-7: supervised fine-tuning with an odds-ratio penalty; beta is its lambda)
With dpo.sft_coef alpha, each pair adds alpha x the chosen response's negative log-likelihood per
token (RPO, Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 2): DPO alone can
lower both responses' likelihoods as long as the rejected one falls faster, which on answers that
differ by a token or two (math) takes the right answer down with the wrong one.
The step's loss is the sum over its pairs divided by the step's pair count (every micro-batch's
pairs), so the gradient is the same however the step is split.

Shape legend: N pairs; a micro-batch's 2N rows are the N chosen responses, then the N rejected
ones (rl/pairs.py), B = 2N; T positions, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trimtab.config.dpo import DPOConfig
from trimtab.data.batches import IGNORE_INDEX
from trimtab.rl.loss import target_logprobs


@dataclass
class DPOTerms:
    """A micro-batch's sums over its pairs (0-d tensors, on device; divide by its pair count)."""

    objective: torch.Tensor  # sum of the pairs' losses (what is differentiated)
    correct: torch.Tensor  # pairs whose implicit reward prefers the chosen response
    margin: torch.Tensor  # sum of r(y_w) - r(y_l)
    chosen_reward: torch.Tensor  # sum of r(y_w)
    rejected_reward: torch.Tensor  # sum of r(y_l)
    pairs: int


def sequence_logprobs(token_logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's response log-probability [B]: token_logprobs [B, T] summed where targets [B, T]
    are response tokens (not IGNORE_INDEX)."""
    return (token_logprobs * (targets != IGNORE_INDEX)).sum(-1)


def pair_losses(
    policy: torch.Tensor, reference: torch.Tensor, beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """policy, reference [2N]: the rows' response log-probabilities (chosen rows, then rejected)
    -> each pair's loss [N] and the implicit rewards of its chosen and rejected responses [N]."""
    n = policy.shape[0] // 2
    ratio = policy - reference  # log pi / pi_ref of each response
    h = ratio[:n] - ratio[n:]
    if loss == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"dpo.loss '{loss}': sigmoid, ipo or hinge")
    return losses, beta * ratio[:n].detach(), beta * ratio[n:].detach()


def reference_free_losses(
    policy: torch.Tensor, lengths: torch.Tensor, beta: float, loss: str, gamma: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """policy [2N] (as pair_losses'), lengths [2N] the responses' tokens -> each pair's SimPO or
    ORPO loss [N] and its responses' rewards beta x mean log-probability [N] (module docstring)."""
    n = policy.shape[0] // 2
    mean = policy / lengths.clamp(min=1)  # log-probability per token
    reward = beta * mean
    if loss == "simpo":
        losses = -F.logsigmoid(reward[:n] - reward[n:] - gamma)
    elif loss == "orpo":
        # log(1 - p) = log(-expm1(log p)), exact for p near 0; -inf at p = 1, kept off by the clamp
        log_odds = mean - torch.log(-torch.expm1(mean.clamp(max=-1e-6)))
        losses = -mean[:n] - beta * F.logsigmoid(log_odds[:n] - log_odds[n:])
    else:
        raise ValueError(f"dpo.loss '{loss}' has a reference: use pair_losses")
    return losses, reward[:n].detach(), reward[n:].detach()


def dpo_terms(policy: torch.Tensor, reference: torch.Tensor | None, lengths: torch.Tensor, cfg: DPOConfig) -> DPOTerms:
    """The sums of a micro-batch's pairs from its rows' response log-probabilities (the
    reference's: None for a reference-free loss) and lengths in tokens [2N]."""
    if reference is None:
        losses, chosen, rejected = reference_free_losses(policy, lengths, cfg.beta, cfg.loss, cfg.simpo_gamma)
    else:
        losses, chosen, rejected = pair_losses(policy, reference, cfg.beta, cfg.loss, cfg.label_smoothing)
    n = chosen.shape[0]
    if cfg.sft_coef:  # RPO: the chosen responses' likelihood held up
        losses = losses - cfg.sft_coef * policy[:n] / lengths[:n].clamp(min=1)
    return DPOTerms(
        objective=losses.sum(),
        correct=(chosen > rejected).float().sum(),
        margin=(chosen - rejected).sum(),
        chosen_reward=chosen.sum(),
        rejected_reward=rejected.sum(),
        pairs=n,
    )


def dpo_from_hidden(
    hidden: torch.Tensor,
    head: torch.Tensor,
    targets: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    cfg: DPOConfig,
    at: torch.Tensor,
) -> DPOTerms:
    """A micro-batch of pairs' sums: hidden [B, T, D] (the policy's, with gradient), head [V, D],
    targets [B, T] (IGNORE_INDEX off the responses), ref_logprobs [B, T] (the reference's at each
    target; rl/reference.py; None for a reference-free loss), `at` the responses' flat positions
    (rl/loss.py: the head reads those only). Both at temperature 1: the policies themselves."""
    policy = sequence_logprobs(target_logprobs(hidden, head, targets, at, 1.0), targets)
    lengths = (targets != IGNORE_INDEX).sum(-1)
    reference = None if ref_logprobs is None else sequence_logprobs(ref_logprobs, targets)
    return dpo_terms(policy, reference, lengths, cfg)
