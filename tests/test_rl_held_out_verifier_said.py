"""A held-out verifier (rl.held_out_reward) that raises: its error was never said, only counted
(rl/held_out_verifier_failures), so a held-out reward of 0 read as the policy's, not the verifier's
(found running `trimtab rl` with a held-out verifier that raises on responses with a leading space:
64 of 64 failed at step 6, held_out_reward 0.0, and not a word on the log). Said now as the
training verifier's errors are, the prompt and its file and line named."""

import logging

from trimtab.config.rl import RLConfig
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.rollout import Rollout
from trimtab.rl.tasks import Problem


class Chars:
    eos_id = pad_id = 0
    encode = staticmethod(lambda text, specials=False: [ord(c) for c in text])
    decode = staticmethod(lambda ids: "".join(map(chr, ids)))


def raising(prompts, seed):  # flaky's verdict on "raise": ValueError
    return [Rollout(p, [ord(c) for c in "raise"] + [0], [-0.5] * 6, False) for p in prompts]


def test_a_held_out_verifier_that_raises_is_named_with_its_error_and_prompt(caplog):
    cfg = RLConfig(group_size=2, prompts_per_step=1, reward="exact", verifier_workers=1)
    cfg.held_out_reward = "python:rl_verifiers:flaky"  # raises on "raise"
    held = [Problem("h1", "1", "tasks.jsonl:3"), Problem("h2", "1", "tasks.jsonl:4")]
    ours = RolloutLoader([Problem("q1", "1")], Chars(), cfg, 0, seed=0, max_prompt_tokens=2, held_out=held)
    ours.policy = raising
    try:
        with caplog.at_level(logging.WARNING, logger="trimtab.rl.batches"):
            figures = ours.evaluate()
    finally:
        ours.close()
    assert figures["rl/held_out_verifier_failures"] == 2.0 and figures["rl/held_out_reward"] == 0.0
    said = [r.getMessage() for r in caplog.records if "verifier failed" in r.getMessage()]
    assert len(said) == 1, said  # one error, said once
    assert said[0].startswith("rl.held_out_reward's verifier failed on a response to prompt 'h1' (tasks.jsonl:3)")
    assert "ValueError: cannot read this answer" in said[0]
    assert "fix the verifier (rl.held_out_reward python:rl_verifiers:flaky)" in said[0]
