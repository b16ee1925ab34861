"""Mixture-of-Depths: top-k routing that really skips compute, a causal predictor that decides at
inference (full forward, prefill and cached decoding agree), capacity warm-up, and the FLOPs
formula."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from trimtab.config import ModelConfig
from trimtab.errors import ConfigError
from trimtab.model import build_model
from trimtab.model.mod import DepthRouter

pytestmark = pytest.mark.usefixtures("one_thread")


def model(pattern=("mod",), capacity=0.5, seed=0, **mod):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64, layer_pattern=list(pattern)
    )
    cfg.mod.capacity = capacity
    for key, value in mod.items():
        setattr(cfg.mod, key, value)
    m = build_model(cfg)
    with torch.no_grad():  # a predictor far from its init, so some tokens are processed and some not
        for _, router in m.mod_layers():
            router.predictor[2].weight.mul_(30)
    return m


def test_training_runs_the_block_on_the_top_k_tokens_only():
    router = DepthRouter(8, capacity=0.25, warmup_steps=0, predictor_loss_coef=0.01)
    router.train()
    x = torch.randn(2, 16, 8)
    seen = []

    def f(xs, rope, mask, cache, layer):
        seen.append((xs.clone(), rope[0].shape))
        return torch.ones_like(xs)

    cos = torch.arange(16.0).view(16, 1, 1).expand(16, 1, 2)
    out = router(x, f, (cos, cos), None, 0)
    xs, rope_shape = seen[0]
    assert xs.shape == (2, 4, 8) and rope_shape == (2, 4, 1, 2)  # k = 0.25 * 16; per-token positions
    score = router.router(x).squeeze(-1)
    top = score.topk(4, -1).indices.sort(-1).values
    assert torch.equal(xs, x.gather(1, top.unsqueeze(-1).expand(2, 4, 8)))  # chosen, in causal order
    changed = (out != x).any(-1)
    assert changed.sum(-1).tolist() == [4, 4] and torch.equal(changed.nonzero()[:, 1].view(2, 4), top)
    gate = torch.sigmoid(score.gather(1, top))
    assert torch.allclose(out.gather(1, top.unsqueeze(-1).expand(2, 4, 8)) - xs, gate.unsqueeze(-1).expand(2, 4, 8))
    assert router.aux_loss > 0 and router.stats["capacity"] == 0.25


def test_the_router_learns_from_the_loss_and_the_predictor_from_its_own_bce():
    m = model()
    m.train()
    m(torch.randint(0, 97, (2, 32))).sum().backward()
    router = m.blocks[0].depth
    assert router.router.weight.grad.abs().sum() > 0  # through the gate
    assert router.predictor[0].weight.grad is None  # the predictor reads detached input
    m.zero_grad()
    m(torch.randint(0, 97, (2, 32)))
    m.aux_loss().backward()
    assert router.predictor[0].weight.grad.abs().sum() > 0
    assert m.blocks[0].attn.qkv.weight.grad is None  # the BCE does not steer the model


def test_compute_is_really_skipped():
    """Matmul FLOPs counted in a training step (forward + backward) follow flops_per_token: at
    capacity 0.5 the blocks' weights do half the work. (The counter sees no attention FLOPs on
    CPU, so the formula's attention term, 12 * D * T * c^2 per layer and token, is left out.)"""
    tokens = torch.randint(0, 97, (4, 64))

    def counted(capacity):
        m = model(capacity=capacity)
        m.train()
        with FlopCounterMode(display=False) as counter:
            (m(tokens).sum() + m.aux_loss()).backward()
        attention = 12 * 32 * 64 * 4 * capacity**2
        return counter.get_total_flops(), (m.flops_per_token(64) - attention) * tokens.numel()

    half, half_formula = counted(0.5)
    full, full_formula = counted(1.0)
    assert half == pytest.approx(half_formula, rel=0.01) and full == pytest.approx(full_formula, rel=0.01)
    assert half / full < 0.55


def test_flops_formula_at_full_capacity_is_dense_plus_the_router():
    dense, mod = model(pattern=("dense",)), model(capacity=1.0)
    routing = sum(p.numel() for p in mod.blocks[0].depth.parameters())
    assert mod.flops_per_token(64) == dense.flops_per_token(64) + 6 * 4 * routing
    assert mod.num_params() == dense.num_params() + 4 * routing


@pytest.mark.parametrize("pattern", [("mod",), ("dense", "moe+mod")])
def test_inference_is_causal_and_cached_decoding_matches_the_full_forward(pattern):
    m = model(pattern=pattern).eval()
    tokens = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        full = m(tokens)
        chosen = m.blocks[-1].depth.predictor(m.tok_emb(tokens)).squeeze(-1) > 0
        assert 0 < chosen.float().mean() < 1  # both kinds of decision occur
        later = tokens.clone()
        later[:, 30:] = (later[:, 30:] + 1) % 97
        assert torch.allclose(m(later)[:, :30], full[:, :30], atol=1e-5)  # no look-ahead
        cache = m.new_cache(2)
        parts = [m(tokens[:, :12], cache), m(tokens[:, 12:20], cache)]  # prefill, then a chunk
        parts += [m(tokens[:, t : t + 1], cache) for t in range(20, 40)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)
    assert not cache.keep[len(m.blocks) - 1][:, :40].all()  # skipped tokens wrote no keys


def test_capacity_warms_up_from_one_to_the_target():
    router = DepthRouter(8, capacity=0.25, warmup_steps=10, predictor_loss_coef=0.0)
    caps = []
    for step in (0, 5, 10, 50):
        router.set_step(step)
        caps.append(router.capacity)
    assert caps == [1.0, pytest.approx(0.625), 0.25, 0.25]
    assert router.tokens(64) == 16


def test_per_layer_capacity_and_its_errors():
    m = model(pattern=("dense", "mod"), layer_capacity=[0.5, 0.125])
    assert [r.target for _, r in m.mod_layers()] == [0.5, 0.125]
    with pytest.raises(ConfigError, match=r"model.mod.layer_capacity.*one per"):
        model(pattern=("mod",), layer_capacity=[0.5])
    with pytest.raises(ConfigError, match=r"model.mod.layer_capacity\[1\]"):
        model(pattern=("dense", "mod"), layer_capacity=[0.5, 1.5])
