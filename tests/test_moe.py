"""MoE layer: routing, capacity, losses, balancing bias, surgery, against a naive reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trimtab.config.sparse import MoEConfig
from trimtab.model import moe as moe_module
from trimtab.model.layers import SwiGLU
from trimtab.model.moe import MoE

D, H = 16, 24
GROUPED_MM = moe_module._grouped_mm


pytestmark = pytest.mark.usefixtures("one_thread")


def make(seed: int = 0, d: int = D, h: int = H, impl: str = "auto", **kw) -> MoE:
    torch.manual_seed(seed)
    kw = {"n_experts": 4, "top_k": 2, "balance_coef": 0.01, "z_loss_coef": 1e-3, **kw}
    m = MoE(d, h, MoEConfig(**kw), init_std=0.3, out_std=0.3)  # large init: far from ties
    m.impl = impl
    return m


def swiglu(x, w1, w3, w2):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Naive MoE: every expert on every token, masked; capacity kept in token order."""
    xf = x.reshape(-1, x.shape[-1])
    probs = (xf @ m.router.T / m.router_temperature).softmax(-1)
    idx = (probs.detach() + m.expert_bias).topk(m.top_k, -1).indices
    gates = probs.gather(-1, idx)
    if m.top_k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    cap = m.capacity(xf.shape[0]) if m.training else 0
    y = torch.zeros_like(xf)
    for e in range(m.n_experts):
        routed = (idx == e).any(-1)
        gate = (gates * (idx == e)).sum(-1)
        if cap:
            routed = routed & (routed.cumsum(0) <= cap)
        y = y + swiglu(xf, m.w1[e], m.w3[e], m.w2[e]) * (gate * routed)[:, None]
    if m.shared is not None:
        y = y + m.shared(xf)
    return y.view_as(x)


def grads(m: MoE, x: torch.Tensor, fn) -> dict[str, torch.Tensor]:
    m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    (fn(x) * torch.linspace(-1, 1, x.numel()).view_as(x)).sum().backward()
    out = {n: p.grad.clone() for n, p in m.named_parameters()}
    out["x"] = x.grad
    return out


def test_output_shape_train_and_eval():
    m = make(n_shared_experts=1)
    x = torch.randn(3, 5, D)
    assert m(x).shape == (3, 5, D) and m.aux_loss is not None and m.aux_loss.dim() == 0
    m.eval()
    assert m(x).shape == (3, 5, D) and m.aux_loss is None


def test_init_stds_and_zero_bias():
    torch.manual_seed(0)
    m = MoE(64, 128, MoEConfig(n_experts=8, n_shared_experts=1), init_std=0.02, out_std=0.005)
    for p, std in (
        (m.router, 0.02),
        (m.w1, 0.02),
        (m.w3, 0.02),
        (m.w2, 0.005),
        (m.shared.w1.weight, 0.02),
        (m.shared.w2.weight, 0.005),
    ):
        assert p.std().item() == pytest.approx(std, rel=0.1)
    assert (m.expert_bias == 0).all() and (m.load == 0).all()
    assert "expert_bias" in m.state_dict() and "load" not in m.state_dict()


def test_one_expert_equals_dense_swiglu():
    m = make(n_experts=1, top_k=1, capacity_factor=0.0)
    ffn = SwiGLU(D, H)
    with torch.no_grad():
        ffn.w1.weight.copy_(m.w1[0].T)
        ffn.w3.weight.copy_(m.w3[0].T)
        ffn.w2.weight.copy_(m.w2[0].T)
    x = torch.randn(2, 7, D)
    torch.testing.assert_close(m(x), ffn(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["grouped", "padded"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(capacity_factor=0.0),  # dropless
        dict(capacity_factor=1.0),  # drops
        dict(capacity_factor=1.0, top_k=1, n_experts=3),
        dict(capacity_factor=1.25, top_k=3, n_experts=6, n_shared_experts=2),
        dict(capacity_factor=0.0, top_k=1, router_temperature=0.5),
    ],
)
def test_matches_naive_reference(kw, impl):
    m = make(impl=impl, **kw)
    with torch.no_grad():
        m.router[0] += 0.5 * m.router[1]  # skew the load so capacity bites
        m.expert_bias.copy_(torch.linspace(-0.05, 0.05, m.n_experts))
    x = torch.randn(4, 9, D)
    torch.testing.assert_close(m(x), reference(m, x), rtol=1e-5, atol=1e-5)
    if kw["capacity_factor"] == 1.0:
        assert m.stats["dropped"] > 0
    got, want = grads(m, x, m), grads(m, x, lambda t: reference(m, t))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
    m.eval()  # eval is dropless whatever the capacity factor
    torch.testing.assert_close(m(x), reference(m, x), rtol=1e-5, atol=1e-5)


def _all_to(m: MoE, experts: list[int]) -> torch.Tensor:
    """Router and input so that every token picks `experts`; returns x [2, 16, D]."""
    with torch.no_grad():
        m.router.zero_()
        for rank, e in enumerate(experts):
            m.router[e, 0] = 10.0 - rank
    x = torch.randn(2, 16, D)
    x[..., 0] = 1.0 + x[..., 0].abs()
    return x


@pytest.mark.parametrize("impl", ["grouped", "padded"])
@pytest.mark.parametrize("top_k,capacity_factor,dropped", [(1, 1.0, 0.75), (2, 1.0, 0.5), (1, 2.0, 0.5), (1, 0.0, 0.0)])
def test_capacity_drops_the_right_fraction_in_token_order(top_k, capacity_factor, dropped, impl):
    m = make(top_k=top_k, capacity_factor=capacity_factor, impl=impl)
    x = _all_to(m, [0, 1][:top_k])  # N = 32 tokens on top_k experts; C = cf * 32 * k / 4
    y = m(x).reshape(32, D)
    assert m.stats["dropped"].item() == pytest.approx(dropped)
    kept = round(32 * (1 - dropped))
    assert y[:kept].abs().sum(-1).gt(0).all()
    assert (y[kept:] == 0).all()  # dropped tokens: zero output, the residual carries them
    m.capacity_factor = 0.0  # live-adjustable
    m(x)
    assert m.stats["dropped"].item() == 0.0


def test_under_compile_bf16_takes_the_grouped_layout(monkeypatch):
    """torch.compile traces grouped_mm in bf16, with or without a capacity (whole graphs;
    padded's largest-load read broke the graph at every MoE layer); fp32 stays padded."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = torch.randn(2, 8, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert make(capacity_factor=0).grouped_layout(x)
        assert make(capacity_factor=1.25).grouped_layout(x)
    assert not make(capacity_factor=0).grouped_layout(x)  # fp32: grouped_mm's fake kernel rejects it


@pytest.mark.slow
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_a_compiled_moe_layer_in_bf16_is_one_graph_and_matches_eager(capacity_factor):
    m = make(capacity_factor=capacity_factor)
    with torch.no_grad():
        m.router[0] += 0.5 * m.router[1]  # skew the load so capacity bites
    x = torch.randn(2, 16, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(m)(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        torch.testing.assert_close(torch.compile(m)(x), m(x), rtol=1e-2, atol=1e-2)
    assert (m.stats["dropped"] > 0) == (capacity_factor > 0)


class _Uninitialised(torch.autograd.Function):
    """grouped_mm as CUDA runs it: the rows past the last offset come back uninitialised, in the
    output and in the input's gradient (NaN here: garbage that spreads if read)."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        out = GROUPED_MM(a, b, offs=offs)
        out[int(offs[-1]) :] = math.nan
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        with torch.enable_grad():
            a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
            ga, gb = torch.autograd.grad(GROUPED_MM(a, b, offs=offs), (a, b), grad)
        ga = ga.clone()
        ga[int(offs[-1]) :] = math.nan
        return ga, gb, None


def test_dropped_rows_past_the_last_offset_are_never_read(monkeypatch):
    """With a capacity, the grouped layout passes every assignment, the dropped ones after the
    last offset (a static shape, no host read); what grouped_mm leaves there must not reach the
    output or any gradient."""
    m = make(capacity_factor=1.0, impl="grouped")
    with torch.no_grad():
        m.router[0] += 0.5 * m.router[1]
    x = torch.randn(4, 9, D)
    want_y, want = m(x), grads(m, x, m)
    assert m.stats["dropped"] > 0
    monkeypatch.setattr(moe_module, "_grouped_mm", lambda a, b, offs: _Uninitialised.apply(a, b, offs))
    assert torch.equal(m(x), want_y)
    got = grads(m, x, m)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_layout_choice_and_autocast():
    x = torch.randn(2, 8, D)
    assert make().grouped_layout(x) and not make(h=6).grouped_layout(x)  # 24-byte rows
    assert not make(impl="padded").grouped_layout(x)
    grouped, padded = make(), make(impl="padded")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # both layouts compute in bf16
        a, b = grouped(x), padded(x)
    assert a.dtype == b.dtype == torch.bfloat16
    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(a.float(), reference(grouped, x), rtol=0.05, atol=0.05)


def test_gradients_reach_router_experts_and_shared():
    for top_k in (1, 2):  # top-1 keeps the raw prob as gate, so the router still learns
        m = make(top_k=top_k, n_shared_experts=1, balance_coef=0.0, z_loss_coef=0.0)
        m(torch.randn(2, 8, D)).square().sum().backward()
        for name, p in m.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert m.aux_loss is None
    m = make()
    m(torch.randn(2, 8, D))
    m.aux_loss.backward()  # the aux loss alone trains the router
    assert m.router.grad.abs().sum() > 0


def test_router_jitter_is_multiplicative_training_only_and_routing_only():
    m = make(router_jitter=0.3)
    x = torch.randn(3, 8, D)
    a, b = m.route(x.reshape(-1, D)), m.route(x.reshape(-1, D))
    assert not torch.equal(a.logits, b.logits)
    assert (m.route(torch.zeros(4, D)).logits == 0).all()  # multiplicative: 0 stays 0
    xf, w = x.reshape(-1, D), m.router.detach()
    bound = 0.3 * (xf.abs() @ w.abs().T)  # |sum_d x_d (u_d - 1) w_ed| with |u_d - 1| <= 0.3
    assert ((a.logits - xf @ w.T).abs() <= bound + 1e-5).all()
    m.eval()
    torch.testing.assert_close(m(x), reference(m, x), rtol=1e-5, atol=1e-5)
    one = make(n_experts=1, top_k=1, router_jitter=0.5)  # experts see the clean input
    one.eval()
    clean_out = one(x)
    one.train()
    torch.testing.assert_close(one(x), clean_out, rtol=1e-5, atol=1e-6)


def test_aux_and_z_loss_hand_checked():
    m = make(d=2, n_experts=2, top_k=1, balance_coef=0.1, z_loss_coef=0.01)
    with torch.no_grad():
        m.router.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    ln3 = math.log(3.0)
    x = torch.tensor([[[ln3, 0.0]] * 3 + [[-ln3, 0.0]]])  # probs (.75, .25) x3 and (.25, .75)
    m(x)
    f, p = torch.tensor([0.75, 0.25]), torch.tensor([0.625, 0.375])
    balance = 2 * (f * p).sum()  # = 1.125
    z = (3 * math.log(4.0) ** 2 + math.log(4 / 3) ** 2) / 4
    assert m.stats["balance_loss"].item() == pytest.approx(1.125, abs=1e-6)
    assert m.stats["balance_loss"].item() == pytest.approx(balance.item(), abs=1e-6)
    assert m.stats["z_loss"].item() == pytest.approx(z, abs=1e-6)
    assert m.aux_loss.item() == pytest.approx(0.1 * 1.125 + 0.01 * z, abs=1e-6)
    torch.testing.assert_close(m.stats["tokens_per_expert"], torch.tensor([3.0, 1.0]))
    m.aux_loss.backward()  # both terms are differentiable (f is a constant, as in Switch)
    logits = x[0] @ m.router.T
    want = 0.1 * 2 * (f * logits.softmax(-1).mean(0)).sum() + 0.01 * logits.logsumexp(-1).square().mean()
    torch.testing.assert_close(m.router.grad, torch.autograd.grad(want, m.router)[0])
    with torch.no_grad():
        m.router.zero_()  # uniform router: balance 1, z = log(E)^2, entropy log(E)
    m(x)
    assert m.stats["balance_loss"].item() == pytest.approx(1.0)
    assert m.stats["z_loss"].item() == pytest.approx(math.log(2.0) ** 2)
    assert m.stats["entropy"].item() == pytest.approx(math.log(2.0))


def test_stats_shapes_and_sums():
    m = make(n_experts=6, top_k=3, capacity_factor=1.0)
    m(torch.randn(3, 10, D))
    s = m.stats
    assert set(s) == {"tokens_per_expert", "dropped", "entropy", "balance_loss", "z_loss"}
    assert s["tokens_per_expert"].shape == (6,) and s["tokens_per_expert"].dtype == torch.float32
    assert s["tokens_per_expert"].sum().item() == 30 * 3
    assert all(s[k].dim() == 0 for k in ("dropped", "entropy", "balance_loss", "z_loss"))
    assert 0 <= s["dropped"] < 1 and 0 < s["entropy"] <= math.log(6)
    assert not any(v.requires_grad for v in s.values())


def test_update_bias_moves_toward_underloaded_experts():
    m = make(top_k=1, bias_update_rate=0.01, capacity_factor=0.0)
    x = _all_to(m, [0])  # all load on expert 0
    x[..., 0] = 1.0  # identical logits gap for every token, so the bias can flip them
    with torch.no_grad():
        m.router[:, 0] = torch.tensor([0.05, 0.0, 0.0, 0.0])
    m(x)
    m(x)  # micro-batches accumulate
    torch.testing.assert_close(m.load, torch.tensor([64.0, 0, 0, 0]))
    m.update_bias()
    b = m.expert_bias
    assert b[0] < 0 and (b[1:] > 0).all() and abs(b.sum().item()) < 1e-6
    assert (m.load == 0).all()
    for _ in range(10):
        m(x)
        m.update_bias()
    assert m.stats["tokens_per_expert"][0] == 0  # the bias moved the tokens away
    # Gates come from probs alone: the bias picks experts but does not weigh them.
    r = m.route(x.reshape(-1, D))
    torch.testing.assert_close(r.gates, r.probs.gather(-1, r.experts))
    torch.testing.assert_close(m(x), reference(m, x), rtol=1e-5, atol=1e-6)
    load = m.load.clone()
    m.eval()  # eval forwards do not count
    m(x)
    torch.testing.assert_close(m.load, load)


def test_a_withheld_step_withholds_the_bias_update_too():
    # The update gate skips a bad step's optimizer update; its routing must not move the bias either
    # (it did: a stretch of bad batches steered the aux-loss-free bias while their updates were withheld).
    m = make(top_k=1, bias_update_rate=0.01, capacity_factor=0.0)
    m(_all_to(m, [0]))
    m.update_bias(torch.tensor(True))
    assert (m.expert_bias == 0).all() and (m.load == 0).all()  # the bad step's load is dropped, not carried
    m(_all_to(m, [0]))
    m.update_bias(torch.tensor(False))
    assert m.expert_bias[0] < 0


def test_update_bias_noop_at_rate_zero_and_checkpoint_counts_once():
    m = make(bias_update_rate=0.0)
    m(torch.randn(2, 8, D))
    m.update_bias()
    assert (m.expert_bias == 0).all() and (m.load == 0).all()
    m = make(bias_update_rate=1e-3)
    x = torch.randn(2, 8, D, requires_grad=True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # re-run all of forward
        checkpoint(m, x, use_reentrant=False).sum().backward()
    assert m.load.sum().item() == 16 * 2


def test_add_expert_splits_the_source():
    m = make(top_k=2).eval()
    x = torch.randn(4, 8, D)
    xf = x.reshape(-1, D)
    before, first = m(x).reshape(-1, D), m.route(xf).experts[:, 0]
    src = int(m.stats["tokens_per_expert"].argmax())
    new = m.add_expert(source=src, noise=0.0)
    assert new == 4 and m.n_experts == 5
    assert m.router.shape == (5, D) and m.w1.shape == (5, D, H) and m.w2.shape == (5, H, D)
    assert m.expert_bias.shape == m.load.shape == (5,)
    after = m(x).reshape(-1, D)
    # Tokens whose first choice was the source now use the source and its copy (so get the
    # source's output alone); every other token's output is unchanged.
    top = first == src
    torch.testing.assert_close(after[~top], before[~top], rtol=1e-5, atol=1e-6)
    alone = swiglu(xf[top], m.w1[src], m.w3[src], m.w2[src])
    torch.testing.assert_close(after[top], alone, rtol=1e-5, atol=1e-6)
    m.train()
    m(x).sum().backward()
    assert m.w1.grad.shape == (5, D, H)


def test_add_expert_top1_shares_tokens_and_defaults_to_most_loaded():
    m = make(top_k=1, capacity_factor=0.0, bias_update_rate=1e-3)
    with torch.no_grad():
        m.router[2] += 0.5  # most tokens to expert 2
    x = torch.randn(8, 16, D)
    m(x)
    old = m.stats["tokens_per_expert"].clone()
    assert old.argmax() == 2
    assert m.add_expert(noise=0.01) == 4  # source defaults to the most loaded: 2
    torch.testing.assert_close(m.w1[4], m.w1[2], rtol=0.1, atol=0.05)
    assert m.load[2] == m.load[4] == old[2] / 2
    m(x)
    new = m.stats["tokens_per_expert"]
    assert new[2] + new[4] == old[2] and new[2] > 0 and new[4] > 0
    torch.testing.assert_close(new[[0, 1, 3]], old[[0, 1, 3]])


def test_prune_expert():
    m = make(n_experts=4, top_k=2)
    old = m.router.detach().clone()
    m.prune_expert(1)
    assert m.n_experts == 3 and m.w3.shape == (3, D, H) and m.expert_bias.shape == (3,)
    torch.testing.assert_close(m.router.detach(), old[[0, 2, 3]])
    x = torch.randn(2, 8, D)
    torch.testing.assert_close(m(x), reference(m, x), rtol=1e-5, atol=1e-5)
    assert m.stats["tokens_per_expert"].shape == (3,)
    m.prune_expert(0)
    with pytest.raises(ValueError, match="top_k"):
        m.prune_expert(0)
    with pytest.raises(IndexError):
        m.prune_expert(5)


def test_reset_router_undoes_a_collapse_and_keeps_the_expert():
    m = make(n_experts=4, top_k=2, capacity_factor=0.0)
    with torch.no_grad():
        m.expert_bias[1] = 1.0  # collapsed: every token picks expert 1 (probs are at most 1)
    x = torch.randn(4, 16, D)
    m(x)
    assert m.stats["tokens_per_expert"][1] == 64
    old = {n: p.detach().clone() for n, p in m.named_parameters()}
    router = m.router
    m.reset_router(1)
    assert m.router is router and m.expert_bias[1] == 0  # in place; the others' mean bias
    for name in ("w1", "w2", "w3"):
        torch.testing.assert_close(getattr(m, name), old[name])  # the expert's weights stay
    torch.testing.assert_close(m.router[[0, 2, 3]], old["router"][[0, 2, 3]])
    mean = old["router"][[0, 2, 3]].mean(0)
    assert (m.router[1] - mean).norm() < 0.5 * mean.norm()
    m(x)
    assert 0 < m.stats["tokens_per_expert"][1] < 40  # mid-pack again
    with pytest.raises(IndexError):
        m.reset_router(4)


def test_reinit_dead_expert_gets_traffic():
    m = make(n_experts=4, top_k=2, capacity_factor=0.0)
    with torch.no_grad():
        m.router[3] = 0.0
        m.expert_bias[3] = -2.0  # dead: never selected
    x = torch.randn(4, 16, D)
    m(x)
    m_counts = m.stats["tokens_per_expert"]
    assert m_counts[3] == 0
    old = {n: p.detach().clone() for n, p in m.named_parameters()}
    old_w1 = m.w1
    m.reinit_expert(3)
    assert m.w1 is not old_w1 and m.w1.shape == (4, D, H)  # replaced, same shape
    assert m.expert_bias[3] == 0
    for name in ("w1", "w2", "w3", "router"):
        torch.testing.assert_close(getattr(m, name)[:3], old[name][:3])
        assert not torch.equal(getattr(m, name)[3], old[name][3])
    busiest = int(m_counts[:3].argmax())
    for name in ("w1", "w2", "w3", "router"):  # a copy of the busiest + a little noise
        copy, source = getattr(m, name)[3], old[name][busiest]
        assert (copy - source).norm() < 0.05 * source.norm()
    m(x).sum().backward()
    assert m.stats["tokens_per_expert"][3] > 0
    assert m.w2.grad[3].abs().sum() > 0
