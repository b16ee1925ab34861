"""The `rl:` section: reinforcement learning on verifiable rewards (trimtab/rl/, docs/rl.md).

`trimtab rl` trains with this section on (`enabled`): each step draws `prompts_per_step` prompts,
generates `group_size` responses to each with the model being trained, scores them with the
reward's verifier, and takes one optimizer step on the GRPO-family objective.
"""

from __future__ import annotations

from dataclasses import dataclass

from trimtab.config.checks import Section, _check

BASELINES = ("grpo", "dr_grpo", "rloo", "reinforce++")
AGGREGATIONS = ("token_mean", "seq_mean", "constant")


@dataclass
class RLConfig(Section):
    enabled: bool = False  # on under `trimtab rl`
    prompts: str = "builtin:arithmetic"  # a JSONL file of {"prompt", "answer"}, or the built-in task
    held_out: int = 64  # held-out prompts scored (greedy pass@1) at each evaluation
    held_out_samples: int = 0  # n >= 2: n sampled responses a held-out prompt, pass@k for k = 2, 4, .. n
    reward: str = "exact"  # the verifier (rl/rewards.py): math | exact | regex:P | format:P | python:M:F
    # the held-out prompts' verifier ("": rl.reward): a stricter check than the one trained on
    # shows reward hacking (rule rl_hacking), as the task's true measure
    held_out_reward: str = ""
    group_size: int = 8  # responses per prompt (the group the advantage is taken over)
    prompts_per_step: int = 8  # prompts per optimizer step (all ranks together)
    max_new_tokens: int = 16  # a response's budget; longer ones are cut (truncated)
    temperature: float = 1.0
    top_p: float = 1.0
    baseline: str = "grpo"  # grpo | dr_grpo | rloo | reinforce++
    aggregation: str = "token_mean"  # token_mean (DAPO) | seq_mean (GRPO) | constant (Dr. GRPO)
    eps_low: float = 0.2  # the clip below 1 (PPO)
    eps_high: float = 0.28  # the clip above 1 (DAPO's clip-higher)
    dynamic_sampling: bool = False  # DAPO: groups with equal rewards dropped, more prompts drawn instead
    resample_rounds: int = 3  # dynamic sampling's extra draws a step at most
    overlong_filter: bool = False  # DAPO: responses cut at max_new_tokens are left out of the loss
    overlong_buffer: int = 0  # DAPO's soft penalty: the last N tokens of the budget cost up to 1 reward
    entropy_coef: float = 0.0  # an entropy bonus in the objective (rule rl_entropy turns it on)
    kl_coef: float = 0.0  # beta: KL to the frozen starting policy in the objective (rl/reference.py)
    # MoE policies: the experts generation chose are imposed on the training forward (R3,
    # arXiv 2510.11370; rl/replay.py), so rounding never routes the two passes apart
    routing_replay: bool = True
    verifier_workers: int = 2  # processes scoring responses
    verifier_timeout_s: float = 10.0  # a verification past this is killed: reward 0, said
    verifier_retries: int = 1

    def validate(self) -> None:
        _check(self.group_size >= 2, "rl.group_size", "must be >= 2 (an advantage compares a group's responses)")
        _check(self.prompts_per_step >= 1, "rl.prompts_per_step", "must be >= 1")
        _check(self.max_new_tokens >= 1, "rl.max_new_tokens", "must be >= 1")
        _check(self.held_out >= 0, "rl.held_out", "must be >= 0")
        _check(self.held_out_samples != 1 and self.held_out_samples >= 0, "rl.held_out_samples", "0 (off) or >= 2")
        _check(self.temperature > 0, "rl.temperature", "must be > 0 (a group of greedy answers is one answer)")
        _check(0 < self.top_p <= 1, "rl.top_p", "must be in (0, 1]")
        _check(self.baseline in BASELINES, "rl.baseline", f"must be one of {', '.join(BASELINES)}")
        _check(self.aggregation in AGGREGATIONS, "rl.aggregation", f"must be one of {', '.join(AGGREGATIONS)}")
        _check(0 < self.eps_low < 1 and self.eps_high > 0, "rl.eps_low", "eps_low in (0, 1) and eps_high > 0")
        _check(self.verifier_workers >= 1, "rl.verifier_workers", "must be >= 1")
        _check(self.verifier_timeout_s > 0, "rl.verifier_timeout_s", "must be > 0 seconds")
        _check(self.verifier_retries >= 0, "rl.verifier_retries", "must be >= 0")
        _check(self.resample_rounds >= 0, "rl.resample_rounds", "must be >= 0")
        _check(self.entropy_coef >= 0, "rl.entropy_coef", "must be >= 0 (a bonus for entropy, not a penalty)")
        _check(self.kl_coef >= 0, "rl.kl_coef", "must be >= 0 (0: no KL term)")
        _check(
            0 <= self.overlong_buffer < self.max_new_tokens,
            "rl.overlong_buffer",
            f"must be 0 .. rl.max_new_tokens - 1 ({self.max_new_tokens - 1})",
        )
