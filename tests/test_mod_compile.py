"""Mixture-of-Depths under torch.compile: the capacity warm-up changes k = ceil(capacity * T) every
step, and a gathered [B, k] block input was a new shape and a guard on the capacity's value each
step (debug-mod with train.compile=true: 49 s a step on 2 CPU cores). Compiled, the warm-up now
masks the same top-k over all T tokens (model/mod.py _warming); eager keeps the gather. The
first two tests take the compiled path eagerly (`compiled_path`), to see its shapes and values."""

from __future__ import annotations

import pytest
import torch

from trimtab.config import ModelConfig
from trimtab.model import build_model
from trimtab.model.mod import DepthRouter

pytestmark = pytest.mark.usefixtures("one_thread")


def model(warmup_steps, capacity=0.25, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, layer_pattern=["dense", "mod"]
    )
    cfg.mod.capacity, cfg.mod.warmup_steps = capacity, warmup_steps
    return build_model(cfg).train()


@pytest.fixture
def compiled_path(monkeypatch):
    """The code paths torch.compile traces (model/layers.py's and mod.py's), run eagerly."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)


def test_the_warm_up_runs_the_block_on_one_shape_whatever_the_capacity(compiled_path):
    """The shape f sees is [B, T, D] at every warm-up step (it was [B, k, D], k falling each
    step), and [B, k, D] at the target once warmed up: one shape per phase."""
    router = DepthRouter(8, capacity=0.25, warmup_steps=10, predictor_loss_coef=0.01).train()
    x = torch.randn(2, 16, 8)
    cos = torch.zeros(16, 1, 2)
    shapes = {}

    def f(xs, rope, mask, cache, layer):
        shapes[step] = xs.shape
        return xs

    for step in range(13):
        router.set_step(step)
        router(x, f, (cos, cos), None, 0)
    assert {shapes[s] for s in range(10)} == {torch.Size([2, 16, 8])}
    assert {shapes[s] for s in range(10, 13)} == {torch.Size([2, 4, 8])}


@pytest.mark.parametrize("step", [3, 7])
def test_the_masked_warm_up_computes_what_the_gather_did(step, monkeypatch):
    """Mid warm-up, the masked forward (compiled) equals the gathered one (eager) at the same
    capacity: output, predictor loss, stats and the router's gradient."""
    warming = model(warmup_steps=10)
    warming.set_step(step)
    router = warming.blocks[1].depth
    assert router.warming and 0.25 < router.capacity < 1
    gathered = model(warmup_steps=0, capacity=router.capacity)
    gathered.load_state_dict(warming.state_dict())
    assert not gathered.blocks[1].depth.warming
    tokens = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(step))
    outs = []
    for m, compiling in ((warming, True), (gathered, False)):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda c=compiling: c)
        out = m(tokens)
        (out.square().mean() + m.blocks[1].depth.aux_loss).backward()
        outs.append((out, m.blocks[1].depth))
    (a, ra), (b, rb) = outs
    assert (a - b).abs().max().item() < 1e-4
    assert abs(ra.aux_loss.item() - rb.aux_loss.item()) < 1e-6
    for key in ("capacity", "predictor_acc", "gate"):
        assert abs(ra.stats[key].item() - rb.stats[key].item()) < 1e-5, key
    assert torch.allclose(ra.router.weight.grad, rb.router.weight.grad, atol=1e-5, rtol=1e-3)


def test_a_compiled_warm_up_compiles_twice_not_every_step():
    """Guards only (the eager backend), each block compiled as train.compile does: the MoD block
    compiles once at capacity 1, once more when the capacity first changes (torch.compile then
    takes it as an input), and not again (the dense block once); no graph breaks. Before: a new
    graph each step, and graph breaks at SDPA's is_causal and in `_top_k`."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = model(warmup_steps=20, capacity=0.5)
    for block in m.blocks:
        block.compile(backend="eager")
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    try:
        for step in range(6):
            m.set_step(step)
            m.hidden(tokens).sum().backward()
        assert counters["stats"]["unique_graphs"] == 1 + 2, dict(counters["stats"])
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
