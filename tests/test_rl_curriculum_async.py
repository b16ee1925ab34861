"""The curriculum's raise (rl/curriculum.py) where it meets the run. Under asynchronous rollouts (rl.max_staleness)
the rule's raise is applied in the trainer's thread while the rollout thread draws the next batch: it swapped the
loader's problems mid-draw, a group's prompt the old difficulty's and the answer it was scored against the new one's
(a right response scored wrong), the batch saying the new difficulty. And a raise that does not fit the model."""

import re
import threading
import time
from types import SimpleNamespace

import pytest

from test_rl_batches import EOS, CharTokenizer
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.rl import RLConfig
from trimtab.errors import ConfigError
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.rl_health import NoLearningSignal
from trimtab.orchestrator.rl_remedies import remedy
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.curriculum import set_difficulty
from trimtab.rl.phase import problems_of
from trimtab.rl.rollout import Rollout


def solver(started: threading.Event, release: threading.Event):
    """A policy that answers each prompt rightly ('A+B=' or 'A-B='), holding its second call (the batch the rollout
    thread generates while the first is trained) until released."""
    calls = []

    def generate(prompts: list[list[int]], seed: int | None) -> list[Rollout]:
        calls.append(len(prompts))
        if len(calls) == 2:
            started.set()
            release.wait(10)
        out = []
        for prompt in prompts:
            text = "".join(map(chr, prompt)).rstrip("=")
            a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)", text).groups()
            answer = str(int(a) + int(b) if op == "+" else int(a) - int(b))
            out.append(Rollout(prompt, [*map(ord, " " + answer), EOS], [-0.1] * (len(answer) + 2), truncated=False))
        return out

    return generate


def release_once_raised(ours: RolloutLoader, release: threading.Event) -> None:
    """Let the draw in flight finish once the loader is at the new difficulty, or after 2 s (a raise that waits for
    the draw before it changes anything)."""
    deadline = time.monotonic() + 2.0
    while ours.difficulty != 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()


def operand_digits(batch) -> int:
    texts = ["".join(map(chr, r.prompt)).rstrip("=").replace("-", "+") for r in batch.rollouts]
    return max(len(n) for text in texts for n in text.split("+"))


def test_a_raise_while_the_rollout_thread_draws_scores_each_group_against_its_own_prompt():
    rl = RLConfig(prompts="builtin:arithmetic:1", group_size=2, prompts_per_step=4, verifier_workers=1)
    rl.held_out, rl.max_staleness = 0, 1
    run = SimpleNamespace(rl=rl, train=SimpleNamespace(seed=0))
    train, held = problems_of(run)
    ours = RolloutLoader(train, CharTokenizer(), rl, 0, seed=0, max_prompt_tokens=4, held_out=held)
    started, release = threading.Event(), threading.Event()
    ours.policy = solver(started, release)
    ours.snapshot = lambda: (ours.policy, ours.version)
    try:
        batches = [ours.next_batch()]  # the step trained; the rollout thread generates the next one
        assert started.wait(10)
        threading.Thread(target=release_once_raised, args=(ours, release)).start()
        set_difficulty(ours, 3, max_seq_len=64)  # the rule's raise, in the trainer's thread, between steps
        batches += [ours.next_batch() for _ in range(3)]
    finally:
        release.set()
        ours.close()
    for batch in batches:  # every response is right: a reward of 0 was scored against another problem's answer
        assert min(batch.rewards) == 1.0, (batch.difficulty, batch.rewards)
        assert operand_digits(batch) <= batch.difficulty  # the batch says the difficulty it was drawn at
    assert [b.difficulty for b in batches] == [1, 3, 3, 3]  # those queued at 1 digit dropped, drawn again at 3


def test_a_raise_that_does_not_fit_is_the_ceiling_and_the_learned_task_stops():
    """A raise whose prompts and rl.max_new_tokens overflow model.max_seq_len failed, and the rule asked for it again
    every window (journaled as failed each time) while the run trained on at loss 0 to max_steps (found with
    rl.max_new_tokens=124 on a 128-token model: 2-digit prompts fit, 3-digit ones do not)."""
    rl = RLConfig(prompts="builtin:arithmetic:1", group_size=2, prompts_per_step=2, verifier_workers=1, held_out=0)
    train, held = problems_of(SimpleNamespace(rl=rl, train=SimpleNamespace(seed=0)))
    ours = RolloutLoader(train, CharTokenizer(), rl, 0, seed=0, max_prompt_tokens=4, held_out=held)
    ours.policy = solver(threading.Event(), threading.Event())
    try:
        with pytest.raises(ConfigError, match=r"model\.max_seq_len=10"):
            set_difficulty(ours, 9, max_seq_len=10)  # a person's jump says nothing of the next digit
        assert ours.next_batch().health.get("top_difficulty") is None
        with pytest.raises(ConfigError, match=r"model\.max_seq_len=6"):
            set_difficulty(ours, 2, max_seq_len=6)  # "12+34=" and 2 new tokens: 8
        health = ours.next_batch().health
    finally:
        ours.close()
    assert health["difficulty"] == 1 and health["top_difficulty"] == 1
    c = OrchestratorConfig()
    c.rl_signal.window = 2
    mon = NoLearningSignal(c)
    rl_figures = {"flat_groups": 1.0, "solved_groups": 1.0, "groups_drawn": 16, "dynamic_sampling": True}
    rl_figures |= {"difficulty": 1, "top_difficulty": 1}
    found = [mon.observe(StepMetrics(step=s, loss=0.0, grad_norm=0.0, rl=rl_figures)) for s in (1, 2)][-1]
    done = remedy(found, SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True), c)
    assert (done.action, done.params["exit_code"]) == ("stop", 0)
    assert "would not fit model.max_seq_len" in done.params["reason"]
