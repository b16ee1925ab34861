"""Model tests: shapes, causality, attention against a reference, counts, init, checkpointing,
KV cache, and logit parity with transformers' LlamaForCausalLM. CPU, tiny configs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trimtab.config import ModelConfig
from trimtab.config.sparse import MoDConfig, MoEConfig
from trimtab.errors import ConfigError
from trimtab.model import KVCache, Transformer, build_model
from trimtab.model.layers import Attention, Rotary, RotaryQKV, group_qkv, split_qkv

V = 97


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    return ModelConfig(**{**base, **kw})


def model(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return build_model(tiny(**kw))


def tokens(B: int = 2, T: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def spread_weights(m: Transformer, std: float = 0.2) -> None:
    """Larger random weights, so attention is far from uniform and errors cannot hide."""
    torch.manual_seed(123)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, std) if p.dim() > 1 else p.uniform_(0.5, 1.5)


# --- forward -------------------------------------------------------------------------------


def test_output_shape_and_dtype():
    out = model()(tokens(3, 11))
    assert out.shape == (3, 11, V) and out.dtype == torch.float32


def test_causal_future_tokens_do_not_change_past_logits():
    m, x = model(), tokens(2, 16)
    spread_weights(m)
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 7) % V
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-3


def test_too_long_raises():
    m = model()
    with pytest.raises(ValueError, match="exceeds"):
        m(tokens(1, 33))
    cache = m.new_cache(1)
    m(tokens(1, 30), cache)
    with pytest.raises(ValueError, match="cache offset 30"):
        m(tokens(1, 3), cache)


def test_build_model_rejects_bad_configs():
    with pytest.raises(ValueError, match="vocab_size"):
        build_model(tiny(vocab_size=0))
    with pytest.raises(ConfigError, match="n_heads"):
        build_model(tiny(n_heads=3))


def rotate_half_reference(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's apply_rotary_pos_emb, written out: x [B, n, T, E], pos [T]."""
    E = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, E, 2, dtype=torch.float64) / E)
    ang = torch.outer(pos.double(), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_attention(attn: Attention, x: torch.Tensor, theta: float) -> torch.Tensor:
    """Explicit softmax attention with K/V heads repeated for each query group."""
    B, T, _ = x.shape
    H, K, E = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = (x @ w.T for w in split_qkv(attn.qkv.weight, H, K))
    q, k, v = (t.view(B, T, -1, E).transpose(1, 2) for t in (q, k, v))
    pos = torch.arange(T)
    q, k = rotate_half_reference(q, pos, theta), rotate_half_reference(k, pos, theta)
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(E)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(B, T, H * E) @ attn.wo.weight.T


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_matches_reference_with_repeated_kv(kv_heads):
    cfg = tiny(n_kv_heads=kv_heads, rope_theta=500.0)
    torch.manual_seed(0)
    attn = Attention(cfg)
    with torch.no_grad():
        attn.qkv.weight.normal_(0, 0.3)
    assert attn.qkv.weight.shape[0] == (4 + 2 * kv_heads) * 16
    x = torch.randn(2, 12, 64)
    rot = Rotary(16, 32, 500.0)
    got = attn(x, rot.table(0, 12), None, None, 0)
    torch.testing.assert_close(got, reference_attention(attn, x, 500.0), rtol=1e-5, atol=1e-5)


def test_rotary_qkv_gradient():
    rot = Rotary(8, 16, 10000.0)
    cos, sin = (t.double() for t in rot.table(3, 5))
    x = torch.randn(2, 5, 2, 2 + 2, 8, dtype=torch.float64, requires_grad=True)  # K=2 groups of G=2
    assert torch.autograd.gradcheck(lambda t: RotaryQKV.apply(t, cos, sin), (x,))


def test_grouped_qkv_layout_round_trips_and_groups_whole_query_groups():
    H, K, E = 6, 2, 3
    q, k, v = (torch.arange(n * E).float().view(n * E, 1) + base for n, base in ((H, 0), (K, 100), (K, 200)))
    grouped = group_qkv(q, k, v, K)
    # each kv head's block: its G = 3 query heads, its key, its value
    assert grouped[: (H // K + 2) * E].flatten().tolist() == [*range(9), 100, 101, 102, 200, 201, 202]
    for a, b in zip(split_qkv(grouped, H, K), (q, k, v)):
        assert torch.equal(a, b)


def test_checkpoints_with_the_old_qkv_layout_load_as_the_same_model(tmp_path):
    """Before the grouped layout, the projection was `attn.wqkv` with q, k, v rows apart: such a
    checkpoint loads into the same function, and its AdamW moments are regrouped with it."""
    from trimtab.checkpoint_load import load_weights
    from trimtab.model.upgrade import upgrade_optimizer

    cfg = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    m = model(**cfg)
    old = {}
    for name, t in m.state_dict().items():
        if "attn.qkv" in name:
            name, t = name.replace("attn.qkv", "attn.wqkv"), torch.cat(split_qkv(t, 4, 2))
        old[name] = t
    fresh = model(seed=1, **cfg)
    load_weights(fresh, old, tmp_path)
    torch.testing.assert_close(fresh(tokens()), m(tokens()))
    names = [n for n, _ in m.named_parameters()]
    i = names.index("blocks.0.attn.qkv.weight")
    moment = old["blocks.0.attn.wqkv.weight"].clone()
    native = {"state": {i: {"exp_avg": moment, "step": torch.tensor(3.0)}}, "param_groups": []}
    upgraded = upgrade_optimizer(native, names, m.cfg)["state"][i]
    assert torch.equal(upgraded["exp_avg"], m.blocks[0].attn.qkv.weight) and upgraded["step"] == 3


# --- parameters, FLOPs, init ---------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_num_params(tie):
    m = model(tie_embeddings=tie)
    unique = {id(p): p.numel() for p in m.parameters()}
    assert m.num_params() == sum(unique.values())
    D, F_, L = 64, 192, 2  # ffn_hidden: int(8 * 64 / 3) = 170 -> 192 (multiple_of 64)
    block = D * (4 + 2 * 2) * 16 + D * D + 3 * D * F_ + 2 * D
    assert m.num_params(exclude_embeddings=True) == L * block + D
    assert m.num_params() == L * block + D + V * D * (1 if tie else 2)


def test_flops_per_token_hand_computed():
    m = model()  # D 64, L 2, H 4, K 2, E 16, F 192, V 97
    matmul = 2 * (64 * 128 + 64 * 64 + 3 * 64 * 192) + 97 * 64
    assert m.flops_per_token(32) == 6 * matmul + 12 * 2 * 64 * 32
    assert m.flops_per_token(32) == 6 * 104_512 + 49_152


def test_init_statistics_and_determinism():
    cfg = dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=0, init_std=0.03)
    m = model(**cfg)
    b = m.blocks[1]
    out_std = 0.03 / math.sqrt(2 * 4)
    for w, std in [
        (b.attn.qkv.weight, 0.03),
        (b.ffn.w1.weight, 0.03),
        (b.ffn.w3.weight, 0.03),
        (m.tok_emb.weight, 0.03),
        (b.attn.wo.weight, out_std),
        (b.ffn.w2.weight, out_std),
    ]:
        assert abs(w.std().item() / std - 1) < 0.05, w.shape
        assert abs(w.mean().item()) < std / 20
    assert all(torch.equal(n.weight, torch.ones(256)) for n in (b.attn_norm, b.ffn_norm, m.norm))
    again = model(**cfg)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), again.parameters()))
    assert not torch.equal(m.tok_emb.weight, model(seed=1, **cfg).tok_emb.weight)


def test_tied_embedding_shares_storage():
    m = model()
    assert m.lm_head.weight is m.tok_emb.weight
    assert m.lm_head.weight.data_ptr() == m.tok_emb.weight.data_ptr()
    untied = model(tie_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()


# --- activation checkpointing --------------------------------------------------------------


def grads(m: Transformer, x: torch.Tensor) -> dict[str, torch.Tensor]:
    m.zero_grad(set_to_none=True)
    F.cross_entropy(m(x).flatten(0, 1), x.flatten(), reduction="sum").backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


class _Matmuls(TorchDispatchMode):
    """Counts the matmuls dispatched while it is on (a backward's recompute included)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default)
        return func(*args, **(kwargs or {}))


CHECKPOINTED_MODELS = {
    "dense": {},
    "moe, grouped, jitter": {
        "layer_pattern": ["moe", "dense"],
        "moe": MoEConfig(n_experts=4, top_k=2, router_jitter=0.1),
    },
    "moe, padded, capacity": {"layer_pattern": ["moe"], "moe": MoEConfig(n_experts=4, top_k=2, n_shared_experts=1)},
    "mod + moe": {
        "layer_pattern": ["moe+mod", "mod"],
        "moe": MoEConfig(n_experts=4, top_k=1),
        "mod": MoDConfig(capacity=0.5),
    },
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", CHECKPOINTED_MODELS)
def test_activation_checkpointing_gives_identical_grads(kind, autocast):
    """full and selective give the gradients of off bit for bit (a block's re-run computes what
    its forward did: the same routing, jitter included); full runs the blocks' matmuls again in the
    backward, selective does not (it keeps their outputs)."""
    m, x = model(**CHECKPOINTED_MODELS[kind]), tokens(2, 16)
    if "padded" in kind:
        for _, moe in m.moe_layers():
            moe.impl = "padded"
    spread_weights(m, 0.1)
    calls, backward_matmuls, out = [], {}, {}
    m.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))
    for mode in ("off", "selective", "full"):
        m.set_activation_checkpointing(mode)
        m.zero_grad(set_to_none=True)
        torch.manual_seed(7)  # the router's jitter
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(m(x).flatten(0, 1).float(), x.flatten(), reduction="sum")
        with _Matmuls() as mm:
            loss.backward()
        backward_matmuls[mode] = mm.count
        out[mode] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert len(calls) == 5  # three forwards, then the block run again by selective and full
    assert backward_matmuls["selective"] == backward_matmuls["off"] < backward_matmuls["full"]
    for mode in ("selective", "full"):
        assert out[mode].keys() == out["off"].keys()
        for name, grad in out["off"].items():
            torch.testing.assert_close(out[mode][name], grad, rtol=0, atol=0, msg=f"{mode}: {name}")


@pytest.mark.slow  # torch.compile: ~10-25 s on a CPU
@pytest.mark.parametrize("kind", ["dense", "moe, grouped, jitter"])
def test_selective_checkpointing_compiles_to_the_eager_gradients(kind):
    """Under torch.compile the selective policy tags the traced graph (the partitioner saves the
    kept ops' outputs); the gradients are eager's, off, to fp32 rounding."""
    m, x = model(**CHECKPOINTED_MODELS[kind]), tokens(2, 16)
    spread_weights(m, 0.1)
    compiled = torch.compile(m)
    out = {}
    for mode, net in (("off", m), ("selective", compiled)):
        m.set_activation_checkpointing(mode)
        m.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        F.cross_entropy(net(x).flatten(0, 1), x.flatten(), reduction="sum").backward()
        out[mode] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    for name, grad in out["off"].items():
        torch.testing.assert_close(out["selective"][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_an_unknown_checkpointing_mode_is_refused_with_the_modes():
    with pytest.raises(ValueError, match="off, selective, full"):
        model().set_activation_checkpointing("partial")


# --- KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "inference"])
def test_kv_cache_prefill_then_decode_matches_full_forward(grad):
    """Without autograd (generation), a decoding step takes layers.decode_attention's path."""
    m, x = model().eval(), tokens(3, 20)
    spread_weights(m)
    full = m(x)
    cache = m.new_cache(3)
    with torch.inference_mode(not grad):
        steps = [m(x[:, :8], cache)] + [m(x[:, t : t + 1], cache) for t in range(8, 20)]
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_kv_cache_chunked_prefill_matches_full_forward():
    m, x = model().eval(), tokens(2, 24)
    spread_weights(m)
    full = m(x)
    cache = KVCache(2, 2, 2, 32, 16, torch.float32, "cpu")
    chunks = [m(x[:, a:b], cache) for a, b in [(0, 5), (5, 9), (9, 16), (16, 17), (17, 24)]]
    torch.testing.assert_close(torch.cat(chunks, 1), full, rtol=1e-5, atol=1e-5)
    cache.reset()
    torch.testing.assert_close(m(x[:, :6], cache), full[:, :6], rtol=1e-5, atol=1e-5)


# --- parity with transformers --------------------------------------------------------------


def to_llama(m: Transformer):
    transformers = pytest.importorskip("transformers")
    cfg = m.cfg
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {
        "model.embed_tokens.weight": m.tok_emb.weight,
        "model.norm.weight": m.norm.weight,
        "lm_head.weight": m.lm_head.weight,
    }
    for i, b in enumerate(m.blocks):
        p = f"model.layers.{i}."
        q, k, v = split_qkv(b.attn.qkv.weight, cfg.n_heads, cfg.n_kv_heads)
        state.update(
            {
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": b.attn.wo.weight,
                p + "mlp.gate_proj.weight": b.ffn.w1.weight,
                p + "mlp.up_proj.weight": b.ffn.w3.weight,
                p + "mlp.down_proj.weight": b.ffn.w2.weight,
                p + "input_layernorm.weight": b.attn_norm.weight,
                p + "post_attention_layernorm.weight": b.ffn_norm.weight,
            }
        )
    hf.load_state_dict(state, strict=True)
    return hf


@pytest.mark.parametrize("tie,kv_heads,theta", [(True, 2, 10000.0), (False, 4, 500.0)])
def test_logits_match_llama(tie, kv_heads, theta):
    m = model(tie_embeddings=tie, n_kv_heads=kv_heads, rope_theta=theta, norm_eps=1e-6)
    spread_weights(m, 0.1)
    hf = to_llama(m)
    x = tokens(3, 32)
    with torch.no_grad():
        ours, ref = m(x), hf(input_ids=x).logits
    assert ref.abs().max() > 1.0  # weights large enough that a rotary mismatch would show
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("autocast", [True, False])
def test_swiglu_keeps_a_third_less_with_autograds_own_gradients(autocast):
    """SwiGLU keeps w1's and w3's outputs, their product and its input cast once (CastTwice,
    SiluMul), where the plain ops keep silu's output too and, under autocast, a second cast of
    the input: N x (f + h) x 2 bytes less in bf16, N x f x 4 in fp32. The gradients are the
    plain ops' to the bit."""
    from trimtab.model.layers import SwiGLU

    torch.manual_seed(0)
    layer, (n, h, f) = SwiGLU(64, 160), (4 * 12, 64, 160)
    x = torch.randn(4, 12, h, requires_grad=True)

    def plain(x: torch.Tensor) -> torch.Tensor:
        return layer.w2(F.silu(layer.w1(x)) * layer.w3(x))

    kept, grads = [], []
    for forward in (layer, plain):
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor, storages: dict[int, int] = storages) -> torch.Tensor:
            if t.dim() == 3 or t.shape[0] == n:  # activations (or their [n, .] views), not weights
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = forward(x * 1.0)  # not a leaf, as in a model: autocast caches a leaf's cast
        out.float().square().sum().backward()
        kept.append(sum(storages.values()))
        grads.append([t.grad.clone() for t in (x, layer.w1.weight, layer.w3.weight, layer.w2.weight)])
        for t in (x, *layer.parameters()):
            t.grad = None
    assert [torch.equal(a, b) for a, b in zip(*grads, strict=True)] == [True] * 4
    assert kept[1] - kept[0] == (n * (f + h) * 2 if autocast else n * f * 4), kept


def test_unpermute_is_index_copy_without_keeping_the_rows():
    """The experts' output rows back in assignment order (zeros where dropped): index_copy's values
    and gradient, but its backward keeps the index only, where index_copy keeps the rows too."""
    from trimtab.model.moe import Unpermute

    torch.manual_seed(0)
    rows, order = torch.randn(6, 8, requires_grad=True), torch.tensor([5, 0, 3, 7, 1, 2])  # 2 of 8 dropped
    weight = torch.randn(8, 8)
    results, kept = [], []
    for unpermute in (lambda r: Unpermute.apply(r, order, 8), lambda r: r.new_zeros(8, 8).index_copy(0, order, r)):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            out = unpermute(rows * 1.0)
        (out * weight).sum().backward()
        results.append((out.detach(), rows.grad.clone()))
        kept.append(sum(t.numel() * t.element_size() for t in saved if t.is_floating_point()))
        rows.grad = None
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][0][[4, 6]].eq(0).all()  # the dropped assignments
    assert kept == [0, 6 * 8 * 4]
