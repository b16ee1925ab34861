"""The built-in task's curriculum: its difficulty (the operands' digits, rl.prompts
builtin:arithmetic:DIGITS) raised once the policy has learnt it.

Rule rl_signal (orchestrator/rl_health.py) found a window whose every group was flat and mostly solved:
the prompts teach the policy nothing more. A prompt file stops there (the data is a person's to change),
but the built-in task has a difficulty to raise: its training problems are drawn again at DIGITS + 1
(the action `set_rl_difficulty`, `trimtab ctl RUN rl-difficulty DIGITS`), so groups the policy does not
solve every time come back, and with them the advantage. The held-out problems stay those of the
configured difficulty: a harder held-out set would read as a fall of held-out pass@1, which rules
rl_hacking and rl_reward answer with a rollback (their baselines are the old task's). The difficulty
is the loader's state (its checkpoint: an exact resume draws the same problems) and each step's
(`RolloutBatch.difficulty`, rl/difficulty in the metrics), so the rules' baselines start again at a
new difficulty (RewardFall, NoLearningSignal).
"""

from __future__ import annotations

from typing import Any

from trimtab.errors import ConfigError
from trimtab.rl.order import EpochOrder, fingerprint
from trimtab.rl.tasks import builtin, longest_tokens


def set_difficulty(loader: Any, digits: int, max_seq_len: int = 0) -> str:
    """Draw `loader`'s (an RolloutLoader's) training problems again at `digits`, its order from the start;
    a ConfigError where its task is a file (no difficulty), or where the longest new prompt and
    rl.max_new_tokens would not fit `max_seq_len` (0: unchecked, a checkpoint's own difficulty)."""
    if not loader.difficulty:
        raise ConfigError(
            f"rl.prompts '{loader.cfg.prompts}' is a file, with no difficulty to set: the built-in task's is "
            "builtin:arithmetic:DIGITS; harder prompts in the file are a person's to write"
        )
    train, _ = builtin(digits, loader.seed, 0)
    longest = longest_tokens(loader.tok, train)
    if max_seq_len and longest + loader.cfg.max_new_tokens > max_seq_len:
        if digits == loader.difficulty + 1:  # the task's ceiling here, in the step's figures: rule rl_signal stops
            # the learned task at it, not raising it again every window (it did, each raise journaled as failed, and
            # the run trained on at loss 0 to max_steps)
            loader.top_difficulty = loader.difficulty
        raise ConfigError(
            f"the built-in task at {digits} digits has prompts of {longest} tokens: with rl.max_new_tokens="
            f"{loader.cfg.max_new_tokens} over model.max_seq_len={max_seq_len}; difficulty unchanged "
            f"({loader.difficulty})"
        )
    # asynchronous (rl.max_staleness): the rollout thread draws from the problems being swapped here, so a batch
    # drawing across the swap had its prompts at the old difficulty and its answers at the new (every response
    # scored wrong); those queued ahead were the old task's. Generated again at the new one.
    loader.drop_ahead()
    before, auto = loader.difficulty, loader.micro_batch_tokens == loader.batch_tokens
    items = fingerprint((p.prompt, p.answer) for p in train)
    loader.problems, loader.difficulty = train, digits
    loader.order = EpochOrder(len(train), loader.seed, "prompts", "rl.prompts", items, seeded=True)
    cfg = loader.cfg
    loader.max_prompt_tokens = max(loader.max_prompt_tokens, longest)
    loader.batch_tokens = cfg.prompts_per_step * cfg.group_size * (loader.max_prompt_tokens + cfg.max_new_tokens)
    if auto:  # train.micro_batch_tokens 0: the whole step, now of longer prompts
        loader.micro_batch_tokens = loader.batch_tokens
    loader.on_difficulty()  # a resume's too: build_rl_phase laid out the configured difficulty's rows
    return (
        f"RL task difficulty {before} -> {digits} digits ({len(train)} training problems drawn again; "
        "the held-out problems unchanged)"
    )
