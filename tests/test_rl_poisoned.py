"""RL's rules on steps whose rollouts came from non-finite weights (rl_stats.poisoned): such a
step's sampled tokens' entropy reads NaN, and it is rule nonfinite's to roll back. Through
`trimtab rl --inject weights_nan@17` (debug, lr 1e-3, from a 600-step arithmetic warm start), the
RL rules read steps 17-18 as their own: rl_length set the overlong penalty and rl_reward rolled
back to step 1 with the LR x0.1, which survives the rollback (as does rl_signal's temperature);
only rl_entropy ignored them."""

from types import SimpleNamespace

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.rl_health import EntropyCollapse, NoLearningSignal
from trimtab.orchestrator.rl_held_out import RewardHacking
from trimtab.orchestrator.rl_reward import RewardFall
from trimtab.orchestrator.rl_rollouts import LengthRunaway, OffPolicy
from trimtab.orchestrator.rl_verifier import VerifierFailures

NAN = float("nan")
# a step's figures as RolloutBatch.health says them: 8 groups of 4 responses, 0/1 rewards, half right
HEALTHY = {
    "flat_groups": 0.25,
    "solved_groups": 0.0,
    "groups_drawn": 8,
    "verifications": (32, 0, 0),
    "truncated": 0.0,
    "response_tokens": 3.0,
    "off_policy": 0.0,
    "kl": 0.0,
    "staleness": 0.0,
    "entropy": 2.0,
    "reward": 0.5,
    "score_n": 8,
    "score": 4.0,
    "score_sq": 2.0,
    "temperature": 1.0,
}
# what rollouts of NaN weights read, each rule's alarm (the entropy NaN in all)
NAN_ROLLOUTS = {
    "rl_signal": {"flat_groups": 1.0},
    "rl_entropy": {"reward": 0.0},
    "rl_length": {"truncated": 1.0, "response_tokens": 6.0},
    "rl_ratio": {"off_policy": 1.0, "kl": NAN},
    "rl_reward": {"score": 0.0, "score_sq": 0.0, "reward": 0.0},
    "rl_verifier": {"verifications": (32, 32, 0)},
}
MONITORS = {
    "rl_signal": NoLearningSignal,
    "rl_entropy": EntropyCollapse,
    "rl_length": LengthRunaway,
    "rl_ratio": OffPolicy,
    "rl_reward": RewardFall,
    "rl_verifier": VerifierFailures,
}


def cfg() -> OrchestratorConfig:
    c = OrchestratorConfig()
    for rule in (c.rl_signal, c.rl_entropy, c.rl_length, c.rl_ratio, c.rl_reward, c.rl_verifier):
        rule.window = 2
    c.rl_reward.start_steps = 1
    return c


def step(s: int, **rl: object) -> StepMetrics:
    return StepMetrics(step=s, loss=0.0, grad_norm=1.0, rl={**HEALTHY, **rl})


@pytest.mark.parametrize("rule", sorted(MONITORS))
def test_no_rl_rule_reads_rollouts_of_non_finite_weights(rule: str) -> None:
    mon = MONITORS[rule](cfg())
    alarm = NAN_ROLLOUTS[rule]
    healthy = [mon.observe(step(s)) for s in range(1, 5)]
    poisoned = [mon.observe(step(s, **alarm, entropy=NAN)) for s in range(5, 9)]
    assert healthy == [None] * 4 and poisoned == [None] * 4
    # the same figures from finite weights are the rule's to find (an entropy that collapsed, for rl_entropy)
    real = [mon.observe(step(s, **alarm, entropy=0.1)) for s in range(9, 13)]
    assert any(f is not None and f.rule == rule for f in real)


def test_the_training_reward_of_rollouts_of_non_finite_weights_is_not_rl_hackings() -> None:
    mon = RewardHacking(cfg())
    for s in range(1, 4):
        mon.observe(step(s, reward=0.5))
    mon.observe(step(4, reward=0.0, entropy=NAN))
    assert mon.recent == [0.5] * 3


def test_an_evaluation_of_non_finite_weights_is_not_rl_hackings(tmp_path) -> None:
    """`trimtab rl --inject weights_nan@10` with train.eval_every=5: step 10's held-out answers came
    from NaN weights (0.0) and the orchestrator gave them to rule rl_hacking as a fall from its best;
    they are rule nonfinite's to roll back. Asked of RunView.weights_finite, not probe_loss: the probe's held-out
    forward ran at every evaluation for the same answer."""
    c = cfg()
    c.rl_hacking.patience = 5  # counted, not acted on: the evaluations' count is the evidence
    orch = Orchestrator(c, tmp_path)
    mon = orch.monitors["rl_hacking"]
    for s in range(1, 4):
        mon.observe(step(s, reward=0.2))
    weights = {"probe": None}  # None for finite weights, NaN for non-finite ones

    def probe() -> None:
        raise AssertionError("a held-out forward to ask whether the weights are finite")

    run = SimpleNamespace(phase=0, weights_finite=lambda: weights["probe"] is None, probe_loss=probe)
    orch.on_eval(run, {"step": 3, "rl/held_out_reward": 0.5})
    for s in range(4, 7):
        mon.observe(step(s, reward=0.6))
    weights["probe"] = NAN
    orch.on_eval(run, {"step": 5, "rl/held_out_reward": 0.0})
    orch.on_eval(run, {"step": 6, "rl/held_out_reward": 0.0})
    assert (mon.best, mon.since) == (0.5, 0)
    weights["probe"] = None  # rolled back, finite again: a real fall counts
    orch.on_eval(run, {"step": 6, "rl/held_out_reward": 0.3})
    assert mon.since == 1
