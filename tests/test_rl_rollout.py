"""Rollouts (rl/rollout.py): a batch of ragged prompts generated at once on a left-padded KV
cache, for every kind of layer (dense, MoE, Mixture-of-Depths, both)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trimtab.config import ModelConfig
from trimtab.model import Transformer, build_model
from trimtab.rl.replay import collate, collate_rollouts, recording, replaying
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
        at = full[len(prompt) - 1 : len(prompt) - 1 + len(r.tokens)]  # the distributions drawn from
        assert r.entropy == pytest.approx(float(-(at.exp() * at).sum(-1).mean()), abs=1e-4)
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


def _batch_logprobs(m: Transformer, rollouts, experts=None, depth: bool = False, decided=None) -> list[list[float]]:
    """Each response token's log-probability from one training-mode forward over the rollouts,
    right-padded into one batch as rl/batches.py collates them."""
    width = max(len(r.prompt) + len(r.tokens) - 1 for r in rollouts)
    inputs = torch.full((len(rollouts), width), EOS)
    for b, r in enumerate(rollouts):
        seq = r.prompt + r.tokens
        inputs[b, : len(seq) - 1] = torch.tensor(seq[:-1])
    m.train()
    with torch.no_grad(), replaying(m, experts, depth, decided):
        full = torch.log_softmax(m(inputs).float(), -1)
    m.eval()
    return [[float(full[b, len(r.prompt) - 1 + i, t]) for i, t in enumerate(r.tokens)] for b, r in enumerate(rollouts)]


def test_routing_replay_gives_the_training_forward_the_routing_generation_chose():
    """A MoE policy whose training forward drops tokens past a capacity (generation never does)
    and rounds differently: replaying generation's experts (rl/replay.py) brings the training
    forward's log-probabilities back to the behaviour ones."""
    m = model(["moe"])
    for _, layer in m.moe_layers():
        layer.capacity_factor = 1.0  # tight: a training forward drops some assignments
    g = torch.Generator().manual_seed(3)
    prompts = [p for p in PROMPTS for _ in range(4)]
    rollouts = generate(m, prompts, 10, EOS, temperature=1.0, generator=g, record_routing=True)
    for r in rollouts:  # every input position of its own: prompt, then the fed response tokens
        assert r.experts.shape == (2, len(r.prompt) + len(r.tokens) - 1, 2) and r.experts.dtype == np.int16
    # the prompt's choices are the ones a full forward over the prompt alone makes
    alone = rollouts[1]
    with recording(m, 1) as routes:
        m(torch.tensor([alone.prompt]))
    assert (routes.sequence(0, 0, len(alone.prompt)) == alone.experts[:, : len(alone.prompt)]).all()

    behaviour = [r.logprobs for r in rollouts]
    replayed = _batch_logprobs(
        m,
        rollouts,
        collate([r.experts for r in rollouts], width=max(len(r.prompt) + len(r.tokens) - 1 for r in rollouts)),
    )
    for got, want in zip(replayed, behaviour):
        assert got == pytest.approx(want, abs=1e-4)
    unreplayed = _batch_logprobs(m, rollouts)
    worst = max(abs(a - b) for got, want in zip(unreplayed, behaviour) for a, b in zip(got, want))
    assert worst > 1e-2  # the capacity's drops, without replay
    assert all(layer.replay is None and layer.recorded is None for _, layer in m.moe_layers())
    assert generate(m, PROMPTS, 4, EOS, temperature=0.0)[0].experts is None  # off by default


def test_routing_replay_routes_a_mixture_of_depths_policy_by_its_predictor_as_generation_does():
    """A MoD policy's training forward sends the top-k tokens at its capacity through a block,
    generation those its causal predictor picks: replayed (rl/replay.py, depth), the training
    forward routes by the predictor and its log-probabilities are the behaviour ones."""
    m = model(["dense", "mod"])
    for _, router in m.mod_layers():
        router.capacity = 0.5
    g = torch.Generator().manual_seed(3)
    rollouts = generate(m, [p for p in PROMPTS for _ in range(4)], 10, EOS, temperature=1.0, generator=g)
    behaviour = [r.logprobs for r in rollouts]
    for got, want in zip(_batch_logprobs(m, rollouts, depth=True), behaviour):
        assert got == pytest.approx(want, abs=1e-4)
    worst = max(abs(a - b) for got, want in zip(_batch_logprobs(m, rollouts), behaviour) for a, b in zip(got, want))
    assert worst > 1e-2  # top-k at half the tokens, without replay
    assert all(not router.replay for _, router in m.mod_layers())


def test_routing_replay_of_a_moe_mod_block_its_predictor_passes_over_keeps_every_forwards_record():
    """A MoE inside a Mixture-of-Depths block ran on no token at a decode step its predictor sent every token past,
    and recorded nothing there: the sequences' choices did not line up ('all input arrays must have the same
    shape', every debug-hybrid RL run at its first rollouts). Each such forward now records placeholders, and a
    replayed training forward that runs the block on no token leaves no aux_loss whose graph a backward freed."""
    m = model(["moe", "moe+mod"])
    (_, router), (_, inner) = m.mod_layers()[0], m.moe_layers()[1]
    with torch.no_grad():
        router.predictor[-1].weight.zero_()  # the predictor's output 0: no token goes through the block
    rollouts = generate(m, [p for p in PROMPTS for _ in range(2)], 6, EOS, generator=torch.Generator().manual_seed(1),
                        record_routing=True)  # fmt: skip
    for r in rollouts:
        assert r.experts.shape == (2, len(r.prompt) + len(r.tokens) - 1, 2)
        assert (r.experts[1] == [0, 1]).all()  # the passed-over tokens' placeholders, as collate's padding
    width = max(len(r.prompt) + len(r.tokens) - 1 for r in rollouts)
    replayed = _batch_logprobs(m, rollouts, collate([r.experts for r in rollouts], width=width), depth=True)
    for got, r in zip(replayed, rollouts):
        assert got == pytest.approx(r.logprobs, abs=1e-4)
    m.train()
    inputs = torch.tensor([rollouts[0].prompt])
    (m(inputs).sum() + m.aux_loss()).backward()  # a top-k forward: the inner MoE's aux_loss, its graph then freed
    assert inner.aux_loss is not None
    with replaying(m, collate([rollouts[0].experts[:, : inputs.shape[1]]], inputs.shape[1]), depth=True):
        logits = m(inputs)
    assert inner.aux_loss is None
    (logits.sum() + m.aux_loss()).backward()  # before: "Trying to backward through the graph a second time"


def test_routing_replay_imposes_the_mixture_of_depths_decisions_generation_made():
    """Generation records each Mixture-of-Depths block's decisions (Rollout.depth) and the replayed training
    forward takes them, not the predictor's answer asked again: that answer's input, decoded on the KV cache,
    rounds otherwise than a whole sequence's, and a near-tie at 0 flips (as a router's top-k does). Here the
    predictor changed after generation (every decision flips): replayed by the predictor the log-probabilities
    move, by the record they are the behaviour ones."""
    m = model(["dense", "mod"])
    g = torch.Generator().manual_seed(3)
    rollouts = generate(m, [p for p in PROMPTS for _ in range(4)], 10, EOS, generator=g, record_routing=True)
    (_, router), alone = m.mod_layers()[0], rollouts[1]
    for r in rollouts:
        assert r.depth.shape == (1, len(r.prompt) + len(r.tokens) - 1) and r.depth.dtype == bool
        assert r.experts is None  # no MoE layer
    with torch.no_grad(), recording(m, 1) as routes:  # the prompt's: a full forward's over the prompt alone
        m(torch.tensor([alone.prompt]))
    assert (routes.decisions(0, 0, len(alone.prompt)) == alone.depth[:, : len(alone.prompt)]).all()
    assert routes.sequence(0, 0, 1) is None and 0 < alone.depth.sum() < alone.depth.size
    with torch.no_grad():
        router.predictor[-1].weight.neg_()
    width = max(len(r.prompt) + len(r.tokens) - 1 for r in rollouts)
    _, depth = collate_rollouts(rollouts, width)
    for got, r in zip(_batch_logprobs(m, rollouts, depth=True, decided=depth), rollouts):
        assert got == pytest.approx(r.logprobs, abs=1e-4)
    asked = _batch_logprobs(m, rollouts, depth=True)
    assert max(abs(a - b) for got, r in zip(asked, rollouts) for a, b in zip(got, r.logprobs)) > 1e-2
    assert router.decided is None and router.recorded is None
    restored = type(r).from_state(json.loads(json.dumps(r.state_dict())))  # a checkpoint's queued batch
    assert (restored.depth == r.depth).all() and restored.depth.dtype == bool


class _Always(torch.nn.Module):
    """A predictor that sends every token through its block, the left pads of a ragged batch included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)


@pytest.mark.parametrize("pattern", [["dense", "mod"], ["moe+mod"]])
def test_a_left_pad_a_mixture_of_depths_predictor_chooses_is_no_key(pattern):
    """A left pad the predictor sent through a block was marked a key there (KVCache.mark), and the row's real
    tokens attended to it: debug-mod trained 150 steps, 4 prompts of 3-20 tokens generated at once, log-
    probabilities up to 0.48 off the row's own and greedy tokens other than the row's alone (RL's importance
    ratios off by as much: a mean |log ratio| of 0.058 over 6,136 tokens, now 4e-7)."""
    m = model(pattern)
    for _, router in m.mod_layers():
        router.predictor = _Always()
    rollouts = generate(m, PROMPTS, 8, EOS, temperature=0.0)
    for prompt, r in zip(PROMPTS, rollouts, strict=True):
        assert r.tokens == generate_one(m, prompt, 8, temperature=0.0, eos_id=EOS), prompt
        with torch.no_grad():
            full = torch.log_softmax(m(torch.tensor([prompt + r.tokens]))[0].float(), -1)
        assert r.logprobs == pytest.approx(
            [float(full[len(prompt) - 1 + i, t]) for i, t in enumerate(r.tokens)], abs=1e-4
        )
