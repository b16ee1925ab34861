"""Rollouts (rl/rollout.py): a batch of ragged prompts generated at once on a left-padded KV
cache, for every kind of layer (dense, MoE, Mixture-of-Depths, both)."""

from __future__ import annotations

import pytest
import torch

from trimtab.config import ModelConfig
from trimtab.model import Transformer, build_model
from trimtab.rl.rollout import generate
from trimtab.sampling import generate as generate_one

V, EOS = 97, 0
PROMPTS = [[5, 9, 13], [7, 3, 2, 8, 11, 4, 6], [21], [30, 31, 32, 33, 34]]


def model(pattern: list[str]) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    m = build_model(ModelConfig(**{**vars(cfg), "layer_pattern": pattern}))
    with torch.no_grad():  # peaked distributions: greedy ties are out of reach, samples differ visibly
        for p in m.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    return m.eval()  # the full forwards below: no MoE capacity (a training forward's), as in decoding


@pytest.mark.parametrize("pattern", [[], ["moe"], ["dense", "mod"], ["moe+mod"]])
def test_a_ragged_batch_generates_each_prompt_as_alone_with_its_behaviour_logprobs(pattern):
    m = model(pattern)
    rollouts = generate(m, PROMPTS, 12, EOS, temperature=0.0)
    for prompt, r in zip(PROMPTS, rollouts, strict=True):
        assert r.tokens == generate_one(m, prompt, 12, temperature=0.0, eos_id=EOS), prompt
        # each token's log-probability, from one forward over the whole sequence without a cache
        with torch.no_grad():
            full = torch.log_softmax(m(torch.tensor([prompt + r.tokens]))[0].float(), -1)
        expected = [float(full[len(prompt) - 1 + i, t]) for i, t in enumerate(r.tokens)]
        assert r.logprobs == pytest.approx(expected, abs=1e-4)
        assert r.truncated == (EOS not in r.tokens) and len(r.tokens) <= 12


def test_rows_stop_at_end_of_text_and_sampling_is_seeded():
    m = model([])
    rows = PROMPTS * 4
    first = generate(m, rows, 20, 3, temperature=1.0, generator=torch.Generator().manual_seed(1), version=7)
    again = generate(m, rows, 20, 3, temperature=1.0, generator=torch.Generator().manual_seed(1), version=7)
    assert [r.tokens for r in first] == [r.tokens for r in again]
    assert len({tuple(r.tokens) for r in first}) > len(PROMPTS)  # a group's samples differ
    for r in first:
        assert (3 in r.tokens) != r.truncated and r.tokens.count(3) <= 1 and r.version == 7
        if not r.truncated:
            assert r.tokens[-1] == 3
        # temperature 1: each behaviour log-probability is the model's own
        with torch.no_grad():
            full = torch.log_softmax(m(torch.tensor([r.prompt + r.tokens]))[0].float(), -1)
        assert r.logprobs == pytest.approx(
            [float(full[len(r.prompt) - 1 + i, t]) for i, t in enumerate(r.tokens)], abs=1e-4
        )


def test_prompts_the_model_cannot_hold_are_refused():
    m = model([])
    with pytest.raises(ValueError, match="every prompt needs 1 to 31 tokens"):
        generate(m, [[1] * 32], 4, EOS)
    with pytest.raises(ValueError, match="every prompt needs"):
        generate(m, [[1], []], 4, EOS)
