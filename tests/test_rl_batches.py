"""The RL step's batch (rl/batches.py) with a scripted policy: micro-batches that hold each
response's targets and behaviour log-probabilities where the trainer needs them, and DAPO's
dynamic sampling, which trains only groups whose rewards differ."""

import pytest

from trimtab.config.rl import RLConfig
from trimtab.data.batches import IGNORE_INDEX
from trimtab.errors import DataError
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.rollout import Rollout
from trimtab.rl.step import overlong_penalty
from trimtab.rl.tasks import Problem

EOS = 0


class CharTokenizer:
    eos_id = pad_id = EOS

    def encode(self, text: str, specials: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def policy(prompts: list[list[int]], seed: int | None) -> list[Rollout]:
    """Problem qN (N even): every response wrong; N odd: the group's responses alternate right, wrong."""
    out = []
    for k, prompt in enumerate(prompts):
        right = int(chr(prompt[-1])) % 2 == 1 and k % 2 == 0
        tokens = [ord("x" if right else "y"), EOS]
        out.append(Rollout(prompt, tokens, [-0.5, -0.25], truncated=False))
    return out


def loader(micro_batch_tokens: int = 8, answer: str = "x", **rl) -> RolloutLoader:
    cfg = RLConfig(**{"group_size": 2, "prompts_per_step": 2, "reward": "exact", "verifier_workers": 1, **rl})
    problems = [Problem(f"q{i}", answer) for i in range(10)]
    made = RolloutLoader(problems, CharTokenizer(), cfg, micro_batch_tokens, seed=0, max_prompt_tokens=2)
    made.policy = policy
    return made


def test_a_step_holds_each_response_at_its_place_with_its_advantage():
    ours = loader()
    try:
        batch = ours.next_batch()
    finally:
        ours.close()
    assert len(batch.rollouts) == 4 and batch.n_targets == 8  # token_mean: every response token
    for micro in batch.micro:
        for b, row in enumerate(micro.targets):
            where = (row != IGNORE_INDEX).nonzero().flatten().tolist()
            assert where == [1, 2]  # the prompt "qN" is 2 tokens: its last input predicts the first response token
            assert micro.old_logprobs[b, 1:3].tolist() == [-0.5, -0.25] and micro.inputs[b, 0] == ord("q")
        assert micro.inputs.shape[0] * micro.inputs.shape[1] <= 8  # the micro-batch budget
    assert sum(m.inputs.shape[0] for m in batch.micro) == 4


def test_an_auto_micro_batch_is_the_whole_step():
    """train.micro_batch_tokens 0 (auto): the step's responses in one micro-batch, however small
    pretraining's train.batch_tokens (which RL does not read)."""
    ours = loader(micro_batch_tokens=0)
    try:
        (micro,) = ours.next_batch().micro
    finally:
        ours.close()
    assert micro.inputs.shape[0] == 4


def test_batches_generated_ahead_resume_on_as_many_ranks_only():
    """Asynchronous rollouts under torchrun keep every rank's batches ahead (`ahead_ranks`): a
    resume on another number of ranks is refused, naming what to do."""
    ours = loader(max_staleness=1)
    try:
        state = {**ours.state_dict(), "ahead_ranks": [[], []]}
        with pytest.raises(DataError, match="generated batches ahead on 2 ranks, this one has 1"):
            ours.load_state_dict(state)
    finally:
        ours.close()


def test_dynamic_sampling_trains_only_groups_whose_rewards_differ_and_resumes_alike():
    plain, dynamic = loader(), loader(dynamic_sampling=True, resample_rounds=5)
    try:
        drawn = plain.next_batch()
        assert len(drawn.rewards) == 4 and drawn.sums["groups"] == 2  # trains what it drew
        assert drawn.sums["reward"] == sum(drawn.rewards) and drawn.sums["verified"] == 4
        steps = [dynamic.next_batch() for _ in range(3)]
        state = dynamic.state_dict()
        again = loader(dynamic_sampling=True, resample_rounds=5)
        again.load_state_dict(state)
        assert again.next_batch().rows == dynamic.next_batch().rows  # the same draws after a resume
        again.close()
        edited = loader(dynamic_sampling=True, resample_rounds=5, answer="y")  # as many prompts, other answers
        with pytest.raises(DataError, match="drew from other prompts than rl.prompts holds now"):
            edited.load_state_dict(state)
        edited.close()
    finally:
        plain.close()
        dynamic.close()
    for batch in steps:
        groups = [batch.rewards[i : i + 2] for i in range(0, len(batch.rewards), 2)]
        assert len(groups) == 2 and all(max(g) != min(g) for g in groups)  # both groups informative
        assert all(row % 2 == 1 for row in batch.rows)  # the odd problems: the ones with a signal
    assert sum(b.sums["groups"] for b in steps) > 6  # some draws were dropped and drawn again


def test_overlong_responses_can_be_penalised_softly_or_left_out():
    assert [overlong_penalty(n, 8, 4) for n in (3, 4, 6, 8)] == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(8, 8, 0) == 0.0  # no buffer: no penalty

    def cut_first(prompts, seed):  # the first response of each group runs to the budget, uncut by EOS
        return [
            Rollout(p, [ord("y")] * 3 if k % 2 == 0 else [ord("x"), EOS], [-1.0] * (3 if k % 2 == 0 else 2), k % 2 == 0)
            for k, p in enumerate(prompts)
        ]

    ours = loader(max_new_tokens=3)
    ours.overlong_filter = True  # the knob (rl.overlong_filter, or rule rl_length's action)
    ours.policy = cut_first
    try:
        batch = ours.next_batch()
    finally:
        ours.close()
    assert sum(m.inputs.shape[0] for m in batch.micro) == 2 and batch.n_targets == 4  # the two whole responses
    rows = [row[row != IGNORE_INDEX].tolist() for m in batch.micro for row in m.targets]
    assert rows == [[ord("x"), EOS]] * 2


def test_each_micro_batch_holds_its_part_of_the_step_normaliser():
    """The trainer weights a micro-batch's auxiliary losses by n_targets / the step's: under
    every aggregation the micro-batches' parts add up to the step's normaliser."""
    for aggregation, whole in (("token_mean", 8), ("seq_mean", 4), ("constant", 4 * 16)):
        ours = loader(aggregation=aggregation)
        try:
            batch = ours.next_batch()
        finally:
            ours.close()
        assert len(batch.micro) == 2 and batch.n_targets == whole
        assert sum(m.n_targets for m in batch.micro) == whole, aggregation


def test_pass_at_k_is_the_unbiased_estimator_over_sampled_held_out_responses():
    """Chen et al. 2021: 1 - C(n - c, k) / C(n, k); the loader samples n responses a held-out
    prompt with one seed at every evaluation and reports k = 2, 4 .. n beside greedy pass@1."""
    from math import comb

    from trimtab.rl.step import pass_at_k

    assert pass_at_k(8, 0, 4) == 0.0 and pass_at_k(8, 5, 4) == 1.0 and pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(8, 2, 4) == 1 - comb(6, 4) / comb(8, 4)
    seeds = []

    def every_other_right(prompts, seed):  # greedy: all wrong; sampled: the odd-indexed ones right
        seeds.append(seed)
        return [Rollout(p, [ord("x" if seed is not None and k % 2 else "y"), EOS], [-1.0] * 2, False)
                for k, p in enumerate(prompts)]  # fmt: skip

    ours = loader(held_out_samples=4)
    ours.held_out, ours.policy = [Problem("q1", "x"), Problem("q2", "x")], every_other_right
    try:
        first, again = ours.evaluate(), ours.evaluate()
    finally:
        ours.close()
    assert first["rl/held_out_pass@1"] == 0.0 and "rl/held_out_pass@8" not in first
    assert first["rl/held_out_pass@2"] == 1 - comb(2, 2) / comb(4, 2) and first["rl/held_out_pass@4"] == 1.0
    assert first == again and seeds[1] == seeds[3] is not None  # the same draw at each evaluation


def test_the_step_reports_its_groups_verifier_scores_without_the_overlong_penalty_and_its_temperature():
    """rule rl_reward's figures: each drawn group's mean score by the verifier alone (the
    overlong penalty is shaping: it is taken back out), summed and squared over the groups, and
    the temperature the responses were sampled at."""

    def cut_first(prompts, seed):  # the first response of each group runs to the budget (wrong), the second is right
        return [
            Rollout(p, [ord("y")] * 3, [-1.0] * 3, True, temperature=0.7)
            if k % 2 == 0
            else Rollout(p, [ord("x"), EOS], [-1.0] * 2, False, temperature=0.7)
            for k, p in enumerate(prompts)
        ]

    ours = loader(max_new_tokens=3)
    ours.overlong_buffer = 2  # 3 tokens: -1; 2 tokens: -0.5
    ours.policy = cut_first
    try:
        batch = ours.next_batch()
    finally:
        ours.close()
    assert batch.rewards == [-1.0, 0.5] * 2  # trained with the penalty
    health = batch.health
    assert health["score_n"] == 2 and health["score"] == pytest.approx(1.0) and health["score_sq"] == pytest.approx(0.5)
    assert health["temperature"] == pytest.approx(0.7)


def test_a_step_whose_generation_ran_out_of_memory_draws_the_same_prompts_again():
    """The trainer asks again after an out-of-memory error (the orchestrator halves the passes):
    the retry answers the prompts the failed draw took, with its sampling seeds, as a run that
    never failed does (they were left out of the epoch before)."""
    import torch

    calls = []

    def fails_once(prompts, seed):
        calls.append(seed)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")
        return policy(prompts, seed)

    failing, clean = loader(), loader()
    failing.policy = fails_once
    try:
        with pytest.raises(torch.OutOfMemoryError):
            failing.next_batch()
        again, first = failing.next_batch(), clean.next_batch()
    finally:
        failing.close()
        clean.close()
    assert again.rows == first.rows and again.rewards == first.rewards and calls[0] == calls[1]
    assert again.sums == first.sums  # the figures too: the failed draw counted nothing


def test_an_overlong_penalty_over_the_whole_budget_is_answered_as_failed():
    """`ctl overlong-penalty N` with N >= rl.max_new_tokens changes nothing: it is a failure
    ("failed: ...", so the journal marks it and ctl's .error answers it), not "applied"."""
    from types import SimpleNamespace

    from trimtab.config import load_config
    from trimtab.training.control import Control

    loader = object.__new__(RolloutLoader)
    loader.overlong_buffer, loader.overlong_filter = 0, False
    cfg = load_config(preset="debug", sets=["rl.enabled=true", "rl.max_new_tokens=6"])
    trainer = SimpleNamespace(cfg=cfg, loader=loader, state=SimpleNamespace(rl_overlong_buffer=None))
    control, said = Control(trainer), []
    control.request("set_overlong_penalty", on_done=said.append, tokens=6)
    control.request("set_overlong_penalty", on_done=said.append, tokens=2)
    control.apply()
    assert said[0].startswith("failed: ") and "must be under rl.max_new_tokens (6)" in said[0]
    assert not said[1].startswith("failed") and loader.overlong_buffer == 2
