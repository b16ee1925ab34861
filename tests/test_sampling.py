"""Sampling and KV-cached generation tests (CPU, tiny model)."""

from __future__ import annotations

import pytest
import torch

from trimtab.config import ModelConfig
from trimtab.model import Transformer, build_model
from trimtab.sampling import draw, fit_prompt, generate, sample_next

V = 97


@pytest.fixture
def model() -> Transformer:
    torch.manual_seed(0)
    m = build_model(ModelConfig(vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=24))
    with torch.no_grad():  # peaked distributions, so greedy and sampled runs differ visibly
        for p in m.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    return m


def greedy_reference(m: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with full no-cache forwards."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def logits(seed: int = 0, B: int = 4) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def draws(x: torch.Tensor, n: int = 400, **kw) -> set[int]:
    g = torch.Generator().manual_seed(0)
    return {int(sample_next(x, generator=g, **kw)[0]) for _ in range(n)}


# --- sample_next ---------------------------------------------------------------------------


def test_greedy_and_degenerate_filters_are_argmax():
    x = logits()
    best = x.argmax(-1)
    assert torch.equal(sample_next(x, temperature=0.0), best)
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(top_k=5, top_p=0.0)):
        for seed in range(5):
            got = sample_next(x, temperature=1.5, generator=torch.Generator().manual_seed(seed), **kw)
            assert torch.equal(got, best), kw
    assert sample_next(x, temperature=0.0).dtype == torch.long


def test_seeded_sampling_is_reproducible_and_random():
    x = logits() / 3
    runs = [
        torch.stack([sample_next(x, 1.0, 0, 1.0, g) for _ in range(20)])
        for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7), torch.Generator().manual_seed(8))
    ]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    assert len(set(runs[0][:, 0].tolist())) > 3


def test_draws_follow_the_distribution_and_never_a_token_without_probability():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]]).repeat(20_000, 1)  # 20k rows, one draw each
    got = draw(probs, torch.Generator().manual_seed(0))
    share = torch.bincount(got, minlength=5) / len(got)
    assert share[1] == 0 and share[4] == 0  # a filtered token, and the last one
    assert torch.allclose(share, probs[0], atol=0.015)  # 0.6's standard error over 20k: 0.0035
    # a row need not sum to 1; one with a single token left draws it
    assert draw(torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 1e-30]])).tolist() == [1, 2]


def test_a_uniform_at_the_total_draws_the_last_token_with_probability_and_nan_a_valid_one(monkeypatch):
    """u = the running total (a uniform rounding up, ~2^-53): the last token with any
    probability, never the filtered ones after it; a NaN row (a policy gone NaN) any valid index."""
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.ones(*shape, dtype=kw["dtype"]))
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    assert draw(probs).tolist() == [3, 1]
    nan = draw(torch.full((2, 6), float("nan")))
    assert ((nan >= 0) & (nan < 6)).all()


def test_top_k_keeps_only_the_k_best():
    x = logits()[:1] / 3
    top3 = set(x[0].topk(3).indices.tolist())
    assert draws(x, top_k=3) == top3


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    x = probs.log()
    assert draws(x, top_p=0.7) == {1, 3}  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert draws(x, top_p=0.85) == {1, 3, 2}
    assert draws(x, top_p=1.0) == {0, 1, 2, 3}


# --- generate ------------------------------------------------------------------------------


def test_next_logits_are_the_whole_forwards_last_position(model):
    """Transformer.next_logits: the head on the last position only, as the decoders take it
    (a prompt's [B, T, V] never made), equal to the full forward's last row."""
    tokens = torch.tensor([[5, 17, 42, 3, 9], [1, 2, 3, 4, 5]])
    with torch.no_grad():
        whole = model(tokens)[:, -1]
        cache = model.new_cache(batch=2, max_len=8)
        assert torch.allclose(model.next_logits(tokens, cache), whole, atol=1e-5)
        assert cache.pos == 5  # the cache moved on as a forward's does


def test_greedy_generate_matches_uncached_decoding(model):
    prompt = [5, 17, 42, 3]
    got = generate(model, prompt, 10, temperature=0.0)
    assert got == greedy_reference(model, prompt, 10)
    assert len(set(got)) > 1


def test_sampled_generate_is_seeded(model):
    prompt = [1, 2, 3]
    a = generate(model, prompt, 12, temperature=1.0, top_k=0, top_p=1.0, seed=3)
    assert a == generate(model, prompt, 12, temperature=1.0, top_k=0, top_p=1.0, seed=3)
    assert a != generate(model, prompt, 12, temperature=1.0, top_k=0, top_p=1.0, seed=4)
    assert len(a) == 12 and all(0 <= t < V for t in a)


def test_generate_stops_at_eos(model):
    prompt = [9, 8, 7]
    ref = greedy_reference(model, prompt, 6)
    eos = ref[3]
    got = generate(model, prompt, 6, temperature=0.0, eos_id=eos)
    assert got == ref[: ref.index(eos) + 1] and got[-1] == eos


def test_generate_stops_at_max_seq_len(model):
    prompt = list(range(20))
    got = generate(model, prompt, 50, temperature=0.0)
    assert got == greedy_reference(model, prompt, 4)  # 20 + 4 = max_seq_len 24
    assert generate(model, list(range(24)), 5) == []
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, list(range(25)), 5)


def test_generate_restores_mode_and_leaves_no_grad_state(model):
    model.train()
    generate(model, [1, 2], 3)
    assert model.training
    model.eval()
    generate(model, [1, 2], 3)
    assert not model.training
    assert all(p.grad is None for p in model.parameters())


def test_a_long_prompt_is_cut_to_leave_room_for_the_new_tokens(tokenizer):
    """It was cut to context - 1 tokens, leaving one position of the max_new_tokens asked for."""
    whole = tokenizer.encode("def f(x): " * 40)
    ids, said = fit_prompt(tokenizer, "def f(x): " * 40, 64, 10)
    assert ids == whole[-54:] and said.endswith(
        "pass the model's 64 positions: the prompt is cut to its last 54 tokens"
    )
    ids, said = fit_prompt(tokenizer, "def f(x): " * 40, 64, 100)  # more than the context holds: one prompt token
    assert ids == whole[-1:] and said.endswith("at most 63 new tokens of the 100 asked for fit")
    assert fit_prompt(tokenizer, "def f(x):", 64, 10) == (tokenizer.encode("def f(x):"), "")
