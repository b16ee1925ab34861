import torch

from trimtab.config import ModelConfig
from trimtab.sampling import generate, sample_next
from trimtab.model import build_model


def tiny(max_seq_len=32):
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   max_seq_len=max_seq_len))


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(3, 50)
    best = logits.argmax(-1)
    assert torch.equal(sample_next(logits, 0.0, 0, 1.0), best)
    assert torch.equal(sample_next(logits, 1.0, 1, 1.0), best)
    assert torch.equal(sample_next(logits, 1.0, 0, 1e-6), best)


def test_top_k_and_top_p_never_sample_outside_their_set():
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0, -2.0]])
    gen = torch.Generator().manual_seed(0)
    assert {int(sample_next(logits, 1.0, 2, 1.0, gen)) for _ in range(200)} <= {0, 1}
    # probabilities ~ [.66, .24, .09, ...]: top_p 0.8 keeps the first two tokens only
    assert {int(sample_next(logits, 1.0, 0, 0.8, gen)) for _ in range(200)} == {0, 1}


def test_cached_generation_matches_full_forward_greedy():
    model = tiny()
    prompt = [5, 17, 3, 42]
    new = generate(model, prompt, 10, temperature=0.0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(10):  # the slow way: a full forward over the whole sequence each token
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert new == seq[len(prompt):]


def test_seeded_sampling_is_reproducible_and_mode_restored():
    model = tiny()
    model.train()
    a = generate(model, [1, 2, 3], 8, seed=7)
    assert a == generate(model, [1, 2, 3], 8, seed=7)
    assert model.training


def test_stops_at_eos_and_at_max_seq_len():
    model = tiny(max_seq_len=16)
    first = generate(model, [1, 2], 1, temperature=0.0)[0]
    assert generate(model, [1, 2], 10, temperature=0.0, eos_id=first) == [first]
    assert len(generate(model, [1, 2, 3, 4], 100, temperature=0.0)) == 16 - 4 + 1
