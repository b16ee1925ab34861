"""Reinforcement learning on verifiable rewards (issue 33; docs/rl.md): rollouts, rewards, the
GRPO-family objective and prompt tasks so far; the loop that drives them comes next."""
