"""The GRPO family's advantages and clipped objective (rl/loss.py): each baseline's values, the
clip's asymmetry, and a step's gradient that is the same however the step is split."""

import pytest
import torch

from trimtab.rl.loss import advantages, normaliser, policy_terms, token_weights


def test_each_baseline():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    grpo = advantages(r, "grpo")
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    assert torch.allclose(grpo[0], (r[0] - 0.5) / std, atol=1e-5) and torch.equal(grpo[1], torch.zeros(4))
    assert torch.equal(advantages(r, "dr_grpo")[0], r[0] - 0.5)
    # rloo: each response against the mean of the other three
    assert torch.allclose(advantages(r, "rloo")[0], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    centred = r - r.mean(1, keepdim=True)
    assert torch.allclose(advantages(r, "reinforce++"), centred / centred.std(), atol=1e-5)
    with pytest.raises(ValueError, match="one of grpo, dr_grpo, rloo, reinforce"):
        advantages(r, "ppo")


def test_the_clip_is_asymmetric_and_stops_the_gradient_past_it():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.1, 1.3, 0.7, 0.9]])).requires_grad_()
    weights = torch.ones(1, 4)
    terms = policy_terms(new, old, torch.tensor([1.0]), weights, eps_low=0.2, eps_high=0.28)
    terms.objective.backward()
    # A > 0: ratio 1.3 is past 1 + 0.28 (no gradient), 1.1 and 0.9 inside, 0.7 below 1 - 0.2 but
    # min() keeps the unclipped (smaller) term there, so it keeps its gradient
    assert new.grad[0, 1] == 0 and all(new.grad[0, i] != 0 for i in (0, 2, 3))
    assert float(terms.clipped) == 1.0 and float(terms.ratio_max) == pytest.approx(1.3)
    assert float(terms.kl) > 0


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "constant"])
def test_a_step_split_into_micro_batches_and_ranks_has_the_gradient_of_the_whole(aggregation):
    """8 responses of ragged lengths: the whole step at once, then 4 micro-batches, then 2 ranks
    of 2 micro-batches (their gradients summed, as the all-reduce does): the same gradient."""
    g = torch.Generator().manual_seed(0)
    N, T = 8, 6
    lengths = [6, 1, 3, 5, 2, 6, 4, 2]
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    logits = torch.randn(N, T, generator=g)
    old = logits.detach() + 0.3 * torch.randn(N, T, generator=g)
    adv = advantages(torch.randint(0, 2, (N // 4, 4), generator=g).float(), "grpo").reshape(-1)
    norm = normaliser(lengths, aggregation, max_new_tokens=T)

    def grad(splits: list[list[int]]) -> torch.Tensor:
        x = logits.clone().requires_grad_()
        for rows in splits:
            w = token_weights(mask[rows], aggregation)
            (policy_terms(x[rows], old[rows], adv[rows], w).objective / norm).backward()
        return x.grad

    whole = grad([list(range(N))])
    assert torch.allclose(grad([[0, 1], [2, 3], [4, 5], [6, 7]]), whole, atol=1e-7)
    rank0, rank1 = grad([[0, 1], [2, 3]]), grad([[4, 5], [6, 7]])
    assert torch.allclose(rank0 + rank1, whole, atol=1e-7)
    assert whole[~mask].abs().sum() == 0  # nothing reaches a padded position
    if aggregation == "seq_mean":
        return  # equal micro-batches of whole responses: the naive mean below happens to agree
    # a per-micro-batch token mean (the bug this rules out) would not be the whole's gradient
    x = logits.clone().requires_grad_()
    for rows in ([0, 1], [2, 3], [4, 5], [6, 7]):
        w = token_weights(mask[rows], aggregation)
        (policy_terms(x[rows], old[rows], adv[rows], w).objective / w.sum() / 4).backward()
    assert not torch.allclose(x.grad, whole, atol=1e-4)


def test_an_entropy_bonus_widens_the_policy_and_is_off_by_default():
    """policy_from_hidden with entropy_coef: the objective less coef x the weighted entropy, whose
    gradient alone (advantages 0) makes the distribution flatter; with 0 no entropy is computed."""
    from types import SimpleNamespace

    from trimtab.rl.loss import policy_from_hidden, response_positions

    torch.manual_seed(0)
    hidden, head = torch.randn(2, 3, 8), (3 * torch.randn(16, 8)).requires_grad_()
    targets = torch.randint(0, 16, (2, 3))
    micro = SimpleNamespace(old_logprobs=torch.zeros(2, 3), advantage=torch.zeros(2), weights=torch.ones(2, 3))
    at = response_positions(targets, torch.device("cpu"))
    assert policy_from_hidden(hidden, head, targets, at, micro, 1.0, 0.2, 0.28).entropy is None

    @torch.no_grad()
    def entropy() -> float:
        logp = torch.nn.functional.linear(hidden, head).log_softmax(-1)
        return float(-(logp.exp() * logp).sum(-1).mean())

    terms = policy_from_hidden(hidden, head, targets, at, micro, 1.0, 0.2, 0.28, entropy_coef=0.5)
    assert float(terms.entropy) == pytest.approx(6 * entropy(), rel=1e-5)  # 6 tokens of weight 1
    assert float(terms.objective.detach()) == pytest.approx(-0.5 * float(terms.entropy), rel=1e-5)
    before = entropy()
    terms.objective.backward()
    with torch.no_grad():
        head -= 0.1 * head.grad
    assert entropy() > before


def test_only_the_response_tokens_go_through_the_head_and_nothing_else_changes():
    """policy_from_hidden takes the head's distribution at the response tokens only (a prompt's
    positions have no target): the objective, its figures and the gradients of hidden states and
    head are those of the whole [B, T, V] computed and weighted 0 off the responses."""
    from types import SimpleNamespace

    from trimtab.rl.loss import at_targets, log_distribution, policy_from_hidden, response_positions

    torch.manual_seed(0)
    hidden, head = torch.randn(2, 5, 8, requires_grad=True), (3 * torch.randn(16, 8)).requires_grad_()
    targets = torch.tensor([[-100, -100, 3, 7, -100], [-100, 4, 4, 9, 1]])  # prompts, responses, padding
    weights = (targets >= 0).float() / 7
    old = torch.where(targets >= 0, -2.0 + 0.1 * torch.randn(2, 5), torch.zeros(2, 5))
    micro = SimpleNamespace(old_logprobs=old, advantage=torch.tensor([1.0, -0.5]), weights=weights)
    at = response_positions(targets, torch.device("cpu"))
    found = policy_from_hidden(hidden, head, targets, at, micro, 0.7, 0.2, 0.28, entropy_coef=0.1)
    found.objective.backward()
    grads = hidden.grad.clone(), head.grad.clone()
    hidden.grad, head.grad = None, None
    every = log_distribution(hidden, head, 0.7)  # [B, T, V]: every position
    entropy = -(every.exp() * every).sum(-1)
    whole = policy_terms(at_targets(every, targets), old, micro.advantage, weights, 0.2, 0.28, entropy, 0.1)
    whole.objective.backward()
    for name in ("objective", "clipped", "kl", "off_policy", "entropy", "ratio_max"):
        assert torch.allclose(getattr(found, name), getattr(whole, name), atol=1e-6), name
    assert torch.allclose(grads[0], hidden.grad, atol=1e-6) and torch.allclose(grads[1], head.grad, atol=1e-6)
    assert grads[0][0, :2].abs().sum() == 0  # a prompt's positions get no gradient from the head


def test_the_kl_term_to_the_reference_is_grpos_estimator_and_pulls_towards_it():
    """kl_coef x sum(weight x (pi_ref / pi - log(pi_ref / pi) - 1)): 0 where the policy is the
    reference, positive elsewhere, and its gradient alone (advantages 0) moves the policy's
    log-probabilities towards the reference's."""
    logprobs = torch.log(torch.tensor([[0.5, 0.2, 0.9]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.5, 0.4, 0.6]]))
    weights, zero = torch.tensor([[1.0, 1.0, 0.0]]), torch.zeros(1)
    terms = policy_terms(logprobs, logprobs.detach(), zero, weights, ref_logprobs=ref, kl_coef=0.5)
    r = torch.log(torch.tensor(0.4 / 0.2))
    assert float(terms.kl_ref) == pytest.approx(float(r.exp() - r - 1))  # token 0: 0; token 2: weight 0
    assert float(terms.objective.detach()) == pytest.approx(0.5 * float(terms.kl_ref))
    terms.objective.backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] < 0 and logprobs.grad[0, 2] == 0  # descent raises 0.2
    same = policy_terms(logprobs.detach(), logprobs.detach(), zero, weights, ref_logprobs=logprobs.detach())
    assert (
        float(same.kl_ref) == 0.0 and policy_terms(logprobs.detach(), logprobs.detach(), zero, weights).kl_ref is None
    )


def test_the_decoupled_objective_weights_each_token_by_its_truncated_importance_weight():
    """Asynchronous rollouts (rl.max_staleness): the clip is around the proximal policy (the one
    trained, detached: one update a batch), each token weighted by min(pi / pi_behaviour, cap).
    The gradient of a token's log-probability is -min(w, cap) x A x weight; on-policy rollouts
    (w = 1) give the coupled objective's gradient."""
    behaviour = torch.log(torch.tensor([[0.5, 0.2, 0.1]]))
    now = torch.log(torch.tensor([[0.6, 0.5, 0.1]]))  # w = 1.2, 2.5 (capped at 2), 1.0
    logp = now.clone().requires_grad_()
    terms = policy_terms(logp, behaviour, torch.tensor([1.5]), torch.ones(1, 3), behaviour_cap=2.0)
    terms.objective.backward()
    assert torch.allclose(logp.grad, -1.5 * torch.tensor([[1.2, 2.0, 1.0]]), atol=1e-5)
    assert float(terms.behaviour_weight) == pytest.approx(1.2 + 2.0 + 1.0, rel=1e-5)
    assert float(terms.behaviour_capped) == 1.0 and float(terms.clipped) == 0.0  # the ratio to pi_prox is 1
    assert float(terms.ratio_max) == pytest.approx(2.5, rel=1e-5)  # pi / pi_behaviour, before the cap
    assert float(terms.off_policy) == 1.0  # 2.5 is outside [1 - 0.2, 1 + 0.28] (rule rl_ratio)
    on = now.clone().requires_grad_()
    coupled = now.clone().requires_grad_()
    policy_terms(on, now, torch.tensor([1.5]), torch.ones(1, 3), behaviour_cap=2.0).objective.backward()
    policy_terms(coupled, now, torch.tensor([1.5]), torch.ones(1, 3)).objective.backward()
    assert torch.allclose(on.grad, coupled.grad)
    assert policy_terms(coupled, now, torch.tensor([1.5]), torch.ones(1, 3)).behaviour_weight is None
